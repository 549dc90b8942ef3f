"""A mixture of experts' (token, expert) pairs sorted within each chip's rows, not across the chips.

Why: grouped matmuls want the pairs sorted by expert. Sorted over the whole batch, which the step
splits over the data-parallel chips, the sort's permutation moves every chip's pairs to the
others: libtpu 0.0.21 sent 2.71x the data-parallel minimum per chip for a Mixtral-like model (4
layers of 1024, 8 experts, 2 per token, ZeRO-2, v5e:2x2), collective-permutes of all the chips'
pairs and the experts' gradients all-reduced, where a dense model of that width sends 1.04x.
Expert parallelism aside, nothing requires a token to meet its experts on another chip.

So the rows are cut into as many blocks as the batch is split into (``Split``; one block where
the rows do not divide), and the pairs are sorted, gathered, multiplied and added back within
each block. The sort runs along the rows of ``[blocks, rows]``; the gathers and the scatter-add
are JAX's, batched over the blocks with ``jax.vmap`` (torch's ``gather`` and ``index_add_``
lower to indices the partitioner does not see as batched); the grouped matmul runs under
``jax.shard_map``, each chip its own block (libtpu turns a batched or partitioned ragged matmul
into dense matmuls over every expert). Each chip then routes its own tokens and sends only the
gradients, as a dense model does: 1.01x the minimum. The values are those of one sort: each
token's pairs meet the same experts, in the same order of experts. The rest stays torch's: the
experts' activations, LoRA's dropout, biases.

On TPU the weight gradient of each grouped matmul is Pallas's megablox ``tgmm`` kernel
(``grouped_matmul``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from spmdzero.backends.torchax.lowering import lowerings


@dataclass
class Split:
    """The step being traced: its mesh, the data-parallel axes its batch is split over (and their
    devices), the platform it compiles for (on "tpu" the weight gradients take megablox's
    ``tgmm``), and the kernels its grouped matmuls took, call by call (``describe``)."""

    mesh: Any = None
    batch_axes: tuple = ()
    platform: str = "cpu"
    calls: collections.Counter = field(default_factory=collections.Counter)

    @property
    def devices(self) -> int:
        return int(math.prod(int(self.mesh.shape[axis]) for axis in self.batch_axes))

    def describe(self) -> Optional[str]:
        """One line for reports; None where the step has no experts' grouped matmul."""
        if not self.calls:
            return None
        ran = ", ".join(f"{_KERNEL_NAMES[k]} x{n}" for k, n in sorted(self.calls.items()))
        return f"{ran}, each chip's rows sorted among themselves" if self.devices > 1 else ran


_KERNEL_NAMES = {"ragged_dot+tgmm": "XLA ragged_dot, its weight gradient by Pallas megablox's tgmm",
                 "ragged_dot": "XLA ragged_dot"}
_split = Split()


@contextlib.contextmanager
def splitting(split: Split):
    """While a step is traced: its mixtures of experts sort and multiply as ``split`` says."""
    global _split
    previous, _split = _split, split
    try:
        yield
    finally:
        _split = previous


def _jax(fn):
    from torchax import interop

    return interop.torch_view(fn)


def _row(rows, index):
    return rows[index]


def _added(rows, index, values):
    return rows.at[index].add(values)


@functools.lru_cache(maxsize=None)
def _batched(fn):
    """``fn`` for each block (the leading dimension), jitted once: an eager step calls it op by
    op."""
    import jax

    return jax.jit(jax.vmap(fn))


def _take(x, index):
    """``x[b][index[b]]`` for each block ``b``: ``[B, m, ...]`` by ``[B, n]`` to ``[B, n, ...]``."""
    return _batched(_row)(x, index)


def _add(x, index, values):
    """``x[b][index[b]] += values[b]`` for each block ``b``, repeated indices summed."""
    return _batched(_added)(x, index, values)


MEGABLOX_TILES = (512, 1024, 1024)  # megablox's tile: rows, contraction, output columns (MaxText's)


def megablox_tiles(rows: int, contracted: int, columns: int):
    """Megablox's tiles for a ``[rows, contracted] x [contracted, columns]`` grouped matmul: rows
    in tiles that divide them (the kernel needs that), columns and the contraction in tiles
    that may leave a partial one; None where no tile of 8 rows or more divides the rows.
    (Wider tiles run out of a v5p's vector memory at Mixtral-8x7B's sizes.)"""
    tm = next((t for t in (512, 256, 128, 64, 32, 16, 8) if t <= MEGABLOX_TILES[0] and rows % t == 0), None)
    return None if tm is None else (tm, min(MEGABLOX_TILES[1], contracted), min(MEGABLOX_TILES[2], columns))


