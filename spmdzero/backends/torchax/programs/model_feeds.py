"""How the generation loop feeds a transformers model, one forward at a time, from static caches:
a decoder-only LM or an encoder-decoder, behind one pair of calls.

``feed.first(tensors, ids, mask)`` runs the prompt and gives the logits of the first new token
and the loop's state (the caches' arrays); ``feed.following(tensors, token, i, state)`` feeds
the ``i``-th new token's predecessor and gives the next logits and the state. The loop in
``programs/generate.py`` is the same for both kinds; only what a forward is handed differs:

* a decoder-only LM: the prompt (left padded) and then each new token through one cache of
  ``prompt + new`` slots, position ids from the mask's cumulative sum, as transformers' greedy
  search computes them;
* an encoder-decoder (T5, BART, Marian...): the prompt (right padded) through the encoder once,
  in the first forward, with the decoder start token; the decoder's own tokens through a cache
  of ``new`` slots; each cross-attention's keys and values of the encoder's output computed and
  cached by the first forward and read from that cache by every later one, as transformers'
  ``EncoderDecoderCache`` does. The encoder's output is kept for the later forwards' masks."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from spmdzero.backends.torchax.patches import transformers_methods
from spmdzero.backends.torchax.programs.module_call import called
from spmdzero.backends.torchax.programs.static_cache import (cache_holding, cache_layers, cache_shape,
                                                             encoder_decoder_cache)


class Feed(NamedTuple):
    """A model's forwards for the generation loop (see the module docstring)."""

    first: Callable  # (tensors, ids, mask) -> (logits [batch, vocab], state)
    following: Callable  # (tensors, token [batch, 1], i, state) -> (logits, state)
    seen_first: Callable  # (ids, left, vocab) -> which tokens each row holds before the first new one


def _with_cache(inputs: dict, cache, slots) -> dict:
    """``inputs`` with the cache as this transformers names it: 4.x is told the slots written
    (``cache_position``), 5.x counts them itself."""
    if transformers_methods.transformers_4():
        return {**inputs, "past_key_values": cache, "cache_position": slots}
    return {**inputs, "cache": cache}


def _logits(env, output):
    import jax.numpy as jnp

    return env.t2j_iso(output.logits)[:, -1].astype(jnp.float32)


def _arrays(cache) -> tuple:
    return [layer.keys._elem for layer in cache.layers], [layer.values._elem for layer in cache.layers]


def causal_feed(env, module: torch.nn.Module, batch: int, prompt: int, new: int, empty: Callable) -> Feed:
    """A decoder-only LM's forwards (``empty(shape)``: a zero cache array, laid out)."""
    import jax.numpy as jnp

    config = module.config
    max_length = prompt + new
    shape = cache_shape(module, batch, max_length)
    # what every forward reads and the first makes: arrays of the trace, closed over by the loop
    # (carried through it, 4.x's mask code would no longer know them: it reads their values)
    invariant: dict = {}

    def forward(tensors, tokens, positions, start, keys, values):
        cache = cache_holding(env, config, max_length, keys, values, start, shape)
        inputs = {"input_ids": env.j2t_iso(tokens), "position_ids": env.j2t_iso(positions),
                  "attention_mask": env.j2t_iso(invariant["full_mask"]), "use_cache": True, "logits_to_keep": 1}
        slots = env.j2t_iso(start + jnp.arange(tokens.shape[1]))
        output = called(module, tensors, (), _with_cache(inputs, cache, slots))
        return _logits(env, output), _arrays(cache)

    def first(tensors, ids, mask):
        invariant["full_mask"] = jnp.concatenate([mask, jnp.ones((batch, new), mask.dtype)], axis=1)
        # transformers' position ids: the mask's cumulative sum, 1 where it is 0 (left padding)
        positions = jnp.where(mask == 0, 1, jnp.cumsum(mask, axis=1) - 1).astype(jnp.int32)
        invariant["last_position"] = positions[:, -1]
        zeros = [empty(shape)] * cache_layers(config)
        return forward(tensors, ids, positions, jnp.int32(0), zeros, zeros)

    def following(tensors, token, i, state):
        keys, values = state
        return forward(tensors, token, (invariant["last_position"] + i)[:, None], prompt + i - 1, keys, values)

    def seen_first(ids, left, vocab):
        # the prompt as fed (the bucket's own padding, left of the row's ``left``, is not the script's)
        held = jnp.arange(prompt)[None, :] >= left[:, None]
        return jnp.zeros((batch, vocab), bool).at[jnp.arange(batch)[:, None], ids].max(held)

    return Feed(first, following, seen_first)


def encoder_decoder_feed(env, module: torch.nn.Module, batch: int, prompt: int, new: int, empty: Callable,
                         start_token: int) -> Feed:
    """An encoder-decoder's forwards (``start_token``: the decoder's first input, transformers'
    ``decoder_start_token_id``)."""
    import jax.numpy as jnp

    config = module.config
    own_shape, cross_shape = cache_shape(module, batch, new), cache_shape(module, batch, prompt)
    layers = cache_layers(config)
    invariant: dict = {}

    def forward(tensors, token, slot, encoder: dict, keys, values, cross_keys, cross_values, filled: bool):
        own = cache_holding(env, config, new, keys, values, slot, own_shape)
        cross = cache_holding(env, config, prompt, cross_keys, cross_values, jnp.int32(prompt if filled else 0),
                              cross_shape)
        cache = encoder_decoder_cache(own, cross, filled)
        # the decoder's mask over all its slots: transformers 4.x would size a missing one from
        # the cache's traced length; the causal mask of the slots written is the model's
        inputs = {**encoder, "attention_mask": env.j2t_iso(invariant["mask"]), "use_cache": True,
                  "decoder_input_ids": env.j2t_iso(token),
                  "decoder_attention_mask": env.j2t_iso(jnp.ones((batch, new), jnp.int32))}
        output = called(module, tensors, (), _with_cache(inputs, cache, env.j2t_iso(slot[None])))
        return _logits(env, output), output, (*_arrays(own), *_arrays(cross))

    def first(tensors, ids, mask):
        invariant["mask"] = mask
        start = jnp.full((batch, 1), start_token, jnp.int32)
        own, cross = [empty(own_shape)] * layers, [empty(cross_shape)] * layers
        logits, output, arrays = forward(tensors, start, jnp.int32(0), {"input_ids": env.j2t_iso(ids)},
                                         own, own, cross, cross, filled=False)
        return logits, (*arrays, env.t2j_iso(output.encoder_last_hidden_state))

    def following(tensors, token, i, state):
        *arrays, hidden = state
        encoder = {"encoder_outputs": (env.j2t_iso(hidden),)}
        logits, _, arrays = forward(tensors, token, jnp.int32(0) + i, encoder, *arrays, filled=True)
        return logits, (*arrays, hidden)

    def seen_first(ids, left, vocab):
        # transformers' input_ids here are the decoder's: its start token
        return jnp.zeros((batch, vocab), bool).at[:, start_token].set(True)

    return Feed(first, following, seen_first)


def feed_for(env, module: torch.nn.Module, batch: int, prompt: int, new: int, empty: Callable,
             start_token: Any = None) -> Feed:
    """The feed for this module's kind."""
    if getattr(module.config, "is_encoder_decoder", False):
        return encoder_decoder_feed(env, module, batch, prompt, new, empty, start_token)
    return causal_feed(env, module, batch, prompt, new, empty)
