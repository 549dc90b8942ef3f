"""The torchax backend's JAX mesh: its devices in the order the mesh shape takes them, across
TPU slices too (``spmd.dcn_mesh``).

Why its own module: the mesh shape is the plan's (``sharding.mesh``, the same data on both
backends), but which device sits where is JAX's business. Within one slice the devices keep
JAX's order. Across slices, ``spmd.dcn_mesh``'s axes (``data``) are the outer ones: each slice
holds a contiguous block of every ``data`` index, so ``fsdp``'s reduce-scatters and all-gathers
stay on the slice's ICI links and only the data-parallel reduction crosses DCN, as torch_xla's
``HybridMesh`` lays it out. On TPU, JAX's ``create_hybrid_device_mesh`` finds the slices from the
devices' ``slice_index`` and orders each one for its ICI topology; without slices (CPU devices,
one slice), the devices go in JAX's order, slice by slice. A mesh given to ``initialize`` keeps
its own order (``user_mesh_devices``)."""

from __future__ import annotations

import numpy as np


def jax_devices(count: int) -> list:
    """``count`` JAX devices: JAX's own (the TPU chips on a TPU VM), unless
    ``SPMDZERO_BACKEND=torch_xla`` gave the devices to torch_xla's runtime: then JAX CPU devices,
    as many as torch_xla's runtime has (that runtime would hold any TPU)."""
    from spmdzero.runtime import jax_runtime

    if jax_runtime.selected():
        return jax_runtime.devices()[:count]
    import torch_xla.runtime as xr

    if xr.device_type() != "CPU":
        raise RuntimeError(f"spmd.backend='torchax' on {xr.device_type()} cannot run where "
                           f"{jax_runtime.VARIABLE}=torch_xla gave the {xr.device_type()} devices to torch_xla's runtime "
                           "at `import spmdzero`: unset the variable (in a notebook: restart the kernel first), or use "
                           "spmd.backend='torch_xla'")
    return jax_runtime.cpu_devices(count)


def mesh_devices(devices: list, mesh_shape: dict[str, int], dcn_shape: dict[str, int] | None = None) -> np.ndarray:
    """``devices`` as an array of ``mesh_shape``; ``dcn_shape``: the part of each axis across
    slices (``sharding.mesh.resolve_hybrid_shape``), the rest being within one."""
    if dcn_shape is not None and len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        from jax.experimental import mesh_utils

        ici = tuple(size // dcn_shape[axis] for axis, size in mesh_shape.items())
        return mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn_shape.values()), devices)
    return np.array(devices).reshape(tuple(mesh_shape.values()))


def user_mesh_devices(mesh, device_count: int) -> np.ndarray:
    """The devices of ``initialize(mesh=...)`` in its order: a ``jax.sharding.Mesh``'s own, or a
    torch_xla ``Mesh``'s ``device_ids`` taken as indices into JAX's devices (the same numbering
    on one host). It must cover every device: the plan's batch arithmetic counts them all."""
    from spmdzero.sharding.mesh import is_jax_mesh, mesh_shape

    shape = tuple(mesh_shape(mesh).values())
    size = int(np.prod(shape))
    if size != device_count:
        raise ValueError(f"initialize(mesh=...): the mesh {mesh_shape(mesh)} has {size} devices, but this process "
                         f"drives {device_count}: the mesh must cover them all")
    if is_jax_mesh(mesh):
        return np.asarray(mesh.devices)
    ids = np.asarray(mesh.device_ids).reshape(shape)
    return np.array(jax_devices(device_count), dtype=object)[ids]
