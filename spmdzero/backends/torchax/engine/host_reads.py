"""Forwards that read a tensor's value on the host train on the torchax backend: the programs of
such a module run eagerly, op by op, instead of as one ``jax.jit`` program.

A forward that reads a value (``if mask.any():``, ``t.item()``, ``int(t.max())``, ``t.tolist()``,
``t.cpu()``) or makes a shape from one (``x[mask]``, ``torch.nonzero``: DeBERTa-v2's
classification loss, ``(labels >= 0).nonzero()``) cannot be traced once: under ``jax.jit`` the
value does not exist yet, and JAX raises a ConcretizationTypeError. DeepSpeed trains such models
(torch runs eagerly), and so does the torch_xla backend (it cuts the graph at the read), so this
backend must not refuse them.

The mechanism: when a program's trace stops at a host read, the same program function runs
without ``jax.jit``, from then on. JAX's transformations run eagerly on concrete arrays:
``jax.grad`` and ``jax.vjp`` evaluate op by op, and their tracers carry concrete values, so
``bool``, ``int``, ``.item()``, boolean masks and ``nonzero`` see the value, as in torch, and the
gradient is the same function's, with the same dropout draws (the key is an input). Nothing else
changes: the program's inputs and outputs, its sharding constraints (eagerly a ``device_put``),
the accumulation, the update program (``engine.step()``, still jitted). Where the step is cut in
two is the whole forward and backward, not just the read: simpler than splitting at the read as
torch_xla does, and right for every read wherever it sits (a submodule, the loss, a library).

Its cost: every op is a dispatch from Python (tens of µs on the host) instead of a fused kernel,
and nothing is fused across ops. docs/config.md gives the figure measured on a small model; the
note printed once per engine says it too. A model that reads values only sometimes keeps its
compiled programs where their trace succeeds (evaluation, another input structure).

Programs whose trace failed are not traced again (``Program.eager``), and an eager run counts no
trace (``engine.traces``): the recompile guard sees a compiled step's retraces only.

Limits: with several hosts, reading a value that spans other hosts' devices fails: JAX cannot
fetch it, and ``Fallback.run_eagerly`` says so, naming the line (2 hosts of 4 CPU devices, a
Qwen2-VL reading its image grid). A module whose output holds no loss runs its forward once more in each of
its first two micro-steps (the training program's eager run finds no loss, then the VJP program
runs).

``f"{t}"`` of a one-value tensor and torch's tensor checks are ``traced_checks``': neither reads
a value a trace does not have. A trace that fails after formatting one, by whatever error (a key
made of the text), runs eagerly too.

``concrete_reads`` lets the reads JAX refuses on any tracer (``.tolist()``, ``np.asarray``, which
torchax's ``.numpy()`` and ``.cpu()`` use) see the concrete value an eager autodiff tracer
carries, as ``bool`` and ``int`` already do.
"""

from __future__ import annotations

import collections
import os
import pathlib
import warnings
from typing import Any, Callable

import torch

from spmdzero.backends.torchax.lowering import traced_checks
from spmdzero.backends.torchax.lowering.trace_reads import concrete_reads, host_read_errors, reads_a_value
from spmdzero.backends.torchax.lowering.values import INT64_TRUNCATED
from spmdzero.observe.console import ensure_handler, logger


def _traced(args) -> bool:
    """Whether any argument is a tracer: the program is called inside another trace
    (``trace_step``), where an eager run would meet the same abstract values."""
    import jax

    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(args))


class EagerVJP:
    """The VJP an eager run of the VJP program returned (the engine wraps it: ``Program.eager``). A jitted backward would trace it again
    at every step (each eager ``jax.vjp`` is a new function), so its backward runs eagerly too
    (``Fallback.backward``)."""

    def __init__(self, vjp: Callable):
        self.vjp = vjp

    def __call__(self, cotangents):
        return self.vjp(cotangents)


class Program:
    """A program function, run as ``jax.jit(fn)`` until its trace meets a host read, then run
    eagerly from then on (see the module docstring). Called as the jitted function would be;
    inside another trace (``trace_step`` composing it with the update) it is always the jitted
    one, so a host read there raises JAX's error, which says the step cannot be one program."""

    def __init__(self, fallback: "Fallback", fn: Callable, kind: str, **jit_kwargs):
        import jax

        self._fallback, self._fn, self._kind = fallback, fn, kind
        self.jitted = jax.jit(fn, **jit_kwargs)
        self.eager = False  # its trace met a host read: it runs eagerly

    def __call__(self, *args):
        if self.eager and not _traced(args):
            return self._eagerly(args)
        texts = traced_checks.formatted()
        try:
            return self._jitted(args)
        except host_read_errors() as err:
            if _traced(args) or not (reads_a_value(err) or traced_checks.formatted() != texts):
                raise
            self.eager = True
            self._fallback.note(self._kind, err)
        except Exception as err:  # after formatting a traced value: maybe the text's (a KeyError)
            if _traced(args) or traced_checks.formatted() == texts:
                raise
            self.eager = True
            read = RuntimeError(f"a failure after a traced value was formatted into text: {type(err).__name__}: {err}")
            self._fallback.note(self._kind, read.with_traceback(err.__traceback__))
        return self._eagerly(args)

    def _jitted(self, args):
        """The jitted program's run. The first run of each compiled program (a new shape) is
        waited for: its memory is new, and an allocation that fails while it runs (JAX
        dispatches asynchronously) is then raised by the engine's call that made it, before a
        backward or an update consumes its outputs and fails the parameters with it
        (``spmdzero.runtime.out_of_memory``: the Trainer's ``--auto_find_batch_size`` then tries
        a smaller batch from intact parameters). Later runs of that program are not waited for."""
        import jax

        cache_size = getattr(self.jitted, "_cache_size", None)  # JAX's jitted function counts its programs
        compiled = cache_size() if cache_size is not None else None
        result = self.jitted(*args)
        if cache_size is not None and cache_size() != compiled and not _traced(args):
            jax.block_until_ready(result)
        return result

    def _eagerly(self, args):
        return self._fallback.run_eagerly(self._fn, args)


