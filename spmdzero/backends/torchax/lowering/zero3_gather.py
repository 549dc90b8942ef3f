"""ZeRO-3's gather of a weight where the module reads it, with FSDP's reduce-scatter as its
transpose.

Why: left to itself, the SPMD partitioner kept ZeRO-3's sharded weights in place and moved
activations instead (tensor-parallel style): 2.26x FSDP's minimum traffic on a 2-layer GPT-2,
2.04x inside a ``scan_layers`` loop. A replicated sharding constraint on the weight gathers it;
but a plain ``with_sharding_constraint``'s transpose pins the gradient replicated as well, an
all-reduce where FSDP reduce-scatters (Llama-2-7B on v5e:4x4: 1.32x the minimum). ``gathered``
constrains the forward only, and leaves the gradient to the layouts around it (the plan's
gradient spec, ``scan._gradient_layout``): 1.01x.

On a mesh with two fsdp axes (``fsdp x fsdp_inner``, 16 chips or more) a weight split over both
is gathered one axis at a time, its gradient's stages backwards (``layouts``): gathered over both
at once, libtpu 0.0.21 all-reduced it instead (Llama-2-70B on v5p:4x4x8: 1.84x the minimum).
"""

from __future__ import annotations

import functools
from typing import Callable

GATHERED = "spmdzero_gathered_weight"  # the name a gathered weight carries (jax.ad_checkpoint.checkpoint_name)
# ops that only lay a value out again: saving their results would save a gathered weight under
# another layout (torchax's F.linear multiplies by ``weight.T``)
_LAYOUT_OPS = frozenset({"transpose", "reshape", "convert_element_type", "broadcast_in_dim", "squeeze",
                         "expand_dims", "copy", "copy_p"})


def not_saving_gathered_weights(prim, *_, **params) -> bool:
    """A ``jax.checkpoint`` policy: save every value the backward needs but the gathered weights,
    under any layout (``GATHERED``, and what layout ops make of anything: cheap to redo, and a
    transposed weight is still the whole weight). The backward gathers the weights again."""
    if prim.name == "name":
        return params.get("name") != GATHERED
    if prim.name == "custom_vjp_call":  # ``gathered`` itself, seen from outside
        call = params.get("call_jaxpr")
        return not any(eqn.primitive.name == "name" and eqn.params.get("name") == GATHERED
                       for eqn in getattr(getattr(call, "jaxpr", call), "eqns", ()))
    return prim.name not in _LAYOUT_OPS


def layouts(grad_layouts: tuple) -> tuple:
    """The partition specs a weight goes through to be whole, in turn: its gradient's layouts
    (the plan's ``grad_layouts``, the last being the weight's own) backwards, then replicated."""
    split = [spec for spec in grad_layouts if any(axis is not None for axis in spec)]
    return tuple(reversed(split[:-1])) + ((),)


@functools.lru_cache(maxsize=None)
def gathered(shardings: tuple):
    """An identity whose output is laid out as ``shardings`` in turn (``NamedSharding``s, the
    last replicated), named ``GATHERED``, and whose cotangent is passed on as it comes."""
    import jax
    from jax.ad_checkpoint import checkpoint_name

    @jax.custom_vjp
    def gather(weight):
        for sharding in shardings:
            weight = jax.lax.with_sharding_constraint(weight, sharding)
        return checkpoint_name(weight, GATHERED)

    def forward(weight):
        return gather(weight), None

    def backward(_, grad):
        return (grad,)

    gather.defvjp(forward, backward)
    return gather


def gathers(plan, param_specs, sharding: Callable, scanned) -> dict:
    """Each parameter's gather at ``plan``'s stage 3 (``name -> gathered(...)``; none below):
    the sharded ones (``param_specs``) but a scanned stack's (``scanned``), which its loop
    gathers one layer per trip. ``sharding`` turns a partition spec into a ``NamedSharding``."""
    if plan.stage < 3:
        return {}
    return {name: gathered(tuple(sharding(spec) for spec in layouts(plan[name].grad_layouts)))
            for name in param_specs if name not in scanned}


def gathered_all(gathers: dict, params: dict) -> dict:
    """``params`` with each one ``gathers`` names gathered, where the module reads it, as FSDP
    does (its gradient's transpose is then the reduce-scatter). Left to itself, the SPMD
    partitioner kept weights sharded and moved the activations instead (tensor-parallel style):
    a 2-layer GPT-2 sent 2.26x FSDP's minimum on v5e:2x2, 1.07x with this. The VJP program (a
    loss outside the module) must not keep them as residuals until its backward, a whole copy of
    the parameters (2.1x the stage-3 accounting in tests/test_torchax_memory.py): its forward is
    checkpointed to save everything but the gathered weights (``GATHERED``, the policy above),
    which the backward gathers again."""
    return {name: gathers[name](p) if name in gathers else p for name, p in params.items()}


def regathers(gathers: dict, params: dict, tensors: dict) -> dict:
    """Each gathered parameter's traced tensor (by ``id``) -> a function that gathers it again
    from its shard in ``params``. A checkpointed region (``remat``) calls it where a module
    reads the parameter inside the region, which then keeps the shard, not the whole weight,
    for the backward (Hugging Face's ``gradient_checkpointing_enable()``)."""
    return {id(tensors[name]): functools.partial(gathers[name], params[name])
            for name in gathers if name in params and name in tensors}