def grouped_matmul(x, weight, offsets, tiles: Optional[tuple] = None, interpret: bool = False):
    """``x`` ``[n, K]`` sorted by group (``offsets`` the groups' ends) times ``weight[g]``
    (``[G, K, N]``), in ``x``'s dtype, by XLA's ``ragged_dot``; rows past the last offset are
    zero. ``tiles`` (``megablox_tiles``): the weight gradient by Pallas's megablox kernel for it
    (``tgmm``, MaxText's), in those tiles. libtpu 0.0.21 runs ``ragged_dot`` forward, and its
    input's gradient, as a ragged kernel, but the weight gradient as dense matmuls over every
    group with the other groups' rows masked: E times the arithmetic (a Mixtral-8x7B-sized layer:
    a roofline of 137 ms against 58). Megablox's forward kernel (``gmm``) re-reads more: 70 ms.
    ``interpret``: the kernel in Pallas's interpreter, for checking off TPU."""
    import jax.numpy as jnp

    if tiles is None:
        return lowerings.grouped_mm(x, weight, offsets)
    offsets = offsets.astype(jnp.int32)
    sizes = jnp.diff(offsets, prepend=jnp.zeros((1,), jnp.int32))
    out = _ragged_dot_tgmm()(x, weight.astype(x.dtype), sizes, tiles, interpret)
    return jnp.where((jnp.arange(x.shape[0]) < offsets[-1])[:, None], out, jnp.zeros((), out.dtype))


def _ragged_dot_tgmm_forward(x, weight, sizes, tiles, interpret):
    import jax

    return jax.lax.ragged_dot(x, weight, sizes), (x, weight, sizes)


def _ragged_dot_tgmm_backward(tiles, interpret, saved, grad):
    import jax
    from jax.experimental.pallas.ops.tpu.megablox import ops  # noqa: F401  (imports the kernels' module)

    kernels = sys.modules["jax.experimental.pallas.ops.tpu.megablox.gmm"]  # the package's ``gmm`` is ops.gmm
    x, weight, sizes = saved
    grad_x = jax.lax.ragged_dot(grad, weight.swapaxes(1, 2), sizes)
    grad_weight = kernels.tgmm(x.swapaxes(0, 1), grad, sizes, weight.dtype, tiles, None, weight.shape[0],
                               interpret=interpret)
    return grad_x, grad_weight, None


@functools.lru_cache(maxsize=None)
def _ragged_dot_tgmm():
    """``ragged_dot(x, weight, sizes)`` differentiated as ``_ragged_dot_tgmm_backward`` does."""
    import jax

    rule = jax.custom_vjp(lambda x, weight, sizes, tiles, interpret: jax.lax.ragged_dot(x, weight, sizes),
                          nondiff_argnums=(3, 4))
    rule.defvjp(_ragged_dot_tgmm_forward, _ragged_dot_tgmm_backward)
    return rule


def _one_block(x, weight, offsets, tiles: Optional[tuple]):
    return grouped_matmul(x[0], weight, offsets[0], tiles)[None]


@functools.lru_cache(maxsize=64)
def _per_chip(mesh, batch_axes: tuple, tiles: Optional[tuple]):
    """``_one_block`` on each chip's block, one jitted function per mesh: an eager step (the
    fallback of ``host_reads``) then compiles it once, not at every call."""
    import jax
    from jax.sharding import PartitionSpec

    rows = PartitionSpec(batch_axes)
    return jax.jit(jax.shard_map(functools.partial(_one_block, tiles=tiles), mesh=mesh,
                                 in_specs=(rows, PartitionSpec(), rows), out_specs=rows, check_vma=False))


def _grouped_mm(x, weight, offsets):
    """Each block's rows ``x[b]`` (``[n, K]``) times the weights by ``offsets[b]``'s groups
    (``grouped_matmul``). One block per data-parallel device runs under ``jax.shard_map``, each
    chip its own: libtpu 0.0.21 keeps a ragged kernel only for an unbatched, unpartitioned
    grouped matmul, and turns a batched one into dense matmuls over every group."""
    import jax.numpy as jnp

    tiles = None
    # a Pallas call is opaque to the partitioner: only where each chip runs its own rows
    if _split.platform == "tpu" and x.dtype in (jnp.float32, jnp.bfloat16) and (x.shape[0] > 1 or _split.devices == 1):
        tiles = megablox_tiles(x.shape[1], x.shape[2], weight.shape[-1])
    _split.calls["ragged_dot" if tiles is None else "ragged_dot+tgmm"] += 1
    if x.shape[0] == 1:
        return _one_block(x, weight, offsets, tiles)
    return _per_chip(_split.mesh, _split.batch_axes, tiles)(x, weight, offsets)


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
        devices = _split.devices
        blocks = devices if tokens % devices == 0 else 1
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

    def weighted_sum(self, values: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each pair's ``values`` ``[B, n, H]`` times its entry of ``weights`` ``[T, K]``, summed
        over each token's choices: ``[T, H]`` in ``dtype`` (transformers 5.x's sum)."""
        return self.unsorted(values * self.of_choices(weights)[..., None]).sum(dim=1).to(dtype)


def plain_linear(layer) -> bool:
    """Whether ``layer`` is a bias-free ``nn.Linear`` (an expert projection ``stacked`` takes)."""
    return type(layer) is torch.nn.Linear and layer.bias is None


def stacked(layers) -> torch.Tensor:
    """Bias-free Linear layers' weights as one ``[E, in, out]`` operand of a grouped matmul."""
    return torch.stack([layer.weight for layer in layers]).transpose(1, 2)
