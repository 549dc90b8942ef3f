"""Apply a ``ShardingPlan`` to live tensors with ``mark_sharding``.

The compiler sees only these annotations: it inserts the gradient reduce-scatter and the
parameter all-gather that ZeRO needs. Annotations are re-applied after every update
because an executed graph's outputs otherwise take whatever sharding GSPMD chose.
"""

from __future__ import annotations

import numpy as np
import torch

from spmdzero.sharding.plan import PartitionSpec


def shard(t: torch.Tensor, mesh, spec: PartitionSpec) -> None:
    """``xs.mark_sharding`` minus its per-call attempt to import the optional ``torchax``
    package, which costs a failed filesystem import search on every annotation when it is
    not installed (about half a millisecond: it dominated small models' step time)."""
    import torch_xla

    torch_xla._XLAC._xla_mark_sharding(t, mesh.get_op_sharding(tuple(spec)))


def constrain(t: torch.Tensor, mesh, spec: PartitionSpec) -> torch.Tensor:
    """A copy of ``t`` behind a sharding constraint (a ``Sharding`` custom call, like JAX's
    ``with_sharding_constraint``). Unlike ``shard`` on ``t`` itself, the constraint does not
    become the layout of the op that produced ``t``."""
    import torch_xla

    out = t.clone()
    torch_xla._XLAC._xla_annotate_custom_sharding(out, mesh.get_op_sharding(tuple(spec)))
    return out


def sharding_text(mesh, spec: PartitionSpec) -> str:
    """``spec`` on ``mesh`` as HLO sharding text, the form ``_get_xla_sharding_spec`` reads back
    from a tensor that ``shard`` laid out so (tests/test_engine.py checks the two agree).
    An op embedded in torch_xla's graph (``fused``) lays out its inner values with this text:
    torch_xla's ``OpSharding`` has no way to print itself, and a tensor to mark and read back
    would have to be made on the devices."""
    names, sizes = tuple(mesh.axis_names), dict(zip(mesh.axis_names, mesh.mesh_shape))
    per_dim = [() if axes is None else (axes,) if isinstance(axes, str) else tuple(axes) for axes in spec]
    used = [axis for axes in per_dim for axis in axes]
    unused = [axis for axis in names if axis not in used]
    tiles = [int(np.prod([sizes[a] for a in axes], dtype=np.int64)) for axes in per_dim]
    if all(t == 1 for t in tiles):
        return "{replicated}"
    replicas = int(np.prod([sizes[a] for a in unused], dtype=np.int64))
    ids = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)
    order = ids.transpose([names.index(a) for a in used + unused]).reshape(-1)
    dims = tiles + ([replicas] if replicas > 1 else [])
    return ("{devices=[" + ",".join(map(str, dims)) + "]" + ",".join(map(str, order))
            + (" last_tile_dim_replicate" if replicas > 1 else "") + "}")
