"""What a host read in the forward costs on the torchax backend: the step time of a model whose
forward reads a value (its programs run eagerly, ``spmdzero/backends/torchax/engine/host_reads.py``)
over the same model's compiled step, on 8 CPU devices, ZeRO-2, fp32, AdamW.

    python benchmarks/host_reads.py                  # both cases, 20 timed steps each
    python benchmarks/host_reads.py --cases gpt2 --steps 10

The read is a guard many training codes carry, ``if not torch.isfinite(loss): raise``, in a
wrapper around the model: the model and its math are the same with it and without it, so the
ratio is the eager dispatch alone. Cases: ``mlp``, 4 x Linear(256, 256) + GELU on 64 rows;
``gpt2``, a transformers GPT-2 built from its config (2 layers, n_embd 64, 4 heads, vocabulary
1024, 8 x 64 tokens). Each variant is warmed up (its compiles and the eager ops' first
dispatches) and then timed step by step; the median step is reported, the two variants
interleaved so that the host's load hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class Guarded(torch.nn.Module):
    """The model, its loss checked on the host before it is returned."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()}")
        return out


def build(case: str):
    """(module returning its loss, its inputs as keyword arguments)."""
    torch.manual_seed(0)
    if case == "mlp":
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
        net = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10))

        class WithLoss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = net

            def forward(self, x):
                return self.net(x).pow(2).mean()

        return WithLoss(), {"x": torch.randn(64, 256)}
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1024, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    tokens = torch.randint(0, 1024, (8, 64))
    return GPT2LMHeadModel(config), {"input_ids": tokens, "labels": tokens}


def engine_for(case: str, guarded: bool):
    import spmdzero

    model, inputs = build(case)
    rows = next(iter(inputs.values())).shape[0]
    engine, *_ = spmdzero.initialize(model=Guarded(model) if guarded else model, config={
        "train_batch_size": rows, "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    return engine, inputs


def step(engine, inputs) -> float:
    start = time.perf_counter()
    out = engine(**inputs)
    engine.backward(out if hasattr(out, "backward") else out.loss)
    engine.step()
    engine._step_loss.block_until_ready()  # the step's work done, not only dispatched
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mlp,gpt2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(f"{'case':<6} {'compiled ms':>12} {'eager ms':>10} {'eager / compiled':>17}")
    for case in args.cases.split(","):
        variants = {name: engine_for(case, name == "eager") for name in ("compiled", "eager")}
        for engine, inputs in variants.values():
            for _ in range(args.warmup):
                step(engine, inputs)
        times: dict = {name: [] for name in variants}
        for _ in range(args.steps):
            for name, (engine, inputs) in variants.items():
                times[name].append(step(engine, inputs))
        assert variants["eager"][0].host_reads.noted and not variants["compiled"][0].host_reads.noted
        compiled, eager = (statistics.median(times[n]) * 1e3 for n in ("compiled", "eager"))
        print(f"{case:<6} {compiled:>12.1f} {eager:>10.1f} {eager / compiled:>16.1f}x")


if __name__ == "__main__":
    main()
