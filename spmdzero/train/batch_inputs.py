"""Which input tensors of a forward carry the batch, and along which dim.

DeepSpeed never looks at a forward's inputs: each rank feeds its own rows. Here one process
feeds all of its host's devices, so it has to find the rows to split them over the
data-parallel devices. Splitting another dim would not change a result (a sharding annotation
is a layout: GSPMD keeps the math), but it costs compute and it changes what
``global_samples`` and samples/s count, so the rule does not guess:

* the batch dim is dim 0, unless ``spmd.batch_dim`` says otherwise: one int for every input
  (``1`` for a sequence-first model), or one per forward argument (``{"src": 1,
  "src_key_padding_mask": 0, "prototypes": null}``, where ``null`` means "not a batch":
  replicated). Positional arguments are named by the module's ``forward`` signature, tensors
  inside a dict by their key; an argument not listed has its batch on dim 0;
* the forward's rows are the configured rows per micro-step when some input has that many
  along its batch dim (a lookup table passed first is then not taken for the batch), else the
  first input's;
* the inputs with that many rows along their batch dim are split, the others replicated.

Where a 3-D or larger first input disagrees with the config on dim 0 and agrees on dim 1, a
hint names ``spmd.batch_dim`` (a sequence-first model); nothing is decided from it.
"""

from __future__ import annotations
import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union
import torch
from spmdzero.train.data import caller_stacklevel

BatchDim = Union[int, Mapping[str, Optional[int]]]


@dataclass(frozen=True)
class BatchLayout:
    """One forward's batch: its rows (None when no input has a batch dim), whether they were
    read from tensors already on the devices (global rows) or from host tensors (this host's),
    and the batch dim of every input to split, by ``id`` (the others are replicated)."""

    rows: Optional[int] = None
    on_device: bool = False
    split: dict[int, int] = field(default_factory=dict)
    hint: Optional[str] = None  # a likely sequence-first input, when spmd.batch_dim is not set

    def dim_of(self, t: torch.Tensor) -> Optional[int]:
        """The dim of ``t`` to split along the batch axes; None: replicated."""
        return self.split.get(id(t))


def forward_argument_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The names of ``module.forward``'s positional parameters, in order (up to ``*args``)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    names = []
    for p in parameters:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return tuple(names)


def _named_tensors(obj: Any, name: Optional[str], out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((name, obj))
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _named_tensors(item, name, out)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _named_tensors(value, key if isinstance(key, str) else name, out)


def batch_layout(inputs: tuple, kwargs: dict, argument_names: tuple[str, ...], batch_dim: BatchDim,
                 expected_rows: Callable[[bool], int], on_device: Callable[[torch.Tensor], bool]) -> BatchLayout:
    """The batch of one forward, by the rule in the module docstring. ``expected_rows(on_device)``
    gives the configured rows per micro-step: global for tensors already on the devices, this
    host's for host tensors."""
    named: list = []
    for i, arg in enumerate(inputs):
        _named_tensors(arg, argument_names[i] if i < len(argument_names) else None, named)
    for key, value in kwargs.items():
        _named_tensors(value, key, named)

    def dim_for(name: Optional[str], t: torch.Tensor) -> Optional[int]:
        dim = batch_dim.get(name, 0) if isinstance(batch_dim, Mapping) else batch_dim
        return dim if dim is not None and t.dim() > dim else None

    candidates = [(t, dim) for name, t in named if (dim := dim_for(name, t)) is not None]
    if not candidates:
        return BatchLayout()
    first, first_dim = candidates[0]
    device = on_device(first)
    expected = expected_rows(device)
    matching = any(t.shape[dim] == expected for t, dim in candidates)
    rows = expected if matching else first.shape[first_dim]
    hint = None
    if not matching and batch_dim == 0 and first.dim() > 2 and first.shape[1] == expected:
        hint = (f"the first input has {first.shape[0]} on dim 0 and {expected} on dim 1, the configured rows per "
                f"micro-step; if the model is sequence-first ([seq, batch, ...]), set \"spmd\": {{\"batch_dim\": 1}} "
                "(or per argument, e.g. {\"src\": 1, \"src_key_padding_mask\": 0}) so that the batch is split and "
                "counted along it")
    return BatchLayout(rows, device, {id(t): dim for t, dim in candidates if t.shape[dim] == rows}, hint)


def leading_dim_layout(batch: Any) -> BatchLayout:
    """The layout of a batch drawn by the engine's own loader (its rows are the configured
    ones): the first tensor's dim 0 is the batch, and every tensor with that many rows on
    dim 0 carries it."""
    tensors: list = []
    _named_tensors(batch, None, tensors)
    rows = next((t.shape[0] for _, t in tensors if t.dim()), None)
    if rows is None:
        return BatchLayout()
    on_device = next(t for _, t in tensors if t.dim()).device.type == "xla"
    return BatchLayout(rows, on_device, {id(t): 0 for _, t in tensors if t.dim() and t.shape[0] == rows})


_NOTED_REPLICATED: set[tuple[int, int]] = set()


def note_replicated(rows: int, devices: int) -> None:
    """Warn, once per shape, that a batch whose rows do not divide over the data-parallel devices
    runs replicated (both backends place it so)."""
    if (rows, devices) in _NOTED_REPLICATED:
        return
    _NOTED_REPLICATED.add((rows, devices))
    warnings.warn(f"spmdzero: a batch of {rows} rows does not divide over the {devices} data-parallel devices; it "
                  f"runs replicated along the batch (every device computes all {rows} rows, the same result at "
                  f"{devices}x the compute, and one more compiled program for this shape). Use a multiple of "
                  f"{devices} rows to split it (noted once per shape).", stacklevel=caller_stacklevel())
