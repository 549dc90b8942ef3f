"""SDPA through Pallas's TPU flash-attention kernel, inside the sharded step.

Why: the exact lowering (``attention.py``) holds the ``[batch, heads, L, S]`` scores, and on a
TPU they dominate a step's memory and HBM traffic (a 124M GPT-2 at 1k tokens: 4.8 GiB of
temporaries; Llama-70B at 4k: 320 GiB per chip). JAX ships a flash kernel
(``jax.experimental.pallas.ops.tpu.flash_attention``) that streams keys in blocks and keeps only
``[L]`` statistics, forward and backward (its own ``custom_vjp``).

A Pallas call is opaque to the SPMD partitioner: left in the global program it would be run on
gathered inputs. It therefore runs under ``jax.shard_map`` over the batch, split as the step's
batch is (the mesh's data-parallel axes): each chip attends its own rows, and no collective is
added. The kernel takes what it covers and nothing else (``unsupported`` names the rest):

* ``is_causal`` (torch's top-left aligned ``tril``) or no causal mask;
* no ``attn_mask``, or a boolean key-padding mask (one row of keys per batch element, broadcast
  over heads and queries: ``mask[:, None, None, :]``), which becomes the kernel's segment ids
  (queries 0, keys 0 where attended, -1 where padded). Query rows that see no key at all are
  zeros, as in torch (the kernel's masked rows would average the padding);
* transformers' causal masks, handed over as their structure (``hf_masks.py``): causality, key
  padding, and packed-sequence ids (the kernel's segment ids as they are);
* grouped-query attention (``enable_gqa``, fewer key/value heads): their heads are repeated;
* sequence lengths that are a multiple of the kernel's 128-row block, and head dims up to 128
  or multiples of it;
* no dropout on the weights: the kernel has none.

Off TPU (``spmd.attention: "flash"`` on CPU, for checking), the same kernel runs in Pallas's
HLO interpreter: the same blocks and arithmetic as XLA ops, slow but exact to the kernel.
"""

from __future__ import annotations

import contextlib
from typing import Optional

BLOCK = 128  # the kernel's tile along both sequences (BlockSizes.get_default), and its least


def key_padding(attn_mask, batch: int, source: int):
    """A boolean ``attn_mask`` that masks keys only, as ``[batch, source]``; None for any other
    mask (a dense ``[L, S]`` one, a float one)."""
    import jax.numpy as jnp

    if attn_mask.dtype != jnp.bool_ or not 1 <= attn_mask.ndim <= 4:
        return None
    shape = (1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape)
    if shape[1] != 1 or shape[2] != 1 or shape[0] not in (1, batch) or shape[3] not in (1, source):
        return None
    return jnp.broadcast_to(attn_mask.reshape(shape)[:, 0, 0, :], (batch, source))


