"""A method of the model that a script calls through the engine runs as the engine's forward
does: in a program on the devices, and differentiable by ``engine.backward``.

Why: DeepSpeed's engine answers an attribute it lacks from its module, and on GPUs a method runs
on the parameters where they live, so its result trains. DeepSpeed-Chat's PPO step calls its
critic that way: ``values = critic_engine.forward_value(seq, attention_mask)``, a loss from them,
``critic_engine.backward(loss)``. On this backend the module the engine answers from is the host
copy, in plain torch: such a method ran on the host CPU, and its loss reached no output of the
engine's forward, so ``engine.backward`` refused it.

Which methods: those the model's own classes define (the script's or its library's: DeepSpeed-
Chat's ``RewardModel.forward_value``), called with at least one tensor. The methods of torch's
``nn.Module`` and of the libraries a model is built on (transformers' ``generate``,
``resize_token_embeddings``, ``gradient_checkpointing_enable``, PEFT's) act on the host module
as before, and so does a method called without a tensor (``critic.gradient_checkpointing_enable()``
defined by the script): it configures the module rather than computes with it, and so does one
whose program returns no tensor, which then runs on the host module. A method that
reads values on the host (``.nonzero()``, ``.item()``) runs eagerly, as such a ``forward`` does
(``host_reads``).
"""

from __future__ import annotations

import types

import torch
from torch.utils import _pytree as torch_pytree

# the packages whose methods act on the host module, never traced
LIBRARIES = frozenset({"torch", "transformers", "peft", "accelerate", "trl", "deepspeed", "spmdzero"})


def routed(module: torch.nn.Module, name: str) -> bool:
    """Whether ``engine.<name>`` runs in a program: a plain method of the model's own classes."""
    for cls in type(module).__mro__:
        if name in cls.__dict__:
            return (isinstance(cls.__dict__[name], types.FunctionType)
                    and cls.__module__.split(".")[0] not in LIBRARIES)
    return False


def computes(args: tuple, kwargs: dict) -> bool:
    """A call with a tensor computes with the model; one without configures it."""
    return any(isinstance(leaf, torch.Tensor) for leaf in torch_pytree.tree_leaves((args, kwargs)))


class _Method(torch.nn.Module):
    """``functional_call`` runs a module's ``forward``: this one's is the model's method, with
    the model as its only child, ``m`` (its parameters keep their names under ``m.``)."""

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
