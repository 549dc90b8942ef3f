"""What libraries see while this backend traces a module: a trace, as under ``torch.compile``.

Libraries written for torch keep a host-side fast path for eager mode and a trace-friendly path
for compilers, and choose between them with ``torch.compiler.is_compiling()``. transformers
4.57's ``_ignore_causal_mask_sdpa`` (OPT, RoBERTa, ...) reads ``torch.all(mask == 1)`` on the
host unless it sees a compiler, and other models read a value to skip work the same way. Under
``jax.jit`` a host read is a ConcretizationTypeError, so the backend refused stock models
that ``torch.compile`` and torch_xla run.

``tracing()`` raises torch's own flag (``torch.compiler._is_compiling_flag``, the one dynamo
and ``torch.export`` set) for the duration of the trace, so every library that asks the public
question gets the answer it would get under ``torch.compile``. The flag is process-wide, like
dynamo's; the backend traces on one thread, and the flag is restored when the trace ends, by
an exception too.
"""

from __future__ import annotations

import contextlib

import torch
import torch.compiler


@contextlib.contextmanager
def tracing():
    """``torch.compiler.is_compiling()`` answers True inside. Re-entrant."""
    before = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = before
