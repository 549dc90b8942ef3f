"""Opt-in ``"spmd": {"scan_layers": true}`` (or ``"stacked"``): a model's stack of identical
blocks traced and compiled once, as an XLA while loop over the stacked block weights
(``torch_xla.experimental.scan``), instead of once per layer.

Tracing and compile time then hardly grow with depth. What qualifies: a model with an
``nn.ModuleList`` of two or more blocks of one class with the same parameter and buffer
names, shapes and dtypes, called one after the other as ``hidden = block(hidden, ...)``
with a tensor as the result, and no per-layer behaviour hidden in Python attributes. That
is transformers' GPT-2 (``transformer.h``) and Llama-style decoders (``model.layers``),
and examples/model.py's TinyGPT (``blocks``). Models whose config alternates layer types
(``config.layer_types``, e.g. sliding-window and full attention) are refused, since the
first block stands for all of them.

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

import copy
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from spmdzero.config.errors import ConfigError
from spmdzero.backends.torch_xla.annotate import constrain

_TENSOR = object()  # marks where a tensor argument goes back among the static ones
QUALIFIES = ("transformers GPT-2 (transformer.h), Llama-style decoders (model.layers), "
             "examples/model.py TinyGPT (blocks)")


def _signature(block: torch.nn.Module) -> tuple:
    tensors = list(block.named_parameters()) + list(block.named_buffers())
    return type(block), tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors)


def find_layer_stack(module: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The model's largest ``nn.ModuleList`` of identical blocks, by parameter count."""
    stacks = [(name, child) for name, child in module.named_modules()
              if isinstance(child, torch.nn.ModuleList) and len(child) >= 2
              and len({_signature(block) for block in child}) == 1]
    if not stacks:
        raise ConfigError(f"spmd.scan_layers: {type(module).__name__} has no nn.ModuleList of two or more identical "
                          f"blocks (one class, the same parameter names and shapes) to scan over. Models that "
                          f"qualify: {QUALIFIES}. Remove spmd.scan_layers for this model.")
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        raise ConfigError(f"spmd.scan_layers: {type(module).__name__} mixes layer types {sorted(set(layer_types))} "
                          "(config.layer_types): its blocks do not compute the same function, so they cannot be "
                          "scanned. Remove spmd.scan_layers for this model.")
    return max(stacks, key=lambda item: sum(p.numel() for p in item[1].parameters()))


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
    """Swap the class of the model's block stack for ``ScannedLayers`` (in place; same
    modules). ``mode="stacked"`` also stacks the blocks' parameters (``stack_parameters``).
    Returns {per-layer parameter: (stacked name, stacked parameter, layer)}, empty unless
    stacked."""
    name, stack = find_layer_stack(module)
    _check_torchax()
    stack.__class__ = ScannedLayers
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):  # transformers: no KV cache in training (a cache cannot be scanned)
        config.use_cache = False
    if mode != "stacked" or stack.stacked:  # (already stacked by an earlier initialize)
        return {}
    return {p: (f"{name}.{local}", stacked, layer) for p, (local, stacked, layer) in stack.stack_parameters().items()}


def scanned_parameters(module: torch.nn.Module) -> frozenset[str]:
    """The names of the parameters that live in a scanned stack (their gradients leave the
    loop already laid out by ``lay_out_gradients``)."""
    return frozenset(f"{stack_name}.{name}" for stack_name, stack in module.named_modules()
                     if isinstance(stack, ScannedLayers) for name, _ in stack.named_parameters())


def restack_groups(params, stacked_from: dict, where: str):
    """``model_parameters`` (tensors, or param group dicts) with the per-layer parameters of
    a stacked stack replaced by the stacked ones (``_restack``); None stays None."""
    if params is None:
        return None
    params = list(params)
    if all(isinstance(group, dict) for group in params):
        lists = _restack([list(group["params"]) for group in params], stacked_from, where)
        return [{**group, "params": new} for group, new in zip(params, lists)]
    return _restack([params], stacked_from, where)[0]


