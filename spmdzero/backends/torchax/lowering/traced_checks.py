"""torch's runtime checks and formatting of a value the compiled step computes, inside its trace.

Why: transformers 5.x checks its inputs with ``torch_compilable_check``, which ends in
``torch._check_tensor_all_with(error, cond, message)``: ``cond._is_all_true().item()``, a read of
a value on the host. Every vision-language model checks so that its image tokens match its image
features (LLaVA, PaliGemma, Gemma 3, Qwen2-VL, ...), with a message formatted beforehand from a
one-value tensor (``f"tokens: {n_image_tokens}"``). Under ``jax.jit`` both are reads: the whole
forward and backward ran eagerly (``host_reads``), and there torchax had no lowering of
``aten::_is_all_true``, so training stopped at the first step.

torch.compile keeps such a check as an assertion inside its graph. JAX has none that does not
stop the step, so inside a trace:

* ``torch._check_tensor_all_with`` (``torch._check_tensor_all`` too) of a traced condition is not
  evaluated, as with ``TRANSFORMERS_DISABLE_TORCH_CHECK=1``; a note names the line and the
  message, once per line. Where the values exist (an eager run, plain torch), it checks as torch
  does (``aten::_is_all_true`` is lowered in ``lowerings``).
* transformers 4.x checks the same with ``if inputs_embeds[mask].numel() != features.numel():
  raise ValueError(...)`` in each model's ``get_placeholder_mask`` (34 classes in 4.57: LLaVA
  and its kin, PaliGemma, Gemma 3, Qwen2-VL, ...): a boolean index, whose shape is a value.
  While a step is traced (``placeholder_checks_left_out``), such a method whose arguments are
  traced runs as written less those ``if`` statements (its source, parsed, the statements
  dropped, compiled at its own lines), noted once per class; with values it runs as written.
* ``format(t, spec)`` of a one-value torchax tensor formats its number where the value exists, as
  torch's ``Tensor.__format__`` does (Switch Transformers picks an expert by
  ``self[f"expert_{idx}"]``). A traced value formats as ``<traced int32>``, so that a message
  does not read it; the trace counts it (``formatted``), and if the trace then fails, whatever
  the error (``self[f"expert_{idx}"]``: a KeyError), ``host_reads`` takes the failure as that
  read's and runs the forward eagerly, where the text holds the number.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import sys
import textwrap
import traceback

import torch

from spmdzero.observe.console import ensure_handler, logger

_NOTED: set = set()  # the lines whose check was left out, noted once each
_FORMATTED = [0]  # traced values formatted so far, in this process


def formatted() -> int:
    """How many traced values have been formatted as ``<traced ...>`` so far: a trace that fails
    after one did may have failed on the text (``host_reads.Program``)."""
    return _FORMATTED[0]


def abstract(t) -> bool:
    """Whether ``t`` is a torchax tensor or view whose value a trace does not have (``jax.jit``'s
    tracer, not the concrete tracer of an eager ``jax.vjp``)."""
    import jax
    from torchax import tensor as ttensor
    from torchax import view as tview

    if not isinstance(t, (ttensor.Tensor, tview.View)):
        return False
    value = t.jax()
    return isinstance(value, jax.core.Tracer) and value.to_concrete_value() is None


def _format(self, spec: str) -> str:
    if self.dim() != 0:
        return object.__format__(self, spec)
    if abstract(self):
        _FORMATTED[0] += 1
        return f"<traced {self.jax().dtype}>".__format__(spec)
    return self.item().__format__(spec)


def _caller() -> str:
    """``file.py:line``: the innermost frame outside torch and transformers' utilities (the model's
    line that checks)."""
    skip = (os.path.dirname(torch.__file__) + os.sep, os.sep + os.path.join("transformers", "utils") + os.sep,
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)  # the torchax backend
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(part in frame.filename for part in skip):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"


def _message(message) -> str:
    try:
        return str(message()) if callable(message) else ""
    except Exception:  # a message that reads a value itself: the line is enough
        return ""


def _left_out(message) -> None:
    line = _caller()
    if line in _NOTED:
        return
    _NOTED.add(line)
    text = _message(message)
    ensure_handler()
    logger.warning("spmdzero: the check at %s (torch._check_tensor_all_with%s) tests a value the compiled step "
                   "computes; reading it would stop the step on the host, so the step does not evaluate it, as with "
                   "TRANSFORMERS_DISABLE_TORCH_CHECK=1. Plain torch runs it (noted once)", line,
                   f': "{text}"' if text else "")


def install() -> None:
    """Process-wide, idempotent: torch's tensor checks and torchax's one-value formatting as above."""
    from torchax import tensor as ttensor
    from torchax import view as tview

    for cls in (ttensor.Tensor, tview.View):
        cls.__format__ = _format
    original = torch._check_tensor_all_with
    if getattr(original, "_spmdzero", False):
        return

    def _check_tensor_all_with(error_type, cond, message=None):
        if abstract(cond):
            return _left_out(message)
        return original(error_type, cond, message)

    _check_tensor_all_with._spmdzero = True
    torch._check_tensor_all_with = _check_tensor_all_with


def _reads_a_count(node) -> bool:
    """``if ... x[mask].numel() != y.numel() ...: [...] raise ...``: transformers 4.x's placeholder
    check (Janus and DeepSeek-VL count the features in the ``if`` before raising)."""
    if not (isinstance(node, ast.If) and isinstance(node.body[-1], ast.Raise) and not node.orelse):
        return False
    return any(isinstance(n, ast.Compare) and any(isinstance(op, ast.NotEq) for op in n.ops)
               and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "numel"
                       and isinstance(c.func.value, ast.Subscript) for c in ast.walk(n))
               for n in ast.walk(node.test))


def _without_checks(function):
    """``function`` compiled from its source less the ``_reads_a_count`` statements, at its own
    file and lines; None where there are none, or its source cannot be had, or it closes over
    names (``super()``'s class) that a recompiled copy would lack."""
    if function.__code__.co_freevars:
        return None
    try:
        lines, first = inspect.getsourcelines(function)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):  # no source, or not this function's (the file changed)
        return None
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef) or definition.name != function.__name__ or definition.decorator_list:
        return None
    dropped = False
    for node in ast.walk(definition):
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            if isinstance(statements, list) and any(_reads_a_count(n) for n in statements):
                kept = [n for n in statements if not _reads_a_count(n)]
                setattr(node, field, kept or [ast.Pass()])
                dropped = True
    if not dropped:
        return None
    ast.increment_lineno(tree, first - 1)
    namespace: dict = {}
    exec(compile(tree, function.__code__.co_filename, "exec"), function.__globals__, namespace)
    return namespace[definition.name]


