"""Mixed precision the ZeRO way: which dtype each tensor has, and what the boundary update
checks and scales (``optim/update.py`` holds the overflow check and the dynamic loss scaler,
pure functions on device state, so that overflow never needs a host sync).

* fp32: everything fp32; no overflow check (DeepSpeed checks none either).
* bf16: module params and activations bf16; fp32 master weights and optimizer states,
  sharded like the states; steps with inf/nan gradients are skipped (DeepSpeed's
  ``bf16.check_grad_overflow``, default on); no loss scaling.
* bf16 with ``bf16_master_weights_and_grads`` (DeepSpeed 0.19, the torchax backend): no fp32
  masters; the update reads and writes the bf16 parameters (its math in fp32, as DeepSpeed's
  Adam kernels compute), and with ``bf16_optimizer_states`` keeps its states in bf16.
* fp16: as bf16 with fp16 params, plus DeepSpeed's loss scaling: dynamic
  (``loss_scale: 0``) or static.

Gradients are reduced in ``communication_data_type`` and accumulated in
``data_types.grad_accum_dtype``; both default to the model dtype, as in DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    # bf16.bf16_master_weights_and_grads: the optimizer updates the bf16 parameters themselves
    low_precision_masters: bool = False
    # the dtype of the optimizer's per-element states (bf16.bf16_optimizer_states: bf16)
    state_dtype: torch.dtype = torch.float32
    # torch_autocast: the dtype the forward's autocast computes in (None: no autocast)
    autocast_dtype: Optional[torch.dtype] = None

    @property
    def master_weights(self) -> bool:
        """Low-precision params keep an fp32 master copy that the optimizer updates (unless
        ``low_precision_masters``: then the parameters are the masters)."""
        return self.param_dtype != torch.float32 and not self.low_precision_masters

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
        model, dynamic, initial, check = torch.bfloat16, False, 1.0, cfg.bf16.check_grad_overflow
        extra = {"low_precision_masters": cfg.bf16.bf16_master_weights_and_grads,
                 "state_dtype": torch.bfloat16 if cfg.bf16.bf16_optimizer_states else torch.float32}
    else:
        model, dynamic, initial, extra, check = torch.float32, False, 1.0, {}, False
    accum = DTYPES[cfg.data_types.grad_accum_dtype] if cfg.data_types.grad_accum_dtype else model
    comm = DTYPES[cfg.communication_data_type] if cfg.communication_data_type else model
    if cfg.torch_autocast.enabled:
        extra["autocast_dtype"] = DTYPES[cfg.torch_autocast.dtype]
    return PrecisionPolicy(model, accum, comm, check, dynamic, initial, **extra)


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
