"""torchax lowerings replaced where they give other values than torch under the sharded step.

Each replacement is installed on torchax's process-wide environment once, at the first engine:

* ``F.scaled_dot_product_attention``: rows with every key masked give torch's zeros, not NaN
  (``attention``).
* ``aten.embedding`` with a ``padding_idx``: torch gives the padding row no gradient. torchax
  0.0.13 does it with a ``custom_jvp`` that sets the tangent's row ``padding_idx`` to zero
  (``jaten._disable_pad_idx_grad_embedding_impl``). Transposed, and with the gradient laid out
  in ZeRO-2's shards along the rows, XLA zeroed row ``padding_idx`` of every shard (rows 0, 12,
  24, ... of a 96-row table on 8 devices): DistilBERT, RoBERTa and ELECTRA trained on wrong
  gradients at stage 2 only. Here the padding row is read through ``stop_gradient`` instead,
  a plain select that every layout partitions alike.
"""

from __future__ import annotations

import torch

from spmdzero.backends.torchax import attention

_INSTALLED = "_spmdzero_lowerings"


def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """torch's embedding on JAX arrays: the rows of ``weight`` at ``indices``; the row
    ``padding_idx`` (if any) takes no gradient. ``scale_grad_by_freq`` and ``sparse`` change only
    torch's backward kernels, which JAX's gradient replaces."""
    import jax
    import jax.numpy as jnp

    if padding_idx is not None and padding_idx != -1:
        row = padding_idx % weight.shape[0]
        is_pad = (jnp.arange(weight.shape[0]) == row)[:, None]
        weight = jnp.where(is_pad, jax.lax.stop_gradient(weight), weight)
    return jnp.take(weight, indices, axis=0)


def install(env) -> None:
    """Install every replacement on ``env``. Idempotent."""
    if getattr(env, _INSTALLED, False):
        return
    from torchax.ops import ops_registry

    attention.install(env)
    for op in (torch.ops.aten.embedding, torch.ops.aten.embedding.default):
        env._ops[op] = ops_registry.Operator(op, embedding, is_jax_function=True, is_user_defined=True,
                                             needs_env=False, is_view_op=False)
    setattr(env, _INSTALLED, True)
