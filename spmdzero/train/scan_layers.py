"""``"spmd": {"scan_layers": true}`` (or ``"stacked"``), what both backends share: which models
qualify, the ``ScannedLayers`` list whose iteration in training yields one callable running
every block, stacked parameters and the optimizer groups rewritten to them, the call's
arguments split into tensors and static values, and the template block the loop body calls.
How the loop runs is the backend's: ``torch_xla.experimental.scan``
(``spmdzero.backends.torch_xla.scan``) or ``jax.lax.scan`` (``spmdzero.backends.torchax.engine.scan``),
given to ``apply_scan_layers`` as ``loop``.

What qualifies: a model with an ``nn.ModuleList`` of two or more blocks of one class with the
same parameter and buffer names, shapes and dtypes, called one after the other as
``hidden = block(hidden, ...)`` with a tensor as the result, and no per-layer behaviour hidden
in Python attributes. That is transformers' GPT-2 (``transformer.h``) and Llama-style decoders
(``model.layers``), and examples/model.py's TinyGPT (``blocks``). Models whose config
alternates layer types (``config.layer_types``, e.g. sliding-window and full attention) are
refused, since the first block stands for all of them.

With ``true`` the blocks stay where they are: parameter names, the sharding plan and
checkpoints are unchanged, and the loop stacks the per-layer weights every step. Out of
training mode (eval, generation with a KV cache) the blocks run one by one as before. A
transformers model's ``config.use_cache`` is turned off (a KV cache is not needed to train and
cannot be scanned; ``generate`` still uses one). ``"stacked"`` makes each block parameter name
one parameter ``[layers, ...]`` (``ScannedLayers.stack_parameters``), which the loop scans
directly and the engine handles as one tensor; names change (``transformer.h.attn.c_attn.weight``),
and with them checkpoints; a client optimizer built on the per-layer parameters is rewritten
(``restack_optimizer``).

Why here and not in a backend: a checkpoint saved with stacked layers on one backend loads on
the other, and an optimizer or plan over stacked names must mean the same on both, so the
names, the stacking and the optimizer groups have one definition.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from spmdzero.config.errors import ConfigError

TENSOR = object()  # marks where a tensor argument goes back among the static ones
QUALIFIES = ("transformers GPT-2 (transformer.h), Llama-style decoders (model.layers), "
             "examples/model.py TinyGPT (blocks)")

# A backend's loop: called with the stack when the model iterates over it in training, it
# returns the one callable ``(hidden, *args, **kwargs) -> hidden`` that runs every block.
Loop = Callable[["ScannedLayers"], Callable[..., torch.Tensor]]


def _signature(block: torch.nn.Module) -> tuple:
    tensors = list(block.named_parameters()) + list(block.named_buffers())
    return type(block), tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors)


def find_layer_stack(module: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The model's largest ``nn.ModuleList`` of identical blocks, by parameter count."""
    # a stack scanned by an earlier initialize is found again (its iteration in training is the loop)
    stacks = [(name, child) for name, child in module.named_modules()
              if isinstance(child, torch.nn.ModuleList) and len(child) >= 2
              and len({_signature(block) for block in _members(child)}) == 1]
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


def _members(stack: torch.nn.ModuleList) -> list[torch.nn.Module]:
    return stack.blocks() if isinstance(stack, ScannedLayers) else list(stack)


def apply_scan_layers(module: torch.nn.Module, mode: bool | str, loop: Loop) -> dict:
    """Swap the class of the model's block stack for ``ScannedLayers`` (in place; same
    modules), iterated in training through the backend's ``loop``. ``mode="stacked"`` also
    stacks the blocks' parameters (``stack_parameters``). Returns {per-layer parameter:
    (stacked name, stacked parameter, layer)}, empty unless stacked."""
    name, stack = find_layer_stack(module)
    stack.__class__ = ScannedLayers
    stack.loop = loop
    stack.__dict__.pop("_scan_fns", None)  # another backend's traced functions (a model initialized again)
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):  # transformers: no KV cache in training (a cache cannot be scanned)
        config.use_cache = False
    if mode != "stacked" or stack.stacked:  # (already stacked by an earlier initialize)
        return {}
    return {p: (f"{name}.{local}", stacked, layer) for p, (local, stacked, layer) in stack.stack_parameters().items()}


def scanned_stacks(module: torch.nn.Module):
    """(name, stack) of each ``ScannedLayers`` in the module."""
    return [(name, stack) for name, stack in module.named_modules() if isinstance(stack, ScannedLayers)]


def scanned_parameters(module: torch.nn.Module) -> frozenset[str]:
    """The names of the parameters that live in a scanned stack (their gradients leave the
    loop already laid out by the backend's ``lay_out_gradients``)."""
    return frozenset(f"{stack_name}.{name}" for stack_name, stack in scanned_stacks(module)
                     for name, _ in stack.named_parameters())


