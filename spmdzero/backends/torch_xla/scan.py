"""Opt-in ``"spmd": {"scan_layers": true}`` (or ``"stacked"``): a model's stack of identical
blocks traced and compiled once, as an XLA while loop over the stacked block weights
(``torch_xla.experimental.scan``), instead of once per layer.

Tracing and compile time then hardly grow with depth. Which models qualify (``find_layer_stack``:
an ``nn.ModuleList`` of two or more identical blocks called one after the other as
``hidden = block(hidden, ...)``), ``ScannedLayers``, stacked parameters and the optimizer
groups over them are backend-independent (``spmdzero.train.scan_layers``, shared with the
torchax backend's ``jax.lax.scan`` loop, ``spmdzero.backends.torchax.engine.scan``); this module is
torch_xla's loop, its gradient layouts and its dropout.

The blocks stay where they are: parameter names, the sharding plan and checkpoints are
unchanged. Only iterating over the stack changes: in training it yields a single callable
that runs every block. Out of training mode (eval, generation with a KV cache) the blocks
run one by one as before. A transformers model's ``config.use_cache`` is turned off (a KV
cache is not needed to train and cannot be scanned; ``generate`` still uses one). Under
ZeRO-2 each block's weight gradient gets the plan's layout inside the loop
(``lay_out_gradients``), so that the TPU compiler reduce-scatters it there.

With ``true`` the per-layer weights are still stacked before the loop every step, and the
stacked gradient sliced, laid out, updated and all-gathered per layer and name after it, so
the step program still grows with depth (1,046 fusions at 12 GPT-2 layers against 318 at 2).
``"stacked"`` makes each block parameter name one parameter ``[layers, ...]``
(``ScannedLayers.stack_parameters``), which the loop scans directly and the engine handles
as one tensor: the step program is the same size at any depth (238 fusions at 2 and 12;
docs/benchmarks.md). Names change (``transformer.h.attn.c_attn.weight``), and with them
checkpoints; a client optimizer built on the per-layer parameters is rewritten
(``restack_optimizer``).

What the loop keeps for the backward is chosen by AOTAutograd's min-cut partitioner, which
recomputes cheap elementwise results in the backward instead of stacking them over the
layers: the default partitioner kept every intermediate the backward reads (4.4x the
unrolled step's temporaries on a small GPT-2, 1.2x with min-cut; docs/aot.md).

Limits: the scanned blocks draw random numbers differently from the loop (dropout masks
differ, and dropout is applied with a mask of the activations' dtype, attention's included,
because torch_xla 2.9's scan cannot carry torch's boolean masks; turn dropout off for
bitwise comparisons), and extra tensor inputs (masks,
position ids) are passed to every block unchanged.
"""

from __future__ import annotations

import torch

from spmdzero.config.errors import ConfigError
from spmdzero.backends.torch_xla.annotate import constrain
from spmdzero.train import scan_layers
from spmdzero.train.scan_layers import (ScannedLayers, block_template, block_output, find_layer_stack,
                                        gradient_layouts, join_arguments, scanned_stacks, split_arguments)


def _check_torchax() -> None:
    """torch_xla's scan backward calls JAX through torchax (``xs.shard_as`` -> ``call_jax``).
    torch_xla 2.9's wheel carries an older copy of the ``torchax`` package that imports flax at
    the top; whichever of torch_xla and torchax was installed last owns the files. Refuse
    here, with the fix, instead of failing in the first backward."""
    from torch_xla._internal.jax_workarounds import maybe_get_torchax

    if maybe_get_torchax() is None:
        raise ConfigError("spmd.scan_layers needs the torchax package importable (torch_xla's scan backward calls JAX "
                          "through it), and it is not: torch_xla 2.9's wheel installs an older torchax copy that "
                          "needs flax. Install torchax after torch_xla: "
                          "pip install --no-deps --force-reinstall torchax==0.0.13")


def apply_scan_layers(module: torch.nn.Module, mode: bool | str = True) -> dict:
    """``spmdzero.train.scan_layers.apply_scan_layers`` with torch_xla's scan as the loop.
    Returns {per-layer parameter: (stacked name, stacked parameter, layer)}, empty unless
    stacked."""
    find_layer_stack(module)  # the model's refusal first, then the installation's
    _check_torchax()
    return scan_layers.apply_scan_layers(module, mode, _ScanCall)


def lay_out_gradients(module: torch.nn.Module, mesh, plan) -> None:
    """Give each scanned stack the layouts its blocks' weight gradients go through inside the
    loop (ZeRO-2; nothing below stage 2), as ``engine.backward`` lays out an unrolled
    model's: pinned replicated, then the ZeRO spec, or, with two fsdp axes, one stage after
    the other.

    Why inside: torch_xla's scan backward makes each iteration's weight gradient "shard
    alike" the forward's weight slice, which ZeRO keeps replicated, so without a layout of
    its own the gradient is all-reduced in every loop trip and only sliced after the loop.
    Laid out in the loop, the TPU compiler reduce-scatters it where it is computed. The
    replicated pin keeps the ZeRO layout off the weight-gradient matmul itself: there the
    partitioner would rather move the block's activations (all-to-all, all-gather of the
    token rows) than reduce the gradient. With two fsdp axes there is no pin, as in
    ``engine.backward``: libtpu does not reduce-scatter a pinned gradient over 16 chips."""
    for stack_name, stack in scanned_stacks(module):
        layouts = gradient_layouts(stack_name, stack, plan)
        stack.gradient_layouts = (mesh, layouts) if layouts else None
        stack.__dict__.pop("_scan_fns", None)  # traced with the previous layouts


