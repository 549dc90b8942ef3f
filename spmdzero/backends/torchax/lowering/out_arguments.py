"""``out=`` arguments on the torchax backend: torchax's ops take none.

``torch.mm(a, b, out=c)`` (TRL's chunked log-probabilities, in their forward and backward) and
the ``out=`` forms optimizers call reach torchax's lowerings with the keyword, which they do not
take ("_aten_mm() got an unexpected keyword argument 'out'"). Under ``OutArgumentsCopied`` such
a call is ``c.copy_(torch.mm(a, b))``: torch's result, written where torch writes it. The trace
(``trace_view.tracing``), the backward of an autograd Function that JAX runs after the trace
(``autograd_functions``) and a torch optimizer's step (``torch_optim``) each run under it.
"""

from __future__ import annotations

import torch


class OutArgumentsCopied(torch.overrides.TorchFunctionMode):
    """``torch.maximum(a, b, out=c)`` as ``c.copy_(torch.maximum(a, b))``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        out = kwargs.pop("out", None)
        if not isinstance(out, torch.Tensor):
            return func(*args, **({**kwargs, "out": out} if out is not None else kwargs))
        out.copy_(func(*args, **kwargs))
        return out
