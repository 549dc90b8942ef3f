"""``deepspeed.ops.lamb``: DeepSpeed's FusedLamb with its defaults, on ``spmdzero.optim.optimizers.Lamb``."""

from spmdzero.optim.optimizers import Lamb


class FusedLamb(Lamb):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
                 weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01, amsgrad=False):
        if max_grad_norm:
            raise ValueError("FusedLamb(max_grad_norm=...) is not supported: use the config's gradient_clipping")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                         min_coeff=min_coeff, amsgrad=amsgrad)
