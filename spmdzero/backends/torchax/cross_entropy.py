"""``F.cross_entropy`` over class logits on the torchax backend, with the memory of one fp32 copy
of the logits instead of several.

torchax lowers ``F.cross_entropy`` through torch's decomposition: ``log_softmax`` (``jax.nn``'s,
whose autodiff keeps its intermediates for the backward) then ``nll_loss`` (a gather, whose
transpose scatters into a zero ``[N, C]`` array). For a language model's head those are
``[tokens, vocabulary]`` arrays in fp32 (transformers upcasts the logits first), and the
backward holds several at once: GPT-2 124M at 4 x 1024 tokens per chip kept about 2.5 GiB of
temporaries for it, more than its twelve blocks once they are rematerialized
(``remat.py``), so activation checkpointing cut the step's temporaries to 49% only.

``cross_entropy_sum`` is the same loss as one JAX function with its own VJP: the forward keeps
the logits and each row's log-sum-exp, the backward makes ``softmax - one_hot`` in one
elementwise pass (torch's own formula for the gradient). While the engine traces the module,
``fused()`` has torchax run it for the common call: 2-D ``[N, C]`` logits, class-index targets,
no class weights and no label smoothing, any ``ignore_index`` and reduction (``mean`` divides by
the rows not ignored, as torch does). Any other call takes torchax's own lowering.
"""

from __future__ import annotations

import contextlib
import functools

import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def _loss(ignore_index: int):
    """The summed loss of ``x`` [N, C] against ``labels`` [N], rows labelled ``ignore_index``
    left out, with its VJP."""
    import jax
    import jax.numpy as jnp

    def forward(x, labels):
        valid = labels != ignore_index
        safe = jnp.where(valid, labels, 0)
        lse = jax.nn.logsumexp(x.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(x, safe[:, None], axis=-1)[:, 0].astype(jnp.float32)
        return jnp.sum(jnp.where(valid, lse - picked, 0.0)), (x, safe, valid, lse)

    @jax.custom_vjp
    def loss(x, labels):
        return forward(x, labels)[0]

    def backward(saved, g):
        x, safe, valid, lse = saved
        softmax = jnp.exp(x.astype(jnp.float32) - lse[:, None])
        one_hot = jax.nn.one_hot(safe, x.shape[-1], dtype=jnp.float32)
        return (g * jnp.where(valid[:, None], softmax - one_hot, 0.0)).astype(x.dtype), None

    loss.defvjp(forward, backward)
    return loss


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """``F.cross_entropy`` while tracing: the fused loss for the common call, else torch's
    (here, inside torchax's function mode, torch's call goes on to its decomposition)."""
    from torchax import interop

    common = (input.dim() == 2 and target.dim() == 1 and not target.is_floating_point() and weight is None
              and size_average is None and reduce is None and label_smoothing == 0.0
              and reduction in ("mean", "sum") and input.is_floating_point())
    if not common:
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    total = interop.torch_view(_loss(int(ignore_index)))(input, target)
    if reduction == "sum":
        return total.to(input.dtype)
    return (total / (target != ignore_index).sum()).to(input.dtype)


@contextlib.contextmanager
def fused(env):
    """Inside, torchax's ``env`` runs ``F.cross_entropy`` as ``_cross_entropy``; its own lowering
    is back when the trace ends."""
    missing = object()
    before = env._ops.get(F.cross_entropy, missing)
    env.override_op_definition(F.cross_entropy, _cross_entropy)
    try:
        yield
    finally:
        if before is missing:
            env._ops.pop(F.cross_entropy, None)
        else:
            env._ops[F.cross_entropy] = before
