"""The forward programs: the module run as a jitted JAX function of its parameters, one program
per input structure, mode and kind. Plain functions of arrays, built by ``build_forward`` from a
``ProgramSetup`` (what they are built from, named) and the inputs' structure: the engine keeps
them by key and calls them with its ``TrainState``'s arrays (``engine/forward.py``).

* ``"forward"``: ``(params, constants, rng, inputs) -> (outputs, changed buffers)``;
* ``"train"`` (the first micro-step) and ``"accumulate"`` (later ones, the accumulation donated):
  ``(params, constants, accum, rng, inputs, loss scale, divisor) -> (outputs, changed buffers,
  accumulated gradients)``, or None when the output holds no loss (``call.no_loss``);
* ``"vjp"``: ``(params, constants, rng, inputs) -> (outputs, changed buffers, VJP)``, the VJP of
  the float outputs with respect to the parameters and the chosen inputs."""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Callable, Optional

import numpy as np
import torch
from torch.utils import _pytree as torch_pytree

from spmdzero.train.scan_layers import scanned_parameters
from spmdzero.backends.torchax.lowering import attention, autocast, cross_entropy, remat, trace_reads, traced_checks
from spmdzero.backends.torchax.lowering import zero3_gather
from spmdzero.backends.torchax.patches import batchnorm, registry, shape_inputs, trace_view
from spmdzero.backends.torchax.programs import frozen, gradients, method_programs
from spmdzero.backends.torchax.programs.setup import ProgramSetup
from spmdzero.backends.torchax.programs.module_call import host_tensors_kept

# the entry of a program's constants that holds the values of other engines it met (``engine/other_engines.py``)
OTHER_ENGINES = "\x00other engines"


class NoLoss(Exception):
    """Raised while tracing a training forward whose output holds no scalar loss."""


def forward_key(key, micro_step, draw):
    """The random key of one forward: the engine's, folded with the micro-step (``TrainState.draw_step``)
    and the draw."""
    import jax

    return jax.random.fold_in(jax.random.fold_in(key, micro_step), draw)


def find_loss(output) -> Optional[torch.Tensor]:
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


def _signature(arrays) -> tuple:
    """The inputs' shapes and dtypes, as jit tells its traces apart (concrete arrays or tracers)."""
    return tuple((tuple(a.shape), str(a.dtype)) for a in arrays)


def build_forward(setup: ProgramSetup, kind: str, treespec, static: tuple, which: tuple, method: str,
                  frozen_names: frozenset, tracing_others: Callable):
    """The program of ``kind`` (the module docstring) for one input structure (``treespec``, the
    non-tensor leaves ``static``): ``which``, the inputs at those positions that the VJP program
    differentiates; ``method``, the module's method it runs; ``frozen_names``, the parameters
    frozen since initialize (held, not differentiated); ``tracing_others(values, env)``, the
    context in which other engines called inside this one's forward run inline."""
    import jax

    env, module, names, policy = setup.env, setup.module, set(setup.trained), setup.policy
    entry = method_programs.entry(module, method)  # what functional_call runs: the module, or its method
    frozen_now = frozen_names  # part of the program's key
    out_spec: list = []  # (treespec, [(index, non-tensor leaf)]), filled while tracing
    # the batch norms' running statistics are updated in training
    facts = registry.TraceFacts([bn for _, bn in batchnorm.tracked(module)], setup.expert_matmuls)
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
    gathers = zero3_gather.gathers(setup.plan, setup.param_specs, setup.sharding, scanned_parameters(module))

    def run(params, constants, rng, arrays, differentiated: bool = True):
        constants = dict(constants)
        traced_others = constants.pop(OTHER_ENGINES, None)
        leaves = list(arrays)
        for i, value in static:
            leaves.insert(i, shape_inputs.unwrapped(value))
        inputs, kwargs = torch_pytree.tree_unflatten(leaves, treespec)
        tensors = env.j2t_iso({**frozen.held(zero3_gather.gathered_all(gathers, params), frozen_now),
                               **constants})
        inputs, kwargs = env.j2t_iso((inputs, kwargs))
        with host_tensors_kept(module):  # the host's tensors put back (module_call.py says why)
            with env, env.override_property(prng=forward_key(*rng)), trace_view.tracing(differentiated), \
                    remat.rematerializing(env, tensors.values(), zero3_gather.regathers(gathers, params, tensors)), \
                    cross_entropy.fused(env), \
                    attention.choosing(setup.attention_kernels, env), \
                    tracing_others(traced_others, env), \
                    autocast.autocasting(env, policy.autocast_dtype), \
                    traced_checks.placeholder_checks_left_out(), registry.entered(facts):
                output = torch.func.functional_call(entry, method_programs.keyed(entry, tensors), inputs, kwargs)
        # buffers the module updated in place (running statistics) are returned as new values
        changed = {n: t._elem for n, t in tensors.items() if n not in names and t._elem is not constants[n]}
        return output, changed

    def program_forward(params, constants, rng, arrays):
        setup.count_trace("forward")
        output, changed = run(params, constants, rng, arrays, differentiated=False)
        return flatten_output(output), changed

    def program_train(params, constants, accum, rng, arrays, loss_scale, divisor):
        setup.count_trace("train_forward")

        def objective(params):
            output, changed = run(params, constants, rng, arrays)
            loss = find_loss(output)
            if loss is None:
                raise NoLoss
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
        grads = gradients.accumulated(setup, grads, accum if kind == "accumulate" else None)
        return outputs, changed, grads

    def program_vjp(params, constants, rng, arrays):
        setup.count_trace("vjp_forward")
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
        if setup.plan.stage >= 3 and not trace_reads.concrete((params, arrays)):
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
        jitted = setup.compile.program(program_vjp, kind)
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
            return outputs, changed, (setup.compile.eager_vjp(vjp) if jitted.eager else vjp)
    elif kind != "forward":
        # later in the window the accumulated gradients are donated: the sum replaces them (_gradient)
        jitted = setup.compile.program(program_train, kind,
                                          **({"donate_argnums": (2,)} if kind == "accumulate" else {}))

        def call(params, constants, accum, rng, arrays, scale, divisor):
            try:
                return jitted(params, constants, accum, rng, arrays, scale, np.float32(divisor))
            except NoLoss:
                call.no_loss = True
            # the failed trace's frames (JAX's among them) refer to each other and hold its inputs
            # (the parameters, the accumulated gradients): freed now, once per program, not when
            # Python's cycle collector next runs (a second gradient on the devices until then)
            gc.collect()
            return None
    else:
        jitted = setup.compile.program(program_forward, kind)

        def call(params, constants, rng, arrays):
            return jitted(params, constants, rng, arrays)
    call.no_loss = False
    call.jitted = jitted  # for trace_step, which composes it with the update
    call.loss_index = lambda: loss_leaf[0]  # the loss among the output tensors, once traced
    call.out_spec = out_spec
    call.loss_of = lambda result: [t for t in torch_pytree.tree_leaves(result)
                                   if isinstance(t, torch.Tensor)][loss_leaf[0]]
    return call