def gradient_layouts(stack_name: str, stack: "ScannedLayers", plan) -> dict:
    """{block parameter name: the partition specs one layer's weight gradient goes through in
    turn inside the loop's backward}: the plan's ``grad_layouts`` (pinned replicated, then the
    ZeRO spec; or two fsdp stages), per layer for a stacked parameter (``layer_grad_layouts``).
    Empty below ZeRO-2 and for frozen or unsplit parameters."""
    layouts = {}
    for name in stack.block_parameter_names():
        planned = plan.get(f"{stack_name}.{name}" if stack.stacked else f"{stack_name}.0.{name}")
        if planned is not None and planned.grad_stages:  # None: frozen, no gradient
            layouts[name] = planned.layer_grad_layouts if stack.stacked else planned.grad_layouts
    return layouts


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


def restack_client(model_parameters, optimizer, stacked_from: dict):
    """The client's ``model_parameters`` and optimizer (a torch one) moved to the stacked
    parameters of ``stacked_from``; returns the new ``model_parameters``."""
    if not stacked_from:
        return model_parameters
    model_parameters = restack_groups(model_parameters, stacked_from, "model_parameters")
    if isinstance(optimizer, torch.optim.Optimizer):
        restack_optimizer(optimizer, stacked_from)
    return model_parameters


def scan_model(module: torch.nn.Module, convert: Callable[[torch.nn.Module], dict], model_parameters,
               optimizer):
    """``spmd.scan_layers`` as one model transform: the block stack converted in place by the
    backend's ``convert`` (its loop: ``jax.lax.scan`` or torch_xla's scan; it returns
    ``apply_scan_layers``'s mapping), and the client's ``model_parameters`` and torch optimizer
    moved to the stacked parameters. Returns the new ``model_parameters``. What checkpoints and
    state dicts need afterwards is ``stacked_layers(module)`` (``io/restack.py`` maps the keys)."""
    if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
        model_parameters = list(model_parameters)  # a generator over the module, before stacking
    return restack_client(model_parameters, optimizer, convert(module))


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
    return {f"{stack_name}.{name}": stack_name for stack_name, stack in scanned_stacks(module)
            for name in stack.stacked_weights()}


class ScannedLayers(torch.nn.ModuleList):
    """An ``nn.ModuleList`` whose iteration, in training, yields one callable running every
    block (its ``loop``'s). Its blocks are the children named by index; with stacked
    parameters it also has ``StackedParameters`` children (by block submodule name), which
    ``len``, iteration and indexing leave out."""

    loop: Optional[Loop] = None  # the backend's (apply_scan_layers)
    gradient_layouts = None  # (mesh, {block parameter name: layouts in turn}): the backend's lay_out_gradients

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

    def layer_weights(self) -> dict[str, torch.Tensor]:
        """{block parameter or buffer name: [layers, ...] tensor}: what the loop scans over.
        The stacked parameters themselves (no copy), and per-layer parameters and buffers
        stacked now (in the step's trace, so that their gradients reach the per-layer ones)."""
        blocks = self.blocks()
        weights = dict(self.stacked_weights())
        for name, _ in list(blocks[0].named_parameters()) + list(blocks[0].named_buffers()):
            weights[name] = torch.stack([tensor_of(block, name) for block in blocks])
        return weights

    def blocks(self) -> list[torch.nn.Module]:
        return [block for key, block in self._modules.items() if key.isdigit()]

    def block_parameter_names(self) -> list[str]:
        """The parameter names of one block (``attn.c_attn.weight``)."""
        if self.stacked:
            return list(self.stacked_weights())
        return [name for name, _ in self.blocks()[0].named_parameters()]

    def stack_parameters(self) -> dict:
        """Make each block parameter name one parameter ``[layers, ...]`` of this list, under
        the block's name for it (``transformer.h.attn.c_attn.weight``: ``StackedParameters``
        children mirror the block's submodules), and take the per-layer ones out of the
        blocks. The step then has one tensor per name to update, lay out and gather, not one
        per layer and name. Calling a block (eval, generation, ``stack[i](...)``) lends it
        its layer's slices for the call (``_lend_layer``). Returns {per-layer parameter:
        (name, stacked parameter, layer)}."""
        blocks = self.blocks()
        names = [name for name, _ in blocks[0].named_parameters()]
        owned = [id(tensor_of(block, name)) for block in blocks for name in names]
        if len(set(owned)) != len(owned):
            raise ConfigError("spmd.scan_layers='stacked': the blocks of this model share parameters, which "
                              "cannot be stacked one per layer; use spmd.scan_layers=true")
        replaced = {}
        for name in names:
            per_layer = [tensor_of(block, name) for block in blocks]
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
                owner, attr = owner_of(block, name)
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
            return iter(self.blocks())
        if self.loop is None:
            raise RuntimeError("spmd.scan_layers: this layer stack was made by apply_scan_layers without a loop")
        return iter([self.loop(self)])

    def __getitem__(self, idx):
        """A slice (Llama's ``self.layers[: config.num_hidden_layers]``, every forward) is a new
        list: it keeps the train/eval mode, the loop, the gradient layouts, the traced functions
        (otherwise each step would trace the block again, without the layouts) and the
        stacked parameters' slices."""
        if not isinstance(idx, slice):
            return super().__getitem__(idx)
        item = ScannedLayers(self.blocks()[idx])
        item.training, item.loop, item.gradient_layouts = self.training, self.loop, self.gradient_layouts
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