def restack_optimizer(optimizer: torch.optim.Optimizer, stacked_from: dict) -> None:
    """A client optimizer built on the model's per-layer parameters (before ``initialize``)
    updates the stacked ones instead: its param groups are rewritten in place."""
    holding = sorted(stacked_from[p][0] for p in optimizer.state if p in stacked_from and optimizer.state[p])
    if holding:
        raise ConfigError(f"spmd.scan_layers='stacked': the optimizer already holds state for per-layer parameters "
                          f"of {holding[0]!r} (and {len(holding) - 1} more), which are stacked into one parameter "
                          "per name; load optimizer state after initialize (engine.load_checkpoint)")
    lists = _restack([list(group["params"]) for group in optimizer.param_groups], stacked_from, "the optimizer")
    for group, params in zip(optimizer.param_groups, lists):
        group["params"] = params


def _restack(groups: list[list], stacked_from: dict, where: str) -> list[list]:
    """Each per-layer parameter replaced by its stacked parameter, placed where its first
    layer was. All layers of one name must be in one group (they become one tensor with one
    learning rate and weight decay), or none of them."""
    by_id = {id(p): entry for p, entry in stacked_from.items()}
    layers: dict[str, int] = {}
    for name, _, _ in stacked_from.values():
        layers[name] = layers.get(name, 0) + 1
    seen: dict[str, tuple[int, set]] = {}
    out = []
    for index, params in enumerate(groups):
        new = []
        for p in params:
            if id(p) not in by_id:
                new.append(p)
                continue
            name, stacked, layer = by_id[id(p)]
            group, found = seen.setdefault(name, (index, set()))
            if group != index:
                raise ConfigError(f"spmd.scan_layers='stacked': {where} puts layers of {name!r} in param groups "
                                  f"{group} and {index}; its layers are one stacked parameter, which can be in "
                                  "one group only (group by parameter name, not by layer)")
            if not found:
                new.append(stacked)
            found.add(layer)
        out.append(new)
    for name, (group, found) in seen.items():
        if len(found) != layers[name]:
            missing = sorted(set(range(layers[name])) - found)
            raise ConfigError(f"spmd.scan_layers='stacked': {where} has only some layers of {name!r} (layers "
                              f"{missing} are missing); its layers are one stacked parameter, optimized as a whole")
    return out


def stacked_layers(module: torch.nn.Module) -> dict[str, str]:
    """{stacked parameter name (dim 0 the layers): the name of its stack}
    (``transformer.h.attn.c_attn.weight``: ``transformer.h``); its keys are
    ``make_plan(stacked=...)``."""
    return {f"{stack_name}.{name}": stack_name for stack_name, stack in module.named_modules()
            if isinstance(stack, ScannedLayers) for name in stack.stacked_weights()}


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
    for stack_name, stack in module.named_modules():
        if not isinstance(stack, ScannedLayers):
            continue
        layouts = {}
        for name in stack.block_parameter_names():
            planned = plan.get(f"{stack_name}.{name}" if stack.stacked else f"{stack_name}.0.{name}")
            if planned is not None and planned.grad_stages:  # None: frozen, no gradient
                layouts[name] = planned.layer_grad_layouts if stack.stacked else planned.grad_layouts
        stack.gradient_layouts = (mesh, layouts) if layouts else None
        stack.__dict__.pop("_scan_fns", None)  # traced with the previous layouts


