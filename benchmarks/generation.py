"""Generation on the devices against generation on the host, in a GRPO-shaped loop.

    python benchmarks/generation.py [--layers 12 --width 768 --batch 8 --prompt 32 --new 32 --iterations 3]
                                    [--num-beams N]

A GPT-2 small (12 layers of 768, random weights: no download) trained by the engine at ZeRO-2 on
this machine's devices (8 CPU devices by default). Each iteration is what an RL fine-tuning
step does: sample completions for a batch of prompts (``engine.module.generate(do_sample=True)``),
then one optimizer step on them (``--num-beams N``: beam search instead of sampling, as an
evaluation with ``num_beams`` generates). The same loop runs twice in one process, with ``generate`` on
the devices (``"spmd": {"generate": "devices"}``, the default) and on the host module
(``"host"``, the parity setting), and prints side by side, per generate call after the first:

* tokens per second (new tokens of the whole batch over the call's wall time);
* bytes copied from the devices: those ``generate`` reads on purpose (``jax.device_get``: the
  tokens and their count) and those written into the host module's parameters and buffers
  (the weights, which the host path needs after every optimizer step);
* programs traced (compiled) per iteration, all kinds, after the first.

The figures are reported, not targets: on CPU devices the "devices" and the host share the same
cores, so tokens/s compares the two programs' work, not a TPU's speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torchax.ops import mappings  # noqa: E402

import spmdzero  # noqa: E402


class Transfers:
    """Bytes copied from the devices: read by ``generate`` (``jax.device_get``) and written into
    the host module (``mappings.j2t``, ``HostCopy.current``)."""

    def __init__(self):
        self.read = self.to_module = 0
        get, j2t = jax.device_get, mappings.j2t

        def counted_get(tree):
            out = get(tree)
            self.read += sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(out))
            return out

        def counted_j2t(array, *args, **kwargs):
            self.to_module += np.dtype(array.dtype).itemsize * int(np.prod(array.shape))
            return j2t(array, *args, **kwargs)

        jax.device_get, mappings.j2t = counted_get, counted_j2t

    def take(self) -> tuple[int, int]:
        taken = (self.read, self.to_module)
        self.read = self.to_module = 0
        return taken


def loop(where: str, args, transfers: Transfers) -> list[dict]:
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                                     n_positions=1024, vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=50256, eos_token_id=50256)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "spmd": {"generate": where}})
    g = torch.Generator().manual_seed(1)
    rows = []
    for iteration in range(args.iterations):
        prompts = torch.randint(0, 50000, (args.batch, args.prompt), generator=g)
        traced = sum(engine.traces.values())
        transfers.take()
        torch.manual_seed(iteration)
        start = time.perf_counter()
        search = {"num_beams": args.num_beams} if args.num_beams > 1 else {"do_sample": True}
        sequences = engine.module.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new,
                                           pad_token_id=50256, **search)
        seconds = time.perf_counter() - start
        read, to_module = transfers.take()
        # one optimizer step on the completions (a GRPO step's shape: the batch's log-likelihood)
        engine.backward(engine(input_ids=sequences, labels=sequences).loss)
        engine.step()
        new_tokens = (sequences.shape[1] - args.prompt) * args.batch
        rows.append({"seconds": seconds, "tokens_per_s": new_tokens / seconds, "read": read,
                     "to_module": to_module, "traced": sum(engine.traces.values()) - traced})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--num-beams", type=int, default=1, help="beam search with N beams instead of sampling")
    args = parser.parse_args()
    transfers = Transfers()
    results = {where: loop(where, args, transfers) for where in ("devices", "host")}
    print(f"GPT-2 {args.layers}x{args.width}, ZeRO-2, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"batch {args.batch}, {args.prompt} prompt + {args.new} new tokens, "
          f"{f'beam search ({args.num_beams} beams)' if args.num_beams > 1 else 'sampled'}; per generate call after "
          "the first:")
    print(f"{'':<10}{'tokens/s':>10}{'read (B)':>12}{'to host module (B)':>20}{'traced/iteration':>18}")
    for where, rows in results.items():
        later = rows[1:] or rows
        print(f"{where:<10}{np.median([r['tokens_per_s'] for r in later]):>10.1f}"
              f"{int(np.median([r['read'] for r in later])):>12,}{int(np.median([r['to_module'] for r in later])):>20,}"
              f"{int(max(r['traced'] for r in later)):>18}")
    devices, host = (np.median([r["tokens_per_s"] for r in results[w][1:] or results[w]]) for w in ("devices", "host"))
    print(f"devices / host tokens/s: {devices / host:.2f}x; first call on the devices (compiles): "
          f"{results['devices'][0]['seconds']:.1f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
