"""ZeRO-3 step time against ZeRO-2 on the torchax backend, side by side in one run.

    python benchmarks/zero3_step_time.py                 # 8 CPU devices by default
    python benchmarks/zero3_step_time.py --steps 20 --repeats 7

Stage 3 lays the parameters out sharded and gathers each where the step uses it (in the forward,
and again in the backward); stage 2 keeps them replicated. On a host-bound model (small: the
step is mostly dispatch and the engine's own work) the ratio says what stage 3 adds per step
besides the gathers' bytes. Two models: a tiny GPT-2 (transformers, 2 layers) and an MLP.

Runs are interleaved (stage 2, stage 3, stage 2, ...), each a block of steps ended by one host
read; the median of the repeats is reported with min and max. Recompiles during the timing are
counted (the engine's traced programs) and must be 0. CPU timings say how much work each device
does; they do not predict TPU step times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import spmdzero  # noqa: E402  (starts the runtime)
import torch  # noqa: E402


def tiny_gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": tokens, "labels": tokens}, lambda out: out.loss


def mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256))
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    return model, {"input": x}, lambda out: out.pow(2).mean()


MODELS = {"tiny GPT-2 (2 x 64)": tiny_gpt2, "MLP 256-512-256": mlp}


class Runner:
    def __init__(self, make, stage: int):
        model, self.batch, self.loss = make()
        self.engine, *_ = spmdzero.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}})

    def steps(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = self.loss(self.engine(**self.batch) if "input" not in self.batch else
                             self.engine(self.batch["input"]))
            self.engine.backward(loss)
            self.engine.step()
        loss.item()  # one host read: the block's steps have run
        return (time.perf_counter() - start) / n

    def traces(self) -> int:
        return sum(self.engine.traces.values())


def compare(name: str, make, steps: int, repeats: int) -> None:
    two, three = Runner(make, 2), Runner(make, 3)
    for runner in (two, three):  # warm-up: trace and compile
        runner.steps(3)
    traced = two.traces(), three.traces()
    times = {2: [], 3: []}
    for _ in range(repeats):
        times[2].append(two.steps(steps))
        times[3].append(three.steps(steps))
    recompiles = two.traces() - traced[0] + three.traces() - traced[1]
    m2, m3 = statistics.median(times[2]), statistics.median(times[3])
    print(f"{name:<22} stage 2 {m2 * 1e3:7.2f} ms (min {min(times[2]) * 1e3:.2f}, max {max(times[2]) * 1e3:.2f})  "
          f"stage 3 {m3 * 1e3:7.2f} ms (min {min(times[3]) * 1e3:.2f}, max {max(times[3]) * 1e3:.2f})  "
          f"stage 3 / stage 2 = {m3 / m2:.3f}  (recompiles during timing: {recompiles})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    args = parser.parse_args()
    import jax

    print(f"{jax.device_count()} {jax.devices()[0].platform} devices, {args.repeats} repeats of {args.steps} steps")
    for name in args.models.split(","):
        compare(name, MODELS[name], args.steps, args.repeats)


if __name__ == "__main__":
    main()
