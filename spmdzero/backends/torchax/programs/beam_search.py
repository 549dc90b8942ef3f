"""The beam search program: transformers' beam search on the devices, as one plain JAX function
of the engine's weights and the prompts, from the same forwards and caches as greedy search
(``programs/generate.py``, ``programs/model_feeds.py``).

transformers' beam search (4.57 and 5.x alike) is written with static shapes: per prompt,
``num_beams`` running hypotheses and ``num_beams`` finished ones in fixed arrays, the top
``max(2, 1 + EOS tokens) * num_beams`` continuations of all beams each step, those that hit EOS
or the length limit scored with the length penalty and merged into the finished ones, the others
continuing, each layer's cache gathered by the beams that continue. It ports as it is: this
program follows it step for step (the same candidates, the same -1e9 sentinels, the same
early-stopping heuristic for ``early_stopping`` True, False and ``"never"``), in one
``jax.lax.while_loop`` with no host read per token. Only the ``num_return_sequences`` best
finished hypotheses of each prompt and the longest one's length come back.

The prompts come in repeated ``num_beams`` times (row ``b * num_beams + k``), as transformers
expands them; the processors (repetition penalty, minimum lengths, forced tokens) run on the
log-probabilities, as in transformers, from ``generate.processed``."""

from __future__ import annotations

from spmdzero.backends.torchax.programs.generate import prepared, processed
from spmdzero.backends.torchax.programs.setup import ProgramSetup

FAR = -1.0e9  # transformers' score for what must not be chosen


