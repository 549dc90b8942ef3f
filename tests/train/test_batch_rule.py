"""The batch rule (spmd.rank) on the engine: what a training forward may feed, what is counted,
what the loader draws, batches that do not divide over the devices, non-tensor fields, and
shape buckets (spmd.pad_to_multiple_of). One 8-device CPU process, tiny models."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import spmdzero
from spmdzero.train.data import pad_sequences

from conftest import BACKENDS, batch_device, compile_count, spmdzero_log, tiny_mlp

ADAMW = {"type": "AdamW", "params": {"lr": 0.01}}
# plain SGD, unclipped (DeepSpeed clips at 1.0 by default): compared with torch.optim.SGD
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "gradient_clipping": 0.0}


def engine_for(rule="device", micro=2, model=None, **extra):
    config = {"train_micro_batch_size_per_gpu": micro, "optimizer": ADAMW, "spmd": {"rank": rule}, **extra}
    return spmdzero.initialize(model=model or tiny_mlp(), config=config)[0]


def train_step_on(engine, *inputs, **kwargs):
    loss = engine(*inputs, **kwargs).pow(2).mean()
    engine.backward(loss)
    engine.step()


def sgd_steps(model, x, steps, lr, *extra):
    """Plain PyTorch: ``steps`` SGD steps of the same loss as ``train_step_on``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        model(x, *extra).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def train_step(engine, rows):
    loss = engine(torch.randn(rows, 16)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def test_initialize_prints_the_resolved_numbers_once_per_process(monkeypatch):
    """Said once, not once per engine: a script that builds more engines with the same batch
    config (examples/train.py measures the other ZeRO stages) hears the numbers once; a changed
    batch config is said."""
    from spmdzero.observe import console

    monkeypatch.setattr(console, "_SAID", set(), raising=False)  # as in a fresh process
    with spmdzero_log() as records:
        engine_for("process", micro=8, gradient_accumulation_steps=2)
        engine_for("process", micro=8, gradient_accumulation_steps=2, zero_optimization={"stage": 1})
        said = [r.getMessage() for r in records if "batch rule" in r.getMessage()]
        engine_for("process", micro=4, gradient_accumulation_steps=2)
    assert len(said) == 1
    assert "spmd.rank='process'" in said[0] and "global batch 16 = 8 per rank" in said[0]
    assert "x 2 accumulation x 1 ranks" in said[0] and "8 rows per process" in said[0]
    assert "1 per device" in said[0]
    changed = [r.getMessage() for r in records if "batch rule" in r.getMessage()][1:]
    assert len(changed) == 1 and "global batch 8 = 4 per rank" in changed[0]


def test_under_the_process_rule_deepspeeds_numbers_are_per_process():
    engine = engine_for("process", micro=8)
    assert (engine.dp_world_size, engine.world_size) == (1, 1)
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()) == (8, 8)
    train_step(engine, 8)  # 8 rows: one per device
    assert engine.global_samples == 8


def test_the_process_rule_loader_draws_like_deepspeeds_loader_on_that_rank():
    dataset = TensorDataset(torch.arange(64.0).unsqueeze(1).repeat(1, 16))
    engine, _, loader, _ = spmdzero.initialize(model=tiny_mlp(), training_data=dataset, config={
        "train_micro_batch_size_per_gpu": 8, "optimizer": ADAMW, "spmd": {"rank": "process"}})
    deepspeed_rank0 = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, num_replicas=1, rank=0))
    assert len(loader) == len(deepspeed_rank0) == 8
    (ours,), (theirs,) = next(iter(loader)), next(iter(deepspeed_rank0))
    assert torch.equal(ours.cpu(), theirs)


