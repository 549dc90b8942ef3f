"""A torchax engine's ``backward(loss)``: the gradient a training forward took is committed to
the accumulation (or taken again when the accumulation changed since), and a loss computed
outside the module reaches the compiled backward program through torch autograd. Gradients are
scaled as DeepSpeed scales them and laid out by the plan (ZeRO-2's shards). ``Gradients`` is the
engine's part that does it (``engine.gradients``)."""

from __future__ import annotations

import warnings
import weakref
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from spmdzero.backends.torchax.lowering import autograd_factories
from spmdzero.backends.torchax.outputs import process_rows
from spmdzero.backends.torchax.engine.forward import SPECULATED
from spmdzero.backends.torchax.engine.release import release_in_background
from spmdzero.backends.torchax.lowering.values import as_jax, is_torchax_tensor
from spmdzero.train.engine_base import check_loss_given, check_scalable
from spmdzero.backends.torchax.programs.backward import build_backward
from spmdzero.backends.torchax.programs.gradients import build_subtract


NOT_FROM_ENGINE = ("engine.backward(loss) was given a loss that depends on no output of this engine's forward "
                   "with grad enabled: compute it from what engine(...) returned in training (not under "
                   "torch.no_grad(), not from a .detach()ed or .cpu() copy)")
BACKWARD_TWICE = ("engine.backward(loss) was given a loss whose gradients an earlier backward already committed: "
                  "call it once per forward's loss, or pass retain_graph=True to the first call (as torch, which "
                  "refuses to backward through a graph a second time)")
PARAMETERS_CHANGED = ("engine.backward(loss) was given the loss of a forward whose gradients must be taken again "
                      "(the gradients accumulated since that forward changed: another backward, or a zero_grad that "
                      "dropped them), but the parameters changed since that forward (an optimizer step, a "
                      "checkpoint load, an edit on the host): the torchax backend takes the gradient inside the "
                      "traced forward and keeps no graph at the old values. Call backward on each loss before the "
                      "optimizer step")
UNCONFIRMED = ("spmdzero: a training forward's loss was not passed to engine.backward: its gradient, added to the accumulated "
               "ones when the forward ran (so that no second copy of the gradients waits for the backward), was "
               "taken out again at the cost of one more run of its training program. Evaluate under "
               "torch.no_grad() or engine.eval()")


# The engine sees the host's edits of the module's parameters at the next forward (as new
# in-place versions), and the host's values are a step behind until read. So the parameters get
# a subclass of their class (``_watched_class``) whose torch ops first bring the trained values
# to the host (``HostCopy.use``): an edit in place or a read then sees them, as in
# torch. ``p.data`` is a tensor with a version counter of its own: its use is noted, and the
# next forward compares that parameter with the devices' copy.
_COMMITTED = object()  # ``loss._spmdzero_forward`` after backward committed that forward's gradient


