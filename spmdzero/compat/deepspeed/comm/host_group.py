"""The default process group's backend for device tensors (XLA's, torchax's): gloo, through a
host copy.

Under DeepSpeed on GPUs, code outside the engine calls ``torch.distributed`` on device
tensors (nccl takes them): the Hugging Face Trainer gathers its running loss with
``dist.all_gather`` at each logging step, accelerate gathers evaluation outputs, scripts
all-reduce a metric. Here the engine's outputs live on the XLA device and gloo refuses
them. ``init_distributed`` therefore creates the default group as ``cpu:gloo,xla:<this>``:
each collective on XLA tensors copies them to the host, runs gloo's collective there and
copies the results back (a device sync, as ``.item()`` would be, and never inside a step:
the training collectives are compiled into the step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

NAME = "spmdzero_host"


def _done():
    future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _to_host(value, pairs: list):
    """``value`` with every tensor replaced by a host copy; ``pairs`` collects (device, host)."""
    if isinstance(value, torch.Tensor):
        host = value.detach().cpu()
        pairs.append((value, host))
        return host
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v, pairs) for v in value)
    return value


class HostCopyGroup(ProcessGroup):
    """A process group for XLA tensors that runs gloo's collectives on host copies."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._args = (store, rank, size, timeout)
        self._group = None

    @property
    def _gloo(self):
        """Made at the first collective on XLA tensors (every process reaches it together, as
        collectives are called by all), so that a script that never makes one connects once."""
        if self._group is None:
            self._group = dist.ProcessGroupGloo(*self._args)
        return self._group

    def getBackendName(self):
        return NAME

    def _run(self, name: str, *args):
        """gloo's ``name`` on host copies of ``args``; the results copied back into the first,
        which every collective here writes (all-reduce's tensors, all-gather's outputs, ...).
        The others are only read: a copy back into an input bumped its version, and autograd
        then refused the input's views (TRL's online DPO gathers a split of its log-probs for
        its metrics, then computes its rewards from that split)."""
        written: list = []
        host_args = [_to_host(args[0], written), *(_to_host(arg, []) for arg in args[1:])]
        getattr(self._gloo, name)(*host_args).wait()
        with torch.no_grad():
            for device, host in written:
                # an XLA tensor takes a copy on its device; a torchax one (the torchax backend's
                # outputs, whose device torch cannot allocate on) copies from the host itself
                device.copy_(host.to(device.device) if device.device.type == "xla" else host)
        return _done()

    def allreduce(self, tensors, opts):
        return self._run("allreduce", tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._run("allgather", output_tensors, input_tensors, opts or dist.AllgatherOptions())

    def _allgather_base(self, output_tensor, input_tensor, opts=None):
        return self._run("_allgather_base", output_tensor, input_tensor, opts or dist.AllgatherOptions())

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._run("allgather_into_tensor_coalesced", outputs, inputs, opts or dist.AllgatherOptions())

    def broadcast(self, tensors, opts):
        return self._run("broadcast", tensors, opts)

    def reduce(self, tensors, opts):
        return self._run("reduce", tensors, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        return self._run("reduce_scatter", output_tensors, input_tensors, opts)

    def _reduce_scatter_base(self, output_tensor, input_tensor, opts):
        return self._run("_reduce_scatter_base", output_tensor, input_tensor, opts)

    def gather(self, output_tensors, input_tensors, opts):
        return self._run("gather", output_tensors, input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts):
        return self._run("scatter", output_tensors, input_tensors, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._run("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts=None):
        self._gloo.barrier(opts or dist.BarrierOptions()).wait()
        return _done()


def _create(store, rank, size, timeout):
    return HostCopyGroup(store, rank, size, timeout)


def register() -> str:
    """Register the backend (once per process); returns the backend string for the default
    group: gloo for host tensors, this group for XLA ones."""
    if not hasattr(dist.Backend, NAME.upper()):
        dist.Backend.register_backend(NAME, _create, devices=["xla"])
    return f"cpu:gloo,xla:{NAME}"
