"""Which of a model's methods, called through the engine, run as the engine's forward does.

Why: DeepSpeed's engine answers an attribute it lacks from its module, and on GPUs a method runs
on the parameters where they live, so its result trains. DeepSpeed-Chat's PPO step calls its
critic that way: ``values = critic_engine.forward_value(seq, attention_mask)``, a loss from them,
``critic_engine.backward(loss)``. Run as a plain attribute of the module, such a method saw none
of what the engine's forward does: on the torchax backend it ran on the host copy of the module,
and ``engine.backward`` refused its loss; on the torch_xla backend its inputs stayed on the host.

Which methods: those the model's own classes define (the script's or its library's: DeepSpeed-
Chat's ``RewardModel.forward_value``), called with at least one tensor. The methods of torch's
``nn.Module`` and of the libraries a model is built on (transformers' ``generate``,
``resize_token_embeddings``, ``gradient_checkpointing_enable``, PEFT's) act on the module as
before, and so does a method called without a tensor (``critic.gradient_checkpointing_enable()``
defined by the script): it configures the module rather than computes with it.
"""

from __future__ import annotations

import types

import torch
from torch.utils import _pytree as torch_pytree

# the packages whose methods act on the module as attributes, never as the engine's forward
LIBRARIES = frozenset({"torch", "transformers", "peft", "accelerate", "trl", "deepspeed", "spmdzero"})


def routed(module: torch.nn.Module, name: str) -> bool:
    """Whether ``engine.<name>`` runs as the forward does: a plain method of the model's own classes."""
    for cls in type(module).__mro__:
        if name in cls.__dict__:
            return (isinstance(cls.__dict__[name], types.FunctionType)
                    and cls.__module__.split(".")[0] not in LIBRARIES)
    return False


def computes(args: tuple, kwargs: dict) -> bool:
    """A call with a tensor computes with the model; one without configures it."""
    return any(isinstance(leaf, torch.Tensor) for leaf in torch_pytree.tree_leaves((args, kwargs)))
