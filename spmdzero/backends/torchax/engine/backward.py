"""A torchax engine's ``backward(loss)``: the gradient a training forward took is committed to
the accumulation (or taken again when the accumulation changed since), and a loss computed
outside the module reaches the compiled backward program through torch autograd. Gradients are
scaled as DeepSpeed scales them and laid out by the plan (ZeRO-2's shards). A mixin of
``TorchaxEngine``."""

from __future__ import annotations

import warnings
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
from spmdzero.runtime.out_of_memory import raises_torch_out_of_memory
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
# to the host (``TorchaxEngine._host_use``): an edit in place or a read then sees them, as in
# torch. ``p.data`` is a tensor with a version counter of its own: its use is noted, and the
# next forward compares that parameter with the devices' copy.
_COMMITTED = object()  # ``loss._spmdzero_forward`` after backward committed that forward's gradient


class BackwardPrograms:
    """The backward part of ``TorchaxEngine`` (see the module docstring)."""

    @raises_torch_out_of_memory
    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Commit the gradients of ``loss``, as torch's backward of it would, scaled by
        1/gradient_accumulation_steps (and fp16's loss scale) as DeepSpeed does. The loss the
        module returned: the gradient its training forward already took is committed; it is taken
        again, by the same program on the same inputs and dropout draw, when the accumulation it
        was added to has changed since (a backward of another forward's loss, a ``zero_grad`` that
        dropped it) or when the forward ran in eval mode. Any other loss (computed outside the
        module from the outputs, or the module's loss written in place since): torch autograd
        takes it back to the outputs, and the compiled backward takes it on (``outside_loss``).
        Returns the loss scaled by 1/gradient_accumulation_steps, as DeepSpeed does."""
        check_loss_given(loss)
        forward = getattr(loss, "_spmdzero_forward", None)
        if forward is _COMMITTED:
            raise RuntimeError(BACKWARD_TWICE)
        if forward is not None and getattr(forward, "loss_version", loss._version) != loss._version:
            # written in place since the forward (``loss *= k``, ``loss /= gas``; the HF Trainer
            # scales by the process count so): no longer the module's loss. torch autograd takes
            # it back through the write, as a loss computed outside the module
            forward = None
        gas = self.gradient_accumulation_steps()
        if self._overwrite_at_backward:  # DeepSpeed's stage-3 optimizer.zero_grad() came since the last one
            release_in_background(self.state.accum)
            self._set_accum(None)  # this forward's gradient, if already added, is taken again
        if forward is None:
            if loss.grad_fn is None:
                raise RuntimeError(NOT_FROM_ENGINE)
            rows = self._backward_outside(loss, retain_graph, gas if scale_wrt_gas else 1)
        else:
            # the next forwards scale the loss as this backward asks (the HF Trainer passes
            # scale_wrt_gas=False at every step); this one is taken again if it scaled otherwise
            self._loss_divisor = float(gas if scale_wrt_gas else 1)
            self._commit_traced(forward)
            if not retain_graph:
                loss._spmdzero_forward = _COMMITTED
            rows = forward.rows or 0
        self._last_loss = loss
        self._rows_since_step += rows
        self._window_reduced = self.is_gradient_accumulation_boundary()
        term = as_jax(loss, self._env).astype("float32") / gas  # a JAX op: no device read
        self._window_loss = term if self._window_loss is None else self._window_loss + term
        return loss / gas if gas > 1 else loss

    def scale(self, loss):
        """DeepSpeed's ``engine.scale(loss)``, for a backward the script runs itself
        (``engine.scale(loss).backward()``, then ``engine.step()``): ``loss`` times fp16's loss
        scale, which the update divides out; ``loss`` itself in bf16 and fp32. The backward
        divides the outputs' gradients by the accumulation steps, as DeepSpeed's does."""
        check_scalable(self, loss)
        if self.state.loss_scale is None:
            return loss
        return loss * self._Output(self.state.loss_scale.scale, self._env)

    def _commit_traced(self, forward: SimpleNamespace) -> None:
        """Commit the gradient a training forward took of the module's loss (taking it again when
        the accumulation changed since, see ``backward``). A gradient the forward already added
        to the accumulation (``SPECULATED``) is confirmed, or taken out and again when the
        backward scales the loss otherwise."""
        if forward.pending is SPECULATED:
            if any(f is forward for f in self._unconfirmed):
                if forward.divisor == self._loss_divisor:
                    self._confirm(forward)
                    return
                self._retract(forward)
            forward.pending = None  # dropped with the accumulation it was added to (zero_grad): taken again
        if (forward.pending is None or forward.accum_token != self._accum_token
                or forward.divisor != self._loss_divisor):
            if forward.generation != self._generation:
                raise RuntimeError(PARAMETERS_CHANGED)
            if not forward.training and forward.rows is not None:
                self._check_training_rows(forward.rows)  # an eval-mode forward trains only now
            if self._gradient(forward) is None:  # its buffer changes were taken by the forward itself
                raise RuntimeError("engine.backward(loss): the module returned this loss in eval mode, but no loss "
                                   "when traced to take its gradient")
            if forward.pending is SPECULATED:  # added to the accumulation now, by its backward
                self._confirm(forward)
                return
        self._take_accum(forward.pending)
        forward.pending = None

    def _settle(self) -> None:
        """Take out of the accumulation the gradients of training forwards whose loss no backward
        took (``_gradient`` added them when they ran), before anything uses the accumulation as
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
        self._confirm(forward)  # no longer in it
        program = self._program("train", forward.treespec, forward.static, forward.training, method=forward.method)
        _, _, gradients = program(self.state.params, forward.constants, None, forward.rng, forward.arrays,
                                  self._loss_scale_value(), np.float32(forward.divisor))
        self.runs["retract"] += 1
        if self._subtract_program is None:
            self._subtract_program = build_subtract(self._setup)
        self._replace_accum(self._subtract_program(self.state.accum, gradients))

    def _take_accum(self, accum: dict) -> None:
        # the sum this one replaces is released now (off this thread): kept a micro-step longer it
        # was a second gradient held between micro-steps (ZeRO's accounting holds one)
        release_in_background(self.state.accum)
        self._set_accum(accum)

    def _replace_accum(self, accum: dict) -> None:
        """The accumulation after a program that was donated the old one (or, run eagerly, read
        it): the forwards whose gradients are in it stay unconfirmed."""
        unconfirmed = self._unconfirmed
        self._take_accum(accum)
        self._unconfirmed = unconfirmed

    def _backward_outside(self, loss: torch.Tensor, retain_graph: bool, divide: int) -> int:
        """torch autograd from ``loss`` (scaled as DeepSpeed scales it: fp32, times fp16's loss
        scale, over ``divide``) back to the engine's outputs, whose nodes run the compiled backward
        (``_backward_through``). Returns the training rows of the forwards it reached."""
        scaled = loss.float()
        if self.state.loss_scale is not None:
            scaled = scaled * self._Output(self.state.loss_scale.scale, self._env)
        if divide > 1:
            scaled = scaled / divide
        state = self._backward_state = SimpleNamespace(retain=retain_graph, rows=0, forwards=0)
        try:
            with autograd_factories.made_in_jax(lambda host: self._Output(self._env.t2j_copy(host), self._env)):
                torch.autograd.backward(scaled, retain_graph=retain_graph)
        finally:
            self._backward_state = None
        if not state.forwards:
            raise RuntimeError(NOT_FROM_ENGINE)
        return state.rows

    def _backward_through(self, record: SimpleNamespace, cotangents: tuple) -> list:
        """The compiled backward of one forward (``outside_loss.TiedOutputs.backward``): its
        gradients, from the cotangents of its outputs, added to the accumulated ones; returns the
        gradients of its inputs that require grad (host tensors for host inputs)."""
        if record.released:
            raise RuntimeError(BACKWARD_TWICE)
        vjp = record.vjp
        if record.generation != self._generation:  # its VJP holds the parameters it saw (forward.py, residuals)
            raise RuntimeError(PARAMETERS_CHANGED)
        if vjp is None:  # the forward took the module's loss's gradient only: its VJP, on the same inputs
            if not record.training and record.rows is not None:
                self._check_training_rows(record.rows)  # an eval-mode forward trains only now
            program = self._program("vjp", record.treespec, record.static, record.training, record.which,
                                    record.method)
            _, _, vjp = program(self.state.params, record.constants, record.rng, record.arrays)
        state = self._backward_state
        # a backward the script ran itself (``loss.backward()``, DeepSpeed 0.19's PyTorch-style
        # backward): DeepSpeed divides the outputs' gradients by the accumulation steps there
        # (its output hooks, ``_backward_prologue_per_tensor``), as engine.backward divides the loss
        divisor = np.float32(1 if state is not None else self.gradient_accumulation_steps())
        cts = tuple(None if cotangents[i] is None else as_jax(cotangents[i], self._env) for i in record.floats)
        if self._processes > 1:  # this process's cotangents, onto the global mesh
            cts = tuple(None if c is None else process_rows.global_cotangent(c, view, whole, shape, kind, self.mesh)
                        for c, (view, whole), (shape, _, kind) in zip(cts, record.shardings, record.avals))
        if self._backward_program is None:
            self._backward_program = build_backward(self._setup)
        self.runs["backward"] += 1
        grads, input_grads = self._backward_program(vjp, cts, self.state.accum, record.avals, divisor)
        self._replace_accum(grads)  # it was donated
        if state is not None:
            state.rows += record.rows or 0
            state.forwards += 1
        if state is None or not state.retain:
            record.vjp, record.released = None, True
        return [self._input_gradient(record, k, g) for k, g in enumerate(input_grads)]

    def _input_gradient(self, record: SimpleNamespace, k: int, grad):
        """The gradient of the ``k``-th input that required grad, as torch gives it: a torchax
        tensor for a torchax input, a host tensor (this process's rows) for a host input."""
        from torchax.ops import mappings

        t = record.inputs[k]
        if is_torchax_tensor(t):
            return self._Output(grad, self._env)
        array = record.arrays[record.which[k]]
        if self._processes > 1 and record.dims[k] is not None:  # this process's rows of the global gradient
            grad = self._jax.device_put(grad, array.sharding)
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

    def _set_accum(self, accum: Optional[dict]) -> None:
        """The gradients accumulated since the last optimizer step; a new token tells the
        forwards whose gradient was added to the old ones that it must be taken again (and so
        does dropping the forwards whose gradient was added before their backward)."""
        self.state = self.state._replace(accum=accum)
        self._accum_token += 1
        self._unconfirmed = []
        if accum is None:  # a step, a drop or a load: no gradients left for a backward to replace
            self._overwrite_at_backward = False
