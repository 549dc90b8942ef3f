"""The torch_xla engine's update at an accumulation boundary, traced into the step's graph:
``boundary_update`` (``spmdzero.optim.update``: the global norm, DeepSpeed's clip, the overflow
skip and fp16's loss scale) around the optimizer's math, the fp32 masters cast back into the
parameters and gathered in stages, and every updated state laid out by the plan again; and
``engine.optimizer.step()``, DeepSpeed's ZeRO optimizer stepped by the caller.

Apart from the engine because it is the one part of the step that depends on which optimizer
runs: spmdzero's own apply each parameter group as one fused op (``fused.update``), a client
torch.optim optimizer reads ``.grad`` on the host's terms (its lazily created state, an
overflowed step undone afterwards, ``client_optimizer_step``). Nothing here reads a device
value on the host but that warm-up step's overflow flag.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Optional

import torch

from spmdzero.backends.torch_xla import fused
from spmdzero.backends.torch_xla.annotate import constrain, shard, sharding_text
from spmdzero.backends.torch_xla.gradients import Slot, gradient, memory_orders
from spmdzero.backends.torch_xla.state import optimizer_state
from spmdzero.optim.ops import TORCH_OPS
from spmdzero.optim.optimizers import SpmdOptimizer
from spmdzero.optim.precision import keep_unless
from spmdzero.optim.schedules import LRSchedule
from spmdzero.optim.update import GradScale, boundary_update
from spmdzero.sharding.plan import ShardingPlan


def update(engine, clipping: float) -> Optional[torch.Tensor]:
    """The optimizer's update with the gradients accumulated since the last one, which it
    consumes (the next micro-step starts a new sum): the global norm, clipping to
    ``clipping``, the overflow skip and the loss scale's update, the masters cast back
    into the parameters, every updated state laid out by the plan. Returns the device
    bool "this step overflowed" under overflow checks, else None."""
    policy, slots, plan, mesh = engine.precision, engine._slots, engine.plan, engine.mesh
    with torch.no_grad():
        grads = [gradient(s, plan, mesh, policy.grad_accum_dtype) for s in slots]
        sum_sq = (fused.sum_of_squares(grads, memory_orders(slots, grads, engine._grad_orders)) if grads
                  else torch.zeros((), device=engine.device))
        result = boundary_update(sum_sq, engine._loss_scale, clipping, policy, TORCH_OPS,
                                 functools.partial(apply_optimizer, engine, grads))
        laid_out = result.applied
        for slot in slots:
            slot.grad = None
        engine._window_reduced = False
        engine._step_loss, engine._window_loss = engine._window_loss, None
        if policy.master_weights:  # the compiler all-gathers the cast master shards
            params = [s.param for s in slots]
            torch._foreach_copy_(params, [gathered_in_stages(s, plan, mesh) for s in slots])
            fused.settle(params)
    engine._global_grad_norm = result.scale.norm
    overflow = None
    if policy.check_overflow:
        overflow = result.scale.skip
        engine._loss_scale = result.loss_scale
        engine._last_overflow, engine._step_applied = overflow, ~overflow
    else:
        engine._step_applied = True
    annotate_updated(engine, laid_out)
    return overflow


def optimizer_step(engine) -> None:
    """``engine.optimizer_step()`` (see there)."""
    if engine._capture is not None:  # trace the update for the TPU compiler; execute nothing
        update(engine, optimizer_clipping(engine))
        engine._capture.record()
        return
    call = "engine.optimizer.step()"
    if engine._backward_since_step and not engine._window_reduced:
        gas = engine.gradient_accumulation_steps()
        raise RuntimeError(
            f"{call} inside a gradient accumulation window (micro-step {engine.micro_steps % gas + 1} of {gas}): the "
            "last engine.backward() was not at the accumulation boundary, so the window's gradients are "
            "incomplete (DeepSpeed's ZeRO optimizer has none reduced then). Call engine.step() after every "
            "micro-step; call engine.optimizer.step() only after the backward of a micro-step where "
            "engine.is_gradient_accumulation_boundary() is True")
    start = time.perf_counter()
    engine._take_gradients(call)
    update(engine, optimizer_clipping(engine))
    engine._end_step(boundary=True)
    engine._step_logger.timers.add("step", time.perf_counter() - start)


def optimizer_clipping(engine) -> float:
    """The clipping of DeepSpeed's optimizer (see ``engine.optimizer_step``)."""
    if engine.plan.stage == 0 and engine.precision.param_dtype == torch.float32:
        return 0.0
    return engine._config.gradient_clipping


def apply_optimizer(engine, grads: list[torch.Tensor], scale: GradScale) -> set[int]:
    """The optimizer's math for ``boundary_update``; returns the ids of the parameters whose
    new values already carry their shardings (set inside the fused op)."""
    optimizer = engine.optimizer.optimizer
    if not isinstance(optimizer, SpmdOptimizer):
        client_optimizer_step(engine, grads, scale.multiplier, scale.skip)
        return set()
    # scale, update and overflow select: one op per group. Old buffers are reused only by a
    # step that the sync after it executes, and not under engine.compile(): dynamo's cached
    # graphs keep reading the old ones.
    donate = engine._capture is None and not engine.is_compiled
    gather = functools.partial(gather_text, engine.plan, engine.mesh, engine.optimized_names())
    optimizer.step(grads={s.target: g for s, g in zip(engine._slots, grads)}, grad_scale=scale.multiplier,
                   skip=scale.skip, donate=donate, group_update=functools.partial(fused.update, gather=gather))
    return optimizer.laid_out