class ScannedLayers(torch.nn.ModuleList):
    """An ``nn.ModuleList`` whose iteration, in training, yields one callable running every
    block through ``torch_xla.experimental.scan``. Its blocks are the children named by
    index; with stacked parameters it also has ``StackedParameters`` children (by block
    submodule name), which ``len``, iteration and indexing leave out."""

    gradient_layouts = None  # (mesh, {block parameter name: partition specs in turn}), see lay_out_gradients

    @property
    def stacked(self) -> bool:
        """Whether the blocks' parameters are stacked (``stack_parameters``)."""
        return bool(self.stacked_weights())

    def stacked_weights(self) -> dict[str, torch.Tensor]:
        """{block parameter name: [layers, ...] tensor}: the stacked parameters, or for a
        slice of the list, their slices."""
        if "_stacked_slices" in self.__dict__:
            return self.__dict__["_stacked_slices"]
        weights = dict(self._parameters)
        for key, holder in self._modules.items():
            if isinstance(holder, StackedParameters):
                weights.update(holder.named_parameters(prefix=key))
        return weights

    def block_parameter_names(self) -> list[str]:
        """The parameter names of one block (``attn.c_attn.weight``)."""
        if self.stacked:
            return list(self.stacked_weights())
        return [name for name, _ in _blocks(self)[0].named_parameters()]

    def stack_parameters(self) -> dict:
        """Make each block parameter name one parameter ``[layers, ...]`` of this list, under
        the block's name for it (``transformer.h.attn.c_attn.weight``: ``StackedParameters``
        children mirror the block's submodules), and take the per-layer ones out of the
        blocks. The step then has one tensor per name to update, lay out and gather, not one
        per layer and name. Calling a block (eval, generation, ``stack[i](...)``) lends it
        its layer's slices for the call (``_lend_layer``). Returns {per-layer parameter:
        (name, stacked parameter, layer)}."""
        blocks = _blocks(self)
        names = [name for name, _ in blocks[0].named_parameters()]
        owned = [id(_tensor(block, name)) for block in blocks for name in names]
        if len(set(owned)) != len(owned):
            raise ConfigError("spmd.scan_layers='stacked': the blocks of this model share parameters, which "
                              "cannot be stacked one per layer; use spmd.scan_layers=true")
        replaced = {}
        for name in names:
            per_layer = [_tensor(block, name) for block in blocks]
            stacked = torch.nn.Parameter(torch.stack([p.detach() for p in per_layer]),
                                         requires_grad=per_layer[0].requires_grad)
            *path, attr = name.split(".")
            holder = self
            for part in path:
                if part not in holder._modules:
                    holder.add_module(part, StackedParameters())
                holder = holder._modules[part]
            holder.register_parameter(attr, stacked)
            replaced.update({p: (name, stacked, layer) for layer, p in enumerate(per_layer)})
            for block in blocks:
                owner, attr = _owner(block, name)
                del owner._parameters[attr]
        for layer, block in enumerate(blocks):
            block.__dict__["_stacked_layer"] = (self, layer)
            block.register_forward_pre_hook(_lend_layer)
            block.register_forward_hook(_return_layer, always_call=True)
        return replaced

    def __len__(self) -> int:
        return sum(1 for key in self._modules if key.isdigit())

    # ModuleList's repr iterates over the list, which in training is the scan
    __repr__ = torch.nn.Module.__repr__

    def __iter__(self):
        if not self.training:
            return iter(_blocks(self))
        return iter([_ScanCall(self)])

    def __getitem__(self, idx):
        """A slice (Llama's ``self.layers[: config.num_hidden_layers]``, every forward) is a new
        list: it keeps the train/eval mode, the gradient layouts, the traced functions
        (otherwise each step would trace the block again, without the layouts) and the
        stacked parameters' slices."""
        if not isinstance(idx, slice):
            return super().__getitem__(idx)
        item = ScannedLayers(_blocks(self)[idx])
        item.training, item.gradient_layouts = self.training, self.gradient_layouts
        item.__dict__["_scan_fns"] = self.__dict__.setdefault("_scan_fns", {})
        if self.stacked:
            whole = idx.indices(len(self)) == (0, len(self), 1)
            item.__dict__["_stacked_slices"] = {name: w if whole else w[idx]
                                                for name, w in self.stacked_weights().items()}
        return item


class StackedParameters(torch.nn.Module):
    """Holds stacked parameters under a block submodule's name (``transformer.h.attn``), so
    that their names are a block's names with the layer index left out, and
    ``get_parameter``, attribute access and strict ``load_state_dict`` work as for any
    module. Not callable: the blocks compute, with slices lent for the call."""

    def extra_repr(self) -> str:
        return ", ".join(f"{name}: {list(p.shape)}" for name, p in self._parameters.items())


