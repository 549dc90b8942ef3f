"""SDPA through Pallas's TPU flash-attention kernel (splash attention), inside the sharded step.

Why: the exact lowering (``attention.py``) holds the ``[batch, heads, L, S]`` scores, and on a
TPU they dominate a step's memory and HBM traffic (a 124M GPT-2 at 1k tokens: 4.8 GiB of
temporaries; Llama-70B at 4k: 320 GiB per chip). JAX ships flash-attention kernels that stream
keys in tiles and keep only ``[L]`` statistics, forward and backward (their own ``custom_vjp``).
Of the two, ``splash_attention`` (the one MaxText runs) is used: its fused backward and compact
statistics move less through HBM than ``flash_attention``'s (GPT-2 124M at 1k tokens on v5e:2x2:
a roofline MFU of 45% against 41%).

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
* dropout on the weights: splash attention has none, so such a call runs spmdzero's own kernel
  (``flash_dropout.py``), which draws the mask from a hash inside its tiles, with the same masks
  and tiles as here.

Off TPU (``spmd.attention: "flash"`` on CPU, for checking), the same kernel runs in Pallas's
HLO interpreter (``interpret=True``): the same tiles and arithmetic as XLA ops, slow but exact to
the kernel.
"""

from __future__ import annotations

import functools
from typing import Optional

from spmdzero.backends.torchax.lowering import flash_dropout

BLOCK = 128  # the kernel's least tile along both sequences
TILES = (1024, 512, 256, BLOCK)  # the tiles tried, largest first (``_tile``)


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
    if dropout_p >= 1.0:
        return f"dropout_p={dropout_p}, which drops every weight"
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
           key_valid=None, segments=None, dropout: float = 0.0, dropout_key=None):
    """The kernel's SDPA (``unsupported`` said yes): ``[b, h, L, E]`` in and out. ``key_valid``:
    ``[b, S]`` booleans (key padding); ``segments``: ``[b, L]`` ids of packed sequences (queries
    and keys of one length), a query attending only keys of its own id; ``dropout`` > 0: that
    rate of the weights dropped, by masks drawn from ``dropout_key`` (``flash_dropout.py``)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.sharding import PartitionSpec

    batch, heads, length, _ = query.shape
    source = key.shape[-2]
    if key.shape[-3] != heads:
        repeat = heads // key.shape[-3]
        key, value = jnp.repeat(key, repeat, axis=-3), jnp.repeat(value, repeat, axis=-3)
    ids = None
    if segments is not None or key_valid is not None:
        q_ids = (jnp.zeros((batch, length), jnp.int32) if segments is None
                 else jnp.broadcast_to(segments, (batch, length)).astype(jnp.int32))
        kv_ids = q_ids if segments is not None else jnp.zeros((batch, source), jnp.int32)
        if key_valid is not None:  # a padded key's id is -1, which no query has
            kv_ids = jnp.where(key_valid, kv_ids, -1)
        ids = (q_ids, kv_ids)

    if dropout > 0.0:
        # one seed per batch row and head, split with the rows: the masks do not depend on the chips
        seeds = flash_dropout.row_seeds(dropout_key, (batch, heads))

        def local(q, k, v, seeds, *ids):
            return flash_dropout.attend((q * scale).astype(q.dtype), k, v, seeds, is_causal, dropout, interpret, *ids)
    else:
        kernel = _kernel(heads, length, source, is_causal, interpret)
        seeds = None

        def local(q, k, v, *ids):
            # the kernel takes one batch row (``[heads, length, dim]``) and unscaled scores
            q = (q * scale).astype(q.dtype)
            if not ids:
                return jax.vmap(kernel)(q, k, v)
            return jax.vmap(lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=splash.SegmentIds(q=qi, kv=ki)))(
                q, k, v, *ids)

    rows = PartitionSpec(batch_axes)
    arrays = (query, key, value) + (() if seeds is None else (seeds,)) + (ids or ())
    out = jax.shard_map(local, mesh=mesh, in_specs=(rows,) * len(arrays), out_specs=rows,
                        check_vma=False)(*arrays)
    if key_valid is not None:
        # query rows that see no key: torch's zeros (the kernel averaged the masked keys)
        seen = (jnp.cumsum(key_valid, axis=-1)[:, jnp.minimum(jnp.arange(length), source - 1)] > 0 if is_causal
                else jnp.broadcast_to(jnp.any(key_valid, axis=-1, keepdims=True), (batch, length)))
        out = jnp.where(seen[:, None, :, None], out, jnp.zeros((), out.dtype))
    return out


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, length: int, source: int, is_causal: bool, interpret: bool):
    """Splash attention for one batch row: causal or full over ``[length, source]`` for every
    head, tiles of ``_tile`` rows, its fused backward (one kernel for dq, dk and dv)."""
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    one = masks.CausalMask((length, source)) if is_causal else masks.FullMask((length, source))
    q_tile, k_tile = _tile(length), _tile(source)
    tiles = splash.BlockSizes(block_q=q_tile, block_kv=k_tile, block_kv_compute=k_tile, block_q_dkv=q_tile,
                              block_kv_dkv=k_tile, block_kv_dkv_compute=k_tile, use_fused_bwd_kernel=True)
    with jax.ensure_compile_time_eval():  # its mask tables are constants, made once, not in a trace
        return splash.make_splash_mha(masks.MultiHeadMask([one] * heads), block_sizes=tiles, head_shards=1,
                                      q_seq_shards=1, interpret=interpret)


def _tile(length: int) -> int:
    """The kernel's tile along a sequence: the largest of ``TILES`` that divides it. Larger tiles
    read each key and query fewer times: GPT-2 124M at 1k tokens (v5e:2x2, bf16, ZeRO-2, no
    dropout) has a roofline MFU of 44% with 256-row tiles, 45% with 1024."""
    return next(t for t in TILES if length % t == 0)
