"""Compile an exported StableHLO step for a TPU topology with JAX's compile-only client
(libtpu), or for XLA:CPU with N devices, and summarize the program: per-device memory and
collectives.

Runs in its own process (``python -m spmdzero.tpu_compile STEP.mlir TOPOLOGY OUT.json``)
so libtpu never loads into the training process. Needs jax and libtpu, not a TPU.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

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


def summarize_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Collectives of the entry computation by kind: count, tensors and bytes (output size).
    TPU's reduce-scatter is a ``kCustom`` fusion calling an ``all-reduce-scatter``
    computation; it is reported as ``reduce-scatter``."""
    from .inspect import COLLECTIVE_OPS, is_cpu_reduce_scatter, split_computations

    computations = split_computations(hlo_text)
    entry = computations.get("ENTRY", [])
    out: dict[str, dict[str, int]] = {}

    def add(kind: str, shape: str) -> None:
        row = out.setdefault(kind, {"count": 0, "tensors": 0, "bytes": 0})
        row["count"] += 1
        row["tensors"] += max(1, shape.count("["))
        row["bytes"] += shape_bytes(shape)

    for ins in entry:
        op = ins.opcode.removesuffix("-start")
        if op == "all-reduce" and is_cpu_reduce_scatter(computations, entry, ins):
            add("reduce-scatter (CPU: all-reduce + slice)", ins.shape)
        elif op in COLLECTIVE_OPS:
            add(op, ins.shape)
        elif op == "fusion" and re.search(r"calls=%all-reduce-scatter", ins.rest):
            add("reduce-scatter", ins.shape)
    return out


def _cpu_devices(count: int) -> list:
    os.environ["JAX_PLATFORMS"] = "cpu"  # never probe for a TPU here
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}")
    import jax

    return jax.devices("cpu")[:count]


def _tpu_devices(topology: str) -> list:
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server: this is not a TPU VM
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(f"libtpu is not installed; {LIBTPU_HINT}")
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as err:
        raise ValueError(f"unknown TPU topology {topology!r} ({err}); examples: v4:2x2x1, v5e:2x2, v5e:4x4, "
                         "v5p:2x2x1, v6e:2x2") from None


def compile_for_tpu(mlir_text: str, topology: str) -> dict:
    """Compile for ``topology``: a TPU topology name, or ``cpu:N`` for XLA:CPU with N devices."""
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc

    devices = _cpu_devices(int(topology[4:])) if topology.startswith("cpu:") else _tpu_devices(topology)
    with mlir.make_ir_context():
        module = mlir.ir.Module.parse(mlir_text)
        options = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices),
                                               device_assignment=np.array([[d.id for d in devices]]),
                                               use_spmd_partitioning=True, backend=devices[0].client)
        # The export carries input shardings only; let outputs take the propagated ones
        # (else they compile replicated and the output bytes are overstated).
        options.executable_build_options.allow_spmd_sharding_propagation_to_output = [True]
        start = time.perf_counter()
        compile_fn = compiler.backend_compile_and_load if topology.startswith("cpu:") else compiler.backend_compile
        extra = ([],) if topology.startswith("cpu:") else ()  # a live CPU client loads; TPU's is compile-only
        executable = compile_fn(devices[0].client, module, xc.DeviceList(tuple(devices)), options, *extra)
        seconds = time.perf_counter() - start
    stats = executable.get_compiled_memory_stats()
    hlo = executable.hlo_modules()[0].to_string()
    return {
        "topology": topology, "chips": len(devices), "device_kind": devices[0].device_kind,
        "compile_seconds": seconds,
        "memory": {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
                   "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes,
                   "generated_code": stats.generated_code_size_in_bytes},
        "collectives": summarize_collectives(hlo),
    }


def main(argv: list[str]) -> int:
    mlir_path, topology, out_path = argv
    try:
        with open(mlir_path) as f:
            result = compile_for_tpu(f.read(), topology)
    except (RuntimeError, ValueError) as err:
        result = {"error": str(err)}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
