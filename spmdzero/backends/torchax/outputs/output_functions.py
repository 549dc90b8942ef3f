"""torch functions that the engine's outputs (``output_tensor``) run otherwise than torch's C++
would run them. torch's C++ sees an output's device as ``meta`` and its integers as int32
(torchax's, JAX without x64), and some functions check or make tensors from that before their
ops reach the outputs' dispatch:

* ``torch.where(mask, out, 0.0)``, ``out.where(mask, 0.0)``: the number became a tensor on
  ``meta``, with no value ("Cannot copy out of meta tensor; no data!"; TRL's distillation
  losses mask so, and ORPO's ``log1mexp`` is such a ``where``). Here it is a host tensor of the
  dtype torch gives the result.
* ``out.new_tensor(data)``: the data was copied to ``meta``, and lost. Here it is a tensor of
  ``out``'s dtype beside ``out``.
* ``torch.take_along_dim(out, host_indices, dim)``: refused for the host indices' device, and
  for int32 indices (TRL's online DPO takes its log-probs so). Here it is the gather it stands
  for (``lowerings.take_along_dim``), through the outputs' ops, so autograd sees it.
* ``F.one_hot(out.argmax(-1), n)``: refused for int32 indices. Here it is a comparison with
  ``arange(n)``, in int32 as the outputs' other integers.

Every other function runs as torch's C++ runs it.
"""

from __future__ import annotations

import torch

from spmdzero.backends.torchax.lowering import lowerings


def replaced(func, args: tuple, kwargs: dict, as_output):
    """The result of ``func(*args, **kwargs)`` on outputs where torch's C++ would refuse it or
    lose a value, else ``NotImplemented``. ``as_output(host_tensor)``: that tensor beside the
    outputs."""
    values = _where_values(func, args)
    if values is not None and any(map(_is_number, values)):
        # of the dtype torch gives the result, which JAX's promotion of a float32 number would
        # widen (``where(mask, bf16, 0.5)`` is bf16)
        dtype = torch.result_type(*values)
        return func(*(torch.tensor(a, dtype=dtype) if _is_number(a) else a for a in args), **kwargs)
    if func is torch.Tensor.new_tensor:
        return _new_tensor(*args, as_output=as_output, **kwargs)
    if func in (torch.take_along_dim, torch.Tensor.take_along_dim):
        return lowerings.take_along_dim(*args, **kwargs)
    if func is torch.nn.functional.one_hot:
        return _one_hot(*args, **kwargs)
    return NotImplemented


def _where_values(func, args: tuple) -> tuple | None:
    """The two values of a ``where`` call (``torch.where(mask, a, b)``, ``a.where(mask, b)``);
    None for any other call."""
    if func is torch.where and len(args) == 3:
        return args[1], args[2]
    if func is torch.Tensor.where and len(args) == 3:
        return args[0], args[2]
    return None


def _is_number(value) -> bool:
    return isinstance(value, (bool, int, float, complex))


def _new_tensor(self, data, dtype=None, device=None, requires_grad=False, *, as_output, **_):
    """``data`` as a tensor of ``self``'s dtype beside ``self`` (a host tensor where ``device``
    names the host), as torch's ``new_tensor`` is."""
    dtype = dtype or self.dtype
    made = data.detach().clone().to(dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device is not None and torch.device(device).type == "cpu":
        made = made.cpu()
    elif made.device.type == "cpu":
        made = as_output(made)
    return made.requires_grad_(requires_grad)


def _one_hot(tensor, num_classes: int = -1):
    if num_classes < 0:  # torch reads the largest index too
        num_classes = int(tensor.max()) + 1
    return (tensor.unsqueeze(-1) == torch.arange(num_classes)).to(torch.int64)
