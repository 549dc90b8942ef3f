"""Flash attention with dropout on the weights: spmdzero's own Pallas TPU kernel, forward and
backward, for the SDPA calls that splash attention (``flash_attention.py``) cannot take.

Why: GPT-2's and BERT's stock configs drop 10% of the attention weights in training
(``attn_pdrop``/``attention_probs_dropout_prob``), and JAX's TPU kernels have no dropout. Such a
call took the exact path, which holds the ``[L, S]`` scores and their mask (GPT-2 124M at 1k
tokens on v5e:2x2: a roofline MFU of 28% against 45% without dropout).

The mask is never stored. Each kept/dropped bit is a hash of (a seed per batch row and head, the
query's position, the key's position): the forward and both backward kernels draw the same bit
for the same score from the same inputs, whatever the tiles, and so does ``keep_mask`` in plain
XLA for tests. The hash is Wellons' 32-bit "lowbias32" integer finalizer on int32 lanes
(multiplies wrap; logical shifts): about a dozen vector integer operations per score. A weight is
kept when the hash's top 31 bits are at least ``rate x 2^31``, and the kept weights are scaled by
``1 / (1 - rate)``, as torch's dropout. The seeds come from the step's dropout key, one per batch
row and head, so a mask does not depend on how many chips the batch is split over.

The kernels are FlashAttention-2's: the forward streams key tiles with a running max and sum and
saves the log-sum-exp per query; the backward recomputes each tile's weights from it, one kernel
for dK and dV (query tiles streamed) and one for dQ (key tiles streamed), with
``delta = rowsum(dO * O)`` from XLA. Masks: causality (torch's top-left ``tril``) and segment ids
(queries see keys of their own id; a padded key has id -1), as splash attention takes them.
"""

from __future__ import annotations

import functools

BLOCK = 128  # the least tile along both sequences
TILES = (512, 256, BLOCK)  # the tiles tried, largest first
_NEG = -0.7 * float(3.4028235e38)  # a masked score: finite, so that a fully masked tile's max minus itself is 0
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers, as int32


def _tile(length: int) -> int:
    return next(t for t in TILES if length % t == 0)


def _mix(x):
    """lowbias32 (Wellons) on int32: xor-shifts and wrapping multiplies, logical shifts."""
    import jax

    x = x ^ jax.lax.shift_right_logical(x, 16)
    x = x * _M1
    x = x ^ jax.lax.shift_right_logical(x, 15)
    x = x * _M2
    return x ^ jax.lax.shift_right_logical(x, 16)


def _threshold(rate: float) -> int:
    return min(int(round(rate * (1 << 31))), (1 << 31) - 1)


def _keep(seed, rows, cols, source: int, rate: float):
    """Whether the weights at query positions ``rows`` and key positions ``cols`` (broadcast
    int32 arrays) are kept, for one batch row and head's ``seed`` (int32)."""
    import jax

    bits = _mix((rows * source + cols) ^ seed)
    return jax.lax.shift_right_logical(bits, 1) >= _threshold(rate)


def row_seeds(key, shape: tuple):
    """int32 seeds of ``shape`` (``[batch, heads]``) drawn from a JAX key, each mixed once more
    so that neighbouring seeds share no structure with the positions they are xor-ed with."""
    import jax
    import jax.numpy as jnp

    return _mix(jax.random.bits(key, tuple(shape), jnp.uint32).view(jnp.int32))


def keep_mask(seeds, length: int, source: int, rate: float):
    """The kernels' mask in plain XLA, ``seeds.shape + (length, source)``: the exact path's
    dropout, and the tests' reference."""
    import jax.numpy as jnp

    rows = jnp.arange(length, dtype=jnp.int32)[:, None]
    cols = jnp.arange(source, dtype=jnp.int32)[None, :]
    return _keep(seeds[..., None, None], rows, cols, source, rate)


def keep_elements(seed, shape: tuple, rate: float):
    """The same hash over every element of an array of ``shape``, by its flat index (int32,
    wrapping): the mask of torch's elementwise dropout (``dropout.py``), one ``seed`` (int32) for
    the whole array, so that it does not depend on how the array is split over chips."""
    import jax
    import jax.numpy as jnp

    index = jnp.zeros(shape, jnp.int32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.int32, shape, dim) * stride
        stride = (stride * shape[dim]) % (1 << 32)
        stride = stride - (1 << 32) if stride >= (1 << 31) else stride
    return jax.lax.shift_right_logical(_mix(index ^ seed), 1) >= _threshold(rate)


