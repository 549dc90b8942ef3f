"""A custom ``torch.autograd.Function`` keeps its own ``backward`` in the traced step.

torch differentiates a Function by calling its ``backward``; JAX, tracing the module, sees only
the ops of its ``forward`` and differentiates those. That is the same gradient only where the
backward is the forward's derivative (Bloom's GeLU). A gradient reversal layer (forward the
identity, backward ``-g``), a straight-through estimator (forward ``round``, backward ``g``) or a
clipped or rescaled gradient trained silently on the forward's derivative instead.

Here, while a differentiated program is traced, ``Function.apply`` becomes a ``jax.custom_vjp``
whose forward is the Function's ``forward`` (or ``forward`` then ``setup_context``) and whose
backward is its ``backward``, both run on torchax tensors. What the forward leaves on ``ctx``
is carried to the backward as torch carries it: the tensors it saved (``save_for_backward``) and
any tensor attribute (``ctx.x = x``) as JAX residuals, every other attribute (numbers, shapes,
flags) as it is. ``ctx.needs_input_grad`` says which inputs are floating tensors. The backward's
``None`` for an input is a zero gradient; integer tensors take none.

Not mapped (called as before, their forward differentiated): a Function called with keyword
arguments, with no tensor argument, outside a differentiated trace (an evaluation program, the
host), under a ``torch.func`` transform (transformers 4.x builds its masks under ``torch.vmap``,
indexing through torch's own ``ModIndex`` Function), torch's own Functions (exact derivatives),
and one whose forward returns something other than tensors and plain values.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as torch_pytree

from spmdzero.backends.torchax.lowering.out_arguments import OutArgumentsCopied

# Where a flattened output or ctx value was a traced tensor (its array travels through JAX). Not
# None: a Function may return None among its outputs (TRL's ChunkedLogProbFunction returns the
# statistics it was not asked for as None) or save one (a missing bias), and those stay None.
_TRACED = object()


class Context:
    """The ``ctx`` a Function's forward and backward see: torch's ``FunctionCtx`` API, kept in
    Python (``save_for_backward``, ``saved_tensors``, ``needs_input_grad``, the marks)."""

    def __init__(self, needs_input_grad: tuple):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors) -> None:
        pass  # forward-mode AD: not used by a training step

    def mark_dirty(self, *tensors) -> None:
        pass  # JAX arrays are values: an in-place forward returns its new value either way

    def mark_non_differentiable(self, *tensors) -> None:
        pass  # their cotangents are zeros, which the backward may ignore

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    @property
    def saved_variables(self) -> tuple:  # torch's old name
        return self.saved_tensors


_HELD = ("needs_input_grad", "saved_tensors", "materialize_grads")  # Context's own, rebuilt by the backward


def _is_traced_tensor(value) -> bool:
    from torchax import tensor
    from torchax import view

    return isinstance(value, (tensor.Tensor, view.View))


def _is_float(array) -> bool:
    import jax.numpy as jnp

    return jnp.issubdtype(array.dtype, jnp.inexact)


def apply_as_custom_vjp(function: type, args: tuple, env) -> Any:
    """``function.apply(*args)`` as a ``jax.custom_vjp`` of its tensor arguments (see the module
    docstring), inside a differentiated trace."""
    import jax
    from torchax import tensor

    positions = [i for i, a in enumerate(args) if _is_traced_tensor(a)]
    arrays = [env.t2j_iso(args[i]) for i in positions]
    setup = _has_setup_context(function)
    static: dict = {}  # what the forward's trace found: the output's structure and ctx's plain attributes

    def as_tensors(values):
        return [tensor.Tensor(v, env) for v in values]

    def forward(*primals):
        inputs = list(args)
        for i, t in zip(positions, as_tensors(primals)):
            inputs[i] = t
        ctx = Context(tuple(i in positions and _is_float(primals[positions.index(i)]) for i in range(len(args))))
        # JAX may trace this rule outside the module's environment (a backward program's VJP at
        # ZeRO-3 did, for TRL's SFT loss): torchax's mode, and out= arguments, as in the trace
        outside = contextlib.ExitStack()
        if not getattr(env, "enabled", True):
            outside.enter_context(env)
            outside.enter_context(OutArgumentsCopied())
        with outside, torch.no_grad():  # as torch runs a Function's forward
            if setup:
                output = function.forward(*inputs)
                function.setup_context(ctx, tuple(inputs), output)
            else:
                output = function.forward(ctx, *inputs)
        leaves, spec = torch_pytree.tree_flatten(output)
        if not all(_is_traced_tensor(v) or isinstance(v, (int, float, bool, str, type(None))) for v in leaves):
            raise _NotMapped
        static["output"] = (spec, [_TRACED if _is_traced_tensor(v) else v for v in leaves])
        return [env.t2j_iso(v) for v in leaves if _is_traced_tensor(v)], ctx

    @jax.custom_vjp
    def call(*primals):
        return forward(*primals)[0]

    def call_forward(*primals):
        outputs, ctx = forward(*primals)
        carried = {k: v for k, v in vars(ctx).items() if k not in _HELD}
        carried["__saved__"] = ctx.saved_tensors
        leaves, spec = torch_pytree.tree_flatten(carried)
        traced = [env.t2j_iso(v) for v in leaves if _is_traced_tensor(v)]
        static["ctx"] = (spec, [_TRACED if _is_traced_tensor(v) else v for v in leaves], ctx.needs_input_grad,
                         ctx.materialize_grads)
        static["avals"] = [(p.shape, p.dtype) for p in primals]
        return outputs, traced

    def call_backward(traced, cotangents):
        avals = static["avals"]
        spec, plain, needs, materialize = static["ctx"]
        traced = iter(as_tensors(traced))
        carried = torch_pytree.tree_unflatten([next(traced) if v is _TRACED else v for v in plain], spec)
        ctx = Context(needs)
        ctx.materialize_grads = materialize
        ctx.saved_tensors = tuple(carried.pop("__saved__"))
        for k, v in carried.items():
            setattr(ctx, k, v)
        # JAX runs this after the forward's trace, outside the environment the module ran in and
        # outside ``trace_view.tracing``: its ``out=`` arguments are copied into here (TRL's backward
        # calls ``torch.mm(..., out=buffer)``)
        with env, OutArgumentsCopied():
            # one gradient per output, as torch gives them: None for a plain value or an integer tensor
            cotangents = iter(cotangents)
            given = [next(cotangents) if v is _TRACED else None for v in static["output"][1]]
            grads = function.backward(ctx, *[None if c is None or not _is_float(c) else tensor.Tensor(c, env)
                                             for c in given])
            grads = grads if isinstance(grads, tuple) else (grads,)
            grads = [env.t2j_iso(g) if isinstance(g, torch.Tensor) else None for g in grads]
        out = []
        for i, (shape, dtype) in zip(positions, avals):
            g = grads[i] if i < len(grads) else None
            if not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
                out.append(np.zeros(shape, dtype=jax.dtypes.float0))
            elif g is None:
                out.append(jax.numpy.zeros(shape, dtype))
            else:
                out.append(jax.numpy.broadcast_to(g, shape).astype(dtype))
        return tuple(out)

    call.defvjp(call_forward, call_backward)
    outputs = iter(as_tensors(call(*arrays)))
    spec, plain = static["output"]
    return torch_pytree.tree_unflatten([next(outputs) if v is _TRACED else v for v in plain], spec)


class _NotMapped(Exception):
    """The Function's output is not tensors and plain values: it is called as before."""


def _has_setup_context(function: type) -> bool:
    from torch.autograd.function import _is_setup_context_defined

    return _is_setup_context_defined(function.setup_context)


def mapped(function: type, args: tuple, kwargs: dict):
    """``function.apply(*args)`` as a custom VJP, or ``NotImplemented`` where it is not mapped (see
    the module docstring)."""
    if kwargs or not torch.is_grad_enabled() or function.__module__.startswith("torch."):
        # torch's own Functions are exact derivatives (and its reentrant checkpoint is remat's region)
        return NotImplemented
    if torch._C._are_functorch_transforms_active():  # under torch.vmap (transformers 4.x's masks): its tensors
        return NotImplemented
    traced = [a for a in args if _is_traced_tensor(a)]
    if not traced:
        return NotImplemented
    try:
        return apply_as_custom_vjp(function, args, traced[0]._env)
    except _NotMapped:
        return NotImplemented
