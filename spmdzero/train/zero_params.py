"""DeepSpeed's ZeRO-3 parameters on the host: placeholders, and gathering them whole on demand.

At stage 3 DeepSpeed keeps no whole parameter in a process: each is an empty tensor (``shape
[0]``) carrying ``ds_id``, ``ds_shape``, ``ds_numel`` and ``ds_status``, and code that needs the
values gathers them (``deepspeed.zero.GatheredParameters``, the 16-bit save). spmdzero's devices
hold the parameters; a host module that kept whole copies would hold the model again in every
process, which ZeRO-3 exists to avoid (6 GB for a 1.5B model in fp32, 280 GB for a 70B).

An engine that keeps placeholders (``spmd.host_parameters``) registers itself as each one's
owner: an object with ``gather(params)`` (bring the values whole from the devices into the
host tensors) and ``release(params, keep_edits)`` (edits to the devices if kept, then empty
again). ``gathered`` is what ``GatheredParameters`` runs; nested gathers of one parameter
release it at the outermost exit. Tensors no engine owns are left as they are (a model that
was never initialized, a buffer)."""

from __future__ import annotations

import contextlib
import functools
import weakref
from enum import Enum

import torch


class ZeroParamType(Enum):
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


class ZeroParamStatus(Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


@functools.cache
def _owners():
    """placeholder parameter -> (a weak reference to its owner, how many gathers hold it)."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


def make_placeholder(param: torch.Tensor, owner, index: int) -> int:
    """Empty ``param`` as DeepSpeed's stage 3 does, its values kept by ``owner`` (see the module
    docstring); returns the bytes freed."""
    freed = param.numel() * param.element_size()
    shape = param.shape
    param.data = torch.empty(0, dtype=param.dtype)
    param.ds_id, param.ds_shape, param.ds_numel = index, shape, shape.numel()
    param.ds_tensor = torch.empty(0, dtype=param.dtype)  # DeepSpeed's local partition: on the devices here
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    _owners()[param] = [weakref.ref(owner), 0]
    return freed


def is_placeholder(param: torch.Tensor) -> bool:
    """Whether ``param`` is an engine's placeholder, not gathered now (its values are on the devices)."""
    return param in _owners() and _owners()[param][1] == 0


def owned(param: torch.Tensor) -> bool:
    """Whether an engine keeps ``param`` as a placeholder (gathered now or not)."""
    return param in _owners()


def host_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's shape, a placeholder's included (``ds_shape``)."""
    return param.ds_shape if owned(param) else param.shape


def _by_owner(params) -> dict:
    groups: dict = {}
    for p in params:
        entry = _owners().get(p) if isinstance(p, torch.Tensor) else None
        owner = entry[0]() if entry is not None else None
        if owner is not None:
            groups.setdefault(id(owner), (owner, []))[1].append(p)
    return groups


@contextlib.contextmanager
def gathered(params, keep_edits: bool):
    """The placeholders among ``params`` whole for the block (``GatheredParameters``); on exit
    edits made to them reach the devices if ``keep_edits`` (DeepSpeed's ``modifier_rank``), and
    they are placeholders again."""
    params = list(params)
    first: list = []
    for owner, group in _by_owner(params).values():
        fresh = [p for p in group if _owners()[p][1] == 0]
        if fresh:
            owner.gather(fresh)
        for p in group:
            _owners()[p][1] += 1
            p.ds_status = ZeroParamStatus.AVAILABLE
        first.append((owner, fresh, group))
    try:
        yield
    finally:
        for owner, fresh, group in first:
            for p in group:
                _owners()[p][1] -= 1
            if keep_edits:
                owner.keep(group)
            last = [p for p in group if _owners()[p][1] == 0]
            if last:
                owner.release(last)
                for p in last:
                    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
