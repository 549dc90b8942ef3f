"""The collectives of a compiled program, counted: per kind, the bytes each device sends under
a ring algorithm, and the trip counts of the loops they run in (a scanned layer stack runs its
collectives once per layer)."""

from __future__ import annotations
import math
import re
from spmdzero.observe.hlo import COLLECTIVE_OPS, cpu_all_reduce_parts, split_computations


_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "pred": 1, "s8": 1, "u8": 1}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as ``f32[256,1024]{1,0:T(8,128)}`` or a tuple of them."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _BYTES.get(dtype, 4)
    return total


def summarize_collectives(hlo_text: str, cpu_program: bool = False) -> dict[str, dict[str, int]]:
    """Collectives of the program by kind: count, tensors, bytes (output size) and bytes sent
    per device, per step. TPU's reduce-scatter is a ``kCustom`` fusion calling an
    ``all-reduce-scatter`` computation; it is reported as ``reduce-scatter``. Other
    collectives may start inside a fusion too (``async-collective-start``), or, on TPU7x, in a
    computation an ``async-start`` calls (SparseCore offload). A while loop's
    body (a scanned layer stack, a windowed einsum's ring of collective-permutes) counts as
    many times as its trip count.

    ``cpu_program``: the HLO is XLA:CPU's, which has no reduce-scatter and writes one as an
    all-reduce whose result only partition-indexed slices read; that is reported as
    ``reduce-scatter (CPU: all-reduce + slice)``, with a reduce-scatter's bytes. In a TPU
    program the same pattern is libtpu's own choice (it decomposes the 16-chip reduce-scatters
    it cannot run as one) and sends what an all-reduce sends, so there it counts as one."""
    out: dict[str, dict[str, int]] = {}
    for kind, shape, group, times in _collectives(hlo_text, cpu_program):
        row = out.setdefault(kind, {"count": 0, "tensors": 0, "bytes": 0, "sent": 0})
        row["count"] += times
        row["tensors"] += times * max(1, shape.count("["))
        row["bytes"] += times * shape_bytes(shape)
        sent = sent_per_device(kind, shape_bytes(shape), group)
        row["sent"] = None if sent is None or row["sent"] is None else row["sent"] + times * sent
    return out


def largest_all_reduces(hlo_text: str, min_bytes: int = 2**20, cpu_program: bool = False) -> list[dict]:
    """The program's all-reduced arrays of at least ``min_bytes``, largest first, as
    ``{"shape", "bytes", "count"}``: under ZeRO-2 a gradient of that shape was all-reduced in
    full instead of reduce-scattered (what to look at when the traffic ratio is high)."""
    found: dict[str, int] = {}
    for kind, shape, _, times in _collectives(hlo_text, cpu_program):
        if kind != "all-reduce":
            continue
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
            array = f"{dtype}[{dims}]"
            if shape_bytes(array) >= min_bytes:
                found[array] = found.get(array, 0) + times
    return sorted(({"shape": a, "bytes": shape_bytes(a), "count": n} for a, n in found.items()),
                  key=lambda r: -r["bytes"])


