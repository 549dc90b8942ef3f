"""Compile an exported StableHLO step for a TPU topology with JAX's compile-only client
(libtpu), or for XLA:CPU with N devices, and summarize the program: per-device memory,
collectives and the compiler's cost analysis.

Runs in its own process (``python -m spmdzero.tpu.compile STEP.mlir TOPOLOGY OUT.json
[STEP.json]``) so libtpu never loads into the training process. Needs jax and libtpu, not
a TPU. ``STEP.json`` says which arguments the step donates to which outputs (its state),
and whether the outputs' shardings in the module are fixed (a module JAX lowered).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from spmdzero.runtime import jax_private, libtpu_flags
from spmdzero.runtime.devices import size_cpu_thread_pool
from spmdzero.tpu.collectives import largest_all_reduces, loop_trip_counts, summarize_collectives, trip_count
from spmdzero.tpu.chips import canonical, chip_spec, known_topologies
from spmdzero.tpu.hbm_traffic import hbm_bytes
from spmdzero.observe.hlo import computation_blocks, split_computations

LIBTPU_HINT = "install it with: pip install 'spmdzero[aot]' (libtpu 0.0.21 to 0.0.42; docs/aot.md)"


def _cpu_devices(count: int) -> list:
    os.environ["JAX_PLATFORMS"] = "cpu"  # never probe for a TPU here
    size_cpu_thread_pool(count)
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

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=canonical(topology)).devices)
    except Exception as err:
        message = str(err)
        if LOCKFILE_MARK in message or "libtpu" in message.lower() and "in use" in message.lower():
            raise RuntimeError(f"libtpu is in use by another process ({message.strip()}); set "
                               "ALLOW_MULTIPLE_LIBTPU_LOAD=1 to let this compile share it, or wait for that "
                               "process to finish") from None
        newer = _newer_libtpu_needed(topology)
        if newer:
            raise ValueError(f"unknown TPU topology {topology!r} to libtpu {_libtpu_version()}: {newer}") from None
        raise ValueError(f"unknown TPU topology {topology!r} ({message.strip()}); valid names include "
                         f"{', '.join(known_topologies())}") from None


LOCKFILE_MARK = "libtpu_lockfile"


def _libtpu_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _newer_libtpu_needed(topology: str) -> str | None:
    """What to install when the topology's generation is one spmdzero knows but the installed
    libtpu predates it (TPU7x on libtpu 0.0.21); None otherwise."""
    try:
        spec = chip_spec(topology)
    except ValueError:
        return None
    installed = _libtpu_version()
    if _version_tuple(installed) >= _version_tuple(spec.libtpu):
        return None
    return (f"{spec.generation} needs libtpu {spec.libtpu} or newer (the oldest spmdzero compiled it with): "
            f"pip install 'libtpu>={spec.libtpu}' (what `pip install 'spmdzero[aot]'` picks where nothing holds "
            "libtpu back, and what jax 0.10.2 pins)")


def _version_tuple(version: str) -> tuple:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def prepare_module(module, donate: list[tuple[int, int]], fixed_outputs: bool = False) -> list[bool]:
    """Give the exported ``main`` what ``jax.jit`` would: shardings on its arguments and
    donated state. Returns, per output, whether the compiler may choose its sharding.

    * A tensor annotated after it was created (a shape-only placeholder) carries its
      sharding on a ``Sharding`` custom call, not on the argument; the argument is moved
      to that sharding, else the compiler would see a replicated input.
    * ``donate`` pairs (argument, output) of the same state tensor before and after the
      step: aliasing them lets the program update the state in place, as a training step
      does, instead of holding both copies.
    * ``fixed_outputs`` (a module JAX lowered: its shardings and donations are already on
      ``main``): an output with a sharding keeps it, as ``jax.jit`` compiles an output whose
      sharding was given; the others are the compiler's choice.
    """
    from jax.interpreters.mlir import ir

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
    propagate = [not (fixed_outputs and ("mhlo.sharding" in attrs or "sdy.sharding" in attrs)) for attrs in res_attrs]
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
    from jax.interpreters.mlir import ir

    d = ir.DictAttr(attr)
    return {d[i].name: d[i].attr for i in range(len(d))}


def compile_for_tpu(mlir_text: str, topology: str, donate: list[tuple[int, int]] = (),
                    fixed_outputs: bool = False) -> dict:
    """Compile for ``topology``: a TPU topology name, or ``cpu:N`` for XLA:CPU with N devices.
    A program that does not fit comes back as a report with ``out_of_memory`` set.
    ``fixed_outputs``: as ``prepare_module`` takes it."""
    import jax.interpreters.mlir as mlir
    import numpy as np
    from jax.extend.backend import get_compile_options

    on_cpu = topology.startswith("cpu:")
    devices = _cpu_devices(int(topology[4:])) if on_cpu else _tpu_devices(topology)
    result = {"topology": topology, "chips": len(devices), "device_kind": devices[0].device_kind}
    if not on_cpu:
        result["libtpu_args"] = os.environ.get("LIBTPU_INIT_ARGS", "")
    with mlir.make_ir_context():
        module = mlir.ir.Module.parse(mlir_text)
        propagate = prepare_module(module, list(donate), fixed_outputs)
        # SPMD partitioning is on in every JAX version's options (0.10 no longer takes the key)
        options = get_compile_options(num_replicas=1, num_partitions=len(devices),
                                      device_assignment=np.array([[d.id for d in devices]]),
                                      backend=devices[0].client)
        # The export carries input shardings only; let the other outputs take the propagated
        # ones (else they compile replicated and the output bytes are overstated).
        options.executable_build_options.allow_spmd_sharding_propagation_to_output = propagate
        start = time.perf_counter()
        try:  # a live CPU client loads; TPU's is compile-only
            executable = jax_private.compile_module(devices[0].client, module, devices, options, load=on_cpu)
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
    if not on_cpu:  # memory spaces are TPU's: XLA:CPU's program has none
        result["hbm_bytes"] = hbm_bytes(hlo)
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
    from jaxlib import xla_client as xc

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
    analysis = jax_private.hlo_cost_analysis(client, text)
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
    donate, fixed_outputs = [], False
    if meta:
        with open(meta[0]) as f:
            settings = json.load(f)
        donate = [tuple(pair) for pair in settings.get("donate", [])]
        fixed_outputs = bool(settings.get("fixed_outputs", False))
    try:
        with open(mlir_path) as f:
            result = compile_for_tpu(f.read(), topology, donate, fixed_outputs)
    except ValueError as err:
        result = {"error": str(err), "kind": "topology" if str(err).startswith("unknown TPU topology") else "input"}
    except RuntimeError as err:
        result = {"error": str(err), "kind": "runtime"}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
