"""``deepspeed.comm``: a real ``torch.distributed`` process group, one process per host.

Scripts call ``torch.distributed`` right after ``deepspeed.init_distributed()`` (rank,
world size, barriers, small all-reduces of metrics), so this creates the default process
group with gloo: a DeepSpeed rank here is a process, as under the batch rule "process".
For XLA tensors the group runs gloo on host copies (``host_group``), so ``torch.distributed``
called directly on the engine's outputs works as it does on GPUs with nccl.
Training collectives do not go through it: GSPMD compiles them into the step.

Collectives here accept XLA tensors: they run on a host copy (a device sync each), which
suits what scripts use them for (metrics, flags) and nothing inside a training step.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from spmdzero import runtime

from . import host_group

ReduceOp = dist.ReduceOp
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
default_pg_timeout = datetime.timedelta(minutes=30)
BACKEND = "gloo"


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True,
                     timeout: datetime.timedelta = default_pg_timeout, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Create the default process group (gloo) if there is none: rank = this process's index,
    world size = the number of processes (hosts). One host needs no rendezvous (an in-memory
    store); several use ``MASTER_ADDR``/``MASTER_PORT`` as ``spmdzero launch`` sets them."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("Distributed backend is not initialized. Please set dist_init_required to True or "
                           "initialize before calling deepspeed.initialize()")
    if dist_backend not in (None, BACKEND, "xla", "nccl", "hccl", "ccl"):
        warnings.warn(f"spmdzero: dist_backend={dist_backend!r} is ignored; the host process group uses gloo",
                      stacklevel=2)
    index, count = runtime.hosts()
    if rank not in (-1, index) or world_size not in (-1, count):
        raise ValueError(f"init_distributed(rank={rank}, world_size={world_size}): spmdzero runs one process per "
                         f"host; this is process {index} of {count}")
    backend = host_group.register()  # gloo, and gloo through a host copy for XLA tensors
    if count == 1 and init_method is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if "MASTER_ADDR" not in os.environ and init_method is None:
        raise RuntimeError("init_distributed: several processes need MASTER_ADDR (the first host's address); "
                           "`spmdzero launch --master_addr=...` sets it")
    dist.init_process_group(backend, init_method=init_method or "env://", rank=index, world_size=count,
                            timeout=timeout)


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else runtime.hosts()[0]


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else runtime.hosts()[1]


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group=None, group_rank=0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group():
    return dist.group.WORLD


def new_group(ranks):
    return dist.new_group(ranks)


def barrier(group=None, async_op=False, device_ids=None):
    return dist.barrier(group=group, async_op=async_op)


def _on_host(tensor: torch.Tensor, collective) -> torch.Tensor:
    """Run ``collective`` on ``tensor``, through a host copy if it lives on the XLA device."""
    if tensor.device.type != "xla":
        collective(tensor)
        return tensor
    host = tensor.cpu()
    collective(host)
    with torch.no_grad():
        tensor.copy_(host.to(tensor.device))
    return tensor


class CompletedWork:
    """What an ``async_op=True`` collective returns here: they run synchronously on a host
    copy, so the work is done by the time the call returns (``.wait()`` is free)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _handle(async_op: bool) -> Optional[CompletedWork]:
    return CompletedWork() if async_op else None


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None):
    _on_host(tensor, lambda t: dist.all_reduce(t, op=op, group=group))
    return _handle(async_op)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    return all_reduce(tensor, op=op, group=group)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce", debug=None):
    _on_host(tensor, lambda t: dist.reduce(t, dst, op=op, group=group))
    return _handle(async_op)


def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    _on_host(tensor, lambda t: dist.broadcast(t, src, group=group))
    return _handle(async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):
    host = [t.cpu() for t in tensor_list]
    dist.all_gather(host, tensor.cpu(), group=group)
    with torch.no_grad():
        for out, value in zip(tensor_list, host):
            out.copy_(value.to(out.device))
    return _handle(async_op)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, debug=None):
    """Every process's ``tensor`` concatenated along dim 0 into ``output_tensor``."""
    parts = [torch.empty_like(tensor, device="cpu") for _ in range(get_world_size(group))]
    all_gather(parts, tensor, group=group)
    with torch.no_grad():
        output_tensor.copy_(torch.cat(parts).to(output_tensor.device))
    return _handle(async_op)


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, debug=None):
    """``tensor`` reduced over the processes, this process's dim-0 chunk into ``output_tensor``."""
    total = tensor.detach().cpu().clone()
    _on_host(total, lambda t: dist.all_reduce(t, op=op, group=group))
    with torch.no_grad():
        output_tensor.copy_(total.chunk(get_world_size(group))[get_rank(group)].to(output_tensor.device))
    return _handle(async_op)


def all_gather_object(object_list, obj, group=None):
    return dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list, src, group=None, device=None):
    return dist.broadcast_object_list(object_list, src, group=group)


def log_summary(show_straggler=False, return_dict=False):
    """DeepSpeed's communication log: spmdzero issues no collectives by hand (the compiler
    places them in the step; see ``engine.collectives_report``), so there is nothing to log."""
    return {} if return_dict else None


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None) -> None:
    """DeepSpeed's comms-logger settings: nothing to configure (see ``log_summary``)."""
