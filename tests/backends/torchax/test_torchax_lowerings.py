"""The default backend's replacements of torchax lowerings (``backends/torchax/lowering/lowerings.py``,
``attention.py``) and the trace's view for libraries (``trace_view.py``), against torch."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spmdzero  # noqa: F401
from conftest import on_host

torchax = pytest.importorskip("torchax")

from spmdzero.backends.torchax.lowering import attention, lowerings
from spmdzero.backends.torchax.patches import trace_view


def _jax(t):
    import jax.numpy as jnp

    if t.dtype == torch.bfloat16:  # numpy has no bf16
        return jnp.asarray(t.detach().float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.detach().numpy())


def _sdpa_cases():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    left_padded = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    left_padded[0, :, :, :3] = False  # row 0: the first three keys are padding; queries 0-2 see no key
    additive = torch.zeros(2, 1, 6, 6).masked_fill(~left_padded, float("-inf"))
    minimum = torch.zeros(2, 1, 6, 6).masked_fill(~left_padded, torch.finfo(torch.float32).min)
    kv2 = (k[:, :2], v[:, :2])
    return {
        "no mask": ((q, k, v), {}),
        "causal": ((q, k, v), {"is_causal": True}),
        "bool mask, rows with every key masked": ((q, k, v), {"attn_mask": left_padded}),
        "-inf mask, rows with every key masked": ((q, k, v), {"attn_mask": additive}),
        "dtype-minimum mask (transformers' eager)": ((q, k, v), {"attn_mask": minimum}),
        "scale": ((q, k, v), {"scale": 0.3, "is_causal": True}),
        "gqa": ((q, *kv2), {"enable_gqa": True, "is_causal": True}),
    }


@pytest.mark.parametrize("case", list(_sdpa_cases()))
def test_sdpa_gives_torchs_values_and_gradients_with_every_mask(case):
    import jax

    (q, k, v), kwargs = _sdpa_cases()[case]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    # torch's own choice of kernel, as a plain run makes it: on rows masked by the dtype's minimum its
    # CPU flash kernel takes the gradient S times (uniform weights only by rounding: attention.py),
    # where its math kernel does not; the lowering gives the flash kernel's, which torch runs
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    expected.square().sum().backward()
    jkwargs = {n: _jax(a) if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()}

    def loss(q, k, v):
        return (attention.scaled_dot_product_attention(q, k, v, **jkwargs) ** 2).sum()

    out = attention.scaled_dot_product_attention(_jax(q), _jax(k), _jax(v), **jkwargs)
    grads = jax.grad(loss, argnums=(0, 1, 2))(_jax(q), _jax(k), _jax(v))
    np.testing.assert_allclose(np.asarray(out), expected.detach().numpy(), atol=1e-5)
    for ours, t in zip(grads, (q, k, v)):
        assert np.isfinite(np.asarray(ours)).all()
        np.testing.assert_allclose(np.asarray(ours), t.grad.numpy(), atol=1e-4)


def test_the_backend_lowers_sdpa_and_embedding_with_spmdzeros_replacements():
    env = torchax.default_env()
    lowerings.install(env)
    assert env._ops[F.scaled_dot_product_attention].func is attention.scaled_dot_product_attention
    assert env._ops[torch.ops.aten.embedding].func is lowerings.embedding
    lowerings.install(env)  # idempotent


class _Tagger(torch.nn.Module):
    """Records what ``torch.compiler.is_compiling()`` answered in its forward."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen = []

    def forward(self, x):
        self.seen.append(torch.compiler.is_compiling())
        return self.linear(x).square().mean()


def test_libraries_see_a_trace_as_a_trace_and_eager_code_as_eager():
    model = _Tagger()
    engine, *_ = spmdzero.initialize(model=model, config={"train_batch_size": 8, "optimizer": {
        "type": "SGD", "params": {"lr": 0.1}}})
    loss = engine(torch.randn(8, 4))
    engine.backward(loss)
    engine.step()
    assert model.seen == [True]  # traced once, as a compiler
    assert torch.compiler.is_compiling() is False  # and the flag is down again
    with pytest.raises(ValueError), trace_view.tracing():
        raise ValueError  # an error in a trace lowers it too
    assert torch.compiler.is_compiling() is False


