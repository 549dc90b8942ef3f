"""``"spmd": {"scan_layers": true}`` (or ``"stacked"``) on the torchax backend: the model's stack
of identical blocks runs as one ``jax.lax.scan`` over the layers' weights inside the jitted
programs, so that the block is traced once and the programs do not grow with depth.

What qualifies, ``ScannedLayers``, stacked parameters and optimizer groups are shared with the
torch_xla backend (``spmdzero.train.scan_layers``); this module is the loop. When the module, run by
the engine under ``jax.jit`` through torchax, iterates over the stack in training, it gets one
callable (``_JaxLoop``) that scans the block over ``[layers, ...]`` weights: the stacked
parameters themselves under ``"stacked"``, the per-layer ones stacked in the trace under
``true`` (their gradients then come back to each layer through the stack's transpose). The
body calls a meta copy of the first block (``block_template``) with one layer's weights as
torchax tensors (``functional_call``). ``jax.grad`` of the training program differentiates
through the loop: JAX's scan transpose is a second loop over the layers, in reverse.

Random numbers: torchax's dropout draws from its environment's PRNG key and rotates it. The
body runs with a key of its own, carried from one layer to the next in the scan's carry (a
key the loop takes from the environment before it starts), and the environment gets its own
key back after each layer's trace: otherwise it would hold the body's traced key after the
loop. So dropout masks differ from the unrolled blocks' (as on torch_xla), with the same
distribution.

ZeRO-3: each trip gathers its layer's weights (a replicated sharding constraint on the layer's
slice, ``lay_out_gradients``), so the loop all-gathers one layer at a time, in the forward and
again in the backward (the gathered weights are never saved for it, whatever ``spmd.remat``
says), and reduce-scatters its gradient, as FSDP does. Left to the partitioner, the loop moved
activations instead: 2.04x FSDP's minimum traffic on a 2-layer GPT-2.

ZeRO-2: each layer's weight gradient goes through the plan's layouts inside the loop's backward
(``lay_out_gradients``: pinned replicated, then the ZeRO spec without the layer dim), through
an identity whose custom VJP constrains the cotangent, the analogue of torch_xla's
``aot_mark_sharding`` in its scanned backward. The engine constrains each gradient to the
plan's gradient spec after ``jax.grad`` as well (the stacked one too: its layer dim is never
split). Under Shardy (JAX's default partitioner) that constraint alone is carried back into the
loop and the compiled program is the same with or without the one inside. Under GSPMD, which
torch_xla switches JAX to process-wide (``jax_use_shardy_partitioner=False`` when it first
calls JAX: a torch_xla scan in the same process does), it is not: the partitioner all-gathers
each layer's activations over the batch in the backward loop instead of reducing the weight
gradients. With the layouts inside, both partitioners compile each trip to a reduction of its
layer's gradient into the sharded ``[layers, ...]`` accumulator (XLA:CPU: an all-reduce that
the device's slice reads; libtpu: a reduce-scatter; tests/test_scan.py).

Rematerialization (``"spmd": {"remat": ...}``): what the backward loop keeps of each layer from
the forward loop. ``"none"``: whatever JAX saves (every intermediate the backward needs, per
layer: the activations of the whole stack at once). ``"full"``: the layer's inputs only; the
backward runs each layer's forward again (one more forward's compute, activations of one layer
at a time). ``"save_matmuls"``: the results of the matmuls that carry no batch dim in their
contraction (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``, MaxText's
``minimal``-like choice): the elementwise ops are recomputed, the expensive ones kept. The
values are the same under every policy (the dropout key is part of the layer's carry, so a
recomputed layer draws the same masks).
"""

from __future__ import annotations

import functools

import torch

from spmdzero.backends.torchax.lowering import hf_masks
from spmdzero.backends.torchax.lowering import zero3_gather

from spmdzero.train import scan_layers
from spmdzero.train.scan_layers import (ScannedLayers, block_output, block_template, gradient_layouts,
                                        join_arguments, scanned_stacks, split_arguments)


REMAT_POLICIES = ("none", "full", "save_matmuls")


