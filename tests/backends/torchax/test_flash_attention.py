"""SDPA through Pallas's flash kernel (spmdzero.backends.torchax.lowering.flash_attention): values and
gradients against torch's own SDPA, run here in Pallas's interpreter on the 8 CPU devices (the
same kernel, blocks and arithmetic the TPU runs), under the step's shard_map over the batch; the
calls it does not cover take the exact path and say why once; a model trains on it as on torch."""

import copy
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import Mesh

import spmdzero
from spmdzero.backends.torchax.lowering import attention, flash_dropout

BATCH, HEADS, LENGTH, DIM = 8, 4, 128, 32


def choice(kernel="flash"):
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    return attention.AttentionChoice(kernel, mesh=mesh, batch_axes=("fsdp",), batch_devices=8,
                                     interpret=kernel == "flash")


def key_padding() -> np.ndarray:
    """Left padding of several lengths; row 3 all padding, row 5 one padded key."""
    valid = np.ones((BATCH, LENGTH), bool)
    for row, padded in ((0, 10), (1, 127), (3, LENGTH), (5, 1), (6, 64)):
        valid[row, :padded] = False
    return valid


CASES = {  # name: (is_causal, mask builder, kv heads)
    "causal": (True, None, HEADS),
    "full": (False, None, HEADS),
    "causal, key padding": (True, lambda v: v[:, None, None, :], HEADS),
    "key padding": (False, lambda v: v[:, None, None, :], HEADS),
    "causal, key padding, GQA": (True, lambda v: v[:, None, None, :], 2),
    "key padding as [S] rows": (False, lambda v: v[:, None, :][:, :, None, :], 1),
}


def case_inputs(case: str, seed: int):
    """A case's causality, random q, k, v and output weights, mask (or None) and kv heads."""
    is_causal, mask_of, kv_heads = CASES[case]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, HEADS, LENGTH, DIM), np.float32)
    k, v = (rng.standard_normal((BATCH, kv_heads, LENGTH, DIM), np.float32) for _ in range(2))
    weights = rng.standard_normal((BATCH, HEADS, LENGTH, DIM), np.float32)
    return is_causal, q, k, v, weights, None if mask_of is None else mask_of(key_padding()), kv_heads


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_gives_torchs_values_and_gradients(case):
    is_causal, q, k, v, weights, mask, kv_heads = case_inputs(case, seed=0)
    gqa = kv_heads != HEADS

    chosen = choice()

    def ours(q, k, v):
        with attention.choosing(chosen):
            out = attention.scaled_dot_product_attention(q, k, v, None if mask is None else jnp.asarray(mask),
                                                         is_causal=is_causal, enable_gqa=gqa)
        return jnp.sum(out * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert chosen.calls == {"flash": 1} and not chosen.reasons

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    expected = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=None if mask is None else torch.tensor(mask),
                                              is_causal=is_causal, enable_gqa=gqa)
    (expected * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(np.asarray(out), expected.detach().numpy(), rtol=0, atol=2e-6)
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6, atol=2e-5)
    if mask is not None:  # rows that see no key are torch's zeros, and so are their gradients
        assert np.all(np.asarray(out)[3] == 0) and np.all(np.asarray(grads[0])[3] == 0)


@pytest.mark.parametrize("what, call, reason", [
    ("a dense mask", dict(attn_mask=np.tril(np.ones((LENGTH, LENGTH), bool))), "a boolean attn_mask of shape"),
    ("an additive mask", dict(attn_mask=np.zeros((BATCH, 1, 1, LENGTH), np.float32)), "additive float32"),
    ("dropout of 1", dict(dropout_p=1.0), "dropout_p=1.0, which drops every weight"),
    ("a length off the block", dict(length=100), "not a multiple of the kernel's 128-row block"),
    ("a batch off the devices", dict(batch=4), "does not divide over the 8 data-parallel devices"),
])
def test_what_the_kernel_does_not_cover_takes_the_exact_path_and_says_why_once(what, call, reason):
    batch, length = call.pop("batch", BATCH), call.pop("length", LENGTH)
    q = jnp.ones((batch, HEADS, length, DIM), jnp.float32)
    chosen = choice()

    class Env:  # dropout's key, as torchax's environment hands it
        @staticmethod
        def get_and_rotate_prng_key():
            return jax.random.key(0)

    with attention.choosing(chosen), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            attention.scaled_dot_product_attention(q, q, q, **{**call, "attn_mask": call.get("attn_mask")},
                                                   env=Env)
    assert chosen.calls == {"exact": 2}
    said = [str(w.message) for w in caught if "exact XLA path" in str(w.message)]
    assert len(said) == 1 and reason in said[0], said
    assert reason in chosen.describe()


