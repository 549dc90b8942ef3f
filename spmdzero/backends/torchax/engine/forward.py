"""A torchax engine's forward: the module run as a jitted JAX program of its parameters, one
program per input structure and mode. In training, the fused program also takes the gradient of
the loss the module returns (``jax.grad``) and adds it to the accumulated gradients; for a loss
computed outside the module, the VJP program returns the outputs with their VJP, tied into
torch autograd (``outside_loss``). Outputs come back as torchax tensors (``output_tensor``). A mixin of
``TorchaxEngine``."""

from __future__ import annotations

import functools
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
from spmdzero.runtime.out_of_memory import raises_torch_out_of_memory
from spmdzero.backends.torchax.programs.forward import build_forward, find_loss


# ``forward.pending`` of a training forward whose gradient was added to the accumulated ones when
# it ran (``_gradient``): its backward confirms it, ``BackwardPrograms._settle`` takes it out again
SPECULATED = object()




def _belongs_to(loss: torch.Tensor, forward) -> None:
    """``loss`` is ``forward``'s: backward commits the gradient that forward takes, unless the
    loss is written in place after it (its version then differs, ``BackwardPrograms.backward``)."""
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


class ForwardPrograms:
    """The forward part of ``TorchaxEngine`` (see the module docstring)."""

    # ---- the training step -----------------------------------------------------------------
    def __call__(self, *inputs, **kwargs):
        return self.forward(*inputs, **kwargs)

    @raises_torch_out_of_memory
    def forward(self, *inputs, **kwargs):
        """Run the module in one jitted program; in training (train mode, grad enabled) it also
        takes the gradient of the loss the module returns (see the module docstring). A forward
        that reads a tensor's value on the host runs eagerly (``host_reads``)."""
        return self._forward(inputs, kwargs)

    def _reads_values(self, err: Exception) -> RuntimeError:
        """The error for tracing the step of a forward that reads a tensor's value on the host
        (``trace_step``): training runs it eagerly (``host_reads``), one traced program cannot."""
        found = str(err).strip().splitlines()[0]
        return RuntimeError(
            f"spmd.backend='torchax': {type(self._module).__name__}'s forward reads a tensor's value on the host"
            f"{host_reads.where(err)} (bool(t), t.item(), t.tolist(), a boolean mask or nonzero), so its step cannot "
            "be traced as one JAX program (trace_step, spmdzero aot); training runs such a forward eagerly instead. "
            "Compute it with tensor ops (torch.where, masks of fixed shape) to compile it, or use "
            f"spmd.backend='torch_xla', which cuts the step in two at the read. JAX said: {found}")

    def _forward(self, inputs: tuple, kwargs: dict, method: str = "forward"):
        """The module's ``method`` (its ``forward``, or another method a script calls through the
        engine, ``module_methods``) on these inputs, in a program of its own; called while another
        engine traces, inline in that engine's program (``other_engines``)."""
        tracer = other_engines.tracing_engine()
        if tracer is not None and tracer is not self:
            return other_engines.call_inside(self, method_programs.entry(self._module, method), inputs, kwargs)
        forwards, traced = other_engines.forward_attributes(), sum(self.traces.values())
        draw = self._next_draw(self._module.training and torch.is_grad_enabled())
        while True:
            try:
                result = self._forward_once(inputs, kwargs, method, draw)
                break
            except other_engines.Met as met:
                if any(e is met.engine for e in self._other_engines):
                    raise
                self._other_engines.append(met.engine)  # its programs take that engine's values from now on
                other_engines.put_back(forwards)
        # a forward redirection's swap undoes itself when the module's forward runs, which a
        # compiled program does not do again: what its trace did to the attributes is done here
        if sum(self.traces.values()) != traced:
            self._forward_swaps = other_engines.changed(forwards) or self._forward_swaps
        else:
            other_engines.put_back(self._forward_swaps)
        return result

    def _program_constants(self) -> dict:
        """The constants a program takes: the buffers and untrained parameters, and the values of
        the other engines it met (``other_engines``)."""
        if not self._other_engines:
            return self.state.constants
        return {**self.state.constants, other_engines.KEY: other_engines.values(self._other_engines)}

    def _next_draw(self, training: bool) -> int:
        """Which of its micro-step's forwards this one is, for its random draws (dropout,
        ``torch.rand``): in torch every call draws anew, so two training forwards of one input
        (R-Drop, SimCSE's two passes) differ, as do the masks of evaluation calls (MAE). Training
        forwards (grad on, training mode) count apart from the others, so an evaluation between
        two steps leaves the training draws as they are. The index restarts at each micro-step:
        a resumed run draws as the uninterrupted one did."""
        if self._draws_at != self.state.draw_step:
            self._draws_at, self._draws = self.state.draw_step, [0, 0]
        stream = 0 if training else 1
        index = self._draws[stream]
        self._draws[stream] += 1
        return index | stream << 31

    def _forward_once(self, inputs: tuple, kwargs: dict, method: str, draw: int):
        """One forward's program run, its outputs cut back from the shape buckets' lengths to
        the lengths fed (``train.shape_buckets``: after the program, outside it)."""
        placed = self._placed(inputs, kwargs, draw)
        return cut_back(self._run_forward(placed, method), placed[-1])

    def _run_forward(self, placed: tuple, method: str):
        leaves, treespec, static, layout, arrays, rng, rows, _ = placed
        training = self._module.training
        grad_enabled = torch.is_grad_enabled()
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        # the inputs whose gradients torch would give (x.grad): differentiated by the VJP program
        which = tuple(i for i, t in enumerate(tensors) if t.requires_grad and t.is_floating_point()) \
            if grad_enabled else ()
        forward = SimpleNamespace(treespec=treespec, static=static, rng=rng, arrays=arrays, rows=rows,
                                  training=training, constants=self._program_constants(), generation=self._generation,
                                  pending=None, accum_token=None, divisor=None, engine=self, which=which,
                                  inputs=[tensors[i] for i in which], dims=[layout.dim_of(tensors[i]) for i in which],
                                  vjp=None, released=False, method=method)
        if training and grad_enabled:
            if rows is not None:
                self._check_training_rows(rows)
            self._input_shapes = tuple(tuple(a.shape) for a in arrays)  # named by the recompile guard
            self._inputs_bucketed = bool(placed[-1])  # padded to a shape bucket (_new_shape_bucket)
            ran = None if which else self._gradient(forward)
            if ran is not None:
                outputs, constants, program = ran
                self._take_constants(constants)
                result = self._outputs(outputs, program, forward)
                _belongs_to(program.loss_of(result), forward)
                return result
            # the output holds no loss (found while tracing), or inputs want their gradients: the
            # VJP program, whose backward engine.backward runs from the loss the script computes
            program = self._program("vjp", treespec, static, training, which, method)
            self.runs["forward"] += 1
            outputs, constants, forward.vjp = program(self.state.params, self._program_constants(), rng, arrays)
            self._take_constants(constants)
            return self._outputs(outputs, program, forward)
        program = self._program("forward", treespec, static, training, method=method)
        self.runs["forward"] += 1
        outputs, constants = program(self.state.params, self._program_constants(), rng, arrays)
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

    def _placed(self, inputs: tuple, kwargs: dict, draw: int = 0) -> tuple:
        """A forward's inputs as its program takes them: (leaves, their treespec, the non-tensor
        leaves by position, the batch layout, the tensors placed as JAX arrays, the random key
        with the micro-step and the forward's ``draw`` (``_next_draw``), the global rows when
        known, the shape buckets' cuts back to the lengths fed). Changes made on the host go to
        the devices first."""
        inputs, kwargs, cuts = self._padded(inputs, kwargs, model_pad_id(self._module))
        # host tensors only: a torchax tensor (an earlier output) is the model's already
        inputs, kwargs = self._in_model_dtype(inputs, kwargs, keep=is_torchax_tensor)
        # a mapping that is not a dict (transformers' BatchEncoding) is one leaf to torch's pytree
        inputs, kwargs = as_dicts(inputs), as_dicts(kwargs)
        if self._processes == 1:  # values that are shapes (image grids) join the program's key
            inputs, kwargs = shape_inputs.kept_on_host((inputs, kwargs), is_torchax_tensor,
                                                       shape_inputs.names(self._module))
        leaves, treespec = torch_pytree.tree_flatten((inputs, kwargs))
        static = tuple((i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor))
        self._take_host_changes()
        layout = self._batch_layout(self._module, inputs, kwargs, on_device=is_torchax_tensor)
        arrays = self.placement.place_inputs(leaves, layout)
        rng = (self.state.rng, np.uint32(self.state.draw_step), np.uint32(draw))  # drawn anew at every call
        rows = layout.rows if layout.on_device else None if layout.rows is None else layout.rows * self._batch.processes
        return leaves, treespec, static, layout, arrays, rng, rows, cuts

    def _take_constants(self, changed: dict) -> None:
        """Buffers a forward changed: the devices' values, copied to the module when it is read."""
        if changed:
            self.state = self.state._replace(constants={**self.state.constants, **changed})
            self._buffers_stale.update(changed)

    def _gradient(self, forward: SimpleNamespace):
        """Run the training program for ``forward`` (a training forward's inputs, as it saw
        them). Returns (outputs, changed buffers, the program), or None when the module's output
        holds no loss.

        With no gradients accumulated yet, its gradient is kept in ``forward.pending`` until
        backward commits it. Later in the window, the accumulated gradients are donated to the
        program and its sum replaces them at once (``forward.pending`` is ``SPECULATED``): the
        gradient is counted before its backward, and taken out again if none comes
        (``BackwardPrograms._settle``). Kept beside the sum until the backward, it was a second
        copy of the gradients on every device between a forward and its backward (issue 42)."""
        accumulate = self.state.accum is not None
        program = self._program("accumulate" if accumulate else "train", forward.treespec, forward.static,
                                forward.training, method=forward.method)
        ran = None if program.no_loss else program(self.state.params, forward.constants, self.state.accum, forward.rng,
                                                    forward.arrays, self._loss_scale_value(),
                                                    np.float32(self._loss_divisor))
        if ran is None:
            return None
        self.runs["forward"] += 1
        outputs, constants, gradients = ran
        if accumulate:
            self._replace_accum(gradients)
            self._unconfirmed.append(forward)
            forward.pending = SPECULATED
        else:
            forward.pending = gradients
        forward.accum_token, forward.divisor = self._accum_token, self._loss_divisor
        return outputs, constants, program

    def _outputs(self, arrays: list, program, record: Optional[SimpleNamespace] = None):
        """The program's outputs as the module returned them; with ``record`` (a forward torch
        could differentiate), tied into torch autograd (``outside_loss``), so that a loss the
        script computes from them reaches the compiled backward."""
        spec, others = program.out_spec
        # several processes: each sees its own rows, as a DeepSpeed rank its micro-batch (process_rows)
        views = [process_rows.local_view(a) for a in arrays] if self._processes > 1 else arrays
        leaves = [self._Output(v, self._env) for v in views]
        if record is not None:
            inexact = self._jax.numpy.inexact  # bf16 is not a numpy float to numpy
            record.floats = [i for i, a in enumerate(arrays) if self._jax.numpy.issubdtype(a.dtype, inexact)]
            # the backward's static description of each float output: its global shape and dtype, and
            # with several processes how its cotangent reaches the global mesh
            kind = (lambda i: (process_rows.SPLIT if process_rows.spans_processes(arrays[i], views[i]) else
                               process_rows.STACKED)) if self._processes > 1 else (lambda i: None)
            record.avals = tuple((tuple(arrays[i].shape), str(arrays[i].dtype), kind(i)) for i in record.floats)
            record.shardings = [(views[i].sharding, arrays[i].sharding) for i in record.floats]
            record.tensors = leaves
            leaves = tie(record, self._anchor, record.inputs)
            record.tensors = None  # the outputs hold the record (their grad_fn), not the reverse
        for i, value in others:
            leaves.insert(i, value)
        return torch_pytree.tree_unflatten(leaves, spec)

    def _program(self, kind: str, treespec, static: tuple, training: bool, which: tuple = (),
                 method: str = "forward"):
        """The jitted program for ``kind``, these inputs' structure and the module's mode (traced
        in it: dropout on or off); ``which``: the inputs the VJP program differentiates;
        ``method``: the module's method it runs (``programs/forward.build_forward``)."""
        key = (kind, training, treespec, _hashable(static), which, self._frozen, method, len(self._other_engines))
        if key not in self._programs:
            tracing_others = functools.partial(other_engines.tracing, self, list(self._other_engines))
            self._programs[key] = build_forward(self._setup, kind, treespec, static, which, method, self._frozen,
                                                tracing_others)
        return self._programs[key]

    def _loss_scale_value(self):
        """fp16's loss scale in use, a device scalar (None without one): a training program's input."""
        return None if self.state.loss_scale is None else self.state.loss_scale.scale
