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

_blocks = 1  # the data-parallel devices of the step being traced (``splitting``)


@contextlib.contextmanager
def splitting(blocks: int):
    """While a step is traced: the batch is split over ``blocks`` data-parallel devices."""
    global _blocks
    previous, _blocks = _blocks, max(1, int(blocks))
    try:
        yield
    finally:
        _blocks = previous


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


def _grouped_mm(x, weight, offsets):
    """Each block's rows ``x[b]`` (``[n, K]``, sorted by group, ``offsets[b]`` the groups' ends)
    times ``weight[g]`` (``[G, K, N]``); rows past the last offset are zero."""
    import jax
    import jax.numpy as jnp

    from spmdzero.backends.torchax import lowerings

    blocks = x.shape[0]
    weights = jnp.broadcast_to(weight, (blocks, *weight.shape))
    return jax.vmap(lowerings.grouped_mm)(x, weights, offsets)


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
        blocks = _blocks if tokens % _blocks == 0 else 1
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
