"""Ops on the engine's outputs that torchax cannot lower, run by torch on the host.

A script's code outside the engine (its loss, its metrics) runs op by op on the outputs
(``output_tensor``), and ``engine.backward`` runs torch's autograd over it (``outside_loss``),
so the outputs meet every op the script and torch's backward formulas call. torchax 0.0.13
lowers most of them, not all: a contrastive loss's ``torch.cdist`` stopped at its backward
("Operator with name aten::_cdist_backward has no lowering"), and so did ``masked_scatter``,
``embedding_bag``, ``multi_margin_loss``, the pooling, interpolation and convolution
backwards, and ``torch.linalg.det``. Such an op now runs on the host, on host copies of its
tensors, and its results come back as outputs: the values torch gives, at the cost of a
device-to-host copy and back (a host sync), said once per op. Inside the engine's programs
nothing changes (JAX differentiates the traced forward; no backward op is called there).
"""

from __future__ import annotations

import warnings

import torch
from torch.utils import _pytree as torch_pytree

from spmdzero.backends.torchax.lowering.values import READ_ONLY_HOST_VALUE

_SAID: set = set()


def run(func, args: tuple, kwargs: dict, as_output):
    """``func(*args, **kwargs)`` with the torchax tensors among them copied to the host, and
    each tensor result handed back through ``as_output``. In-place ops are not run here: their
    write would land in the host copy."""
    from torchax import tensor as ttensor
    from torchax.ops import mappings

    if func._schema.is_mutable:
        raise ttensor.OperatorNotFound(f"{func} has no torchax lowering, and writes its inputs: it cannot run on a host copy")
    name = str(func)
    if name not in _SAID:
        _SAID.add(name)
        warnings.warn(f"spmdzero: torchax has no lowering of {name}; on the engine's outputs it runs on the host "
                      "(a device-to-host copy and back, each call)", stacklevel=4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", READ_ONLY_HOST_VALUE)  # copied at once
        host_args, host_kwargs = torch_pytree.tree_map_only(ttensor.Tensor, lambda t: _host(mappings.j2t(t._elem, use_dlpack=False)),
                                                            (args, kwargs))
    result = func(*host_args, **host_kwargs)
    return torch_pytree.tree_map_only(torch.Tensor, as_output, result)


def _host(value: torch.Tensor) -> torch.Tensor:
    """A host copy of a torchax tensor's value, its int32 as torch's int64 (torchax makes
    torch's int64 int32: an index an op takes must be int64 again on the host)."""
    return value.long() if value.dtype == torch.int32 else value.clone()
