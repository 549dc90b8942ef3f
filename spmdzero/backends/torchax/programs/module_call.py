"""A module called with a program's tensors as its parameters and buffers, the host's put back.

``torch.func.functional_call`` puts the host tensors back when it returns, except under a
submodule registered twice (``self.alias = self.shared``, T5's embeddings on transformers 4.x):
it swaps the names one after another, so the second name's "original" is the first one's traced
tensor, and that is what stays. Put back here, exactly, by module: torch's parametrize (PEFT's
LoRA on 5.x experts) also leaves a removed one as a buffer."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def host_tensors_kept(module: torch.nn.Module):
    """Every submodule's parameters and buffers as they were, when the block ends."""
    held = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    try:
        yield
    finally:
        for m, params, buffers in held:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)


def called(module: torch.nn.Module, tensors: dict, args: tuple = (), kwargs: dict | None = None):
    """``module(*args, **kwargs)`` with ``tensors`` (by name) as its parameters and buffers."""
    with host_tensors_kept(module):
        return torch.func.functional_call(module, tensors, args, kwargs)