def client_optimizer_step(engine, grads: list, inverse: Optional[torch.Tensor],
                          overflow: Optional[torch.Tensor]) -> None:
    """A torch.optim optimizer reads ``.grad``; an overflowed step is undone afterwards.

    Its first step creates its state (torch's lazy state: nothing is made up before, see
    ``spmdzero.optim.optimizers``); ``annotate_updated`` then lays the new tensors out
    by the plan, and from the next step on the graph is the same every step. An
    overflowed step must not leave state it created: the next step must be torch's first
    again (SGD's momentum buffer is the first applied gradient, not one derived from
    inf), and whether a key exists is decided on the host. So a step that creates state
    under overflow checks (fp16, bf16's ``check_grad_overflow``) reads its overflow flag:
    only the steps before the first applied one (warm-up), never after."""
    slots = engine._slots
    grads = [g.float() if inverse is None else g.float() * inverse for g in grads]
    state = engine.optimizer.optimizer.state
    keys_before = {s.target: set(state[s.target]) if s.target in state else None for s in slots}
    updated = [s.target for s in slots] + [t for k, (t, _) in engine.state_tensors().items()
                                           if k.startswith("optim.")]
    before = [t.clone() for t in updated] if overflow is not None else None
    for slot, grad in zip(slots, grads):
        slot.target.grad = grad
    engine.optimizer.optimizer.step()
    for slot in slots:
        slot.target.grad = None
    created = {t: keys for t, keys in keys_before.items() if set(state.get(t, ())) != (keys or set())}
    engine._creating_state = bool(created)
    if overflow is None:
        return
    keep_unless(overflow, updated, before)
    if created and engine._capture is None:  # a captured step is put back as a whole (restore_snapshot)
        import torch_xla

        torch_xla.sync()  # the step so far, executed: its overflow flag is then read without a second run
        if bool(overflow):
            for target, keys in created.items():
                if keys is None:
                    state.pop(target, None)
                else:
                    for key in set(state[target]) - keys:
                        del state[target][key]


def step_scheduler_if(engine, applied: torch.Tensor, lr_kwargs: Optional[dict]) -> None:
    """DeepSpeed does not step the schedule on a skipped step. DeepSpeed's schedules do
    that in the graph; other schedulers step on the host every boundary (warned)."""
    scheduler = engine.lr_scheduler
    if scheduler is None:
        return
    if isinstance(scheduler, LRSchedule) and not lr_kwargs:
        scheduler.step_if(applied)
        return
    if not getattr(engine, "_warned_host_scheduler", False):
        engine._warned_host_scheduler = True
        warnings.warn(f"spmdzero: {type(scheduler).__name__} steps on every boundary, including steps "
                      "skipped for overflow (DeepSpeed does not step it then); use a DeepSpeed schedule from the "
                      "config for the exact behaviour", stacklevel=3)
    scheduler.step(**(lr_kwargs or {}))


def gathered_in_stages(slot: Slot, plan: ShardingPlan, mesh) -> torch.Tensor:
    """The updated master, cast to the parameter's dtype and laid out through its ZeRO stages
    backwards on two fsdp axes (``TensorPlan.gather_layouts``), so that the compiler gathers
    it one axis at a time: over both at once, libtpu 0.0.21 all-reduced the parameters on
    v5p:4x4x8 (a 2-layer Llama at ZeRO-2: 1.73x the minimum, no all-gather). Else the master."""
    planned = plan[slot.name]
    if plan.stage >= 3 or len(planned.zero_stages) < 2:
        return slot.target
    value = slot.target.to(slot.param.dtype)
    for spec in planned.gather_layouts[:-1]:
        value = constrain(value, mesh, spec)
    return value


def gather_text(plan: ShardingPlan, mesh, target_names: dict, target: torch.Tensor) -> tuple[str, ...]:
    """For the fused update (``fused.update``'s ``gather``): the layouts, as HLO sharding text,
    that an updated parameter passes through between its state's layout and its own
    (``TensorPlan.gather_layouts``, less the last): one fsdp axis at a time on two fsdp axes,
    none on one. (A master's layout is its state's: its cast is gathered by
    ``gathered_in_stages``.)"""
    planned = plan.get(target_names.get(target, ""))
    if planned is None or plan.stage >= 3 or len(planned.zero_stages) < 2:
        return ()
    return tuple(sharding_text(mesh, spec) for spec in planned.gather_layouts[:-1])


def annotate_updated(engine, laid_out: set[int]) -> None:
    """``lay_out_state`` for what an update changed, less the targets (by id) whose new values
    and states already carry their shardings (the fused update sets them inside its op):
    ~20 us per annotation, which for 700 tensors was most of the update's tracing."""
    mesh, plan, state = engine.mesh, engine.plan, engine.optimizer.optimizer.state
    for slot in engine._slots:
        planned = plan[slot.name]
        if slot.target is not slot.param:  # the param is a fresh cast of the master
            shard(slot.param, mesh, planned.param)
        if id(slot.target) in laid_out:
            continue
        shard(slot.target, mesh, planned.param if slot.target is slot.param else planned.master)
        for _, (value, spec) in optimizer_state(plan, slot.name, slot.target, state[slot.target]):
            shard(value, mesh, spec)
    if engine._loss_scale is not None:
        for value in engine._loss_scale:
            shard(value, mesh, ())