def _positions(q_block, k_block, block_q, block_k, transposed: bool):
    """The query and key positions of a tile's scores, ``[bq, bk]`` (``transposed``: ``[bk, bq]``)."""
    import jax
    import jax.numpy as jnp

    shape, q_dim = ((block_k, block_q), 1) if transposed else ((block_q, block_k), 0)
    rows = q_block * block_q + jax.lax.broadcasted_iota(jnp.int32, shape, q_dim)
    cols = k_block * block_k + jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_dim)
    return rows, cols


def _attended(rows, cols, causal, ids):
    """Which scores at query positions ``rows`` and key positions ``cols`` are attended; None:
    all. ``ids``: the tile's query and key segment ids, laid out to broadcast against them."""
    mask = rows >= cols if causal else None
    if ids is not None:
        same = ids[0] == ids[1]
        mask = same if mask is None else mask & same
    return mask


def _visible(q_block, k_block, block_q, block_k, causal):
    """Whether the tile has any score a causal mask keeps (every tile without one)."""
    return k_block * block_k <= q_block * block_q + block_q - 1 if causal else True


def _ids(refs, has_ids):
    return (refs[0][...], refs[1][...]) if has_ids else None


def _as_row(column, size: int):
    """``[n, 1]`` as ``[1, n]`` by a masked sum over the diagonal (ops every Mosaic version lowers)."""
    import jax
    import jax.numpy as jnp

    diagonal = (jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
                == jax.lax.broadcasted_iota(jnp.int32, (size, size), 1))
    return jnp.sum(jnp.where(diagonal, column, 0.0), axis=0, keepdims=True)


