"""spmdzero against the alternatives, on CPU virtual devices, in one run.

    python benchmarks/compare.py [--devices 2,4,8] [--widths 256,512] [--steps 5] [--repeats 3]

For each device count N (a child process each: the device count is fixed per process) and
each model size (an MLP of 4 square layers, AdamW, batch 2 per device), it measures:

* spmdzero ZeRO stages 0, 1, 2;
* a hand-written SPMD ZeRO-2 loop with the same annotations;
* torch_xla's FSDPv2 (ZeRO-3 through SPMD);
* the same model and AdamW in JAX/optax, with ZeRO-2 shardings (jax.sharding).

Columns: persistent per-device bytes of model states (measured from the live arrays'
shards), bytes each device sends per step in the compiled program (ring model) over the
data-parallel minimum 2(N-1)/N x P x 4, step time relative to stage 0 and to the
hand-written loop (median of interleaved repeats), compiles during timing, and the time to
the first step (a cold compile). It prints one table and writes benchmarks/results.md.

What CPU timings can say: how much work each device does and whether anything recompiles.
What they cannot: TPU step times. XLA:CPU has no reduce-scatter (it all-reduces and slices),
and 8 "devices" share this machine's cores. Collective counts and bytes carry over to TPU;
absolute times do not.

The torch_xla backend's benchmark (`SPMDZERO_BACKEND=torch_xla`): its hand-written loop and
FSDPv2 are torch_xla's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("SPMDZERO_BACKEND", "torch_xla")  # the torch_xla backend's benchmark (its children inherit it)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VARIANTS = ["stage 0", "stage 1", "stage 2", "hand ZeRO-2", "FSDPv2", "JAX ZeRO-2"]


# ---- child: one device count -----------------------------------------------------------------------

def child(widths: list[int], steps: int, repeats: int) -> None:
    import spmdzero  # noqa: F401  (starts the runtime with CPU_NUM_DEVICES devices)
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    for width in widths:
        runners = {}
        for name in VARIANTS:
            start = time.perf_counter()
            runner = make_runner(name, width, n)
            runner.step()
            runner.wait()
            runners[name] = (runner, time.perf_counter() - start)
        for runner, _ in runners.values():  # warm-up: every program compiled
            runner.step()
            runner.wait()
        times = {name: [] for name in VARIANTS}
        compiles = {name: 0 for name in VARIANTS}
        for _ in range(repeats):
            for name, (runner, _) in runners.items():
                before = runner.compiles()
                start = time.perf_counter()
                for _ in range(steps):
                    runner.step()
                runner.wait()
                times[name].append((time.perf_counter() - start) / steps)
                compiles[name] += runner.compiles() - before
        for name, (runner, first) in runners.items():
            print(json.dumps({"devices": n, "width": width, "variant": name, "params": runner.params,
                              "bytes": runner.state_bytes(), "traffic": runner.traffic(),
                              "step": statistics.median(times[name]), "compiles": compiles[name],
                              "first_step": first}), flush=True)


def make_runner(name: str, width: int, n: int):
    if name.startswith("stage"):
        return EngineRunner(int(name[-1]), width, n)
    return {"hand ZeRO-2": HandRunner, "FSDPv2": FsdpRunner, "JAX ZeRO-2": JaxRunner}[name](width, n)


def mlp(width: int):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


class TorchRunner:
    def compiles(self) -> int:
        from spmdzero.observe.monitor import compile_count

        return compile_count()

    def wait(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def _traffic_of(self, outputs, n: int) -> float:
        import torch_xla.core.xla_model as xm

        from spmdzero.tpu.report import CollectivesReport
        from spmdzero.tpu.capture import compile_mlir

        result = compile_mlir(xm.get_stablehlo(outputs), f"cpu:{n}")
        return CollectivesReport(n, result["collectives"], self.params * 4).total_traffic


class EngineRunner(TorchRunner):
    def __init__(self, stage: int, width: int, n: int):
        import torch

        import spmdzero
        from spmdzero.backends.torch_xla.batches import to_device_sharded

        self.n = n
        self.engine, *_ = spmdzero.initialize(model=mlp(width), config={
            "train_batch_size": 2 * n, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}})
        self.params = sum(p.numel() for p in self.engine.module.parameters())
        self.x = to_device_sharded(torch.randn(2 * n, width), self.engine.mesh, self.engine.plan.batch_spec, n)

    def step(self) -> None:
        self.engine.backward(self.engine(self.x).pow(2).mean())
        self.engine.step()

    def state_bytes(self) -> int:
        from spmdzero.observe.reports import model_state_bytes

        return model_state_bytes(self.engine).total

    def traffic(self) -> float:
        return self.engine.collectives_report(self.x, loss_fn=lambda out: out.pow(2).mean()).total_traffic


class HandRunner(TorchRunner):
    """The annotations spmdzero writes, by hand: torch.optim.AdamW, grads reduce-scattered."""

    def __init__(self, width: int, n: int):
        sys.path.insert(0, HERE)
        import torch
        from step_time import HandWrittenRunner

        self.inner = HandWrittenRunner(mlp(width), 2 * n, width)
        self.params = sum(p.numel() for p in self.inner.params)
        self.n = n
        self._torch = torch

    def step(self) -> None:
        self.inner.step()

    def state_bytes(self) -> int:
        from spmdzero.observe.reports import per_device_bytes

        states = [v for p in self.inner.params for v in self.inner.opt.state[p].values()
                  if isinstance(v, self._torch.Tensor) and v.device.type == "xla"]
        return sum(per_device_bytes(t) for t in list(self.inner.params) + states)

    def traffic(self) -> float:
        import torch_xla

        loss = self.inner.trace()
        states = [v for p in self.inner.params for v in self.inner.opt.state[p].values()
                  if isinstance(v, self._torch.Tensor) and v.device.type == "xla"]
        traffic = self._traffic_of([loss] + list(self.inner.params) + states, self.n)
        torch_xla.sync()  # execute the traced step: one more training step
        return traffic


class FsdpRunner(TorchRunner):
    def __init__(self, width: int, n: int):
        import numpy as np
        import torch
        import torch_xla
        import torch_xla.distributed.spmd as xs
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        self.mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
        self.model = SpmdFullyShardedDataParallel(mlp(width).to(torch_xla.device()), mesh=self.mesh)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
        self.x = torch.randn(2 * n, width).to(torch_xla.device())
        xs.mark_sharding(self.x, self.mesh, ("fsdp", None))
        self.n = n

    def _trace(self):
        loss = self.model(self.x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def step(self) -> None:
        import torch_xla

        self._trace()
        torch_xla.sync()

    def state_bytes(self) -> int:
        import torch

        from spmdzero.observe.reports import per_device_bytes

        states = [v for s in self.opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.device.type == "xla"]
        return sum(per_device_bytes(t) for t in list(self.model.parameters()) + states)

    def traffic(self) -> float:
        import torch

        loss = self._trace()
        outputs = [loss] + list(self.model.parameters()) + [v for s in self.opt.state.values() for v in s.values()
                                                            if isinstance(v, torch.Tensor) and v.device.type == "xla"]
        traffic = self._traffic_of(outputs, self.n)
        self.step()  # execute the traced step (nothing is lost: it is one more training step)
        return traffic


class JaxRunner:
    """The same MLP and AdamW in JAX/optax: params replicated, gradients and optimizer state
    sharded along 'fsdp' like spmdzero's ZeRO-2, batch sharded."""

    def __init__(self, width: int, n: int):
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        devices = jax.devices("cpu")[:n]
        mesh = Mesh(np.array(devices), ("fsdp",))
        self.n = n
        rep, rows, cols = NamedSharding(mesh, P()), NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P("fsdp", None))
        key = jax.random.PRNGKey(0)
        params = []
        for _ in range(4):
            key, k1 = jax.random.split(key)
            params.append({"w": jax.random.normal(k1, (width, width)) / np.sqrt(width), "b": jnp.zeros(width)})
        zero = lambda leaf: cols if leaf.ndim == 2 else rows  # noqa: E731  (ZeRO spec: shard the first dim)
        self.tx = optax.adamw(1e-3, weight_decay=0.01)
        self.weights = jax.device_put(params, rep)
        self.opt_state = jax.jit(self.tx.init, out_shardings=None)(self.weights)
        self.opt_state = jax.tree.map(lambda a: jax.device_put(a, zero(a) if a.ndim else rep), self.opt_state)
        self.x = jax.device_put(jax.random.normal(key, (2 * n, width)), cols)
        self.params = sum(p.size for layer in params for p in layer.values())

        def loss_fn(params, x):
            for layer in params:
                x = jnp.tanh(x @ layer["w"].T + layer["b"])
            return jnp.mean(x ** 2)

        from jax_zero2 import zero2_train_step

        self._step = zero2_train_step(loss_fn, self.tx, zero, rep, self.opt_state)
        self.jax = jax

    def step(self) -> None:
        self.weights, self.opt_state, self.loss = self._step(self.weights, self.opt_state, self.x)

    def wait(self) -> None:
        self.jax.block_until_ready(self.weights)

    def compiles(self) -> int:
        return self._step._cache_size()

    def state_bytes(self) -> int:
        leaves = self.jax.tree.leaves((self.weights, self.opt_state))
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves if hasattr(leaf, "addressable_shards"))

    def traffic(self) -> float:
        from spmdzero.tpu.report import CollectivesReport
        from spmdzero.tpu.collectives import summarize_collectives

        text = self._step.lower(self.weights, self.opt_state, self.x).compile().as_text()
        return CollectivesReport(self.n, summarize_collectives(text, cpu_program=True), self.params * 4).total_traffic


