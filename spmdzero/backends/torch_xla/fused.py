"""One optimizer update per parameter group, traced once: the group's math run under JAX and
embedded into torch_xla's lazy graph as a single op.

Tracing an update tensor by tensor costs the host tens of microseconds per op and tensor
(each in-place op runs Python broadcast checks): ~130 ms for a 12-layer GPT-2's AdamW, more
than its forward. Here the optimizer's ``_math`` runs once per group *shape signature* under
``jax.jit``; its HLO is cached and every later step adds one node with the group's tensors as
operands (torch_xla's ``_xla_user_computation``, what ``xla_builder.call_jax`` uses, without
its per-tensor pytree handling).

What stays per tensor is kept to a few C++ calls of about a microsecond each:

* the results take the place of the parameters and states (``swap_in``) instead of being
  copied into them (``_foreach_copy_``: ~0.1 ms per tensor through functionalization);
* the op lays out its own results: each output carries its target's sharding inside the
  embedded computation, so the engine does not annotate 700 tensors after every update
  (``mark_sharding`` adds one graph node per tensor, ~20 us each);
* the lowered op is found by the identity of the group's tensors, not by reading their
  shapes, dtypes and layouts back every step.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch._subclasses.functional_tensor import FunctionalTensor

from spmdzero.optim.ops import jax_ops
from spmdzero.runtime import jax_private
from spmdzero.runtime.jax_runtime import shardy_partitioner
from spmdzero.optim.update import GradScale, update_group

_CACHE: dict[tuple, Any] = {}
_FUSED_DTYPES = (torch.float32,)


def applies(params: list[torch.Tensor], state) -> bool:
    """fp32 XLA parameters only: JAX promotes a bf16 tensor times an fp32 scalar to fp32 where
    torch keeps bf16, so other dtypes keep the per-tensor torch path (and its results)."""
    return all(p.device.type == "xla" and p.dtype in _FUSED_DTYPES
               and all(s.device.type == "xla" for s in state[p].values()) for p in params)


def update(optimizer, params: list[torch.Tensor], grads: list[torch.Tensor], hp: dict[str, torch.Tensor],
           group: dict, grad_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None,
           donate: bool = False, gather: Optional[Callable[[torch.Tensor], tuple[str, ...]]] = None) -> Optional[bool]:
    """Apply ``optim.update.update_group`` (the optimizer's math) to the whole group as one graph op, in place
    (``swap_in``, ``donate`` as there). Returns None, doing nothing, for a group the op does
    not apply to (see ``applies``); else whether the results carry their targets' shardings
    (set inside the op), in which case the caller need not annotate them.

    ``gather(param)``: the layouts (HLO sharding text) a new parameter passes through between
    its state's layout and its own, one fsdp axis at a time (``TensorPlan.gather_layouts``);
    asked once per lowering. Gathered over two fsdp axes at once, libtpu 0.0.21 all-reduces the
    updated parameters at 128 chips instead of all-gathering them (docs/tpu.md)."""
    states = [optimizer.state[p] for p in params]
    keys, hp_keys = tuple(states[0]), tuple(hp)
    extras = tuple(name for name, t in (("grad_scale", grad_scale), ("skip", skip)) if t is not None)
    targets = list(params) + [state[k] for state in states for k in keys]
    grad_dtypes = tuple({g.dtype for g in grads})
    if grad_dtypes != (torch.float32,):
        grads = _as_fp32(grads)
    static = {k: v for k, v in group.items() if isinstance(v, bool)}
    head = [hp[k] for k in hp_keys] + [t for t in (grad_scale, skip) if t is not None]
    # Operand order decides buffer reuse. torch_xla numbers a graph's inputs in the order its
    # post-order walk meets them, last operand first; XLA pairs the donated ones with outputs
    # of the same byte size in input order against output order (OptimizeInputOutputBufferAlias),
    # and the outputs come in the order the tensors were created: parameters, then each
    # parameter's states. Listed last and reversed, the targets are met in that order, so each
    # one's new value takes its own old buffer. Any other order pairs a tensor with another
    # one's buffer, and XLA copies every state in and out of the step to break the cycles
    # (two extra passes over the optimizer states; tests/test_hlo.py checks there are none).
    flat = head + list(grads) + targets[::-1]
    key = (type(optimizer), tuple(static.items()), keys, hp_keys, extras)
    # This group's op (one per param group: groups of one optimizer share ``key``), found
    # again by the identity of its parameters and states (kept by swap_in) and the gradients'
    # dtypes; anything else lowers (or finds in _CACHE) a new one.
    identity = (tuple(map(id, targets)), grad_dtypes)
    plans = optimizer.__dict__.setdefault("_fused_ops", {})
    slot = (id(group),) + key
    plan = plans.get(slot)
    if plan is None or plan[0] != identity:
        if not applies(params, optimizer.state):
            plans[slot] = (identity, None, None, None)
            return None
        n = len(params)
        layouts = _shardings(targets)
        inner = _shard_layouts(layouts, params, states, keys)
        stages = tuple(() if layout is None or gather is None else tuple(gather(p))
                       for p, layout in zip(params, inner))

        def group_update(args, ops):
            tail, grads, mine = args[:len(head)], args[len(head):len(head) + n], args[len(head) + n:][::-1]
            params, k = mine[:n], len(keys)
            hp = dict(zip(hp_keys, tail))
            extra = dict(zip(extras, tail[len(hp_keys):]))
            states = [dict(zip(keys, mine[n + i * k:n + (i + 1) * k])) for i in range(n)]
            scale = GradScale(None, extra.get("grad_scale"), extra.get("skip"))
            new_params, new_states = update_group(optimizer, params, grads, states, hp, static, scale, ops)
            new_params = [p if layout is None else _through(ops, p, (layout,) + through)
                          for p, layout, through in zip(new_params, inner, stages)]
            return new_params + [state[name] for state in new_states for name in keys]  # in the order of targets

        plan = plans[slot] = (identity, _computation(key + (stages,), group_update, flat, layouts),
                              layouts is not None, donors(targets))
    _, computation, laid_out, donated = plan
    if computation is None:
        return None
    swap_in(targets, _run(computation, flat), donated if donate else None)
    return laid_out


def _through(ops, value, layouts: tuple[str, ...]):
    """``value`` laid out as each of ``layouts`` in turn."""
    for layout in layouts:
        value = ops.layout(value, layout)
    return value


def _shard_layouts(layouts: Optional[list[str]], params: list[torch.Tensor], states: list[dict],
                   keys: tuple) -> list[Optional[str]]:
    """Per parameter, the layout its new value is computed in before it takes its own: its
    first same-shaped state's, where that differs (ZeRO-1/2: replicated params, sharded
    states), else None. Each device then computes its shard of the new parameter and the
    parameter's replicated layout all-gathers it, as ZeRO's update does; left to GSPMD, the
    update was all-gathered and subtracted from the full parameter, which reads and writes
    it once more (16.8M MLP on v5e:2x4: 7% more HBM bytes than the hand-written loop)."""
    if layouts is None:
        return [None] * len(params)
    n, k = len(params), len(keys)
    inner = []
    for i, p in enumerate(params):
        shaped = [layouts[n + i * k + j] for j, key in enumerate(keys) if states[i][key].shape == p.shape]
        inner.append(shaped[0] if shaped and shaped[0] != layouts[i] else None)
    return inner


def donors(targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """The targets whose old buffers a step may reuse (see ``swap_in``): all but scalars."""
    return [t for t in targets if t.dim()]


def swap_in(targets: list[torch.Tensor], values: list[torch.Tensor],
            donate: Optional[list[torch.Tensor]] = None) -> None:
    """``t.copy_(v)`` for each pair, minus the copy: each target takes its value's lazy tensor.
    ``replace`` + ``commit_update`` are what functionalization does after an in-place op:
    the value becomes the target's, and views and aliases of the target (``p.detach()`` in
    ``state_dict()``, ``p.data``) see it too. (torch_xla's ``_replace_xla_tensor`` alone
    skips that: aliases keep the old value, and a checkpoint-loaded parameter, whose
    storage was updated by ``copy_``, is even reset to it at its next use.)

    ``donate``: targets (``donors(targets)``) whose old buffers are given to the next
    ``torch_xla.sync()`` to write results into, as torch_xla does for tensors updated in
    place. Only when that sync will execute this trace (not for a step that is only
    captured), and nothing else keeps the old values. Scalars are left out: a fresh 0-d
    tensor (a step counter) can hold torch_xla's shared cached constant, which must never be
    donated (torch_xla's own in-place path skips such read-only data; the flag does not).
    The targets are ``settle``d."""
    import torch_xla

    if donate:
        flag = torch_xla._XLAC._set_buffer_donation
        for target in donate:
            flag(target, True)
    unwrap, replace, commit = torch._from_functional_tensor, torch._functionalize_replace, torch._functionalize_commit_update
    for target, value in zip(targets, values):
        replace(target, unwrap(value))
        commit(target)
    settle(targets)


def settle(tensors: list[torch.Tensor]) -> None:
    """Apply the in-place updates just traced on ``tensors`` to their functional storage now,
    not at their next use. torch's functionalization applies an update (``copy_``, ``add_``,
    ``swap_in``) lazily, when the tensor is next read; once the step has executed that costs
    about 20 us per tensor on the host, against 3 us before (a 12-layer GPT-2's update,
    592 tensors: benchmarks/results/2026-11-history.md)."""
    sync = torch._functionalize_sync  # torch._sync's C++ call, without its Python wrapper (~1.5 us a tensor)
    for t in tensors:
        if isinstance(t, FunctionalTensor):  # AOTAutograd's Python wrapper: torch._sync knows how
            torch._sync(t)
        else:
            sync(t)


def sum_of_squares(tensors: list[torch.Tensor], orders: Optional[list[Optional[tuple[int, ...]]]] = None) -> torch.Tensor:
    """``0 + sum(t * t) + ...`` in fp32, in this order (the engine's global-norm expression),
    as one graph op. ``orders[i]``, when given, is tensor i's dims in memory order
    (``memory_order``): the sum reads it that way round. A sum is the same in any order, but
    XLA:CPU copies a tensor laid out transposed (a Linear weight's gradient) into row-major
    order before it reduces it, and that copy cost the 16.8M-parameter MLP's step about 10%
    of its CPU time (benchmarks/results/2026-11-history.md); read in memory order there is no copy. On a TPU
    the compiler lays the reduction out itself either way."""
    orders = list(orders) if orders is not None else [None] * len(tensors)

    def total(args, ops):
        out = 0
        for t, order in zip(args, orders):
            t = t.astype("float32")
            if order is not None:
                t = t.transpose(order)
            out = out + (t * t).sum()
        return [out]

    flat = _as_fp32(tensors)
    return _run(_computation(("sum_of_squares", tuple(orders)), total, flat), flat)[0]


_IR_LAYOUT = re.compile(r"^IR: .*?xla_shape=\w+\[[\d,]*\]\{([\d,]+)\}", re.M)


def memory_order(t: torch.Tensor) -> Optional[tuple[int, ...]]:
    """A pending tensor's dims from the outermost in memory to the innermost, as torch_xla
    lays out the op that makes it (a Linear weight's gradient, the transpose of a matmul, is
    ``(1, 0)``); None for the row-major default, or when torch_xla's description of the
    tensor names no layout. About 6 us: callers cache it (the graph is the same every step)."""
    import torch_xla

    found = _IR_LAYOUT.search(torch_xla._XLAC._get_xla_tensor_debug_info(t))
    if found is None:
        return None
    order = tuple(int(d) for d in reversed(found.group(1).split(",")))
    return None if order == tuple(range(t.dim())) or sorted(order) != list(range(t.dim())) else order


def _as_fp32(flat: list[torch.Tensor]) -> list[torch.Tensor]:
    # A bf16/fp16 lazy tensor can be f32 underneath (torch_xla's logical element type), which
    # an embedded computation's parameters must match: hand it fp32, as the torch path computes.
    return [t.float() if t.is_floating_point() and t.dtype != torch.float32 else t for t in flat]


def _run(computation, flat: list[torch.Tensor]) -> list[torch.Tensor]:
    import torch_xla

    return torch_xla._XLAC._xla_user_computation("xla::spmdzero_fused", flat, computation)


def _shardings(targets: list[torch.Tensor]) -> Optional[list[str]]:
    """Each target's sharding as HLO text, or None when one has none (a tensor outside an
    engine, or not yet annotated): the results are then left to the caller to annotate."""
    import torch_xla

    layouts = [torch_xla._XLAC._get_xla_sharding_spec(t) for t in targets]
    return layouts if all(layouts) else None


def _computation(key: tuple, fn, flat: list[torch.Tensor], out_shardings: Optional[list[str]] = None):
    """``fn(flat JAX arrays, ops) -> list of arrays`` as an XLA computation, lowered once per
    ``key``, operand shape signature and output shardings."""
    signature = (key, tuple((t.shape, t.dtype) for t in flat), tuple(out_shardings or ()))
    computation = _CACHE.get(signature)
    if computation is None:
        computation = _CACHE[signature] = _lower(fn, flat, out_shardings)
    return computation


def _lower(fn, flat: list[torch.Tensor], out_shardings: Optional[list[str]]):
    """An XLA computation lowered by JAX for the runtime's platform (lowering starts no JAX
    backend), each result behind a sharding constraint from ``out_shardings``."""
    from torch_xla._internal.jax_workarounds import maybe_get_jax
    import torch_xla.core.xla_builder as xb
    import torch_xla.runtime as xr

    # JAX imported the way torch_xla needs (after the PJRT client exists). Its first import draws
    # from NumPy's global RNG (jaxlib 0.7.1: about ten words), which the script may have seeded for
    # its own data (HelloDeepSpeed masks tokens with np.random); in a torch_xla process that import
    # comes here, at the first step, so the draw would shift the script's stream from then on
    numpy_rng = np.random.get_state()
    try:
        jax = maybe_get_jax()
    finally:
        np.random.set_state(numpy_rng)
    import jax.numpy as jnp

    ops = jax_ops(layout=lambda x, sharding: _layout_primitive().bind(x, sharding=sharding))
    shapes = [jax.ShapeDtypeStruct(tuple(t.shape), jnp.dtype(str(t.dtype).removeprefix("torch."))) for t in flat]
    platform = "tpu" if xr.device_type() == "TPU" else "cpu"
    if platform == "cpu":  # JAX would otherwise probe for a TPU (libtpu) before it lowers anything
        jax.config.update("jax_platforms", "cpu")

    def constrained(args):
        results = fn(args, ops)
        if out_shardings:
            layout = _layout_primitive()
            results = [layout.bind(r, sharding=s) for r, s in zip(results, out_shardings, strict=True)]
        return results

    # GSPMD's sharding custom calls, which torch_xla's partitioner reads (not Shardy's)
    with shardy_partitioner(False):
        traced = jax.jit(constrained, keep_unused=True).trace(shapes)
        proto = traced.lower(lowering_platforms=(platform,)).compiler_ir("hlo").as_serialized_hlo_module_proto()
    return xb.computation_from_module_proto("spmdzero_fused", proto)


_LAYOUT = []


def _layout_primitive():
    """A JAX primitive that lowers to GSPMD's ``Sharding`` custom call with a sharding given
    as HLO text (what ``mark_sharding`` would set), with no JAX mesh or devices: JAX's own
    ``with_sharding_constraint`` needs devices of JAX's backend, which here is not the
    runtime's."""
    if not _LAYOUT:
        import jax.interpreters.mlir as mlir
        from jax.extend import core
        from jaxlib import xla_client

        layout = core.Primitive("spmdzero_layout")
        layout.def_abstract_eval(lambda x, *, sharding: x)

        def lowering(ctx, x, *, sharding):
            proto = xla_client.HloSharding.from_string(sharding).to_proto()
            return [jax_private.wrap_with_sharding_op(ctx, x, ctx.avals_out[0], proto)]

        mlir.register_lowering(layout, lowering)
        _LAYOUT.append(layout)
    return _LAYOUT[0]
