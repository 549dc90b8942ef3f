"""Compile an exported StableHLO step for a TPU topology with JAX's compile-only client
(libtpu), or for XLA:CPU with N devices, and summarize the program: per-device memory,
collectives and the compiler's cost analysis.

Runs in its own process (``python -m spmdzero.tpu.compile STEP.mlir TOPOLOGY OUT.json
[STEP.json]``) so libtpu never loads into the training process. Needs jax and libtpu, not
a TPU. ``STEP.json`` says which arguments the step donates to which outputs (its state).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from spmdzero.runtime import libtpu_flags

LIBTPU_HINT = "install it with: pip install 'spmdzero[aot]' (libtpu==0.0.21, the version torch_xla 2.9 pins)"
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
    collectives may start inside a fusion too (``async-collective-start``). A while loop's
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
    from spmdzero.observe.hlo import COLLECTIVE_OPS, is_cpu_reduce_scatter, split_computations

    computations = split_computations(hlo_text)
    found: list[tuple[str, str, int, int]] = []

    def add(kind: str, shape: str, group: int, times: int) -> None:
        found.append((kind, shape, group, times))

    def walk(body: list, times: int, trips: int = 1) -> None:
        nonlocal found
        for ins in body:
            op = ins.opcode.removesuffix("-start")
            if op == "all-reduce" and cpu_program and is_cpu_reduce_scatter(computations, body, ins):
                add("reduce-scatter (CPU: all-reduce + slice)", ins.shape, group_size(ins.rest), times)
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
    Groups are written ``{{0,2},{1,3}}`` or as an iota ``[groups,size]<=[...]``."""
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if listed:
        return len(listed.group(1).split(","))
    iota = re.search(r"replica_groups=\[(?:\d+,)*(\d+)\]<=", attributes)
    return int(iota.group(1)) if iota else 0


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
    from spmdzero.observe.hlo import split_computations

    computations = split_computations(hlo_text)
    return [trip_count(computations, ins, body) for body in computations.values() for ins in body
            if ins.opcode == "while"]


def _cpu_devices(count: int) -> list:
    os.environ["JAX_PLATFORMS"] = "cpu"  # never probe for a TPU here
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}")
    import jax

    return jax.devices("cpu")[:count]


def _tpu_devices(topology: str) -> list:
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server: this is not a TPU VM
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    libtpu_flags.apply()  # as spmdzero.runtime does on a TPU VM, before libtpu loads
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(f"libtpu is not installed; {LIBTPU_HINT}")
    from jax.experimental import topologies

    from spmdzero.tpu.chips import known_topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as err:
        message = str(err)
        if LOCKFILE_MARK in message or "libtpu" in message.lower() and "in use" in message.lower():
            raise RuntimeError(f"libtpu is in use by another process ({message.strip()}); set "
                               "ALLOW_MULTIPLE_LIBTPU_LOAD=1 to let this compile share it, or wait for that "
                               "process to finish") from None
        raise ValueError(f"unknown TPU topology {topology!r} ({message.strip()}); valid names include "
                         f"{', '.join(known_topologies())}") from None


LOCKFILE_MARK = "libtpu_lockfile"


def prepare_module(module, donate: list[tuple[int, int]]) -> list[bool]:
    """Give the exported ``main`` what ``jax.jit`` would: shardings on its arguments and
    donated state. Returns, per output, whether the compiler may choose its sharding.

    * A tensor annotated after it was created (a shape-only placeholder) carries its
      sharding on a ``Sharding`` custom call, not on the argument; the argument is moved
      to that sharding, else the compiler would see a replicated input.
    * ``donate`` pairs (argument, output) of the same state tensor before and after the
      step: aliasing them lets the program update the state in place, as a training step
      does, instead of holding both copies.
    """
    from jax._src.interpreters import mlir

    ir = mlir.ir
    main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
    block = main.regions[0].blocks[0]
    arg_attrs = [_attr_dict(a) for a in main.attributes["arg_attrs"]] if "arg_attrs" in main.attributes \
        else [{} for _ in block.arguments]
    outputs = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results)
    res_attrs = [_attr_dict(a) for a in main.attributes["res_attrs"]] if "res_attrs" in main.attributes \
        else [{} for _ in range(outputs)]
    for op in block.operations:
        if op.operation.name != "stablehlo.custom_call" or \
                ir.StringAttr(op.attributes["call_target_name"]).value != "Sharding":
            continue
        operand = op.operands[0]
        if ir.BlockArgument.isinstance(operand):
            attrs = arg_attrs[ir.BlockArgument(operand).arg_number]
            attrs.setdefault("mhlo.sharding", op.attributes["mhlo.sharding"])
    propagate = [True] * outputs
    i32 = ir.IntegerType.get_signless(32)
    for arg, out in donate:
        attrs = arg_attrs[arg]
        attrs["tf.aliasing_output"] = ir.IntegerAttr.get(i32, out)
        if "mhlo.sharding" in attrs:  # an aliased output keeps its input's layout
            res_attrs[out]["mhlo.sharding"] = attrs["mhlo.sharding"]
            propagate[out] = False
    main.attributes["arg_attrs"] = ir.ArrayAttr.get([ir.DictAttr.get(a) for a in arg_attrs])
    main.attributes["res_attrs"] = ir.ArrayAttr.get([ir.DictAttr.get(a) for a in res_attrs])
    return propagate


