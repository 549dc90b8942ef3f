"""The generation program: greedy decoding or sampling of a transformers LM, decoder-only or
encoder-decoder, on the devices, as one plain JAX function of the engine's weights, the prompts
and static KV caches made inside it.

``(params, constants, ids, mask, eos, pad, steps, knobs, seed, least, left) -> (new tokens, count)``:
the prompt (``[batch, prompt bucket]``, padded) goes through the model in one forward (the
prefill), then a ``jax.lax.while_loop`` feeds each new token back, one forward per token, until
``steps`` tokens or every row has ended at an EOS token. What each forward is handed, a
decoder-only LM's or an encoder-decoder's, is ``programs/model_feeds.py``'s. The loop runs on the
devices: no host read per token, and the weights are read where they are (at ZeRO-3 laid out
tensor-parallel once per call, outside the loop: ``sharding/decode_plan.py``). Only the tokens
and their count come back.

Why one program per prompt and new-token bucket: its shapes are the caches', so a prompt padded
to a bucket length and a token budget rounded up to one reuse it; the number of steps asked for
is an input. It follows transformers' greedy search exactly: rows that ended padded with ``pad``
after their EOS token, the loop stopping when every row has ended. Sampling warps the logits as
transformers' processors do, in their order (temperature, top-k, top-p, min-p: the values are
traced, so new ones do not compile again; top-k's k and which warpers run are the program's) and
draws with ``jax.random`` from ``seed`` folded with the token's index: reproducible from a seed,
not torch's draws. transformers' ``StaticCache`` is handed the loop's arrays as its layers'
tensors for each forward and updated in place, each new token's attention reading the cache once
(``programs/static_cache.py``), as ``programs/decode.py`` does for ``spmdzero aot --generate``."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import torch

from spmdzero.backends.torchax.lowering import attention, autocast, traced_checks
from spmdzero.backends.torchax.patches import registry
from spmdzero.backends.torchax.lowering.values import jax_dtype
from spmdzero.backends.torchax.programs.model_feeds import feed_for
from spmdzero.backends.torchax.programs.static_cache import attending_in_place
from spmdzero.backends.torchax.programs.setup import ProgramSetup


def warped(logits, knobs, structure: tuple):
    """Logits as transformers' sampling processors leave them, in their order: divided by the
    temperature, then those outside the top k, outside the top p of the probability mass, and
    below min p times the largest probability set to -inf. ``knobs``: temperature, k, p, min p
    (traced); ``structure``: (k (0: off), top-p on, min-p on), the program's."""
    import jax
    import jax.numpy as jnp

    top_k, use_top_p, use_min_p = structure
    scores = logits / knobs[0]
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = jax.lax.top_k(scores, top_k)[0][:, -1:]
        scores = jnp.where(scores < kth, -jnp.inf, scores)
    if use_top_p:
        ascending = jnp.sort(scores, axis=-1)
        removed = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1) <= 1 - knobs[2]
        removed = removed.at[:, -1].set(False)  # the likeliest token stays
        threshold = jnp.take_along_axis(ascending, jnp.argmin(removed, axis=-1)[:, None], axis=-1)
        scores = jnp.where(scores < threshold, -jnp.inf, scores)
    if use_min_p:
        probs = jax.nn.softmax(scores, axis=-1)
        scores = jnp.where(probs < knobs[3] * probs.max(-1, keepdims=True), -jnp.inf, scores)
    return scores


def penalized(logits, seen, penalty):
    """transformers' repetition penalty: the logits of tokens the sequence holds (``seen``, the
    prompt as fed and the new tokens) divided by ``penalty`` where positive, multiplied where
    negative."""
    import jax.numpy as jnp

    return jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)


def processed(logits, *, i, steps, least, eos, seen, penalty, penalize: bool, forced: tuple):
    """Scores (logits, or beam search's log-probabilities) for the ``i``-th new token as
    transformers' processors before the warpers leave them, in its order: the repetition penalty
    (``seen``, ``penalty``; when ``penalize``); no EOS token before the ``least``-th new token
    (the min-length processors); the forced BOS token (the first new one) and EOS tokens (the last
    one ``steps`` allows), ``forced``: (BOS or None, EOS tokens or ()), the program's."""
    import jax.numpy as jnp

    forced_bos, forced_eos = forced
    tokens = jnp.arange(logits.shape[-1])

    def only(scores, allowed, now):
        return jnp.where(now, jnp.where(jnp.isin(tokens, jnp.asarray(allowed, jnp.int32)), 0.0, -jnp.inf), scores)

    if penalize:
        logits = penalized(logits, seen, penalty)
    if eos.shape[0]:
        logits = jnp.where(jnp.isin(tokens, eos) & (i < least), -jnp.inf, logits)
    if forced_bos is not None:
        logits = only(logits, [forced_bos], i == 0)
    if forced_eos:
        logits = only(logits, list(forced_eos), i == steps - 1)
    return logits


