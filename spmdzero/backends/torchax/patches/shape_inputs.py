"""Inputs whose values are shapes, kept on the host and made part of the program, as a Python
number is.

Why: Qwen-VL-style models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V) get ``image_grid_thw``, each
image's patch grid, beside ``pixel_values``, all of its patches in one flat tensor. Their vision
tower reads the grid on the host to lay the patches out (transformers' ``vision_utils``:
``grid_thw.tolist()``, the rotary positions, the attention's per-image ``torch.split``, 2.5-VL's
window order), so under ``jax.jit`` the first read sent the whole forward down the eager path
(``host_reads``). The grid's values are shapes already: ``pixel_values`` has their sum of rows,
so a batch of other image sizes compiles anyway. Kept as a host tensor and keyed by its values,
each read sees the numbers in the trace, and the program compiles once per set of grids (for
images of one size, once).

Pixtral's vision tower (Mistral 3, and LLaVA checkpoints built on it) crops each image's patch
grid by ``image_sizes``, each image's size after the processor resized it, which ``pixel_values``
holds padded to the batch's largest: a model with that tower keeps ``image_sizes`` too. Other
models' ``image_sizes`` are the images' original sizes (LLaVA-NeXT), which differ from image to
image while the shapes stay: kept, they would compile a program per batch, so they are not.

``kept_on_host`` wraps such a tensor, where the forward gets it by one of those names, as a
``HostValue``: a non-tensor leaf, so the program's key holds it (``Forwards.program``) and
the trace gets it back as a host tensor (``unwrapped``). Only with one process: each process's
images are its own, and every process must run the same program.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

# forward arguments that hold a patch grid per image or video, or the frame spacing that places
# a video's frames (Qwen2.5-VL), as transformers' Qwen-VL processors name them
NAMES = frozenset({"image_grid_thw", "video_grid_thw", "second_per_grid_ts"})
_MOST_VALUES = 1 << 14  # a grid per image: far fewer numbers than this
_CROPPED_BY_SIZES = frozenset({"PixtralTransformer"})  # vision towers that crop by image_sizes


_names_of: "weakref.WeakKeyDictionary[torch.nn.Module, frozenset]" = weakref.WeakKeyDictionary()


def names(module: torch.nn.Module) -> frozenset:
    """The argument names kept for ``module``'s forward: ``NAMES``, and ``image_sizes`` where a
    submodule crops by them (found once per module)."""
    found = _names_of.get(module)
    if found is None:
        crops = any(type(m).__name__ in _CROPPED_BY_SIZES for m in module.modules())
        found = _names_of[module] = NAMES | {"image_sizes"} if crops else NAMES
    return found


class HostValue:
    """A host tensor carried as a static leaf of a program's inputs: equal, and hashed, by its
    dtype, shape and values."""

    __slots__ = ("tensor", "_key")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach().to("cpu", copy=True).contiguous()
        self._key = (str(self.tensor.dtype), tuple(self.tensor.shape), tuple(self.tensor.flatten().tolist()))

    def __eq__(self, other) -> bool:
        return isinstance(other, HostValue) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"HostValue({self.tensor.tolist()})"


def _keepable(value, is_device_tensor) -> bool:
    return (isinstance(value, torch.Tensor) and not is_device_tensor(value) and not value.requires_grad
            and value.numel() <= _MOST_VALUES)


def kept_on_host(tree, is_device_tensor, kept: frozenset = NAMES):
    """``tree`` (a forward's inputs or keyword arguments, their mappings plain dicts already) with
    each host tensor named by one of ``kept`` (``names``), at any depth, as a ``HostValue``."""
    if isinstance(tree, Mapping):
        return type(tree)((k, HostValue(v) if k in kept and _keepable(v, is_device_tensor)
                           else kept_on_host(v, is_device_tensor, kept)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(kept_on_host(v, is_device_tensor, kept) for v in tree)
    return tree


def unwrapped(value):
    """A static leaf as the traced forward gets it: a ``HostValue``'s tensor (a copy of its own,
    which the forward may change), anything else as it is."""
    return value.tensor.clone() if isinstance(value, HostValue) else value
