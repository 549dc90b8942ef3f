"""Host batches onto torch_xla's devices, split along the batch axes: the inputs that carry
the batch (``train.batch_inputs``) are sharded on their batch dim, the rest replicated; on
several hosts each contributes its rows of the global batch."""

from __future__ import annotations
from typing import Any, Callable, Optional
import torch
from spmdzero import runtime
from spmdzero.backends.torch_xla.annotate import shard
from spmdzero.sharding.plan import replicated
from spmdzero.train.batch_inputs import BatchLayout, leading_dim_layout, note_replicated
from spmdzero.train.data import map_tensors


class _SendWithGradient(torch.autograd.Function):
    """The sharded move of a host tensor that requires grad (input gradients: saliency,
    adversarial examples). torch_xla's sharded transfer is outside autograd, so its backward
    is given here: the gradient goes back to the host tensor as ``tensor.to(device)``'s
    would, each host taking its own rows of the global gradient. The copy to the host is a
    device read, made only for tensors whose gradient the user asked for."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, sharding, device, process_count: int, dim: int) -> torch.Tensor:
        import torch_xla.core.xla_model as xm

        ctx.source, ctx.rows, ctx.process_count, ctx.dim = (t.device, t.dtype), t.shape[dim], process_count, dim
        return xm.send_cpu_data_to_device([t.detach()], device, sharding)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.process_count > 1:  # the global batch is the hosts' rows in process order
            start = runtime.hosts()[0] * ctx.rows
            grad = grad.narrow(ctx.dim, start, ctx.rows)
        device, dtype = ctx.source
        return grad.to(device=device, dtype=dtype), None, None, None, None


def to_device_sharded(batch: Any, mesh, batch_spec: Callable[..., tuple], dp_size: int,
                      process_count: int = 1, layout: Optional[BatchLayout] = None) -> Any:
    """Move every tensor in ``batch`` to the device: the inputs that carry the batch
    (``layout``, from ``train.batch_inputs``; by default the tensors with the first tensor's
    leading dim) split along the batch axes on their batch dim, the rest (masks, lookup
    tables, scalars) replicated. With several hosts, ``batch`` is this host's share of the
    global batch (torch_xla's ``minibatch`` input sharding). On one host, a batch that does
    not divide over the data-parallel devices runs replicated (noted once); with several
    hosts it is refused (each host holds different rows)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    device = torch_xla.device()
    layout = layout if layout is not None else leading_dim_layout(batch)
    batch_size = layout.rows
    local_dp = dp_size // process_count
    replicate = batch_size is not None and batch_size % local_dp != 0
    if replicate and process_count > 1:
        raise ValueError(
            f"batch dimension {batch_size} does not divide over the {local_dp} data-parallel devices of this host; "
            f"with several hosts each host's rows must split over its devices: use a multiple of {local_dp}"
        )
    if replicate:
        note_replicated(batch_size, local_dp)

    def move(t: torch.Tensor) -> torch.Tensor:
        dim = layout.dim_of(t)
        if dim is None:
            return t if t.device.type == "xla" else t.to(device)
        spec = replicated(t.dim()) if replicate else batch_spec(t.dim(), dim)
        if t.device.type == "xla":
            shard(t, mesh, spec)
            return t
        sharding = xs.ShardingSpec(mesh, spec, minibatch=process_count > 1)
        if t.requires_grad and torch.is_grad_enabled():
            return _SendWithGradient.apply(t, sharding, device, process_count, dim)
        return xm.send_cpu_data_to_device([t], device, sharding)[0]

    return map_tensors(batch, move)