class Prepared(NamedTuple):
    """What every generation program starts from (``prepared``)."""

    feed: Any  # the model's forwards (programs/model_feeds.py)
    weights: Callable  # (params, constants) -> the weights in the generation layout, by name
    tracing: Callable  # () -> the context a program's forwards are traced in


def prepared(setup: ProgramSetup, rows: int, prompt: int, new: int, layouts, tracing, start_token) -> Prepared:
    """The feed for ``rows`` sequences, the weights' layout and the tracing context of a
    generation program (see ``build_generate``'s arguments)."""
    import jax
    import jax.numpy as jnp

    env, policy = setup.env, setup.policy
    facts = registry.TraceFacts([], setup.expert_matmuls)

    def empty(shape):
        return jax.lax.with_sharding_constraint(jnp.zeros(shape, jax_dtype(policy.param_dtype)), layouts.cache)

    def weights(params, constants):
        # as training holds them at ZeRO-1/2 (replicated), tensor-parallel at ZeRO-3 (the Hybrid
        # Engine's); one reshard a call, before the loop
        return {**{n: jax.lax.with_sharding_constraint(p, layouts.weights[n]) if n in layouts.weights else p
                   for n, p in params.items()}, **constants}

    @contextlib.contextmanager
    def traced():
        with env, torch.no_grad(), tracing(), attention.choosing(setup.attention_kernels, env), \
                autocast.autocasting(env, policy.autocast_dtype), traced_checks.placeholder_checks_left_out(), \
                registry.entered(facts), attending_in_place(env, layouts.cache):
            yield

    return Prepared(feed_for(env, setup.module, rows, prompt, new, empty, start_token), weights, traced)


def build_generate(setup: ProgramSetup, batch: int, prompt: int, new: int, sampling, layouts, tracing,
                   penalize: bool = False, start_token=None, forced: tuple = (None, ())):
    """The generation program for ``batch`` prompts of ``prompt`` tokens (a bucket) and up to
    ``new`` new tokens, jitted (see the module docstring); ``sampling``: the warpers' structure
    (``warped``), or None for greedy search; ``penalize``: whether a repetition penalty
    (``knobs[4]``) applies, the first processor, as in transformers;
    ``layouts``: where the weights, the rows and the KV cache lie while it runs
    (``engine/generation.GenerationLayout``); ``tracing()``: the context that tells the module's
    calls they are traced (the engine's ``other_engines.tracing``: not routed through the engine
    again); ``start_token``: an encoder-decoder's decoder start token (``programs/model_feeds.py``);
    ``forced``: transformers' forced BOS token and EOS tokens (``processed``)."""
    import jax
    import jax.numpy as jnp

    env = setup.env
    feed, laid_out, traced = prepared(setup, batch, prompt, new, layouts, tracing, start_token)

    def chosen(logits, knobs, seed, i, least, eos, seen, steps):
        """The next token (the ``i``-th new one): the likeliest, or drawn from the warped logits
        with the token's key, after transformers' processors (``processed``)."""
        logits = processed(logits, i=i, steps=steps, least=least, eos=eos, seen=seen, penalty=knobs[4],
                           penalize=penalize, forced=forced)
        if sampling is None:
            return logits.argmax(-1).astype(jnp.int32)
        key = jax.random.fold_in(jax.random.key(seed), i)
        return jax.random.categorical(key, warped(logits, knobs, sampling), axis=-1).astype(jnp.int32)

    def generate(params, constants, ids, mask, eos, pad, steps, knobs, seed, least, left):
        setup.count_trace("generate")

        def ended_by(tokens):
            return jnp.isin(tokens, eos) if eos.shape[0] else jnp.zeros(tokens.shape, bool)

        with traced():
            tensors = env.j2t_iso(laid_out(params, constants))
            logits, state = feed.first(tensors, ids, mask)
            rows = jnp.arange(batch)
            # the tokens each row holds, for the repetition penalty: as fed, then each new token
            seen = feed.seen_first(ids, left, logits.shape[-1]) if penalize else jnp.zeros((batch, 1), bool)
            first = chosen(logits, knobs, seed, 0, least, eos, seen, steps)
            out = jnp.full((batch, new), pad, jnp.int32).at[:, 0].set(first)
            if penalize:
                seen = seen.at[rows, first].set(True)

            def more(carry):
                i, _, ended, _, _ = carry
                return (i < steps) & ~ended.all()

            def one(carry):
                i, out, ended, state, seen = carry
                token = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
                logits, state = feed.following(tensors, token, i, state)
                following = jnp.where(ended, pad, chosen(logits, knobs, seed, i, least, eos, seen, steps))
                out = jax.lax.dynamic_update_slice_in_dim(out, following[:, None], i, axis=1)
                if penalize:  # transformers' input_ids hold the pad tokens of ended rows too
                    seen = seen.at[rows, following].set(True)
                return i + 1, out, ended | ended_by(following), state, seen

            count, out, *_ = jax.lax.while_loop(more, one, (jnp.int32(1), out, ended_by(first), state, seen))
        return out, count

    return setup.compile.program(generate, "generate")
