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
* ``F.ctc_loss``: torchax has no lowering of ``aten::_ctc_loss`` (wav2vec2's and HuBERT's
  CTC heads stopped there). Here it is the CTC forward algorithm over the blank-interleaved
  targets in log space, one ``jax.lax.scan`` over time, differentiated by JAX; padded or
  concatenated targets, per-row input and target lengths, torch's reductions (``mean`` divides
  each row by its target length) and ``zero_infinity``.
* ``torch.take_along_dim``: torch checks that its indices are int64, and torchax's are int32
  (JAX without x64), so every call stopped. Here it is the gather it stands for.
* ``aten.native_layer_norm`` in fp16/bf16: torchax computes it in the input's dtype, and the
  backward of ``rsqrt(var + eps)`` overflows fp16 for small activations (``var^-1.5`` above
  65504): every fp16 transformers model with a LayerNorm (GPT-2, OPT) trained on NaN gradients
  at any loss scale. torch's kernels accumulate in fp32, and so does this lowering, returning
  the input's dtype.
* ``aten._to_copy`` of a Python number: ``torch.vmap``'s batching rules hand torchax a scalar
  operand as a plain int (``x - 3`` inside a vmapped function), and torchax's ``_to_copy`` read
  its ``.dtype``. transformers 4.x builds every attention mask with ``torch.vmap``, and Mistral's
  sliding window (``q_idx - sliding_window``) stopped there. The number becomes an array of the
  asked dtype.
* ``t[a:b]`` where a bound is a tensor (DeepSpeed-Chat's reward model, ``r[d:n]`` with ``d``
  from ``nonzero``): torchax keeps the slice, tensor and all, in a lazy view that is read later,
  outside its environment, where it raised an AssertionError. Here the bound is taken as an
  int when the slice is made, as torch takes it (``operator.index``): a value read on the host,
  so a traced program hands the forward to the eager path (``host_reads``), as any read does.
  An index that is a tensor on the host (``torch.as_tensor`` of a NumPy array: DETR's loss
  indexes its targets with the Hungarian matching that SciPy computes on the host) indexes a
  device tensor in torch; torchax asserted that it was not one of its own. Here it becomes one.

* ``v.tolist()``, ``v.numpy()`` of a lazy view (a row of a device tensor): torch refused them on
  the view; they read its values, as the tensor's do (``_views_read``).

* ``x.copy_(v)`` where ``v`` is a slice torchax keeps as a lazy view: torchax's ``copy_`` read an
  attribute that views lack (transformers 5.x's Jamba, whose Mamba cache copies a slice, stopped
  with AttributeError). The view's values are copied.

* ``x.set_(y)``: no torchax lowering. ``torch.nn.utils.parametrize`` calls it, and PEFT's LoRA on
  transformers 5.x's expert weights registers a parametrization at every forward ("Operator with
  name aten::set_.source_Tensor has no lowering"). ``x`` takes ``y``'s values; another shape or
  dtype is refused, naming both.