def _collectives(hlo_text: str, cpu_program: bool):
    """``(kind, output shape, replica group size, times per step)`` for every collective, as
    ``summarize_collectives`` counts them."""
    computations = split_computations(hlo_text)
    found: list[tuple[str, str, int, int]] = []

    def add(kind: str, shape: str, group: int, times: int) -> None:
        found.append((kind, shape, group, times))

    def walk(body: list, times: int, trips: int = 1) -> None:
        nonlocal found
        for ins in body:
            op = ins.opcode.removesuffix("-start")
            if op == "all-reduce" and cpu_program:
                parts = cpu_all_reduce_parts(computations, body, ins)
                for kind, scattered in (("reduce-scatter (CPU: all-reduce + slice)", True), ("all-reduce", False)):
                    shapes = [shape for shape, s in parts if s == scattered]
                    if shapes:
                        add(kind, shapes[0] if len(shapes) == 1 else f"({', '.join(shapes)})", group_size(ins.rest),
                            times)
            elif op in COLLECTIVE_OPS:
                add(op, _output_shape(ins), group_size(ins.rest), times)
            elif op == "fusion" and (called := re.search(r"calls=%([\w.\-]+)", ins.rest)):
                inner = computations.get(called.group(1), [])
                if called.group(1).startswith("all-reduce-scatter"):
                    reduce = [i.rest for i in inner if i.opcode.startswith("all-reduce")]
                    add("reduce-scatter", ins.shape, group_size(reduce[0] if reduce else ""), times)
                    continue
                # An async collective starts in an ``async-collective-start`` fusion; the fusions
                # that continue it (``async_collective_fusion``) repeat its op: count the start only.
                for i in inner if ins.name.startswith("async-collective-start") else ():
                    if i.opcode.removesuffix("-start") in COLLECTIVE_OPS:
                        add(i.opcode.removesuffix("-start"), i.shape, group_size(i.rest), times)
            elif ins.opcode in ("async-start", "call-start", "call") and \
                    (called := re.search(r"(?:calls|to_apply)=%([\w.\-]+)", ins.rest)) and called.group(1) in computations:
                # TPU7x runs collectives on its SparseCores: an async-start calls a computation that
                # calls the one holding the collective (the executable prints the pair as one
                # `call-start(...), to_apply=%...`, the pass dumps as `async-start(...), calls=%...`)
                walk(computations[called.group(1)], times, trips)
            elif op == "while":
                loop = re.search(r"body=%([\w.\-]+)", ins.rest)
                if loop and loop.group(1) in computations:
                    count = trip_count(computations, ins, body)
                    walk(computations[loop.group(1)], times * count, count)
            elif op == "conditional":
                # Count the branch that sends the most, every time (an upper bound), except in
                # libtpu's windowed einsum: its ring skips the permute in the last trip of the loop
                # (the other branch is ``last_iteration_noop``).
                names = re.findall(r"(?:true_computation|false_computation)=%([\w.\-]+)", ins.rest)
                listed = re.search(r"branch_computations=\{([^}]*)\}", ins.rest)
                names += re.findall(r"%([\w.\-]+)", listed.group(1)) if listed else []
                runs = times - times // trips if any(n.startswith("last_iteration_noop") for n in names) else times
                outer, branches = found, []
                for name in (n for n in names if n in computations):
                    found = []
                    walk(computations[name], runs)
                    branches.append(found)
                found = outer + max(branches, key=_sent, default=[])

    walk(computations.get("ENTRY", []), 1)
    return found


def _sent(collectives: list) -> int:
    return sum(times * (sent_per_device(kind, shape_bytes(shape), group) or 0)
               for kind, shape, group, times in collectives)


def _output_shape(ins) -> str:
    """An async ``collective-permute-start`` / ``all-gather-start`` is shaped (operand, output,
    ...): its output is what is sent."""
    if ins.opcode in ("collective-permute-start", "all-gather-start") and ins.shape.startswith("("):
        arrays = re.findall(r"\b[a-z]+\d*\[[\d,]*\]", ins.shape)
        return arrays[1] if len(arrays) > 1 else ins.shape
    return ins.shape


def group_size(attributes: str) -> int:
    """Devices in one replica group of a collective (0 when it does not say).
    Groups are written ``{{0,2},{1,3}}``, as an iota ``[groups,size]<=[...]``, or (libtpu
    0.0.42) by mesh axes, ``mesh['axis_0'=16,'axis_1'=8] {'axis_1'}`` (with the devices'
    order, ``device_ids=(...)``, between them where it is not the iota): a group spans the
    axes named in braces."""
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if listed:
        return len(listed.group(1).split(","))
    iota = re.search(r"replica_groups=\[(?:\d+,)*(\d+)\]<=", attributes)
    if iota:
        return int(iota.group(1))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\S*\))?\s*\{([^}]*)\}", attributes)
    if not mesh:
        return 0
    sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
    named = re.findall(r"'([^']+)'", mesh.group(2))
    return math.prod(sizes.get(name, 0) for name in named) if named else 0


