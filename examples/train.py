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

from spmdzero.inspect import model_state_bytes  # noqa: E402


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
    mesh = " x ".join(f"{n}={s}" for n, s in zip(engine.mesh.axis_names, engine.mesh.mesh_shape))
    print(f"spmdzero: ZeRO stage {engine.zero_optimization_stage()}, mesh {mesh}, {num_params:,} params, "
          f"train_batch_size={engine.train_batch_size()} (micro {engine.train_micro_batch_size_per_gpu()} x "
          f"{engine.dp_world_size} devices x {engine.gradient_accumulation_steps()} accumulation)")

    # The engine logs DeepSpeed-style lines every steps_per_print optimizer steps.
    while engine.global_steps < args.steps:  # epochs
        for tokens, targets in loader:
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            if engine.global_steps >= args.steps:
                break
    print(f"final loss {loss.item():.4f} after {engine.global_steps} steps ({engine.skipped_steps} skipped)")

    mem = model_state_bytes(engine)
    n = dict(zip(engine.mesh.axis_names, engine.mesh.mesh_shape))["fsdp"]
    print(f"per-device bytes of model states (measured from live shardings, P={num_params:,}, fsdp={n}):")
    for name, value in (("params", mem.params), ("grads", mem.grads), ("optimizer states", mem.optimizer_states),
                        ("fp32 master weights", mem.master_weights), ("total", mem.total)):
        print(f"  {name:<20}{value:>12,} B  ({value / num_params:5.2f} bytes/param)")
    print(f"  (stage 0 would hold 16 bytes/param = {16 * num_params:,} B)")


if __name__ == "__main__":
    main()
