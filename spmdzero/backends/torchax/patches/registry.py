"""Every model family's adaptation, entered through one context while a program is traced.

Why a registry: the forward program enters each family's patch (its methods swapped for
traceable ones, put back after). Each module of this folder that defines ``patched(trace)`` is
one family's, found here once, so adding a model family is one new file in ``patches/`` with a
``patched`` function: the engine does not change. ``trace`` says what a patch may need of the
program being traced (``TraceFacts``). The order does not matter: each family swaps its own
classes' methods."""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
from typing import Any, NamedTuple


class TraceFacts(NamedTuple):
    """What a family's patch may read of the program being traced."""

    batch_norms: list  # the batch norms whose running statistics the program updates (``batchnorm``)
    expert_matmuls: Any  # how the experts' grouped matmuls split their rows (``moe_rows.Split``)


@functools.cache
def families() -> tuple:
    """The ``patched`` functions of this folder's modules, by module name."""
    package = __name__.rpartition(".")[0]
    found = []
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package}.{info.name}")
        if callable(getattr(module, "patched", None)):
            found.append(module.patched)
    return tuple(found)


@contextlib.contextmanager
def entered(trace: TraceFacts):
    """Every family's patch, entered for the duration of a trace."""
    with contextlib.ExitStack() as stack:
        for patched in families():
            stack.enter_context(patched(trace))
        yield
