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
elementwise pass (torch's own formula for the gradient). The label's logit is a masked row sum,
not a gather: it reads the logits in the layout the head's matmul wrote them, where libtpu
copied them whole into row-major order for a gather. While the engine traces the module,
``fused()`` has torchax run it for the common call: 2-D ``[N, C]`` logits, class-index targets,
no class weights and no label smoothing, any ``ignore_index`` and reduction (``mean`` divides by
the rows not ignored, as torch does). Any other call takes torchax's own lowering.

transformers upcasts bf16 logits to fp32 before its loss (``logits.float()``), and the backward
kept that fp32 copy: 823 MB for GPT-2 124M at 4 x 1024 tokens per chip, 2.5 GB for a
152k-token vocabulary at 4k tokens. ``fused()`` also records which traced values are such an
upcast (through the reshapes after it), and the loss takes the bf16 values instead: the same
fp32 arithmetic, and no fp32 copy.
"""

from __future__ import annotations

import contextlib
import functools

import torch
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
        # the label's logit as a masked row sum, not a gather: the sum reads the logits in the
        # layout the log-sum-exp reads them, where libtpu copied the whole [N, C] array into
        # row-major order for the gather (GPT-2 124M, 4 x 1024 tokens a chip: 412 MB each way)
        hit = jnp.arange(x.shape[-1], dtype=safe.dtype)[None, :] == safe[:, None]
        picked = jnp.sum(jnp.where(hit, x.astype(jnp.float32), 0.0), axis=-1)
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


class _Upcasts:
    """The fp32 values of a trace that are an upcast of a bf16/fp16 value (transformers'
    ``logits.float()``), through the reshapes after it (``.view(-1, vocab)``): for each, the
    value it was upcast from. Keyed by the traced value's identity, which holds it alive."""

    HALF = ("bfloat16", "float16")

    def __init__(self):
        self._parents: dict = {}  # id(fp32 value) -> (fp32 value, half value or the fp32 value it reshapes)

    def upcast(self, source, out) -> None:
        if str(source.dtype) in self.HALF and str(out.dtype) == "float32":
            self._parents[id(out)] = (out, source)

    def reshaped(self, source, out) -> None:
        if id(source) in self._parents and self._parents[id(source)][0] is source:
            self._parents[id(out)] = (out, source)

    def source(self, value):
        """The half-precision value ``value`` is an upcast of, reshaped as ``value``; None if none."""
        import jax.numpy as jnp

        entry = self._parents.get(id(value))
        if entry is None or entry[0] is not value:
            return None
        parent = entry[1]
        if str(parent.dtype) in self.HALF:
            return parent
        half = self.source(parent)
        return None if half is None else jnp.reshape(half, value.shape)


_upcasts: list = []  # the innermost ``fused`` context's _Upcasts


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """``F.cross_entropy`` while tracing: the fused loss for the common call, else torch's
    (here, inside torchax's function mode, torch's call goes on to its decomposition). Logits
    that are an fp32 upcast of half-precision ones go in as those: the loss's arithmetic is fp32
    either way (an upcast is exact), and the fp32 copy, which the backward would keep, is never
    made (GPT-2 124M, 4 x 1024 tokens per chip: 823 MB)."""
    from torchax import interop
    from torchax import tensor as ttensor

    common = (input.dim() == 2 and target.dim() == 1 and not target.is_floating_point() and weight is None
              and size_average is None and reduce is None and label_smoothing == 0.0
              and reduction in ("mean", "sum") and input.is_floating_point())
    if not common:
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    dtype, logits = input.dtype, input
    if isinstance(input, ttensor.Tensor) and input._env.param.autocast_dtype is not None:
        dtype = torch.float32  # torch's autocast computes the cross-entropy in fp32 (torch_autocast)
    if _upcasts and isinstance(input, ttensor.Tensor):
        half = _upcasts[-1].source(input._elem)
        if half is not None:
            logits = ttensor.Tensor(half, input._env)
    total = interop.torch_view(_loss(int(ignore_index)))(logits, target)
    if reduction == "sum":
        return total.to(dtype)
    return (total / (target != ignore_index).sum()).to(dtype)


def _recording(env, op, record):
    """``op``'s lowering in ``env``, with ``record(input, output)`` after each call."""
    from torchax.ops import ops_registry

    lowering = env._ops[op]

    def run(x, *args, **kwargs):
        out = lowering.func(x, *args, **kwargs)
        record(x, out)
        return out

    return ops_registry.Operator(op, run, is_jax_function=lowering.is_jax_function, is_user_defined=True,
                                 needs_env=lowering.needs_env, is_view_op=lowering.is_view_op)


@contextlib.contextmanager
def fused(env):
    """Inside, torchax's ``env`` runs ``F.cross_entropy`` as ``_cross_entropy``, and its upcasts
    and reshapes are recorded for it (``_Upcasts``); its own lowerings are back when the trace
    ends."""
    import torch

    from torchax import tensor as ttensor

    upcasts = _Upcasts()
    reshapes = (torch.ops.aten.view, torch.ops.aten._unsafe_view, torch.ops.aten.reshape)
    missing = object()
    before = {op: env._ops.get(op, missing) for op in (F.cross_entropy, *reshapes)}
    to_copy = env.__dict__.get("_to_copy", missing)  # torchax's method, or spmdzero's wrapper of it
    copy = env._to_copy

    def recording_to_copy(the_tensor, new_dtype, new_device):
        out = copy(the_tensor, new_dtype, new_device)
        if isinstance(the_tensor, ttensor.Tensor) and isinstance(out, ttensor.Tensor):
            upcasts.upcast(the_tensor._elem, out._elem)
        return out

    env.override_op_definition(F.cross_entropy, _cross_entropy)
    for op in reshapes:
        if before[op] is not missing:
            env._ops[op] = _recording(env, op, upcasts.reshaped)
    env._to_copy = recording_to_copy
    _upcasts.append(upcasts)
    try:
        yield
    finally:
        _upcasts.pop()
        if to_copy is missing:
            del env._to_copy
        else:
            env._to_copy = to_copy
        for op, lowering in before.items():
            if lowering is missing:
                env._ops.pop(op, None)
            else:
                env._ops[op] = lowering
