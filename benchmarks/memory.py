"""Device memory of the default (torchax) backend against ZeRO's accounting, on 8 CPU devices.

    python benchmarks/memory.py                    # the table in docs/benchmarks.md
    python benchmarks/memory.py --width 256 --steps 6

For an MLP of P parameters (``--width`` w: Linear(w, 2w), Linear(2w, w); w=512 gives P =
1.05M), AdamW, 2 micro-steps per optimizer step, and each ZeRO stage and precision (fp32 at
stages 0, 1, 2; bf16 at stage 2, with fp32 masters and with bf16 ones, "bf16-masters":
``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``), it trains ``--steps`` micro-steps twice: with the loss
computed inside the module (``engine(x, y)`` returns it) and outside it (``loss =
mse(engine(x), y)``). After every ``engine.step()`` (between micro-steps, and right after each
optimizer step) it waits for the dispatched programs (``engine.wait()``) and sums the bytes
that every live JAX array holds on one device, the arrays that existed before the engine
excepted (``spmdzero.observe.reports.live_device_bytes``): the parameters, gradients, master
weights and optimizer states, and whatever else is still alive (outputs the loop keeps, inputs,
arrays waiting to be released). It measures the same between each forward and its backward (a
gradient waiting for its backward; with the loss outside, the forward's VJP and its
activations). It prints per stage and precision the most of each, ZeRO's accounting per device (16P, 8P + 8P/N, 4P + 12P/N at stages 0, 1, 2; 2P + 14P/N for bf16 at
stage 2, 2P + 6P/N with bf16 masters and states, read from the engine's ``sharding_report().zero_accounting()``) and the ratios.
"""

from __future__ import annotations

import argparse
import sys

import torch

CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (2, "bf16-masters")]
N = 8  # CPU devices: spmdzero's default when imported


def mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, width))


class WithLoss(torch.nn.Module):
    """The loss inside the module: the engine's fused training program takes its gradient."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x).float(), y)


def config(stage: int, precision: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    if precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if precision == "bf16-masters":  # DeepSpeed 0.19's bf16 master weights and optimizer states
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return cfg


def measure(stage: int, precision: str, loss_inside: bool, width: int = 512, steps: int = 4) -> dict:
    """Train ``steps`` micro-steps; the most bytes held on one device after any step and
    between any forward and its backward, the accounting, and P."""
    import jax
    import spmdzero
    from spmdzero.observe.reports import live_device_bytes

    before = jax.live_arrays()
    net = mlp(width)
    engine, *_ = spmdzero.initialize(model=WithLoss(net) if loss_inside else net, config=config(stage, precision))
    generator = torch.Generator().manual_seed(1)
    held, waiting = [], []
    for _ in range(steps):
        x, y = torch.randn(2 * N, width, generator=generator), torch.randn(2 * N, width, generator=generator)
        if loss_inside:
            loss = engine(x, y)
        else:
            loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.wait()
        waiting.append(live_device_bytes(exclude=before))
        engine.backward(loss)
        engine.step()
        engine.wait()
        held.append(live_device_bytes(exclude=before))
    accounting = engine.sharding_report().zero_accounting()["total"]
    params = sum(p.numel() for p in net.parameters())
    del engine, loss
    return {"held": max(held), "waiting": max(waiting), "accounting": accounting, "P": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4, help="micro-steps per run (2 per optimizer step)")
    args = parser.parse_args()
    rows = [("stage", "precision", "loss", "held after step", "ratio", "held before backward", "ratio",
             "ZeRO accounting")]
    params = None
    for stage, precision in CASES:
        for inside in (True, False):
            got = measure(stage, precision, inside, args.width, args.steps)
            params = got["P"]
            rows.append((str(stage), precision, "inside" if inside else "outside", f"{got['held']:,}",
                         f"{got['held'] / got['accounting']:.3f}", f"{got['waiting']:,}",
                         f"{got['waiting'] / got['accounting']:.3f}", f"{got['accounting']:,.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"P = {params:,} parameters, {N} devices, AdamW, 2 micro-steps per step, "
          f"{args.steps} micro-steps; bytes per device, the most held after any engine.step() and between any "
          "forward and its backward")
    print("| " + " | ".join(c.ljust(w) for c, w in zip(rows[0], widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
