"""Apply a ``ShardingPlan`` to live tensors with ``mark_sharding``.

The compiler sees only these annotations: it inserts the gradient reduce-scatter and the
parameter all-gather that ZeRO needs. Annotations are re-applied after every update
because an executed graph's outputs otherwise take whatever sharding GSPMD chose.
"""

from __future__ import annotations

import torch

from .plan import PartitionSpec, ShardingPlan, replicated


def shard(t: torch.Tensor, mesh, spec: PartitionSpec) -> None:
    """``xs.mark_sharding`` minus its per-call attempt to import the optional ``torchax``
    package, which costs a failed filesystem import search on every annotation when it is
    not installed (about half a millisecond: it dominated small models' step time)."""
    import torch_xla

    torch_xla._XLAC._xla_mark_sharding(t, mesh.get_op_sharding(tuple(spec)))


def annotate_params(named_params, plan: ShardingPlan, mesh) -> None:
    for name, p in named_params:
        planned = plan.get(name)
        spec = planned.param if planned else replicated(p.dim())
        shard(p, mesh, spec)


def annotate_grad_buffers(buffers: dict, plan: ShardingPlan, mesh) -> None:
    """``buffers`` maps parameter name -> its gradient accumulation buffer."""
    for name, buf in buffers.items():
        shard(buf, mesh, plan[name].grad)


def annotate_optimizer_state(optimizer, param_names: dict, plan: ShardingPlan, mesh) -> None:
    """Per-parameter state shaped like its parameter follows the plan; other state
    (step counters) is replicated. State kept on the host (CPU tensors) is left alone."""
    for p, state in optimizer.state.items():
        spec = plan[param_names[p]].optimizer_state if p in param_names else None
        for value in state.values():
            if not isinstance(value, torch.Tensor) or value.device.type != "xla":
                continue
            same_shape = spec is not None and tuple(value.shape) == tuple(p.shape)
            shard(value, mesh, spec if same_shape else replicated(value.dim()))
