"""Each process's own part of the outputs, when several processes (hosts) make one mesh.

The engine's programs run on the global mesh, so their outputs are global arrays: a batch-split
output (logits) spans every host's devices, and no host could read it or compute with its own
labels (``criterion(engine(x), y)`` with ``y`` this host's rows). DeepSpeed gives each rank the
outputs of its own micro-batch, and averages the ranks' gradients. So here:

* ``local_view``: an output as this process sees it, over this process's devices only: its rows
  of a batch-split output (the shards its devices hold, no copy), the whole of a replicated one
  (a loss the module returned). The script's loss code then runs on its own rows, as on one
  rank.
* ``global_cotangent``: the gradient of this process's loss with respect to its view, back onto
  the global mesh for the compiled backward: each process's rows in place for a split output;
  for a replicated one, every process's own cotangent, stacked along a new leading dimension
  over all devices (``stacked``), which the backward sums (``combine``). The backward then
  divides by the process count: the gradient of the ranks' mean loss, as DeepSpeed's averaging
  all-reduce gives it.

Nothing is read on the host: views and cotangents are rearrangements of device buffers (a
replicated output's cotangent is gathered on this process's devices first).
"""

from __future__ import annotations

import math

import numpy as np

SPLIT, STACKED = "split", "stacked"  # how a cotangent reaches the global mesh (``combine``)


def local_view(array):
    """``array`` (global) as an array over this process's devices: the part they hold. Its
    devices form a grid of the tiles they hold (a mesh axis per split dim, one for copies)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    held = {shard.device: shard for shard in array.addressable_shards}
    index = {device: held[device].index for device in held}
    ndim = array.ndim
    starts = [sorted({index[d][k].start or 0 for d in index}) for k in range(ndim)]
    stops = [max(index[d][k].stop if index[d][k].stop is not None else array.shape[k] for d in index)
             for k in range(ndim)]
    split = [k for k in range(ndim) if len(starts[k]) > 1]
    tiles = [len(starts[k]) for k in split]
    copies = len(held) // max(1, math.prod(tiles))
    grid = np.empty(tiles + [copies], dtype=object)
    filled: dict[tuple, int] = {}
    for device in sorted(held, key=lambda d: d.id):
        tile = tuple(starts[k].index(index[device][k].start or 0) for k in split)
        grid[tile + (filled.get(tile, 0),)] = device
        filled[tile] = filled.get(tile, 0) + 1
    names = tuple(f"dim{k}" for k in split) + ("copies",)
    sharding = NamedSharding(Mesh(grid, names), PartitionSpec(*[f"dim{k}" if k in split else None
                                                                 for k in range(ndim)]))
    shape = tuple(stops[k] - starts[k][0] for k in range(ndim))
    return jax.make_array_from_single_device_arrays(shape, sharding, [held[d].data for d in grid.flat])


def spans_processes(array, view) -> bool:
    """Whether ``array``'s rows are split across the processes (this one holds a part)."""
    return tuple(view.shape) != tuple(array.shape)


def global_cotangent(cotangent, view_sharding, global_sharding, shape: tuple, kind: str, mesh):
    """The cotangent of this process's view, on the global mesh: for a ``SPLIT`` output its rows
    in place (each device's shard where the output's was), for a replicated one (``STACKED``) a
    ``[devices, *shape]`` array whose blocks are this process's cotangent on each of its devices."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    if kind == SPLIT:
        laid = jax.device_put(cotangent, view_sharding)  # the view's layout: each device its shard
        by_device = {shard.device: shard.data for shard in laid.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            shape, global_sharding, [by_device[d] for d in global_sharding.addressable_devices])
    whole = jax.device_put(cotangent, NamedSharding(view_sharding.mesh, PartitionSpec()))  # on each local device
    by_device = {shard.device: shard.data for shard in whole.addressable_shards}
    stacked = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    return jax.make_array_from_single_device_arrays(
        (mesh.size, *shape), stacked, [by_device[d][None] for d in stacked.addressable_devices])


def combine(cotangent, kind: str, processes: int):
    """Inside the backward program: the gradient of the processes' mean loss with respect to
    the global output, from ``global_cotangent``'s array."""
    if kind == STACKED:  # every device's block: each process's cotangent, once per device it has
        cotangent = cotangent.sum(0) / (cotangent.shape[0] // processes)
    return cotangent / processes
