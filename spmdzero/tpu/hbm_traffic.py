"""The HBM bytes a compiled TPU program reads and writes per step, from the memory spaces in its
HLO.

XLA's cost analysis counts every operand and output of every instruction as "bytes accessed",
whatever memory it lies in. After libtpu's memory-space assignment a decode step prefetches each
layer's weights and KV cache into on-chip memory (layouts marked ``S(1)``) with async copies and
slices, and its fusions read them there: the cost analysis then counts each such byte three
times (the HBM read, the on-chip write, the on-chip read), 3.7x the bytes the step must read
from HBM. For a step bound by HBM bandwidth that makes the roofline a ceiling, not a floor.

``hbm_bytes(hlo)`` counts only what moves in or out of HBM (a layout with no memory space, or
``S(0)``), per instruction of the scheduled program, a while loop's body as often as it runs:

* an operand in HBM is read whole, except where the instruction (or the fused computation,
  through reshapes, pads and nested fusions) only slices it (a slice, a dynamic slice: the
  slices' bytes, as a windowed einsum reads its weight a window a trip), or only updates it in
  place (the first operand of a dynamic-update-slice: nothing read);
* an output in HBM is written whole, except a dynamic-update-slice's (the update's bytes);
* an async copy, slice or collective reads its source and writes its result, each where it lies
  (a slice reads only its slice; libtpu prints an async slice as ``slice-start`` or as an
  ``async-start`` calling one);
* bitcasts, tuples, parameters, constants, the ``-done`` halves of async pairs, and libtpu's
  ``ConcatBitcast`` and ``AllocateBuffer`` (no data moved) count nothing.

It is an estimate from the program text, not a measurement; ``tests/tpu/test_hbm_traffic.py``
holds it to programs whose traffic is known."""

from __future__ import annotations

import re

from spmdzero.observe.hlo import Instruction, split_computations
from spmdzero.tpu.collectives import trip_count

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
             "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](?:\{([^}]*)\})?")
_FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "partition-id", "replica-id",
         "after-all", "opt-barrier", "iota"}
_FREE_CALLS = ("ConcatBitcast", "AllocateBuffer")
_SLICES = ("slice", "dynamic-slice")


