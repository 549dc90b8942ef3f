"""A torchax engine's forward: the module run as a jitted JAX program of its parameters, one
program per input structure and mode. In training, the fused program also takes the gradient of
the loss the module returns (``jax.grad``) and adds it to the accumulated gradients; for a loss
computed outside the module, the VJP program returns the outputs with their VJP, tied into
torch autograd (``outside_loss``). Outputs come back as torchax tensors (``output_tensor``).
``Forwards`` is the engine's part that does it (``engine.forwards``)."""

from __future__ import annotations

import functools
import weakref
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
from torch.utils import _pytree as torch_pytree

from spmdzero.train.data import model_pad_id
from spmdzero.train.shape_buckets import cut_back
from spmdzero.backends.torchax.engine import host_reads
from spmdzero.backends.torchax.engine.outside_loss import tie
from spmdzero.backends.torchax.outputs import process_rows
from spmdzero.backends.torchax.patches import shape_inputs
from spmdzero.backends.torchax.engine import other_engines
from spmdzero.backends.torchax.programs import method_programs
from spmdzero.backends.torchax.lowering.values import as_dicts, is_torchax_tensor
from spmdzero.backends.torchax.programs.forward import build_forward, find_loss


# ``forward.pending`` of a training forward whose gradient was added to the accumulated ones when
# it ran (``Gradients.take``): its backward confirms it, ``Gradients.settle`` takes it out again
SPECULATED = object()




def _belongs_to(loss: torch.Tensor, forward) -> None:
    """``loss`` is ``forward``'s: backward commits the gradient that forward takes, unless the
    loss is written in place after it (its version then differs, ``Gradients.backward``)."""
    loss._spmdzero_forward, forward.loss_version = forward, loss._version






def _hashable(static: tuple) -> tuple:
    try:
        hash(static)
        return static
    except TypeError:
        return tuple((i, repr(v)) for i, v in static)