def test_a_model_trains_on_the_kernel_as_on_torch():
    """Grouped-query causal attention with a key-padding mask, ZeRO-2, 3 SGD steps against torch."""

    class Attention(torch.nn.Module):
        def __init__(self, width=32, heads=4, kv_heads=2):
            super().__init__()
            self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
            self.q, self.o = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
            self.k, self.v = (torch.nn.Linear(width, kv_heads * self.dim) for _ in range(2))

        def forward(self, x, valid, target):
            b, n, _ = x.shape
            q = self.q(x).view(b, n, self.heads, self.dim).transpose(1, 2)
            k, v = (p(x).view(b, n, self.kv_heads, self.dim).transpose(1, 2) for p in (self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], is_causal=True,
                                               enable_gqa=True)
            return ((self.o(y.transpose(1, 2).reshape(b, n, -1)) - target) ** 2).mean()

    torch.manual_seed(0)
    model = Attention()
    reference = copy.deepcopy(model)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "spmd": {"attention": "flash"}})
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, target, valid = torch.randn(8, LENGTH, 32), torch.randn(8, LENGTH, 32), torch.tensor(key_padding())
    for _ in range(3):
        loss = engine(x, valid, target)
        engine.backward(loss)
        engine.step()
        optimizer.zero_grad()
        expected = reference(x, valid, target)
        expected.backward()
        optimizer.step()
        assert abs(loss.item() - expected.item()) <= 1e-6
    for (name, got), want in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), atol=1e-6, rtol=0, msg=name)
    assert engine.attention_kernels.describe() == "Pallas flash kernel x1"


def test_auto_is_the_exact_path_off_tpu_and_the_kernel_on_it():
    assert attention.AttentionChoice.resolve("auto", "cpu").kernel == "exact"
    on_tpu = attention.AttentionChoice.resolve("auto", "tpu")
    assert on_tpu.kernel == "flash" and not on_tpu.interpret
    forced = attention.AttentionChoice.resolve("flash", "cpu")
    assert forced.kernel == "flash" and forced.interpret
    assert attention.AttentionChoice.resolve("exact", "tpu").kernel == "exact"


