"""torch values as JAX arrays on torchax's runtime, which runs JAX without x64: the dtype a
tensor becomes, a tensor's value as an array, and the warnings those conversions give (matched
where a conversion is meant). Why a module of their own: the engine places values with them,
and the lowerings and the output tensors convert with them too, below the engine."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from spmdzero.train.data import like


def as_dicts(obj):
    """Every non-dict mapping in ``obj`` (a ``BatchEncoding``) as a dict, for torch's pytree."""
    if isinstance(obj, Mapping):
        pairs = ((k, as_dicts(v)) for k, v in obj.items())
        return like(obj, pairs) if isinstance(obj, dict) else dict(pairs)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(as_dicts(v) for v in obj)
    return obj


def as_jax(t: torch.Tensor, env):
    """A tensor's value as a JAX array: a torchax tensor's own, a host tensor's copy."""
    return t._elem if is_torchax_tensor(t) else env.t2j_copy(t.detach())


def is_torchax_tensor(t: torch.Tensor) -> bool:
    from torchax import tensor as ttensor

    return isinstance(t, ttensor.Tensor)


def jax_dtype(dtype: torch.dtype):
    import jax.numpy as jnp

    return jnp.dtype(str(dtype).removeprefix("torch."))


def placed_dtype(dtype: torch.dtype):
    """The dtype of the JAX array ``_put`` makes of a tensor of ``dtype`` (int64 is int32 unless
    JAX runs with x64), for a shape-only engine, which makes none."""
    import jax
    from torchax.ops import mappings

    return jax.dtypes.canonicalize_dtype(mappings.t2j_dtype(dtype))


INT64_TRUNCATED = r"Explicitly requested dtype .*int64.* requested in .* is not available"
# torch's warning when it wraps a read-only host value (JAX's cached one): silenced where the value is copied or only read
READ_ONLY_HOST_VALUE = "The given NumPy array is not writable"
