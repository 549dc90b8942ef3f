"""The device mesh: a 1-D ``fsdp`` mesh by default, ``data x fsdp`` from the config.

ZeRO shards optimizer states (and, at stage 2, gradients) across the ``fsdp`` devices only;
the batch is split across every data-parallel axis. Their product is DeepSpeed's world size
in the batch arithmetic.

On 16 or more ``fsdp`` devices the ``fsdp`` dimension is factored into two mesh axes,
``fsdp`` (outer) x ``fsdp_inner`` (2 by default, 8 from 128 devices, ``spmd.mesh.fsdp_inner``): libtpu 0.0.21
turns a reduce-scatter over 16 or more chips of a v5e:4x4 or larger slice into an all-reduce
and a slice, but keeps two reduce-scatters over the two axes in turn (the plan splits a
matrix's rows over ``fsdp`` and its columns over ``fsdp_inner``; docs/tpu.md). The
devices and the batch rows keep their order: ``fsdp = 8`` is ``fsdp = 4 x fsdp_inner = 2``."""

from __future__ import annotations
from typing import Mapping
import numpy as np
from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import MeshConfig


FSDP_AXIS = "fsdp"


FSDP_INNER_AXIS = "fsdp_inner"


DATA_AXIS = "data"


FSDP_AXES = (FSDP_AXIS, FSDP_INNER_AXIS)


DATA_PARALLEL_AXES = (DATA_AXIS, FSDP_AXIS, FSDP_INNER_AXIS)


# "auto": from this many fsdp devices on (the first that applies and divides them), an inner
# axis of this size. libtpu reduce-scatters over 4 chips (v5e:2x2) as they are, and over 16
# only one axis at a time. At 128 (v5p:4x4x8, spmdzero aot, traffic over the minimum, inner
# 2 -> 8): Llama-2-70B ZeRO-3 1.09 -> 1.02, Llama-2-7B ZeRO-3 1.07 -> 1.00, ZeRO-2 1.12 -> 1.02.
AUTO_INNER = ((128, 8), (16, 2))


def resolve_mesh_shape(mesh_config: MeshConfig | None, num_devices: int) -> dict[str, int]:
    """Axis sizes by name. No config: ``fsdp`` over all devices. Else fill the -1 entry so
    that ``data * fsdp == num_devices``. Then factor ``fsdp`` (see ``split_fsdp``). Pure; no
    devices needed."""
    if mesh_config is None:
        return split_fsdp({FSDP_AXIS: num_devices}, "auto")
    data, fsdp = mesh_config.data, mesh_config.fsdp
    if data == -1 and fsdp == -1:
        raise ConfigError("spmd.mesh: at most one of 'data' and 'fsdp' may be -1")
    if data == -1:
        data = num_devices // fsdp if num_devices % fsdp == 0 else 0
    if fsdp == -1:
        fsdp = num_devices // data if num_devices % data == 0 else 0
    if data * fsdp != num_devices or data < 1 or fsdp < 1:
        raise ConfigError(
            f"spmd.mesh: data={mesh_config.data} x fsdp={mesh_config.fsdp} does not cover the "
            f"{num_devices} devices"
        )
    return split_fsdp({DATA_AXIS: data, FSDP_AXIS: fsdp}, mesh_config.fsdp_inner)


