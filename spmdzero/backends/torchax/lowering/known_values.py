"""Small integers known while a step is traced, computed then, as torch computes them.

Why: under ``jax.jit`` every JAX op is staged, even on constants. So ``torch.tensor([...],
device=...)`` of Python numbers became a traced value, and a size computed from it (``.tolist()``,
``unique_consecutive``) a host read, which sent the whole forward down the eager path
(``host_reads``). transformers 4.x's Qwen2.5-VL makes its window boundaries so
(``torch.unique_consecutive(torch.tensor(list, device=...))``, then ``(cu[1:] - cu[:-1]).tolist()``
in its attention).

``install`` makes torchax's ``torch.tensor`` of numbers, ``torch.arange`` of numbers, and every op
whose tensors are all known small integers or booleans (at most ``_SMALL`` values each: sizes,
offsets, boundaries; host tensors too, so Mistral 3's ``torch.as_tensor(image_sizes, device=...)``
of its host sizes, kept there by ``shape_inputs``, stays known), run under
``jax.ensure_compile_time_eval``: what they make is a constant of the program, if it is small too.
transformers 4.x's Jamba, Zamba and Zamba2 size their causal mask by ``cache_position[-1] + 1``,
and PhiMoE its rotary table, ``cache_position`` being ``torch.arange(length)`` in a forward without
a cache: a host read of a traced value before. What is computed from the inputs, and anything
large or of floats, is traced as before: a mask is not folded into the program as a constant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch

from spmdzero.backends.torchax.lowering.values import INT64_TRUNCATED

_SMALL = 4096
# ranges of Python numbers: known too (the cache positions a forward without a cache makes)
# (torch._C's own function, the one torchax keys: spmdzero's runtime wraps torch.arange)
_RANGES = frozenset({torch._C._VariableFunctions.arange, torch.ops.aten.arange, torch.ops.aten.arange.default,
                     torch.ops.aten.arange.start, torch.ops.aten.arange.start_step})


def install(env) -> None:
    """``env``'s ``torch.tensor`` of numbers, and its ops on small known integers, evaluated while
    tracing (module docstring). Called once per environment (``lowerings.install``)."""
    import jax
    import jax.numpy as jnp

    def value(t):
        while getattr(t, "_elem", None) is None and hasattr(t, "parent"):  # a lazy view: its base's value
            t = t.parent
        return getattr(t, "_elem", None)

    def small_integers(t) -> bool:
        if type(t) is torch.Tensor:  # a host tensor (an image grid moved to the device: as_tensor, .to)
            return t.numel() <= _SMALL and not (t.is_floating_point() or t.is_complex())
        v = value(t)
        return (isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer) and v.size <= _SMALL
                and (jnp.issubdtype(v.dtype, jnp.integer) or v.dtype == jnp.bool_))

    def known(func, args, kwargs) -> bool:
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not tensors:  # a range of Python numbers (cache_position = torch.arange(length))
            return func in _RANGES and not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
        return all(small_integers(t) for t in tensors)

    def small(result) -> bool:
        """Whether what an evaluated op made is small enough to be a constant of the program."""
        return all(getattr(value(t), "size", 0) <= _SMALL
                   for t in jax.tree_util.tree_leaves(result) if isinstance(t, torch.Tensor))

    @contextlib.contextmanager
    def evaluated():
        with jax.ensure_compile_time_eval(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", INT64_TRUNCATED, UserWarning)  # x64 off: int32, as traced
            yield

    dispatch = env.dispatch

    def dispatch_known(func, types, args, kwargs=None):
        if known(func, args, kwargs):
            with evaluated():
                result = dispatch(func, types, args, kwargs)
            if small(result):
                return result
        return dispatch(func, types, args, kwargs)  # traced: a mask is not folded in as a constant

    env.dispatch = dispatch_known
    factory = torch._C._VariableFunctions.tensor  # the function torchax keys (spmdzero's runtime wraps torch.tensor)
    numbers = env._ops[factory].func

    def tensor(*args, **kwargs):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
            return numbers(*args, **kwargs)
        with evaluated():
            return numbers(*args, **kwargs)

    env._ops[factory] = dataclasses.replace(env._ops[factory], func=tensor)
