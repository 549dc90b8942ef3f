"""transformers' methods swapped for traceable ones while a step is traced, and put back after.

Why: some transformers models read a value on the host where tensor ops would compute the same
thing (transformers 4.x's loops over the experts that got tokens, its skip of an all-ones
padding mask). Under ``jax.jit`` each read sends the whole forward down the eager path
(``host_reads``). ``moe_experts`` and ``recurrent_masks`` restate such methods with static
shapes; this module swaps them in, on the classes of the modules already imported (a model is
built before its engine, so its modules are), for the trace only, and puts transformers' own
back when it ends, by an exception too: eager code, and plain torch in the same process, run
transformers' lines.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Callable, Iterable

# (model, class, method, replacement): transformers.models.<model>.modeling_<model>.<class>.<method>
# becomes replacement(the original function); a model "<package>/<name>" is in
# transformers.models.<package>.modeling_<name> (data2vec/data2vec_audio)
Replacement = tuple[str, str, str, Callable[[Callable], Callable]]


def transformers_4() -> bool:
    """Whether the transformers this process imported is a 4.x release."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and str(getattr(transformers, "__version__", "")).startswith("4.")


@contextlib.contextmanager
def replaced(entries: Iterable[Replacement]):
    """Each entry's method replaced, where its module is imported and its class defines it."""
    saved = []
    for model, class_name, method, replacement in entries:
        package, _, name = model.partition("/")
        cls = getattr(sys.modules.get(f"transformers.models.{package}.modeling_{name or package}"), class_name, None)
        if cls is None or method not in cls.__dict__:
            continue
        original = cls.__dict__[method]
        saved.append((cls, method, original))
        setattr(cls, method, replacement(original))
    try:
        yield
    finally:
        for cls, method, original in reversed(saved):
            setattr(cls, method, original)


def loss_outside(original: Callable, applies: Callable, loss: Callable) -> Callable:
    """``original``, a forward that takes ``labels=``, as one that, where ``applies(model, labels)``,
    runs without its labels and puts ``loss(model, logits, labels, bound)`` (``bound``: the call's
    ``inspect.BoundArguments``) first in its outputs, where transformers puts its own loss: as the
    output's ``loss``, or first in a ``return_dict=False`` tuple."""
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None or not applies(self, labels):
            return original(self, *args, **kwargs)
        bound.arguments["labels"] = None
        outputs = original(*bound.args, **bound.kwargs)
        if isinstance(outputs, tuple):
            return (loss(self, outputs[0], labels, bound),) + outputs
        return type(outputs)(loss=loss(self, outputs.logits, labels, bound), **dict(outputs.items()))

    return forward
