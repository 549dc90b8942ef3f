"""A script's host tensors beside the torchax engine's outputs, and device names in torchax's mode.

On this backend a script's own tensors live on the host: ``engine.device`` is ``cpu``, and a
move to the outputs' device (``y.to(out.device)``, ``torch.zeros(n, device=out.device)``) is a
copy on the host (``spmdzero.runtime.privateuse1``). An op mixing such a tensor with an output
runs in JAX on a copy of it (the engine's output tensors convert host operands, ``engine.py``).
That is right for ``loss_fn(out, y)``, but an op that writes into the host tensor
(``total += loss.detach()``, ``buf[i] = out.argmax(-1)``, ``y.copy_(out)``) wrote only into the
copy: the host tensor kept its old value, silently. ``write_back`` copies the result into it,
a device-to-host copy the script asked for by writing into a host tensor (HF's Trainer sums its
loss into a tensor on its device, the host here).

Inside torchax's mode (a traced forward, and an output's op), ``Tensor.to`` compares the device
type with the raw argument: ``x.to(0)`` or ``x.to("jax:0")`` on a torchax tensor did not match
``"jax"`` and went through the host, which a traced value cannot. ``name_devices_by_type`` gives
torchax the type of such a device, as it gets it from ``x.to(out.device)``. It also gives
``_to_copy`` a torch dtype: torchax's ``torch.as_tensor(tensor, dtype=...)`` hands it the dtype
already converted to JAX's, which it could not convert again ("Attempting to convert unknown
type: float32 to jax type"; torch's ASGD makes its ``eta`` state so).

A factory that makes a host tensor (no device, or ``cpu``) from a one-value device tensor
(``torch.arange(h)``, ``h`` a row of Qwen2-VL's ``grid_thw`` in transformers 4.x) reads its value,
as torch does from a CUDA tensor; torchax handed the tensor to torch's own factory, which stopped
with "Tensor.item() cannot be called on meta tensors". Under a trace the read sends the forward
to the eager run (``host_reads``), as any read does. Such a host tensor may then meet device
tensors in one op (``F.pad(index, (0, pad_w, 0, pad_h))``, ``pad_w`` a device value: Qwen2.5-VL's
window index in 4.x): its values join the op as a constant, where torchax stopped ("Expect a
Tensor or a View but got <class 'torch.Tensor'>").
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch


@functools.lru_cache(maxsize=None)
def _written(func) -> tuple:
    """The arguments ``func`` writes into (its schema's ``Tensor(a!)``): (position, name) each."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _is_host(t) -> bool:
    from torchax import tensor as ttensor

    return isinstance(t, torch.Tensor) and not isinstance(t, ttensor.Tensor)


def write_back(func, args: tuple, kwargs: dict) -> Optional[Callable[[tuple, dict], None]]:
    """For an op on the engine's outputs that writes into host tensors among ``args``/``kwargs``:
    a function that, given the arguments as the op ran on them (host tensors converted to
    torchax tensors, in the same places), copies the written values into the host tensors.
    None when the op writes into no host tensor (nearly every op: no cost beyond a lookup)."""
    places = []
    for i, name in _written(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        where = (i, None) if i < len(args) else (None, name)
        if isinstance(value, (list, tuple)):  # Tensor(a!)[]: the _foreach_ ops
            places += [(*where, j) for j, t in enumerate(value) if _is_host(t)]
        elif _is_host(value):
            places.append((*where, None))
    if not places:
        return None

    def finish(ran_args: tuple, ran_kwargs: dict) -> None:
        from torchax.ops import mappings

        def at(source, i, name, j):
            value = source[0][i] if i is not None else source[1][name]
            return value if j is None else value[j]

        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # copied at once
            for i, name, j in places:
                host, ran = at((args, kwargs), i, name, j), at((ran_args, ran_kwargs), i, name, j)
                host.copy_(mappings.j2t(ran._elem, use_dlpack=False))

    return finish


def _device_type(device):
    """What torchax's ``Tensor.to`` compares with a tensor's device type: ``"jax"`` for ``0``,
    ``"jax:0"`` or ``torch.device("jax:0")``; ``"cpu"`` for ``"cpu"``."""
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, int) and not isinstance(device, bool):  # an index names the accelerator, as in torch
        return torch.device(device).type
    if isinstance(device, str):
        return torch.device(device).type
    return device


def name_devices_by_type(env) -> None:
    """torchax's ``env`` compares ``Tensor.to``'s device by its type, and converts to a torch
    dtype. Idempotent."""
    if getattr(env, "_spmdzero_devices_by_type", False):
        return
    from torchax.ops import mappings

    to_copy = env._to_copy

    def _to_copy(the_tensor, new_dtype, new_device):
        if new_dtype is not None and not isinstance(new_dtype, torch.dtype):  # JAX's, from torch.as_tensor
            new_dtype = mappings.j2t_dtype(new_dtype)
        return to_copy(the_tensor, new_dtype, _device_type(new_device))

    env._to_copy = _to_copy
    constructor = env._handle_tensor_constructor

    def _handle_tensor_constructor(func, args, kwargs):
        if not env._should_use_torchax_tensor(kwargs.get("device")):
            args, kwargs = _numbers(args), {k: _numbers(v) for k, v in kwargs.items()}
        return constructor(func, args, kwargs)

    env._handle_tensor_constructor = _handle_tensor_constructor
    to_jax = env.t2j_iso

    def t2j_iso(tensors):
        return to_jax(torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: _as_device(t, env), tensors))

    env.t2j_iso = t2j_iso
    env._spmdzero_devices_by_type = True


def _as_device(t: torch.Tensor, env):
    """A host tensor (not torchax's) with more than one value as a torchax tensor of its values;
    others as they are (torchax takes a one-value host tensor as a number)."""
    from torchax import tensor as ttensor
    from torchax import view as tview

    if isinstance(t, (ttensor.Tensor, tview.View)) or t.device.type != "cpu" or t.squeeze().ndim == 0:
        return t
    return ttensor.Tensor(env.t2j_copy(t.detach()), env)


def _numbers(value):
    """``value`` with each one-value torchax tensor in it (one level of tuple or list) as its
    Python number: a read."""
    from torchax import tensor as ttensor
    from torchax import view as tview

    if isinstance(value, (tuple, list)):
        return type(value)(_numbers(v) for v in value)
    if isinstance(value, (ttensor.Tensor, tview.View)) and value.dim() == 0:
        return value.item()
    return value