def test_more_rows_than_the_config_says_are_trained_and_counted_as_deepspeed_would():
    """DeepSpeed never compares a forward's rows with train_micro_batch_size_per_gpu (a reward
    model feeds chosen and rejected sequences as one batch of twice the rows). It used to be
    refused ("got 32 rows per process, more than the 16")."""
    engine = engine_for("device", micro=2, **SGD)  # 2 per device x 8 devices = 16 rows per micro-step
    reference = tiny_mlp()
    x = torch.randn(32, 16)
    with spmdzero_log() as records, warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        train_step_on(engine, x)
        train_step_on(engine, x)
    # DeepSpeed's count: train_batch_size() per optimizer step; samples/s: the rows fed
    assert engine.global_samples == 2 * engine.train_batch_size() == 32 and engine.samples_last_step == 32
    noted = [r.getMessage() for r in records if "32 rows per process, more than the 16" in r.getMessage()]
    assert len(noted) == 1  # once, in the log
    sgd_steps(reference, x, 2, lr=0.01)
    for (name, ours), theirs in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_fewer_rows_warn_once_and_global_samples_counts_as_deepspeed_counts():
    """DeepSpeed adds ``train_batch_size()`` to ``global_samples`` at each optimizer step, whatever
    the tensors' shapes (engine.py, ``_take_model_step``); samples/s count the rows fed. It used
    to count the rows fed: 16 + 8 + 8."""
    engine = engine_for("device", micro=2)
    train_step(engine, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(engine, 8)  # an epoch's partial last batch
        train_step(engine, 8)
    fewer = [w for w in caught if "fewer than the 16" in str(w.message)]
    assert len(fewer) == 1 and fewer[0].filename == __file__
    assert engine.train_batch_size() == 16 and engine.global_samples == 3 * 16
    assert engine.samples_last_step == 8


def test_a_batch_that_does_not_divide_over_the_devices_runs_replicated():
    engine = engine_for("device", micro=2)
    reference = tiny_mlp()
    x = torch.randn(12, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(engine, 12)
        engine.eval()
        out = engine(x[:3])
        engine(x[:3])
    replicated = [w for w in caught if "does not divide over the 8 data-parallel devices" in str(w.message)]
    assert len(replicated) == 2  # once per shape: 12 rows, 3 rows
    assert engine.global_samples == engine.train_batch_size() == 16
    engine2 = engine_for("device", micro=2)
    engine2.eval()
    torch.testing.assert_close(engine2(x[:3]).cpu(), reference(x[:3]), rtol=1e-5, atol=1e-5)
    assert out.shape == (3, 8)


def test_non_tensor_fields_stay_aligned_with_their_rows():
    class Named(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return {"x": torch.full((16,), float(i)), "name": f"row{i}", "tag": "same"}

    _, _, loader, _ = spmdzero.initialize(model=tiny_mlp(), training_data=Named(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW})
    batch = next(iter(loader))
    rows = batch["x"][:, 0].cpu().int().tolist()
    assert len(batch["name"]) == len(rows) == 16
    assert batch["name"] == [f"row{r}" for r in rows]
    assert batch["tag"] == ["same"] * 16


class TinyLM(torch.nn.Module):
    """Embedding + linear head; a masked token loss, as Hugging Face models compute it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)

    def forward(self, input_ids, attention_mask, labels):
        hidden = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        return torch.nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten(),
                                                 ignore_index=-100)


def lm_batch(length, rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (rows, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pad", ["default", "off", 16])
def test_shape_buckets_stop_recompiles_from_variable_lengths(pad, backend):
    """With no key, the torchax backend pads to shape buckets (powers of two from 128), torch_xla
    does not (its outputs would be cut inside its traced step); ``"shape_buckets": false`` feeds
    the lengths as they are, and ``pad_to_multiple_of`` chooses the multiple on either backend."""
    keys = {"default": {}, "off": {"shape_buckets": False}}.get(pad, {"pad_to_multiple_of": pad})
    spmd = {"rank": "device", "backend": backend, **keys}
    engine = spmdzero.initialize(model=TinyLM(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW, "spmd": spmd})[0]
    # warm-up at one length, then the lengths change (torch_xla caches the programs of the process:
    # each case its own lengths)
    first = {"default": 5, "off": 6}.get(pad, 7)
    bucketed = pad == 16 or (pad == "default" and backend == "torchax")
    # past the first bucket (128): a new bucket compiles once, as warm-up, not a recompile to warn of
    lengths = [first] * 4 + [first + 4, first + 8] + ([150, 140] if pad == "default" and bucketed else [])
    compiles = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, length in enumerate(lengths):
            before = compile_count(engine)
            engine.backward(engine(**lm_batch(length, seed=step)))
            engine.step()
            compiles.append(compile_count(engine) - before)
    guard = [str(w.message) for w in caught if "recompiled after warm-up" in str(w.message)]
    if bucketed:
        assert compiles[4:6] == [0, 0] and compiles[7:] in ([], [0])
        assert compiles[6:7] in ([], [1])  # the 256 bucket: its training forward (the update is the same)
        assert not guard
    else:
        assert all(c > 0 for c in compiles[4:])
        assert len(guard) == 1 and "pad_to_multiple_of" in guard[0]


def test_padding_names_only_sequence_inputs():
    batch = {**lm_batch(5, rows=2), "token_type_ids": torch.zeros(2, 5, dtype=torch.long),
             "scores": torch.randn(2, 3), "class_labels": torch.tensor([0, 1])}
    padded = pad_sequences((batch,), 8, pad_id=7)[0]
    assert padded["input_ids"].shape == (2, 8) and (padded["input_ids"][:, 5:] == 7).all()
    assert (padded["attention_mask"][:, 5:] == 0).all() and (padded["labels"][:, 5:] == -100).all()
    assert (padded["token_type_ids"][:, 5:] == 0).all()
    assert padded["scores"].shape == (2, 3) and padded["class_labels"].shape == (2,)


def test_a_dict_with_a_sequence_of_unknown_padding_is_left_whole_and_said_once():
    """A script's own ``src_tokens`` beside the ``attention_mask`` (HelloDeepSpeed's collator):
    padding the mask alone gave the model sequences of two lengths (a broadcasting error in its
    attention), so the dict is left as it is, and a warning names the keys once."""
    import warnings

    batch = {"src_tokens": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long),
             "tgt_tokens": torch.ones(2, 5, dtype=torch.long)}
    with pytest.warns(UserWarning, match=r"keys \['src_tokens', 'tgt_tokens'\] unpadded"):
        assert pad_sequences(batch, 8) is batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pad_sequences(batch, 8) is batch
    no_mask = {"input_ids": torch.ones(2, 5, dtype=torch.long)}
    assert pad_sequences(no_mask, 8)["input_ids"].shape == (2, 5)  # no mask: padding would change the result


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_padding_with_the_attention_mask_keeps_transformers_losses(arch):
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64,
            max_position_embeddings=64))
    model.eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a row already padded by the collator
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "token_type_ids": torch.zeros_like(ids)}
    if arch == "gpt2":
        del batch["token_type_ids"]
    padded = pad_sequences(batch, 16, pad_id=model.config.pad_token_id or 0)
    assert padded["input_ids"].shape == (3, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(**padded).loss, model(**batch).loss, rtol=1e-5, atol=1e-6)


class Sentences(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.arange(1, 2 + i % 7)  # lengths 1..7


def pad_to_longest(items):  # what a DataCollatorWithPadding does, per DeepSpeed rank
    ids = torch.nn.utils.rnn.pad_sequence(items, batch_first=True)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": ids.masked_fill(ids == 0, -100)}


@pytest.mark.parametrize("pad", [None, 16])
def test_the_training_loader_aligns_and_pads_ranks_batches_on_the_host(pad):
    spmd = {"pad_to_multiple_of": pad} if pad else {}
    _, _, loader, _ = spmdzero.initialize(model=TinyLM(), training_data=Sentences(), collate_fn=pad_to_longest,
                                          config={"train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW,
                                                  "spmd": spmd})
    for batch in loader:
        ids, mask, labels = (batch[k].cpu() for k in ("input_ids", "attention_mask", "labels"))
        assert ids.shape == mask.shape == labels.shape and (pad is None or ids.shape == (8, 16))
        assert torch.equal(mask, (ids != 0).long()) and torch.equal(labels, ids.masked_fill(ids == 0, -100))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hugging_face_collators_batch_encodings_are_split_like_dicts(backend):
    """transformers' collators (DataCollatorWithPadding, ...ForLanguageModeling) return a
    BatchEncoding, a UserDict and not a dict: every rank's rows reach the devices, padded, and
    are counted (the first rank's alone used to be trained, on the host, with a warning that
    called it a partial batch); passed to the engine directly, it is moved the same way."""
    from transformers import BatchEncoding

    engine, _, loader, _ = spmdzero.initialize(
        model=TinyLM(), training_data=Sentences(), collate_fn=lambda items: BatchEncoding(pad_to_longest(items)),
        config={"train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW,
                "spmd": {"pad_to_multiple_of": 16, "backend": backend}})
    seen = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for batch in loader:
            assert isinstance(batch, BatchEncoding) and batch["input_ids"].device.type == batch_device(backend)
            assert batch["input_ids"].shape == (8, 16)
            seen += batch["input_ids"].shape[0]
            engine.backward(engine(**batch))
            engine.step()
    assert seen == engine.global_samples == len(Sentences())

    class WholeBatch(TinyLM):  # forward(batch), the BatchEncoding passed as it is
        def forward(self, batch):
            return super().forward(**batch)

    engine = engine_for(micro=1, model=WholeBatch(), spmd={"backend": backend})
    engine.backward(engine(BatchEncoding(pad_to_longest([Sentences()[i] for i in range(8)]))))
    engine.step()
    assert engine.global_samples == 8


def test_ranks_batches_of_different_shapes_without_a_mask_are_a_clear_error():
    _, _, loader, _ = spmdzero.initialize(model=tiny_mlp(), training_data=Sentences(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW},
        collate_fn=lambda items: torch.nn.utils.rnn.pad_sequence(items, batch_first=True))
    with pytest.raises(ValueError, match="different shapes for batch.*pad to a fixed length in your collate_fn"):
        next(iter(loader))


class SequenceFirst(torch.nn.Module):
    """nn.Transformer's default layout: ``src`` is [seq, batch, d], its padding mask [batch, seq]."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)

    def forward(self, src, src_key_padding_mask=None):
        return self.layer(src, src_key_padding_mask=src_key_padding_mask)


def assert_trained_like(engine, reference):
    for (name, ours), theirs in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("seq", [16, 4])
def test_a_sequence_first_model_says_its_batch_dim(seq):
    """A [seq, batch, d] input with 8 rows (1 per device): dim 0 used to be taken for the batch:
    seq 16 was refused as "16 rows", seq 4 ran replicated with a "fewer rows" warning and
    global_samples counted 4. With spmd.batch_dim 1 the batch is split and counted on dim 1;
    without it, the forward trains as fed and a hint names the key."""
    src = torch.randn(seq, 8, 8)
    mask = torch.zeros(8, seq, dtype=torch.bool)
    mask[0, -1] = True
    reference = SequenceFirst()
    sgd_steps(reference, src, 1, 0.01, None)

    engine = engine_for("device", micro=1, model=SequenceFirst(), **SGD, spmd={"batch_dim": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: not "fewer rows", not "replicated"
        train_step_on(engine, src)
    assert engine.global_samples == 8
    assert_trained_like(engine, reference)

    # per argument: the mask is batch-first
    engine = engine_for("device", micro=1, model=SequenceFirst(), **SGD,
                        spmd={"batch_dim": {"src": 1, "src_key_padding_mask": 0}})
    reference = SequenceFirst()
    reference(src, mask).pow(2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = engine(src, src_key_padding_mask=mask).pow(2).mean()
    engine.backward(loss)
    for (name, p), ref in zip(engine.module.named_parameters(), reference.parameters()):
        assert p.grad is None  # the gradients are the engine's
    assert engine.global_samples == 0 and engine._rows_since_step == 8

    engine = engine_for("device", micro=1, model=SequenceFirst(), **SGD)
    with pytest.warns(UserWarning, match='set "spmd": {"batch_dim": 1}'):
        train_step_on(engine, src)
    assert engine.samples_last_step == seq  # trained as fed: dim 0, the documented default
    assert engine.global_samples == 8  # DeepSpeed's count: train_batch_size() per step (it counted seq)


def test_a_lookup_table_passed_before_the_batch_is_not_taken_for_it():
    """``engine(prototypes[16, 4], x[8, 4])`` with 8 rows per micro-step: x is the batch (it has
    the configured rows), the table is replicated. It used to be refused as 16 rows."""

    class Nearest(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, prototypes, x):
            return self.proj(x) @ prototypes.T

    prototypes, x = torch.randn(16, 4), torch.randn(8, 4)
    engine = engine_for("device", micro=1, model=Nearest(), **SGD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step_on(engine, prototypes, x)
    assert engine.global_samples == 8
    reference = Nearest()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    reference(prototypes, x).pow(2).mean().backward()
    optimizer.step()
    assert_trained_like(engine, reference)


def test_torchax_shape_buckets_by_default_keep_torchs_losses_and_cut_outputs_back(monkeypatch):
    """No key: a GPT-2 fed rows of 5 to 40 tokens trains as plain torch does on the same rows (the
    loss of the module and one computed outside from the logits), compiles one training program
    (the model's 64 positions cap the bucket), hands back logits of the length fed, evaluates
    without a compile per length, and says the buckets once."""
    import transformers

    from spmdzero.observe import console

    monkeypatch.setattr(console, "_SAID", set(), raising=False)  # as in a fresh process

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))

    def batch(length, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, 64, (8, length), generator=g)
        mask = torch.ones_like(ids)
        mask[1, length // 2:] = 0  # a row the collator padded already
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    reference = gpt2()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    engine, *_ = spmdzero.initialize(model=gpt2(), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "spmd": {"backend": "torchax"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with spmdzero_log() as records:
        for step, length in enumerate([5, 17, 40, 9]):
            fed = batch(length, step)
            out = engine(**fed)
            assert out.logits.shape == (8, length, 64)  # cut back to the length fed
            if step % 2:  # a loss computed outside the module, from the cut logits
                loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1),
                                                         fed["labels"][:, 1:].flatten(), ignore_index=-100)
            else:
                loss = out.loss
            engine.backward(loss)
            engine.step()
            theirs = reference(**fed)
            expected = theirs.loss if step % 2 == 0 else torch.nn.functional.cross_entropy(
                theirs.logits[:, :-1].flatten(0, 1), fed["labels"][:, 1:].flatten(), ignore_index=-100)
            expected.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), step
        engine.eval()
        with torch.no_grad():
            evals = [engine(**batch(length, 9)).logits.shape for length in (6, 30)]
    assert evals == [(8, 6, 64), (8, 30, 64)]
    assert engine.traces == {"train_forward": 1, "vjp_forward": 1, "backward": 1, "update": 1, "forward": 1}, \
        engine.traces
    said = [r.getMessage() for r in records if "shape buckets" in r.getMessage()]
    assert len(said) == 1 and "128, 256, 512, ... up to 64 (the model's positions)" in said[0], said
    for (name, ours), theirs in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_torchax_shape_buckets_cut_a_shifted_output_back_to_the_tokens_it_scores():
    """A module that returns next-token log-probabilities (``[rows, length - 1]``, as TRL's fused
    LM head does in GRPO and RLOO) gets them back at the length fed minus one: left at the
    bucket's, ``log_probs[:, -k:]`` were the padding's and a loss on them trained nothing."""
    class NextTokenLogProbs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(32, 16)
            self.head = torch.nn.Linear(16, 32)

        def forward(self, input_ids, attention_mask):
            logits = self.head(self.embed(input_ids))[:, :-1]
            return {"log_probs": logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]}

    ids = torch.randint(0, 32, (8, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    advantages = torch.linspace(-1, 1, 8)[:, None]
    reference = NextTokenLogProbs()
    engine, *_ = spmdzero.initialize(model=NextTokenLogProbs(), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "spmd": {"backend": "torchax"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    out = engine(input_ids=ids, attention_mask=mask)
    assert out["log_probs"].shape == (8, 11)
    loss = -(out["log_probs"][:, -6:] * advantages).mean()  # the completion's tokens only
    engine.backward(loss)
    engine.step()
    expected = -(reference(ids, mask)["log_probs"][:, -6:] * advantages).mean()
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert abs(loss.item() - expected.item()) <= 1e-6
    for (name, ours), theirs in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_torchax_shape_buckets_pad_a_positional_sequence_with_its_keyword_mask():
    """DeepSpeed-Chat's actor is called ``model(seq, attention_mask=mask)``: the mask was padded
    to the bucket and the positional ids were not, and OPT failed adding position embeddings of
    the mask's length to token embeddings of the ids'. Both are padded now, and the logits come
    back at the length fed, as plain torch gives them."""
    import transformers

    def opt():
        torch.manual_seed(0)
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
            word_embed_proj_dim=32, max_position_embeddings=256, dropout=0.0, attention_dropout=0.0))

    ids = torch.randint(2, 64, (8, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[2, :5] = 0  # a left-padded prompt
    engine, *_ = spmdzero.initialize(model=opt(), config={
        "train_micro_batch_size_per_gpu": 1, "spmd": {"backend": "torchax"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.eval()
    with torch.no_grad():
        out = engine(ids, attention_mask=mask).logits
        expected = opt().eval()(ids, attention_mask=mask).logits
    assert out.shape == (8, 24, 64)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-5)
