"""Scalar arguments given as tensors, as a traced optimizer step gives them.

Traced as under ``torch.compile`` (``torch_optim.tracing_as_torch_compile``), torch's optimizers
keep their step count a tensor, so the factors computed from it are tensors too, and they reach
ops whose factor is a number: Adagrad's ``param.addcdiv_(grad, std, value=-clr)``, NAdam's and
RAdam's ``add_(..., alpha=...)``. torch turns such a tensor into a number with ``.item()``, a
host read, which a traced program cannot make. Under ``TensorScalarsComputed`` the factor
multiplies the term instead, as torch's own decomposition computes it
(``self + value * (tensor1 / tensor2)``, ``self + alpha * other``).
"""

from __future__ import annotations

import torch

# the ops and the keyword of their number factor; the term it multiplies
_ALPHA = {torch.add, torch.sub, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.sub, torch.Tensor.sub_}
_VALUE = {torch.addcdiv: torch.div, torch.Tensor.addcdiv: torch.div, torch.Tensor.addcdiv_: torch.div,
          torch.addcmul: torch.mul, torch.Tensor.addcmul: torch.mul, torch.Tensor.addcmul_: torch.mul}
_SUBTRACTS = {torch.sub, torch.Tensor.sub, torch.Tensor.sub_}
_IN_PLACE = {torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.addcdiv_, torch.Tensor.addcmul_}


class TensorScalarsComputed(torch.overrides.TorchFunctionMode):
    """``x.addcdiv_(a, b, value=t)`` as ``x.add_(a / b * t)`` and ``x.add_(y, alpha=t)`` as
    ``x.add_(y * t)`` when ``t`` is a tensor; every other call as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _ALPHA and isinstance(kwargs.get("alpha"), torch.Tensor) and len(args) >= 2:
            term = args[1] * kwargs.pop("alpha")
        elif func in _VALUE and isinstance(kwargs.get("value"), torch.Tensor) and len(args) >= 3:
            term = _VALUE[func](args[1], args[2]) * kwargs.pop("value")
        else:
            return func(*args, **kwargs)
        if func in _SUBTRACTS:
            term = -term
        if func in _IN_PLACE:
            return args[0].add_(term)
        return torch.add(args[0], term, **kwargs)
