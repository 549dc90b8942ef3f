"""Small integers known while a step is traced, computed then, as torch computes them.

Why: under ``jax.jit`` every JAX op is staged, even on constants. So ``torch.tensor([...],
device=...)`` of Python numbers became a traced value, and a size computed from it (``.tolist()``,
``unique_consecutive``) a host read, which sent the whole forward down the eager path
(``host_reads``). transformers 4.x's Qwen2.5-VL makes its window boundaries so
(``torch.unique_consecutive(torch.tensor(list, device=...))``, then ``(cu[1:] - cu[:-1]).tolist()``
in its attention).

``install`` makes torchax's ``torch.tensor`` of numbers, and every op whose tensors are all known
small integers or booleans (at most ``_SMALL`` values each: sizes, offsets, boundaries; host
tensors too, so Mistral 3's ``torch.as_tensor(image_sizes, device=...)`` of its host sizes, kept
there by ``shape_inputs``, stays known), run under
``jax.ensure_compile_time_eval``: what they make is a constant of the program. What is computed
from the inputs, and anything large or of floats, is traced as before: a mask is not folded into
the program as a constant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch

from spmdzero.backends.torchax.placement import INT64_TRUNCATED

_SMALL = 4096


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

    def known(args, kwargs) -> bool:
        tensors = [t for t in jax.tree_util.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(small_integers(t) for t in tensors)

    @contextlib.contextmanager
    def evaluated():
        with jax.ensure_compile_time_eval(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", INT64_TRUNCATED, UserWarning)  # x64 off: int32, as traced
            yield

    dispatch = env.dispatch

    def dispatch_known(func, types, args, kwargs=None):
        if known(args, kwargs):
            with evaluated():
                return dispatch(func, types, args, kwargs)
        return dispatch(func, types, args, kwargs)

    env.dispatch = dispatch_known
    factory = torch._C._VariableFunctions.tensor  # the function torchax keys (spmdzero's runtime wraps torch.tensor)
    numbers = env._ops[factory].func

    def tensor(*args, **kwargs):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
            return numbers(*args, **kwargs)
        with evaluated():
            return numbers(*args, **kwargs)

    env._ops[factory] = dataclasses.replace(env._ops[factory], func=tensor)