_SPANS_HOSTS = "spans non-addressable"  # JAX's words for a read of an array other hosts hold parts of


class Fallback:
    """One engine's programs that may run eagerly, and the note said once when one first does."""

    def __init__(self, engine: Any, module_name: str):
        self._engine, self._module_name = engine, module_name
        self.noted = False

    def program(self, fn: Callable, kind: str, **jit_kwargs) -> Program:
        """``fn`` jitted, or eager once its trace reads a value; ``kind`` names it in the note."""
        return Program(self, fn, kind, **jit_kwargs)

    @staticmethod
    def eager_vjp(vjp: Callable) -> "EagerVJP":
        """The VJP an eager run returned, marked so that its backward runs eagerly too."""
        return EagerVJP(vjp)

    def backward(self, fn: Callable, **jit_kwargs) -> Callable:
        """The backward program ``(vjp, ...) -> ...``: jitted for a jitted forward's VJP, eager
        for an ``EagerVJP``."""
        import jax

        jitted = jax.jit(fn, **jit_kwargs)

        def call(vjp, *args):
            if isinstance(vjp, EagerVJP):
                return self.run_eagerly(fn, (vjp, *args))
            return jitted(vjp, *args)

        return call

    def run_eagerly(self, fn: Callable, args: tuple):
        """``fn(*args)`` without ``jax.jit``: op by op. It compiles no program, so it counts no
        trace (the program functions count themselves in ``engine.traces``). JAX's note that an
        int64 became int32 (torchax's integers), which a traced program gives once, would come
        at every step of an eager one (HelloDeepSpeed's ``torch.nonzero``): it is not said."""
        engine = self._engine
        counted = collections.Counter(engine.traces)
        try:
            with concrete_reads(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", INT64_TRUNCATED, UserWarning)
                return fn(*args)
        except RuntimeError as err:
            if _SPANS_HOSTS not in str(err):
                raise
            raise RuntimeError(
                f"spmdzero: {self._module_name}'s forward reads a tensor's value on the host{where(err)}, and with "
                "several hosts that value spans other hosts' devices, which this host cannot read. A forward that "
                "reads values trains on one host only for now on the default backend (vision-language models that "
                "take image_grid_thw among them, with several hosts). JAX said: "
                f"{str(err).strip().splitlines()[0]}") from err
        finally:
            engine.traces.clear()
            engine.traces.update(counted)

    def note(self, kind: str, err: Exception) -> None:
        """Say once per engine that its module's programs run eagerly, where it reads, and the cost."""
        if self.noted:
            return
        self.noted = True
        found = str(err).strip().splitlines()[0]
        ensure_handler()
        logger.warning(
            "spmdzero: %s's forward reads a tensor's value on the host%s, which a program compiled once cannot "
            "(JAX: %s). The torchax backend runs this model's %s program, and any other of its programs that reads, "
            "eagerly, op by op, from now on; engine.step() stays compiled. Cost: %s; and each shape not seen before "
            "(a new padded length, a new count of rows picked by value) compiles its ops again. To compile it, compute with "
            "tensor ops (torch.where, masks of fixed shape) instead of reading the value, or use "
            "spmd.backend='torch_xla', which cuts the step at the read (noted once)",
            self._module_name, where(err), found, PROGRAM_NAMES.get(kind, kind), COST)


def where(err: Exception) -> str:
    """`` at file.py:line (`code`)``: the last frame of the error outside JAX, torch, torchax and
    spmdzero (the model's line that reads), or nothing."""
    import traceback

    skip = _internal_directories()
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if not frame.filename.startswith(skip) and os.path.exists(frame.filename):
            code = f" (`{frame.line.strip()}`)" if frame.line else ""
            return f" at {os.path.basename(frame.filename)}:{frame.lineno}{code}"
    return ""


def _internal_directories() -> tuple:
    """The directories of JAX, jaxlib, torch, torchax and spmdzero."""
    import jax
    import jaxlib
    import torchax

    spmdzero_dir = str(pathlib.Path(__file__).resolve().parents[3])  # engine/ -> torchax/ -> backends/ -> spmdzero/
    return tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib, torch, torchax)) + (spmdzero_dir + os.sep,)


# the engine's program kinds (programs/forward.build_forward), as the note names them
PROGRAM_NAMES = {"train": "training", "accumulate": "accumulating training", "vjp": "forward-and-VJP",
                 "forward": "evaluation"}

# benchmarks/host_reads.py, 8 CPU devices, ZeRO-2 (docs/config.md#the-torchax-backend)
COST = ("a training step took 6x the compiled step's time on a small MLP and 10x on a 2-layer GPT-2 "
        "(benchmarks/host_reads.py, 8 CPU devices)")
