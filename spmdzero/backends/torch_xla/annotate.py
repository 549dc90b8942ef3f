"""Apply a ``ShardingPlan`` to live tensors with ``mark_sharding``.

The compiler sees only these annotations: it inserts the gradient reduce-scatter and the
parameter all-gather that ZeRO needs. Annotations are re-applied after every update
because an executed graph's outputs otherwise take whatever sharding GSPMD chose.
"""

from __future__ import annotations

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
