"""Where a torchax engine's values live: inputs and host tensors placed on the mesh as JAX arrays
(replicated, or split by rows over the batch axes; several hosts each place their own rows), the
dtype conversions torchax's x64-off runtime needs, and process 0's parameters and seed broadcast
to every process at the start, as DeepSpeed broadcasts rank 0's. The engine holds one (``engine.placement``)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from spmdzero.train.batch_inputs import note_replicated
from spmdzero.backends.torchax.lowering.values import READ_ONLY_HOST_VALUE, placed_dtype



def broadcast_from_first_process(module: torch.nn.Module, seed: int) -> int:
    """Process 0's parameters and buffers copied into every process's ``module`` (DeepSpeed's
    engine broadcasts them from rank 0 at initialize, so each rank may seed or load its own),
    and process 0's ``seed``, returned. One program over every process's devices."""
    from jax.experimental import multihost_utils
    from torchax.ops import mappings

    tensors = [t for _, t in [*module.named_parameters(), *module.named_buffers()]]
    host = [np.asarray(mappings.t2j(t.detach().cpu())) for t in tensors]
    # booleans are summed as bytes (the broadcast adds process 0's values to the others' zeros)
    host = [h.view(np.uint8) if h.dtype == np.bool_ else h for h in host]
    seed_words = np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)
    *values, seed_words = multihost_utils.broadcast_one_to_all([*host, seed_words])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", READ_ONLY_HOST_VALUE)  # it is copied
        for t, value in zip(tensors, values):
            value = np.asarray(value)
            t.copy_(mappings.j2t(value.view(np.bool_) if t.dtype == torch.bool else value, use_dlpack=False))
    return int(seed_words[0]) << 32 | int(seed_words[1])


class Placement:
    """Where the engine's values go: layouts on its mesh, whole values and batch rows put there.
    Shape-only (``spmdzero aot``), every put gives a ``jax.ShapeDtypeStruct`` with its layout."""

    def __init__(self, mesh, processes: int, shape_only: bool, batch, plan):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        self._jax, self.mesh, self._processes, self._shape_only = jax, mesh, processes, shape_only
        self._batch, self.plan = batch, plan  # the data-parallel devices, the batch's layout
        self._named, self._spec = NamedSharding, PartitionSpec
        self.replicated = self.sharding(())

    def sharding(self, spec):
        """A partition spec as a layout on the mesh."""
        return self._named(self.mesh, self._spec(*spec))

    def put(self, t: torch.Tensor, sharding):
        """``t``, the whole value (the same on every process), laid out by ``sharding``; from a
        copy: JAX imports a host tensor without copying it, and the first device's buffer would
        then be memory the script can still change (``p.data``, a reused batch buffer) on that
        device alone."""
        from torchax.ops import mappings

        if self._shape_only:
            return self._jax.ShapeDtypeStruct(tuple(t.shape), placed_dtype(t.dtype), sharding=sharding)
        value = mappings.t2j(t.detach().cpu().clone())
        if self._processes == 1:
            return self._jax.device_put(value, sharding)
        # jax.device_put would compare the value across the processes first (a collective per array)
        value = np.asarray(value)
        return self._jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def put_rows(self, t: torch.Tensor, sharding, dim: int):
        """``t``, this process's rows of a batch (along ``dim``), as its part of the global batch."""
        if self._processes == 1:
            return self.put(t, sharding)
        from torchax.ops import mappings

        local = np.asarray(mappings.t2j(t.detach().cpu().clone()))  # a copy, as in _put
        shape = (*local.shape[:dim], local.shape[dim] * self._processes, *local.shape[dim + 1:])
        return self._jax.make_array_from_process_local_data(sharding, local, shape)

    def place_inputs(self, leaves: list, layout) -> list:
        """Tensors to JAX arrays: the inputs that carry the batch (``layout``) split along the
        batch axes on their batch dim (replicated when the rows do not divide), others
        replicated; torchax tensors as they are. With several processes, host tensors that
        carry the batch hold this process's rows of the global batch; the others must be the
        same on every process."""
        from torchax import tensor as ttensor

        local = layout.rows is not None and not layout.on_device  # this process's rows
        rows = None if layout.rows is None else layout.rows * (self._processes if local else 1)
        split = rows is not None and rows % self._batch.dp_devices == 0
        if rows is not None and not split and self._processes == 1:
            note_replicated(rows, self._batch.dp_devices)
        if local and not split and self._processes > 1:
            devices = self._batch.dp_devices // self._processes
            raise ValueError(f"a batch of {layout.rows} rows does not divide over the {devices} data-parallel devices "
                             f"of this process; with several processes ({self._processes}) each one's rows are split "
                             f"over its own devices: use a multiple of {devices} rows per process")
        placed = []
        for t in (t for t in leaves if isinstance(t, torch.Tensor)):
            dim = layout.dim_of(t)
            if isinstance(t, ttensor.Tensor):
                placed.append(t._elem)
            elif split and dim is not None:
                sharding = self.sharding(self.plan.batch_spec(t.dim(), dim))
                placed.append(self.put_rows(t, sharding, dim) if local else self.put(t, sharding))
            else:
                placed.append(self.put(t, self.replicated))
        return placed
