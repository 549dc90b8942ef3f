"""A static KV cache a compiled decode step updates in place, and reads once.

transformers' ``StaticCache`` writes a new token's keys and values with ``index_copy_`` and hands
the attention the whole updated cache. Compiled for a TPU, that reads each layer's cache, writes
it back whole, and reads it again for the attention: ``spmdzero aot --generate`` measured 4.6x
the bytes a decode step must read (the weights and the cache, once). Here the layers' tensors
are a program's arrays (``cache_holding``), a layer's update is one ``dynamic_update_slice``
of the new slots (in place, as the cache is donated), and while ``attending_in_place`` is on,
a one-token attention reads the cache as it was before the update and takes the new token's key
and value beside it: one joint softmax over both, the same attention up to rounding. The
compiler then orders the reads before the in-place write, and each cache byte is read once.

The arrays are ``[batch, kv heads, max length, head dim]`` per layer; ``length`` slots are
filled. A prompt (more than one new slot) attends through the cache as transformers does."""

from __future__ import annotations

import collections
import contextlib
import copy
import math

import torch


def cache_shape(module: torch.nn.Module, batch: int, max_length: int) -> tuple:
    """One layer's keys (or values): ``[batch, kv heads, max length, head dim]``; an
    encoder-decoder's are its decoder's (BART's ``decoder_attention_heads``, T5's ``d_kv``)."""
    config = module.config
    heads = (getattr(config, "decoder_attention_heads", None) or getattr(config, "num_key_value_heads", None)
             or config.num_attention_heads)
    head_dim = (getattr(config, "d_kv", None) or getattr(config, "head_dim", None)
                or config.hidden_size // config.num_attention_heads)
    return (batch, heads, max_length, head_dim)


def cache_layers(config) -> int:
    """The layers a cache holds: the decoder's (an encoder-decoder's ``num_hidden_layers`` may
    be its encoder's: BART's ``encoder_layers``, T5's ``num_layers``)."""
    return (getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None)
            or config.num_hidden_layers)


# the attentions traced while ``attending_in_place`` is on: "one token" (the cache read as it
# was, beside the new token) or "through the cache" (SDPA over the updated cache: a prompt, or
# a call this module does not recognize); for tests and reports
TRACED = collections.Counter()


class _Updates:
    """The one-token updates of a traced forward: the updated cache tensor (by identity) -> the
    cache before it, the new slot's values, the slot. Read by ``attending_in_place``."""

    active: "_Updates | None" = None

    def __init__(self):
        self.by_id: dict[int, tuple] = {}

    def record(self, updated: torch.Tensor, before, new, slot) -> None:
        self.by_id[id(updated)] = (updated, before, new, slot)  # the tensor held: its id stays its own

    def find(self, tensor) -> tuple | None:
        entry = self.by_id.get(id(tensor))
        return entry[1:] if entry is not None and entry[0] is tensor else None


def _in_place_update(env, layer):
    """``layer.update`` as one ``dynamic_update_slice`` at the filled length (see the module docstring)."""
    import jax

    def update(key_states, value_states, *args, **kwargs):
        slot = env.t2j_iso(layer.cumulative_length)
        written = []
        for name, new in (("keys", key_states), ("values", value_states)):
            before = env.t2j_iso(getattr(layer, name))
            new = env.t2j_iso(new).astype(before.dtype)
            after = env.j2t_iso(jax.lax.dynamic_update_slice(before, new, (0, 0, slot, 0)))
            setattr(layer, name, after)
            if new.shape[2] == 1 and _Updates.active is not None:
                _Updates.active.record(after, before, new, slot)
            written.append(after)
        layer.cumulative_length = env.j2t_iso(slot + key_states.shape[-2])
        return tuple(written)

    return update


def cache_holding(env, config, max_length: int, keys: list, values: list, length, shape: tuple):
    """transformers' ``StaticCache`` whose layers hold these arrays (``shape``: one layer's
    ``[batch, kv heads, max length, head dim]``), ``length`` slots filled, updated in place: a
    program's inputs as the model's cache for one call (4.57's and 5.x's attribute names both set)."""
    from transformers.cache_utils import StaticCache

    batch, heads, _, head_dim = shape
    cache = StaticCache(config=config, max_cache_len=max_length)
    if len(cache.layers) != len(keys):  # the config counted the encoder's layers (T5's num_layers)
        cache.layers = [copy.copy(cache.layers[0]) for _ in keys]
    for layer, k, v in zip(cache.layers, keys, values, strict=True):
        layer.keys, layer.values = env.j2t_iso(k), env.j2t_iso(v)
        layer.cumulative_length = env.j2t_iso(length)
        layer.device, layer.batch_size, layer.num_heads = layer.keys.device, batch, heads
        layer.max_batch_size, layer.dtype = batch, layer.keys.dtype  # transformers 4.x's names
        layer.k_head_dim = layer.v_head_dim = layer.head_dim = head_dim
        layer.is_initialized = True
        layer.update = _in_place_update(env, layer)
    return cache