class _PaddedEmbedding(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(96, 32, padding_idx=0)
        self.head = torch.nn.Linear(32, 96)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        return F.cross_entropy(self.head(torch.tanh(self.embed(ids))).view(-1, 96), labels.view(-1))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_an_embeddings_padding_row_takes_no_gradient_in_every_layout(stage, tied):
    torch.manual_seed(0)
    model = _PaddedEmbedding(tied)
    reference = copy.deepcopy(model)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 8, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    ids, labels = torch.randint(0, 96, (8, 16)), torch.randint(0, 96, (8, 16))
    ids[:, :3] = 0  # padding in every row
    loss = engine(ids, labels)
    engine.backward(loss)
    engine.step()
    reference(ids, labels).backward()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    # rows 12, 24, ... start the gradient's shards at stage 2: every row must match torch's
    np.testing.assert_allclose(on_host(engine.module.embed.weight).numpy(), reference.embed.weight.detach().numpy(),
                               atol=1e-6)


def test_a_number_in_a_vmapped_function_meets_a_torchax_tensor():
    """transformers 4.x's sliding-window mask: ``kv_idx > q_idx - sliding_window`` under ``torch.vmap``."""
    env = torchax.default_env()
    lowerings.install(env)
    with env:
        q = torch.arange(5, device="jax")
        result = torch.vmap(lambda x: x - 3)(q)
    np.testing.assert_array_equal(np.asarray(result._elem), np.arange(5) - 3)


def test_a_write_of_another_dtype_is_cast_to_the_tensors_as_in_torch():
    """``x[key] = value`` with fp32 values into a bf16 tensor, by a slice, a slice of a slice, a
    boolean mask and indices, and ``copy_`` and ``out=`` into a slice: ``x`` stays bf16 with torch's values, and JAX warns of no unsafe
    cast. Through the mask ``x`` became fp32 before, and the others warned. (torch casts for
    slices and refuses the other two; here they take the cast value, as torch's slices do.)"""
    import warnings

    env = torchax.default_env()
    lowerings.install(env)
    mask = [[False], [True], [True], [False]]
    writes = {"mask": lambda x, v, d: x.__setitem__(torch.tensor(mask, device=d).expand(4, 3)[:, 0], v),
              "indices": lambda x, v, d: x.__setitem__(torch.tensor([1, 2], device=d), v),
              "slice": lambda x, v, d: x.__setitem__(slice(1, 3), v),
              "slice of a slice": lambda x, v, d: x[1:3].__setitem__((slice(None), 0), v[:, 0]),
              "copy_ into a slice": lambda x, v, d: x[1:3].copy_(v),
              "out= into a slice": lambda x, v, d: torch.mul(v, 2.0, out=x[1:3])}
    for name, write in writes.items():
        value = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 0.5
        expected = torch.zeros(4, 3, dtype=torch.bfloat16)
        write(expected, value.to(torch.bfloat16) if name in ("mask", "indices") else value, "cpu")
        with env, warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            x = torch.zeros(4, 3, dtype=torch.bfloat16, device="jax")
            write(x, value.to("jax"), "jax")
        assert x.dtype == torch.bfloat16, name
        np.testing.assert_array_equal(np.asarray(x._elem.astype("float32")), expected.float().numpy(), err_msg=name)


class _OutArgument(torch.nn.Module):
    """A forward that writes a product into a buffer it made (``out=``), as TRL's helpers do."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        with torch.no_grad():
            scale = torch.empty(x.shape[0], 4, device=x.device)
            torch.mm(x, self.weight, out=scale)
        return self.head(x @ self.weight * scale.sigmoid()).square().mean()


def _trains_as_torch(model, steps: int):
    """``model`` (a loss of ``x [8, 4]``) trained by the engine and by torch, SGD: the losses
    agree at every step; returns the engine and the reference."""
    reference = copy.deepcopy(model)
    engine, *_ = spmdzero.initialize(model=model, config={"train_batch_size": 8, "gradient_clipping": 0.0,
                                                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        expected = reference(x)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    return engine, reference


@pytest.mark.slow
def test_an_out_argument_in_a_forward_is_written_as_torch_writes_it():
    torch.manual_seed(0)
    _trains_as_torch(_OutArgument(), steps=3)


class _TakeAlongDim(torch.nn.Module):
    """Log-probabilities taken along ids with ``torch.take_along_dim`` (TRL's online DPO): ids
    computed in the forward (an argmax) and ids from the batch, both int32 under torchax."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 6)

    def forward(self, x):
        logps = self.head(x).log_softmax(-1)
        ids = (x.abs() * 10).long() % 6
        best = torch.take_along_dim(logps, logps.argmax(-1, keepdim=True), dim=-1)
        return -(torch.take_along_dim(logps, ids, dim=1).mean() + best.mean() + logps.take_along_dim(ids[:1, :1], 0).mean())


def test_take_along_dim_with_int32_indices_trains_as_in_torch():
    """torch checks that ``take_along_dim``'s indices are int64; torchax's are int32, so every
    call in a forward stopped ("dtype of indices should be Long but got Int"). It is lowered as
    the gather it stands for (``lowerings.take_along_dim``)."""
    torch.manual_seed(0)
    _trains_as_torch(_TakeAlongDim(), steps=2)


class _Detached(torch.nn.Module):
    """Gradients stopped three ways: ``torch.detach``, ``.detach()`` and ``torch.no_grad()``."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.weight = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        y = x @ self.weight
        if self.how == "torch.detach":
            gate = torch.detach(y)
        elif self.how == "method":
            gate = y.detach()
        else:
            with torch.no_grad():
                gate = y * 1.0
        return (y * gate.sigmoid()).square().mean()


@pytest.mark.parametrize("how", ["torch.detach", "method", "no_grad"])
def test_a_value_detached_in_the_forward_takes_no_gradient(how):
    torch.manual_seed(0)
    model = _Detached(how)
    reference = copy.deepcopy(model)
    engine, *_ = spmdzero.initialize(model=model, config={"train_batch_size": 8, "gradient_clipping": 0.0,
                                                          "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    x = torch.randn(8, 4)
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    reference(x).backward()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    np.testing.assert_allclose(on_host(engine.module.weight).numpy(), reference.weight.detach().numpy(), atol=1e-6)


class _MovesItsLayer(torch.nn.Module):
    """Switch Transformers' router: ``self.classifier = self.classifier.to(self.dtype)`` in every
    forward, a no-op in the layer's own dtype, which ``Module.to`` runs under ``no_grad`` and
    assigns to each parameter's ``.data``."""

    def __init__(self):
        super().__init__()
        self.layer, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        self.layer = self.layer.to(torch.float32)
        return self.head(torch.tanh(self.layer(x))).square().mean()


def test_a_layer_moved_to_its_own_dtype_in_the_forward_still_trains():
    """The moved layer's weights stopped getting gradients (0.1 off plain torch after 3 SGD
    steps): under ``no_grad`` every result was a ``stop_gradient`` copy, the parameter itself
    included, and ``.data =`` put that copy in its place. A result that is the op's own tensor is
    now handed back as it is, as torch does."""
    torch.manual_seed(0)
    engine, reference = _trains_as_torch(_MovesItsLayer(), steps=3)
    for (name, p), (_, q) in zip(engine.module.named_parameters(), reference.named_parameters()):
        np.testing.assert_allclose(on_host(p).numpy(), q.detach().numpy(), atol=1e-6, err_msg=name)


class _WindowCache(torch.nn.Module):
    """transformers 4.x's RecurrentGemma attention: its keys and values cut to a window under
    ``torch.no_grad()`` (``_update_cache``), a slice, which torchax keeps as a lazy view; and a
    slice of that view read with grad enabled."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.head = torch.nn.Linear(4, 2), torch.nn.Linear(4, 8), torch.nn.Linear(2, 1)

    def forward(self, x):
        keys = self.key(x)
        with torch.no_grad():
            window = keys[:, -3:]
        scores = self.query(x) @ window[:, 1:].transpose(-1, -2)
        return self.head(scores.softmax(-1) @ window[:, 1:]).square().mean()


def test_a_slice_taken_under_no_grad_passes_no_gradient():
    """The window's keys passed gradients to the key projection, which torch gives none: a
    no_grad result that is a lazy view was not stopped (RecurrentGemma on 4.57 trained to other
    weights)."""
    torch.manual_seed(0)
    engine, reference = _trains_as_torch(_WindowCache(), steps=3)
    for (name, p), (_, q) in zip(engine.module.named_parameters(), reference.named_parameters()):
        np.testing.assert_allclose(on_host(p).numpy(), q.detach().numpy(), atol=1e-6, err_msg=name)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("zero_infinity", [False, True])
@pytest.mark.parametrize("concatenated", [False, True])
def test_ctc_loss_gives_torchs_values_and_gradients(reduction, zero_infinity, concatenated):
    """Padded and concatenated targets, an empty target, rows shorter than the input, a row
    too short for its targets (infinite, or 0 with zero_infinity), and a target equal to the blank
    (transformers 4.x's speech models keep one)."""
    import jax
    import jax.numpy as jnp

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 5, 6, generator=g, requires_grad=True)
    targets = torch.randint(1, 6, (5, 4), generator=g)
    targets[0, 2] = 0  # the blank
    input_lengths, target_lengths = torch.tensor([12, 10, 7, 3, 1]), torch.tensor([4, 3, 0, 2, 3])
    if concatenated:
        targets = torch.cat([targets[b, :target_lengths[b]] for b in range(5)])
    expected = F.ctc_loss(logits.log_softmax(-1), targets, input_lengths, target_lengths, reduction=reduction,
                          zero_infinity=zero_infinity)
    (expected.sum() if reduction == "none" else expected).backward()

    def loss(x):
        return jnp.sum(lowerings.ctc_loss(jax.nn.log_softmax(x, -1), _jax(targets), _jax(input_lengths),
                                          _jax(target_lengths), 0, reduction, zero_infinity))

    ours = lowerings.ctc_loss(jax.nn.log_softmax(_jax(logits), -1), _jax(targets), _jax(input_lengths),
                              _jax(target_lengths), 0, reduction, zero_infinity)
    np.testing.assert_allclose(np.asarray(ours), expected.detach().numpy(), rtol=1e-5)
    if zero_infinity or reduction == "none":  # torch's gradient of an infinite mean is NaN
        grads = np.asarray(jax.grad(loss)(_jax(logits)))
        np.testing.assert_allclose(np.nan_to_num(grads), np.nan_to_num(logits.grad.numpy()), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_layer_norm_gives_torchs_values_and_finite_half_precision_gradients(dtype):
    """Small activations in fp16: the backward of rsqrt(var + eps) overflowed in fp16 (NaN gradients
    for every fp16 GPT-2 and OPT); torch accumulates in fp32, and so does the lowering."""
    import jax
    import jax.numpy as jnp

    g = torch.Generator().manual_seed(0)
    x = (0.02 * torch.randn(4, 6, 32, generator=g)).to(dtype).requires_grad_()
    weight, bias = torch.randn(32, generator=g).to(dtype), torch.randn(32, generator=g).to(dtype)
    expected = F.layer_norm(x, (32,), weight, bias)
    expected.float().square().sum().backward()

    def loss(x):
        out, _, _ = lowerings.native_layer_norm(x, [32], _jax(weight), _jax(bias))
        return jnp.sum(out.astype(jnp.float32) ** 2)

    jx = jnp.asarray(x.detach().float().numpy()).astype(_jax(weight).dtype)
    out, _, _ = lowerings.native_layer_norm(jx, [32], _jax(weight), _jax(bias))
    grad = np.asarray(jax.grad(loss)(jx), np.float32)
    tolerance = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), expected.detach().float().numpy(), atol=tolerance,
                               rtol=tolerance)
    assert np.isfinite(grad).all()
    np.testing.assert_allclose(grad, x.grad.float().numpy(), rtol=5 * tolerance, atol=5 * tolerance * np.abs(grad).max())


@pytest.mark.slow
def test_an_fp16_gpt2_trains_on_finite_gradients_close_to_fp32():
    transformers = pytest.importorskip("transformers")
    norms = {}
    for precision in ("fp32", "fp16"):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
        config = {"train_batch_size": 8, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
        if precision == "fp16":
            config["fp16"] = {"enabled": True, "loss_scale": 1.0}
        engine, *_ = spmdzero.initialize(model=model, config=config)
        ids = torch.randint(3, 96, (8, 16), generator=torch.Generator().manual_seed(1))
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        norms[precision] = engine.get_global_grad_norm()
    assert np.isfinite(norms["fp16"]), norms
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=0.02), norms


class _Dropped(torch.nn.Module):
    """``dropout(x * w)`` summed with fixed weights ``c``: the gradient of ``w`` is
    ``sum_rows(c * x * kept / (1 - p))``, read from the same mask as the output's zeros."""

    def __init__(self, p: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 96))
        self.dropout = torch.nn.Dropout(p)

    def forward(self, x, c):
        out = self.dropout(x * self.w)
        return out, (out * c).sum()