def unsupported(query, key, value, attn_mask, dropout_p: float, batch_devices: int) -> Optional[str]:
    """Why the kernel cannot run this call (None: it can), in words for the user."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return (f"inputs of rank {query.ndim}: the kernel takes [batch, heads, length, head_dim] "
                "(the layout of transformers' attention)")
    batch, heads, length, dim = query.shape
    source = key.shape[-2]
    if dropout_p > 0.0:
        return (f"dropout on the attention weights (dropout_p={dropout_p}): the kernel has none; set the model's "
                "attention dropout to 0 (attn_pdrop, attention_dropout, ...) to use it")
    if value.shape[-1] != dim:
        return f"a value head dim ({value.shape[-1]}) other than the query's ({dim})"
    for name, n in (("query", length), ("key", source)):
        if n % BLOCK:
            return (f"a {name} length of {n}, not a multiple of the kernel's {BLOCK}-row block: pad the "
                    f"batches (\"spmd\": {{\"pad_to_multiple_of\": {BLOCK}}})")
    if dim > BLOCK and dim % BLOCK:
        return f"a head dim of {dim}: the kernel takes head dims up to {BLOCK}, or multiples of it"
    if batch % batch_devices:
        return f"a batch of {batch} rows, which does not divide over the {batch_devices} data-parallel devices"
    if attn_mask is not None and key_padding(attn_mask, batch, source) is None:
        kind = "boolean" if str(attn_mask.dtype) == "bool" else f"additive {attn_mask.dtype}"
        return (f"a {kind} attn_mask of shape {tuple(attn_mask.shape)}: the kernel masks by causality, key "
                "padding and packed-sequence ids (segment ids) only, not by a dense [L, S] mask")
    return None


def attend(query, key, value, is_causal: bool, scale: float, mesh, batch_axes: tuple, interpret: bool,
           key_valid=None, segments=None):
    """The kernel's SDPA (``unsupported`` said yes): ``[b, h, L, E]`` in and out. ``key_valid``:
    ``[b, S]`` booleans (key padding); ``segments``: ``[b, L]`` ids of packed sequences (queries
    and keys of one length), a query attending only keys of its own id."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas
    from jax.sharding import PartitionSpec

    batch, heads, length, _ = query.shape
    source = key.shape[-2]
    if key.shape[-3] != heads:
        repeat = heads // key.shape[-3]
        key, value = jnp.repeat(key, repeat, axis=-3), jnp.repeat(value, repeat, axis=-3)
    blocks = pallas.BlockSizes.get_default(batch, heads, length, source, query.shape[-1])
    ids = None
    if segments is not None or key_valid is not None:
        q_ids = (jnp.zeros((batch, length), jnp.int32) if segments is None
                 else jnp.broadcast_to(segments, (batch, length)).astype(jnp.int32))
        kv_ids = q_ids if segments is not None else jnp.zeros((batch, source), jnp.int32)
        if key_valid is not None:  # a padded key's id is -1, which no query has
            kv_ids = jnp.where(key_valid, kv_ids, -1)
        ids = (q_ids, kv_ids)

    def local(q, k, v, *ids):
        segment_ids = pallas.SegmentIds(q=ids[0], kv=ids[1]) if ids else None
        return pallas.flash_attention(q, k, v, segment_ids=segment_ids, causal=is_causal, sm_scale=scale,
                                      block_sizes=blocks)

    rows = PartitionSpec(batch_axes)
    arrays = (query, key, value) + (ids or ())
    out = jax.shard_map(_interpreted(local) if interpret else local, mesh=mesh,
                        in_specs=(rows,) * len(arrays), out_specs=rows, check_vma=False)(*arrays)
    if key_valid is not None:
        # query rows that see no key: torch's zeros (the kernel averaged the masked keys)
        seen = (jnp.cumsum(key_valid, axis=-1)[:, jnp.minimum(jnp.arange(length), source - 1)] > 0 if is_causal
                else jnp.broadcast_to(jnp.any(key_valid, axis=-1, keepdims=True), (batch, length)))
        out = jnp.where(seen[:, None, :, None], out, jnp.zeros((), out.dtype))
    return out


def _interpreted(kernel):
    """``kernel`` with each of its Pallas calls in Pallas's HLO interpreter (``interpret=True``,
    which the kernel's entry point does not expose). Its backward's calls are traced only when
    the step's gradient is taken, after the forward's trace: the interpreter is switched on
    around the forward and the backward each, through a ``custom_vjp`` of the kernel's own VJP."""
    import jax

    @contextlib.contextmanager
    def interpreter():
        from jax._src import config

        previous = config.pallas_tpu_interpret_mode_context_manager.swap_local(True)
        try:
            yield
        finally:
            config.pallas_tpu_interpret_mode_context_manager.set_local(previous)

    @jax.custom_vjp
    def call(*args):
        with interpreter():
            return kernel(*args)

    def forward(*args):
        with interpreter():
            return jax.vjp(kernel, *args)

    def backward(vjp, cotangent):
        with interpreter():
            return vjp(cotangent)

    call.defvjp(forward, backward)
    return call
