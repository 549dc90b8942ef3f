"""A program of one of the model's methods (``train/module_methods.py`` says which are routed):
``functional_call`` runs a module's ``forward``, so the program hands it a module whose
``forward`` is that method. The rest of the program (placement, gradients, ``engine.backward``
from its outputs, an eager run when it reads values on the host) is the forward's. A method
whose program returns no tensor was called for what it does to the module, which a program
would not keep: the engine runs it on the host module instead (``host_module``)."""

from __future__ import annotations

import torch


class _Method(torch.nn.Module):
    """The model's ``method`` as a module's ``forward``, the model its only child, ``m`` (its
    parameters keep their names under ``m.``)."""

    def __init__(self, module: torch.nn.Module, name: str):
        super().__init__()
        self.m = module
        self.method = name

    def forward(self, *args, **kwargs):
        return getattr(self.m, self.method)(*args, **kwargs)


def entry(module: torch.nn.Module, method: str) -> torch.nn.Module:
    """What a program for ``method`` hands to ``functional_call``."""
    return module if method == "forward" else _Method(module, method)


def keyed(entry_module: torch.nn.Module, tensors: dict) -> dict:
    """The parameters and buffers by their names under ``entry_module``."""
    if isinstance(entry_module, _Method):
        return {f"m.{name}": t for name, t in tensors.items()}
    return tensors
