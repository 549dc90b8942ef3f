"""The torch_xla engine's state protocol: every persistent device tensor by checkpoint key with
its plan layout (``state_tensors``), the layout put back after anything wrote it (``lay_out``),
the step state kept on the device, and the snapshot a TPU capture takes before it traces a step
and puts back after (``snapshot``/``restore_snapshot``).

Apart from the engine because the layers above it (checkpoints, ``spmdzero.tpu.capture``,
reports) need this small protocol, not its fields; and together because each part must change
whenever the state does: a new kind of state is a new key, a new layout and a new thing to put
back. The engine's methods (``state_tensors``, ``lay_out_state``, ``snapshot``,
``restore_snapshot``) call these functions.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch

from spmdzero.backends.torch_xla.annotate import shard
from spmdzero.backends.torch_xla.gradients import Slot
from spmdzero.optim.schedules import LRSchedule
from spmdzero.optim.update import LossScale
from spmdzero.sharding.plan import ShardingPlan, replicated

# What a traced step changes on the engine besides its tensors (``snapshot``): copied values,
# and objects that a step rebinds rather than updates in place.
_STEP_ATTRIBUTES = ("global_steps", "global_samples", "micro_steps", "_step_applied", "_last_overflow",
                    "_global_grad_norm", "_loss_scale", "_skipped_on_device", "_rows_since_step",
                    "_backward_since_step", "_window_reduced", "_creating_state", "samples_last_step")
_REBOUND_ATTRIBUTES = ("_last_loss", "_window_loss", "_step_loss", "_input_shapes")


@dataclass
class EngineSnapshot:
    """What ``SpmdZeroEngine.snapshot`` kept; only ``restore_snapshot`` reads it."""

    tensors: dict  # state key -> the live tensor
    values: Optional[dict]  # state key -> a clone holding its value (None: not kept)
    attrs: dict
    pending: list  # each slot's pending gradient
    groups: list  # copies of the optimizer's param groups
    scheduler: Optional[dict]
    optimizer_state: dict  # target -> a copy of its state dict (which keys it has: torch's are created lazily)
    host_values: dict  # (target, key) -> a clone of a host tensor of its state (torch increments Adam's in place)


def state_tensors(module: torch.nn.Module, plan: ShardingPlan, slots: list[Slot], optimizer,
                  target_names: dict, loss_scale: Optional[LossScale]) -> dict[str, tuple[torch.Tensor, tuple]]:
    """``engine.state_tensors()`` (see there) over the engine's parts: ``slots`` its trained
    parameters, ``optimizer`` its ZeRO optimizer (or None), ``target_names`` the optimizer
    targets' names, ``loss_scale`` fp16's scaler (or None)."""
    out: dict[str, tuple[torch.Tensor, tuple]] = {}
    for name, p in module.named_parameters():
        planned = plan.get(name)
        out[f"model.{name}"] = (p, planned.param if planned else replicated(p.dim()))
    for name, b in module.named_buffers():
        if b is not None and b.device.type == "xla":
            out[f"buffer.{name}"] = (b, replicated(b.dim()))
    for slot in slots:
        if slot.target is not slot.param:
            out[f"master.{slot.name}"] = (slot.target, plan[slot.name].master)
    if optimizer is not None:
        for target, state in optimizer.optimizer.state.items():
            name = target_names[target]
            for key, (value, spec) in optimizer_state(plan, name, target, state):
                out[f"optim.{name}.{key}"] = (value, spec)
    if loss_scale is not None:
        for field, value in zip(loss_scale._fields, loss_scale):
            out[f"loss_scale.{field}"] = (value, ())
    return out


def optimizer_state(plan: ShardingPlan, name: str, target: torch.Tensor, state: dict):
    """(key, (tensor, spec)) for each device tensor of one target's optimizer state."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.device.type == "xla":
            like_param = tuple(value.shape) == tuple(target.shape)
            yield key, (value, plan[name].optimizer_state if like_param else replicated(value.dim()))


def lay_out(tensors: dict[str, tuple[torch.Tensor, tuple]], mesh) -> None:
    """Annotate each of ``state_tensors``' tensors with its spec."""
    for tensor, spec in tensors.values():
        shard(tensor, mesh, spec)


