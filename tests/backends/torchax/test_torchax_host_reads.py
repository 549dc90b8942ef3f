"""Forwards that read a tensor's value on the host train on the default (torchax) backend as in
plain torch: their programs run eagerly (``spmdzero/backends/torchax/engine/host_reads.py``), said once
in the log, and the optimizer step stays compiled. Errors that are not host reads surface as
before. wav2vec2's CTC loss (a stock model that reads) is in the transformers zoo
(``test_transformers_zoo.py``, on transformers 5.x and 4.57). DeBERTa's classification loss read
too; it compiles now, checked here."""

import copy
import re
import warnings

import numpy as np
import pytest
import torch

import spmdzero
from conftest import spmdzero_log
from spmdzero.backends.torchax.lowering.values import INT64_TRUNCATED

STEPS, GAS, LR = 4, 2, 0.1
NOTE = "reads a tensor's value on the host"


class HostReads(torch.nn.Module):
    """An MLP whose forward reads values on the host the ways eager torch code does: an ``if`` on
    an input and on an activation, ``.item()``, ``int()``, ``.tolist()`` and ``.cpu()`` (a log of
    what it saw), ``nonzero`` and a boolean mask (rows chosen by value: data-dependent shapes), and a
    slice whose bound is a tensor (torchax kept the tensor in a lazy view, read outside its
    environment: an AssertionError), and index tensors made on the host from NumPy (DETR's
    Hungarian matching: torchax asserted that they were not its tensors)."""

    def __init__(self, loss_inside: bool):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 8)
        self.loss_inside = loss_inside
        self.seen: list = []

    def forward(self, x, y=None):
        if x.abs().max() > 3.0:  # a branch on the batch: taken by some batches, not others
            x = x.clamp(-3.0, 3.0)
        h = torch.tanh(self.fc1(x))
        h = h / max(1.0, h.detach().abs().mean().item() * 4)
        self.seen.append((h.sum().tolist(), h.detach().cpu().abs().max()))
        out = self.fc2(h)
        if out.abs().max() > 1.0:  # a branch on a value the parameters make
            out = out * 0.9
        keep = out[:, 0] > 0
        rows = torch.nonzero(keep).flatten()
        out = out.index_add(0, rows, out[keep] * (int(keep.sum()) / len(keep)))
        first = (x[:, 0] > x[:, 0].min()).nonzero()[0]  # a slice bound that is a tensor (DeepSpeed-Chat's reward model)
        out = torch.cat([out[:first], out[first:] * 0.5])
        # rows matched on the host, as DETR's loss matches with SciPy: the indices are host
        # tensors (torch.as_tensor of NumPy), which index and write the device's tensors
        order = torch.as_tensor(np.argsort(out[:, 1].detach().cpu().numpy()), dtype=torch.int64)
        scale = torch.ones_like(out[:, 0])
        scale[order[:4]] = 0.5
        out = out[order] * scale[order][:, None]
        if not self.loss_inside:
            return out
        return torch.nn.functional.mse_loss(out, y)


def data(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 16, generator=g) * 1.3, torch.randn(16, 8, generator=g)) for _ in range(n)]


def loss_of(model, x, y, loss_inside: bool):
    return model(x, y) if loss_inside else torch.nn.functional.mse_loss(model(x), y)


