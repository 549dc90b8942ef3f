"""transformers' and torch's ``Adafactor`` on the torchax backend: their updates, the step count a tensor.

Why: the Trainer's ``--optim adafactor`` (and T5's usual recipe, ``Adafactor(relative_step=True,
warmup_init=True)``) hands the engine ``transformers.optimization.Adafactor``, whose ``step()``
keeps the count as a Python number and reads it with ``math.pow``/``math.sqrt``, and the
parameters' RMS with Python's ``max``. Traced into the update program (``torch_optim``) the
count was lost after the first step (only tensor states are kept) and the reads cannot stop a
compiled program; the run stopped at its second step. As a constant of the program the count
would build a new program every step.

How: ``step`` is that class's update written in tensor ops: the count a float32 tensor state
(``"step"``, as torch's capturable optimizers keep theirs, so checkpoints hold it in the host
state as they do the others' counts), ``min``/``max`` as ``torch.minimum``/``clamp``. The rest is
Adafactor's own arithmetic, in its order: the factored second moments of a matrix's gradient
(row and column means), the unfactored one of a vector's, the update clipped by its RMS over
``clip_threshold``, the optional first moment, the weight decay scaled by the step size. A
subclass that overrides ``step`` runs its own, as any torch optimizer does.

torch's own ``torch.optim.Adafactor`` (torch 2.5 and later) keeps its count a tensor, but reads
it with ``.item()``, and the parameter's and the update's norms too, to take Python's ``min``
and ``max`` of them: the update stopped at its first trace. ``torch_step`` is its
single-tensor update with those three as tensors, in its order and with its state keys
(``step``, ``row_var``/``col_var`` for a matrix, ``variance`` for a vector), so that its
``state_dict`` is torch's.
"""

from __future__ import annotations

import torch


def replaces(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is transformers' or torch's Adafactor with that class's own ``step``."""
    return _twin(optimizer) is not None


def step(optimizer: torch.optim.Optimizer) -> None:
    """One step of ``optimizer``, transformers' or torch's Adafactor (``replaces``)."""
    _twin(optimizer)(optimizer)


def _twin(optimizer: torch.optim.Optimizer):
    """The traced update standing in for ``optimizer``'s class's own ``step``; None if it has none."""
    for cls in type(optimizer).__mro__:
        twin = _TWINS.get((cls.__module__, cls.__name__))
        if twin is not None:
            return twin if type(optimizer).step is cls.step else None
    return None


def _rms(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.norm(2) / (tensor.numel() ** 0.5)


@torch.no_grad()
def transformers_step(optimizer: torch.optim.Optimizer) -> None:
    """One step of transformers' Adafactor ``optimizer`` (its groups' hyperparameters, its ``state``)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad.float() if p.grad.dtype in (torch.float16, torch.bfloat16) else p.grad
            state = optimizer.state[p]
            factored, use_first_moment = len(grad.shape) >= 2, group["beta1"] is not None
            if len(state) == 0:
                state["step"] = grad.new_zeros((), dtype=torch.float32)  # a factory would make a host tensor
                if use_first_moment:
                    state["exp_avg"] = torch.zeros_like(grad)
                if factored:
                    state["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1]).to(grad)
                    state["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:]).to(grad)
                else:
                    state["exp_avg_sq"] = torch.zeros_like(grad)
            p_fp32 = p.float() if p.dtype in (torch.float16, torch.bfloat16) else p

            count = state["step"] + 1
            state["step"] = count
            state["RMS"] = _rms(p_fp32)
            size = group["lr"]
            if group["relative_step"]:
                smallest = 1e-6 * count if group["warmup_init"] else count.new_full((), 1e-2)
                size = torch.minimum(smallest, 1.0 / torch.sqrt(count))
            if group["scale_parameter"]:
                size = torch.clamp(state["RMS"], min=group["eps"][1]) * size
            beta2t = 1.0 - torch.pow(count, group["decay_rate"])

            update = grad ** 2 + group["eps"][0]
            if factored:
                row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                row.mul_(beta2t).add_(update.mean(dim=-1) * (1.0 - beta2t))
                col.mul_(beta2t).add_(update.mean(dim=-2) * (1.0 - beta2t))
                r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
                update = torch.mul(r_factor, col.unsqueeze(-2).rsqrt()) * grad
            else:
                second = state["exp_avg_sq"]
                second.mul_(beta2t).add_(update * (1.0 - beta2t))
                update = second.rsqrt() * grad
            update = update / (_rms(update) / group["clip_threshold"]).clamp(min=1.0)
            update = update * size
            if use_first_moment:
                first = state["exp_avg"]
                first.mul_(group["beta1"]).add_(update, alpha=1 - group["beta1"])
                update = first
            if group["weight_decay"] != 0:
                p_fp32.add_(p_fp32 * (-group["weight_decay"] * size))
            p_fp32.add_(-update)
            if p.dtype in (torch.float16, torch.bfloat16):
                p.copy_(p_fp32)


@torch.no_grad()
def torch_step(optimizer: torch.optim.Optimizer) -> None:
    """One step of torch's ``torch.optim.Adafactor`` (``_single_tensor_adafactor``'s arithmetic)."""
    for group in optimizer.param_groups:
        lr, (eps1, eps2), d = group["lr"], group["eps"], group["d"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = -p.grad if group["maximize"] else p.grad
            state = optimizer.state[p]
            if len(state) == 0:
                state["step"] = grad.new_zeros((), dtype=torch.float32)  # a factory would make a host tensor
                if grad.dim() > 1:
                    state["row_var"] = grad.new_zeros((*grad.shape[:-1], 1))
                    state["col_var"] = grad.new_zeros((*grad.shape[:-2], 1, grad.shape[-1]))
                else:
                    state["variance"] = torch.zeros_like(grad)
            floor = torch.finfo(p.dtype).eps if eps1 is None else eps1
            count = state["step"] + 1
            state["step"] = count
            one_minus_beta2 = count ** group["beta2_decay"]
            rho = torch.clamp(count.rsqrt(), max=lr)  # min(lr, 1 / sqrt(step))
            alpha = torch.clamp(_rms(p), min=eps2) * rho
            if group["weight_decay"] != 0:
                p.mul_(1 - lr * group["weight_decay"])
            if grad.dim() > 1:
                row_var, col_var = state["row_var"], state["col_var"]
                row_var.lerp_(torch.norm(grad, dim=-1, keepdim=True).square() / grad.size(-1), one_minus_beta2)
                col_var.lerp_(torch.norm(grad, dim=-2, keepdim=True).square() / grad.size(-2), one_minus_beta2)
                estimate = (row_var @ col_var) / row_var.mean(dim=-2, keepdim=True).clamp(min=floor)
            else:
                variance = state["variance"]
                variance.lerp_(grad * grad, one_minus_beta2)
                estimate = variance
            update = estimate.clamp(min=floor * floor).rsqrt() * grad
            denom = torch.clamp(update.norm(2) / ((update.numel() ** 0.5) * d), min=1.0)
            p.add_(update * (-alpha / denom))


_TWINS = {("transformers.optimization", "Adafactor"): transformers_step, ("torch.optim", "Adafactor"): torch_step}
