"""A torchax engine's whole step as one program, for tools rather than training:
``trace_step`` composes the training forward and the update on abstract inputs (``spmdzero
aot`` compiles it for a TPU topology), and ``collectives_report`` compiles it for XLA:CPU to list
its collectives. ``compile()`` is accepted (accelerate calls it) and changes nothing. A mixin of
``TorchaxEngine``."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from spmdzero.sharding.plan import replicated
from spmdzero.backends.torchax.optim import torch_optim
from spmdzero.backends.torchax.engine.forward import host_tensors_as_constants
from spmdzero.backends.torchax.programs.forward import NoLoss
from spmdzero.backends.torchax.lowering.values import jax_dtype
from spmdzero.backends.torchax.programs.train_state import StepReport



class TracedStep(NamedTuple):
    """``TorchaxEngine.trace_step``'s answer: the traced step (``jax.stages.Traced``: ``.lower()``
    gives its StableHLO) and what a report needs that the program does not say."""

    traced: Any
    loss_index: int  # the loss among the forward's output tensors (the step's last outputs)
    trained: dict  # trained parameter name -> shape
    communication_dtype: torch.dtype  # the gradients' dtype on the wire
    micro_batch: int  # rows per data-parallel device per micro-step (the config's)
    accumulation_steps: int
    rows: Optional[int]  # global rows of the traced batch, when known


class TracedSteps:
    """The traced step part of ``TorchaxEngine`` (see the module docstring)."""

    def trace_step(self, *inputs, **kwargs) -> "TracedStep":
        """One training step at an accumulation boundary for a batch of ``inputs``, traced by JAX
        as ONE program and not run: the training program (forward, the gradient of the loss the
        module returns, laid out by the plan's gradient spec and added to the accumulated ones
        when the config accumulates) and the update program (clipping, the optimizer, the
        parameters replicated and the states laid out by the plan), the state donated to the
        outputs as the update donates it. What ``spmdzero aot`` lowers for a TPU topology and
        compiles: the two programs this engine runs, composed, so that the compiler sees one
        step as the torch_xla backend's capture gives it. The forward's outputs are outputs of
        the step (the training program returns them: they are in memory while the update runs).

        On a shape-only engine (``build(..., shape_only=True)``) every argument is a
        ``jax.ShapeDtypeStruct`` on an abstract mesh: nothing is materialized, and any topology
        traces on any machine. On a live engine the arguments are its arrays (traced, not read).
        The engine is left as it was (its trace counters included: the recompile guard does not
        count this trace)."""
        import jax

        if self.optimizer is None:
            raise ValueError("trace_step traces a training step, which needs an optimizer: pass optimizer= to "
                             "initialize() or add an 'optimizer' section to the config")
        traces = collections.Counter(self.traces)
        try:
            _, treespec, static, _, arrays, rng, rows, _ = self._placed(inputs, kwargs)
            accumulate = self.gradient_accumulation_steps() > 1  # the boundary's gradient joins the window's
            program = self._program("accumulate" if accumulate else "train", treespec, static, self._module.training)
            rep = self.placement.replicated
            accum = None
            if accumulate:
                dtype = jax_dtype(self.precision.grad_accum_dtype)
                accum = {n: jax.ShapeDtypeStruct(tuple(self.plan[n].shape), dtype, sharding=self._grad_specs[n])
                         for n in self._names}
            scalar = jax.ShapeDtypeStruct((), np.float32, sharding=rep)

            def step(stepped, accum, constants, rng, arrays, divisor, hyper):
                scale = None if stepped.loss_scale is None else stepped.loss_scale.scale
                outputs, changed, grads = program.jitted(stepped.params, constants, accum, rng, arrays, scale, divisor)
                return self._update(stepped, grads, hyper), changed, outputs

            def traced():
                shardings = self._stepped_shardings()
                states = self.state.opt_state
                if shardings.opt_state is None and states and all(states.values()):
                    # a torch optimizer's states, once they exist, come out as they went in: laid out
                    # so, each updates its input in place (donated) instead of being a new buffer
                    shardings = shardings._replace(opt_state={n: {k: v.sharding for k, v in st.items()}
                                                              for n, st in states.items()})
                rep = self.placement.replicated
                jitted = jax.jit(step, out_shardings=((shardings, StepReport(rep, rep)), None, None),
                                 donate_argnums=(0, 1))
                return jitted.trace(self.state.stepped(), accum, self.state.constants, rng, arrays, scalar,
                                    self._abstract_hyper())

            try:
                try:
                    result = traced()
                except jax.errors.ConcretizationTypeError as err:
                    if not self._torch_optimizer or self._lr_mode != "traced":
                        raise self._reads_values(err) from err
                    # as the first real step does: its step reads the lr as a Python number (torch_optim.LR_MODES)
                    self._lr_mode = torch_optim.fallback_lr_mode(self.basic_optimizer)
                    self._static_hyper = torch_optim.static_hyperparameters(
                        self.basic_optimizer, with_lr=self._lr_mode == "constant")
                    self._update = self._build_update()
                    try:
                        result = traced()
                    except jax.errors.ConcretizationTypeError as again:  # the forward's, then
                        raise self._reads_values(again) from again
            except NoLoss:
                raise ValueError(f"the module's output holds no scalar loss ({type(self._module).__name__}): the "
                                 "torchax backend's step compiles the training program, which takes the gradient of "
                                 "the loss the module returns (a scalar, a dict with a 'loss' key, an object with "
                                 ".loss, or a tuple whose first item is the loss)") from None
        finally:
            self.traces = traces
        return TracedStep(result, program.loss_index(), {n: tuple(self.plan[n].shape) for n in self._names},
                          self.precision.communication_dtype, self.train_micro_batch_size_per_gpu(),
                          self.gradient_accumulation_steps(), rows)

    def _abstract_hyper(self) -> list:
        """The update's hyperparameter input as ``jax.ShapeDtypeStruct``s: one float32 vector per
        param group, as ``_take_model_step`` gives it (none when a torch optimizer's lr is a
        constant of the program)."""
        import jax

        rep = self.placement.replicated
        if self._torch_optimizer:
            return [] if self._lr_mode == "constant" else [
                jax.ShapeDtypeStruct((1,), np.float32, sharding=rep) for _ in self.basic_optimizer.param_groups]
        return [jax.ShapeDtypeStruct((len(self.basic_optimizer._hyper_values(g)),), np.float32, sharding=rep)
                for g in self.basic_optimizer.param_groups]

    def _state_spec(self, name: str, value):
        """An optimizer state's layout: the plan's for a parameter-shaped one, else replicated."""
        planned = self.plan[name]
        return self.placement.sharding(planned.optimizer_state if tuple(value.shape) == tuple(planned.shape)
                              else replicated(value.ndim))

    def compile(self, *args, **kwargs) -> None:
        """DeepSpeed's ``engine.compile()`` (``torch.compile`` of the module; accelerate calls it
        when dynamo is on): this engine's programs are compiled by ``jax.jit`` already, so there
        is nothing more to compile. Said once; ``is_compiled`` is then True, as in DeepSpeed."""
        from spmdzero.observe.console import say_once

        say_once(["engine.compile(): the torchax backend's programs are already compiled by jax.jit; nothing "
                  "changes"])
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self.__dict__.get("_compiled", False)

    def collectives_report(self, *inputs, loss_fn=None, **kwargs):
        """The collectives of one training step on these inputs, compiled for XLA:CPU on this
        engine's devices, against the data-parallel minimum, as the torch_xla engine reports them.
        ``loss_fn(output)`` (or the module's own loss) is the loss; the step is traced
        (``trace_step``), not run, and the engine is left as it was."""
        from spmdzero.tpu.capture import JaxStepCapture

        module = self._module
        programs, own = self._programs, module.__dict__.get("forward")
        if loss_fn is not None:  # traced with the loss inside the forward, in programs of its own
            forward = module.forward
            self._programs = {}
            module.forward = lambda *args, **kw: host_tensors_as_constants(loss_fn, forward(*args, **kw))
        try:
            step = JaxStepCapture(self, self.trace_step(*inputs, **kwargs))
        finally:
            if loss_fn is not None:
                self._programs = programs
                if own is None:
                    del module.forward
                else:
                    module.forward = own
        return step.collectives_report()
