"""The parser of post-optimization HLO text: computations, instructions, and the collectives
in them (with XLA:CPU's lowering of a reduce-scatter named as what TPU and GPU compile it to)."""

from __future__ import annotations
import re
from dataclasses import dataclass


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")


_CALLS = re.compile(r"calls=%([\w.\-]+)")


COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    rest: str  # operands and attributes

    def uses(self, name: str) -> bool:
        return re.search(r"%" + re.escape(name) + r"(?![\w.\-])", self.rest) is not None


def computation_blocks(text: str) -> dict[str, list[str]]:
    """HLO module text -> {computation name: its lines, header to closing brace}, in order.
    The entry is under 'ENTRY'. An instruction printed over several lines (a Pallas kernel's
    ``kernel_metadata`` holds a newline since JAX 0.8) is joined into one: a computation's
    lines each start with ``%`` or ``ROOT``, and only a line that is ``}`` (with the thread it
    runs on, on TPU7x) closes it."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if header and current is None:
            current = "ENTRY" if header.group(1) else header.group(2)
            blocks[current] = [line]
        elif current is not None:
            if _COMPUTATION_END.match(line):
                blocks[current].append(line)
                current = None
            elif _INSTRUCTION_START.match(line) or len(blocks[current]) == 1:
                blocks[current].append(line)
            else:  # the rest of the instruction above
                blocks[current][-1] += " " + line.strip()
    return blocks


_INSTRUCTION_START = re.compile(r"^\s*(?:ROOT\s+)?%")
# "}" alone, or with the thread it runs on (TPU7x's SparseCore computations: `}, execution_thread=
# "sparsecore"`); an instruction's continuation starts "}}," instead
_COMPUTATION_END = re.compile(r"^\}\s*(?:,\s*execution_thread=.*)?$")


def split_computations(text: str) -> dict[str, list[Instruction]]:
    """HLO module text -> {computation name: instructions}. The entry is under 'ENTRY'."""
    return {name: [Instruction(*m.groups()) for line in lines[1:] if (m := _INSTR.match(line))]
            for name, lines in computation_blocks(text).items()}


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
        if op in COLLECTIVE_OPS:
            counts[op] = counts.get(op, 0) + 1
            if op == "all-reduce" and is_cpu_reduce_scatter(comps, entry, ins):
                counts["reduce-scatter-pattern"] = counts.get("reduce-scatter-pattern", 0) + 1
    return counts


def is_cpu_reduce_scatter(comps, entry: list[Instruction], ins: Instruction) -> bool:
    """A non-scalar all-reduce whose only consumers are partition-indexed slices (of a tuple
    all-reduce: every non-scalar element's)."""
    parts = cpu_all_reduce_parts(comps, entry, ins)
    return any(scattered for _, scattered in parts) and all(scattered or shape.endswith("[]")
                                                            for shape, scattered in parts)


def cpu_all_reduce_parts(comps, entry: list[Instruction], ins: Instruction) -> list[tuple[str, bool]]:
    """``(shape, reduce-scattered)`` for each array an XLA:CPU all-reduce reduces: one, or each
    element of a tuple. XLA 0.10's combiner puts a step's scalars (a loss's sum) and a gradient
    in one tuple all-reduce; the gradient's element alone feeds the partition-indexed slices of
    a reduce-scatter, the scalar is all-reduced."""
    arrays = re.findall(r"\b[a-z]+\d*\[[\d,]*\]", ins.shape)
    if not ins.shape.startswith("("):
        scalar = arrays[0].endswith("[]") if arrays else True
        return [(arrays[0] if arrays else ins.shape, not scalar and _feeds_only_partition_slices(comps, entry, ins))]
    parts = []
    for index, shape in enumerate(arrays):
        element = [u for u in entry if u.opcode == "get-tuple-element" and u.uses(ins.name)
                   and re.search(rf"\bindex={index}\b", u.rest)]
        scattered = not shape.endswith("[]") and bool(element) and \
            all(_feeds_only_partition_slices(comps, entry, e) for e in element)
        parts.append((shape, scattered))
    return parts


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