* ``x[key] = value`` with ``value`` of another dtype (an fp32 result written into a bf16
  activation), and ``copy_``/in-place ops/``out=`` into a slice: torch casts the value to the
  written tensor's dtype. torchax wrote it as it came: through a boolean mask ``x`` became
  fp32, silently, and into indices or slices JAX warned at every step that it will refuse the
  write (TRL's bf16 SFT printed it). Here the value is cast first.

In-place ops that torchax 0.0.13 lowers only out of place (``x.exp_()``, ``neg_``, ``abs_``,
``clamp_max_``, ``addmm_`` on a slice, as TRL's chunked log-probabilities backward calls it:
"Operator with name aten::addmm_ has no lowering") run as torchax runs ``add_``: the functional
op, then the result written into the tensor or view (``_inplace_from_functional``).

``aten::_is_all_true`` and ``aten::_is_any_true`` (``torch._check_tensor_all``, which transformers
5.x's vision-language models call on their image tokens): no torchax lowering. Here they are
``jnp.all`` and ``jnp.any``, a one-value bool (``traced_checks`` says when the check runs).

Small integers known while tracing are computed then (``known_values``).

One replacement gives other random values, not other semantics: ``F.dropout`` and
``torch.dropout`` (``nn.Dropout``) draw their mask from a hash that the backward draws again, instead of JAX's
threefry bits kept in memory for the backward (``dropout``).
"""

from __future__ import annotations

import dataclasses

import torch

from spmdzero.backends.torchax.lowering import attention
from spmdzero.backends.torchax.lowering import dropout, known_values

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


_IMPOSSIBLE = -1e30  # a log-probability standing for log(0): finite, so that gradients stay finite


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
    """torch's CTC loss on JAX arrays: ``log_probs`` ``[T, N, C]`` (or ``[T, C]``), ``targets``
    ``[N, S]`` padded or 1-D concatenated, lengths per row."""
    import jax
    import jax.numpy as jnp

    batched = log_probs.ndim == 3
    if not batched:
        log_probs, targets = log_probs[:, None], targets[None] if targets.ndim == 1 else targets
    steps, rows, _ = log_probs.shape
    input_lengths = jnp.broadcast_to(jnp.asarray(input_lengths, jnp.int32), (rows,))
    target_lengths = jnp.broadcast_to(jnp.asarray(target_lengths, jnp.int32), (rows,))
    targets = jnp.asarray(targets, jnp.int32)
    if targets.ndim == 1:  # concatenated: row b's targets start after the rows before it
        starts = jnp.cumsum(target_lengths) - target_lengths
        width = targets.shape[0]
        targets = targets[jnp.clip(starts[:, None] + jnp.arange(width)[None], 0, max(width - 1, 0))]
    width = targets.shape[1]
    length = 2 * width + 1
    position = jnp.arange(length)
    # blank, t0, blank, t1, ...; labels past a row's targets are blanks that no path reaches
    labels = jnp.where(position % 2 == 0, blank, targets[:, jnp.clip((position - 1) // 2, 0, max(width - 1, 0))])
    labels = jnp.where((position[None] - 1) // 2 < target_lengths[:, None], labels, blank)
    # a path may skip the label two back unless it is the same symbol (torch's rule: a target equal to the
    # blank included, which the 4.x speech models keep)
    skip = (position >= 2) & (labels != jnp.roll(labels, 2, axis=1))
    log_probs = log_probs.astype(jnp.float32)
    emit = jnp.take_along_axis(log_probs, jnp.broadcast_to(labels[None], (steps, rows, length)), axis=2)
    start = jnp.where(position[None] < jnp.minimum(2, 2 * target_lengths[:, None] + 1), emit[0], _IMPOSSIBLE)

    def shift(alpha, by):
        return jnp.pad(alpha, ((0, 0), (by, 0)), constant_values=_IMPOSSIBLE)[:, :length]

    def advance(alpha, inputs):
        t, emitted = inputs
        merged = jnp.logaddexp(alpha, shift(alpha, 1))
        merged = jnp.where(skip, jnp.logaddexp(merged, shift(alpha, 2)), merged)
        new = jnp.maximum(merged + emitted, _IMPOSSIBLE)
        return jnp.where((t < input_lengths)[:, None], new, alpha), None

    alpha, _ = jax.lax.scan(advance, start, (jnp.arange(1, steps), emit[1:]))
    last = 2 * target_lengths
    final = jnp.take_along_axis(alpha, last[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(alpha, jnp.maximum(last - 1, 0)[:, None], axis=1)[:, 0]
    final = jnp.where(target_lengths > 0, jnp.logaddexp(final, before), final)
    loss = -final
    impossible = loss > -_IMPOSSIBLE / 2
    loss = jnp.where(impossible, 0.0 if zero_infinity else jnp.inf, loss)
    if isinstance(reduction, int):  # torch.ctc_loss's enum: none, mean, sum
        reduction = ("none", "mean", "sum")[reduction]
    if reduction == "mean":
        loss = jnp.mean(loss / jnp.maximum(target_lengths, 1))
    elif reduction == "sum":
        loss = jnp.sum(loss)
    elif not batched:
        loss = loss[0]
    return loss.astype(log_probs.dtype)


def native_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch's layer norm over the trailing ``normalized_shape`` dims, computed in fp32 for
    half-precision inputs: ``(output, mean, rstd)``."""
    import jax
    import jax.numpy as jnp

    if isinstance(normalized_shape, int):
        normalized_shape = [normalized_shape]
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    compute = jnp.float32 if input.dtype in (jnp.float16, jnp.bfloat16) else input.dtype
    x = input.astype(compute)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.var(x, axis=axes, keepdims=True) + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight.astype(compute)
    if bias is not None:
        out = out + bias.astype(compute)
    return out.astype(input.dtype), mean.astype(input.dtype), rstd.astype(input.dtype)


def take_along_dim(input, indices, dim=None):
    """``torch.take_along_dim`` as the gather it stands for, in torch ops, without torch's check
    that the indices are int64: torchax's integers are int32 (JAX without x64), so inside a
    traced forward every call stopped ("dtype of indices should be Long but got Int")."""
    if dim is None:
        return input.reshape(-1).gather(0, indices.reshape(-1))
    dim = dim % input.dim()

    def sized(shape, n):
        return (*shape[:dim], n, *shape[dim + 1:])
    shape = torch.broadcast_shapes(sized(input.shape, indices.shape[dim]), indices.shape)
    source = input.broadcast_to(sized(shape, input.shape[dim]))
    return source.gather(dim, indices.broadcast_to(shape))


def _is_all_true(x):
    import jax.numpy as jnp

    return jnp.all(x)


def _is_any_true(x):
    import jax.numpy as jnp

    return jnp.any(x)


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


def _views_read() -> None:
    """A lazy view's ``.tolist()`` and ``.numpy()`` read its values, as the tensor's do: torchax
    defines them on its tensors only, and torch's own refused the view ("tolist() is not supported
    for tensor subclasses, got View": LLaVA-NeXT's ``image_size.tolist()`` of a row of
    ``image_sizes``, on the eager path)."""
    from torchax import view as tview

    tview.View.tolist = lambda self: self.torch().tolist()
    tview.View.numpy = lambda self: self.torch().numpy()


def _copies_from_views(env) -> None:
    """``x.copy_(v)`` where ``v`` is a lazy view (a slice torchax has not materialized) copies the
    view's values: torchax's ``copy_`` read ``v._elem``, which a view lacks (transformers 5.x's
    Mamba caches, ``conv_states[i].copy_(states[..., -k:])``: Jamba stopped with AttributeError)."""
    from torchax import view as tview

    op = torch.ops.aten.copy_
    lowering = env._ops[op]
    copy = lowering.func

    def copy_from_view(x, y, *args, **kwargs):
        return copy(x, y.torch() if isinstance(y, tview.View) else y, *args, **kwargs)

    env._ops[op] = dataclasses.replace(lowering, func=copy_from_view, is_user_defined=True)


def set_to_tensor(x, y):
    """``x.set_(y)`` (``aten.set_.source_Tensor``): ``x`` takes ``y``'s values. torchax has no
    lowering; ``torch.nn.utils.parametrize`` calls it when a parametrization is registered, and
    PEFT's LoRA on transformers 5.x's expert weights (``ParamWrapper``) registers one at every
    forward. A torchax tensor's shape and dtype are fixed at its making: other ones are refused."""
    from torchax import view as tview

    if tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype:
        raise RuntimeError(f"spmdzero: x.set_(y) with another shape or dtype ({tuple(x.shape)} {x.dtype} from "
                           f"{tuple(y.shape)} {y.dtype}) cannot run on the torchax backend, whose tensors keep theirs")
    value = y.jax() if isinstance(y, tview.View) else y._elem
    if isinstance(x, tview.View):
        x.update(value)
    else:
        x._elem = value
    return x


def _index_bounds(indexes, env):
    """``indexes`` with every slice bound that is a tensor taken as an int, and every host
    tensor among them (a plain torch tensor) as the environment's (see the module docstring);
    everything else as it is."""
    import operator

    import jax.numpy as jnp
    from torchax import tensor as ttensor
    from torchax import view as tview

    def bound(b):
        return operator.index(b) if isinstance(b, torch.Tensor) else b

    def each(i):
        if isinstance(i, slice):
            return slice(bound(i.start), bound(i.stop), bound(i.step))
        if isinstance(i, torch.Tensor) and not isinstance(i, (ttensor.Tensor, tview.View)):
            return ttensor.Tensor(jnp.asarray(i.detach().cpu().numpy()), env)
        return i

    return tuple(each(i) for i in indexes) if isinstance(indexes, tuple) else each(indexes)


def _slices_with_index_bounds(env) -> None:
    """``env``'s ``Tensor.__getitem__`` takes tensor slice bounds as ints, and index tensors on
    the host (``_index_bounds``); it indexes a lazy view's values (torchax's read the tensor's
    ``_elem``, which a view lacks: Qwen2-VL's ``token_types[attention_mask[row].bool()]``), and a
    host tensor by device indices as a constant (GLM-4V's ``image_shapes[seq_ids, 1]``, its grid
    kept on the host by ``shape_inputs``)."""
    import dataclasses

    from torchax import view as tview

    original = env._ops[torch.Tensor.__getitem__]

    def getitem(self, indexes, *args, **kwargs):
        if isinstance(self, tview.View):
            self = self.torch()
        elif type(self) is torch.Tensor:  # a host tensor (an image grid) indexed by device indices
            self = _index_bounds(self, env)
        return original.func(self, _index_bounds(indexes, env), *args, **kwargs)

    env._ops[torch.Tensor.__getitem__] = dataclasses.replace(original, func=getitem)


def _setitem_in_the_tensors_dtype() -> None:
    """``x[key] = value`` writes ``value`` cast to ``x``'s dtype, as torch does, and so does any
    write into a view (``copy_``, an in-place op, ``out=`` into a slice): torchax's ``Tensor``
    and ``View``, process-wide, once. ``key`` may hold index tensors on the host, as in
    ``x[key]``, and a view's key device index tensors (a boolean mask)."""
    from torchax import tensor as ttensor
    from torchax import view as tview
    from torchax.ops import mappings

    setitem, update = ttensor.Tensor.__setitem__, tview.View.update
    if getattr(setitem, _INSTALLED, False):
        return

    def cast_setitem(self, key, val):
        key = _index_bounds(key, self._env)  # index tensors on the host, as in __getitem__
        if isinstance(val, (ttensor.Tensor, tview.View)) and val.dtype != self.dtype:
            val = ttensor.Tensor(val.jax().astype(mappings.t2j_dtype(self.dtype)), val._env)
        return setitem(self, key, val)

    def cast_update(self, new_values, view_infos=None):
        if isinstance(new_values, (ttensor.Tensor, tview.View)):
            new_values = new_values.jax()
        if hasattr(new_values, "astype"):
            new_values = new_values.astype(self.source_jax().dtype)
        return update(self, new_values, view_infos)

    def view_setitem(self, key, val):
        # torchax kept the key's index tensors as they are, and JAX's scatter could not read a
        # torch dtype ("Cannot interpret 'torch.bool' as a data type": transformers 4.x's Idefics3
        # writes ``position_ids[row][mask] = ids``)
        key = _index_bounds(key, self._env)
        keys = key if isinstance(key, tuple) else (key,)
        keys = tuple(k.jax() if isinstance(k, (ttensor.Tensor, tview.View)) else k for k in keys)
        return view_setitem_original(self, keys if isinstance(key, tuple) else keys[0], val)

    view_setitem_original = tview.View.__setitem__
    setattr(cast_setitem, _INSTALLED, True)
    ttensor.Tensor.__setitem__, tview.View.update = cast_setitem, cast_update
    tview.View.__setitem__ = view_setitem


def _grouped_mm_ops() -> list:
    """The grouped matmul ops this process has: torch's, and transformers' once its MoE code is loaded."""
    ops = [getattr(torch.ops.aten, "_grouped_mm", None)]
    if hasattr(torch.ops, "transformers") and hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        ops.append(torch.ops.transformers.grouped_mm_fallback)
    return [op for op in ops if op is not None]


# in-place ops that are not their functional op written back: a new shape or strides (``t_``,
# ``as_strided_``), or the arguments in another order (``polygamma_(self, n)``, ``polygamma(n, self)``)
_NOT_FUNCTIONAL_THEN_WRITTEN = {"t_", "as_strided_", "polygamma_"}


def _inplace_from_functional(env) -> None:
    """Every aten in-place op (``name_``) that torchax cannot run, neither by a lowering nor by a
    decomposition, while it runs the functional ``name``: torchax's ``InplaceOp`` of it."""
    from torchax.ops import op_base, ops_registry
    from torchax.tensor import OperatorNotFound

    def runs(packet) -> bool:  # any of its overloads
        for overload in packet.overloads():
            try:
                env._get_op_or_decomp(getattr(packet, overload))
                return True
            except OperatorNotFound:
                pass
        return False

    names = {schema.name[len("aten::"):] for schema in torch._C._jit_get_all_schemas()}
    names -= _NOT_FUNCTIONAL_THEN_WRITTEN
    for name in sorted(names):
        if not name.endswith("_") or name.startswith("_") or ":" in name or name[:-1] not in names:
            continue
        inplace, functional = getattr(torch.ops.aten, name, None), getattr(torch.ops.aten, name[:-1], None)
        if inplace is None or functional is None or runs(inplace) or not runs(functional):
            continue
        env._ops[inplace] = ops_registry.Operator(inplace, op_base.InplaceOp(functional), is_jax_function=False,
                                                  is_user_defined=True, needs_env=False, is_view_op=True)


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
    _slices_with_index_bounds(env)
    _setitem_in_the_tensors_dtype()
    _copies_from_views(env)
    _views_read()
    env._ops[torch.ops.aten.set_.source_Tensor] = ops_registry.Operator(
        torch.ops.aten.set_.source_Tensor, set_to_tensor, is_jax_function=False, is_user_defined=True,
        needs_env=False, is_view_op=True)
    for op in (torch.ops.aten.embedding, torch.ops.aten.embedding.default):
        lower(op, embedding)
    for op in (torch.ops.aten.detach, torch.ops.aten.detach.default):
        lower(op, _stop_gradient)
    for op, fn in ((torch.ops.aten._is_all_true, _is_all_true), (torch.ops.aten._is_any_true, _is_any_true)):
        lower(op, fn)
        lower(op.default, fn)
    for op in (torch.nn.functional.ctc_loss, torch.ctc_loss):
        lower(op, ctc_loss)
    for op in (torch.ops.aten.native_layer_norm, torch.ops.aten.native_layer_norm.default):
        lower(op, native_layer_norm)
    _inplace_from_functional(env)
    known_values.install(env)
    for op in (torch.take_along_dim, torch.Tensor.take_along_dim):
        env._ops[op] = ops_registry.Operator(op, take_along_dim, is_jax_function=False, is_user_defined=True,
                                             needs_env=False, is_view_op=False)
    for op, fn in ((torch.nn.functional.dropout, dropout.functional_dropout), (torch.dropout, dropout.torch_dropout)):
        env._ops[op] = ops_registry.Operator(op, fn, is_jax_function=False, is_user_defined=True, needs_env=True,
                                             is_view_op=False)
    setattr(env, _INSTALLED, True)