@pytest.mark.parametrize("stage", [0, 2])
def test_dropout_draws_a_hash_mask_that_its_backward_draws_again(stage):
    """nn.Dropout on this backend (``backends/torchax/lowering/dropout.py``): a fraction p of the values
    dropped, the others scaled by 1/(1 - p), and the gradient taken through the forward's own
    mask, which the backward draws again from its seed (with another mask, the gradient would
    not match the output's zeros). A second call draws another mask."""
    from spmdzero.backends.torchax.lowering import dropout

    p = 0.3
    env = torchax.default_env()
    lowerings.install(env)
    assert env._ops[F.dropout].func is dropout.functional_dropout
    torch.manual_seed(0)
    model = _Dropped(p)
    w = model.w.detach().clone()
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 64, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(64, 96, generator=g) + 3.0, torch.randn(64, 96, generator=g)  # x * w is never 0
    out, loss = engine(x, c)
    engine.backward(loss)
    engine.step()
    out = np.asarray(on_host(out.detach()))
    kept = out != 0
    assert abs(kept.mean() - (1 - p)) < 0.02, kept.mean()
    np.testing.assert_allclose(out[kept], ((x * w).numpy() / (1 - p))[kept], rtol=1e-6)
    grad = (c.numpy() * x.numpy() * kept / (1 - p)).sum(0)
    np.testing.assert_allclose(on_host(engine.module.w).numpy(), w.numpy() - grad, rtol=1e-5, atol=1e-4)
    again, _ = engine(x, c)
    assert ((np.asarray(on_host(again.detach())) != 0) != kept).mean() > 0.2  # a fresh mask: about 2p(1-p) differ


