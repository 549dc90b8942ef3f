"""Other engines inside an engine's program.

A script may call one engine from inside another's forward, and read that engine's module's
parameters there. TRL's ``DistillationTrainer`` does both: its loss runs inside the student
engine's forward (TRL's "forward redirection": the engine is called with the model's ``forward``
swapped for the loss), calls the teacher engine from there, and projects through the teacher's
``lm_head`` weight itself. Outside its own programs a module's parameters are host tensors,
which a program cannot mix with its own values; and a device array a trace closes over becomes
a constant of the program, a copy of those weights inside it.

So an engine's programs take the other engines they met as inputs: their parameters and
buffers, as the devices hold them at each call, under ``KEY`` among the program's constants.
While an engine traces, those engines' modules hold the traced values, and a call to such an
engine runs its module right there, inline. An engine called inside a trace that does not take
it yet stops that trace (``Met``); the tracing engine adds it and traces again, once. What the
first attempt changed of the modules' ``forward`` attributes is put back first: a forward
redirection swaps a module's ``forward`` and the swap undoes itself when called. For the same
reason, a call that runs a program already compiled does to those attributes what the program's
trace did (``changed``), since the module's own ``forward`` does not run again."""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from spmdzero.backends.torchax.programs.forward import OTHER_ENGINES

KEY = OTHER_ENGINES  # the entry of a program's constants that holds them (programs/forward.py)

_state = threading.local()
_live: "weakref.WeakSet" = weakref.WeakSet()  # every torchax engine
_UNSET = object()


def register(engine) -> None:
    _live.add(engine)


def _forward_of(module: torch.nn.Module):
    """The ``forward`` set on ``module`` itself (an instance attribute), else ``_UNSET``."""
    return module.__dict__.get("forward", _UNSET)


def forward_attributes() -> list:
    """Each live engine's module and the ``forward`` set on it, if any."""
    return [(e.host.wrapped, _forward_of(e.host.wrapped)) for e in list(_live)]


def changed(before: list) -> list:
    """The modules whose ``forward`` attribute is not what ``before`` found, with what it is now."""
    return [(m, _forward_of(m)) for m, forward in before if _forward_of(m) is not forward]


def put_back(saved: list) -> None:
    """The modules' ``forward`` attributes as ``forward_attributes`` found them."""
    for module, forward in saved:
        if forward is _UNSET:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = forward


class Met(Exception):
    """``engine`` was called inside another engine's trace, which does not take it yet."""

    def __init__(self, engine):
        super().__init__(f"{type(engine.host.wrapped).__name__}'s engine was called inside another engine's program")
        self.engine = engine


def values(engines: list) -> dict:
    """What a program takes of ``engines``: each one's parameters and buffers by name."""
    return {i: {**e.state.params, **e.state.constants} for i, e in enumerate(engines)}


def tracing_engine():
    """The engine whose program is being traced on this thread, or None."""
    stack = getattr(_state, "stack", None)
    return stack[-1][0] if stack else None


def call_inside(engine, module: torch.nn.Module, inputs: tuple, kwargs: dict):
    """``engine`` called while another engine traces: its ``module`` (whose parameters hold the
    traced values) run inline, or ``Met`` when the trace does not take ``engine``."""
    _, taken = _state.stack[-1]
    if not any(e is engine for e in taken):
        raise Met(engine)
    return module(*inputs, **kwargs)


@contextlib.contextmanager
def tracing(engine, engines: list, traced: dict | None, env):
    """While ``engine`` traces: the modules of ``engines`` hold ``traced`` (``values``' layout,
    traced JAX values) as torchax tensors."""
    stack = _state.__dict__.setdefault("stack", [])
    stack.append((engine, list(engines)))
    try:
        with contextlib.ExitStack() as swaps:
            for i, other in enumerate(engines):
                tensors = env.j2t_iso(traced[i])
                swaps.enter_context(torch.nn.utils.stateless._reparametrize_module(
                    other.host.wrapped, tensors, tie_weights=True, strict=False))
            yield
    finally:
        stack.pop()
