"""The gradient slots of the torch_xla engine: what ``backward`` folds each fresh gradient into,
and what the boundary update (``update``) reads and empties.

A module of its own because the gradients' layouts are where ZeRO's gradient partitioning
happens, apart from the step's orchestration (``engine``). Every trainable parameter has a
slot: its accumulated gradient, laid out by the plan (sharded at ZeRO-2), and the tensor the
optimizer updates (the parameter itself in fp32, its fp32 master weight under mixed
precision). ``take_param_grads`` annotates the fresh ``p.grad`` with the plan's gradient spec,
so the compiler reduce-scatters it, folds it into the slot and drops it, as DeepSpeed's ZeRO
does with its partitioned gradients. The slot holds no buffer between accumulation
boundaries: the first micro-step's gradient *is* the accumulator, so without accumulation the
reduced shard goes straight to clipping and the optimizer, with no zero-fill, add or copy of
a full-size buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from spmdzero.backends.torch_xla import fused
from spmdzero.backends.torch_xla.annotate import constrain, shard
from spmdzero.optim.precision import PrecisionPolicy
from spmdzero.sharding.plan import ShardingPlan


@dataclass(eq=False)
class Slot:
    name: str
    param: torch.Tensor  # the module's parameter (replicated, model dtype)
    target: torch.Tensor  # what the optimizer updates: the param, or its fp32 master weight
    grad: Optional[torch.Tensor] = None  # gradients accumulated since the last boundary (plan's grad spec,
    #                                      grad_accum dtype); None when there are none
    summed: bool = False  # grad is a sum of micro-steps' gradients, not one backward's


def take_param_grads(slots: list[Slot], plan: ShardingPlan, mesh, precision: PrecisionPolicy, scanned,
                     divisor: int = 1) -> None:
    """Move the gradients autograd left in ``param.grad`` into the slots (divided by
    ``divisor``, reduced in ``communication_data_type``, laid out as the plan says, summed in
    ``grad_accum_dtype``). ``scanned``: the parameters whose gradients the layer loop lays out
    (``spmdzero.train.scan_layers.scanned_parameters``)."""
    comm, accum = precision.communication_dtype, precision.grad_accum_dtype
    with torch.no_grad():
        for slot in slots:
            grad = slot.param.grad
            if grad is None:
                continue
            slot.param.grad = None
            if divisor != 1:
                grad = grad / divisor
            planned = plan[slot.name]
            spec = planned.grad
            reduced = grad.to(comm)
            if planned.grad_stages and slot.name in scanned:
                # Laid out through its stages inside the layer loop (spmdzero.backends.torch_xla.scan): a replicated
                # pin here would all-gather the reduce-scattered gradient again.
                shard(reduced, mesh, spec)
                stages = ()
            else:
                # The first layout as the gradient's own (see TensorPlan.grad_layouts), the
                # rest as sharded copies.
                first, *stages = planned.grad_layouts
                shard(reduced, mesh, first)
            for stage in stages:
                reduced = constrain(reduced, mesh, stage)
            grad = reduced.to(accum)
            slot.summed = slot.grad is not None
            if slot.grad is not None:
                # In place: the sum's output takes the accumulator's own buffer (torch_xla
                # donates a tensor updated in place), not a second shard-sized allocation.
                grad = slot.grad.add_(grad)
                fused.settle([grad])
            if grad is not reduced:  # a micro-step's output takes the compiler's layout unless annotated
                shard(grad, mesh, spec)
            slot.grad = grad


def gradient(slot: Slot, plan: ShardingPlan, mesh, dtype: torch.dtype) -> torch.Tensor:
    """The slot's accumulated gradient; zeros (in ``dtype``, laid out by the plan) for a
    parameter that took no part in any backward since the last boundary, which the optimizer
    still steps."""
    if slot.grad is not None:
        return slot.grad
    zeros = torch.zeros(slot.param.shape, dtype=dtype, device=slot.param.device)
    shard(zeros, mesh, plan[slot.name].grad)
    return zeros


def memory_orders(slots: list[Slot], grads: list[torch.Tensor],
                  known: dict[tuple[str, str], Optional[tuple[int, ...]]]) -> list[Optional[tuple[int, ...]]]:
    """Each gradient's dims in memory order (``fused.memory_order``), for the global norm to
    read them that way. Asked once per parameter and kind of gradient (one backward's, a
    sum of micro-steps', zeros), and kept in ``known``: the step's graph, and so its layouts,
    are the same every time."""
    orders = []
    for slot, grad in zip(slots, grads):
        key = (slot.name, "zeros" if slot.grad is None else "sum" if slot.summed else "one")
        if key not in known:
            known[key] = fused.memory_order(grad)
        orders.append(known[key])
    return orders