def train_both(loss_inside: bool, stage: int = 2) -> dict:
    """STEPS optimizer steps (GAS micro-steps each) on the engine (ZeRO ``stage``, fp32, SGD, no
    clipping) and on plain torch from the same weights, with the engine's log and traces."""
    model = HostReads(loss_inside)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    with spmdzero_log() as records:
        engine, *_ = spmdzero.initialize(model=model, config={
            "train_batch_size": 16 * GAS, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
        ours, theirs, traces = [], [], []
        for i, (x, y) in enumerate(data(STEPS * GAS)):
            loss = loss_of(engine, x, y, loss_inside)
            engine.backward(loss)
            engine.step()
            ours.append(loss.item())
            traces.append(dict(engine.traces))
            ref_loss = loss_of(reference, x, y, loss_inside)
            (ref_loss / GAS).backward()
            theirs.append(ref_loss.item())
            if (i + 1) % GAS == 0:
                optimizer.step()
                optimizer.zero_grad()
        x, y = data(1)[0]
        with torch.no_grad():  # an evaluation forward reads too
            engine.eval()
            reference.eval()
            evaluated = (loss_of(engine, x, y, loss_inside).item(), loss_of(reference, x, y, loss_inside).item())
    notes = [r.getMessage() for r in records if NOTE in r.getMessage()]
    return {"engine": engine, "reference": reference, "ours": ours, "theirs": theirs, "traces": traces,
            "evaluated": evaluated, "notes": notes, "seen": (model.seen, reference.seen)}


# at stage 3 the VJP program of a loss outside the module is checkpointed, so that the gathered
# weights are gathered again in the backward: an eager run must not be (jax.checkpoint traces its
# function with abstract values, and the read failed again)
@pytest.fixture(scope="module", params=[(True, 2), (False, 2), (False, 3)],
                ids=["loss_inside", "loss_outside", "loss_outside_stage_3"])
def trained(request):
    return train_both(*request.param)


@pytest.mark.slow
def test_a_forward_that_reads_values_trains_as_in_plain_torch(trained):
    """ZeRO-2 with gradient accumulation, the loss returned by the module (the training and
    accumulating programs) or computed outside it (the VJP program and its backward)."""
    assert trained["ours"] == pytest.approx(trained["theirs"], abs=1e-5)
    for (name, p), q in zip(trained["engine"].module.named_parameters(), trained["reference"].parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
    assert trained["evaluated"][0] == pytest.approx(trained["evaluated"][1], abs=1e-5)
    # the host reads saw the values torch saw. With the loss outside, the first two micro-steps
    # ran the forward twice (the training program's eager run finds no loss, then the VJP
    # program runs): the same values again
    ours, theirs = ([(a, float(b)) for a, b in seen] for seen in trained["seen"])
    ours = [v for i, v in enumerate(ours) if i == 0 or v != ours[i - 1]]
    assert len(ours) == len(theirs) == STEPS * GAS + 1
    assert [v for pair in ours for v in pair] == pytest.approx([v for pair in theirs for v in pair], abs=1e-4)


@pytest.mark.slow
def test_the_eager_run_is_said_once_naming_the_line_and_the_cost(trained):
    notes = trained["notes"]
    assert len(notes) == 1, notes
    assert "HostReads's forward" in notes[0] and "test_torchax_host_reads.py" in notes[0], notes[0]
    assert "eagerly, op by op" in notes[0] and "10x" in notes[0] and "spmd.backend='torch_xla'" in notes[0]
    assert "each shape not seen before" in notes[0], notes[0]


class MaskedLM(torch.nn.Module):
    """HelloDeepSpeed's masked LM in small (DeepSpeedExamples' ``train_bert_ds.py``): position ids
    made with ``.long()`` (RoBERTa's embeddings), the masked rows picked with ``nonzero``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, src, tgt):
        h = self.embed((src.ne(0).int() * src.int()).long())
        rows = torch.nonzero((tgt != 0).view(-1)).view(-1)
        scores = self.head(h.view(-1, 16)).index_select(0, rows)
        return torch.nn.functional.cross_entropy(scores, torch.index_select(tgt.view(-1), 0, rows))


def test_the_eager_steps_do_not_repeat_jaxs_int64_note():
    """torchax's integers are int32, and JAX says so when a program casts to int64: once, when
    the program is traced. An eager program said it at every step (two lines of each step's log
    in ``train_bert_ds.py``)."""
    engine, *_ = spmdzero.initialize(model=MaskedLM(), config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")  # each time a warning is given, not once per line
        for _ in range(4):
            src = torch.randint(1, 32, (8, 6), generator=g)
            loss = engine(src, torch.where(torch.rand(8, 6, generator=g) < 0.3, src, 0))
            engine.backward(loss)
            engine.step()
    said = [str(w.message) for w in warned if re.search(INT64_TRUNCATED, str(w.message))]
    assert engine.traces and len(said) <= 1, said


@pytest.mark.slow
def test_a_program_that_fell_back_is_not_traced_again(trained):
    """Each program's trace stops at the read once; after the first optimizer step nothing is
    traced (the eager runs count no trace, so the recompile guard stays quiet)."""
    traces = trained["traces"]
    assert all(t == traces[GAS - 1] for t in traces[GAS - 1:]), traces
    assert traces[-1]["update"] == 1


class Broken(torch.nn.Module):
    """A forward with a bug that is not a host read."""

    def __init__(self, bug: str):
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)
        self.bug = bug

    def forward(self, x, y):
        if self.bug == "shape":
            x = x.reshape(-1, 2)  # then Linear(16, 8) of 2 features
        elif self.bug == "raise":
            raise ValueError("the model's own error")
        elif self.bug == "type":
            raise TypeError("the model's own type error")
        return torch.nn.functional.mse_loss(self.fc(x), y)


@pytest.mark.parametrize("bug, error, match", [("shape", ValueError, "does not match"),
                                               ("raise", ValueError, "the model's own error"),
                                               ("type", TypeError, "the model's own type error")])
def test_an_error_that_is_not_a_host_read_surfaces_as_before(bug, error, match):
    engine, *_ = spmdzero.initialize(model=Broken(bug), config={
        "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    x, y = data(1)[0]
    with spmdzero_log() as records, pytest.raises(error, match=match) as raised:
        engine(x, y)
    assert NOTE not in str(raised.value) and "eager" not in str(raised.value)
    assert not [r for r in records if NOTE in r.getMessage()]
    assert not engine.host_reads.noted


class SizedByValue(torch.nn.Module):
    """A factory sized by a value, as transformers 4.x's Jamba sizes its causal mask
    (``torch.full((L, cache_position[-1] + 1), ...)``): JAX's TypeError for a traced shape, a
    read that the eager run answers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x, y):
        width = (x[0] * 0).long().sum() + x.shape[1]
        return torch.nn.functional.mse_loss(self.fc(x * torch.full((x.shape[0], width), 0.5, device=x.device)), y)


def _trains_as_torch(model, steps: int = 2):
    """``steps`` SGD steps of ``model`` (a loss of ``x``, ``y``) by the engine and by torch: the
    same losses. Returns the engine."""
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 16, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    for x, y in data(steps):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        expected = reference(x, y)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    return engine


def test_a_factory_sized_by_a_value_runs_eagerly_as_in_torch():
    with spmdzero_log() as records:
        _trains_as_torch(SizedByValue())
    notes = [r.getMessage() for r in records if NOTE in r.getMessage()]
    assert len(notes) == 1 and "torch.full" in notes[0] and "Shapes must be" in notes[0], notes


class PicksByName(torch.nn.Module):
    """Switch Transformers' expert loop in 5.x: a module picked by a name formatted from a
    one-value tensor, ``self.experts[f"expert_{idx}"]``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate = torch.nn.Linear(16, 2)
        self.experts = torch.nn.ModuleDict({f"expert_{i}": torch.nn.Linear(16, 8) for i in range(2)})

    def forward(self, x, y):
        idx = self.gate(x).mean(0).argmax()
        return torch.nn.functional.mse_loss(self.experts[f"expert_{idx}"](x), y)


def test_a_name_formatted_from_a_one_value_tensor_is_its_number():
    """torchax's tensors formatted as their repr (``expert_View(Tensor(...))``): a KeyError.
    Formatting is a read: the forward runs eagerly, as in torch, and trains as torch does."""
    assert _trains_as_torch(PicksByName()).host_reads.noted


class GuardedLoss(torch.nn.Module):
    """A loss checked on the host, as training code guards against NaN: the read makes the
    forward eager, and the check raises as it does in torch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x, y):
        loss = torch.nn.functional.mse_loss(self.fc(x), y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()}")
        return loss


def test_an_error_the_eager_forward_raises_is_the_models():
    engine, *_ = spmdzero.initialize(model=GuardedLoss(), config={
        "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    x, y = data(1)[0]
    loss = engine(x, y)  # finite: trained eagerly
    engine.backward(loss)
    engine.step()
    assert engine.host_reads.noted
    with pytest.raises(FloatingPointError, match="non-finite loss nan"):
        engine(x * float("nan"), y)


def test_a_traced_step_of_a_forward_that_reads_says_it_cannot_be_one_program():
    """``trace_step`` (what ``spmdzero aot`` compiles) composes the step into one program, which
    cannot stop for a value: a clear error naming the read, not an eager run."""
    engine, *_ = spmdzero.initialize(model=GuardedLoss(), config={
        "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    x, y = data(1)[0]
    with pytest.raises(RuntimeError, match=r"GuardedLoss's forward reads a tensor's value on the host at "
                                           r"test_torchax_host_reads.py:\d+ .* cannot be traced as one JAX program"):
        engine.trace_step(x, y)
    assert not engine.host_reads.noted


def _step_both(engine, reference, optimizer, batch) -> tuple[float, float]:
    """One training step of the engine and of the plain-torch reference on ``batch``; their losses."""
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    theirs = reference(**batch).loss
    theirs.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss), float(theirs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["DebertaV2", "Deberta"])
def test_debertas_classification_loss_over_its_labeled_rows_compiles_and_trains_as_in_plain_torch(name):
    """DeBERTa's (and DeBERTa-v2's and v3's) classification loss picks the rows with a label by
    ``(labels >= 0).nonzero()``, a data-dependent shape: every step ran eagerly. While traced it
    takes the same loss with a mask (``labeled_rows.py``). Two rows unlabeled (-1) in each batch,
    then a batch with none labeled, whose loss transformers makes 0."""
    import transformers

    config = getattr(transformers, f"{name}Config")(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForSequenceClassification")(config)
    reference = copy.deepcopy(model)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 8, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    with spmdzero_log() as records:
        for step in range(3):
            labels = torch.randint(0, 3, (8,), generator=g)
            labels[step:step + 2] = -1
            inputs = {"input_ids": torch.randint(0, 64, (8, 12), generator=g), "labels": labels}
            loss, theirs = _step_both(engine, reference, optimizer, inputs)
            assert abs(loss - theirs) <= 1e-5 * abs(theirs), (step, loss, theirs)
        inputs["labels"] = torch.full((8,), -1)
        assert float(engine(**inputs).loss) == 0.0 == float(reference(**inputs).loss)
    assert not [r for r in records if NOTE in r.getMessage()] and not engine.host_reads.noted
    assert engine.traces["train_forward"] == 1, engine.traces
    for (n, p), q in zip(engine.module.named_parameters(), reference.parameters()):
        assert torch.allclose(p.detach().cpu(), q.detach(), atol=1e-5), n


def test_concrete_reads_give_an_eager_tracers_value_and_still_refuse_an_abstract_one():
    """``.tolist()`` and ``np.asarray`` of an eager autodiff tracer see its value inside
    ``concrete_reads`` only; under ``jax.jit`` they still raise JAX's error."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from spmdzero.backends.torchax.engine.host_reads import concrete_reads

    seen = []

    def f(x):
        seen.append((x.sum().tolist(), float(np.asarray(x).max())))
        return (x * x).sum()

    with concrete_reads():
        assert jax.grad(f)(jnp.arange(3.0)).tolist() == [0.0, 2.0, 4.0]
        assert seen == [(3.0, 2.0)]
        with pytest.raises(jax.errors.ConcretizationTypeError):
            jax.jit(f)(jnp.arange(3.0))
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.grad(f)(jnp.arange(3.0))


def test_transformers_methods_are_swapped_for_the_trace_only():
    """``transformers_methods.replaced``: the method of a class in an imported transformers
    module is the replacement inside, transformers' own after, by an exception too; a module not
    imported, or a class without the method, is left alone."""
    import sys
    import types

    from spmdzero.backends.torchax.patches import transformers_methods

    class Block:
        def forward(self):
            return "transformers"

    module = types.ModuleType("transformers.models.fake.modeling_fake")
    module.Block = Block
    sys.modules[module.__name__] = module
    try:
        entries = [("fake", "Block", "forward", lambda original: lambda self: "traced " + original(self)),
                   ("fake", "Block", "moe", lambda original: None), ("absent", "Block", "forward", lambda o: None)]
        with pytest.raises(RuntimeError, match="stopped"), transformers_methods.replaced(entries):
            assert Block().forward() == "traced transformers" and not hasattr(Block, "moe")
            raise RuntimeError("the trace stopped")
        assert Block().forward() == "transformers" and "forward" in vars(Block)
    finally:
        del sys.modules[module.__name__]


def test_a_read_of_a_value_other_hosts_hold_says_so_and_names_the_model():
    """On several hosts an eager forward's read of a value that spans other hosts' devices (2 x 4
    CPU devices, a Qwen2-VL reading its image grid) stopped with JAX's words alone; other errors
    pass as they are."""
    import collections
    from types import SimpleNamespace

    from spmdzero.backends.torchax.engine import host_reads

    fallback = host_reads.Fallback(SimpleNamespace(traces=collections.Counter()), "Qwen2VLForConditionalGeneration")

    def spans_hosts():
        raise RuntimeError("Fetching value for `jax.Array` that spans non-addressable (non process local) devices "
                           "is not possible.")

    def fails():
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match=r"Qwen2VLForConditionalGeneration's forward reads a tensor's value on the "
                                           r"host.*several hosts.*JAX said: Fetching value"):
        fallback.run_eagerly(spans_hosts, ())
    with pytest.raises(RuntimeError, match="^something else$"):
        fallback.run_eagerly(fails, ())


def _speech_rows(g, inputs: str) -> dict:
    """Eight rows of audio (or Wav2Vec2-BERT's features) whose labels are padded as the CTC
    collators pad them, with -100 at the end, and here with -100 and the blank (0) inside a row
    too: each kept label must keep its place in its row."""
    labels = torch.randint(1, 20, (8, 6), generator=g)
    labels[1, -3:] = -100
    labels[2, 2] = -100
    labels[3, 1] = 0  # the blank: 5.x drops it from the targets, 4.x keeps it
    batch = {"labels": labels}
    if inputs == "input_features":
        batch["input_features"] = torch.randn(8, 20, 8, generator=g)
        batch["attention_mask"] = torch.ones(8, 20, dtype=torch.long)
        batch["attention_mask"][0, 15:] = 0
    else:
        batch["input_values"] = torch.randn(8, 1600, generator=g)
    return batch


@pytest.mark.slow
@pytest.mark.parametrize("name,inputs,reduction", [("Wav2Vec2", "input_values", "mean"),
                                                   ("Hubert", "input_values", "sum"),
                                                   ("Wav2Vec2Bert", "input_features", "mean")])
def test_the_ctc_loss_of_speech_models_compiles_and_trains_as_in_plain_torch(name, inputs, reduction, monkeypatch):
    """wav2vec2 and its kin check ``labels.max()`` and concatenate the targets by
    ``masked_select``, two reads: every step ran eagerly. While traced, their loss takes the
    targets padded (``ctc_targets.py``): one program, the same losses and weights as plain torch,
    and the range check noted as left out."""
    import transformers

    from spmdzero.backends.torchax.patches import ctc_targets

    monkeypatch.setattr(ctc_targets, "_NOTED", set())  # noted once per class in a process: the zoo's may have been
    common = dict(vocab_size=24, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                  pad_token_id=0, ctc_loss_reduction=reduction, hidden_dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                  mask_time_prob=0.0)
    if inputs == "input_features":
        common.update(feature_projection_input_dim=8, conv_depthwise_kernel_size=3, add_adapter=False,
                      conformer_conv_dropout=0.0)
    else:
        common.update(conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
                      num_conv_pos_embedding_groups=4)
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCTC")(getattr(transformers, f"{name}Config")(**common))
    reference = copy.deepcopy(model)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 8, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}})
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with spmdzero_log() as records:
        for step in range(3):
            batch = _speech_rows(g, inputs)
            loss, theirs = _step_both(engine, reference, optimizer, batch)
            # the first step to 1e-5; the next after updates, whose rounding CTC's steep start magnifies
            tolerance = 1e-5 if step == 0 else 1e-4
            assert abs(loss - theirs) <= tolerance * abs(theirs), (step, loss, theirs)
        assert engine.traces["train_forward"] == 1, engine.traces
        ours, theirs = engine(**batch, return_dict=False), reference(**batch, return_dict=False)  # a tuple
        assert len(ours) == len(theirs) and abs(float(ours[0]) - float(theirs[0])) <= 1e-4 * abs(float(theirs[0]))
    messages = [r.getMessage() for r in records]
    assert not [m for m in messages if NOTE in m] and not engine.host_reads.noted, messages
    assert len([m for m in messages if "below vocab_size" in m]) == 1, messages
    for (n, p), q in zip(engine.module.named_parameters(), reference.parameters()):
        assert torch.allclose(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4), n
