"""Activation checkpointing on the torchax backend: ``torch.utils.checkpoint.checkpoint`` runs its
function under ``jax.checkpoint`` while the engine traces the module.

The backend traces the module under ``jax.jit`` and differentiates it with ``jax.grad``; torch's
autograd never runs, so torch's checkpoint (which works by saved-tensor hooks or a reentrant
``autograd.Function``) just called its function and every activation stayed live until the
backward. ``rematerializing()`` turns each call of it, during the trace, into ``jax.checkpoint``
(remat) of the function: the compiled backward keeps only the region's inputs and recomputes the
rest, as torch's checkpoint does. Hugging Face's ``gradient_checkpointing_enable()`` (and
``activation_checkpointing_enable()``) checkpoints each block through it, so they rematerialize.

Catching every binding: callers hold the function in many ways. transformers binds
``functools.partial(checkpoint, **kwargs)`` when checkpointing is enabled, user code does ``from
torch.utils.checkpoint import checkpoint`` at import. All of them hold the same object, torch's
``_disable_dynamo`` wrapper, which on each call looks up ``__dynamo_disable`` on the function it
wraps (a cache of ``torch._dynamo.disable(checkpoint)``) and calls that. Setting that attribute
for the duration of the trace reaches every binding without replacing any; the previous value is
put back when the trace ends. ``hook_available()`` checks that torch still has that shape (a
newer torch may not): the engine says once that checkpointing is not honoured if it has not, and
``tests/test_remat.py`` counts the remat regions in a traced program, so a change underneath fails.

What a region sees and returns: its tensor arguments (positional and keyword, in any nesting)
become the inputs of the remat region; the tensors it closes over (the module's traced
parameters) are inputs of it too (``jax.checkpoint`` lifts closed-over tracers), so gradients
reach them. Its output may nest tensors with other values (Hugging Face layers return tuples
holding None): the tensors are the region's outputs, the rest is kept as traced.

Random numbers: torchax's dropout draws from the environment's PRNG key and rotates it. Rotated
inside the region, the environment would keep a tracer of the region's trace. The key is passed
in and the rotated key out: the forward and its recomputation make the same draws, the same as
without checkpointing, and the environment's key advances past the region.

torch's arguments: ``use_reentrant`` True and False (and None, torch's default of True) are the
same here: one rematerialization, with torch's refusal of keyword arguments to the function under
the reentrant variant. ``preserve_rng_state=False`` is honoured as True (the recomputation always
makes the forward's draws, which is what torch's True promises). ``context_fn`` (selective
checkpointing policies, ``create_selective_checkpoint_contexts``) is ignored, said once: the
whole region is recomputed. ``determinism_check``, ``debug`` and ``early_stop`` have nothing to
check or stop here.

Module outputs held outside the region: transformers captures submodules' outputs with forward
hooks while the model runs (``output_router_logits=True``, which TRL sets for mixtures of experts
to add their load-balancing loss; ``output_hidden_states``, ``output_attentions``). Captured
inside a region, they were values of the region's trace, and JAX refused them where the model
used them (``UnexpectedTracerError``: the step ran eagerly, or failed). Every tensor a module
call returns inside the region and that is still alive when the region's function has returned
leaves the region as one of its outputs, and the tensor takes the outside value: whoever holds
it reads the region's result. An unused one costs nothing (XLA drops it).

Module state updated in place inside a region (BatchNorm's running statistics in a checkpointed
block): the engine hands ``rematerializing()`` the module's parameters and buffers as traced; one
the region changed leaves the region as one of its outputs and is set outside, or it would hold a
value of the region's trace. It is updated once, in the forward (torch's checkpoint updates it
again when it recomputes the block).

ZeRO-3's gathered weights: the engine gathers each sharded parameter where the module reads it
(``zero3_gather``). Gathered once ahead of the module, outside every region, a block's weights
came into its region whole, and a region keeps its inputs for the backward: every block's
gathered weights stayed live from the forward to the backward, the whole model on every chip
(Llama-2-7B with ``gradient_checkpointing_enable()`` on v5e:4x4: 19.37 GiB a chip, where
``scan_layers`` with ``remat`` gives 10.75). The engine hands ``rematerializing()`` a way to
gather each parameter again from its shard (``regather``): inside a region, a module called
there reads its own parameters gathered inside the region, from the shards. The region then
keeps only the shards, and its recomputation in the backward gathers again, as FSDP does.

A region that reads a value on the host (Qwen2-VL's vision blocks split their attention by
``cu_seqlens.tolist()``) sends the forward down the eager path (``host_reads``), and there
``jax.checkpoint`` still traces its region with abstract values, so the read failed again and
training stopped. In an eager run such a region is called as it is, without rematerialization
(said once): its activations are kept, as without checkpointing.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
import torch.utils.checkpoint
from torch.utils import _pytree as torch_pytree

from spmdzero.backends.torchax.lowering import trace_reads

_CACHE = "__dynamo_disable"  # the attribute torch's _disable_dynamo wrapper calls through
_warned: set = set()


def _wrapped():
    """The function inside ``torch.utils.checkpoint.checkpoint``'s ``_disable_dynamo`` wrapper,
    or None when the wrapper is not the one this hook knows."""
    wrapper = torch.utils.checkpoint.checkpoint
    inner = getattr(wrapper, "__wrapped__", None)
    code = getattr(wrapper, "__code__", None)
    if inner is None or code is None or _CACHE not in code.co_consts:
        return None
    return inner


def hook_available() -> bool:
    """Whether ``rematerializing()`` reaches ``torch.utils.checkpoint.checkpoint`` in this torch."""
    return _wrapped() is not None


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


@contextlib.contextmanager
def rematerializing(env, state=(), regather=None):
    """Inside, ``torch.utils.checkpoint.checkpoint`` (however bound) runs its function under
    ``jax.checkpoint`` in torchax's ``env``; ``state``: the traced module's parameters and buffers
    (torchax tensors), which a region may update in place; ``regather``: ZeRO-3's gathered
    parameters, by ``id`` of their tensor, each mapped to a function that gathers it again from its
    shard (the module docstring). Re-entrant; restored by an exception too."""
    inner = _wrapped()
    if inner is None:
        _warn_once("hook", f"torch {torch.__version__}: torch.utils.checkpoint.checkpoint is not the "
                           "_disable_dynamo wrapper spmdzero hooks; activation checkpointing is not honoured on the "
                           "torchax backend (every activation is kept)")
        yield
        return
    missing = object()
    before = inner.__dict__.get(_CACHE, missing)
    signature = inspect.signature(inner)
    state = list(state)

    def checkpoint(function, *args, **kwargs):
        return _checkpoint(env, state, signature, function, args, kwargs, regather or {})

    setattr(inner, _CACHE, checkpoint)
    try:
        yield
    finally:
        if before is missing:
            inner.__dict__.pop(_CACHE, None)
        else:
            setattr(inner, _CACHE, before)


def _checkpoint(env, state, signature, function, args, kwargs, regather):
    """One call of ``torch.utils.checkpoint.checkpoint(function, *args, **kwargs)`` in the trace."""
    try:
        bound = signature.bind(function, *args, **kwargs)
    except TypeError as err:
        raise TypeError(f"torch.utils.checkpoint.checkpoint: {err}") from None
    options = bound.arguments
    varargs, varkw = (next((p.name for p in signature.parameters.values() if p.kind == kind), None)
                      for kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD))
    function_kwargs = dict(options.get(varkw, {}))
    function_kwargs.pop("preserve_rng_state", None)
    if options.get("use_reentrant") in (None, True) and function_kwargs:
        # torch's own refusal: the reentrant variant passes no keyword arguments
        raise ValueError("Unexpected keyword arguments: " + ",".join(function_kwargs))
    context_fn = options.get("context_fn", torch.utils.checkpoint.noop_context_fn)
    if context_fn is not torch.utils.checkpoint.noop_context_fn:
        _warn_once("context_fn", "torch.utils.checkpoint.checkpoint(context_fn=...) is ignored on the torchax "
                                 "backend: the whole region is recomputed in the backward (jax.checkpoint)")
    return rematerialized(env, function, options.get(varargs, ()), function_kwargs, state, regather)


@contextlib.contextmanager
def _module_outputs():
    """Weak references to the torchax tensors that module calls return inside (a global forward
    hook): those still alive when the region's function returns are held by something outside
    it (transformers' output capture: ``output_router_logits``, ``output_hidden_states``)."""
    import weakref

    from torchax import tensor as ttensor

    made: list = []

    def hook(module, inputs, output):
        for leaf in torch_pytree.tree_leaves(output):
            if isinstance(leaf, ttensor.Tensor):
                made.append(weakref.ref(leaf))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield made
    finally:
        handle.remove()


@contextlib.contextmanager
def _gathered_where_called(regather: dict):
    """Inside a region: a module called there reads its own parameters that ``regather`` names
    gathered from their shards inside the region (a global forward pre-hook), each once per
    region; they are put back when the region's function returns."""
    if not regather:
        yield
        return
    swapped: dict = {}  # id -> (tensor, its value outside the region)

    def hook(module, inputs):
        for tensor in module._parameters.values():
            key = id(tensor)
            if key in regather and key not in swapped:
                swapped[key] = (tensor, tensor._elem)
                tensor._elem = regather[key]()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        for tensor, outside in swapped.values():
            tensor._elem = outside


def rematerialized(env, function, args: tuple, kwargs: dict, state: list = (), regather=None):
    """``function(*args, **kwargs)`` on torchax tensors as one ``jax.checkpoint`` region; the
    tensors of ``state`` it updates in place are updated outside it; ``regather``: as for
    ``rematerializing``."""
    import jax
    from torchax import tensor as ttensor

    leaves, spec = torch_pytree.tree_flatten((args, kwargs))
    inputs = [i for i, leaf in enumerate(leaves) if isinstance(leaf, ttensor.Tensor)]
    traced: list = []  # the output's structure and its non-tensor leaves, found while tracing the region

    def region(key, arrays):
        before = [t._elem for t in state]
        placed = list(leaves)
        for i, array in zip(inputs, arrays):
            placed[i] = ttensor.Tensor(array, env, requires_grad=leaves[i].requires_grad)
        call_args, call_kwargs = torch_pytree.tree_unflatten(placed, spec)
        with env.override_property(prng=key), _module_outputs() as made, _gathered_where_called(regather):
            output = function(*call_args, **call_kwargs)
            key = env.prng_key
        out_leaves, out_spec = torch_pytree.tree_flatten(output)
        tensors = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, ttensor.Tensor)]
        changed = [i for i, t in enumerate(state) if t._elem is not before[i]]
        updates = [state[i]._elem for i in changed]
        for i in changed:  # the region's values leave it only as its outputs
            state[i]._elem = before[i]
        outputs = {id(out_leaves[i]) for i in tensors}  # these leave the region as its outputs already
        kept = [t for t in (ref() for ref in made) if t is not None and id(t) not in outputs]
        traced[:] = [out_spec, out_leaves, tensors, changed, kept]
        return key, [out_leaves[i]._elem for i in tensors], updates, [t._elem for t in kept]

    arrays_in = [leaves[i]._elem for i in inputs]
    saved = [t._elem for t in state]
    try:
        key, arrays, updates, kept_arrays = jax.checkpoint(region)(env.prng_key, arrays_in)
    except trace_reads.host_read_errors() as err:
        if not (trace_reads.reads_a_value(err) and trace_reads.concrete((arrays_in, saved))):
            raise
        for t, array in zip(state, saved):  # the failed trace's values do not stay
            t._elem = array
        _warn_once("eager", "a checkpointed region reads a value on the host: in the eager run it runs without "
                            "rematerialization (jax.checkpoint traces its region with abstract values), keeping "
                            "its activations")
        return function(*args, **kwargs)
    env.param.prng = key  # the environment's key advances as the region's draws rotated it
    out_spec, out_leaves, tensors, changed, kept = traced
    for i, update in zip(changed, updates):
        state[i]._elem = update
    for tensor, array in zip(kept, kept_arrays):  # held by a hook or a collector: the region's value, outside
        tensor._elem = array
    out_leaves = list(out_leaves)
    for i, array in zip(tensors, arrays):
        out_leaves[i] = ttensor.Tensor(array, env, requires_grad=out_leaves[i].requires_grad)
    return torch_pytree.tree_unflatten(out_leaves, out_spec)