class Gradients:
    """The gradients between forwards and the optimizer step: a part of ``TorchaxEngine``
    (``engine.gradients``). It runs a training forward's program (``take``), commits each loss's
    gradient at its backward (``backward``), takes back what no backward confirmed (``settle``)
    and drops the accumulation as ``zero_grad`` asks. The accumulated gradients themselves are
    ``engine.state.accum``; what this part owns is the bookkeeping around them: which forwards'
    gradients are in the sum unconfirmed, a token that changes with the sum, the divisor the
    losses are scaled by, and whether the window's last backward was at the boundary."""

    def __init__(self, engine, divisor: float):
        self._engine = weakref.proxy(engine)  # the engine holds this part; the part does not keep it alive
        self._token = 0  # changes with the accumulation (``set``)
        self._unconfirmed: list = []  # forwards whose gradient the accumulation holds before their backward
        self._subtract_program = None  # built at the first such forward taken out again
        self.window_reduced = False  # the last backward was at a boundary (zero_grad_keeps_gradients)
        self._overwrite_at_backward = False  # zero_grad_overwrites_next_backward
        self.divisor = divisor  # what the training program divides the loss by
        self._outside: Optional[SimpleNamespace] = None  # during ``_backward_outside``
        self._backward_program = None  # built at the first loss computed outside the module

    # ---- a training forward's gradient ---------------------------------------------------
    def take(self, forward: SimpleNamespace):
        """Run the training program for ``forward`` (a training forward's inputs, as it saw
        them). Returns (outputs, changed buffers, the program), or None when the module's output
        holds no loss.

        With no gradients accumulated yet, its gradient is kept in ``forward.pending`` until
        backward commits it. Later in the window, the accumulated gradients are donated to the
        program and its sum replaces them at once (``forward.pending`` is ``SPECULATED``): the
        gradient is counted before its backward, and taken out again if none comes
        (``settle``). Kept beside the sum until the backward, it was a second copy of the
        gradients on every device between a forward and its backward (issue 42)."""
        engine = self._engine
        accumulate = engine.state.accum is not None
        program = engine.forwards.program("accumulate" if accumulate else "train", forward.treespec, forward.static,
                                          forward.training, method=forward.method)
        ran = None if program.no_loss else program(engine.state.params, forward.constants, engine.state.accum,
                                                    forward.rng, forward.arrays, engine.state.scale(),
                                                    np.float32(self.divisor))
        if ran is None:
            return None
        engine.runs["forward"] += 1
        outputs, constants, gradients = ran
        if accumulate:
            self._replace(gradients)
            self._unconfirmed.append(forward)
            forward.pending = SPECULATED
        else:
            forward.pending = gradients
        forward.accum_token, forward.divisor = self._token, self.divisor
        return outputs, constants, program

    # ---- backward ------------------------------------------------------------------------
    def backward(self, loss, retain_graph: bool, scale_wrt_gas: bool) -> int:
        """Commit the gradients of ``loss``, as torch's backward of it would, scaled by
        1/gradient_accumulation_steps (and fp16's loss scale) as DeepSpeed does. The loss the
        module returned: the gradient its training forward already took is committed; it is taken
        again, by the same program on the same inputs and dropout draw, when the accumulation it
        was added to has changed since (a backward of another forward's loss, a ``zero_grad`` that
        dropped it) or when the forward ran in eval mode. Any other loss (computed outside the
        module from the outputs, or the module's loss written in place since): torch autograd
        takes it back to the outputs, and the compiled backward takes it on (``outside_loss``).
        Returns the training rows it committed."""
        engine = self._engine
        check_loss_given(loss)
        forward = getattr(loss, "_spmdzero_forward", None)
        if forward is _COMMITTED:
            raise RuntimeError(BACKWARD_TWICE)
        if forward is not None and getattr(forward, "loss_version", loss._version) != loss._version:
            # written in place since the forward (``loss *= k``, ``loss /= gas``; the HF Trainer
            # scales by the process count so): no longer the module's loss. torch autograd takes
            # it back through the write, as a loss computed outside the module
            forward = None
        gas = engine.gradient_accumulation_steps()
        if self._overwrite_at_backward:  # DeepSpeed's stage-3 optimizer.zero_grad() came since the last one
            self.drop()  # this forward's gradient, if already added, is taken again
        if forward is None:
            if loss.grad_fn is None:
                raise RuntimeError(NOT_FROM_ENGINE)
            rows = self._backward_outside(loss, retain_graph, gas if scale_wrt_gas else 1)
        else:
            # the next forwards scale the loss as this backward asks (the HF Trainer passes
            # scale_wrt_gas=False at every step); this one is taken again if it scaled otherwise
            self.divisor = float(gas if scale_wrt_gas else 1)
            self._commit_traced(forward)
            if not retain_graph:
                loss._spmdzero_forward = _COMMITTED
            rows = forward.rows or 0
        self.window_reduced = engine.is_gradient_accumulation_boundary()
        return rows

    def scale(self, loss):
        """DeepSpeed's ``engine.scale(loss)``, for a backward the script runs itself
        (``engine.scale(loss).backward()``, then ``engine.step()``): ``loss`` times fp16's loss
        scale, which the update divides out; ``loss`` itself in bf16 and fp32. That backward
        divides the outputs' gradients by the accumulation steps (``through``), as DeepSpeed's does."""
        engine = self._engine
        check_scalable(engine, loss)
        if engine.state.loss_scale is None:
            return loss
        return loss * engine.output_tensor(engine.state.loss_scale.scale, engine.env)

    def _commit_traced(self, forward: SimpleNamespace) -> None:
        """Commit the gradient a training forward took of the module's loss (taking it again when
        the accumulation changed since, see ``backward``). A gradient the forward already added
        to the accumulation (``SPECULATED``) is confirmed, or taken out and again when the
        backward scales the loss otherwise."""
        engine = self._engine
        if forward.pending is SPECULATED:
            if any(f is forward for f in self._unconfirmed):
                if forward.divisor == self.divisor:
                    self._confirm(forward)
                    return
                self._retract(forward)
            forward.pending = None  # dropped with the accumulation it was added to (zero_grad): taken again
        if (forward.pending is None or forward.accum_token != self._token
                or forward.divisor != self.divisor):
            if forward.params_version != engine.params_version:
                raise RuntimeError(PARAMETERS_CHANGED)
            if not forward.training and forward.rows is not None:
                engine.check_training_rows(forward.rows)  # an eval-mode forward trains only now
            if self.take(forward) is None:  # its buffer changes were taken by the forward itself
                raise RuntimeError("engine.backward(loss): the module returned this loss in eval mode, but no loss "
                                   "when traced to take its gradient")
            if forward.pending is SPECULATED:  # added to the accumulation now, by its backward
                self._confirm(forward)
                return
        self._take(forward.pending)
        forward.pending = None

    def settle(self) -> None:
        """Take out of the accumulation the gradients of training forwards whose loss no backward
        took (``take`` added them when they ran), before anything uses the accumulation as
        committed (the update, a gradient read) or the parameters change: DeepSpeed commits a
        gradient at the backward only. Each costs one more run of its training program; the sum
        then differs from one that never held it by rounding only (one subtraction)."""
        for forward in self._unconfirmed[:]:
            warnings.warn(UNCONFIRMED, stacklevel=3)
            self._retract(forward)

    def _confirm(self, forward: SimpleNamespace) -> None:
        """``forward``'s gradient, already in the accumulation, is committed by its backward."""
        self._unconfirmed = [f for f in self._unconfirmed if f is not forward]
        forward.pending = None

    def _retract(self, forward: SimpleNamespace) -> None:
        """Subtract ``forward``'s gradient (taken again by its training program, on its inputs,
        dropout draw and loss divisor, at the parameters it saw) from the accumulation."""
        engine = self._engine
        self._confirm(forward)  # no longer in it
        program = engine.forwards.program("train", forward.treespec, forward.static, forward.training,
                                          method=forward.method)
        _, _, gradients = program(engine.state.params, forward.constants, None, forward.rng, forward.arrays,
                                  engine.state.scale(), np.float32(forward.divisor))
        engine.runs["retract"] += 1
        if self._subtract_program is None:
            self._subtract_program = build_subtract(engine.setup)
        self._replace(self._subtract_program(engine.state.accum, gradients))

    def _take(self, accum: dict) -> None:
        # the sum this one replaces is released now (off this thread): kept a micro-step longer it
        # was a second gradient held between micro-steps (ZeRO's accounting holds one)
        release_in_background(self._engine.state.accum)
        self.set(accum)

    def _replace(self, accum: dict) -> None:
        """The accumulation after a program that was donated the old one (or, run eagerly, read
        it): the forwards whose gradients are in it stay unconfirmed."""
        unconfirmed = self._unconfirmed
        self._take(accum)
        self._unconfirmed = unconfirmed

    def _backward_outside(self, loss: torch.Tensor, retain_graph: bool, divide: int) -> int:
        """torch autograd from ``loss`` (scaled as DeepSpeed scales it: fp32, times fp16's loss
        scale, over ``divide``) back to the engine's outputs, whose nodes run the compiled backward
        (``through``). Returns the training rows of the forwards it reached."""
        engine = self._engine
        scaled = loss.float()
        if engine.state.loss_scale is not None:
            scaled = scaled * engine.output_tensor(engine.state.loss_scale.scale, engine.env)
        if divide > 1:
            scaled = scaled / divide
        outside = self._outside = SimpleNamespace(retain=retain_graph, rows=0, forwards=0)
        try:
            with autograd_factories.made_in_jax(lambda host: engine.output_tensor(engine.env.t2j_copy(host),
                                                                                  engine.env)):
                torch.autograd.backward(scaled, retain_graph=retain_graph)
        finally:
            self._outside = None
        if not outside.forwards:
            raise RuntimeError(NOT_FROM_ENGINE)
        return outside.rows

    def through(self, record: SimpleNamespace, cotangents: tuple) -> list:
        """The compiled backward of one forward (``outside_loss.TiedOutputs.backward``): its
        gradients, from the cotangents of its outputs, added to the accumulated ones; returns the
        gradients of its inputs that require grad (host tensors for host inputs)."""
        engine = self._engine
        if record.released:
            raise RuntimeError(BACKWARD_TWICE)
        vjp = record.vjp
        if record.params_version != engine.params_version:  # its VJP holds the parameters it saw (residuals)
            raise RuntimeError(PARAMETERS_CHANGED)
        if vjp is None:  # the forward took the module's loss's gradient only: its VJP, on the same inputs
            if not record.training and record.rows is not None:
                engine.check_training_rows(record.rows)  # an eval-mode forward trains only now
            program = engine.forwards.program("vjp", record.treespec, record.static, record.training, record.which,
                                              record.method)
            _, _, vjp = program(engine.state.params, record.constants, record.rng, record.arrays)
        outside = self._outside
        # a backward the script ran itself (``loss.backward()``, DeepSpeed 0.19's PyTorch-style
        # backward): DeepSpeed divides the outputs' gradients by the accumulation steps there
        # (its output hooks, ``_backward_prologue_per_tensor``), as engine.backward divides the loss
        divisor = np.float32(1 if outside is not None else engine.gradient_accumulation_steps())
        cts = tuple(None if cotangents[i] is None else as_jax(cotangents[i], engine.env) for i in record.floats)
        if engine.processes > 1:  # this process's cotangents, onto the global mesh
            cts = tuple(None if c is None else process_rows.global_cotangent(c, view, whole, shape, kind, engine.mesh)
                        for c, (view, whole), (shape, _, kind) in zip(cts, record.shardings, record.avals))
        if self._backward_program is None:
            self._backward_program = build_backward(engine.setup)
        engine.runs["backward"] += 1
        grads, input_grads = self._backward_program(vjp, cts, engine.state.accum, record.avals, divisor)
        self._replace(grads)  # it was donated
        if outside is not None:
            outside.rows += record.rows or 0
            outside.forwards += 1
        if outside is None or not outside.retain:
            record.vjp, record.released = None, True
        return [self._input_gradient(record, k, g) for k, g in enumerate(input_grads)]

    def _input_gradient(self, record: SimpleNamespace, k: int, grad):
        """The gradient of the ``k``-th input that required grad, as torch gives it: a torchax
        tensor for a torchax input, a host tensor (this process's rows) for a host input."""
        from torchax.ops import mappings

        engine = self._engine
        t = record.inputs[k]
        if is_torchax_tensor(t):
            return engine.output_tensor(grad, engine.env)
        array = record.arrays[record.which[k]]
        if engine.processes > 1 and record.dims[k] is not None:  # this process's rows of the global gradient
            import jax

            grad = jax.device_put(grad, array.sharding)
            dim, seen, parts = record.dims[k], set(), []
            for shard in sorted(grad.addressable_shards, key=lambda s: s.index[dim].start or 0):
                start = shard.index[dim].start or 0
                if start not in seen:
                    seen.add(start)
                    parts.append(np.asarray(shard.data))
            grad = np.concatenate(parts, axis=dim)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # it is copied
            return mappings.j2t(np.asarray(grad), use_dlpack=False).to(t.dtype)

    # ---- the accumulation as a whole -------------------------------------------------------
    def set(self, accum: Optional[dict]) -> None:
        """The gradients accumulated since the last optimizer step; a new token tells the
        forwards whose gradient was added to the old ones that it must be taken again (and so
        does dropping the forwards whose gradient was added before their backward)."""
        engine = self._engine
        engine.state = engine.state._replace(accum=accum)
        self._token += 1
        self._unconfirmed = []
        if accum is None:  # a step, a drop or a load: no gradients left for a backward to replace
            self._overwrite_at_backward = False

    def drop(self) -> None:
        """The accumulated gradients released (off this thread) and gone."""
        release_in_background(self._engine.state.accum)
        self.set(None)

    def new_window(self) -> None:
        """The accumulation starts over (an optimizer step took it, a load replaced the weights)."""
        self.set(None)
        self.window_reduced = False

    def zero_grad(self, by_optimizer: bool) -> None:
        """DeepSpeed's ``zero_grad`` (see ``TorchaxEngine.zero_grad``)."""
        engine = self._engine
        if engine.state.accum is None:
            return
        if engine.zero_grad_overwrites_next_backward(by_optimizer):
            self._overwrite_at_backward = True  # the next backward drops them (``backward``)
        elif not engine.zero_grad_keeps_gradients(by_optimizer, self.window_reduced):
            self.drop()
            self.window_reduced = False
