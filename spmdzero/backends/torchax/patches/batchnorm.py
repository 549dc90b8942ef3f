"""Batch-norm running statistics on the torchax backend: torchax 0.0.13 lowers batch norm
without writing ``running_mean``/``running_var`` back, and ``momentum=None`` reads the batch
count on the host (``num_batches_tracked.item()``), which a traced program cannot.

While the engine traces the module, each ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` that
tracks running statistics runs ``_forward_with_update`` instead of its own forward in
training: the output from the batch's statistics, as torch's, and the running statistics
updated as torch updates them (momentum or, for ``momentum=None``, the cumulative average,
``running_var`` from the unbiased variance, ``num_batches_tracked`` counted) with torch ops
that write the buffers in place; the engine's program returns the buffers it changed. The
batch is the global one (every data-parallel row), which is what ``SyncBatchNorm`` means, so
both classes run the same code. In eval mode the module's own forward runs (the running
statistics, which torchax lowers as torch does).

Why a module apart: it is the one place the engine replaces a torch module's behaviour while
tracing, and the one place that knows which batch-norm modules it can replace.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm

_OWN_FORWARDS = (_BatchNorm.forward, SyncBatchNorm.forward)


def tracked(module: torch.nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The batch-norm submodules that track running statistics, by name."""
    return [(name, sub) for name, sub in module.named_modules()
            if isinstance(sub, _BatchNorm) and sub.track_running_stats]


def check_replaceable(module: torch.nn.Module) -> None:
    """Refuse a batch-norm subclass with its own ``forward``: its running statistics would stay
    as they were, silently (the replacement runs torch's forward, not the subclass's)."""
    for name, sub in tracked(module):
        if type(sub).forward not in _OWN_FORWARDS or "forward" in vars(sub):
            raise ValueError(f"spmd.backend='torchax' updates batch-norm running statistics by running torch's own "
                             f"batch norm, but module {name!r} ({type(sub).__name__}) has its own forward; use "
                             "spmd.backend='torch_xla', or set track_running_stats=False on it")


def _forward_with_update(bn: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    """``bn``'s forward; in training, also the running statistics updated in place as torch does."""
    if not bn.training:
        return type(bn).forward(bn, input)
    bn._check_input_dim(input)
    if isinstance(bn, SyncBatchNorm):
        bn._check_non_zero_input_channels(input)
    output = F.batch_norm(input, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    dims = [0, *range(2, input.dim())]
    with torch.no_grad():
        x = input.detach()
        mean, var = x.mean(dims), x.var(dims, correction=1)  # torch's running_var takes the unbiased variance
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / bn.num_batches_tracked if bn.momentum is None else bn.momentum  # a tensor: no host read
        running_mean, running_var = bn.running_mean, bn.running_var
        running_mean.copy_((running_mean * (1 - factor) + mean * factor).to(running_mean.dtype))
        running_var.copy_((running_var * (1 - factor) + var * factor).to(running_var.dtype))
    return output


@contextlib.contextmanager
def patched(trace):
    """While tracing: ``trace.batch_norms`` (from ``tracked``) run ``_forward_with_update``."""
    modules = trace.batch_norms
    for bn in modules:
        bn.forward = types.MethodType(_forward_with_update, bn)
    try:
        yield
    finally:
        for bn in modules:
            vars(bn).pop("forward", None)
