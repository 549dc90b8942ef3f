"""One optimizer update per parameter group, traced once: the group's math run under JAX and
embedded into torch_xla's lazy graph as a single op.

Tracing an update tensor by tensor costs the host tens of microseconds per op and tensor
(each in-place op runs Python broadcast checks): ~130 ms for a 12-layer GPT-2's AdamW, more
than its forward. Here the optimizer's ``_math`` runs once per group *shape signature* under
``jax.jit``; its HLO is cached and every later step adds one node with the group's tensors as
operands (torch_xla's ``_xla_user_computation``, what ``xla_builder.call_jax`` uses, without
its per-tensor pytree handling). The outputs are copied into the parameters and states in
one ``_foreach_copy_`` call.

Sharding: the embedded computation carries no annotations; GSPMD propagates the operands'
shardings through it, and the engine re-annotates every parameter and state after the
update, as it does after the per-tensor update.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

_CACHE: dict[tuple, Any] = {}
_FUSED_DTYPES = (torch.float32,)


def applies(params: list[torch.Tensor], state) -> bool:
    """fp32 XLA parameters only: JAX promotes a bf16 tensor times an fp32 scalar to fp32 where
    torch keeps bf16, so other dtypes keep the per-tensor torch path (and its results)."""
    return all(p.device.type == "xla" and p.dtype in _FUSED_DTYPES
               and all(s.device.type == "xla" for s in state[p].values()) for p in params)


def update(optimizer, params: list[torch.Tensor], grads: list[torch.Tensor], hp: dict[str, torch.Tensor],
           group: dict, grad_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
    """Apply ``optimizer.scaled_math`` to every tensor of the group as one graph op, in place."""
    n, keys, hp_keys = len(params), tuple(optimizer.state[params[0]]), tuple(hp)
    extras = tuple(name for name, t in (("grad_scale", grad_scale), ("skip", skip)) if t is not None)
    targets = list(params) + [optimizer.state[p][k] for p in params for k in keys]
    head = [hp[k] for k in hp_keys] + [t for t in (grad_scale, skip) if t is not None]
    # Operand order decides buffer reuse. torch_xla numbers a graph's inputs in the order its
    # post-order walk meets them, last operand first, and marks the updated ones as donors;
    # XLA then pairs donors with outputs of the same byte size in input order against output
    # order (OptimizeInputOutputBufferAlias), and the outputs come in the order the tensors
    # were created: parameters, then each parameter's states. Listed last and reversed, the
    # targets are met in that order, so each one's new value takes its own old buffer. Any
    # other order pairs a tensor with another one's buffer, and XLA copies every state in and
    # out of the step to break the cycles (two extra full passes over the optimizer states).
    flat = head + list(grads) + targets[::-1]
    static = {k: v for k, v in group.items() if isinstance(v, bool)}

    def group_update(args, ops):
        tail, grads, mine = args[:len(head)], args[len(head):len(head) + n], args[len(head) + n:][::-1]
        params = mine[:n]
        states = [dict(zip(keys, mine[n + i * len(keys):n + (i + 1) * len(keys)])) for i in range(n)]
        hp = dict(zip(hp_keys, tail))
        extra = dict(zip(extras, tail[len(hp_keys):]))
        new_params, new_states = [], []
        for p, g, state in zip(params, grads, states):
            new_p, new_state = optimizer.scaled_math(p, g, state, hp, static, ops, **extra)
            new_params.append(new_p)
            new_states += [new_state[k] for k in keys]
        return new_params + new_states

    outputs = _call((type(optimizer), tuple(static.items()), keys, hp_keys, extras), group_update, flat)
    # One call for all copies. torch_xla's _replace_xla_tensor would skip the copies but gave
    # wrong values after a checkpoint load (tensors whose data came from copy_ of staged data).
    torch._foreach_copy_(targets, list(outputs))


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``0 + sum(t * t) + ...`` in fp32, in this order (the engine's global-norm expression),
    as one graph op."""
    def total(args, ops):
        out = 0
        for t in args:
            t = t.astype("float32")
            out = out + (t * t).sum()
        return [out]

    return _call(("sum_of_squares",), total, tensors)[0]


def _call(key: tuple, fn, flat: list[torch.Tensor]) -> list[torch.Tensor]:
    """``fn(flat JAX arrays, ops) -> list of arrays`` embedded as one op; lowered once per
    ``key`` and operand shape signature."""
    import torch_xla

    # A bf16/fp16 lazy tensor can be f32 underneath (torch_xla's logical element type), which
    # an embedded computation's parameters must match: hand it fp32, as the torch path computes.
    flat = [t.float() if t.is_floating_point() and t.dtype != torch.float32 else t for t in flat]
    signature = (key, tuple((t.shape, t.dtype) for t in flat))
    computation = _CACHE.get(signature)
    if computation is None:
        computation = _CACHE[signature] = _lower(fn, flat)
    return torch_xla._XLAC._xla_user_computation("xla::spmdzero_fused", flat, computation)


def _lower(fn, flat: list[torch.Tensor]):
    """An XLA computation lowered by JAX for the runtime's platform (lowering starts no JAX
    backend)."""
    from torch_xla._internal.jax_workarounds import maybe_get_jax
    import torch_xla.core.xla_builder as xb
    import torch_xla.runtime as xr

    jax = maybe_get_jax()  # imports JAX the way torch_xla needs (after the PJRT client exists)
    import jax.numpy as jnp

    ops = SimpleNamespace(cast=lambda x, like: x.astype(like.dtype), sqrt=jnp.sqrt, where=jnp.where, sign=jnp.sign,
                          norm=jnp.linalg.vector_norm, clamp=jnp.clip, ones_like=jnp.ones_like)
    shapes = [jax.ShapeDtypeStruct(tuple(t.shape), jnp.dtype(str(t.dtype).removeprefix("torch."))) for t in flat]
    platform = "tpu" if xr.device_type() == "TPU" else "cpu"
    if platform == "cpu":  # JAX would otherwise probe for a TPU (libtpu) before it lowers anything
        jax.config.update("jax_platforms", "cpu")
    traced = jax.jit(lambda args: fn(args, ops), keep_unused=True).trace(shapes)
    proto = traced.lower(lowering_platforms=(platform,)).compiler_ir("hlo").as_serialized_hlo_module_proto()
    return xb.computation_from_module_proto("spmdzero_fused", proto)
