"""Train a small GPT-style LM on synthetic tokens from a DeepSpeed JSON config.

    python examples/train.py --deepspeed_config examples/configs/zero2.json

The loop is DeepSpeed's, with one import changed. With no TPU it runs on 8 virtual CPU
devices (set CPU_NUM_DEVICES for another count).
"""

from __future__ import annotations

import argparse
import os
import sys

import spmdzero  # first: starts the XLA runtime in SPMD mode
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import SyntheticTokens, TinyGPT  # noqa: E402

from spmdzero.observe.reports import model_state_bytes  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", required=True, help="path to a DeepSpeed JSON config")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps to train")
    parser.add_argument("--samples", type=int, default=2048, help="synthetic sequences in the dataset")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    model = TinyGPT(args.vocab_size, args.seq_len, args.d_model, n_layers=args.layers)
    dataset = SyntheticTokens(args.samples, args.seq_len, args.vocab_size)
    engine, _, loader, _ = spmdzero.initialize(args=args, model=model, training_data=dataset)
    num_params = sum(p.numel() for p in model.parameters())
    mesh = " x ".join(f"{n}={s}" for n, s in engine.plan.mesh_shape)  # the plan: pure data, either backend
    # the batch numbers were said by initialize (its "batch rule" lines)
    print(f"spmdzero: ZeRO stage {engine.zero_optimization_stage()}, mesh {mesh}, {num_params:,} params", flush=True)

    # The engine logs DeepSpeed-style lines every steps_per_print optimizer steps, above the bar.
    bar = progress_bar(args.steps)
    losses = []  # device tensors, read once at the end: reading each step would stall it
    while engine.global_steps < args.steps:  # epochs
        for tokens, targets in loader:
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            if bar is not None:
                bar.update(engine.global_steps - bar.n)
            if engine.global_steps >= args.steps:
                break
    if bar is not None:
        bar.close()
    summary(engine, torch.stack(losses).float().cpu().tolist(), args)


def progress_bar(total: int):
    """A tqdm bar of optimizer steps (none without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="training", unit="step", dynamic_ncols=True)


def sparkline(values: list[float], width: int = 60) -> str:
    """The loss curve in one line of text."""
    marks = "▁▂▃▄▅▆▇█"
    step = max(1, len(values) // width)
    points = [sum(values[i:i + step]) / len(values[i:i + step]) for i in range(0, len(values), step)]
    low, high = min(points), max(points)
    return "".join(marks[int((v - low) / (high - low + 1e-12) * (len(marks) - 1))] for v in points)


def summary(engine, losses: list[float], args) -> None:
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {engine.micro_steps} micro-steps "
          f"({engine.global_steps} optimizer steps, {engine.skipped_steps} skipped)")
    print(f"  {sparkline(losses)}")
    num_params = sum(p.numel() for p in engine.module.parameters())
    n = dict(engine.plan.mesh_shape)["fsdp"]
    table = [f"per-device bytes of model states by ZeRO stage (measured from live shardings, P={num_params:,}, "
             f"fsdp={n}; * = this run):",
             f"  {'stage':<8}{'params':>12}{'grads':>12}{'opt states':>12}{'fp32 master':>12}{'total':>12}  bytes/param"]
    config = dict(engine.config)
    for stage in (0, 1, 2):
        if stage == engine.zero_optimization_stage():
            mem = model_state_bytes(engine)
        else:  # a fresh engine for the other stages: measured the same way, nothing trained
            config["zero_optimization"] = {"stage": stage}
            other, *_ = spmdzero.initialize(model=TinyGPT(args.vocab_size, args.seq_len, args.d_model,
                                                          n_layers=args.layers), config=config)
            mem = model_state_bytes(other)
        mark = "*" if stage == engine.zero_optimization_stage() else " "
        table.append(f"  {mark}{stage:<7}{mem.params:>12,}{mem.grads:>12,}{mem.optimizer_states:>12,}"
                     f"{mem.master_weights:>12,}{mem.total:>12,}  {mem.total / num_params:5.2f}")
    print("\n".join(table), flush=True)  # whole: built first, as the other engines are built


if __name__ == "__main__":
    main()