def apply_scan_layers(module: torch.nn.Module, mode: bool | str, remat: str = "none") -> dict:
    """``spmdzero.train.scan_layers.apply_scan_layers`` with ``jax.lax.scan`` as the loop; the
    block's template is made now, from the host module (in the traced program its tensors are
    torchax tensors, which a deep copy would trace); ``remat``: the layers' rematerialization
    (see the module docstring). Returns {per-layer parameter: (stacked name, stacked parameter,
    layer)}, empty unless stacked."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"spmd.remat={remat!r}: one of {', '.join(REMAT_POLICIES)}")
    stacked_from = scan_layers.apply_scan_layers(module, mode, _JaxLoop)
    for _, stack in scanned_stacks(module):
        fns = stack.__dict__.setdefault("_scan_fns", {})
        fns["template"], fns["remat"] = block_template(stack), remat
    return stacked_from


def _rematerialized(one_layer, policy: str, gathers: bool = False):
    """``one_layer`` under ``jax.checkpoint`` with ``policy`` (see the module docstring).
    ``gathers`` (ZeRO-3): the layer gathers its weights; under ``"none"`` they are the one thing
    not saved for the backward (each layer's whole weights, kept for every layer, would be the
    whole model on every device), so the backward gathers them again, as FSDP does."""
    import jax

    if policy == "none" and not gathers:
        return one_layer
    saveable = {"none": zero3_gather.not_saving_gathered_weights,
                "full": jax.checkpoint_policies.nothing_saveable,
                "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[policy]
    # inside a scan nothing can be merged across the loop's iterations: no barrier needed
    return jax.checkpoint(one_layer, policy=saveable, prevent_cse=False)


def lay_out_gradients(module: torch.nn.Module, mesh, plan) -> None:
    """Give each scanned stack the shardings its blocks' weight gradients go through, in turn,
    inside the loop's backward (ZeRO-2; nothing below stage 2): ``mesh`` is the engine's JAX
    mesh, the layouts the plan's (``spmdzero.train.scan_layers.gradient_layouts``)."""
    from jax.sharding import NamedSharding, PartitionSpec

    for stack_name, stack in scanned_stacks(module):
        layouts = gradient_layouts(stack_name, stack, plan)
        stack.gradient_layouts = (mesh, {name: tuple(NamedSharding(mesh, PartitionSpec(*spec)) for spec in specs)
                                         for name, specs in layouts.items()}) if layouts else None
        # ZeRO-3: each trip gathers its layer's weights whole where the block reads them
        stack.__dict__.setdefault("_scan_fns", {})["gather"] = {
            name: tuple(NamedSharding(mesh, PartitionSpec(*spec)) for spec in zero3_gather.layouts(specs))
            for name, specs in layouts.items()} if plan.stage >= 3 else None


@functools.lru_cache(maxsize=None)
def _gradient_layout(shardings: tuple):
    """An identity whose cotangent goes through ``shardings`` in turn: a sharding constraint
    on the gradient alone. (``jax.lax.with_sharding_constraint`` on the weight itself would
    lay out the forward's weight too, and its transpose would constrain the gradient to the
    weight's replicated layout.)"""
    import jax

    @jax.custom_vjp
    def laid_out(weight):
        return weight

    def forward(weight):
        return weight, None

    def backward(_, grad):
        for sharding in shardings:
            grad = jax.lax.with_sharding_constraint(grad, sharding)
        return (grad,)

    laid_out.defvjp(forward, backward)
    return laid_out


class _JaxLoop:
    """The stack's loop (``ScannedLayers.loop``) on the torchax backend."""

    def __init__(self, stack: ScannedLayers):
        self.stack = stack

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        import jax
        import torchax
        from torchax import tensor as ttensor

        stack = self.stack
        blocks = stack.blocks()
        if not isinstance(hidden, ttensor.Tensor):
            # the host module called in training outside the engine's programs: nothing is
            # traced there, so the blocks run one by one, as unscanned
            rebuild = None
            for block in blocks:
                hidden, rebuild = block_output(block, block(hidden, *args, **kwargs))
            return rebuild(hidden)
        env = torchax.default_env()
        spec, static, tensors = split_arguments(blocks[0], args, kwargs)
        cache = stack.__dict__.setdefault("_scan_fns", {})
        if "template" not in cache:  # a stack scanned before this backend's apply_scan_layers
            raise RuntimeError("spmd.scan_layers: this layer stack was not prepared by the torchax backend")
        template = cache["template"]
        weights = env.t2j_iso(stack.layer_weights())  # the stacked parameters, or per-layer ones stacked now
        shared = env.t2j_iso(tensors)  # masks, position ids: the same for every layer (the loop's constants)
        _, layouts = stack.gradient_layouts or (None, {})

        gather = cache.get("gather")
        form: list = []  # how the block hands its output back (block_output), found while tracing

        def one_layer(carry, layer):
            hidden, key = carry
            layer = {name: _gradient_layout(layouts[name])(w) if name in layouts else w for name, w in layer.items()}
            if gather:
                layer = {name: zero3_gather.gathered(gather[name])(w) if name in gather else w
                         for name, w in layer.items()}
            # the layer's dropout draws from the carried key; the environment's own key is
            # back when the block returns (override_property restores it)
            with env.override_property(prng=key):
                args, kwargs = join_arguments(spec, static, hf_masks.carried(tensors, env.j2t_iso(shared)))
                out = torch.func.functional_call(template, env.j2t_iso(layer), (env.j2t_iso(hidden), *args), kwargs,
                                                 strict=True)
                key = env.prng_key
            hidden, rebuild = block_output(template, out)
            form[:] = [rebuild]
            return (env.t2j_iso(hidden), key), None

        # length: a block with no parameters or buffers gives the loop nothing to count
        body = _rematerialized(one_layer, cache.get("remat", "none"), gathers=bool(gather))
        (out, _), _ = jax.lax.scan(body, (env.t2j_iso(hidden), env.get_and_rotate_prng_key()), weights,
                                   length=len(blocks))
        return form[0](env.j2t_iso(out))