def test_the_flash_kernel_on_the_torch_xla_backend_says_where_it_runs():
    from spmdzero.config.errors import ConfigError

    with pytest.raises(ConfigError, match="spmd.attention='flash' is implemented on the torchax backend"):
        spmdzero.initialize(model=torch.nn.Linear(4, 4), config={
            "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "spmd": {"backend": "torch_xla", "attention": "flash"}})


@pytest.mark.parametrize("padded", [False, True], ids=["packed ids", "key padding"])
def test_a_transformers_decoder_trains_on_the_kernel_as_on_torch(padded):
    """Llama (grouped-query) from its config: transformers' dense causal mask reaches the kernel as
    its structure (hf_masks): packed-sequence ids without an attention_mask, key padding with one."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    reference = copy.deepcopy(model)
    ids, mask = torch.randint(0, 256, (8, LENGTH)), torch.ones(8, LENGTH, dtype=torch.long)
    mask[0, :30] = mask[2, :100] = 0
    batch = {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100)} | ({"attention_mask": mask} if padded
                                                                           else {})
    engine = _trains_on_the_kernel_as_torch(model, reference, batch)
    assert engine.attention_kernels.describe() == "Pallas flash kernel x2"  # both layers, no exact path


def _trains_on_the_kernel_as_torch(model, reference, batch):
    """2 SGD steps of ``model`` on the flash kernel (ZeRO-2) and of ``reference`` in torch: the
    same losses and parameters, to 1e-6. Returns the engine."""
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "spmd": {"attention": "flash"}})
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        optimizer.zero_grad()
        expected = reference(**batch).loss
        expected.backward()
        optimizer.step()
        assert abs(loss.item() - expected.item()) <= 1e-6
    for (name, got), want in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), atol=1e-6, rtol=0, msg=name)
    return engine


# ---- dropout on the weights: spmdzero's own kernel (flash_dropout.py) ----------------------------

RATE = 0.2


class DropoutEnv:
    """The trace's dropout key, as torchax's environment hands it out."""

    def __init__(self, seed=0):
        self.key = jax.random.key(seed)

    def get_and_rotate_prng_key(self):
        return self.key


def _dropout_call(chosen, q, k, v, mask, is_causal, gqa, env):
    with attention.choosing(chosen):
        return attention.scaled_dot_product_attention(q, k, v, None if mask is None else jnp.asarray(mask),
                                                      dropout_p=RATE, is_causal=is_causal, enable_gqa=gqa, env=env)


@pytest.mark.parametrize("case", ["causal", "full", "causal, key padding", "causal, key padding, GQA"])
def test_the_dropout_kernel_gives_torchs_values_and_gradients_for_its_mask(case):
    """torch's SDPA math with the kernel's own mask (``keep_mask``, the same hash in XLA), kept
    weights scaled by 1/(1-p) as torch's dropout: values and gradients, fp32."""
    is_causal, q, k, v, weights, mask, kv_heads = case_inputs(case, seed=1)
    gqa, env, chosen = kv_heads != HEADS, DropoutEnv(), choice()

    def ours(q, k, v):
        out = _dropout_call(chosen, q, k, v, mask, is_causal, gqa, env)
        return jnp.sum(out * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert chosen.calls == {"flash-dropout": 1} and not chosen.reasons
    keep = np.asarray(flash_dropout.keep_mask(flash_dropout.row_seeds(env.key, (BATCH, HEADS)), LENGTH, LENGTH, RATE))
    assert abs(keep.mean() - (1 - RATE)) < 0.005  # 524,288 draws: the standard deviation is 0.0006

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    rk, rv = (t.repeat_interleave(HEADS // kv_heads, dim=1) for t in (tk, tv))
    scores = tq @ rk.transpose(-1, -2) / DIM ** 0.5
    allowed = torch.ones(LENGTH, LENGTH, dtype=torch.bool)
    if is_causal:
        allowed = allowed.tril()
    if mask is not None:
        allowed = allowed & torch.tensor(mask)
    dead = ~allowed.expand_as(scores).any(-1, keepdim=True)  # torch's zeros for rows that see no key
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")).masked_fill(dead, 0.0), -1).masked_fill(dead, 0)
    expected = (probs * torch.tensor(keep) / (1 - RATE)) @ rv
    (expected * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(np.asarray(out), expected.detach().numpy(), rtol=0, atol=2e-6)
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6, atol=2e-5)


def test_the_dropout_masks_are_the_exact_paths_and_do_not_depend_on_the_chip_count():
    """The exact path draws the kernel's masks (the same hash), so either path drops the same
    weights; one seed per batch row and head, split with the rows: 8 chips or 2 give the same
    values. Rows and heads draw different masks, and another key draws others."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((BATCH, HEADS, LENGTH, DIM), np.float32) for _ in range(3))
    two = attention.AttentionChoice("flash", mesh=Mesh(np.array(jax.devices()[:2]), ("fsdp",)),
                                    batch_axes=("fsdp",), batch_devices=2, interpret=True)
    outs = {name: np.asarray(jax.jit(lambda q, k, v, c=c, e=e: _dropout_call(c, q, k, v, None, True, False, e))(q, k, v))
            for name, c, e in (("8 chips", choice(), DropoutEnv()), ("2 chips", two, DropoutEnv()),
                               ("exact", choice("exact"), DropoutEnv()), ("another key", choice(), DropoutEnv(1)))}
    np.testing.assert_allclose(outs["2 chips"], outs["8 chips"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(outs["exact"], outs["8 chips"], rtol=0, atol=2e-6)
    assert np.abs(outs["another key"] - outs["8 chips"]).max() > 0.1
    keep = np.asarray(flash_dropout.keep_mask(flash_dropout.row_seeds(jax.random.key(0), (BATCH, HEADS)),
                                              LENGTH, LENGTH, RATE))
    agree = (keep[0, 0] == keep[0, 1]).mean(), (keep[0, 0] == keep[1, 0]).mean()
    independent = RATE ** 2 + (1 - RATE) ** 2  # 0.68 for two independent masks
    assert all(abs(a - independent) < 0.01 for a in agree), agree


def _gpt2(**dropout):
    import transformers

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=LENGTH, **dropout)
    config._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(config)


def _bert(**dropout):
    import transformers

    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                     vocab_size=256, max_position_embeddings=LENGTH, **dropout)
    config._attn_implementation = "sdpa"
    return transformers.BertForMaskedLM(config)


def _padded_batch():
    """Token ids with left padding in one row and right padding in another, labels ignoring it."""
    ids = torch.randint(0, 256, (8, LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(8, LENGTH, dtype=torch.long)
    mask[1, :20] = mask[3, 100:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


needs_transformers_5 = pytest.mark.skipif(
    int(__import__("transformers").__version__.split(".")[0]) < 5,
    reason="transformers 4.x's encoders build a dense mask (modeling_attn_mask_utils), which takes the exact path")


@pytest.mark.parametrize("model", [
    pytest.param(lambda: _gpt2(attn_pdrop=0.1, resid_pdrop=0.0, embd_pdrop=0.0), id="gpt2"),
    pytest.param(lambda: _bert(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.0), id="bert",
                 marks=needs_transformers_5)])
def test_a_transformers_model_trains_with_attention_dropout_on_the_kernel_as_on_the_exact_path(model):
    """GPT-2 (causal) and BERT (bidirectional) from their configs with attention dropout 0.1
    (their stock rate; the other dropouts off, as torch would draw them otherwise), on a padded
    batch: ZeRO-2, 3 steps on the kernel and on the exact path, which drops the same weights.
    Losses and parameters agree; the report names the kernel."""
    batch, runs = _padded_batch(), {}
    for kernel in ("flash", "exact"):
        torch.manual_seed(0)
        engine, *_ = spmdzero.initialize(model=model().train(), config={
            "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "spmd": {"attention": kernel}})
        losses = []
        for _ in range(3):
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[kernel] = (losses, {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()},
                        engine.attention_kernels.describe())
    (flash, flash_params, said), (exact, exact_params, _) = runs["flash"], runs["exact"]
    assert said == "Pallas flash kernel with dropout x2", said
    np.testing.assert_allclose(flash, exact, rtol=0, atol=2e-6)
    for name, want in exact_params.items():
        torch.testing.assert_close(flash_params[name], want, atol=2e-6, rtol=0, msg=name)
    assert flash[-1] < flash[0]


@needs_transformers_5
def test_a_transformers_encoder_trains_on_the_kernel_as_on_torch():
    """BERT from its config, no dropout, a padded batch: transformers 5.x's bidirectional mask
    reaches the kernel as key padding (hf_masks), and 2 SGD steps match torch's."""
    torch.manual_seed(0)
    model = _bert(attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0).train()
    reference = copy.deepcopy(model)
    engine = _trains_on_the_kernel_as_torch(model, reference, _padded_batch())
    assert engine.attention_kernels.describe() == "Pallas flash kernel x2"


def test_the_dropout_kernel_in_a_scanned_rematerialized_stage_3_step_drops_what_the_exact_path_drops():
    """GPT-2 with attention dropout under ``scan_layers: "stacked"``, ``remat: "full"`` and ZeRO-3
    (the layer loop's body calls the kernel once, and its backward recomputes the forward): 2 AdamW
    steps on a padded batch give the exact path's losses."""
    batch, losses = _padded_batch(), {}
    for kernel in ("flash", "exact"):
        torch.manual_seed(0)
        engine, *_ = spmdzero.initialize(model=_gpt2(attn_pdrop=0.1, resid_pdrop=0.0, embd_pdrop=0.0).train(), config={
            "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "spmd": {"attention": kernel, "scan_layers": "stacked", "remat": "full"}})
        losses[kernel] = []
        for _ in range(2):
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses[kernel].append(loss.item())
        if kernel == "flash":
            assert engine.attention_kernels.describe() == "Pallas flash kernel with dropout x1"  # the loop body
    np.testing.assert_allclose(losses["flash"], losses["exact"], rtol=0, atol=2e-6)