def host_tensors_as_constants(fn, output):
    """``fn(output)`` traced, its host tensors (a target the loss function closes over) taken
    as constants of the program: torchax refuses math between its tensors and host ones. A move
    to a device (``y.to(engine.device)``, ``.cpu()``) keeps the value where the program has it:
    a traced value cannot be copied to the host."""
    import torchax
    from torchax import tensor as ttensor

    env = torchax.default_env()

    class HostTensorsAsConstants(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (torch.Tensor.cpu, torch.Tensor.cuda):
                return args[0]
            if func is torch.Tensor.to:  # only a dtype change stays
                dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
                args, kwargs = (args[0],) if dtype is None else (args[0], dtype), {}
            args, kwargs = torch_pytree.tree_map_only(
                torch.Tensor, lambda t: t if is_torchax_tensor(t) else ttensor.Tensor(env.t2j_copy(t.detach()), env),
                (args, kwargs))
            return func(*args, **kwargs)

    with HostTensorsAsConstants():
        return fn(output)


class Forwards:
    """The module's forward on the devices: a part of ``TorchaxEngine`` (``engine.forwards``).
    It places a call's inputs, picks (building once) the program for their structure and the
    module's mode, runs it, and hands the outputs back as torchax tensors, tied into torch
    autograd when torch could differentiate them. A training forward's gradient is
    ``engine.gradients``' (``Gradients.take``). What it owns: the programs by key, the other
    engines its programs take, and which draw of its micro-step each forward is."""

    def __init__(self, engine):
        self._engine = weakref.proxy(engine)  # the engine holds this part; the part does not keep it alive
        self.programs: dict = {}  # jitted functions by static structure (``program``)
        self.other_engines: list = []  # engines called inside this one's programs (other_engines.py)
        self._forward_swaps: list = []  # what the last trace did to modules' forward attributes
        self._draws_at, self._draws = None, [0, 0]  # forwards of the micro-step so far, by stream (``_next_draw``)
        self._anchor = torch.zeros((), requires_grad=True)  # ties every training forward's outputs into autograd

    def run(self, inputs: tuple, kwargs: dict, method: str = "forward"):
        """The module's ``method`` (its ``forward``, or another method a script calls through the
        engine, ``module_methods``) on these inputs, in a program of its own; called while another
        engine traces, inline in that engine's program (``other_engines``)."""
        engine = self._engine
        module = engine.host.wrapped
        tracer = other_engines.tracing_engine()
        if tracer is not None and tracer is not engine:
            return other_engines.call_inside(engine, method_programs.entry(module, method), inputs, kwargs)
        forwards, traced = other_engines.forward_attributes(), sum(engine.traces.values())
        draw = self._next_draw(module.training and torch.is_grad_enabled())
        while True:
            try:
                result = self._run_once(inputs, kwargs, method, draw)
                break
            except other_engines.Met as met:
                if any(e is met.engine for e in self.other_engines):
                    raise
                self.other_engines.append(met.engine)  # its programs take that engine's values from now on
                other_engines.put_back(forwards)
        # a forward redirection's swap undoes itself when the module's forward runs, which a
        # compiled program does not do again: what its trace did to the attributes is done here
        if sum(engine.traces.values()) != traced:
            self._forward_swaps = other_engines.changed(forwards) or self._forward_swaps
        else:
            other_engines.put_back(self._forward_swaps)
        return result

    def reads_values(self, err: Exception) -> RuntimeError:
        """The error for tracing the step of a forward that reads a tensor's value on the host
        (``trace_step``): training runs it eagerly (``host_reads``), one traced program cannot."""
        found = str(err).strip().splitlines()[0]
        return RuntimeError(
            f"spmd.backend='torchax': {type(self._engine.host.wrapped).__name__}'s forward reads a tensor's value on "
            f"the host{host_reads.where(err)} (bool(t), t.item(), t.tolist(), a boolean mask or nonzero), so its step "
            "cannot be traced as one JAX program (trace_step, spmdzero aot); training runs such a forward eagerly "
            "instead. Compute it with tensor ops (torch.where, masks of fixed shape) to compile it, or use "
            f"spmd.backend='torch_xla', which cuts the step in two at the read. JAX said: {found}")

    def constants(self) -> dict:
        """The constants a program takes: the buffers and untrained parameters, and the values of
        the other engines it met (``other_engines``)."""
        constants = self._engine.state.constants
        if not self.other_engines:
            return constants
        return {**constants, other_engines.KEY: other_engines.values(self.other_engines)}

    def restart_draws(self) -> None:
        """The next forward is its micro-step's first (a checkpoint load: the loaded micro-step
        may be the one the last forwards drew in)."""
        self._draws_at, self._draws = None, [0, 0]

    def _next_draw(self, training: bool) -> int:
        """Which of its micro-step's forwards this one is, for its random draws (dropout,
        ``torch.rand``): in torch every call draws anew, so two training forwards of one input
        (R-Drop, SimCSE's two passes) differ, as do the masks of evaluation calls (MAE). Training
        forwards (grad on, training mode) count apart from the others, so an evaluation between
        two steps leaves the training draws as they are. The index restarts at each micro-step:
        a resumed run draws as the uninterrupted one did."""
        draw_step = self._engine.state.draw_step
        if self._draws_at != draw_step:
            self._draws_at, self._draws = draw_step, [0, 0]
        stream = 0 if training else 1
        index = self._draws[stream]
        self._draws[stream] += 1
        return index | stream << 31

    def _run_once(self, inputs: tuple, kwargs: dict, method: str, draw: int):
        """One forward's program run, its outputs cut back from the shape buckets' lengths to
        the lengths fed (``train.shape_buckets``: after the program, outside it)."""
        placed = self.placed(inputs, kwargs, draw)
        return cut_back(self._run_placed(placed, method), placed[-1])

    def _run_placed(self, placed: tuple, method: str):
        engine = self._engine
        leaves, treespec, static, layout, arrays, rng, rows, _ = placed
        training = engine.host.wrapped.training
        grad_enabled = torch.is_grad_enabled()
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        # the inputs whose gradients torch would give (x.grad): differentiated by the VJP program
        which = tuple(i for i, t in enumerate(tensors) if t.requires_grad and t.is_floating_point()) \
            if grad_enabled else ()
        forward = SimpleNamespace(treespec=treespec, static=static, rng=rng, arrays=arrays, rows=rows,
                                  training=training, constants=self.constants(),
                                  params_version=engine.params_version, pending=None, accum_token=None, divisor=None,
                                  engine=engine, which=which, inputs=[tensors[i] for i in which],
                                  dims=[layout.dim_of(tensors[i]) for i in which], vjp=None, released=False,
                                  method=method)
        if training and grad_enabled:
            if rows is not None:
                engine.check_training_rows(rows)
            # named by the recompile guard; padded to a shape bucket (``EngineBase.new_shape_bucket``)
            engine.training_inputs(tuple(tuple(a.shape) for a in arrays), bool(placed[-1]))
            ran = None if which else engine.gradients.take(forward)
            if ran is not None:
                outputs, constants, program = ran
                self._take_constants(constants)
                result = self._outputs(outputs, program, forward)
                _belongs_to(program.loss_of(result), forward)
                return result
            # the output holds no loss (found while tracing), or inputs want their gradients: the
            # VJP program, whose backward engine.backward runs from the loss the script computes
            program = self.program("vjp", treespec, static, training, which, method)
            engine.runs["forward"] += 1
            outputs, constants, forward.vjp = program(engine.state.params, self.constants(), rng, arrays)
            self._take_constants(constants)
            return self._outputs(outputs, program, forward)
        program = self.program("forward", treespec, static, training, method=method)
        engine.runs["forward"] += 1
        outputs, constants = program(engine.state.params, self.constants(), rng, arrays)
        self._take_constants(constants)
        if not grad_enabled:
            return self._outputs(outputs, program)
        # eval mode with grad enabled (fine-tuning with dropout off): the gradients are taken only
        # if backward asks for them, by the training or VJP program in eval mode
        result = self._outputs(outputs, program, forward)
        loss = find_loss(result)
        if loss is not None and not which:
            _belongs_to(loss, forward)
        return result

    def placed(self, inputs: tuple, kwargs: dict, draw: int = 0) -> tuple:
        """A forward's inputs as its program takes them: (leaves, their treespec, the non-tensor
        leaves by position, the batch layout, the tensors placed as JAX arrays, the random key
        with the micro-step and the forward's ``draw`` (``_next_draw``), the global rows when
        known, the shape buckets' cuts back to the lengths fed). Changes made on the host go to
        the devices first."""
        engine = self._engine
        module = engine.host.wrapped
        inputs, kwargs, cuts = engine.padded_inputs(inputs, kwargs, model_pad_id(module))
        # host tensors only: a torchax tensor (an earlier output) is the model's already
        inputs, kwargs = engine.in_model_dtype(inputs, kwargs, keep=is_torchax_tensor)
        # a mapping that is not a dict (transformers' BatchEncoding) is one leaf to torch's pytree
        inputs, kwargs = as_dicts(inputs), as_dicts(kwargs)
        if engine.processes == 1:  # values that are shapes (image grids) join the program's key
            inputs, kwargs = shape_inputs.kept_on_host((inputs, kwargs), is_torchax_tensor,
                                                       shape_inputs.names(module))
        leaves, treespec = torch_pytree.tree_flatten((inputs, kwargs))
        static = tuple((i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor))
        engine.host.take_changes()
        layout = engine.batch_layout(module, inputs, kwargs, on_device=is_torchax_tensor)
        arrays = engine.placement.place_inputs(leaves, layout)
        state = engine.state
        rng = (state.rng, np.uint32(state.draw_step), np.uint32(draw))  # drawn anew at every call
        rows = layout.rows if layout.on_device else None if layout.rows is None else layout.rows * engine.batch_sizes.processes
        return leaves, treespec, static, layout, arrays, rng, rows, cuts

    def _take_constants(self, changed: dict) -> None:
        """Buffers a forward changed: the devices' values, copied to the module when it is read."""
        if changed:
            engine = self._engine
            engine.state = engine.state._replace(constants={**engine.state.constants, **changed})
            engine.host.buffers_changed(changed)

    def _outputs(self, arrays: list, program, record: Optional[SimpleNamespace] = None):
        """The program's outputs as the module returned them; with ``record`` (a forward torch
        could differentiate), tied into torch autograd (``outside_loss``), so that a loss the
        script computes from them reaches the compiled backward."""
        import jax

        engine = self._engine
        spec, others = program.out_spec
        # several processes: each sees its own rows, as a DeepSpeed rank its micro-batch (process_rows)
        views = [process_rows.local_view(a) for a in arrays] if engine.processes > 1 else arrays
        leaves = [engine.output_tensor(v, engine.env) for v in views]
        if record is not None:
            inexact = jax.numpy.inexact  # bf16 is not a numpy float to numpy
            record.floats = [i for i, a in enumerate(arrays) if jax.numpy.issubdtype(a.dtype, inexact)]
            # the backward's static description of each float output: its global shape and dtype, and
            # with several processes how its cotangent reaches the global mesh
            kind = (lambda i: (process_rows.SPLIT if process_rows.spans_processes(arrays[i], views[i]) else
                               process_rows.STACKED)) if engine.processes > 1 else (lambda i: None)
            record.avals = tuple((tuple(arrays[i].shape), str(arrays[i].dtype), kind(i)) for i in record.floats)
            record.shardings = [(views[i].sharding, arrays[i].sharding) for i in record.floats]
            record.tensors = leaves
            leaves = tie(record, self._anchor, record.inputs)
            record.tensors = None  # the outputs hold the record (their grad_fn), not the reverse
        for i, value in others:
            leaves.insert(i, value)
        return torch_pytree.tree_unflatten(leaves, spec)

    def program(self, kind: str, treespec, static: tuple, training: bool, which: tuple = (),
                method: str = "forward"):
        """The jitted program for ``kind``, these inputs' structure and the module's mode (traced
        in it: dropout on or off); ``which``: the inputs the VJP program differentiates;
        ``method``: the module's method it runs (``programs/forward.build_forward``)."""
        engine = self._engine
        frozen = engine.host.frozen
        key = (kind, training, treespec, _hashable(static), which, frozen, method, len(self.other_engines))
        if key not in self.programs:
            tracing_others = functools.partial(other_engines.tracing, engine, list(self.other_engines))
            self.programs[key] = build_forward(engine.setup, kind, treespec, static, which, method, frozen,
                                               tracing_others)
        return self.programs[key]