def sent_per_device(kind: str, size: int, group: int) -> int | None:
    """Bytes one device sends for a collective with a ``size``-byte output over ``group``
    devices under a ring algorithm: all-reduce 2(g-1)/g x size, reduce-scatter (g-1) x its
    shard, all-gather and all-to-all (g-1)/g x size, a collective-permute its size. A
    two-axis fsdp mesh reduces over subgroups, so the group, not the mesh, sets the count.
    None if the group is unknown."""
    if kind == "collective-permute":
        return size
    if group <= 0:
        return None
    if kind == "all-reduce":
        return 2 * (group - 1) * size // group
    if kind == "reduce-scatter":
        return (group - 1) * size
    return (group - 1) * size // group


def trip_count(computations: dict, ins, caller: list = ()) -> int:
    """A while loop's trip count: XLA:CPU states it (``known_trip_count``); XLA:TPU's loops
    compare the induction variable against a bound in the condition (``compare(i, N),
    direction=LT``), and a loop libtpu unrolled (a windowed einsum's ``wide.`` loop) steps it
    by more than 1: the count is ceil((N - start) / step), the start read from the loop's
    initial tuple in ``caller`` (0 when not found), the step from the body's root. 1 when
    there is no such compare."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.rest)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%([\w.\-]+)", ins.rest)
    cond = computations.get(condition.group(1), []) if condition else []
    constants = _scalar_constants(cond)
    elements = {i.name: int(m.group(1)) for i in cond
                if i.opcode == "get-tuple-element" and (m := re.search(r"index=(\d+)", i.rest))}
    counts = []
    for i in cond:
        m = re.match(r"%([\w.\-]+),\s*%([\w.\-]+)\)", i.rest)
        if i.opcode != "compare" or "direction=LT" not in i.rest or not m or m.group(2) not in constants:
            continue
        bound, index = constants[m.group(2)], elements.get(m.group(1))
        loop = re.search(r"body=%([\w.\-]+)", ins.rest)
        step = _loop_step(computations.get(loop.group(1), []) if loop else [], index)
        start = _loop_start(caller, ins, index)
        if bound - start > 0:
            counts.append(-(-(bound - start) // step))
    return max(counts, default=1)


def _scalar_constants(body: list) -> dict[str, int]:
    return {i.name: int(m.group(1)) for i in body if i.opcode == "constant" and (m := re.match(r"(-?\d+)\)", i.rest))}


def _loop_step(body: list, index: int | None) -> int:
    """How much the loop body adds to tuple element ``index`` (1 when it cannot tell)."""
    root = body[-1] if body and body[-1].opcode == "tuple" else None  # HLO text prints the ROOT last
    if root is None or index is None:
        return 1
    operands = re.findall(r"%([\w.\-]+)", root.rest.split(")")[0])
    if index >= len(operands):
        return 1
    by_name = {i.name: i for i in body}
    update = by_name.get(operands[index])
    constants = _scalar_constants(body)
    if update is None or update.opcode != "add":
        return 1
    steps = [constants[a] for a in re.findall(r"%([\w.\-]+)", update.rest.split(")")[0]) if a in constants]
    return steps[0] if len(steps) == 1 and steps[0] > 0 else 1


def _loop_start(caller: list, ins, index: int | None) -> int:
    """The initial value of the loop's tuple element ``index`` when it is a constant (through
    copies) in the calling computation; 0 otherwise."""
    by_name = {i.name: i for i in caller}
    init = re.match(r"%([\w.\-]+)\)", ins.rest)
    tuple_ins = by_name.get(init.group(1)) if init else None
    if tuple_ins is None or tuple_ins.opcode != "tuple" or index is None:
        return 0
    operands = re.findall(r"%([\w.\-]+)", tuple_ins.rest.split(")")[0])
    name = operands[index] if index < len(operands) else None
    while name in by_name and by_name[name].opcode == "copy":
        name = re.match(r"%([\w.\-]+)", by_name[name].rest).group(1)
    return _scalar_constants(caller).get(name, 0)


def loop_trip_counts(hlo_text: str) -> list[int]:
    """Trip counts of the program's while loops. The compiler's cost analysis counts a loop
    body once, so a program with loops has its FLOPs and bytes accessed under-stated."""
    computations = split_computations(hlo_text)
    return [trip_count(computations, ins, body) for body in computations.values() for ins in body
            if ins.opcode == "while"]
