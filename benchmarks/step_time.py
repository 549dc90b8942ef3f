"""Step-time ratios on CPU virtual devices, measured side by side in one run.

    python benchmarks/step_time.py            # 8 CPU devices by default

1. spmdzero ZeRO-2 vs a hand-written SPMD loop with the same annotations (target <= 1.05):
   the engine's overhead over the bare annotations.
2. ZeRO-2 vs ZeRO-0 on an optimizer-heavy model (target <= 0.5): each device updates
   1/N of the states instead of all of them.

Runs are interleaved (A, B, A, B, ...) and the median of the repeats is reported, so
machine noise hits both sides alike. CPU timings say how much work each device does;
they do not predict TPU step times.

The torch_xla backend's benchmark (`SPMDZERO_BACKEND=torch_xla`): its hand-written loop is
torch_xla's. The torchax backend's step is measured by trace_overhead.py.
"""

from __future__ import annotations

import os
import argparse
import statistics
import time

os.environ.setdefault("SPMDZERO_BACKEND", "torch_xla")  # the torch_xla backend's benchmark (its children inherit it)

import spmdzero  # noqa: F401  (starts the runtime)
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs

from hand_zero2 import zero2_adamw
from spmdzero.backends.torch_xla.annotate import shard
from spmdzero.backends.torch_xla.batches import to_device_sharded


def mlp(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def config(stage: int, batch: int) -> dict:
    return {"train_batch_size": batch, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}


class EngineRunner:
    def __init__(self, model, stage, batch, width):
        self.engine, *_ = spmdzero.initialize(model=model, config=config(stage, batch))
        # placed on the device once, as the hand-written loop does: time the step, not input transfer
        self.x = to_device_sharded(torch.randn(batch, width), self.engine.mesh, self.engine.plan.batch_spec,
                                   int(self.engine.mesh.size()))

    def step(self):
        loss = self.engine(self.x).pow(2).mean()
        self.engine.backward(loss)
        self.engine.step()


class HandWrittenRunner:
    """The same ZeRO-2 annotations written out by hand: no engine, torch.optim.AdamW.

    It annotates through ``spmdzero.backends.torch_xla.annotate.shard`` (torch_xla's annotation without the
    per-call torchax import probe), so the ratio measures the engine, not that probe."""

    def __init__(self, model, batch, width):
        import numpy as np

        n = torch_xla.runtime.global_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
        self.model = model.to(torch_xla.device())
        self.opt, self.params, self.specs = zero2_adamw(self.model, self.mesh, lr=1e-3)
        self.x = xm.send_cpu_data_to_device([torch.randn(batch, width)], torch_xla.device(),
                                            xs.ShardingSpec(self.mesh, ("fsdp", None)))[0]
        torch_xla.sync()

    def step(self):
        self.trace()
        torch_xla.sync()

    def trace(self):
        """One step, traced and not yet executed (the caller syncs, or exports it)."""
        loss = self.model(self.x).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p, spec in zip(self.params, self.specs):
                shard(p.grad, self.mesh, (None,) * p.dim())
                p.grad = p.grad.clone()
                shard(p.grad, self.mesh, spec)
            norm = torch.sqrt(sum((p.grad * p.grad).sum() for p in self.params))
            coef = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
            for p in self.params:
                p.grad.mul_(coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for p, spec in zip(self.params, self.specs):
            shard(p, self.mesh, (None,) * p.dim())
            shard(self.opt.state[p]["exp_avg"], self.mesh, spec)
            shard(self.opt.state[p]["exp_avg_sq"], self.mesh, spec)
        return loss


def time_steps(runner, steps: int) -> float:
    xm.wait_device_ops()
    start = time.perf_counter()
    for _ in range(steps):
        runner.step()
    xm.wait_device_ops()
    return (time.perf_counter() - start) / steps


def compare(name: str, a, b, steps: int, repeats: int, target: float) -> None:
    for runner in (a, b):  # warm-up: compile both programs
        for _ in range(3):
            runner.step()
    compiles = met.metric_data("CompileTime")[0]
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(time_steps(a, steps))
        tb.append(time_steps(b, steps))
    recompiled = met.metric_data("CompileTime")[0] - compiles
    ma, mb = statistics.median(ta), statistics.median(tb)
    verdict = "meets" if ma / mb <= target else "misses"
    print(f"{name:<46} {ma * 1e3:9.2f} ms / {mb * 1e3:9.2f} ms = {ma / mb:5.3f}  "
          f"(target <= {target}: {verdict}; recompiles during timing: {recompiled})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heavy-width", type=int, default=1024)
    parser.add_argument("--heavy-depth", type=int, default=4)
    args = parser.parse_args()
    n = torch_xla.runtime.global_runtime_device_count()
    print(f"{n} CPU virtual devices; median of {args.repeats} interleaved repeats of {args.steps} steps\n")

    width, depth, batch = 256, 4, 64
    compare("spmdzero ZeRO-2 / hand-written SPMD ZeRO-2",
            EngineRunner(mlp(width, depth), 2, batch, width), HandWrittenRunner(mlp(width, depth), batch, width),
            args.steps, args.repeats, target=1.05)

    width, depth, batch = args.heavy_width, args.heavy_depth, 8  # tiny batch: the optimizer dominates
    compare("ZeRO-2 / ZeRO-0, optimizer-heavy model",
            EngineRunner(mlp(width, depth), 2, batch, width), EngineRunner(mlp(width, depth), 0, batch, width),
            args.steps, args.repeats, target=0.5)


if __name__ == "__main__":
    main()