class _InPlace(torch.nn.Module):
    """In-place ops torchax 0.0.13 lowers only out of place: ``exp_``, ``neg_``, ``clamp_max_``,
    and ``addmm_`` into a slice (TRL's chunked log-probabilities backward)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.weight = torch.nn.Parameter(torch.randn(4, 4) * 0.3)

    def forward(self, x):
        h = self.linear(x).mul(0.5)
        h.exp_()
        a = h + 0.0  # exp_'s backward reads its output: the other writes go into a copy
        a[2:].addmm_(x[2:], self.weight)
        a.neg_().clamp_max_(-0.2)
        return a.square().mean()


def test_in_place_ops_torchax_lowers_only_out_of_place_train_as_in_torch():
    from spmdzero.backends.torchax.lowering import lowerings

    env = torchax.default_env()
    lowerings.install(env)
    with env:
        x = torch.ones(3, 2, device="jax")
        x[1:].addmm_(torch.ones(2, 2, device="jax"), torch.ones(2, 2, device="jax"))  # "aten::addmm_ has no lowering"
        assert x.tolist() == [[1.0, 1.0], [3.0, 3.0], [3.0, 3.0]]
    torch.manual_seed(0)
    engine, reference = _trains_as_torch(_InPlace(), steps=2)
    np.testing.assert_allclose(on_host(engine.module.weight).numpy(), reference.weight.detach().numpy(), atol=1e-6)


def test_a_copy_from_a_slice_and_a_set_take_the_values_as_in_torch():
    """``x.copy_(y[..., -k:])`` (transformers 5.x's Mamba caches: Jamba stopped with torchax's
    AttributeError on a lazy view) and ``x.set_(y)`` (``torch.nn.utils.parametrize``, which PEFT's
    LoRA on 5.x's expert weights registers at every forward: no lowering), into a tensor and into
    a slice; a set_ of another shape is refused naming both."""
    env = torchax.default_env()
    lowerings.install(env)
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for into_slice in (False, True):
        expected = torch.zeros(4, 2) if into_slice else torch.zeros(3, 2)
        (expected[1:] if into_slice else expected).copy_(source[..., -2:])
        other = torch.zeros(3, 2)
        other.set_(source[:, 1:3].contiguous())
        with env:
            y = source.to("jax")
            x = torch.zeros(4, 2, device="jax") if into_slice else torch.zeros(3, 2, device="jax")
            (x[1:] if into_slice else x).copy_(y[..., -2:])
            z = torch.zeros(3, 2, device="jax")
            z.set_(y[:, 1:3])
            np.testing.assert_array_equal(np.asarray(x._elem), expected.numpy())
            np.testing.assert_array_equal(np.asarray(z._elem), other.numpy())
            with pytest.raises(RuntimeError, match=r"set_\(y\) with another shape.*\(3, 2\).*\(3, 4\)"):
                z.set_(y)


def test_a_parametrized_weight_trains_as_in_torch():
    """``torch.nn.utils.parametrize`` registered inside the forward and removed, as PEFT's
    ``ParamWrapper`` does for LoRA on transformers 5.x's expert weights: the parameter's ``set_``
    (no lowering before); and a second trace (a new batch shape) after it: the removal put the
    traced tensor back as a buffer, which shadowed the parameter then (parametrize's
    AssertionError)."""
    from torch.nn.utils import parametrize

    class Scaled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            parametrize.register_parametrization(self.fc, "weight", Scaled())
            try:
                return self.fc(x).square().mean()
            finally:
                parametrize.remove_parametrizations(self.fc, "weight", leave_parametrized=False)

    torch.manual_seed(0)
    engine, reference = _trains_as_torch(Model(), steps=2)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(2))  # another shape: traced again
    loss = engine(x)
    engine.backward(loss)
    assert float(loss) == pytest.approx(float(reference(x)), rel=1e-5)
    assert "weight" not in dict(engine.module.fc.named_buffers())
    np.testing.assert_allclose(on_host(engine.module.fc.weight).numpy(), reference.fc.weight.detach().numpy(),
                               atol=1e-6)


class _ReadsARow(torch.nn.Module):
    """LLaVA-NeXT's ``image_size.tolist()`` of a row of ``image_sizes``: a lazy view's values read
    on the host, on the eager path (torch refused ``.tolist()`` on the view)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        row = x[0, :2]  # a lazy view of the input
        scale = 1 + 0.1 * sum(abs(v) for v in row.tolist()) + 0.1 * float(np.abs(row.detach().numpy()).sum())
        return self.head(x * scale).square().mean()


def test_a_views_values_read_as_a_list_or_an_array_are_torchs():
    engine, _ = _trains_as_torch(_ReadsARow(), steps=2)
    assert engine.host_reads.noted  # a read: the eager path, where the view has values
