"""Parameters frozen or unfrozen after ``initialize`` (``requires_grad`` changed), as DeepSpeed
and the torch_xla backend treat them.

DeepSpeed builds its ZeRO optimizer's parameter groups at ``initialize`` from the parameters
that require grad then. A parameter frozen later gets no gradient from torch's backward, and the
optimizer still steps it with zeros in its place (its moments decay, weight decay applies); one
unfrozen later is in no group and is never updated (the forward uses its value). The torch_xla
backend does the same (its trained slots are fixed at ``initialize``; a slot without a gradient
gets zeros). Here the trained set stays the one the update program was traced for, and the
training programs hold the parameters frozen since with ``jax.lax.stop_gradient``: their
gradients are zeros, as torch gives none. A change of the frozen set traces the training
programs again once (their key holds it)."""

from __future__ import annotations

import torch


def frozen_since_initialize(module: torch.nn.Module, trained: list[str]) -> frozenset:
    """The trained parameters (by name) that no longer require grad."""
    params = dict(module.named_parameters())
    return frozenset(name for name in trained if not params[name].requires_grad)


def held(params: dict, frozen: frozenset) -> dict:
    """``params`` (traced JAX values by name) with the frozen ones cut from differentiation."""
    if not frozen:
        return params
    import jax

    return {n: jax.lax.stop_gradient(v) if n in frozen else v for n, v in params.items()}
