"""At ZeRO-3, the host module's parameters as DeepSpeed's stage 3 keeps them: placeholders
(``train/zero_params.py``), their values on the devices only.

Generation runs on the devices, and the 16-bit save and ``GatheredParameters`` read the devices
when asked, so nothing needs a whole copy on the host. ``spmd.host_parameters``: ``"auto"`` (the
default) keeps placeholders at stage 3 from ``AUTO_FROM_BYTES`` of host parameters, where the copy
matters (a model of a few hundred MB keeps its copy, and scripts that read it keep working);
``"placeholders"`` at stage 3 whatever the size; ``"whole"`` never. A placeholder reads as
DeepSpeed's: ``shape [0]``, ``ds_shape``, ``ds_numel``, ``ds_id``, ``ds_status``
NOT_AVAILABLE; ``deepspeed.zero.GatheredParameters`` brings it whole for a block (edits kept with
``modifier_rank``), as does ``engine.module.generate`` on the host (beam search and the other
fallbacks).

Gathering is lazy: inside the block a parameter has its shape at once (a one-element stand-in,
expanded), and its values come from the devices at the first torch op that reads one of the
gathered parameters (the watched parameter class, ``host_module``). TRL gathers the whole model
around ``generate`` at ZeRO-3 (``unwrap_model_for_generation``); generation runs on the devices
and reads no host value, so nothing is copied."""

from __future__ import annotations

import warnings
import weakref

import torch

from spmdzero.observe.console import say_once
from spmdzero.train import zero_params

AUTO_FROM_BYTES = 2**30  # the host copy's size from which "auto" keeps placeholders


def chosen(setting: str, stage: int, module: torch.nn.Module, shape_only: bool) -> bool:
    """Whether this engine keeps its host parameters as placeholders (see the module docstring)."""
    if shape_only or stage < 3 or setting == "whole":
        return False
    if setting == "placeholders":
        return True
    return sum(p.numel() * p.element_size() for p in module.parameters()) >= AUTO_FROM_BYTES


class HostPlaceholders:
    """The owner of an engine's placeholders (``zero_params``'s protocol): gathers their values
    from the devices, keeps edits made while gathered, and empties them again."""

    def __init__(self, engine, host, module: torch.nn.Module):
        self._engine = weakref.proxy(engine)
        self._host = host
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._pending: dict[int, torch.Tensor] = {}  # gathered, not yet read: their stand-ins
        placed = {**engine.state.params, **engine.state.constants}
        freed = 0
        with torch.no_grad():
            for index, (name, p) in enumerate(module.named_parameters()):
                if name in placed and not zero_params.owned(p):
                    freed += zero_params.make_placeholder(p, self, index)
        say_once([f"ZeRO-3: the host module keeps its parameters as placeholders, as DeepSpeed's stage 3 does "
                  f"({freed / 2**30:.2f} GiB not held on the host; deepspeed.zero.GatheredParameters brings them "
                  "whole; spmd.host_parameters)"])

    def _value(self, name: str) -> torch.Tensor:
        from torchax.ops import mappings

        state = self._engine.state
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # it is copied
            return mappings.j2t(state.params[name] if name in state.params else state.constants[name],
                                use_dlpack=False)

    def gather(self, params: list) -> None:
        """Whole shapes now, values at the first read (``fill_pending``)."""
        with torch.no_grad(), self._host.unwatched():
            for p in params:
                p.data = torch.zeros((), dtype=p.dtype).expand(p.ds_shape)
                self._pending[id(p)] = p
        self._host.seen()

    def fill_pending(self) -> None:
        """The gathered parameters' values from the devices (a torch op is about to read one)."""
        if not self._pending:
            return
        self._engine.gradients.settle()  # at the parameters the unconfirmed forwards saw
        with torch.no_grad(), self._host.unwatched():
            for p in self._pending.values():
                value = self._value(self._names[id(p)])
                p.data = value.to(p.dtype) if value.dtype != p.dtype else value.clone()
        self._pending = {}
        self._host.seen()

    def keep(self, params: list) -> None:
        """Edits made while gathered go to the devices (``GatheredParameters(modifier_rank=...)``);
        a parameter never read was never edited."""
        with self._host.unwatched():
            for p in params:
                if id(p) not in self._pending:
                    self._host.put(self._names[id(p)], p.detach())

    def release(self, params: list) -> None:
        with torch.no_grad(), self._host.unwatched():
            for p in params:
                self._pending.pop(id(p), None)
                p.data = torch.empty(0, dtype=p.dtype)
        self._host.seen()
