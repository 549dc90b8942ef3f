"""The torch_xla ``Mesh`` (or ``HybridMesh`` across TPU slices) for a mesh shape resolved by
``sharding.mesh``."""

from __future__ import annotations
import numpy as np
from spmdzero.config.schema import MeshConfig
from spmdzero.sharding.mesh import resolve_hybrid_shape, resolve_mesh_shape


def build_mesh(mesh_config: MeshConfig | None, num_devices: int, dcn_config=None):
    import torch_xla.distributed.spmd as xs

    if dcn_config is not None:
        ici, dcn = resolve_hybrid_shape(mesh_config, dcn_config, num_devices)
        return xs.HybridMesh(ici_mesh_shape=tuple(ici.values()), dcn_mesh_shape=tuple(dcn.values()),
                             axis_names=tuple(ici))
    shape = resolve_mesh_shape(mesh_config, num_devices)
    return xs.Mesh(np.arange(num_devices), tuple(shape.values()), tuple(shape))