def keep_step_state_on_device(engine) -> None:
    """Under overflow checks (fp16, bf16's check_grad_overflow) every optimizer step but
    the first reads the skipped-step count and a DeepSpeed schedule's step count and lrs
    from the device, as the previous step left them. Put them there from the start, and
    the first step traces the same graph as the rest: the step compiles once, not twice.
    The caller's next sync materializes them."""
    if not engine.precision.check_overflow:
        return
    if engine._skipped_on_device is None:
        engine._skipped_on_device = torch.zeros((), dtype=torch.float32, device=engine.device)
    if isinstance(engine.lr_scheduler, LRSchedule):
        engine.lr_scheduler.keep_on_device(engine.device)


def snapshot(engine, with_tensors: bool) -> EngineSnapshot:
    """``engine.snapshot()`` (see there)."""
    import torch_xla

    if with_tensors:
        torch_xla.sync()
    tensors = {k: t for k, (t, _) in engine.state_tensors().items()}
    tensors.update({f"grad.{k}": b for k, b in engine.grad_buffers().items()})
    # A clone shares the state's device buffer and keeps pointing at it while the traced
    # step updates the tensor in place (``t.data`` would follow the update).
    values = {k: t.clone() for k, t in tensors.items()} if with_tensors else None
    attrs = {k: copy.copy(getattr(engine, k)) for k in _STEP_ATTRIBUTES}
    # Rebound, never updated in place, by a traced backward or step: the objects are kept
    # (the gradients pending inside an accumulation window, the last loss read by last_loss()).
    attrs.update({k: getattr(engine, k) for k in _REBOUND_ATTRIBUTES})
    optimizer, scheduler = engine.optimizer, engine.lr_scheduler
    groups = [dict(g) for g in optimizer.param_groups] if optimizer else []
    optimizer_state = {t: dict(s) for t, s in optimizer.state.items()} if optimizer else {}
    host_values = {(t, k): v.clone() for t, s in optimizer_state.items() for k, v in s.items()
                   if isinstance(v, torch.Tensor) and v.device.type != "xla"}
    # the schedule's own attributes, not its state_dict(): that reads a device step count back
    # as an int, which the next step sends as a new input and so compiles a new graph
    kept_schedule = {k: v if isinstance(v, torch.Tensor) else copy.copy(v)
                     for k, v in vars(scheduler).items()} if scheduler is not None else None
    return EngineSnapshot(tensors, values, attrs, [slot.grad for slot in engine.trained_parameters()], groups,
                          kept_schedule, optimizer_state, host_values)


def restore_snapshot(engine, snapshot: EngineSnapshot) -> None:
    """``engine.restore_snapshot(snapshot)`` (see there)."""
    import torch_xla

    if snapshot.values is not None:
        # An in-place copy, not a swap of the XLA tensor under the functional wrapper: views
        # (a weight's transpose in the next forward) are rebuilt from the wrapper's base,
        # which a swap would leave at the traced update.
        with torch.no_grad():
            for key, t in snapshot.tensors.items():
                t.copy_(snapshot.values[key])
        # laid out by the plan and executed now, as a graph of its own (compiled once): left
        # pending, the copies would join the next training step's graph and make it a new
        # one to compile
        engine.lay_out_state()
        torch_xla.sync()
    for name, value in snapshot.attrs.items():
        setattr(engine, name, value)
    for slot, grad in zip(engine._slots, snapshot.pending):
        slot.grad = grad
    if engine.optimizer:
        for group, kept in zip(engine.optimizer.param_groups, snapshot.groups):
            group.update(kept)
        # which state exists (a torch optimizer's first step creates it), and its host
        # tensors' values (torch counts Adam's steps in a CPU tensor, in place)
        state = engine.optimizer.state
        for target in [t for t in state if t not in snapshot.optimizer_state]:
            del state[target]
        for target, kept in snapshot.optimizer_state.items():
            state[target] = dict(kept)
        with torch.no_grad():
            for (target, key), value in snapshot.host_values.items():
                state[target][key].copy_(value)
    if snapshot.scheduler is not None:
        vars(engine.lr_scheduler).update(snapshot.scheduler)
    for p in engine.module.parameters():
        p.grad = None
