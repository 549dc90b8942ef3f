"""A torchax engine's whole step as one program, for tools rather than training:
``trace_step`` composes the training forward and the update on abstract inputs (``spmdzero
aot`` compiles it for a TPU topology), and ``collectives_report`` compiles it for XLA:CPU to list
its collectives. Functions of the engine: they read its parts and leave it as it was."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

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


def trace_step(engine, inputs: tuple, kwargs: dict) -> TracedStep:
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

    if engine.optimizer is None:
        raise ValueError("trace_step traces a training step, which needs an optimizer: pass optimizer= to "
                         "initialize() or add an 'optimizer' section to the config")
    forwards, updates, trained, plan = engine.forwards, engine.updates, engine.trained, engine.plan
    module = engine.host.wrapped
    traces = collections.Counter(engine.traces)
    try:
        _, treespec, static, _, arrays, rng, rows, _ = forwards.placed(inputs, kwargs)
        accumulate = engine.gradient_accumulation_steps() > 1  # the boundary's gradient joins the window's
        program = forwards.program("accumulate" if accumulate else "train", treespec, static, module.training)
        rep = engine.placement.replicated
        accum = None
        if accumulate:
            dtype = jax_dtype(engine.precision.grad_accum_dtype)
            accum = {n: jax.ShapeDtypeStruct(tuple(plan[n].shape), dtype, sharding=trained.grad_specs[n])
                     for n in trained.names}
        scalar = jax.ShapeDtypeStruct((), np.float32, sharding=rep)

        def step(stepped, accum, constants, rng, arrays, divisor, hyper):
            scale = None if stepped.loss_scale is None else stepped.loss_scale.scale
            outputs, changed, grads = program.jitted(stepped.params, constants, accum, rng, arrays, scale, divisor)
            return updates.program(stepped, grads, hyper), changed, outputs

        def traced():
            shardings = updates.stepped_shardings()
            states = engine.state.opt_state
            if shardings.opt_state is None and states and all(states.values()):
                # a torch optimizer's states, once they exist, come out as they went in: laid out
                # so, each updates its input in place (donated) instead of being a new buffer
                shardings = shardings._replace(opt_state={n: {k: v.sharding for k, v in st.items()}
                                                          for n, st in states.items()})
            jitted = jax.jit(step, out_shardings=((shardings, StepReport(rep, rep)), None, None),
                             donate_argnums=(0, 1))
            return jitted.trace(engine.state.stepped(), accum, engine.state.constants, rng, arrays, scalar,
                                updates.abstract_hyper())

        try:
            try:
                result = traced()
            except jax.errors.ConcretizationTypeError as err:
                if not engine.torch_optimizer or updates.lr_mode != "traced":
                    raise forwards.reads_values(err) from err
                # as the first real step does: its step reads the lr as a Python number (torch_optim.LR_MODES)
                updates.fall_back_to_constant_lr(warn=False)
                try:
                    result = traced()
                except jax.errors.ConcretizationTypeError as again:  # the forward's, then
                    raise forwards.reads_values(again) from again
        except NoLoss:
            raise ValueError(f"the module's output holds no scalar loss ({type(module).__name__}): the "
                             "torchax backend's step compiles the training program, which takes the gradient of "
                             "the loss the module returns (a scalar, a dict with a 'loss' key, an object with "
                             ".loss, or a tuple whose first item is the loss)") from None
    finally:
        engine.traces = traces
    return TracedStep(result, program.loss_index(), {n: tuple(plan[n].shape) for n in trained.names},
                      engine.precision.communication_dtype, engine.train_micro_batch_size_per_gpu(),
                      engine.gradient_accumulation_steps(), rows)


def collectives_report(engine, inputs: tuple, kwargs: dict, loss_fn=None):
    """The collectives of one training step on these inputs, compiled for XLA:CPU on the
    engine's devices, against the data-parallel minimum, as the torch_xla engine reports them.
    ``loss_fn(output)`` (or the module's own loss) is the loss; the step is traced
    (``trace_step``), not run, and the engine is left as it was."""
    from spmdzero.tpu.capture import JaxStepCapture

    module, forwards = engine.host.wrapped, engine.forwards
    programs, own = forwards.programs, module.__dict__.get("forward")
    if loss_fn is not None:  # traced with the loss inside the forward, in programs of its own
        forward = module.forward
        forwards.programs = {}
        module.forward = lambda *args, **kw: host_tensors_as_constants(loss_fn, forward(*args, **kw))
    try:
        step = JaxStepCapture(engine, trace_step(engine, inputs, kwargs))
    finally:
        if loss_fn is not None:
            forwards.programs = programs
            if own is None:
                del module.forward
            else:
                module.forward = own
    return step.collectives_report()