def _forward_kernel(seeds_ref, q_ref, k_ref, v_ref, *rest, causal, rate, block_q, block_k, source, has_ids):
    """One (row, head, query tile): stream the key tiles, keep the running max ``m`` and sum
    ``l`` (before dropout: dropout scales what is kept, not the softmax's denominator) and the
    dropped weights times V; at the last key tile write O and the log-sum-exp, as a row (a
    ``[bq, 1]`` column in HBM is padded to 128 lanes: 128 times the bytes)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    ids, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = rest[:2 * has_ids], rest[2 * has_ids:]
    b, h, qi, ki = (pl.program_id(i) for i in range(4))

    @pl.when(ki == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_visible(qi, ki, block_q, block_k, causal))
    def _():
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        rows, cols = _positions(qi, ki, block_q, block_k, transposed=False)
        mask = _attended(rows, cols, causal, _ids(ids, has_ids))
        if mask is not None:
            s = jnp.where(mask, s, _NEG)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        if rate:
            p = jnp.where(_keep(seeds_ref[b, h], rows, cols, source, rate), p, 0.0)
        acc_sc[...] = alpha * acc_sc[...] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(ki == pl.num_programs(3) - 1)
    def _():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] * (1.0 / ((1.0 - rate) * l))).astype(o_ref.dtype)
        lse_ref[...] = _as_row(m_sc[...] + jnp.log(l), block_q)


def _tile_grads(seeds_ref, ids, q, k, v, do, lse, delta, b, h, qi, ki, causal, rate, block_q, block_k, source,
                has_ids):
    """A tile's dropped weights and score gradients, transposed (``[bk, bq]``: the log-sum-exp
    and delta are rows): the weights recomputed from the log-sum-exp, dP through dropout, then
    dS = P * (dP - delta), delta = rowsum(dO * O)."""
    import jax
    import jax.numpy as jnp

    s = jax.lax.dot_general(k, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    rows, cols = _positions(qi, ki, block_q, block_k, transposed=True)
    mask = _attended(rows, cols, causal, _ids(ids, has_ids))
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    p = jnp.exp(s - lse)
    dp = jax.lax.dot_general(v, do, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dropped = p
    if rate:
        keep = _keep(seeds_ref[b, h], rows, cols, source, rate)
        dropped = jnp.where(keep, p, 0.0) * (1.0 / (1.0 - rate))
        dp = jnp.where(keep, dp, 0.0) * (1.0 / (1.0 - rate))
    return dropped, p * (dp - delta)


def _dkv_kernel(seeds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, causal, rate, block_q,
                block_k, source, has_ids):
    """One (row, head, key tile): stream the query tiles; dV += P_dropped^T dO, dK += dS^T Q."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    ids, (dk_ref, dv_ref, dk_sc, dv_sc) = rest[:2 * has_ids], rest[2 * has_ids:]
    b, h, ki, qi = (pl.program_id(i) for i in range(4))

    @pl.when(qi == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_visible(qi, ki, block_q, block_k, causal))
    def _():
        q, do = q_ref[...], do_ref[...]
        dropped, ds = _tile_grads(seeds_ref, ids, q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...],
                                  b, h, qi, ki, causal, rate, block_q, block_k, source, has_ids)
        dv_sc[...] += jax.lax.dot_general(dropped.astype(do.dtype), do, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
        dk_sc[...] += jax.lax.dot_general(ds.astype(q.dtype), q, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)

    @pl.when(qi == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(seeds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, causal, rate, block_q,
               block_k, source, has_ids):
    """One (row, head, query tile): stream the key tiles; dQ += dS K."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    ids, (dq_ref, dq_sc) = rest[:2 * has_ids], rest[2 * has_ids:]
    b, h, qi, ki = (pl.program_id(i) for i in range(4))

    @pl.when(ki == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(_visible(qi, ki, block_q, block_k, causal))
    def _():
        k = k_ref[...]
        _, ds = _tile_grads(seeds_ref, ids, q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...],
                            b, h, qi, ki, causal, rate, block_q, block_k, source, has_ids)
        dq_sc[...] += jax.lax.dot_general(ds.astype(k.dtype), k, (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)

    @pl.when(ki == pl.num_programs(3) - 1)
    def _():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _specs(dim, block_q, block_k, q_major: bool, has_ids: bool, transposed: bool):
    """BlockSpecs of the q-like and k-like inputs, the per-query rows (log-sum-exp, delta:
    ``[b, h, 1, L]``) and the segment ids, for a grid (b, h, outer, inner) whose outer axis
    walks query tiles (``q_major``) or key tiles. The ids come as a query column and a key row
    (``[b, L, 1]``, ``[b, 1, S]``), or ``transposed`` as a query row and a key column."""
    from jax.experimental import pallas as pl

    def tiles(i, j):
        return (i, j) if q_major else (j, i)  # (query tile, key tile)

    q_spec = pl.BlockSpec((None, None, block_q, dim), lambda b, h, i, j, s: (b, h, tiles(i, j)[0], 0))
    k_spec = pl.BlockSpec((None, None, block_k, dim), lambda b, h, i, j, s: (b, h, tiles(i, j)[1], 0))
    row_spec = pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, j, s: (b, h, 0, tiles(i, j)[0]))
    ids = []
    if has_ids:
        column = lambda block, which: pl.BlockSpec((None, block, 1), lambda b, h, i, j, s: (b, tiles(i, j)[which], 0))
        row = lambda block, which: pl.BlockSpec((None, 1, block), lambda b, h, i, j, s: (b, 0, tiles(i, j)[which]))
        ids = [row(block_q, 0), column(block_k, 1)] if transposed else [column(block_q, 0), row(block_k, 1)]
    return q_spec, k_spec, row_spec, ids


def _costs(shape: tuple, source: int, itemsize: int, causal: bool, block_q: int, block_k: int) -> dict:
    """Each kernel's work for XLA's cost analysis (a Pallas call is opaque to it, so the roofline
    of ``spmdzero aot`` counts it from these): matmul FLOPs (half the tiles under a causal mask),
    one exp a score, and HBM bytes with each streamed tile read once a tile of the other side."""
    from jax.experimental import pallas as pl

    batch, heads, length, dim = shape
    scores = batch * heads * length * source * (0.5 if causal else 1.0)
    q_side = batch * heads * length * dim * itemsize  # one q-like array: q, o, dO, dQ
    k_side = batch * heads * source * dim * itemsize
    rows = batch * heads * length * 4  # the log-sum-exp or delta, fp32
    q_tiles, k_tiles = length // block_q, source // block_k

    def estimate(matmuls: int, exps: int, nbytes: float):
        return pl.CostEstimate(flops=int(2 * dim * scores * matmuls), transcendentals=int(scores * exps),
                               bytes_accessed=int(nbytes))

    return {"fwd": estimate(2, 1, 2 * q_side + 2 * k_side * q_tiles + rows),
            "dq": estimate(3, 1, 3 * q_side + 2 * k_side * q_tiles + 2 * rows),
            "dkv": estimate(4, 1, 4 * k_side + 2 * q_side * k_tiles + 2 * rows * k_tiles)}


@functools.lru_cache(maxsize=64)
def _calls(shape: tuple, source: int, dtype, causal: bool, rate: float, has_ids: bool, interpret: bool):
    """The three pallas_calls for ``[b, h, L, E]`` queries against ``source`` keys."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    batch, heads, length, dim = shape
    block_q, block_k = _tile(length), _tile(source)
    static = dict(causal=causal, rate=rate, block_q=block_q, block_k=block_k, source=source, has_ids=has_ids)
    cost = _costs(shape, source, jnp.dtype(dtype).itemsize, causal, block_q, block_k)
    parallel = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    f32 = jnp.float32

    q_spec, k_spec, row_spec, ids = _specs(dim, block_q, block_k, True, has_ids, transposed=False)
    rows_shape = jax.ShapeDtypeStruct((batch, heads, 1, length), f32)
    forward = pl.pallas_call(
        functools.partial(_forward_kernel, **static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, heads, length // block_q, source // block_k),
            in_specs=[q_spec, k_spec, k_spec, *ids], out_specs=[q_spec, row_spec],
            scratch_shapes=[pltpu.VMEM((block_q, 1), f32), pltpu.VMEM((block_q, 1), f32),
                            pltpu.VMEM((block_q, dim), f32)]),
        out_shape=[jax.ShapeDtypeStruct(shape, dtype), rows_shape],
        compiler_params=parallel, interpret=interpret, name="spmdzero_flash_dropout_fwd",
        cost_estimate=cost["fwd"])

    q_spec, k_spec, row_spec, ids = _specs(dim, block_q, block_k, True, has_ids, transposed=True)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, heads, length // block_q, source // block_k),
            in_specs=[q_spec, k_spec, k_spec, q_spec, row_spec, row_spec, *ids], out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((block_q, dim), f32)]),
        out_shape=jax.ShapeDtypeStruct(shape, dtype),
        compiler_params=parallel, interpret=interpret, name="spmdzero_flash_dropout_dq",
        cost_estimate=cost["dq"])

    q_spec, k_spec, row_spec, ids = _specs(dim, block_q, block_k, False, has_ids, transposed=True)
    kv_shape = (batch, heads, source, dim)
    dkv = pl.pallas_call(
        functools.partial(_dkv_kernel, **static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, heads, source // block_k, length // block_q),
            in_specs=[q_spec, k_spec, k_spec, q_spec, row_spec, row_spec, *ids], out_specs=[k_spec, k_spec],
            scratch_shapes=[pltpu.VMEM((block_k, dim), f32), pltpu.VMEM((block_k, dim), f32)]),
        out_shape=[jax.ShapeDtypeStruct(kv_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype)],
        compiler_params=parallel, interpret=interpret, name="spmdzero_flash_dropout_dkv",
        cost_estimate=cost["dkv"])
    return forward, dq, dkv