def build_beam_search(setup: ProgramSetup, batch: int, beams: int, returned: int, prompt: int, new: int,
                      eos_count: int, length_penalty: float, early_stopping, layouts, tracing,
                      penalize: bool = False, start_token=None, forced: tuple = (None, ())):
    """The beam search program for ``batch`` prompts (each given ``beams`` times) of ``prompt``
    tokens and up to ``new`` new tokens, jitted: ``(params, constants, ids, mask, eos, fill,
    steps, knobs, least, left) -> (sequences [batch, returned, new], length)``. ``eos_count``:
    how many EOS tokens (it sizes the candidates); ``length_penalty`` and ``early_stopping``:
    transformers' (the program's); ``fill``: what transformers fills unused slots with; the
    rest as ``generate.build_generate``'s."""
    import jax
    import jax.numpy as jnp

    env = setup.env
    rows = batch * beams
    feed, laid_out, traced = prepared(setup, rows, prompt, new, layouts, tracing, start_token)
    keep = max(2, 1 + eos_count) * beams  # candidates a step: enough to continue when the best end
    top_beams = jnp.arange(keep) < beams  # only those can finish

    def gathered(array, index):
        """``array[b, index[b, j], ...]``: transformers' ``_gather_beams``."""
        return jnp.take_along_axis(array, index.reshape(index.shape + (1,) * (array.ndim - 2)), axis=1)

    def by_beam(array, index):
        """The rows (``[batch * beams, ...]``) of the beams that continue, picked among their
        prompt's beams: a gather along the beams, batch by batch, which stays on the devices
        that hold the prompt's rows (an index into all rows would gather every row everywhere)."""
        return gathered(array.reshape(batch, beams, *array.shape[1:]), index).reshape(array.shape)

    def search(params, constants, ids, mask, eos, fill, steps, knobs, least, left):
        setup.count_trace("beam search")

        def step(i, logits, carry):
            """One step of transformers' beam search: the ``i``-th new token of every beam."""
            running, running_scores, done, scores, finished, lengths, open_, state, seen = carry
            log_probs = processed(jax.nn.log_softmax(logits, axis=-1), i=i, steps=steps, least=least, eos=eos,
                                  seen=seen, penalty=knobs[4], penalize=penalize, forced=forced)
            vocab = log_probs.shape[-1]
            totals = (log_probs.reshape(batch, beams, vocab) + running_scores[:, :, None]).reshape(batch, -1)
            # c. the top candidates of all beams
            top_scores, top_index = jax.lax.top_k(totals, keep)
            source, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
            candidates = jnp.where(jnp.arange(new) == i, token[:, :, None], gathered(running, source))
            # d. which end here: an EOS token, or the last token the length allows
            hits = (jnp.isin(token, eos) if eos_count else jnp.zeros(token.shape, bool)) | (i + 1 >= steps)
            # e. the best that go on
            going = top_scores + hits.astype(jnp.float32) * FAR
            chosen = jax.lax.top_k(going, beams)[1]
            running, running_scores = gathered(candidates, chosen), gathered(going, chosen)
            from_beam = gathered(source, chosen)  # the beam of its prompt each continues
            # f. the ended ones, scored with the length penalty, merged into the finished
            ended = hits & top_beams[None, :]
            scored = top_scores / (i + 1.0) ** length_penalty
            if early_stopping is True:
                scored = scored + (finished.all(-1, keepdims=True)).astype(jnp.float32) * FAR
            scored = scored + (~open_).astype(jnp.float32) * FAR + (~ended).astype(jnp.float32) * FAR
            merged = jax.lax.top_k(jnp.concatenate([scores, scored], axis=1), beams)[1]
            done = gathered(jnp.concatenate([done, candidates], axis=1), merged)
            scores = gathered(jnp.concatenate([scores, scored], axis=1), merged)
            finished = gathered(jnp.concatenate([finished, ended], axis=1), merged)
            lengths = gathered(jnp.concatenate([lengths, jnp.full((batch, keep), i + 1, jnp.int32)], axis=1), merged)
            # g. each cache, and the tokens each beam holds, follow the beams that go on
            state = jax.tree.map(lambda a: by_beam(a, from_beam), state)
            if penalize:
                seen = by_beam(seen, from_beam).at[jnp.arange(rows), running[:, :, i].reshape(-1)].set(True)
            # can a running beam still beat the worst finished one (transformers' heuristic)
            best_length = jnp.asarray(steps if early_stopping == "never" and length_penalty > 0.0 else i + 1,
                                      jnp.float32)
            best_running = running_scores[:, :1] / best_length ** length_penalty
            worst = jnp.where(finished, scores.min(1, keepdims=True), FAR)
            open_ = open_ & (best_running > worst).any(-1, keepdims=True)
            go_on = open_.any() & ~hits.all()
            if early_stopping is True:
                go_on = go_on & ~finished.all()
            return go_on, (running, running_scores, done, scores, finished, lengths, open_, state, seen)

        with traced():
            tensors = env.j2t_iso(laid_out(params, constants))
            logits, state = feed.first(tensors, ids, mask)
            seen = feed.seen_first(ids, left, logits.shape[-1]) if penalize else jnp.zeros((rows, 1), bool)
            sequences = jnp.full((batch, beams, new), fill, jnp.int32)
            running_scores = jnp.zeros((batch, beams), jnp.float32).at[:, 1:].set(FAR)  # one beam at first
            carry = (sequences, running_scores, sequences, jnp.full((batch, beams), FAR, jnp.float32),
                     jnp.zeros((batch, beams), bool), jnp.zeros((batch, beams), jnp.int32),
                     jnp.ones((batch, 1), bool), state, seen)
            go_on, carry = step(0, logits, carry)

            def more(loop):
                return loop[1]

            def one(loop):
                i, _, carry = loop
                token = carry[0][:, :, i - 1].reshape(rows, 1)
                logits, state = feed.following(tensors, token, i, carry[7])
                go_on, carry = step(i, logits, (*carry[:7], state, carry[8]))
                return i + 1, go_on, carry

            _, _, carry = jax.lax.while_loop(more, one, (jnp.int32(1), go_on, carry))
            done, lengths = carry[2], carry[5]
        return done[:, :returned], lengths[:, :returned].max()

    return setup.compile.program(search, "beam search")

