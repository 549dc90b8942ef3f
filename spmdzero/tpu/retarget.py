"""Compile for more chips than one process can trace (v5e-256): trace the step on a smaller
mesh with the same global batch, then move its sharding annotations onto the target mesh.

PyTorch's autograd engine counts devices in 8 bits, so torch_xla cannot run a backward on
128 or more devices. The exported StableHLO is the *global* program: its shapes do not
depend on the device count, only its ``mhlo.sharding`` annotations do. Traced on a mesh
whose every axis is the target's divided by a whole factor, with the micro-batch per chip
multiplied by the device ratio (the same global batch), each annotation names which mesh
axes split which tensor dimension; the same axes on the target mesh give the program the
target would have traced, provided the ZeRO plan puts every tensor on the same axes at both
sizes (checked: ``make_plan`` is pure data).
"""

from __future__ import annotations

import itertools
import re
from typing import Optional

import numpy as np

from spmdzero.tpu.chips import topology_chips
from spmdzero.sharding.mesh import resolve_mesh_shape
from spmdzero.sharding.plan import make_plan
from spmdzero.tpu.captured_engine import CapturedEngine

MAX_TRACE_DEVICES = 127  # autograd's device index is 8 bits (one value reserved)

_SHARDING = re.compile(r'mhlo\.sharding = "\{devices=\[([\d,]+)\]([\d,]+)( last_tile_dim_replicate)?\}"')


def trace_devices(topology: str) -> int:
    """How many devices to trace ``topology`` on: its chips, or for more than one process can
    trace, the largest quarter, sixteenth... of them that fits."""
    chips = topology_chips(topology)
    devices = chips
    while devices > MAX_TRACE_DEVICES:
        if devices % 4:
            raise ValueError(f"topology {topology!r} has {chips} chips: too many to trace in one process "
                             f"(at most {MAX_TRACE_DEVICES}) and not a multiple of 4 to trace on a smaller mesh")
        devices //= 4
    return devices


def target_mesh_shape(engine: CapturedEngine, chips: int) -> dict:
    """The mesh the engine would build on ``chips`` devices (its ``spmd.mesh`` config)."""
    if engine.validated_config.spmd.dcn_mesh is not None:
        raise ValueError("spmd.dcn_mesh: a multi-slice mesh cannot be traced on fewer devices than chips")
    return resolve_mesh_shape(engine.validated_config.spmd.mesh, chips)


def _axes_of(tiles: np.ndarray, mesh: np.ndarray) -> Optional[list[tuple[int, ...]]]:
    """Which mesh axes, in order, make up each dimension of a tile assignment: the
    assignment is ``mesh.transpose(order).reshape(tiles.shape)`` for some axis order, with
    consecutive axes grouped into each tile dimension. None when it is not of that form."""
    k = mesh.ndim
    for order in itertools.permutations(range(k)):
        groups, sizes, position = [], [mesh.shape[a] for a in order], 0
        ok = True
        for dim in tiles.shape:
            group, size = [], 1
            while size < dim and position < k:
                group.append(order[position])
                size *= sizes[position]
                position += 1
            if size != dim:
                ok = False
                break
            groups.append(tuple(group))
        if ok and position == k and np.array_equal(mesh.transpose(order).reshape(tiles.shape), tiles):
            return groups
    return None


def retarget(mlir: str, traced_mesh: dict, target_mesh: dict) -> str:
    """``mlir`` traced on ``traced_mesh`` (axis -> size, devices in row-major order) with
    every annotation moved to ``target_mesh`` (the same axes, each a whole multiple)."""
    if list(traced_mesh) != list(target_mesh) or any(target_mesh[a] % traced_mesh[a] for a in traced_mesh):
        raise ValueError(f"cannot move a program traced on mesh {traced_mesh} to mesh {target_mesh}: the axes must "
                         "be the same and each a whole multiple")
    traced = np.arange(int(np.prod(list(traced_mesh.values())))).reshape(tuple(traced_mesh.values()))
    target = np.arange(int(np.prod(list(target_mesh.values())))).reshape(tuple(target_mesh.values()))
    cache: dict[str, str] = {}

    def move(match: re.Match) -> str:
        key = match.group(0)
        if key not in cache:
            dims = [int(d) for d in match.group(1).split(",")]
            tiles = np.array([int(d) for d in match.group(2).split(",")]).reshape(dims)
            groups = _axes_of(tiles, traced)
            if groups is None:
                raise ValueError(f"sharding {key} is not a layout of the traced mesh {traced_mesh}")
            order = [a for g in groups for a in g]
            new_dims = [int(np.prod([target.shape[a] for a in g])) for g in groups]
            ids = target.transpose(order).reshape(new_dims).ravel()
            cache[key] = (f'mhlo.sharding = "{{devices=[{",".join(map(str, new_dims))}]{",".join(map(str, ids))}'
                          f'{match.group(3) or ""}}}"')
        return cache[key]

    moved = _SHARDING.sub(move, mlir)
    if moved.count("devices=[") != len(re.findall(r"\{devices=\[[^\]]*\]\d", moved)):
        raise ValueError("the traced program has sharding annotations in a form spmdzero cannot move "
                         "(iota device lists)")
    return moved


def check_same_plan(plan, target_mesh: dict) -> None:
    """Refuse when the ZeRO plan at the target size puts some tensor on other axes than the
    traced plan (``zero_spec`` replicates a tensor smaller than the mesh)."""
    named = [(t.name, t.shape) for t in plan.tensors]
    tied = [t.name for t in plan.tensors if t.tied_embedding]
    stacked = [t.name for t in plan.tensors if t.stacked]
    other = make_plan(named, target_mesh, plan.stage, tied, stacked)
    differ = [t.name for t, u in zip(plan.tensors, other.tensors) if t != u]  # every spec and split dim
    if differ:
        raise ValueError(f"the ZeRO plan on mesh {target_mesh} shards {differ[:3]} differently from the traced mesh "
                         f"{dict(plan.mesh_shape)}: this program cannot be moved to it")
