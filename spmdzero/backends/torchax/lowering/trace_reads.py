"""What a trace cannot answer and an eager run can: JAX's errors for a traced program's read of
a value on the host (``if t:``, ``t.item()``, ``x[mask]``), and the reads of a tracer that
carries its concrete value (eager ``jax.grad``/``jax.vjp``). Why below the engine: the engine
runs such a program eagerly instead (``engine/host_reads.py``), and activation checkpointing
(``remat.py``) answers the same errors inside its region."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable


def host_read_errors() -> tuple:
    """JAX's errors for a value or shape that a trace does not know: what the eager run answers."""
    import jax

    errors = jax.errors
    return (errors.ConcretizationTypeError,  # bool(t), t.item(), int(t), nonzero (and TracerBoolConversionError)
            errors.NonConcreteBooleanIndexError,  # x[mask]
            errors.TracerArrayConversionError,  # np.asarray(t), t.numpy(), t.cpu()
            errors.TracerIntegerConversionError,  # operator.index(t): a tensor as a size or an index
            TypeError)  # only as ``reads_a_value`` says: a tensor as one of a factory's sizes


# JAX's TypeError for a shape that holds a traced value (``jax._src.core._invalid_shape_error``):
# ``torch.full((n, t[-1] + 1), ...)``, which Jamba's causal mask in transformers 4.x makes, where an
# eager run has the value
_TRACED_SHAPE = ("Shapes must be 1D sequences of concrete values of integer type", "If using `jit`")


def reads_a_value(err: Exception) -> bool:
    """Whether ``err`` (one of ``host_read_errors``) is a trace's read of a value it does not have."""
    if type(err) is TypeError:
        return all(part in str(err) for part in _TRACED_SHAPE)
    return True


def concrete(tree) -> bool:
    """Whether every array in ``tree`` has its value: a plain array, or the tracer of an eager
    ``jax.vjp`` that carries one (an eager run), not a ``jax.jit`` trace's."""
    import jax

    return all(not isinstance(leaf, jax.core.Tracer) or leaf.to_concrete_value() is not None
               for leaf in jax.tree_util.tree_leaves(tree))


@contextlib.contextmanager
def concrete_reads():
    """``.tolist()``, ``__array__`` and ``.tobytes()`` of a tracer that carries a concrete value
    (eager ``jax.grad``/``jax.vjp``) give that value, as its ``bool``/``int`` do; an abstract
    tracer still raises. Process-wide for the duration (the backend runs a step on one thread)."""
    import jax

    tracer = jax.core.Tracer
    originals = {name: getattr(tracer, name) for name in ("tolist", "__array__", "tobytes")}

    def concrete(name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            value = self.to_concrete_value()
            if value is None:
                return original(self, *args, **kwargs)
            return getattr(value, name)(*args, **kwargs)

        return method

    for name, original in originals.items():
        setattr(tracer, name, concrete(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(tracer, name, original)
