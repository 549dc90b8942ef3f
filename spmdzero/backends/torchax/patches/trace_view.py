"""What libraries see while this backend traces a module: a trace, as under ``torch.compile``.

Libraries written for torch keep a host-side fast path for eager mode and a trace-friendly path
for compilers, and choose between them with ``torch.compiler.is_compiling()``. transformers
4.57's ``_ignore_causal_mask_sdpa`` (OPT, RoBERTa, ...) reads ``torch.all(mask == 1)`` on the
host unless it sees a compiler, and other models read a value to skip work the same way. Under
``jax.jit`` a host read is a ConcretizationTypeError, and such a forward runs eagerly, several
times slower (``host_reads``): stock models that ``torch.compile`` compiles would lose their
compiled step for a read they skip under a compiler.

torchax's ops take no ``out=`` argument (``torch.mm(a, b, out=c)``, which TRL and optimizers call):
inside ``tracing()`` such a call is ``c.copy_(torch.mm(a, b))`` (``out_arguments``).

JAX differentiates the whole traced function, where torch's autograd records nothing under
``torch.no_grad()``: a forward that computes a scale, a routing weight or a target there would
send gradients through it. Inside ``tracing()`` every result computed with grad disabled is
``jax.lax.stop_gradient``-ed (``NoGradStopsGradients``); ``torch.detach`` is lowered to it too
(``lowerings``). Not inside a custom ``torch.autograd.Function``'s forward, which torch runs
with grad disabled too: its gradient is its ``backward``'s, which the trace keeps as a
``jax.custom_vjp`` (``autograd_functions``).

``tracing()`` raises torch's own flag (``torch.compiler._is_compiling_flag``, the one dynamo
and ``torch.export`` set) for the duration of the trace, so every library that asks the public
question gets the answer it would get under ``torch.compile``. The flag is process-wide, like
dynamo's; the backend traces on one thread, and the flag is restored when the trace ends, by
an exception too. A method whose path under a compiler computes another function than eager
torch's (``EAGER_PATHS``) sees the flag down: transformers 4.x's RecurrentGemma skips its RG-LRU's
input normalization (``SqrtBoundDerivative``) when it sees a compiler, and trained to other
weights (its loss 1e-3 off at the first step, 3e-2 by the fourth).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.compiler
from torch.utils import _pytree as torch_pytree

from spmdzero.backends.torchax.lowering import autograd_functions
from spmdzero.backends.torchax.patches import transformers_methods
from spmdzero.backends.torchax.lowering.out_arguments import OutArgumentsCopied


class NoGradStopsGradients(torch.overrides.TorchFunctionMode):
    """Results computed under ``torch.no_grad()`` (or ``torch.inference_mode``) take no gradient,
    except inside an autograd Function's forward (``_functions_running``), and except a result
    that is one of the op's own tensors: torch hands the tensor itself back there (``p.to(dtype)``
    in its dtype, which ``module.to(dtype)`` runs under ``no_grad`` and assigns to ``p.data``:
    Switch Transformers' router moves its classifier so in every forward, and its weights had
    stopped getting gradients). A lazy view made there stays one, its values stopped
    (``_views_stop_gradients``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled() or _functions_running[0]:
            return result
        import jax
        from torchax import tensor

        from torchax import view

        given = {id(t) for t in torch_pytree.tree_leaves((args, kwargs)) if isinstance(t, (tensor.Tensor, view.View))}

        def stopped(t):
            if id(t) in given:
                return t
            if isinstance(t, view.View):  # a lazy view (a slice): it still writes through; its values stop
                _views_stop_gradients()
                t._spmdzero_no_grad = True
                return t
            return tensor.Tensor(jax.lax.stop_gradient(t._elem), t._env)

        return torch_pytree.tree_map_only((tensor.Tensor, view.View), stopped, result)


def _views_stop_gradients() -> None:
    """torchax's ``View.jax()`` stops gradients where the view, or one it was made from, was made
    under ``no_grad`` (transformers 4.x's RecurrentGemma slices its keys and values for its
    window cache under ``torch.no_grad()``: torch gives its key and value projections no gradient
    through them, and a slice is a lazy view, which went through). Process-wide, once."""
    import jax
    from torchax import view

    original = view.View.jax
    if getattr(original, "_spmdzero", False):
        return

    def jax_value(self):
        value = original(self)
        source = self
        while isinstance(source, view.View):
            if getattr(source, "_spmdzero_no_grad", False):
                return jax.lax.stop_gradient(value)
            source = source.parent
        return value

    jax_value._spmdzero = True
    view.View.jax = jax_value


_functions_running = [0]  # autograd Functions whose forward is running, in the trace


@contextlib.contextmanager
def _functions_counted(differentiated: bool):
    """``torch.autograd.Function.apply`` counted in ``_functions_running`` while the trace lasts;
    ``differentiated``: a custom VJP of the Function's backward (``autograd_functions``)."""
    apply = torch.autograd.Function.__dict__["apply"]

    def counted(cls, *args, **kwargs):
        _functions_running[0] += 1
        try:
            result = autograd_functions.mapped(cls, args, kwargs) if differentiated else NotImplemented
            if result is not NotImplemented:
                return result
            return apply.__func__(cls, *args, **kwargs)
        finally:
            _functions_running[0] -= 1

    torch.autograd.Function.apply = classmethod(counted)
    try:
        yield
    finally:
        torch.autograd.Function.apply = apply


# (model, class, method): transformers' methods that compute another function under a compiler
EAGER_PATHS = (("recurrent_gemma", "RecurrentGemmaRglru", "forward"),)


def _not_compiling(original):
    @functools.wraps(original)
    def method(*args, **kwargs):
        before = torch.compiler._is_compiling_flag
        torch.compiler._is_compiling_flag = False
        try:
            return original(*args, **kwargs)
        finally:
            torch.compiler._is_compiling_flag = before

    return method


@contextlib.contextmanager
def tracing(differentiated: bool = True):
    """``torch.compiler.is_compiling()`` answers True inside, and ``out=`` arguments are copied
    into. ``differentiated``: JAX takes the trace's gradient, so grad is enabled at its start
    (a program can be traced inside torch's backward, which disables it), and a ``no_grad``
    region inside stops gradients. Re-entrant."""
    before = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        with torch.set_grad_enabled(True) if differentiated else contextlib.nullcontext(), _functions_counted(differentiated), \
                NoGradStopsGradients() if differentiated else contextlib.nullcontext(), OutArgumentsCopied(), \
                transformers_methods.replaced([(*path, _not_compiling) for path in EAGER_PATHS]):
            yield
    finally:
        torch.compiler._is_compiling_flag = before
