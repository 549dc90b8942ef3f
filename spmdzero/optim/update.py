"""DeepSpeed's ZeRO-1/2 boundary update as pure functions over one array namespace
(``optim/ops.py``). Both backends run exactly these; neither has a copy.

At an accumulation boundary DeepSpeed's ZeRO optimizer:

1. takes the global norm of the gradients, in fp32 (``sum_of_squares``, ``grad_scale``);
2. divides the gradients by the loss scale and, when the unscaled norm exceeds
   ``gradient_clipping``, by the clip coefficient ``(norm + 1e-6) / gradient_clipping`` too,
   never by less than 1 (``clip_divisor``);
3. under fp16, or bf16 with ``check_grad_overflow``, skips the step when that norm is not
   finite: parameters and states keep their old values (``update_group``, through the
   optimizer's ``scaled_math``);
4. runs the optimizer's math (``SpmdOptimizer._math``);
5. updates the dynamic loss scale (``next_loss_scale``).

``boundary_update`` is that sequence. What a backend brings is where it runs and how the
optimizer's math is applied (``apply``): the torchax backend calls it inside its one jitted
update program with ``jax_ops()`` and applies ``update_group`` to every group there; the
torch_xla engine calls it in its traced step with ``TORCH_OPS`` and applies each group as one
JAX op embedded in its graph (``backends/torch_xla/fused.py``), which runs ``update_group`` too.
Nothing here reads a value back to the host, so a skipped step costs no sync.

State is plain data, as in optax: ``init_loss_scale``/``next_loss_scale`` are an init/update
pair over ``LossScale``, a tuple of scalars; an optimizer's per-parameter state is a dict of
arrays that its ``_initial_state`` makes and its ``_math`` returns anew.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from spmdzero.optim.precision import PrecisionPolicy

CLIP_EPS = 1e-6  # DeepSpeed's: clip = (norm + 1e-6) / max_norm


class LossScale(NamedTuple):
    """DeepSpeed's ``DynamicLossScaler`` fields, as float32 scalars (device arrays in a step)."""

    scale: Any
    hysteresis: Any
    last_overflow_iter: Any
    iteration: Any


class GradScale(NamedTuple):
    """What the boundary step derives from the gradients before the optimizer's math."""

    norm: Any  # the global gradient norm: unscaled by the loss scale, before clipping
    multiplier: Any  # every gradient is multiplied by it before the math; None for 1
    skip: Any  # True where the gradients are not finite (the step is skipped); None without an overflow check


def init_loss_scale(policy: PrecisionPolicy) -> Optional[LossScale]:
    """The loss scaler's first state, as Python floats (the backend places them), or None when
    the loss is not scaled (fp32, bf16, fp16 with ``loss_scale: 1``)."""
    if not policy.scales_loss:
        return None
    return LossScale(float(policy.initial_scale), float(policy.hysteresis), -1.0, 0.0)


def next_loss_scale(state: LossScale, overflow, policy: PrecisionPolicy, ops) -> LossScale:
    """DeepSpeed's ``DynamicLossScaler.update_scale`` as a select between its two branches.

    Overflow: halve the scale (not below min_scale) once hysteresis is used up, else use up
    one unit of it. No overflow: refill hysteresis when consecutive; double the scale after
    every loss_scale_window stable steps. DeepSpeed raises when it overflows at the minimum
    scale; here the scale stays at the minimum and the step is skipped. A static scale stays."""
    if not policy.dynamic_loss_scale:
        return state
    scale, hysteresis, last, iteration = state
    full = float(policy.hysteresis)
    # overflow branch
    shift = ops.ones_like(overflow) if policy.hysteresis == 1 else hysteresis == 1
    scale_o = ops.where(shift, ops.clamp(scale / 2.0, policy.min_scale, None), scale)
    hysteresis_o = ops.where(shift, hysteresis, hysteresis - 1)
    # no-overflow branch
    stable = iteration - last - 1
    grow = (stable > 0) & (ops.remainder(stable, policy.scale_window) == 0)
    scale_n = ops.where(grow, scale * 2.0, scale)
    refilled = ops.full_like(hysteresis, full)
    hysteresis_n = refilled if policy.consecutive_hysteresis else ops.where(grow, refilled, hysteresis)
    return LossScale(scale=ops.where(overflow, scale_o, scale_n),
                     hysteresis=ops.where(overflow, hysteresis_o, hysteresis_n),
                     last_overflow_iter=ops.where(overflow, iteration, last),
                     iteration=iteration + 1)


def sum_of_squares(grads, ops):
    """``0 + sum(g * g) + ...`` in fp32, in this order: the global norm's square."""
    total = 0
    for g in grads:
        g = ops.float32(g)
        total = total + (g * g).sum()
    return total


def clip_divisor(norm, max_norm: float, ops):
    """What the gradients are divided by for ``gradient_clipping = max_norm``: at least 1, so
    gradients are never scaled up."""
    return ops.clamp((norm + CLIP_EPS) / max_norm, 1.0, None)


def grad_scale(sum_sq, loss_scale, clipping: float, check_overflow: bool, ops) -> GradScale:
    """The norm, DeepSpeed's combined divisor (the loss scale times the clip coefficient) as a
    multiplier, and the overflow flag, from the gradients' sum of squares. ``loss_scale`` is the
    current scale (a scalar) or None."""
    norm = ops.sqrt(sum_sq) if loss_scale is None else ops.sqrt(sum_sq) / loss_scale
    divisor = loss_scale
    if clipping > 0:
        clip = clip_divisor(norm, clipping, ops)
        divisor = clip if divisor is None else divisor * clip
    multiplier = 1.0 / divisor if divisor is not None else None
    skip = ~ops.isfinite(sum_sq) if check_overflow else None
    return GradScale(norm, multiplier, skip)


def update_group(optimizer, targets: list, grads: list, states: list[dict], hp: dict, static: dict,
                 scale: GradScale, ops) -> tuple[list, list[dict]]:
    """The optimizer's math on one parameter group, tensor by tensor: each gradient cast to its
    target's dtype and multiplied by ``scale.multiplier``, the old values kept where
    ``scale.skip``. ``static`` holds the group's flags that change the formula (bools)."""
    new_targets, new_states = [], []
    for target, grad, state in zip(targets, grads, states, strict=True):
        new_target, new_state = optimizer.scaled_math(target, grad, state, hp, static, ops, scale.multiplier,
                                                      scale.skip)
        new_targets.append(new_target)
        new_states.append(new_state)
    return new_targets, new_states


class BoundaryResult(NamedTuple):
    scale: GradScale
    loss_scale: Optional[LossScale]  # the next loss scaler state (None when the loss is not scaled)
    applied: Any  # what ``apply`` returned


def boundary_update(sum_sq, loss_scale: Optional[LossScale], clipping: float, policy: PrecisionPolicy, ops,
                    apply: Callable[[GradScale], Any]) -> BoundaryResult:
    """One boundary step: the gradient scale and overflow flag from ``sum_sq``, the optimizer's
    math through ``apply(scale)``, then the next loss scaler state."""
    scale = grad_scale(sum_sq, None if loss_scale is None else loss_scale.scale, clipping,
                       policy.check_overflow, ops)
    applied = apply(scale)
    if loss_scale is not None and scale.skip is not None:
        loss_scale = next_loss_scale(loss_scale, scale.skip, policy, ops)
    return BoundaryResult(scale, loss_scale, applied)
