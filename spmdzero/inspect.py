"""Measure what the compiler and runtime actually did: per-device bytes from the live
tensors' shardings, and the collectives in post-optimization HLO text."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

_DEVICES = re.compile(r"devices=\[([\d,]+)\]")


def sharding_spec(t: torch.Tensor) -> str:
    """torch_xla's sharding string for a live XLA tensor ('' when it has none)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def per_device_shape(shape, spec: str) -> tuple[int, ...]:
    """Shape of one device's shard, from an HLO sharding string such as
    ``{devices=[8,1]0,...,7}`` or ``{devices=[4,1,2]... last_tile_dim_replicate}``.
    Tiles beyond the tensor's rank are replication; uneven tiles are padded (rounded up)."""
    match = _DEVICES.search(spec or "")
    if match is None:  # '', '{replicated}', '{maximal ...}': the whole tensor on a device
        return tuple(shape)
    tiles = [int(x) for x in match.group(1).split(",")][: len(shape)]
    return tuple(-(-size // tile) for size, tile in zip(shape, tiles))


def per_device_bytes(t: torch.Tensor) -> int:
    return math.prod(per_device_shape(tuple(t.shape), sharding_spec(t))) * t.element_size()


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-device bytes of model states (ZeRO's accounting: params, grads, optimizer states)."""

    params: int
    grads: int
    optimizer_states: int
    master_weights: int = 0  # fp32 copies under mixed precision; ZeRO counts them as optimizer state

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states + self.master_weights


def model_state_bytes(engine) -> ModelStateBytes:
    """Read from the live tensors: parameters, ZeRO gradient buffers, optimizer state and
    fp32 master weights."""
    params = sum(per_device_bytes(p) for p in engine.module.parameters())
    grads = sum(per_device_bytes(b) for b in engine.grad_buffers().values())
    masters = sum(per_device_bytes(m) for m in engine.master_weights().values())
    states = 0
    if engine.optimizer is not None:
        for state in engine.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.device.type == "xla":
                    states += per_device_bytes(v)
    return ModelStateBytes(params, grads, states, masters)


# ---- post-optimization HLO ---------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    rest: str  # operands and attributes

    def uses(self, name: str) -> bool:
        return re.search(r"%" + re.escape(name) + r"(?![\w.\-])", self.rest) is not None


def split_computations(text: str) -> dict[str, list[Instruction]]:
    """HLO module text -> {computation name: instructions}. The entry is under 'ENTRY'."""
    comps: dict[str, list[Instruction]] = {}
    current = None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if header:
            current = "ENTRY" if header.group(1) else header.group(2)
            comps[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            m = _INSTR.match(line)
            if m:
                comps[current].append(Instruction(*m.groups()))
    return comps


def collective_counts(text: str) -> dict[str, int]:
    """Counts of collective opcodes in the entry computation, plus
    ``reduce-scatter-pattern``: all-reduces consumed only by partition-indexed
    dynamic-slices (directly or inside a fusion fed ``partition-id``). That is how XLA:CPU
    lowers a reduce-scatter; the TPU and GPU compilers rewrite it into one."""
    comps = split_computations(text)
    entry = comps.get("ENTRY", [])
    counts: dict[str, int] = {}
    for ins in entry:
        op = ins.opcode.removesuffix("-start")
        if op in _COLLECTIVES:
            counts[op] = counts.get(op, 0) + 1
            scalar = ins.shape.split("{")[0].endswith("[]")
            if op == "all-reduce" and not scalar and _feeds_only_partition_slices(comps, entry, ins):
                counts["reduce-scatter-pattern"] = counts.get("reduce-scatter-pattern", 0) + 1
    return counts


def collectives(text: str, opcode: str) -> list[Instruction]:
    """The entry computation's instructions of one collective kind."""
    return [i for i in split_computations(text).get("ENTRY", []) if i.opcode.removesuffix("-start") == opcode]


def _feeds_only_partition_slices(comps, entry: list[Instruction], ins: Instruction) -> bool:
    pending, seen = [u for u in entry if u.uses(ins.name)], set()
    while pending:
        user = pending.pop()
        if user.name in seen:
            continue
        seen.add(user.name)
        if user.opcode in ("get-tuple-element", "bitcast", "copy", "all-reduce-done"):
            pending.extend(u for u in entry if u.uses(user.name))
        elif user.opcode == "dynamic-slice":
            continue
        elif user.opcode == "fusion":
            called = _CALLS.search(user.rest)
            body = comps.get(called.group(1), []) if called else []
            partitioned = any(u.opcode == "partition-id" for u in entry if user.uses(u.name))
            if not (partitioned and any(b.opcode == "dynamic-slice" for b in body)):
                return False
        else:
            return False
    return bool(seen)


def dumped_modules(dump_dir: str) -> dict[str, str]:
    """Post-optimization HLO text of every module XLA dumped to ``dump_dir`` (run with
    ``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``), by file name, in compile order."""
    import glob
    import os

    files = sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")))
    files = [f for f in files if not f.endswith(("buffer-assignment.txt", "memory-usage-report.txt"))]
    return {os.path.basename(f): open(f).read() for f in files}
