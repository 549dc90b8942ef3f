"""The torchax backend's JAX mesh: its devices in the order the mesh shape takes them, across
TPU slices too (``spmd.dcn_mesh``).

Why its own module: the mesh shape is the plan's (``sharding.mesh``, the same data on both
backends), but which device sits where is JAX's business. Within one slice the devices keep
JAX's order. Across slices, ``spmd.dcn_mesh``'s axes (``data``) are the outer ones: each slice
holds a contiguous block of every ``data`` index, so ``fsdp``'s reduce-scatters and all-gathers
stay on the slice's ICI links and only the data-parallel reduction crosses DCN, as torch_xla's
``HybridMesh`` lays it out. On TPU, JAX's ``create_hybrid_device_mesh`` finds the slices from the
devices' ``slice_index`` and orders each one for its ICI topology; without slices (CPU devices,
one slice), the devices go in JAX's order, slice by slice."""

from __future__ import annotations

import numpy as np


def mesh_devices(devices: list, mesh_shape: dict[str, int], dcn_shape: dict[str, int] | None = None) -> np.ndarray:
    """``devices`` as an array of ``mesh_shape``; ``dcn_shape``: the part of each axis across
    slices (``sharding.mesh.resolve_hybrid_shape``), the rest being within one."""
    if dcn_shape is not None and len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        from jax.experimental import mesh_utils

        ici = tuple(size // dcn_shape[axis] for axis, size in mesh_shape.items())
        return mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn_shape.values()), devices)
    return np.array(devices).reshape(tuple(mesh_shape.values()))