def encoder_decoder_cache(self_attention, cross_attention, filled: bool):
    """transformers' ``EncoderDecoderCache`` of two ``cache_holding`` caches: the decoder's own
    keys and values, and the encoder's as each cross-attention projects them. ``filled``: whether
    the cross-attention caches hold them already (every token after the first reads them there;
    the first computes and writes them). Said by hand: the constructor would read a traced length."""
    from transformers.cache_utils import EncoderDecoderCache

    cross_attention.get_seq_length = lambda layer_idx=0: 0
    try:
        cache = EncoderDecoderCache(self_attention, cross_attention)
    finally:
        del cross_attention.get_seq_length
    cache.is_updated = {layer: filled for layer in range(len(cross_attention.layers))}
    return cache


def one_token_attention(query, before_keys, new_key, before_values, new_value, slot, mask, scale):
    """Attention of ``query`` (``[batch, heads, L, E]``) over the cache's slots before ``slot``
    and the new token's key and value (``[batch, kv heads, 1, E]``), with one softmax: what SDPA
    over the updated cache gives, reading the cache before the update. ``mask``: SDPA's
    ``attn_mask`` over every slot (boolean or additive, one for every head), or None. More query
    heads than key heads (grouped-query attention) share them in groups, as ``repeat_kv`` does,
    without repeating the cache."""
    import jax
    import jax.numpy as jnp

    batch, heads, length, width = query.shape
    groups = heads // before_keys.shape[1]
    if groups > 1:  # the query heads of a key head as its rows
        query = query.reshape(batch, heads // groups, groups * length, width)
        if mask is not None:
            mask = jnp.broadcast_to(mask[:, :, None], (*mask.shape[:2], groups, *mask.shape[2:]))
            mask = mask.reshape(mask.shape[0], 1, groups * length, mask.shape[-1])
        out = one_token_attention(query, before_keys, new_key, before_values, new_value, slot, mask, scale)
        return out.reshape(batch, heads, length, out.shape[-1])

    compute = jnp.float32
    slots = before_keys.shape[-2]
    old = jnp.einsum("...le,...se->...ls", query, before_keys, preferred_element_type=compute) * scale
    new = jnp.einsum("...le,...se->...ls", query, new_key, preferred_element_type=compute) * scale
    earlier = jnp.arange(slots) < slot
    if mask is None:
        old = jnp.where(earlier, old, -jnp.inf)
    else:
        at_slot = jax.lax.dynamic_slice_in_dim(mask, slot, 1, axis=-1)
        if mask.dtype == jnp.bool_:
            old = jnp.where(mask & earlier, old, -jnp.inf)
            new = jnp.where(at_slot, new, -jnp.inf)
        else:
            old = jnp.where(earlier, old + mask.astype(compute), -jnp.inf)
            new = new + at_slot.astype(compute)
    top = jnp.maximum(old.max(-1, keepdims=True), new)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    old, new = jnp.exp(old - top), jnp.exp(new - top)
    total = old.sum(-1, keepdims=True) + new
    total = jnp.where(total > 0, total, 1.0)  # a row with every slot masked gives zeros, as torch's SDPA does
    out = (jnp.einsum("...ls,...se->...le", old.astype(before_values.dtype), before_values,
                      preferred_element_type=compute) + new * new_value.astype(compute)) / total
    return out.astype(query.dtype)


@contextlib.contextmanager
def attending_in_place(env, sharding=None):
    """While tracing: a one-token SDPA over a cache ``cache_holding`` updated reads the cache as
    it was (``one_token_attention``); ``sharding``: where the attention's heads lie (the cache's
    layout), pinned on its inputs and output (the reference lowering merges batch and heads, and
    the partitioner then gathered the whole cache every step)."""
    import jax
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    updates, outer = _Updates(), _Updates.active

    def pinned(t):
        return t if sharding is None else jax.lax.with_sharding_constraint(t, sharding)

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        keys, values = updates.find(key), updates.find(value)
        if keys is None or values is None or dropout_p or is_causal or query.dim() != 4 or \
                query.shape[1] % keys[0].shape[1] or attn_mask is not None and attn_mask.shape[1] != 1 and \
                query.shape[1] != keys[0].shape[1]:
            TRACED["through the cache"] += 1
            pin = (lambda t: env.j2t_iso(pinned(env.t2j_iso(t)))) if sharding is not None else (lambda t: t)
            return pin(sdpa(pin(query), pin(key), pin(value), attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa))
        (before_keys, new_key, slot), (before_values, new_value, _) = keys, values
        TRACED["one token"] += 1
        q = env.t2j_iso(query)
        out = one_token_attention(pinned(q), pinned(before_keys), new_key, pinned(before_values), new_value, slot,
                                  None if attn_mask is None else env.t2j_iso(attn_mask),
                                  1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
        return env.j2t_iso(pinned(out))

    from transformers.integrations import sdpa_attention

    repeat_kv = sdpa_attention.repeat_kv

    def repeated(hidden_states, n_rep):
        """transformers 4.x repeats a grouped cache's heads before SDPA: the repeat stays known as
        the update it repeats, whose attention groups the query heads instead."""
        out = repeat_kv(hidden_states, n_rep)
        entry = updates.find(hidden_states)
        if entry is not None and out is not hidden_states:
            updates.record(out, *entry)
        return out

    F.scaled_dot_product_attention, _Updates.active, sdpa_attention.repeat_kv = attention, updates, repeated
    try:
        yield
    finally:
        F.scaled_dot_product_attention, _Updates.active, sdpa_attention.repeat_kv = sdpa, outer, repeat_kv
