"""``F.scaled_dot_product_attention`` on the torchax backend, with torch's values on masked rows.

torchax 0.0.13 lowers SDPA to a reference (``torchax/ops/jtorch.py``, ``_sdpa_reference``) that
fills masked scores with -inf and takes a plain softmax. A query row whose keys are all masked
(the padding rows of a left-padded batch, which transformers 5.x hands SDPA as a bool mask)
then gives 0/0 = NaN, and the NaN reaches the loss through the backward even where the labels
ignore those rows: GPT-2, Llama, Qwen2 and OPT trained on NaN from their first step. torch's
own SDPA (its math kernel's ``_safe_softmax``) returns zeros for such rows, and so does this
lowering: a row that is -inf everywhere takes scores of 0 before the softmax (so that its
gradient is finite too) and weights of 0 after it. Everything else is torch's arithmetic: the
default scale 1/sqrt(E), ``is_causal``'s lower-triangular mask, a bool mask (True: attend) or
an additive float mask, ``enable_gqa``'s repeated key/value heads, and dropout on the weights
(drawn from the trace's key, as torchax's other dropout). A mask of the dtype's minimum, as
transformers' eager path builds, is not -inf and gives torch's uniform weights, as in torch.

The softmax runs in float32 for half-precision inputs, as torch's CPU kernels accumulate.
This still materializes the ``[L, S]`` scores; issue 43 brings kernels that do not.
"""

from __future__ import annotations

import math

import torch

_INSTALLED = "_spmdzero_exact_sdpa"


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, env=None):
    """torch's SDPA on JAX arrays (``[..., L, E]``, ``[..., S, E]``, ``[..., S, Ev]``)."""
    import jax
    import jax.numpy as jnp

    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = jnp.repeat(key, repeat, axis=-3), jnp.repeat(value, repeat, axis=-3)
    length, source = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    compute = jnp.float32 if query.dtype in (jnp.bfloat16, jnp.float16) else query.dtype
    scores = jnp.einsum("...le,...se->...ls", query, key, preferred_element_type=compute) * scale
    if is_causal:
        scores = jnp.where(jnp.tril(jnp.ones((length, source), dtype=bool)), scores, -jnp.inf)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            scores = jnp.where(attn_mask, scores, -jnp.inf)
        else:
            scores = scores + attn_mask.astype(compute)
    # rows with every key masked: torch gives zeros, and so must the gradient stay finite
    dead = jnp.all(scores == -jnp.inf, axis=-1, keepdims=True)
    weights = jax.nn.softmax(jnp.where(dead, 0.0, scores), axis=-1)
    weights = jnp.where(dead, 0.0, weights)
    if dropout_p > 0.0:
        keep = jax.random.bernoulli(env.get_and_rotate_prng_key(), 1.0 - dropout_p, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_p), 0.0)
    return jnp.einsum("...ls,...se->...le", weights.astype(value.dtype), value)


def install(env) -> None:
    """Make ``env`` lower SDPA (the functional and the aten op) with ``scaled_dot_product_attention``.
    Idempotent; the default environment is the process's, like torchax's own lowerings."""
    if getattr(env, _INSTALLED, False):
        return
    from torchax.ops import ops_registry

    for op in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):
        env._ops[op] = ops_registry.Operator(op, scaled_dot_product_attention, is_jax_function=True,
                                             is_user_defined=True, needs_env=True, is_view_op=False)
    setattr(env, _INSTALLED, True)