def owner_of(block: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (block.get_submodule(owner) if owner else block), attr


def tensor_of(block: torch.nn.Module, name: str) -> torch.Tensor:
    owner, attr = owner_of(block, name)
    return getattr(owner, attr)


def _lend_layer(block: torch.nn.Module, args) -> None:
    """Forward pre-hook of a block whose parameters are stacked: its layer's slices, for the call."""
    stack, layer = block.__dict__["_stacked_layer"]
    for name, stacked in stack.stacked_weights().items():
        owner, attr = owner_of(block, name)
        owner._parameters[attr] = stacked[layer]


def _return_layer(block: torch.nn.Module, args, output) -> None:
    stack, _ = block.__dict__["_stacked_layer"]
    for name in stack.stacked_weights():
        owner, attr = owner_of(block, name)
        owner._parameters.pop(attr, None)


def split_arguments(block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[Any, tuple, list]:
    """A block call's arguments after the hidden state as (pytree spec, static leaves with
    ``TENSOR`` where a tensor goes, the tensors): the tensors are the loop's inputs, the rest
    is part of the traced function. Anything but tensors and plain values is refused (a KV
    cache cannot go through the loop)."""
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    static = tuple(TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    for leaf in static:
        if leaf is not TENSOR and leaf is not None and not isinstance(leaf, (bool, int, float, str)):
            raise TypeError(f"spmd.scan_layers: a {type(block).__name__} block is called with a "
                            f"{type(leaf).__name__} argument; only tensors and plain numbers can be passed "
                            "to scanned blocks (is a KV cache in use while training?)")
    return spec, static, tensors


def join_arguments(spec, static: tuple, tensors) -> tuple[tuple, dict]:
    """``split_arguments`` undone, with ``tensors`` (the loop's view of them) in place."""
    tensors = iter(tensors)
    leaves = [next(tensors) if leaf is TENSOR else leaf for leaf in static]
    return tree_unflatten(leaves, spec)


def block_template(stack: ScannedLayers) -> torch.nn.Module:
    """A copy of the first block on the meta device, for the loop body to call with one
    layer's weights (``functional_call``, strict: every parameter and buffer given). A block
    whose parameters are stacked keeps the list it belongs to (not copied) and gets meta
    placeholders instead of the lending hooks."""
    first = stack.blocks()[0]
    owner_stack = first.__dict__.get("_stacked_layer", (None,))[0]
    template = copy.deepcopy(first, memo={id(owner_stack): owner_stack}).to("meta")
    if owner_stack is not None:
        template.__dict__.pop("_stacked_layer")
        for hooks in (template._forward_pre_hooks, template._forward_hooks):
            for handle in [handle for handle, hook in hooks.items() if hook in (_lend_layer, _return_layer)]:
                del hooks[handle]
        for name, stacked in owner_stack.stacked_weights().items():
            owner, attr = owner_of(template, name)
            owner._parameters[attr] = torch.nn.Parameter(torch.empty(stacked.shape[1:], dtype=stacked.dtype,
                                                                     device="meta"), stacked.requires_grad)
    return template


def block_output(block: torch.nn.Module, out) -> tuple[torch.Tensor, Callable]:
    """A block's hidden state, and how to hand the loop's result back in the block's own form:
    the tensor itself, or a tuple (list) of it and Nones. transformers 4.x's GPT-2, OPT, Phi and
    GPT-NeoX blocks return ``(hidden_states,)``, and their model takes ``outputs[0]``. Anything
    else leaving a block (attention weights, a KV cache) cannot leave the loop."""
    if isinstance(out, torch.Tensor):
        return out, lambda hidden: hidden
    if (isinstance(out, (tuple, list)) and not hasattr(out, "_fields") and out and isinstance(out[0], torch.Tensor)
            and all(item is None for item in out[1:])):
        kind, extra = type(out), len(out) - 1
        return out[0], lambda hidden: kind((hidden,) + (None,) * extra)
    raise TypeError(f"spmd.scan_layers: {type(block).__name__} returns {type(out).__name__}"
                    f"{' with more than the hidden state' if isinstance(out, (tuple, list)) else ''}; scanned "
                    "blocks must return the hidden state tensor, or a tuple of it and Nones (turn "
                    "output_attentions and use_cache off in training)")
