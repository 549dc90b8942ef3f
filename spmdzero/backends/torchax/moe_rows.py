"""A mixture of experts' (token, expert) pairs sorted within each chip's rows, not across the chips.

Why: grouped matmuls want the pairs sorted by expert. Sorted over the whole batch, which the step
splits over the data-parallel chips, the sort's permutation moves every chip's pairs to the
others: libtpu 0.0.21 sent 2.71x the data-parallel minimum per chip for a Mixtral-like model (4
layers of 1024, 8 experts, 2 per token, ZeRO-2, v5e:2x2), collective-permutes of all the chips'
pairs and the experts' gradients all-reduced, where a dense model of that width sends 1.03x.
Expert parallelism aside, nothing requires a token to meet its experts on another chip.

So the rows are cut into as many blocks as the batch is split into (``splitting``; one block
where the rows do not divide), and the pairs are sorted, gathered, multiplied and added back
within each block: every operation has the blocks as a leading dimension the partitioner sees
as independent (a sort along the rows, a gather and a scatter-add batched over the blocks, the
grouped matmul batched over them, with each block's own group offsets). Each chip then routes
its own tokens and sends only the gradients, as a dense model does. The values are those of one
sort: each token's pairs meet the same experts, in the same order of experts.

The gathers, the scatter-add and the grouped matmul are JAX's (``jnp.take`` and ``.at[].add``
batched with ``jax.vmap``, ``jax.lax.ragged_dot``): torch's ``gather`` and ``index_add_`` along a
dimension lower to indices the partitioner does not see as batched, and torch has no batched
grouped matmul. The rest stays torch's, the experts' activations, LoRA's dropout, biases
included.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_split = (None, (), 1, "cpu")  # the traced step's mesh, data-parallel axes, their devices, platform


@contextlib.contextmanager
def splitting(mesh, batch_axes: tuple, platform: str = "cpu"):
    """While a step is traced: its batch is split over ``mesh``'s ``batch_axes``, and it
    compiles for ``platform`` ("tpu": the grouped matmuls take Pallas's megablox kernel)."""
    global _split
    devices = 1
    for axis in batch_axes:
        devices *= int(mesh.shape[axis])
    previous, _split = _split, (mesh, tuple(batch_axes), devices, platform)
    try:
        yield
    finally:
        _split = previous


def _jax(fn):
    from torchax import interop

    return interop.torch_view(fn)


def _take(x, index):
    """``x[b][index[b]]`` for each block ``b``: ``[B, m, ...]`` by ``[B, n]`` to ``[B, n, ...]``."""
    import jax

    return jax.vmap(lambda rows, i: rows[i])(x, index)


def _add(x, index, values):
    """``x[b][index[b]] += values[b]`` for each block ``b``, repeated indices summed."""
    import jax

    return jax.vmap(lambda rows, i, v: rows.at[i].add(v))(x, index, values)


MEGABLOX_TILES = (512, 1024, 1024)  # the most rows, contracted and output columns in one tile


def megablox_tiles(rows: int, contracted: int, columns: int):
    """Megablox's tiles for a ``[rows, contracted] x [contracted, columns]`` grouped matmul: rows
    in tiles that divide them (the kernel needs that), columns and the contraction in tiles
    that may leave a partial one; None where no tile of 8 rows or more divides the rows."""
    tm = next((t for t in (512, 256, 128, 64, 32, 16, 8) if t <= MEGABLOX_TILES[0] and rows % t == 0), None)
    return None if tm is None else (tm, min(MEGABLOX_TILES[1], contracted), min(MEGABLOX_TILES[2], columns))


def grouped_matmul(x, weight, offsets, megablox: bool = False, interpret: bool = False):
    """``x`` ``[n, K]`` sorted by group (``offsets`` the groups' ends) times ``weight[g]``
    (``[G, K, N]``), in ``x``'s dtype; rows past the last offset are zero. ``megablox``: Pallas's
    grouped-matmul kernel (``jax.experimental.pallas.ops.tpu.megablox``, MaxText's), forward and
    backward, where its tiles fit; else XLA's ``ragged_dot``. libtpu 0.0.21 runs ``ragged_dot``
    forward as a ragged kernel but its weight gradient as dense matmuls over every group, the
    rows of the others masked: E times the arithmetic. ``interpret``: the kernel in Pallas's
    interpreter, for checking off TPU."""
    import jax.numpy as jnp

    from spmdzero.backends.torchax import lowerings

    tiles = megablox_tiles(x.shape[0], x.shape[1], weight.shape[-1]) if megablox else None
    if tiles is None or x.dtype not in (jnp.float32, jnp.bfloat16):
        return lowerings.grouped_mm(x, weight, offsets)
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops

    offsets = offsets.astype(jnp.int32)
    sizes = jnp.diff(offsets, prepend=jnp.zeros((1,), jnp.int32))
    # the kernel leaves rows past the groups unwritten, forward and in the input's gradient: both
    # selects keep them out (the first one's backward drops the gradient's unwritten rows)
    grouped = (jnp.arange(x.shape[0]) < offsets[-1])[:, None]
    x = jnp.where(grouped, x, jnp.zeros((), x.dtype))
    out = megablox_ops.gmm(x, weight.astype(x.dtype), sizes, x.dtype, tiles, None, None, False, interpret)
    return jnp.where(grouped, out, jnp.zeros((), out.dtype))


def _grouped_mm(x, weight, offsets):
    """Each block's rows ``x[b]`` (``[n, K]``) times the weights by ``offsets[b]``'s groups
    (``grouped_matmul``). One block per data-parallel device runs under ``jax.shard_map``, each
    chip its own: libtpu 0.0.21 keeps a ragged kernel only for an unbatched, unpartitioned
    grouped matmul, and turns a batched one into dense matmuls over every group."""
    import jax
    from jax.sharding import PartitionSpec

    mesh, axes, devices, platform = _split

    def one(x, weight, offsets):
        return grouped_matmul(x[0], weight, offsets[0], megablox=platform == "tpu")[None]

    if x.shape[0] == 1:
        return one(x, weight, offsets)
    assert x.shape[0] == devices, (x.shape, devices)
    rows = PartitionSpec(axes)
    return jax.shard_map(one, mesh=mesh, in_specs=(rows, PartitionSpec(), rows), out_specs=rows,
                         check_vma=False)(x, weight, offsets)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` per block: ``x`` ``[B, n, K]``, ``weight`` ``[G, K, N]``, ``offsets``
    ``[B, G]`` (``Pairs.offsets``), to ``[B, n, N]`` in ``x``'s dtype."""
    return _jax(_grouped_mm)(x, weight, offsets)


@dataclass
class Pairs:
    """The (token, choice) pairs of ``chosen`` ``[T, K]`` sorted by expert within each of
    ``blocks`` blocks of ``T / blocks`` tokens, stably (transformers' loop's order): ``order``
    ``[B, n]`` (``n = T K / B``) the pairs' flat indices within their block, ``tokens`` their
    tokens within it, ``offsets`` ``[B, E]`` the end of each expert's group in each block. An
    expert index past the experts (a sentinel) sorts last and counts in no group."""

    blocks: int
    choices: int
    order: torch.Tensor
    tokens: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def by_expert(cls, chosen: torch.Tensor, experts: int) -> "Pairs":
        tokens, choices = chosen.shape
        blocks = _split[2] if tokens % _split[2] == 0 else 1
        flat = chosen.reshape(blocks, -1)
        order = torch.argsort(flat, dim=1, stable=True)
        counts = F.one_hot(flat, experts + 1)[..., :experts].sum(1)
        return cls(blocks, choices, order, order // choices, torch.cumsum(counts, 1).to(torch.int32))

    def _blocked(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.blocks, -1, *x.shape[1:])

    def of_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Each pair's row of ``x`` ``[T, ...]``: ``[B, n, ...]``."""
        return _jax(_take)(self._blocked(x), self.tokens)

    def of_choices(self, x: torch.Tensor) -> torch.Tensor:
        """Each pair's entry of ``x`` ``[T, K, ...]`` (the router's weights, its choices):
        ``[B, n, ...]``."""
        return _jax(_take)(x.reshape(self.blocks, -1, *x.shape[2:]), self.order)

    def added_to_tokens(self, out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``out`` ``[T, ...]`` with each pair's ``values`` ``[B, n, ...]`` added to its token's
        row, in the pairs' order: ``index_add_``'s sum."""
        return _jax(_add)(self._blocked(out), self.tokens, values).reshape(out.shape)

    def unsorted(self, values: torch.Tensor) -> torch.Tensor:
        """The pairs' ``values`` ``[B, n, ...]`` back in (token, choice) order: ``[T, K, ...]``."""
        back = _jax(_take)(values, torch.argsort(self.order, dim=1))
        return back.reshape(-1, self.choices, *values.shape[2:])
