"""The one array namespace that spmdzero's update math is written against, in three
implementations: Python floats on the host, torch tensors, and JAX arrays.

The optimizers' math (``SpmdOptimizer._math``), the boundary update (``optim/update.py``: global
norm, clipping, overflow skip, loss scaling) and DeepSpeed's LR schedules are each written once,
as functions of an ``ops`` argument:

* ``HOST_OPS``: Python floats (float64), DeepSpeed's exact schedule values on the host;
* ``TORCH_OPS``: torch tensors, for the torch_xla engine's graph and for CPU tensors in tests;
* ``jax_ops()``: JAX arrays, for the torch_xla engine's fused update (embedded in its graph)
  and for the torchax backend's update program.

Every namespace has the same names, so a formula never asks which one it runs on. The formulas
are branch-free (both sides of a ``where`` are evaluated), which is what lets the same one run
on the host and in a compiled step.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch


def _host_clamp(x, low, high):
    if low is not None:
        x = max(x, low)
    return x if high is None else min(x, high)


HOST_OPS = SimpleNamespace(
    cast=lambda x, like: float(x), where=lambda cond, a, b: a if cond else b, sqrt=math.sqrt, log=math.log,
    cos=math.cos, floor=math.floor, remainder=lambda a, b: a % b, maximum=max, minimum=min, clamp=_host_clamp,
    isfinite=math.isfinite, float32=float, sign=lambda x: float((x > 0) - (x < 0)), full_like=lambda x, value: float(value))


def _tensor_bound(op):
    """``torch.clamp`` as a binary maximum/minimum where either side may be a Python number."""
    def bound(a, b):
        return op(a, b) if isinstance(a, torch.Tensor) else op(b, a)
    return bound


TORCH_OPS = SimpleNamespace(
    cast=lambda x, like: x.to(like.dtype), where=torch.where, sqrt=torch.sqrt, log=torch.log, cos=torch.cos,
    floor=torch.floor, remainder=torch.remainder,
    maximum=_tensor_bound(lambda t, low: torch.clamp(t, min=low)),
    minimum=_tensor_bound(lambda t, high: torch.clamp(t, max=high)),
    clamp=lambda x, low, high: torch.clamp(x, min=low, max=high), isfinite=torch.isfinite,
    float32=lambda x: x.float(), sign=torch.sign,
    full_like=torch.full_like, norm=torch.linalg.vector_norm, ones_like=torch.ones_like)


def jax_ops(**extra) -> SimpleNamespace:
    """``TORCH_OPS`` on JAX arrays (``extra``: a backend's own additions, such as the torch_xla
    fused op's ``layout``). Built on call: importing JAX is left to the backends that use it."""
    import jax.numpy as jnp

    return SimpleNamespace(
        cast=lambda x, like: x.astype(like.dtype), where=jnp.where, sqrt=jnp.sqrt, log=jnp.log, cos=jnp.cos,
        floor=jnp.floor, remainder=jnp.remainder, maximum=jnp.maximum, minimum=jnp.minimum, clamp=jnp.clip,
        isfinite=jnp.isfinite, float32=lambda x: x.astype(jnp.float32), sign=jnp.sign, full_like=jnp.full_like, norm=jnp.linalg.vector_norm,
        ones_like=jnp.ones_like, **extra)