_REWRITTEN: dict = {}  # transformers' function: its rewrite (None: nothing to drop)


def _placeholder_method(cls, original):
    rewritten = _REWRITTEN.setdefault(original, _without_checks(original))
    if rewritten is None:
        return None

    def get_placeholder_mask(self, *args, **kwargs):
        if not any(abstract(a) for a in (*args, *kwargs.values())):
            return original(self, *args, **kwargs)
        key = f"{cls.__name__}.get_placeholder_mask"
        if key not in _NOTED:
            _NOTED.add(key)
            ensure_handler()
            logger.warning("spmdzero: %s checks that the image tokens match the image features by the shape of a "
                           "boolean index (inputs_embeds[mask].numel()), a value the compiled step computes; the "
                           "step leaves that check out, as transformers 5.x does under a trace. Plain torch runs it "
                           "(noted once)", key)
        return rewritten(self, *args, **kwargs)

    return get_placeholder_mask


@contextlib.contextmanager
def placeholder_checks_left_out():
    """While a step is traced: every imported model class's ``get_placeholder_mask`` whose check
    reads a count runs without it on traced arguments (transformers 4.x's; one of 5.24's)."""
    saved = []
    for name, module in list(sys.modules.items()):
        if not (name.startswith("transformers.models.") and ".modeling_" in name) or module is None:
            continue
        for cls in list(vars(module).values()):
            original = isinstance(cls, type) and cls.__dict__.get("get_placeholder_mask")
            if not inspect.isfunction(original) or cls.__module__ != name:
                continue
            replacement = _placeholder_method(cls, original)
            if replacement is not None:
                saved.append((cls, original))
                cls.get_placeholder_mask = replacement
    try:
        yield
    finally:
        for cls, original in saved:
            cls.get_placeholder_mask = original
