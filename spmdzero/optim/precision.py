"""Mixed precision the ZeRO way: which dtype each tensor has, and dynamic loss scaling as
pure functions on device state, so that overflow never needs a host sync.

* fp32: everything fp32; no overflow check (DeepSpeed checks none either).
* bf16: module params and activations bf16; fp32 master weights and optimizer states,
  sharded like the states; steps with inf/nan gradients are skipped (DeepSpeed's
  ``bf16.check_grad_overflow``, default on); no loss scaling.
* fp16: as bf16 with fp16 params, plus DeepSpeed's loss scaling: dynamic
  (``loss_scale: 0``) or static.

Gradients are reduced in ``communication_data_type`` and accumulated in
``data_types.grad_accum_dtype``; both default to the model dtype, as in DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from spmdzero.config.schema import DeepSpeedConfig

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "bfloat": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    communication_dtype: torch.dtype
    check_overflow: bool
    dynamic_loss_scale: bool
    initial_scale: float  # the static scale when not dynamic
    scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0

    @property
    def master_weights(self) -> bool:
        """Low-precision params keep an fp32 master copy that the optimizer updates."""
        return self.param_dtype != torch.float32

    @property
    def scales_loss(self) -> bool:
        return self.dynamic_loss_scale or self.initial_scale != 1.0


def precision_policy(cfg: DeepSpeedConfig) -> PrecisionPolicy:
    if cfg.fp16.enabled:
        model, fp16 = torch.float16, cfg.fp16
        dynamic = fp16.loss_scale == 0
        initial = 2.0 ** fp16.initial_scale_power if dynamic else fp16.loss_scale
        extra = dict(scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                     consecutive_hysteresis=fp16.consecutive_hysteresis, min_scale=float(fp16.min_loss_scale))
        check = True
    elif cfg.bf16.enabled:
        model, dynamic, initial, extra, check = torch.bfloat16, False, 1.0, {}, cfg.bf16.check_grad_overflow
    else:
        model, dynamic, initial, extra, check = torch.float32, False, 1.0, {}, False
    accum = DTYPES[cfg.data_types.grad_accum_dtype] if cfg.data_types.grad_accum_dtype else model
    comm = DTYPES[cfg.communication_data_type] if cfg.communication_data_type else model
    return PrecisionPolicy(model, accum, comm, check, dynamic, initial, **extra)


class LossScaleState(NamedTuple):
    """DeepSpeed's DynamicLossScaler fields, as float32 device scalars."""

    scale: torch.Tensor
    hysteresis: torch.Tensor
    last_overflow_iter: torch.Tensor
    iteration: torch.Tensor


def init_loss_scale(policy: PrecisionPolicy, device) -> LossScaleState:
    values = torch.tensor([policy.initial_scale, policy.hysteresis, -1.0, 0.0], dtype=torch.float32).to(device)
    return LossScaleState(*values.unbind())


def update_loss_scale(state: LossScaleState, overflow: torch.Tensor, policy: PrecisionPolicy) -> LossScaleState:
    """DeepSpeed's ``DynamicLossScaler.update_scale`` as a select between its two branches.

    Overflow: halve the scale (not below min_scale) once hysteresis is used up, else use
    up one unit of it. No overflow: refill hysteresis when consecutive; double the scale
    after every loss_scale_window stable steps. DeepSpeed raises when it overflows at the
    minimum scale; here the scale stays at the minimum and the step is skipped."""
    if not policy.dynamic_loss_scale:
        return state
    scale, hysteresis, last, iteration = state
    full = float(policy.hysteresis)
    # overflow branch
    shift = torch.ones_like(overflow) if policy.hysteresis == 1 else hysteresis == 1
    scale_o = torch.where(shift, torch.clamp(scale / 2.0, min=policy.min_scale), scale)
    hysteresis_o = torch.where(shift, hysteresis, hysteresis - 1)
    # no-overflow branch
    stable = iteration - last - 1
    grow = (stable > 0) & (torch.remainder(stable, policy.scale_window) == 0)
    scale_n = torch.where(grow, scale * 2.0, scale)
    if policy.consecutive_hysteresis:
        hysteresis_n = torch.full_like(hysteresis, full)
    else:
        hysteresis_n = torch.where(grow, torch.full_like(hysteresis, full), hysteresis)
    return LossScaleState(
        scale=torch.where(overflow, scale_o, scale_n),
        hysteresis=torch.where(overflow, hysteresis_o, hysteresis_n),
        last_overflow_iter=torch.where(overflow, iteration, last),
        iteration=iteration + 1,
    )


def is_overflow(grad_norm_sq: torch.Tensor) -> torch.Tensor:
    """inf/nan anywhere in the gradients makes their sum of squares non-finite."""
    return ~torch.isfinite(grad_norm_sq)


def keep_unless(overflow: torch.Tensor, tensors: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    """Put back the values from before the update where it overflowed (in the graph)."""
    for t, old in zip(tensors, before):
        t.copy_(torch.where(overflow, old, t))


def attach_master_weights(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                          dtype: torch.dtype) -> dict[torch.Tensor, torch.Tensor]:
    """Give every optimized parameter an fp32 master copy, point the optimizer at the
    masters, and cast the module to ``dtype`` in place. Returns {param: master}."""
    masters: dict[torch.Tensor, torch.Tensor] = {}
    for group in optimizer.param_groups:
        group["params"] = [masters.setdefault(p, p.detach().to(torch.float32).clone()) for p in group["params"]]
    for p, master in masters.items():
        if p in optimizer.state:
            optimizer.state[master] = optimizer.state.pop(p)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # keep Parameter identities
    try:
        module.to(dtype)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    return masters