class _ScanCall:
    """The stack's loop (``ScannedLayers.loop``): one ``torch_xla.experimental.scan`` over
    the layers' weights."""

    def __init__(self, stack: ScannedLayers):
        self.stack = stack

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        from functorch.compile import min_cut_rematerialization_partition
        from torch_xla.experimental.scan import scan

        blocks = self.stack.blocks()
        spec, static, tensors = split_arguments(blocks[0], args, kwargs)
        weights = self.stack.layer_weights()  # stacked parameters themselves, no copy
        if self.stack.gradient_layouts:
            weights = _replicated_inputs(weights, self.stack.gradient_layouts[0])
        shared = [t.expand(len(blocks), *t.shape) for t in tensors]
        fn = _layer_fn(self.stack, spec, static)
        import torch._functorch.config as functorch_config

        # views (a weight's transpose) are recomputed in the backward, not saved: saved, the
        # loop would stack a copy of them every trip
        with functorch_config.patch(recompute_views=True):
            out, _ = scan(fn, hidden, (weights, shared), is_fn_pure=True,
                          partition_fn=min_cut_rematerialization_partition)
        return fn.rebuild(out)


def _replicated_inputs(weights: dict, mesh) -> dict:
    """The weights behind a replicated sharding constraint, for the loop to read.

    The backward reads each layer's weights straight from these stacks (the partition keeps
    the weights themselves, not views of them such as a transpose, which the loop would copy
    into a second stack: a copy of every weight, 8.9 GiB per chip for a 7B on v5p-64). But
    torch_xla's scan backward makes each layer's weight gradient "shard alike" the first
    layer's weight slice; with the ZeRO layout on the gradient that pulled the stacks
    themselves to the sharded layout, and the backward all-gathered each layer's weights
    again (1.42x the minimum traffic on a small Llama). The constraint keeps them replicated,
    as the plan has the parameters."""
    return {name: constrain(w, mesh, (None,) * w.dim()) for name, w in weights.items()}


def _layer_fn(stack: ScannedLayers, spec, static: tuple):
    """One block's computation for ``scan``: the same function object for the same call
    structure, so that torch_xla's scan caches its traced graph across steps."""
    cache: dict = stack.__dict__.setdefault("_scan_fns", {})
    key = (repr(spec), static)
    if key in cache:
        return cache[key]
    template = block_template(stack)
    mesh, layouts = stack.gradient_layouts or (None, {})

    def one_layer(carry, xs):
        weights, shared = xs
        weights = {name: _GradientLayout.apply(w, mesh, layouts[name]) if name in layouts else w
                   for name, w in weights.items()}
        args, kwargs = join_arguments(spec, static, shared)
        with _FloatMaskDropout():
            out = torch.func.functional_call(template, weights, (carry, *args), kwargs, strict=True)
        hidden, one_layer.rebuild = block_output(template, out)
        return hidden, None

    one_layer.rebuild = None  # how the block hands its output back (block_output), set by the trace
    cache[key] = one_layer
    return one_layer


class _GradientLayout(torch.autograd.Function):
    """Identity on a block's weight (the weight itself, so that the partition keeps it for the
    backward as the loop's input, not as a copy); its gradient goes through ``layouts`` in turn.
    AOTAutograd traces this backward into the scanned graph (torch_xla's
    ``aot_mark_sharding`` op), so the layouts land on each iteration's gradient inside the
    loop."""

    @staticmethod
    def forward(ctx, weight, mesh, layouts):
        ctx.mesh, ctx.layouts = mesh, layouts
        return weight

    @staticmethod
    def backward(ctx, grad):
        for spec in ctx.layouts:
            grad = torch.ops.xla.aot_mark_sharding(grad, str(ctx.mesh), str(tuple(spec)))
        return grad, None, None


class _FloatMaskDropout(torch.overrides.TorchFunctionMode):
    """Dropout inside a scanned block with a mask of the input's dtype. torch's dropout saves
    a boolean mask for its backward, and torch_xla 2.9's scan stacks such a saved boolean
    into a buffer of another element type (the lowering fails: PRED vs F32). Same
    distribution, other random draws (see the module's Limits)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.functional.dropout, torch.dropout):
            x, p, training = _dropout_args(func, args, kwargs)
            if training and p > 0:
                return _float_mask_dropout(x, p)
        if func is torch.nn.functional.scaled_dot_product_attention and (
                kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) > 0):
            return _attention_with_float_mask_dropout(*args, **kwargs)
        return func(*args, **kwargs)


def _float_mask_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1:
        return x * 0
    keep = (torch.rand_like(x) >= p).to(x.dtype)
    return x * keep * (1.0 / (1.0 - p))


def _attention_with_float_mask_dropout(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                       scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` written out (its fused kernels drop out with a
    boolean mask), as torch documents its math."""
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scale = 1.0 / query.size(-1) ** 0.5 if scale is None else scale
    scores = query @ key.transpose(-2, -1) * scale
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return _float_mask_dropout(torch.softmax(scores, dim=-1), dropout_p) @ value


def _dropout_args(func, args, kwargs) -> tuple:
    """(input, p, training) of ``F.dropout(input, p=0.5, training=True, inplace=False)`` or
    ``torch.dropout(input, p, train)``."""
    names = ("input", "p", "training") if func is torch.nn.functional.dropout else ("input", "p", "train")
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    return values["input"], float(values.get("p", 0.5)), bool(values.get(names[2], True))