def split_fsdp(shape: dict[str, int], inner: int | str) -> dict[str, int]:
    """``shape`` with its ``fsdp`` size factored into ``fsdp x fsdp_inner``; ``inner`` is
    ``spmd.mesh.fsdp_inner``: a size, 1 for one axis, or "auto" (``AUTO_INNER``: 2 from 16
    fsdp devices on, 8 from 128, when it divides them)."""
    fsdp = shape[FSDP_AXIS]
    if inner == "auto":
        inner = next((size for start, size in AUTO_INNER if fsdp >= start and fsdp % size == 0), 1)
    if inner != 1 and (fsdp % inner or inner >= fsdp):
        raise ConfigError(f"spmd.mesh.fsdp_inner: {inner} must divide the fsdp size {fsdp} and be "
                          f"smaller than it (1 keeps a single fsdp axis)")
    if inner == 1:
        return shape
    return {**shape, FSDP_AXIS: fsdp // inner, FSDP_INNER_AXIS: inner}


def resolve_hybrid_shape(mesh_config: MeshConfig | None, dcn_config, num_devices: int
                         ) -> tuple[dict[str, int], dict[str, int]]:
    """(ICI shape within a slice, DCN shape across slices) for multislice. The slices are
    ``dcn.data`` (``fsdp`` never crosses DCN: optimizer states shard over ICI only); the
    in-slice mesh fills the devices of one slice. The global mesh is their product."""
    slices = dcn_config.data
    if num_devices % slices:
        raise ConfigError(f"spmd.dcn_mesh: data={slices} slices do not divide the {num_devices} devices")
    ici = resolve_mesh_shape(mesh_config or MeshConfig(data=1, fsdp=-1), num_devices // slices)
    return ici, {axis: slices if axis == DATA_AXIS else 1 for axis in ici}


def global_shape(ici: dict[str, int], dcn: dict[str, int]) -> dict[str, int]:
    return {axis: ici[axis] * dcn[axis] for axis in ici}


MESH_KINDS = {"torch_xla": "a torch_xla.distributed.spmd.Mesh", "jax": "a jax.sharding.Mesh"}


def check_user_mesh(mesh, kinds: tuple[str, ...] = ("torch_xla",)) -> None:
    """``initialize(mesh=...)``: a mesh of one of the ``kinds`` the backend takes (``MESH_KINDS``)
    with an ``fsdp`` axis."""
    found = "torch_xla" if is_torch_xla_mesh(mesh) else "jax" if is_jax_mesh(mesh) else None
    if found not in kinds:
        raise TypeError(f"mesh must be {' or '.join(MESH_KINDS[k] for k in kinds)}, got {type(mesh).__name__}"
                        + (" (the torchax backend's)" if found == "jax" else ""))
    if FSDP_AXIS not in (mesh.axis_names or ()):
        raise ValueError(
            f"mesh axes {mesh.axis_names} have no {FSDP_AXIS!r} axis; spmdzero shards optimizer "
            f"states along {FSDP_AXIS!r} (name the axis 'fsdp', and 'data' for pure data parallelism)"
        )


def is_torch_xla_mesh(mesh) -> bool:
    """A ``torch_xla.distributed.spmd.Mesh`` (by its fields: torch_xla is an optional install)."""
    return hasattr(mesh, "mesh_shape") and hasattr(mesh, "device_ids") and hasattr(mesh, "axis_names")


def is_jax_mesh(mesh) -> bool:
    """A ``jax.sharding.Mesh`` (by its fields: JAX is imported only by the torchax backend)."""
    return hasattr(mesh, "devices") and hasattr(mesh, "axis_names") and hasattr(mesh, "shape") and not isinstance(
        mesh, str)


def mesh_shape(mesh) -> dict[str, int]:
    """{axis: size} of a torch_xla or a JAX mesh."""
    if is_torch_xla_mesh(mesh):
        return dict(zip(mesh.axis_names, mesh.mesh_shape))
    return dict(mesh.shape)


def fsdp_axes(shape: Mapping[str, int]) -> tuple[str, ...]:
    return tuple(a for a in FSDP_AXES if a in shape)


def fsdp_size(shape: Mapping[str, int]) -> int:
    """How many ways ZeRO splits a tensor: the product of the fsdp axes."""
    return int(np.prod([shape[a] for a in fsdp_axes(shape)]))


def data_parallel_axes(shape: Mapping[str, int]) -> tuple[str, ...]:
    return tuple(a for a in DATA_PARALLEL_AXES if a in shape)


def data_parallel_size(shape: Mapping[str, int]) -> int:
    return int(np.prod([shape[a] for a in data_parallel_axes(shape)]))
