"""A torchax engine's forward: the module run as a jitted JAX program of its parameters, one
program per input structure and mode. In training, the fused program also takes the gradient of
the loss the module returns (``jax.grad``) and adds it to the accumulated gradients; for a loss
computed outside the module, the VJP program returns the outputs with their VJP, tied into
torch autograd (``outside_loss``). Outputs come back as torchax tensors (``output_tensor``). A mixin of
``TorchaxEngine``."""

from __future__ import annotations

import gc
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
from torch.utils import _pytree as torch_pytree

from spmdzero.train.data import model_pad_id
from spmdzero.train.shape_buckets import cut_back
from spmdzero.backends.torchax.lowering import attention, autocast
from spmdzero.backends.torchax.patches import batchnorm
from spmdzero.backends.torchax.engine import frozen, host_reads
from spmdzero.backends.torchax.engine.outside_loss import tie
from spmdzero.backends.torchax.outputs import process_rows
from spmdzero.backends.torchax.patches import registry, shape_inputs
from spmdzero.backends.torchax.patches import trace_view
from spmdzero.backends.torchax.lowering import remat, traced_checks
from spmdzero.backends.torchax.engine import method_programs, other_engines
from spmdzero.backends.torchax.lowering import cross_entropy
from spmdzero.backends.torchax.lowering import zero3_gather
from spmdzero.train.scan_layers import scanned_parameters
from spmdzero.backends.torchax.lowering.values import as_dicts, is_torchax_tensor, jax_dtype
from spmdzero.runtime.out_of_memory import raises_torch_out_of_memory
from spmdzero.backends.torchax.lowering import trace_reads


# ``forward.pending`` of a training forward whose gradient was added to the accumulated ones when
# it ran (``_gradient``): its backward confirms it, ``BackwardPrograms._settle`` takes it out again
SPECULATED = object()


class _NoLoss(Exception):
    """Raised while tracing a training forward whose output holds no scalar loss."""


def _belongs_to(loss: torch.Tensor, forward) -> None:
    """``loss`` is ``forward``'s: backward commits the gradient that forward takes, unless the
    loss is written in place after it (its version then differs, ``BackwardPrograms.backward``)."""
    loss._spmdzero_forward, forward.loss_version = forward, loss._version


def _forward_key(key, micro_step, draw):
    """The random key of one forward: the engine's, folded with the micro-step (``_draw_step``)
    and the draw."""
    import jax

    return jax.random.fold_in(jax.random.fold_in(key, micro_step), draw)


def _find_loss(output) -> Optional[torch.Tensor]:
    def scalar(t):
        return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()

    if scalar(output):
        return output
    # a dict with a "loss" key, as the torch_xla backend and DeepSpeed take it
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if scalar(loss):
        return loss
    if isinstance(output, (tuple, list)) and output and scalar(output[0]):
        return output[0]
    return None


def _hashable(static: tuple) -> tuple:
    try:
        hash(static)
        return static
    except TypeError:
        return tuple((i, repr(v)) for i, v in static)


def _signature(arrays) -> tuple:
    """The inputs' shapes and dtypes, as jit tells its traces apart (concrete arrays or tracers)."""
    return tuple((tuple(a.shape), str(a.dtype)) for a in arrays)


