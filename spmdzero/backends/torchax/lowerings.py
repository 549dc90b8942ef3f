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
* transformers 5.x's mixture-of-experts ``grouped_mm`` (``torch.ops.transformers.grouped_mm_fallback``,
  and ``aten._grouped_mm`` where it picks torch's kernel): a custom op with no torchax lowering,
  whose eager body reads the group offsets on the host. Here it is ``jax.lax.ragged_dot``, the
  grouped matmul XLA lowers on every platform, with the offsets as a traced input.
* ``aten.detach`` (``torch.detach(t)``, and torch's own detaches): torchax lowers it to the
  identity, so a detached value still passed gradients under JAX. Here it is
  ``jax.lax.stop_gradient``, as the torchax tensor's own ``.detach()`` method already is.
* ``aten._to_copy`` of a Python number: ``torch.vmap``'s batching rules hand torchax a scalar
  operand as a plain int (``x - 3`` inside a vmapped function), and torchax's ``_to_copy`` read
  its ``.dtype``. transformers 4.x builds every attention mask with ``torch.vmap``, and Mistral's
  sliding window (``q_idx - sliding_window``) stopped there. The number becomes an array of the
  asked dtype.
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


def grouped_mm(input, weight, offs=None, bias=None, out_dtype=None):
    """Rows ``offs[g-1]:offs[g]`` of ``input`` (``[S, K]``, sorted by group) times ``weight[g]``
    (``[G, K, N]``); rows past ``offs[-1]`` are zero, as in transformers' fallback."""
    import jax
    import jax.numpy as jnp

    if offs is None or input.ndim != 2 or weight.ndim != 3:
        raise NotImplementedError(
            f"spmd.backend='torchax' lowers grouped_mm for a 2-D input and 3-D weights with offsets (a "
            f"mixture of experts' layout); got input {tuple(input.shape)}, weight {tuple(weight.shape)}, "
            f"offs {'None' if offs is None else tuple(offs.shape)}")
    offs = offs.astype(jnp.int32)
    sizes = jnp.diff(offs, prepend=jnp.zeros((1,), jnp.int32))
    out = jax.lax.ragged_dot(input, weight.astype(input.dtype), sizes)
    out = jnp.where((jnp.arange(input.shape[0]) < offs[-1])[:, None], out, 0)
    if bias is not None:
        out = out + bias
    return out.astype(out_dtype or input.dtype)


def _stop_gradient(x):
    import jax

    return jax.lax.stop_gradient(x)


def _numbers_copy_to_arrays(env) -> None:
    """``env``'s ``.to``/``_to_copy`` takes a Python number as a 0-d tensor of the asked dtype."""
    to = env._torch_Tensor_to

    def to_or_number(args, kwargs):
        if args and isinstance(args[0], (bool, int, float)):
            import jax.numpy as jnp
            from torchax import tensor
            from torchax.ops import mappings

            dtype = (kwargs or {}).get("dtype")
            value = jnp.asarray(args[0], dtype=None if dtype is None else mappings.t2j_dtype(dtype))
            return tensor.Tensor(value, env)
        return to(args, kwargs)

    env._torch_Tensor_to = to_or_number


def _grouped_mm_ops() -> list:
    """The grouped matmul ops this process has: torch's, and transformers' once its MoE code is loaded."""
    ops = [getattr(torch.ops.aten, "_grouped_mm", None)]
    if hasattr(torch.ops, "transformers") and hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        ops.append(torch.ops.transformers.grouped_mm_fallback)
    return [op for op in ops if op is not None]


def install(env) -> None:
    """Install every replacement on ``env``. Idempotent; called at every engine, since a model
    built since the last one may have brought an op (transformers' grouped_mm)."""
    from torchax.ops import ops_registry

    def lower(op, fn):
        env._ops[op] = ops_registry.Operator(op, fn, is_jax_function=True, is_user_defined=True, needs_env=False,
                                             is_view_op=False)

    # transformers' op exists once its MoE module is imported (the model is built before the engine)
    for op in _grouped_mm_ops():
        if op not in env._ops or not env._ops[op].is_user_defined:
            lower(op, grouped_mm)
    if getattr(env, _INSTALLED, False):
        return
    attention.install(env)
    _numbers_copy_to_arrays(env)
    for op in (torch.ops.aten.embedding, torch.ops.aten.embedding.default):
        lower(op, embedding)
    for op in (torch.ops.aten.detach, torch.ops.aten.detach.default):
        lower(op, _stop_gradient)
    setattr(env, _INSTALLED, True)