def _arrays(shape: str) -> list[tuple[int, bool]]:
    """(bytes, in HBM) of each array in a shape (a tuple's in order)."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in _ITEMSIZE:
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append((count * _ITEMSIZE[dtype], space is None or space.group(1) == "0"))
    return out


def _hbm(shape: str) -> int:
    return sum(size for size, in_hbm in _arrays(shape) if in_hbm)


def _operands(ins: Instruction) -> list[str]:
    """The instruction's operand names, in order (up to the closing parenthesis)."""
    depth, end = 0, len(ins.rest)
    for i, ch in enumerate(ins.rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                end = i
                break
            depth -= 1
    return re.findall(r"%([\w.\-]+)", ins.rest[:end])


_RESHAPES = ("bitcast", "reshape", "pad", "copy", "transpose", "broadcast")


def _read_of_parameter(fused: list[Instruction], index: int, whole: int, computations: dict) -> int:
    """Bytes a fused computation reads of its ``index``-th parameter (``whole`` bytes): where it
    is only sliced (through reshapes, pads and nested fusions), its slices' bytes; where it is
    only updated in place, 0; else whole."""
    param = next((i for i in fused if i.opcode == "parameter" and re.match(rf"{index}\)", i.rest)), None)
    return whole if param is None else min(whole, _read_of_value(fused, param.name, whole, computations))


def _read_of_value(fused: list[Instruction], name: str, whole: int, computations: dict, real: float = 1.0) -> int:
    """``real``: the share of the value that is the parameter's data (a pad adds the rest), by
    which a slice of it is read."""
    users = [i for i in fused if name in _operands(i)]
    if not users:
        return whole
    shapes = {i.name: i.shape for i in fused}
    total = 0
    for user in users:
        operands = _operands(user)
        if user.opcode in _SLICES and operands[0] == name:
            total += int(real * sum(size for size, _ in _arrays(user.shape)))
        elif user.opcode == "dynamic-update-slice" and operands[0] == name:
            continue
        elif user.opcode in _RESHAPES and operands[0] == name:
            grown = sum(size for size, _ in _arrays(user.shape))
            share = sum(size for size, _ in _arrays(shapes.get(name, ""))) / grown if user.opcode == "pad" and grown \
                else 1.0
            total += _read_of_value(fused, user.name, whole, computations, real * share)
        elif user.opcode == "fusion" and (called := re.search(r"calls=%([\w.\-]+)", user.rest)):
            nested = computations.get(called.group(1), [])
            total += sum(_read_of_parameter(nested, k, whole, computations) for k, o in enumerate(operands) if o == name)
        else:
            return whole
    return total


def _update_bytes(fused: list[Instruction], shapes: dict) -> int | None:
    """The bytes a fusion whose root is a dynamic-update-slice (or a tuple of them) writes: its
    updates'; None for any other root."""
    root = fused[-1] if fused else None
    roots = [root] if root is not None and root.opcode != "tuple" else \
        [i for i in fused if root is not None and i.name in _operands(root)]
    if not roots or any(r.opcode != "dynamic-update-slice" for r in roots):
        return None
    return sum(sum(size for size, _ in _arrays(shapes.get(_operands(r)[1], ""))) for r in roots)


def _instruction_bytes(ins: Instruction, computations: dict, shapes: dict) -> int:
    operands = _operands(ins)
    op = ins.opcode
    if op in _FREE or op.endswith("-done") or op == "while":
        return 0
    if op == "custom-call" and any(f'"{name}"' in ins.rest for name in _FREE_CALLS):
        return 0
    if op == "copy-start":  # (destination, source, context)
        arrays = _arrays(ins.shape)
        return _hbm(shapes.get(operands[0], "")) + (arrays[0][0] if arrays and arrays[0][1] else 0)
    if op in ("slice-start", "dynamic-slice-start"):  # ((source), slice, context): the slice read and written
        arrays = _arrays(re.match(r"\(\((?:[^()]|\([^()]*\))*\),\s*(.*)", ins.shape).group(1))[:1]
        size = arrays[0][0] if arrays else 0
        return (size if operands and _hbm(shapes.get(operands[0], "")) else 0) + (size if arrays and arrays[0][1] else 0)
    if op.endswith("-start"):  # async: ((operands), result, context...), or a collective's (operand, result, ...)
        called = re.search(r"calls=%([\w.\-]+)", ins.rest)
        body = computations.get(called.group(1), []) if called else []
        inner = body[-1] if body else None
        result = re.match(r"\(\((?:[^()]|\([^()]*\))*\),\s*(.*)", ins.shape)
        arrays = _arrays(result.group(1)) if result else _arrays(ins.shape)[1:2]
        written = arrays[0][0] if arrays and arrays[0][1] else 0
        if inner is not None and inner.opcode in _SLICES:
            source = shapes.get(operands[0], "") if operands else ""
            return written + (sum(s for s, _ in _arrays(inner.shape)) if _hbm(source) else 0)
        return written + sum(_hbm(shapes.get(o, "")) for o in operands)
    if op == "fusion" and (called := re.search(r"calls=%([\w.\-]+)", ins.rest)):
        fused = computations.get(called.group(1), [])
        fused_shapes = {i.name: i.shape for i in fused}
        read = sum(_read_of_parameter(fused, k, _hbm(shapes.get(o, "")), computations) for k, o in enumerate(operands))
        update = _update_bytes(fused, fused_shapes)
        written = _hbm(ins.shape) if update is None else (update if _hbm(ins.shape) else 0)
        return read + written
    if op in _SLICES:
        return (sum(s for s, _ in _arrays(ins.shape)) if _hbm(shapes.get(operands[0], "")) else 0) + _hbm(ins.shape)
    if op == "dynamic-update-slice":
        update = sum(s for s, _ in _arrays(shapes.get(operands[1], "")))
        return (update if _hbm(shapes.get(operands[1], "")) else 0) + (update if _hbm(ins.shape) else 0)
    return sum(_hbm(shapes.get(o, "")) for o in operands) + _hbm(ins.shape)


def hbm_bytes(hlo_text: str) -> int:
    """HBM bytes one run of the program moves (see the module docstring)."""
    computations = split_computations(hlo_text)
    def walk(name: str, times: int) -> int:
        body = computations.get(name, [])
        shapes = {i.name: i.shape for i in body}
        total = 0
        for ins in body:
            if ins.opcode == "while" and (loop := re.search(r"body=%([\w.\-]+)", ins.rest)):
                total += walk(loop.group(1), times * trip_count(computations, ins, body))
            elif ins.opcode in ("call", "conditional"):
                total += sum(walk(c, times) for c in re.findall(r"(?:to_apply|branch_computations=\{?|,\s*)%([\w.\-]+)",
                                                                  ins.rest) if c in computations)
            else:
                total += times * _instruction_bytes(ins, computations, shapes)
        return total

    return walk("ENTRY", 1)
