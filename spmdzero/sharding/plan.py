"""The sharding plan: which tensor is split how, as pure data.

``make_plan(named shapes, mesh shape, ZeRO stage)`` returns a frozen ``ShardingPlan``
that gives, for every trainable parameter, the partition spec of the parameter, its
gradient buffer and its optimizer states. It needs no device, prints as a table, and
the engine applies it without re-deciding anything.

The rule, per tensor:

* parameters are replicated at every stage;
* a tensor's *ZeRO spec* splits its largest dimension (the first one on ties) across
  the ``fsdp`` axis; a dimension that does not divide evenly is padded by XLA;
* tensors whose largest dimension is smaller than the ``fsdp`` size (scalars, tiny
  vectors) stay replicated: some devices would otherwise hold only padding;
* ``even=True`` (the torchax backend: JAX shards only dims that divide evenly) splits only
  dims that divide by their axes' size: the largest such dim, or none (replicated);
* a tied embedding table (rows looked up by token id, the same tensor as the output
  projection) splits its embedding dimension, the last, instead of its rows. Its gradient
  is the projection's matmul plus a scatter-add of one row per token, and XLA folds the
  matmul into the scatter before partitioning. Split by rows, the matmul's partial sums
  have to be all-reduced in full before the scatter, then the scattered rows
  reduce-scattered: about 3x the table's minimum traffic. Split by columns, the scatter is
  partitioned along its window dimension: the matmul's part is reduce-scattered, the token
  rows are exchanged (an all-to-all, tokens x width), and nothing is all-reduced;
* on a mesh with two fsdp axes (``fsdp x fsdp_inner``, 16 or more fsdp devices, see
  mesh.py), a tensor of two or more dims splits its last dim over ``fsdp_inner`` (the TPU's
  128-wide lane dim: the small inner axis keeps whole tiles per shard) and its largest
  other dim over ``fsdp``. Its gradient is constrained to one axis's split first, then to
  both (``grad_stages``): libtpu reduce-scatters each stage, where one 16-chip
  reduce-scatter becomes an all-reduce and a slice. The first stage is the ``fsdp`` split,
  or for a tall tensor (that dim longer than the last) the ``fsdp_inner`` split
  (``_two_axis_spec``: measured). A tied table keeps one stage, its
  columns over both axes: libtpu all-reduces it, but the scatter-add stays partitioned by
  columns. Split in two stages, the scatter's token rows (tokens x width) are all-gathered
  over every chip and half the table is still all-reduced (docs/tpu.md). Tensors that do
  not split in two stages (vectors, odd shapes) split their largest dim over both axes at
  once;
* a stacked parameter (``"spmd": {"scan_layers": "stacked"}``: one tensor ``[layers, ...]``
  holding a block parameter of every layer, spmdzero.backends.torch_xla.scan) never splits its layer dim 0: the
  layer loop slices it, one layer per trip. Its ZeRO spec is that of one layer's slice with
  dim 0 replicated in front, and inside the loop each layer's gradient is laid out as that
  slice's spec (``layer_grad_layouts``);
* stage 0: everything replicated. Stage 1: optimizer states (and fp32 master weights,
  under mixed precision) use the ZeRO spec, gradients replicated. Stage 2: gradients too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping, Optional, Sequence

from spmdzero.sharding.mesh import FSDP_AXIS, FSDP_INNER_AXIS, data_parallel_axes, fsdp_axes, fsdp_size

PartitionSpec = tuple  # one entry per dim: None (replicated) or a mesh axis name / tuple of names


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    param: PartitionSpec
    grad: PartitionSpec
    optimizer_state: PartitionSpec
    master: PartitionSpec  # the fp32 master weight under mixed precision: optimizer state to ZeRO
    shard_dims: tuple[int, ...]  # the dims the ZeRO spec splits, () if the tensor stays replicated
    tied_embedding: bool = False  # a table looked up by index that is also a matmul weight
    # The layouts the fresh gradient is constrained to in turn, the last being ``grad``;
    # () when the gradient stays replicated.
    grad_stages: tuple[PartitionSpec, ...] = ()
    stacked: bool = False  # dim 0 is the layer dim of a scanned stack (never split)
    # The ZeRO spec's stages at any stage from 1 (``grad_stages`` holds them from stage 2 only)
    zero_stages: tuple[PartitionSpec, ...] = ()

    @property
    def gather_layouts(self) -> tuple[PartitionSpec, ...]:
        """The layouts a sharded value of this tensor passes through to become whole, the last
        being replicated: the ZeRO spec's stages backwards, one fsdp axis at a time. Gathered
        over ``fsdp x fsdp_inner`` at once, libtpu 0.0.21 all-reduces instead (ZeRO-3's weights,
        and at stages 1-2 the parameters after the update; docs/tpu.md)."""
        return tuple(reversed(self.zero_stages[:-1])) + (replicated(len(self.shape)),)

    @property
    def grad_layouts(self) -> tuple[PartitionSpec, ...]:
        """What the freshly computed gradient is laid out as, in turn, inside the backward.
        One stage: pinned replicated first, so that the ZeRO layout stays off the
        weight-gradient matmul (the partitioner would move the activations instead of
        reducing the gradient) and the compiler makes the all-reduce + slice a
        reduce-scatter. Two stages (two fsdp axes) or a tied table: the first stage is the
        gradient's own layout (libtpu does not reduce-scatter a pinned gradient over 16
        chips; a tied table's scatter-add stays partitioned by columns)."""
        if (self.tied_embedding and self.grad_stages) or len(self.grad_stages) > 1:
            return self.grad_stages
        return (replicated(len(self.shape)),) + self.grad_stages

    @property
    def layer_grad_layouts(self) -> tuple[PartitionSpec, ...]:
        """A stacked parameter's ``grad_layouts`` for one layer's gradient inside the layer
        loop: each without the (replicated) layer dim."""
        if not self.stacked:
            raise ValueError(f"{self.name} is not a stacked parameter: it has no per-layer gradient layout")
        return tuple(spec[1:] for spec in self.grad_layouts)


