"""The decode program: one token of a transformers causal LM per sequence, from a static KV cache,
as a plain JAX function of the weights and the cache, laid out by the generation plan
(``sharding/decode_plan.py``: the Hybrid Engine's tensor-parallel layout, as annotations).

``(weights, keys, values, length, tokens) -> (next tokens, keys, values, length + 1)``: the
cache is ``[batch, kv heads, max length, head dim]`` per layer, passed in and given back
(donated: updated in place), as a compiled decode loop needs it; transformers' ``StaticCache``
is handed the arrays as its layers' tensors for the call, updated in place and read once
(``static_cache.py``). Greedy: the next token is the argmax. The attention is computed where its
heads are: its inputs and output are pinned to the cache's layout (the reference SDPA lowering
merges batch and heads, and the partitioner then all-gathered the whole cache every step)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from spmdzero.backends.torchax.programs.module_call import called
from spmdzero.backends.torchax.programs.static_cache import attending_in_place, cache_holding, cache_shape


@dataclasses.dataclass(frozen=True)
class DecodeSetup:
    """What the decode program is built from."""

    env: Any  # torchax's environment
    module: torch.nn.Module  # a transformers causal LM (its weights are inputs, not constants)
    batch: int  # sequences decoded together
    max_length: int  # the cache's slots: prompt + new tokens
    cache_sharding: Any  # the KV cache's layout (a NamedSharding of the plan's cache spec)


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
        with env, attending_in_place(env, setup.cache_sharding):
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
            output = called(module, tensors, (), inputs)
            following = output.logits[:, -1].argmax(-1)
            return (env.t2j_iso(following)[:, None].astype(jnp.int32), [layer.keys._elem for layer in cache.layers],
                    [layer.values._elem for layer in cache.layers], length + 1)

    cache_out = [setup.cache_sharding] * module.config.num_hidden_layers  # StaticCache's layers, one a block
    return jax.jit(decode, donate_argnums=(1, 2), out_shardings=(None, cache_out, cache_out, None))
