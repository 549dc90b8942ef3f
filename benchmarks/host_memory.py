"""Host memory at ZeRO-3: whole host parameters against DeepSpeed's placeholders.

    python benchmarks/host_memory.py [--model gpt2-medium|gpt2-large|gpt2-xl] [--steps 1]

A GPT-2 (random weights: no download) trained at ZeRO-3 in fp32 with AdamW on this machine's
devices (8 CPU devices by default), once with ``"spmd": {"host_parameters": "whole"}`` and once
with ``"placeholders"`` (what ``"auto"`` picks from 1 GiB of parameters), each in a process of
its own. After initialize and after the steps, each prints:

* the process's resident memory (RSS, plus any of it swapped out);
* the bytes of the live device arrays (every shard: on CPU devices they are host memory too);
* RSS minus those: the host's own memory, the host module's parameters included;
* the bytes the host module's parameters hold.

Then the two side by side, and the difference. ``--steps 0`` measures after ``initialize`` only.
On CPU devices the states are host memory too: ``gpt2-large`` (774M) initializes in about 13 GB
and its first step needs more than 23 GB; ``gpt2-xl`` (1.56B) holds 6.2 GB of parameters and
12.5 GB of AdamW states before its host copy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PRESETS = {"gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}


def rss_bytes() -> int:
    """Resident memory plus what was swapped out: the process's whole footprint, even where a
    swap file lets a model larger than RAM be measured."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return sum(int(fields[k][0]) * 1024 for k in ("VmRSS", "VmSwap") if k in fields)


def device_bytes() -> int:
    """Every live device buffer once (two arrays may hold the same buffers)."""
    import jax

    buffers = {}
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            buffers[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    return sum(buffers.values())


def measure(model_name: str, mode: str, steps: int) -> dict:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "8")
    import torch
    import transformers

    import spmdzero

    layers, width, heads = PRESETS[model_name]
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads,
                                                                 n_positions=64))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "gradient_clipping": 0.0,
              "spmd": {"host_parameters": mode}}
    engine, *_ = spmdzero.initialize(model=model, config=config)

    def snapshot():
        engine.wait()
        rss, devices = rss_bytes(), device_bytes()
        host_params = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"rss": rss, "devices": devices, "host": rss - devices, "host_parameters": host_params}

    out = {"parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
           "initialized": snapshot()}
    ids = torch.randint(0, 50257, (8, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out["trained"] = snapshot() if steps else out["initialized"]
    out["losses"] = losses
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="gpt2-medium")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--mode", choices=("whole", "placeholders"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode is not None:  # one measurement, in this process
        print(json.dumps(measure(args.model, args.mode, args.steps)))
        return 0
    results = {}
    for mode in ("whole", "placeholders"):
        proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                               "--mode", mode], capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    gib = 2**30
    whole, kept = results["whole"], results["placeholders"]
    print(f"{args.model}: {whole['parameters'] / 1e6:.0f}M parameters, ZeRO-3, fp32, AdamW, "
          f"{os.environ.get('CPU_NUM_DEVICES', '8')} CPU devices; GiB")
    print(f"{'':40}{'whole':>10}{'placeholders':>14}{'difference':>12}")
    for when in ("initialized", "trained") if args.steps else ("initialized",):
        for key, label in (("rss", "RSS"), ("devices", "device arrays"), ("host", "RSS - device arrays"),
                           ("host_parameters", "host module's parameters")):
            a, b = whole[when][key] / gib, kept[when][key] / gib
            print(f"{when + ': ' + label:40}{a:10.2f}{b:14.2f}{a - b:12.2f}")
    print(f"host memory (RSS - device arrays) after {args.steps} step(s): placeholders / whole = "
          f"{kept['trained']['host'] / whole['trained']['host']:.2f}x")  # after initialize with --steps 0
    print(f"losses: whole {whole['losses']}, placeholders {kept['losses']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
