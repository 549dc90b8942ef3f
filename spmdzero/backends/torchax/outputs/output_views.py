"""Views of the engine's outputs alias them, as torch's views do: a write through a view reaches
the tensor it views, and a write to that tensor shows in its views.

Why: a JAX array is immutable, and torchax's ops make every slice a copy, so a script's
post-processing of the outputs silently lost its writes. DeepSpeed-Chat's PPO step adds each
row's reward to its last token with ``rewards[j, start:ends[j]][-1] += reward_clip[j]``: the
write went into a copy of a slice of a slice, and the actor trained without its reward.

How: an output made by a view op (its schema returns an alias: slicing, ``select``, ``view``,
``transpose``, ``split``, ``detach``, ...) records the tensor it views (the root, an output that
is no view) and the chain of view ops from it. Its value is the chain replayed on the root's
value whenever the root has changed since (``VERSION``). A write to a view (any in-place op, or
``__setitem__``, which torchax assigns directly) scatters the view's new value into the root:
the chain replayed on an array of the root's flat indices says where each element lives. Only
the write pays for that index array. A view op that changes the dtype (``view(torch.int32)``) is
a copy, as before.
"""

from __future__ import annotations

import functools

import torch

ROOT, CHAIN, SEEN, VERSION = "_spmdzero_view_root", "_spmdzero_view_chain", "_spmdzero_view_seen", \
    "_spmdzero_version"


@functools.lru_cache(maxsize=None)  # asked at every op on an output: the schema is the op's own
def is_view(func) -> bool:
    """An aten op whose result aliases its first argument (its schema returns ``Tensor(a)``)."""
    if not isinstance(func, torch._ops.OpOverload) or func is torch.ops.aten.view.dtype:
        return False
    schema = func._schema
    return not schema.is_mutable and bool(schema.returns) and schema.returns[0].alias_info is not None


def version(root) -> int:
    return root.__dict__.get(VERSION, 0)


def record(result, base, step) -> None:
    """``result`` views ``base`` through ``step`` ((func, args, kwargs, index in a list result))."""
    state = base.__dict__
    root = state.get(ROOT)
    root = base if root is None else root
    result.__dict__.update({ROOT: root, CHAIN: [*state.get(CHAIN, ()), step], SEEN: version(root)})


def replay(chain, value, env):
    """``value`` (a JAX array) through the chain of view ops."""
    from torchax import tensor as ttensor

    t = ttensor.Tensor(value, env)
    with env:
        for func, args, kwargs, index in chain:
            t = func(t, *args, **kwargs)
            if index is not None:
                t = t[index]
    return t._elem


def scatter(root_value, chain, view_value, env):
    """The root's value with the view's elements replaced by ``view_value``."""
    import jax.numpy as jnp

    flat = jnp.arange(root_value.size, dtype=jnp.int32).reshape(root_value.shape)
    where = replay(chain, flat, env).reshape(-1)
    updated = root_value.reshape(-1).at[where].set(jnp.asarray(view_value).reshape(-1).astype(root_value.dtype))
    return updated.reshape(root_value.shape)
