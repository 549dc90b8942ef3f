"""``F.scaled_dot_product_attention`` on the torchax backend, with torch's values on masked rows.

torchax 0.0.13 lowers SDPA to a reference (``torchax/ops/jtorch.py``, ``_sdpa_reference``) that
fills masked scores with -inf and takes a plain softmax. A query row whose keys are all masked
(the padding rows of a left-padded batch, which transformers 5.x hands SDPA as a bool mask)
then gives 0/0 = NaN, and the NaN reaches the loss through the backward even where the labels
ignore those rows: GPT-2, Llama, Qwen2 and OPT trained on NaN from their first step. torch's
own SDPA (its math kernel's ``_safe_softmax``) returns zeros for such rows, and so does this
lowering: a row that is -inf everywhere takes scores of 0 before the softmax (so that its
gradient is finite too) and weights of 0 after it. Everything else is torch's arithmetic: the
default scale 1/sqrt(E), ``is_causal``'s lower-triangular mask, a bool mask (True: attend) or
an additive float mask, ``enable_gqa``'s repeated key/value heads, and dropout on the weights
(from the trace's key, as torchax's other dropout, by the flash kernel's hash: both paths drop
the same weights, ``flash_dropout.py``). A mask of the dtype's minimum, as
transformers' eager path builds, is not -inf and gives torch's uniform weights, as in torch.

The gradient of such a row is torch's too. transformers 4.x's own masks (OPT, BioGPT, XGLM and
the other models that build theirs in ``_update_causal_mask``) are additive, the dtype's minimum
where masked, so a left-padded batch's padding rows are that minimum everywhere. torch's CPU SDPA
runs its flash kernel there, whose backward recomputes the weights as ``exp(s - lse)`` with
``lse = max + log(sum)`` in float32: next to 3.4e38 the log is lost, ``lse`` is the max, and each
weight is taken as 1 instead of 1/S. The forward is the true softmax; the backward takes that row's
gradient S times (S: the keys). The last padding position's logits predict the first real token,
so the loss reaches such a row: OPT on 4.57 trained away from torch from its second step (7e-3 in
the loss). ``_torch_cpu_row_gradient`` scales those rows' gradients as torch does, on the same
float32 test (``max + log(sum) == max``), and leaves every other row's exactly alone. On a GPU,
transformers 4.x unmasks such rows instead (``_unmask_unattended``): a third answer, which the
padding rows' logits alone see.

The softmax runs in float32 for half-precision inputs, as torch's CPU kernels accumulate.
This path holds the ``[L, S]`` scores. While an engine traces its step (``choosing``), a call
the flash kernel covers goes to Pallas's kernel instead (``flash_attention.py``): by default on
TPU (``"spmd": {"attention": "auto"}``), everywhere with ``"flash"``. A call it does not cover
stays here, and the engine says why once (``AttentionChoice``); ``spmdzero aot`` reports both.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from spmdzero.backends.torchax.lowering import flash_attention, flash_dropout
from spmdzero.backends.torchax.lowering import hf_masks

_INSTALLED = "_spmdzero_exact_sdpa"


@dataclass
class AttentionChoice:
    """One engine's attention: the kernel it asked for (``spmd.attention``, resolved for the
    platform) and what its traces ran, call by call."""

    kernel: str  # "flash" or "exact"
    mesh: Any = None
    batch_axes: tuple = ()
    batch_devices: int = 1
    interpret: bool = False  # the flash kernel in Pallas's interpreter (off TPU)
    calls: collections.Counter = field(default_factory=collections.Counter)  # "flash"/"exact" -> traced calls
    reasons: dict = field(default_factory=dict)  # why a call took the exact path -> calls

    @classmethod
    def resolve(cls, setting: str, platform: str, **where) -> "AttentionChoice":
        """``spmd.attention`` on ``platform`` ("tpu" for ``spmdzero aot``'s shape-only steps)."""
        kernel = "flash" if setting == "flash" or (setting == "auto" and platform == "tpu") else "exact"
        return cls(kernel, interpret=kernel == "flash" and platform != "tpu", **where)

    def fell_back(self, reason: str) -> None:
        if reason not in self.reasons:
            warnings.warn(f"spmdzero: scaled_dot_product_attention takes the exact XLA path, which holds the "
                          f"[L, S] scores, instead of the flash kernel: {reason}", stacklevel=2)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def describe(self) -> str:
        """One line for reports: which kernel ran how often, and why not the flash kernel."""
        if not self.calls:
            return "no scaled_dot_product_attention call in the step"
        ran = ", ".join(f"{_KERNEL_NAMES[k]} x{n}" for k, n in sorted(self.calls.items()))
        why = "; ".join(self.reasons) if self.reasons else ("spmd.attention asks for the exact path"
                                                            if self.kernel == "exact" and self.calls["exact"]
                                                            else "")
        return ran + (f" ({why})" if why else "")


_KERNEL_NAMES = {"flash": "Pallas flash kernel", "flash-dropout": "Pallas flash kernel with dropout",
                 "exact": "exact XLA (holds [L, S] scores)"}
_choice: Optional[AttentionChoice] = None


@contextlib.contextmanager
def choosing(choice: AttentionChoice, env=None):
    """SDPA calls traced inside (in ``env``) take ``choice``'s kernel and count in it; with the
    flash kernel, so do transformers' causal masks (``hf_masks``)."""
    global _choice
    previous, _choice = _choice, choice
    try:
        if choice.kernel == "flash" and env is not None:
            with hf_masks.structured(functools.partial(_transformers_kernel, choice, env)):
                yield
        else:
            yield
    finally:
        _choice = previous


def _transformers_kernel(choice: AttentionChoice, env, module, query, key, value, structure, dropout, scaling):
    """transformers' attention on the flash kernel, for a mask ``hf_masks`` knows the structure
    of; None (transformers' own path) where the kernel does not cover the call."""
    q, k, v = env.t2j_iso((query, key, value))
    reason = flash_attention.unsupported(q, k, v, None, dropout, choice.batch_devices)
    if reason is not None:
        choice.fell_back(reason)
        return None
    padding, segments = env.t2j_iso((structure.key_padding, structure.segments))
    out = flash_attention.attend(q, k, v, structure.causal, 1.0 / math.sqrt(q.shape[-1]) if scaling is None
                                 else scaling, choice.mesh, choice.batch_axes, choice.interpret,
                                 key_valid=None if padding is None else padding.astype(bool), segments=segments,
                                 **_dropout(choice, dropout, env))
    return env.j2t_iso(out)


def _dropout(choice: AttentionChoice, rate, env) -> dict:
    """Count a kernel call (with or without dropout: two kernels) and give ``attend`` its dropout:
    the rate and a key from the trace's, as the exact path's dropout draws."""
    rate = float(rate or 0.0)
    choice.calls["flash-dropout" if rate > 0.0 else "flash"] += 1
    return {"dropout": rate, "dropout_key": env.get_and_rotate_prng_key()} if rate > 0.0 else {}


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, env=None):
    """torch's SDPA on JAX arrays (``[..., L, E]``, ``[..., S, E]``, ``[..., S, Ev]``)."""
    import jax
    import jax.numpy as jnp

    choice = _choice
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if choice is not None and choice.kernel == "flash":
        reason = flash_attention.unsupported(query, key, value, attn_mask, dropout_p, choice.batch_devices)
        if reason is None:
            valid = None if attn_mask is None else flash_attention.key_padding(attn_mask, query.shape[0],
                                                                                key.shape[-2])
            return flash_attention.attend(query, key, value, is_causal, scale, choice.mesh, choice.batch_axes,
                                          choice.interpret, key_valid=valid, **_dropout(choice, dropout_p, env))
        choice.fell_back(reason)
    if choice is not None:
        choice.calls["exact"] += 1
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = jnp.repeat(key, repeat, axis=-3), jnp.repeat(value, repeat, axis=-3)
    length, source = query.shape[-2], key.shape[-2]
    compute = jnp.float32 if query.dtype in (jnp.bfloat16, jnp.float16) else query.dtype
    scores = jnp.einsum("...le,...se->...ls", query, key, preferred_element_type=compute) * scale
    if is_causal:
        scores = jnp.where(jnp.tril(jnp.ones((length, source), dtype=bool)), scores, -jnp.inf)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            scores = jnp.where(attn_mask, scores, -jnp.inf)
        else:
            scores = scores + attn_mask.astype(compute)
    # rows with every key masked: torch gives zeros, and so must the gradient stay finite
    dead = jnp.all(scores == -jnp.inf, axis=-1, keepdims=True)
    scores = jnp.where(dead, 0.0, scores)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(dead, 0.0, weights)
    if dropout_p > 0.0:  # the flash kernel's masks, drawn by the same hash: either path drops the same weights
        seeds = flash_dropout.row_seeds(env.get_and_rotate_prng_key(), weights.shape[:-2])
        keep = flash_dropout.keep_mask(seeds, length, source, dropout_p)
        weights = jnp.where(keep, weights / (1.0 - dropout_p), 0.0)
    out = jnp.einsum("...ls,...se->...le", weights.astype(value.dtype), value)
    if attn_mask is None or attn_mask.dtype == jnp.bool_:  # no finite minimum to lose the log next to
        return out
    top = jnp.max(scores, axis=-1, keepdims=True)
    total = jnp.sum(jnp.exp(scores - top), axis=-1, keepdims=True)
    lost = (top.astype(jnp.float32) + jnp.log(total).astype(jnp.float32) == top.astype(jnp.float32)) & ~dead
    return _torch_cpu_row_gradient()(out, jax.lax.stop_gradient(jnp.where(lost, total, 1.0).astype(out.dtype)))


@functools.lru_cache(maxsize=None)
def _torch_cpu_row_gradient():
    """The identity on ``out`` whose cotangent is multiplied by ``factor`` (one per query row):
    torch's CPU kernel's gradient on rows whose ``lse`` lost its log (the module docstring). The
    forward is exactly ``out``."""
    import jax

    @jax.custom_vjp
    def scaled(out, factor):
        return out

    def forward(out, factor):
        return out, factor

    def backward(factor, grad):
        return grad * factor, jax.numpy.zeros_like(factor)

    scaled.defvjp(forward, backward)
    return scaled


def install(env) -> None:
    """Make ``env`` lower SDPA (the functional and the aten op) with ``scaled_dot_product_attention``.
    Idempotent; the default environment is the process's, like torchax's own lowerings."""
    if getattr(env, _INSTALLED, False):
        return
    from torchax.ops import ops_registry

    for op in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):
        env._ops[op] = ops_registry.Operator(op, scaled_dot_product_attention, is_jax_function=True,
                                             is_user_defined=True, needs_env=True, is_view_op=False)
    setattr(env, _INSTALLED, True)
