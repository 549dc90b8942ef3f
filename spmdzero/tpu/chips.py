"""Published per-chip figures of TPU generations, for "does it fit" and the roofline
estimate of a step's time (``spmdzero.aot``).

Sources (Cloud TPU system architecture pages, docs.cloud.google.com/tpu/docs/<gen>):
* v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s (tpu/docs/v4); ICI: 6 links of 50 GB/s
  per direction = 600 GB/s bidirectional (Jouppi et al., "TPU v4", ISCA 2023).
* v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 1600 Gbps = 400 GB/s bidirectional
  (tpu/docs/v5e).
* v5p: 459 TFLOP/s bf16, 95 GB HBM2e at 2765 GB/s, ICI 4800 Gbps = 600 GB/s (tpu/docs/v5p).
* v6e (Trillium): 918 TFLOP/s bf16, 32 GB HBM at 1640 GB/s, ICI 800 GB/s bidirectional
  (tpu/docs/v6e).
* TPU7x (Ironwood): 2307 TFLOP/s bf16, 192 GiB HBM3E at 7380 GB/s, ICI 1200 GB/s bidirectional
  per chip (tpu/docs/tpu7x). Each chip is two JAX devices (its two TensorCores, as libtpu's
  compile-only client lists them), so its figures here are halved: per device, as for every
  generation. libtpu 0.0.21 does not know it; 0.0.42 (jax 0.10.2's) does.
HBM capacities are what the compiler is given (GiB), as the compile-only client reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class ChipSpec:
    generation: str
    hbm_bytes: int
    peak_bf16_flops: float  # FLOP/s
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s per chip, both directions of all links
    topologies: tuple[str, ...]  # slice shapes accepted by libtpu (examples, smallest first)
    devices_per_chip: int = 1  # JAX devices (TensorCores) per chip: 2 on TPU7x
    libtpu: str = "0.0.21"  # the oldest libtpu spmdzero has compiled for it


CHIPS = {
    "v4": ChipSpec("v4", 32 * GIB, 275e12, 1200e9, 600e9, ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8")),
    "v5e": ChipSpec("v5e", 16 * GIB, 197e12, 819e9, 400e9, ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16",
                                                             "16x16")),
    "v5p": ChipSpec("v5p", 95 * GIB, 459e12, 2765e9, 600e9, ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4",
                                                              "4x4x8", "4x8x8", "8x8x8")),
    "v6e": ChipSpec("v6e", 32 * GIB, 918e12, 1640e9, 800e9, ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16",
                                                              "16x16")),
    "tpu7x": ChipSpec("tpu7x", 96 * GIB, 2307e12 / 2, 7380e9 / 2, 1200e9 / 2, ("2x2x1", "2x2x2", "2x2x4", "2x4x4",
                                                                            "4x4x4", "4x4x8", "8x8x8"),
                      devices_per_chip=2, libtpu="0.0.42"),
}

# Other names people give a generation -> spmdzero's (libtpu's) name
ALIASES = {"v7x": "tpu7x", "v7": "tpu7x", "ironwood": "tpu7x", "trillium": "v6e"}


def known_topologies() -> list[str]:
    return [f"{g}:{shape}" for g, spec in CHIPS.items() for shape in spec.topologies]


def canonical(topology: str) -> str:
    """The topology as libtpu names it: ``v7x:2x2x1`` -> ``tpu7x:2x2x1``."""
    generation, colon, dims = topology.partition(":")
    generation = generation.lower()
    return ALIASES.get(generation, generation) + colon + dims


def chip_spec(topology: str) -> ChipSpec:
    """The chip of a topology name such as ``v5e:4x4``; ValueError listing valid names."""
    generation, _, dims = canonical(topology).partition(":")
    if generation not in CHIPS or not dims or not all(d.isdigit() and int(d) > 0 for d in dims.split("x")):
        raise ValueError(f"unknown TPU topology {topology!r}: expected GENERATION:AxB[xC]; valid names include "
                         f"{', '.join(known_topologies())}")
    return CHIPS[generation]


def topology_chips(topology: str) -> int:
    """Devices in a topology name such as ``v5e:4x4`` or ``v4:2x2x1``: its chips, times two on
    TPU7x (JAX's devices, one per TensorCore there, which the mesh and every per-chip figure
    count)."""
    spec = chip_spec(topology)
    return spec.devices_per_chip * math.prod(int(d) for d in topology.partition(":")[2].split("x"))
