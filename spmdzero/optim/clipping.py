"""DeepSpeed's global-norm clipping for ZeRO-1/2, written once for every backend: the clip
coefficient is ``(norm + 1e-6) / gradient_clipping``, applied only when it exceeds 1, and
gradients are divided by it (together with the loss scale) before the optimizer's math."""

CLIP_EPS = 1e-6  # DeepSpeed's: clip = (norm + 1e-6) / max_norm


def clip_divisor(norm, max_norm: float, ops):
    """What the gradients are divided by for ``gradient_clipping = max_norm``: at least 1, so
    gradients are never scaled up. ``ops`` is the array namespace (``TORCH_OPS``, ``jax_ops()``)."""
    return ops.clamp((norm + CLIP_EPS) / max_norm, 1.0, None)
