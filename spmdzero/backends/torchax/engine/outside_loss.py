"""A loss computed outside the module (``loss = criterion(engine(x), y)``) on the torchax
backend: the training forward's outputs are tied into torch autograd, so the script's own loss
code runs eagerly on them and ``engine.backward(loss)`` hands the loss's gradient with respect
to those outputs (the cotangents) back to the compiled backward.

Why this shape: the module's forward and backward must stay compiled once, whatever the user's
loss code does. So the forward is one jitted program that returns, beside the outputs, JAX's VJP
of them (``jax.vjp``: the residuals the backward needs, held as arrays between the two programs,
as torch's autograd graph holds them); the loss code is a handful of eager ops on the outputs;
and the backward is one jitted program taking the VJP, the cotangents and the accumulated
gradients. torch autograd does the bookkeeping torch users expect: which forwards a loss came
from, several of them in one loss, ``retain_graph``, and ``x.grad`` for inputs that require grad.

``TiedOutputs`` is the autograd node; the engine (``TorchaxEngine._backward_through``) runs the
programs."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class TiedOutputs(torch.autograd.Function):
    """``apply(record, anchor, *inputs)`` returns ``record.tensors`` (the forward's tensor
    outputs, already computed) as outputs of one autograd node; its backward gives
    ``record.engine`` the cotangents and returns the gradients of ``inputs`` (the host tensors
    that require grad). ``anchor`` is a host scalar that requires grad, so that torch records
    the node when no input does."""

    @staticmethod
    def forward(ctx, record: SimpleNamespace, anchor: torch.Tensor, *inputs: torch.Tensor):
        ctx.record = record
        ctx.set_materialize_grads(False)  # outputs the loss does not use: no eager zeros (the program makes them)
        return tuple(record.tensors)

    @staticmethod
    def backward(ctx, *cotangents):
        record = ctx.record
        return (None, None, *record.engine.gradients.through(record, cotangents))


def tie(record: SimpleNamespace, anchor: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``record.tensors`` as outputs of a ``TiedOutputs`` node (the same values, now with a
    ``grad_fn``); non-float ones do not require grad, as in torch."""
    return list(TiedOutputs.apply(record, anchor, *inputs))