def attend(q, k, v, seeds, causal: bool, rate: float, interpret: bool, q_ids=None, kv_ids=None):
    """Dropout attention on one device's rows: ``q`` ``[b, h, L, E]`` already scaled, ``k``/``v``
    ``[b, h, S, E]`` with as many heads, ``seeds`` ``[b, h]`` int32, ``q_ids`` ``[b, L]`` and
    ``kv_ids`` ``[b, S]`` int32 segment ids or None. Differentiable in q, k and v."""
    import jax.numpy as jnp

    has_ids = q_ids is not None
    run = _differentiable(tuple(q.shape), k.shape[-2], jnp.dtype(q.dtype), bool(causal), float(rate), has_ids,
                          bool(interpret))
    # the forward's tiles take the query ids as a column and the key ids as a row; the backward's
    # (transposed) the other way round
    ids = (q_ids[:, :, None], kv_ids[:, None, :], q_ids[:, None, :], kv_ids[:, :, None]) if has_ids else ()
    return run(q, k, v, seeds, *ids)


@functools.lru_cache(maxsize=64)
def _differentiable(shape: tuple, source: int, dtype, causal: bool, rate: float, has_ids: bool, interpret: bool):
    """``(q, k, v, seeds, *ids) -> out`` with the kernels' backward (no gradient for the seeds
    and ids). The log-sum-exp and delta are ``[b, h, 1, L]`` rows."""
    import jax
    import jax.numpy as jnp

    forward, dq_call, dkv_call = _calls(shape, source, dtype, causal, rate, has_ids, interpret)

    @jax.custom_vjp
    def run(q, k, v, seeds, *ids):
        return forward(seeds, q, k, v, *ids[:2])[0]

    def run_forward(q, k, v, seeds, *ids):
        out, lse = forward(seeds, q, k, v, *ids[:2])
        return out, (q, k, v, seeds, ids, out, lse)

    def run_backward(saved, do):
        q, k, v, seeds, ids, out, lse = saved
        delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)[:, :, None, :]
        do = do.astype(q.dtype)
        dq = dq_call(seeds, q, k, v, do, lse, delta, *ids[2:])
        dk, dv = dkv_call(seeds, q, k, v, do, lse, delta, *ids[2:])
        return (dq, dk, dv, None) + (None,) * len(ids)

    run.defvjp(run_forward, run_backward)
    return run