class _ScanCall:
    def __init__(self, stack: ScannedLayers):
        self.stack = stack

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        from functorch.compile import min_cut_rematerialization_partition
        from torch_xla.experimental.scan import scan

        blocks = _blocks(self.stack)
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        static = tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
        for leaf in static:
            if leaf is not _TENSOR and leaf is not None and not isinstance(leaf, (bool, int, float, str)):
                raise TypeError(f"spmd.scan_layers: a {type(blocks[0]).__name__} block is called with a "
                                f"{type(leaf).__name__} argument; only tensors and plain numbers can be passed "
                                "to scanned blocks (is a KV cache in use while training?)")
        weights = dict(self.stack.stacked_weights())  # the parameters themselves, no copy
        for name, _ in list(blocks[0].named_parameters()) + list(blocks[0].named_buffers()):
            weights[name] = torch.stack([_tensor(block, name) for block in blocks])
        if self.stack.gradient_layouts:
            weights = _replicated_inputs(weights, self.stack.gradient_layouts[0])
        shared = [t.expand(len(blocks), *t.shape) for t in tensors]
        fn = _layer_fn(self.stack, blocks[0], spec, static)
        import torch._functorch.config as functorch_config

        # views (a weight's transpose) are recomputed in the backward, not saved: saved, the
        # loop would stack a copy of them every trip
        with functorch_config.patch(recompute_views=True):
            out, _ = scan(fn, hidden, (weights, shared), is_fn_pure=True,
                          partition_fn=min_cut_rematerialization_partition)
        return out


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


def _blocks(stack: ScannedLayers) -> list[torch.nn.Module]:
    return [block for key, block in stack._modules.items() if key.isdigit()]


def _owner(block: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (block.get_submodule(owner) if owner else block), attr


def _tensor(block: torch.nn.Module, name: str) -> torch.Tensor:
    owner, attr = _owner(block, name)
    return getattr(owner, attr)


def _lend_layer(block: torch.nn.Module, args) -> None:
    """Forward pre-hook of a block whose parameters are stacked: its layer's slices, for the call."""
    stack, layer = block.__dict__["_stacked_layer"]
    for name, stacked in stack.stacked_weights().items():
        owner, attr = _owner(block, name)
        owner._parameters[attr] = stacked[layer]


def _return_layer(block: torch.nn.Module, args, output) -> None:
    stack, _ = block.__dict__["_stacked_layer"]
    for name in stack.stacked_weights():
        owner, attr = _owner(block, name)
        owner._parameters.pop(attr, None)


def _layer_fn(stack: ScannedLayers, first: torch.nn.Module, spec, static: tuple):
    """One block's computation for ``scan``: the same function object for the same call
    structure, so that torch_xla's scan caches its traced graph across steps."""
    cache: dict[Any, Any] = stack.__dict__.setdefault("_scan_fns", {})
    key = (repr(spec), static)
    if key in cache:
        return cache[key]
    # Weights come from the stacked tensors. A block whose parameters are stacked keeps the
    # list it belongs to (not copied) and gets meta placeholders instead of the lending hooks.
    owner_stack = first.__dict__.get("_stacked_layer", (None,))[0]
    template = copy.deepcopy(first, memo={id(owner_stack): owner_stack}).to("meta")
    if owner_stack is not None:
        template.__dict__.pop("_stacked_layer")
        for hooks in (template._forward_pre_hooks, template._forward_hooks):
            for handle in [handle for handle, hook in hooks.items() if hook in (_lend_layer, _return_layer)]:
                del hooks[handle]
        for name, stacked in owner_stack.stacked_weights().items():
            owner, attr = _owner(template, name)
            owner._parameters[attr] = torch.nn.Parameter(torch.empty(stacked.shape[1:], dtype=stacked.dtype,
                                                                     device="meta"), stacked.requires_grad)
    mesh, layouts = stack.gradient_layouts or (None, {})

    def one_layer(carry, xs):
        weights, shared = xs
        weights = {name: _GradientLayout.apply(w, mesh, layouts[name]) if name in layouts else w
                   for name, w in weights.items()}
        shared_iter = iter(shared)
        leaves = [next(shared_iter) if leaf is _TENSOR else leaf for leaf in static]
        args, kwargs = tree_unflatten(leaves, spec)
        with _FloatMaskDropout():
            out = torch.func.functional_call(template, weights, (carry, *args), kwargs, strict=True)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"spmd.scan_layers: {type(first).__name__} returns {type(out).__name__}; scanned blocks "
                            "must return the hidden state tensor")
        return out, None

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