def _host_tensors_as_constants(fn, output):
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
        loss = _find_loss(result)
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
        arrays = self._place_inputs(leaves, layout)
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
                                                    forward.arrays)
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
        ``method``: the module's method it runs."""
        key = (kind, training, treespec, _hashable(static), which, self._frozen, method, len(self._other_engines))
        if key not in self._programs:
            self._programs[key] = self._build_forward(kind, treespec, static, which, method)
        return self._programs[key]

    def _build_forward(self, kind: str, treespec, static: tuple, which: tuple = (), method: str = "forward"):
        """A jitted run of the module for one input structure: ``kind`` "forward":
        ``(params, constants, rng, inputs) -> (outputs, changed buffers)``; "train" (the first
        micro-step) and "accumulate" (later ones): ``(params, constants, accum, rng, inputs) ->
        (outputs, changed buffers, accumulated gradients)``, or None when the output holds no loss;
        "vjp": ``(params, constants, rng, inputs) -> (outputs, changed buffers, VJP)``, the VJP of
        the float outputs with respect to the parameters and the inputs at positions ``which``
        (what ``_backward_through`` gives the cotangents)."""
        import jax

        env, module, names, policy = self._env, self._module, set(self._names), self.precision
        entry = method_programs.entry(module, method)  # what functional_call runs: the module, or its method
        frozen_now = self._frozen  # part of the program's key (_program)
        out_spec: list = []  # (treespec, [(index, non-tensor leaf)]), filled while tracing
        # the batch norms' running statistics are updated in training
        facts = registry.TraceFacts([bn for _, bn in batchnorm.tracked(module)], self.expert_matmuls)
        loss_leaf: list = []

        def flatten_output(output) -> list:
            """The output's tensors as JAX arrays; its other leaves are kept if they are plain
            values, else dropped (None): a transformers cache holds traced arrays."""
            leaves, spec = torch_pytree.tree_flatten(output)
            plain = (int, float, str, bool, type(None))
            out_spec[:] = [spec, [(i, v if isinstance(v, plain) else None) for i, v in enumerate(leaves)
                                  if not isinstance(v, torch.Tensor)]]
            return [env.t2j_iso(t) for t in leaves if isinstance(t, torch.Tensor)]

        # ZeRO-3: each sharded parameter gathered whole where the module reads it (zero3_gather);
        # a scanned stack's weights are gathered by its loop, one layer per trip (``scan.py``)
        gathers = zero3_gather.gathers(self.plan, self._param_specs, self._sharding, scanned_parameters(module))

        others = list(self._other_engines)  # their values come in under other_engines.KEY

        def run(params, constants, rng, arrays, differentiated: bool = True):
            constants = dict(constants)
            traced_others = constants.pop(other_engines.KEY, None)
            leaves = list(arrays)
            for i, value in static:
                leaves.insert(i, shape_inputs.unwrapped(value))
            inputs, kwargs = torch_pytree.tree_unflatten(leaves, treespec)
            tensors = env.j2t_iso({**frozen.held(zero3_gather.gathered_all(gathers, params), frozen_now),
                                   **constants})
            inputs, kwargs = env.j2t_iso((inputs, kwargs))
            # functional_call puts the host tensors back when it returns, except under a submodule
            # registered twice (``self.alias = self.shared``): there the traced ones stayed. Put back here,
            # exactly: torch's parametrize (PEFT's LoRA on 5.x experts) leaves a removed one as a buffer
            held = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
            try:
                with env, env.override_property(prng=_forward_key(*rng)), trace_view.tracing(differentiated), \
                        remat.rematerializing(env, tensors.values(), zero3_gather.regathers(gathers, params, tensors)), \
                        cross_entropy.fused(env), \
                        attention.choosing(self.attention_kernels, env), \
                        other_engines.tracing(self, others, traced_others, env), \
                        autocast.autocasting(env, self.precision.autocast_dtype), \
                        traced_checks.placeholder_checks_left_out(), registry.entered(facts):
                    output = torch.func.functional_call(entry, method_programs.keyed(entry, tensors), inputs, kwargs)
            finally:
                for m, params, buffers in held:
                    m._parameters.clear()
                    m._parameters.update(params)
                    m._buffers.clear()
                    m._buffers.update(buffers)
            # buffers the module updated in place (running statistics) are returned as new values
            changed = {n: t._elem for n, t in tensors.items() if n not in names and t._elem is not constants[n]}
            return output, changed

        def program_forward(params, constants, rng, arrays):
            self.traces["forward"] += 1
            output, changed = run(params, constants, rng, arrays, differentiated=False)
            return flatten_output(output), changed

        def program_train(params, constants, accum, rng, arrays, loss_scale, divisor):
            self.traces["train_forward"] += 1

            def objective(params):
                output, changed = run(params, constants, rng, arrays)
                loss = _find_loss(output)
                if loss is None:
                    raise _NoLoss
                outputs = flatten_output(output)
                tensors = [t for t in torch_pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
                loss_leaf[:] = [next(i for i, t in enumerate(tensors) if t is loss)]
                value = env.t2j_iso(loss).reshape(())
                # DeepSpeed's backward scales the loss by 1/gradient_accumulation_steps (unless
                # backward(scale_wrt_gas=False): 1), then by fp16's loss scale (inputs: a new
                # value is not a new program)
                value = value / divisor
                return (value if loss_scale is None else value * loss_scale), (outputs, changed)

            grads, (outputs, changed) = jax.grad(objective, has_aux=True)(params)
            # reduced in communication_data_type, accumulated in grad_accum_dtype (both the model's by default)
            comm, accumulated = jax_dtype(policy.communication_dtype), jax_dtype(policy.grad_accum_dtype)
            grads = {n: self._laid_out_gradient(n, g.astype(comm)).astype(accumulated) for n, g in grads.items()}
            if kind == "accumulate":
                grads = {n: jax.lax.with_sharding_constraint(accum[n] + g, self._grad_specs[n])
                         for n, g in grads.items()}
            return outputs, changed, grads

        def program_vjp(params, constants, rng, arrays):
            self.traces["vjp_forward"] += 1
            floats: list = []  # positions of the float outputs, found while tracing

            def differentiable(params, chosen):
                placed = list(arrays)
                for i, array in zip(which, chosen):
                    placed[i] = array
                output, changed = run(params, constants, rng, placed)
                outputs = flatten_output(output)
                floats[:] = [i for i, o in enumerate(outputs) if jax.numpy.issubdtype(o.dtype, jax.numpy.inexact)]
                return [outputs[i] for i in floats], (outputs, changed)

            # ZeRO-3's gathered weights gathered again in the backward; not eagerly (jax.checkpoint traces)
            if self.plan.stage >= 3 and not trace_reads.concrete((params, arrays)):
                differentiable = jax.checkpoint(differentiable, policy=zero3_gather.not_saving_gathered_weights)

            _, vjp, (outputs, changed) = jax.vjp(differentiable, params, [arrays[i] for i in which], has_aux=True)
            # the VJP's residuals that are parameters or buffers themselves (a matmul's weight) are
            # not outputs: as outputs they were copies, a second copy of the weights on every device
            # until the backward; ``call`` puts the engine's arrays back in their place
            leaves, treedef = jax.tree_util.tree_flatten(vjp)
            sources = {id(a): (0, n) for n, a in params.items()} | {id(a): (1, n) for n, a in constants.items()}
            residuals[_signature(arrays)] = (treedef, [sources.get(id(leaf)) for leaf in leaves])
            return outputs, changed, [leaf for leaf in leaves if id(leaf) not in sources]

        if kind == "vjp":
            jitted = self._host_reads.program(program_vjp, kind)
            # per input signature: (the VJP's treedef, per leaf: None or where it comes from), set by
            # its trace. The treedef holds the output shapes the VJP takes cotangents of, so a batch of
            # a length traced before (jit's cache, no new trace) needs that trace's, not the last one's
            residuals: dict = {}

            def call(params, constants, rng, arrays):
                outputs, changed, computed = jitted(params, constants, rng, arrays)
                treedef, sources = residuals[_signature(arrays)]
                computed, inputs = iter(computed), (params, constants)
                vjp = jax.tree_util.tree_unflatten(
                    treedef, [next(computed) if s is None else inputs[s[0]][s[1]] for s in sources])
                return outputs, changed, (host_reads.EagerVJP(vjp) if jitted.eager else vjp)
        elif kind != "forward":
            # later in the window the accumulated gradients are donated: the sum replaces them (_gradient)
            jitted = self._host_reads.program(program_train, kind,
                                              **({"donate_argnums": (2,)} if kind == "accumulate" else {}))

            def call(params, constants, accum, rng, arrays, divisor=None):
                scale = None if self.state.loss_scale is None else self.state.loss_scale.scale
                divisor = self._loss_divisor if divisor is None else divisor
                try:
                    return jitted(params, constants, accum, rng, arrays, scale, np.float32(divisor))
                except _NoLoss:
                    call.no_loss = True
                # the failed trace's frames (JAX's among them) refer to each other and hold its inputs
                # (the parameters, the accumulated gradients): freed now, once per program, not when
                # Python's cycle collector next runs (a second gradient on the devices until then)
                gc.collect()
                return None
        else:
            jitted = self._host_reads.program(program_forward, kind)

            def call(params, constants, rng, arrays):
                return jitted(params, constants, rng, arrays)
        call.no_loss = False
        call.jitted = jitted  # for trace_step, which composes it with the update
        call.loss_index = lambda: loss_leaf[0]  # the loss among the output tensors, once traced
        call.out_spec = out_spec
        call.loss_of = lambda result: [t for t in torch_pytree.tree_leaves(result)
                                       if isinstance(t, torch.Tensor)][loss_leaf[0]]
        return call
