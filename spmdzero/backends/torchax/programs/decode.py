"""The decode program: one token of a transformers causal LM per sequence, from a static KV cache,
as a plain JAX function of the weights and the cache, laid out by the generation plan
(``sharding/decode_plan.py``: the Hybrid Engine's tensor-parallel layout, as annotations).

``(weights, keys, values, length, tokens) -> (next tokens, keys, values, length + 1)``: the
cache is ``[batch, kv heads, max length, head dim]`` per layer, passed in and given back
(donated: updated in place), as a compiled decode loop needs it; transformers' ``StaticCache``
is handed the arrays as its layers' tensors for the call. Greedy: the next token is the
argmax. The attention is computed where its heads are: its inputs and output are pinned to the
cache's layout, and spmdzero's SDPA (``lowering/attention.py``) keeps batch and heads apart (the
reference lowering merges them, and the partitioner then all-gathered the whole cache every
step)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class DecodeSetup:
    """What the decode program is built from."""

    env: Any  # torchax's environment
    module: torch.nn.Module  # a transformers causal LM (its weights are inputs, not constants)
    batch: int  # sequences decoded together
    max_length: int  # the cache's slots: prompt + new tokens
    cache_sharding: Any  # the KV cache's layout (a NamedSharding of the plan's cache spec)


@contextlib.contextmanager
def _attention_by_heads(env, sharding):
    """While tracing: SDPA's query, key, value and output pinned to the cache's layout."""
    import jax
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def pinned(t):
        return env.j2t_iso(jax.lax.with_sharding_constraint(env.t2j_iso(t), sharding))

    def by_heads(query, key, value, *args, **kwargs):
        return pinned(sdpa(pinned(query), pinned(key), pinned(value), *args, **kwargs))

    F.scaled_dot_product_attention = by_heads
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def cache_shape(module: torch.nn.Module, batch: int, max_length: int) -> tuple:
    """One layer's keys (or values): ``[batch, kv heads, max length, head dim]``."""
    config = module.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (batch, heads, max_length, head_dim)


def cache_holding(env, config, max_length: int, keys: list, values: list, length, shape: tuple):
    """transformers' ``StaticCache`` whose layers hold these arrays (``shape``: one layer's
    ``[batch, kv heads, max length, head dim]``), ``length`` slots filled: a program's inputs
    as the model's cache for one call (4.57's and 5.x's attribute names both set)."""
    from transformers.cache_utils import StaticCache

    batch, heads, _, head_dim = shape
    cache = StaticCache(config=config, max_cache_len=max_length)
    for layer, k, v in zip(cache.layers, keys, values):
        layer.keys, layer.values = env.j2t_iso(k), env.j2t_iso(v)
        layer.cumulative_length = env.j2t_iso(length)
        layer.device, layer.batch_size, layer.num_heads = layer.keys.device, batch, heads
        layer.max_batch_size, layer.dtype = batch, layer.keys.dtype  # transformers 4.x's names
        layer.k_head_dim = layer.v_head_dim = layer.head_dim = head_dim
        layer.is_initialized = True
    return cache


def build_decode(setup: DecodeSetup):
    """The decode program, jitted, the cache donated (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from spmdzero.backends.torchax.lowering import lowerings
    from spmdzero.backends.torchax.patches import transformers_methods

    env, module = setup.env, setup.module
    lowerings.install(env)  # spmdzero's SDPA among them
    buffers = dict(module.named_buffers())
    batch, heads, _, head_dim = cache_shape(module, setup.batch, setup.max_length)

    def decode(weights, keys, values, length, tokens):
        with env, _attention_by_heads(env, setup.cache_sharding):
            tensors = env.j2t_iso({**weights, **{n: env.t2j_copy(b) for n, b in buffers.items()}})
            cache = cache_holding(env, module.config, setup.max_length, keys, values, length,
                                  (batch, heads, setup.max_length, head_dim))
            positions = env.j2t_iso(jnp.broadcast_to(length, (batch, 1)).astype(jnp.int32))
            inputs = {"input_ids": env.j2t_iso(tokens), "position_ids": positions, "use_cache": True,
                      "logits_to_keep": 1}
            if transformers_methods.transformers_4():  # the cache's slots are given; 5.x counts them itself
                inputs.update(past_key_values=cache, cache_position=env.j2t_iso(length.reshape(1)))
            else:
                inputs["cache"] = cache
            output = torch.func.functional_call(module, tensors, (), inputs)
            following = output.logits[:, -1].argmax(-1)
            return (env.t2j_iso(following)[:, None].astype(jnp.int32), [layer.keys._elem for layer in cache.layers],
                    [layer.values._elem for layer in cache.layers], length + 1)

    cache_out = [setup.cache_sharding] * module.config.num_hidden_layers  # StaticCache's layers, one a block
    return jax.jit(decode, donate_argnums=(1, 2), out_shardings=(None, cache_out, cache_out, None))
