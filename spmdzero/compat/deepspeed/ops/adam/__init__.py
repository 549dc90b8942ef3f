"""``deepspeed.ops.adam``: DeepSpeed's Adam classes with DeepSpeed's defaults, on
``spmdzero.optim.optimizers.AdamW`` (whose state GSPMD shards by the ZeRO plan)."""

from spmdzero.optim.optimizers import AdamW


class FusedAdam(AdamW):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        # set_grad_none: the engine drops gradients after every step anyway
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, adam_w_mode=adam_w_mode, amsgrad=amsgrad)


class DeepSpeedCPUAdam(AdamW):
    """DeepSpeed's CPU-offload Adam. spmdzero keeps optimizer states on the devices, sharded
    (no offload), so this is the same update as ``FusedAdam`` with the same defaults."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: spmdzero keeps "
                             "optimizer states in fp32")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, adam_w_mode=adamw_mode, amsgrad=amsgrad)
