"""A device that runs out of memory raises torch's ``OutOfMemoryError``, as a GPU does.

Why: the Trainer's ``--auto_find_batch_size`` and accelerate's ``find_executable_batch_size``
halve the batch and try again only on a ``RuntimeError`` whose one argument contains
``" out of memory."``, CUDA's words (``accelerate.utils.memory.should_reduce_batch_size``). JAX
and torch_xla report exhausted device memory as XLA's status ``RESOURCE_EXHAUSTED`` ("Out of
memory allocating N bytes."; on a TPU, usually when the step compiles: "Ran out of memory in
memory space hbm"), which that check passes on, so on a TPU the batch would never shrink and the
run would stop at the first step. A program that fails to allocate once it runs, after its call
returned (JAX dispatches asynchronously), says so where its outputs are first read (``INTERNAL:
... Out of memory allocating N bytes.``). The engine's calls (forward, backward, step) and the
torchax backend's reads of their outputs (``loss.item()``) raise either as
``torch.OutOfMemoryError`` instead: a ``RuntimeError``, as CUDA's is, whose message starts with
"XLA device out of memory." and goes on with XLA's whole message; XLA's error stays chained as
its ``__cause__``. Any other error passes unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

# what XLA's errors say when memory ran out (JAX's XlaRuntimeError, torch_xla's RuntimeError):
# the status code of a failed allocation or compile, and the words of one found at a read
EXHAUSTED = ("RESOURCE_EXHAUSTED", "out of memory")


def is_device_out_of_memory(err: BaseException) -> bool:
    """An XLA runtime error that says the device's memory ran out."""
    if not isinstance(err, RuntimeError) or isinstance(err, torch.OutOfMemoryError):
        return False
    message = str(err)
    return EXHAUSTED[0] in message or EXHAUSTED[1] in message.lower()


def as_torch_out_of_memory(err: RuntimeError) -> torch.OutOfMemoryError:
    """``err`` as torch's error, with the words accelerate and the Trainer look for."""
    return torch.OutOfMemoryError(f"XLA device out of memory. {err}")


def raises_torch_out_of_memory(method: Callable) -> Callable:
    """``method`` with a device's exhausted memory raised as ``torch.OutOfMemoryError``."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except RuntimeError as err:
            if not is_device_out_of_memory(err):
                raise
            raise as_torch_out_of_memory(err) from err

    return call
