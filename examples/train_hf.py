"""A Hugging Face transformers model, built from its config (random init, nothing
downloaded), trained unchanged under spmdzero from a DeepSpeed config.

    pip install 'spmdzero[hf]'
    python examples/train_hf.py --deepspeed_config examples/configs/zero2.json --steps 20
"""

from __future__ import annotations

import argparse
import os
import sys

import spmdzero  # first: starts the XLA runtime in SPMD mode
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import SyntheticTokens  # noqa: E402


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # the model users already have, as it is
    dataset = SyntheticTokens(2048, 32, 256)
    engine, _, loader, _ = spmdzero.initialize(args=args, model=model, training_data=dataset)
    losses = []
    while engine.global_steps < args.steps:
        for tokens, _ in loader:
            loss = engine(input_ids=tokens, labels=tokens).loss  # transformers shifts the labels itself
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            if engine.global_steps >= args.steps:
                break
    values = torch.stack(losses).float().cpu().tolist()
    print(f"GPT2LMHeadModel ({sum(p.numel() for p in model.parameters()):,} params), ZeRO stage "
          f"{engine.zero_optimization_stage()}: loss {values[0]:.3f} -> {values[-1]:.3f} in {engine.global_steps} steps")
    return values[-1] / values[0]


if __name__ == "__main__":
    main()
