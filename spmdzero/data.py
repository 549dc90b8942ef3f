"""Host batches -> device batches sharded along the batch axes.

One process feeds all of its host's devices, so one host batch holds the micro-batches
of every data-parallel rank. ``ShardedDataLoader`` draws each rank's samples with the
same ``DistributedSampler`` DeepSpeed's loader uses (shuffled, seed 0) and concatenates
them in rank order, so device group r trains on exactly what DeepSpeed's rank r would.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler

from .annotate import shard


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        mapped = [_map_tensors(o, fn) for o in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else type(obj)(mapped)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    return obj


def to_device_sharded(batch: Any, mesh, batch_spec: Callable[[int], tuple], dp_size: int) -> Any:
    """Move every tensor with a leading batch dim to the device, split across the batch axes.

    0-dim tensors and tensors already on the XLA device are moved/annotated as they are;
    a leading dim that does not divide over ``dp_size`` devices is refused.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    device = torch_xla.device()

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t.to(device)
        if t.shape[0] % dp_size:
            raise ValueError(
                f"batch dimension {t.shape[0]} (tensor of shape {tuple(t.shape)}) does not divide over the "
                f"{dp_size} data-parallel devices; use a batch size that is a multiple of {dp_size}"
            )
        spec = batch_spec(t.dim())
        if t.device.type == "xla":
            shard(t, mesh, spec)
            return t
        return xm.send_cpu_data_to_device([t], device, xs.ShardingSpec(mesh, spec))[0]

    return _map_tensors(batch, move)


class ShardedDataLoader:
    """DeepSpeed's training loader, one host batch per micro-step, already on device."""

    def __init__(self, dataset, micro_batch_per_device: int, dp_size: int, mesh, batch_spec,
                 collate_fn: Optional[Callable] = None, drop_last: bool = False):
        self.dp_size = dp_size
        self.mesh, self.batch_spec = mesh, batch_spec
        self.rank_loaders = [
            DataLoader(dataset, batch_size=micro_batch_per_device, collate_fn=collate_fn, drop_last=drop_last,
                       sampler=DistributedSampler(dataset, num_replicas=dp_size, rank=r))
            for r in range(dp_size)
        ]

    def __len__(self) -> int:
        return len(self.rank_loaders[0])

    def __iter__(self):
        for per_rank in zip(*self.rank_loaders):
            host_batch = _concat(per_rank)
            yield to_device_sharded(host_batch, self.mesh, self.batch_spec, self.dp_size)


def _concat(parts: tuple) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else first
    if isinstance(first, (list, tuple)):
        merged = [_concat(tuple(p[i] for p in parts)) for i in range(len(first))]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    if isinstance(first, dict):
        return type(first)((k, _concat(tuple(p[k] for p in parts))) for k in first)
    return first
