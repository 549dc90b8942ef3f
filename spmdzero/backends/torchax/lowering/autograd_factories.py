"""Tensors that torch's autograd formulas make while ``engine.backward`` runs torch autograd over
the engine's outputs (``outside_loss``), made in JAX beside those outputs.

An output is a torchax tensor: a wrapper whose device torch's C++ sees as ``meta``. A backward
formula that makes a new tensor from the gradient's options makes a meta tensor, which holds no
data: ``clamp``'s gradient is ``where(in_range, grad, zeros({}, grad.options()))``, and TRL's
GRPO loss clamps its probability ratio. The next op, on the outputs, cannot copy that tensor to
JAX ("Cannot copy out of meta tensor; no data!"). The same holds for a gradient that reaches an
output through a move to the host: TRL's ORPO returns ``loss.to(args.device)``, which is ``cpu``
here, so the move's backward copies the host gradient to ``meta``. Inside ``made_in_jax``, a call
that makes a tensor on ``meta`` from no tensor, or from host tensors only, is made on the host
instead, with the same arguments, and handed to JAX as an output: the values the formula asked
for, where the outputs are.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils import _pytree as torch_pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _on_meta(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


class _MetaFactoriesInJax(TorchDispatchMode):
    def __init__(self, as_output):
        super().__init__()
        self._as_output = as_output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [leaf for leaf in torch_pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        if _on_meta(kwargs) and all(t.device.type == "cpu" for t in tensors):
            made = func(*args, **{**kwargs, "device": "cpu"})
            return torch_pytree.tree_map_only(torch.Tensor, self._as_output, made)
        return func(*args, **kwargs)


@contextlib.contextmanager
def made_in_jax(as_output):
    """Inside, a tensor made on ``meta`` from nothing or from host tensors is ``as_output(the
    same tensor made on the host)``; every other op runs as it would."""
    with _MetaFactoriesInJax(as_output):
        yield
