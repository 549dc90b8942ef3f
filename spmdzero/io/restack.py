"""Checkpoints across ``spmd.scan_layers='stacked'``: which saved tensors make up each live
one when a checkpoint stacks its layer parameters and the engine does not, or the reverse.

Pure key arithmetic (no devices), so a run can switch the setting between a save and a
load: a per-layer checkpoint (a plain spmdzero run, or an imported DeepSpeed one) feeds a
stacked engine, and a stacked checkpoint a per-layer one. A stacked name
(``transformer.h.attn.c_attn.weight``, stack ``transformer.h``) stands for the per-layer names
``transformer.h.0.attn.c_attn.weight`` ... and appears in the keys of the parameter, its fp32
master and its optimizer states (``model.<name>``, ``master.<name>``, ``optim.<name>.<state>``).
"""

from __future__ import annotations

import re

from dataclasses import dataclass
from typing import Optional

_PREFIXES = ("model.", "master.", "optim.")


@dataclass(frozen=True)
class Source:
    """Where a live tensor's value comes from: ``keys`` of the checkpoint, combined by
    ``how``: "copy" (one key, as is), "stack" (one key per layer, stacked on a new dim 0),
    "slice" (layer ``index`` of one stacked key)."""

    keys: tuple[str, ...]
    how: str = "copy"
    index: Optional[int] = None

    def layer_spec(self, spec: tuple) -> tuple:
        """The partition spec to read each of ``keys`` with, given the live tensor's."""
        if self.how == "stack":
            return tuple(spec[1:])
        if self.how == "slice":
            return (None, *spec)
        return tuple(spec)

    def shape(self, saved: dict[str, tuple]) -> tuple:
        """The shape this source assembles, from the saved shapes."""
        first = tuple(saved[self.keys[0]])
        if self.how == "stack":
            return (len(self.keys), *first)
        if self.how == "slice":
            return first[1:]
        return first

    def assemble(self, values: dict):
        """The live tensor's value from the read tensors (``values`` by checkpoint key)."""
        if self.how == "stack":
            import torch

            return torch.stack([values[key] for key in self.keys])
        if self.how == "slice":
            return values[self.keys[0]][self.index]
        return values[self.keys[0]]


def layer_names(stacked: dict[str, str], layers: dict[str, int]) -> dict[str, list[str]]:
    """{stacked name: its per-layer names}, from ``{stacked name: stack}`` (``scan.stacked_layers``)
    and each stacked name's layer count."""
    out = {}
    for name, stack in stacked.items():
        local = name[len(stack) + 1:]
        out[name] = [f"{stack}.{layer}.{local}" for layer in range(layers[name])]
    return out


def _split(key: str, names) -> Optional[tuple[str, str, str]]:
    """``(prefix, name, rest)`` when ``key`` is ``prefix + name + rest`` for one of ``names``."""
    for prefix in _PREFIXES:
        if not key.startswith(prefix):
            continue
        body = key[len(prefix):]
        for name in names:
            if body == name or body.startswith(name + "."):
                return prefix, name, body[len(name):]
    return None


def sources(live: dict[str, tuple], saved: dict[str, tuple], live_stacked: dict[str, list[str]],
            saved_stacked: dict[str, list[str]]) -> dict[str, Source]:
    """Sources for the live keys the checkpoint lacks but holds by layer, or stacked.

    ``live`` and ``saved`` map keys to shapes; ``live_stacked`` gives the engine's stacked
    names and their per-layer names, ``saved_stacked`` the checkpoint's. A live stacked
    tensor takes its layers' saved tensors, stacked; a state that is not per layer (a step
    count, shaped like each layer's) takes layer 0's, which every layer shares in a run that
    steps them together. A live per-layer tensor takes its slice of the saved stacked one."""
    out: dict[str, Source] = {}
    layer_of = {layer: (name, index) for name, layers in saved_stacked.items() for index, layer in enumerate(layers)}
    for key, shape in live.items():
        if key in saved:
            continue
        split = _split(key, live_stacked)
        if split is not None:
            prefix, name, rest = split
            keys = tuple(prefix + layer + rest for layer in live_stacked[name])
            if keys and all(k in saved for k in keys):
                layered = len(shape) == len(saved[keys[0]]) + 1 and tuple(shape) == (len(keys), *saved[keys[0]])
                out[key] = Source(keys, "stack") if layered else Source(keys[:1])
            continue
        split = _split(key, layer_of)
        if split is not None:
            prefix, layer, rest = split
            name, index = layer_of[layer]
            stacked_key = prefix + name + rest
            if stacked_key in saved:
                stacked = tuple(saved[stacked_key])
                sliced = len(stacked) == len(shape) + 1 and stacked[1:] == tuple(shape) and index < stacked[0]
                out[key] = Source((stacked_key,), "slice", index) if sliced else Source((stacked_key,))
    return out


def host_state_names(live_names, saved_names, live_stacked: dict[str, list[str]],
                     saved_stacked: dict[str, list[str]]) -> dict[str, str]:
    """{live target name: the saved name whose host-side optimizer state it takes}: its own,
    its layer 0's (live stacked), or its stack's (live per layer)."""
    saved_names = set(saved_names)
    stack_of = {layer: name for name, layers in saved_stacked.items() for layer in layers}
    out = {}
    for name in live_names:
        if name in saved_names:
            out[name] = name
        elif live_stacked.get(name) and live_stacked[name][0] in saved_names:
            out[name] = live_stacked[name][0]
        elif stack_of.get(name) in saved_names:
            out[name] = stack_of[name]
    return out


def unstack(state_dict: dict, stacks: dict[str, str]) -> dict:
    """A state dict with each stacked tensor (``stacked_layers``) written as its layers under
    the per-layer names the plain model has: what the model without
    ``spmd.scan_layers='stacked'`` loads."""
    out = {}
    for name, tensor in state_dict.items():
        stack = stacks.get(name)
        if stack is None:
            out[name] = tensor
            continue
        local = name[len(stack) + 1:]
        out.update({f"{stack}.{layer}.{local}": tensor[layer].clone() for layer in range(tensor.shape[0])})
    return out


def stacking_mismatch(missing: list[str], unexpected: list[str]) -> str:
    """A sentence for a checkpoint whose keys differ from the model's by stacking
    (``transformer.h.0.attn.c_attn.weight`` against ``transformer.h.attn.c_attn.weight``) and
    that ``spmdzero.io.restack`` could not map (layers missing), else ''."""
    def unstacked(keys):
        return {re.sub(r"\.\d+\.", ".", key, count=1) for key in keys}

    if set(missing) & unstacked(unexpected):
        return ("; the checkpoint has per-layer parameters and this model stacks them "
                "(spmd.scan_layers='stacked'), but not every layer of each stack is in the checkpoint "
                "(a model of another depth?)")
    if set(unexpected) & unstacked(missing):
        return ("; the checkpoint has stacked layer parameters (saved with spmd.scan_layers='stacked') and this "
                "model has per-layer ones, but not every layer is in the checkpoint's stacks "
                "(a model of another depth?)")
    return ""
