"""The static KV cache of the decode and generation programs (``programs/static_cache.py``): a
one-token attention that reads the cache as it was before the in-place update, beside the new
token, is SDPA over the updated cache."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from spmdzero.backends.torchax.programs.static_cache import one_token_attention  # noqa: E402


def reference(query, keys, values, mask, scale):
    """SDPA over the updated cache, key heads repeated for grouped queries (transformers' ``repeat_kv``)."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = np.repeat(keys, groups, axis=1), np.repeat(values, groups, axis=1)
    scores = np.einsum("bhle,bhse->bhls", query, keys) * scale
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    scores = scores - scores.max(-1, keepdims=True)
    weights = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    return np.einsum("bhls,bhse->bhle", weights, values)


@pytest.mark.parametrize("heads,kv_heads,mask_kind", [(4, 4, "bool"), (4, 2, "float"), (6, 2, "none"),
                                                       (4, 1, "bool")])
def test_one_token_attention_is_sdpa_over_the_updated_cache(heads, kv_heads, mask_kind):
    rng = np.random.default_rng(0)
    batch, slots, width, slot = 3, 10, 8, 6
    query = rng.standard_normal((batch, heads, 1, width)).astype(np.float32)
    before_k = rng.standard_normal((batch, kv_heads, slots, width)).astype(np.float32)
    before_v = rng.standard_normal((batch, kv_heads, slots, width)).astype(np.float32)
    before_k[:, :, slot:] = 99.0  # slots not yet filled (stale values): never read as keys
    before_v[:, :, slot:] = 99.0
    new_k = rng.standard_normal((batch, kv_heads, 1, width)).astype(np.float32)
    new_v = rng.standard_normal((batch, kv_heads, 1, width)).astype(np.float32)
    updated_k, updated_v = before_k.copy(), before_v.copy()
    updated_k[:, :, slot:slot + 1], updated_v[:, :, slot:slot + 1] = new_k, new_v
    causal = np.arange(slots) <= slot
    padded = np.ones((batch, 1, 1, slots), bool) & causal
    padded[1, ..., :2] = False  # a left-padded row
    mask = {"bool": padded, "float": np.where(padded, 0.0, -1e9).astype(np.float32), "none": None}[mask_kind]
    # without a mask the filled slots are all attended (SDPA over a cache whose unfilled slots are masked)
    reference_mask = np.broadcast_to(causal, padded.shape) if mask_kind == "none" else mask
    expected = reference(query, updated_k, updated_v, reference_mask, 0.35)
    got = one_token_attention(jnp.asarray(query), jnp.asarray(before_k), jnp.asarray(new_k), jnp.asarray(before_v),
                              jnp.asarray(new_v), jnp.int32(slot), None if mask is None else jnp.asarray(mask), 0.35)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    assert got.shape == (batch, heads, 1, width) and got.dtype == jnp.float32