@dataclass(frozen=True)
class ShardingPlan:
    stage: int
    mesh_shape: tuple[tuple[str, int], ...]
    tensors: tuple[TensorPlan, ...]

    @cached_property
    def _by_name(self) -> dict[str, TensorPlan]:
        return {t.name: t for t in self.tensors}

    def get(self, name: str) -> Optional[TensorPlan]:
        return self._by_name.get(name)

    def __getitem__(self, name: str) -> TensorPlan:
        if name not in self._by_name:
            raise KeyError(f"no parameter named {name!r} in the sharding plan")
        return self._by_name[name]

    def batch_spec(self, ndim: int, dim: int = 0) -> PartitionSpec:
        """Split dim ``dim`` (the batch) across every data-parallel axis."""
        return batch_spec(dict(self.mesh_shape), ndim, dim)

    def table(self) -> str:
        rows = [("parameter", "shape", "param", "grad", "optimizer state", "master")]
        rows += [(t.name, "x".join(map(str, t.shape)) or "scalar", _fmt(t.param), _fmt(t.grad),
                  _fmt(t.optimizer_state), _fmt(t.master)) for t in self.tensors]
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        mesh = " x ".join(f"{n}={s}" for n, s in self.mesh_shape)
        lines = [f"ZeRO stage {self.stage} on mesh {mesh}"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    __str__ = table


def _fmt(spec: PartitionSpec) -> str:
    def axis(s) -> str:
        return "-" if s is None else s if isinstance(s, str) else "+".join(s)

    return "(" + ", ".join(axis(s) for s in spec) + ")" if spec else "()"


def replicated(ndim: int) -> PartitionSpec:
    return (None,) * ndim


def zero_spec(shape: Sequence[int], mesh_shape: Mapping[str, int], tied_embedding: bool = False,
              even: bool = False) -> tuple[PartitionSpec, ...]:
    """A tensor's ZeRO spec as the stages its gradient is constrained through, the last being
    the spec itself; () if the tensor stays replicated (see the module docstring)."""
    shape = tuple(shape)
    if len(fsdp_axes(mesh_shape)) == 2:
        size = fsdp_size(mesh_shape)
        if tied_embedding and len(shape) == 2 and _splits(shape[-1], size, even):
            return ((None, (FSDP_AXIS, FSDP_INNER_AXIS)),)
        return _two_axis_spec(shape, mesh_shape[FSDP_AXIS], mesh_shape[FSDP_INNER_AXIS], even)
    fsdp = mesh_shape[FSDP_AXIS]
    if tied_embedding and len(shape) == 2 and fsdp > 1 and _splits(shape[-1], fsdp, even):
        return ((None, FSDP_AXIS),)
    return _split_largest(shape, fsdp, FSDP_AXIS, even)


def _splits(dim: int, size: int, even: bool) -> bool:
    """``dim`` may be split ``size`` ways: at least one element each, evenly if asked."""
    return dim >= size and (not even or dim % size == 0)


def _two_axis_spec(shape: tuple[int, ...], outer: int, inner: int, even: bool) -> tuple[PartitionSpec, ...]:
    """Rows over ``fsdp`` and the last dim over ``fsdp_inner``, the gradient reduced over one
    axis at a time: the rows first, except for a tall tensor (rows longer than the last dim),
    whose last dim goes first. Measured with ``spmdzero aot`` (traffic / FSDP's minimum, rows
    first -> this rule): with the rows first libtpu 0.0.21 all-reduced Llama-2-70B's
    ``[28672, 8192]`` MLP gradients whole over the 64-chip outer group (ZeRO-3, v5p:4x4x8:
    1.18 -> 1.09); Llama-2-7B at ZeRO-3 on v5e:4x4 and v5p:2x4x4 1.01 -> 1.00, at ZeRO-2 on
    v5p:2x4x4 1.03 -> 1.02. The last dim first for every tensor was worse there (1.03, 1.07)."""
    if len(shape) >= 2 and shape[-1] % inner == 0:
        dim = max(range(len(shape) - 1), key=lambda d: (shape[d], -d))
        if _splits(shape[dim], outer, even):
            both = tuple(FSDP_AXIS if d == dim else None for d in range(len(shape) - 1)) + (FSDP_INNER_AXIS,)
            if shape[dim] > shape[-1]:
                return (None,) * (len(shape) - 1) + (FSDP_INNER_AXIS,), both
            return both[:-1] + (None,), both
    return _split_largest(shape, outer * inner, (FSDP_AXIS, FSDP_INNER_AXIS), even)


def _split_largest(shape: tuple[int, ...], size: int, axis, even: bool = False) -> tuple[PartitionSpec, ...]:
    """The largest dim (the first on ties) over ``axis``; a dim that does not divide evenly is
    padded by XLA (``even``: only dims that divide are candidates). Replicated when no dim is
    a candidate: with every dim smaller than ``size``, some devices would hold only padding."""
    candidates = [d for d in range(len(shape)) if _splits(shape[d], size, even)] if size > 1 else []
    if not candidates:
        return ()
    dim = max(candidates, key=lambda d: (shape[d], -d))
    return (tuple(axis if d == dim else None for d in range(len(shape))),)


def shard_dims(spec: PartitionSpec) -> tuple[int, ...]:
    return tuple(d for d, s in enumerate(spec) if s is not None)


def batch_spec(mesh_shape: Mapping[str, int], ndim: int, dim: int = 0) -> PartitionSpec:
    axes = data_parallel_axes(mesh_shape)
    first = axes[0] if len(axes) == 1 else axes
    return (None,) * dim + (first,) + (None,) * (ndim - dim - 1)


def make_plan(named_shapes: Iterable[tuple[str, Sequence[int]]], mesh_shape: Mapping[str, int],
              stage: int, tied_embeddings: Iterable[str] = (), stacked: Iterable[str] = (),
              even: bool = False) -> ShardingPlan:
    """``tied_embeddings``: the names of embedding tables that are also another module's weight;
    ``stacked``: the names of stacked layer parameters (dim 0 the layers); ``even``: split only
    dims that divide evenly (see the module docstring)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if FSDP_AXIS not in mesh_shape:
        raise ValueError(f"mesh axes {tuple(mesh_shape)} have no {FSDP_AXIS!r} axis")
    tied_embeddings, stacked = set(tied_embeddings), set(stacked)
    tensors = []
    for name, shape in named_shapes:
        shape = tuple(int(s) for s in shape)
        if name in stacked and not shape:
            raise ValueError(f"stacked parameter {name!r} has no layer dim (shape ())")
        rep = replicated(len(shape))
        if stage < 1:
            stages = ()
        elif name in stacked:  # one layer's spec, the layer dim in front, never split
            stages = tuple((None,) + spec for spec in zero_spec(shape[1:], mesh_shape, even=even))
        else:
            stages = zero_spec(shape, mesh_shape, name in tied_embeddings, even)
        sharded = stages[-1] if stages else rep
        tensors.append(TensorPlan(
            name=name, shape=shape, param=sharded if stage >= 3 else rep,
            grad=sharded if stage >= 2 else rep,
            optimizer_state=sharded,
            master=sharded,
            shard_dims=shard_dims(sharded),
            tied_embedding=name in tied_embeddings,
            grad_stages=stages if stage >= 2 else (),
            stacked=name in stacked,
            zero_stages=stages,
        ))
    return ShardingPlan(stage, tuple(mesh_shape.items()), tuple(tensors))
