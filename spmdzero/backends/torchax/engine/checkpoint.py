"""The torchax backend's device side of checkpoints (``spmdzero.io.shards.StateShards``): the
JAX arrays' shards written and read through torch.distributed.checkpoint's chunk protocol
(``__create_write_items__``, ``__create_chunk_list__``, which DCP's default planners ask of a
value; the planners here look up a shard's host tensor by its offsets), one chunk per distinct shard, as torch_xla's planners write
them: either backend reads the other's checkpoints.

Each process writes only the shards its devices hold (``addressable_shards``), a replicated
one once (its replica 0, on one process), and reads only the chunks its devices need; one shard
is on the host at a time while saving."""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch


def _torch_dtype(dtype) -> torch.dtype:
    return getattr(torch, np.dtype(dtype).name)


def _to_torch(array) -> torch.Tensor:
    """A single-device JAX array on the host, bit for bit (bf16 through its 16-bit pattern)."""
    host = np.asarray(array)
    if host.dtype.name == "bfloat16":
        return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy())


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        import jax.numpy as jnp

        return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
    return tensor.numpy()


def _bounds(index: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
    """A shard's index (slices) as (start, stop) per dim."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class JaxShards:
    """One array's distinct shards on this process's devices, as a DCP value. Saving: the array's
    replica-0 shards, copied to the host when DCP writes each. Loading: an empty host buffer per
    distinct shard of the target layout, read by DCP and then put on the devices (``array``)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, bounds: list, source: Optional[dict] = None,
                 sharding: Any = None):
        self.shape, self.dtype, self._sharding = tuple(shape), dtype, sharding
        self._bounds = bounds  # [(start, stop) per dim] per shard, in order
        self._source = source  # {offsets: single-device array} when saving
        self._buffers: dict[torch.Size, torch.Tensor] = {}

    @classmethod
    def of_array(cls, array) -> "JaxShards":
        shape = tuple(array.shape)
        owned = [s for s in array.addressable_shards if s.replica_id == 0]
        bounds = [_bounds(s.index, shape) for s in owned]
        source = {torch.Size(b[0] for b in bs): s.data for bs, s in zip(bounds, owned)}
        return cls(shape, _torch_dtype(array.dtype), bounds, source=source)

    @classmethod
    def target(cls, shape: tuple, dtype: torch.dtype, sharding) -> "JaxShards":
        distinct = dict.fromkeys(_bounds(index, shape)
                                 for index in sharding.addressable_devices_indices_map(tuple(shape)).values())
        shards = cls(shape, dtype, list(distinct), sharding=sharding)
        for bounds in shards._bounds:
            shards._buffers[torch.Size(b[0] for b in bounds)] = torch.empty([b[1] - b[0] for b in bounds], dtype=dtype)
        return shards

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def _chunks(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(b[0] for b in bounds),
                                     sizes=torch.Size(b[1] - b[0] for b in bounds)) for bounds in self._bounds]

    # ---- DCP's checkpointable protocol -----------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import (TensorProperties, TensorWriteData, WriteItem,
                                                          WriteItemType)

        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=self.dtype),
                                                      size=self.size()))
                for i, chunk in enumerate(self._chunks())]

    def __create_chunk_list__(self) -> list:
        return self._chunks()

    def host_shard(self, offsets: torch.Size) -> torch.Tensor:
        """The host tensor of the shard at ``offsets``: to write (copied off its device now, and
        released by this object), or to read into."""
        if self._source is not None:  # saving: this shard to the host now, released after
            return _to_torch(self._source.pop(offsets))
        return self._buffers[offsets]

    def array(self):
        """The read buffers as one JAX array laid out by the target sharding."""
        import jax

        def shard(index):
            bounds = _bounds(index, self.shape)
            return _to_numpy(self._buffers[torch.Size(b[0] for b in bounds)])

        return jax.make_array_from_callback(self.shape, self._sharding, shard)


@functools.lru_cache(maxsize=None)
def _planners() -> tuple[type, type]:
    """DCP's default planners, with a ``JaxShards`` value's shard looked up by its offsets (the
    defaults do that for torch tensors only)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            return self.state_dict[index.fqn].host_shard(index.offset)

    class LoadPlanner(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # the default's first step turns every value that is not a tensor into None
            self.original_state_dict = self.state_dict = state_dict
            self.metadata, self.is_coordinator = metadata, is_coordinator

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn].host_shard(index.offset)

    return SavePlanner, LoadPlanner


class TorchaxStateShards:
    """``StateShards`` over one torchax engine."""

    def __init__(self, engine):
        self._engine = engine

    def writable(self, tensors: dict[str, Any]) -> tuple[dict, Any]:
        import jax
        jax.block_until_ready(list(tensors.values()))
        return {k: JaxShards.of_array(a) for k, a in tensors.items()}, _planners()[0]()

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, spec: tuple) -> JaxShards:
        return JaxShards.target(shape, dtype, self._engine.placement.sharding(spec))

    def from_host(self, tensor: torch.Tensor, spec: tuple):
        return self._engine.placement.put(tensor, self._engine.placement.sharding(spec))

    def readable(self, staging: dict[str, JaxShards]) -> tuple[dict, Any]:
        return dict(staging), _planners()[1]()

    def values(self, staging: dict[str, Any]) -> dict[str, Any]:
        return {k: v.array() if isinstance(v, JaxShards) else v for k, v in staging.items()}

    def commit(self, values: dict[str, Any]) -> None:
        self._engine.load_state(values)

    def rng_state(self) -> int:
        return self._engine.rng_seed

    def set_rng_state(self, seed: int) -> None:
        self._engine.reseed(seed)

    def rng_position(self) -> int:
        return self._engine.state.draw_step

    def set_rng_position(self, position: int) -> None:
        self._engine.state = self._engine.state._replace(draw_step=position)