def _attr_dict(attr) -> dict:
    from jax._src.interpreters import mlir

    d = mlir.ir.DictAttr(attr)
    return {d[i].name: d[i].attr for i in range(len(d))}


def compile_for_tpu(mlir_text: str, topology: str, donate: list[tuple[int, int]] = ()) -> dict:
    """Compile for ``topology``: a TPU topology name, or ``cpu:N`` for XLA:CPU with N devices.
    A program that does not fit comes back as a report with ``out_of_memory`` set."""
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc

    on_cpu = topology.startswith("cpu:")
    devices = _cpu_devices(int(topology[4:])) if on_cpu else _tpu_devices(topology)
    result = {"topology": topology, "chips": len(devices), "device_kind": devices[0].device_kind}
    if not on_cpu:
        result["libtpu_args"] = os.environ.get("LIBTPU_INIT_ARGS", "")
    with mlir.make_ir_context():
        module = mlir.ir.Module.parse(mlir_text)
        propagate = prepare_module(module, list(donate))
        options = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices),
                                               device_assignment=np.array([[d.id for d in devices]]),
                                               use_spmd_partitioning=True, backend=devices[0].client)
        # The export carries input shardings only; let the other outputs take the propagated
        # ones (else they compile replicated and the output bytes are overstated).
        options.executable_build_options.allow_spmd_sharding_propagation_to_output = propagate
        start = time.perf_counter()
        compile_fn = compiler.backend_compile_and_load if on_cpu else compiler.backend_compile
        extra = ([],) if on_cpu else ()  # a live CPU client loads; TPU's is compile-only
        try:
            executable = compile_fn(devices[0].client, module, xc.DeviceList(tuple(devices)), options, *extra)
        except Exception as err:  # jax raises its own XlaRuntimeError; the message says which
            out_of_memory = parse_resource_exhausted(str(err))
            if out_of_memory is None:
                raise
            result.update(compile_seconds=time.perf_counter() - start, out_of_memory=out_of_memory,
                          memory=None, collectives={}, all_reduces=[], cost={})
            return result
        result["compile_seconds"] = time.perf_counter() - start
    stats = executable.get_compiled_memory_stats()
    result["memory"] = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
                        "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes,
                        "generated_code": stats.generated_code_size_in_bytes}
    hlo = executable.hlo_modules()[0].to_string()
    result["collectives"] = summarize_collectives(hlo, cpu_program=on_cpu)
    result["all_reduces"] = largest_all_reduces(hlo, cpu_program=on_cpu)
    result["loops"] = loop_trip_counts(hlo)
    result["cost"] = _cost(executable)
    if any(trips > 1 for trips in result["loops"]) and result["cost"]:
        try:
            result["cost_per_step"] = per_step_cost(hlo, result["cost"])
        except Exception as err:  # the report keeps the compiler's figures and says why
            result["cost_per_step_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    return result


def _cost(executable) -> dict:
    """The compiler's per-chip estimate of FLOPs and HBM bytes accessed (empty where the
    backend gives none)."""
    try:
        analysis = executable.cost_analysis()
    except Exception:  # not every client implements it
        return {}
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    return {key: float(analysis[key]) for key in ("flops", "bytes accessed", "transcendentals")
            if key in analysis}


_COST_KEYS = ("flops", "bytes accessed", "transcendentals")


def per_step_cost(hlo_text: str, cost: dict, client=None) -> dict:
    """``cost`` (the compiler's analysis of the whole program, which counts every while
    loop's body once) with each body counted as often as it runs per step: its own cost
    (XLA's cost analysis of the body as a program of its own, less that of the loops nested
    in it) times its trip count and those of the loops around it. The body's analysis runs on
    an XLA:CPU client, which gives a TPU program the same FLOPs and bytes as libtpu does."""
    from jax._src.lib import xla_client as xc

    from spmdzero.observe.hlo import computation_blocks, split_computations

    client = client or xc.make_cpu_client()
    computations = split_computations(hlo_text)
    blocks = computation_blocks(hlo_text)
    loops = []  # (body, trips, trips of the loops around it, enclosing body)

    def walk(name: str, times: int, enclosing, seen: set) -> None:
        for ins in computations.get(name, []):
            if ins.opcode == "while" and (body := re.search(r"body=%([\w.\-]+)", ins.rest)):
                trips = trip_count(computations, ins, computations[name])
                loops.append((body.group(1), trips, times, enclosing))
                walk(body.group(1), times * trips, body.group(1), seen)
                continue
            for called in _called(ins.rest, blocks):
                if called not in seen:  # a fusion or reducer: no loops in it, visited once
                    seen.add(called)
                    walk(called, times, enclosing, seen)

    walk("ENTRY", 1, None, set())
    once = {body: _program_cost(client, _as_program(blocks, body)) for body, *_ in loops}
    total = {key: cost.get(key, 0.0) for key in _COST_KEYS if key in cost}
    for body, trips, times, _ in loops:
        own = {key: once[body].get(key, 0.0) - sum(once[inner].get(key, 0.0) for inner, *_, around in loops
                                                   if around == body) for key in total}
        for key in total:
            total[key] += (times * trips - 1) * own[key]
    return total


def _called(attributes: str, blocks: dict) -> list[str]:
    return [name for name in re.findall(r"%([\w.\-]+)", attributes) if name in blocks and name != "ENTRY"]


def _as_program(blocks: dict, body: str) -> str:
    """A module whose entry is the computation ``body``, with what it calls."""
    needed, stack = set(), [body]
    while stack:
        name = stack.pop()
        if name not in needed:
            needed.add(name)
            stack.extend(c for line in blocks[name][1:] for c in _called(line, blocks))
    lines = ["HloModule loop_body", ""]
    for name, block in blocks.items():
        if name in needed:
            lines += ["ENTRY " + block[0] if name == body else block[0], *block[1:], ""]
    return "\n".join(lines)


def _program_cost(client, text: str) -> dict:
    from jax._src.lib import xla_client as xc

    analysis = xc._xla.hlo_module_cost_analysis(client, xc._xla.hlo_module_from_text(text))
    return {key: float(analysis[key]) for key in _COST_KEYS if key in analysis}


_SIZE = r"([\d.]+)([KMGT]?)"
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_resource_exhausted(message: str) -> dict | None:
    """The numbers of XLA:TPU's out-of-memory compile error ("Used 19.31G of 15.75G hbm.
    Exceeded hbm capacity by 3.56G."): what the program needs, the usable HBM and the
    excess, in bytes. None for any other error."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    out: dict = {"message": message.strip().splitlines()[0][:500]}
    used = re.search(rf"Used {_SIZE} of {_SIZE} hbm", message)
    if used:
        out["used"] = _bytes(used.group(1), used.group(2))
        out["capacity"] = _bytes(used.group(3), used.group(4))
    allocation = re.search(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)", message)
    if allocation:  # one buffer alone is larger than the chip
        out["used"], out["capacity"] = int(allocation.group(1)), int(allocation.group(2))
    over = re.search(rf"Exceeded hbm capacity by {_SIZE}", message)
    if over:
        out["over_by"] = _bytes(over.group(1), over.group(2))
    elif "used" in out:
        out["over_by"] = out["used"] - out["capacity"]
    usage = {kind: _bytes(m.group(1), m.group(2)) for kind in ("reserved", "program", "arguments")
             if (m := re.search(rf"^\s*{kind}\s+{_SIZE}B?\s*$", message, re.MULTILINE))}
    if usage:
        out["usage"] = usage
    largest = largest_allocations(message)
    if largest:
        out["largest_allocations"] = largest
    return out


def largest_allocations(message: str, limit: int = 5) -> list[dict]:
    """The "Largest program allocations in hbm" that libtpu lists in an out-of-memory error:
    what the program was holding at its peak, the user's first clue to what to shrink. Each
    as {bytes, shape, op (the operation's name), source (file:line, when the op has one),
    label (the HLO instruction), kind (temporary, argument, ...)}."""
    head = message.find("Largest program allocations")
    if head < 0:
        return []
    found = []
    for entry in re.split(r"\n\s*\d+\. Size: ", message[head:])[1:limit + 1]:
        size = re.match(_SIZE, entry)
        op = re.search(r'op_name="([^"]*)"', entry)
        source = re.search(r'source_file="([^"]*)" source_line=(\d+)', entry)
        shape = re.search(r"Shape: (\S+)", entry)
        label = re.search(r"XLA label: ([\w.\-]+)", entry)
        kind = re.search(r"Allocation type: (.+)", entry)
        found.append({"bytes": _bytes(size.group(1), size.group(2)) if size else 0,
                      "shape": shape.group(1).split("{")[0] if shape else "",
                      "op": op.group(1) if op else "",
                      "source": (f"{os.path.basename(source.group(1))}:{source.group(2)}"
                                 if source and source.group(1) not in ("", "-") else ""),
                      "label": label.group(1) if label else "",
                      "kind": kind.group(1).strip() if kind else ""})
    return found


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNIT[unit])


def main(argv: list[str]) -> int:
    mlir_path, topology, out_path, *meta = argv
    donate = []
    if meta:
        with open(meta[0]) as f:
            donate = [tuple(pair) for pair in json.load(f).get("donate", [])]
    try:
        with open(mlir_path) as f:
            result = compile_for_tpu(f.read(), topology, donate)
    except ValueError as err:
        result = {"error": str(err), "kind": "topology" if str(err).startswith("unknown TPU topology") else "input"}
    except RuntimeError as err:
        result = {"error": str(err), "kind": "runtime"}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