# ---- parent: all device counts, one table -----------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--widths", default="256,512")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results.md"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.child:
        child(widths, args.steps, args.repeats)
        return
    rows = []
    for n in (int(d) for d in args.devices.split(",")):
        env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(n), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"}
        command = [sys.executable, __file__, "--child", "--widths", args.widths, "--steps", str(args.steps),
                   "--repeats", str(args.repeats)]
        out = subprocess.run(command, env=env, cwd=REPO, check=True, capture_output=True, text=True).stdout
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    table = render(rows)
    print(table)
    with open(args.out, "w") as f:
        f.write(f"Measured with `python benchmarks/compare.py --devices {args.devices} --widths {args.widths} "
                f"--steps {args.steps} --repeats {args.repeats}`\n\n{table}\n")


def render(rows: list[dict]) -> str:
    head = ("| N | params | variant | model-state bytes/device | bytes/param | sent/step vs 2(N-1)/N·P·4 "
            "| step time vs stage 0 | vs hand ZeRO-2 | compiles while timed | first step (s) |")
    lines = [head, "|" + "---|" * 10]
    for (n, width) in sorted({(r["devices"], r["width"]) for r in rows}):
        group = {r["variant"]: r for r in rows if r["devices"] == n and r["width"] == width}
        base, hand = group["stage 0"]["step"], group["hand ZeRO-2"]["step"]
        for name in VARIANTS:
            r = group[name]
            minimum = 2 * (n - 1) / n * r["params"] * 4
            traffic = f"{r['traffic'] / minimum:.2f}"
            lines.append(f"| {n} | {r['params']:,} | {name} | {r['bytes']:,} | {r['bytes'] / r['params']:.2f} | "
                         f"{traffic} | {r['step'] / base:.2f} | {r['step'] / hand:.2f} | {r['compiles']} | "
                         f"{r['first_step']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
