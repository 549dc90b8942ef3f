"""ZeRO-3's host parameters as DeepSpeed keeps them (``engine/host_placeholders.py``,
``train/zero_params.py``): placeholders whose values live on the devices only, gathered whole on
demand by ``GatheredParameters``, the 16-bit save and the host's ``generate``; training and
checkpoints as with whole host parameters."""

import copy
import logging

import pytest
import torch
import transformers

import spmdzero
from spmdzero.compat.deepspeed.runtime.zero import GatheredParameters, ZeroParamStatus


def tiny_gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                                                vocab_size=96, bos_token_id=1, eos_token_id=2))


def engine_for(host_parameters: str, stage: int = 3, model=None):
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.0,
              "spmd": {"host_parameters": host_parameters}}
    model = model if model is not None else tiny_gpt2()
    engine, *_ = spmdzero.initialize(model=model, config=config)
    return engine, model


def batch(seed: int):
    ids = torch.randint(3, 96, (8, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def train(engine, steps: int, first: int = 0) -> list:
    losses = []
    for i in range(first, first + steps):
        loss = engine(**batch(i)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def pair():
    """The same model trained 2 steps with whole host parameters and with placeholders."""
    whole, whole_model = engine_for("whole")
    records, logger = [], logging.getLogger("spmdzero")
    handler, level = logging.Handler(), logger.level
    handler.emit = records.append
    logger.addHandler(handler), logger.setLevel(logging.INFO)
    try:
        kept, kept_model = engine_for("placeholders")
    finally:
        logger.removeHandler(handler), logger.setLevel(level)
    return whole, whole_model, kept, kept_model, records, train(whole, 2), train(kept, 2)


def test_placeholders_read_as_deepspeeds_and_hold_nothing(pair):
    whole, whole_model, kept, kept_model, records, *_ = pair
    for (name, p), (_, w) in zip(kept_model.named_parameters(), whole_model.named_parameters()):
        assert p.shape == (0,) and p.ds_shape == w.shape and p.ds_numel == w.numel(), name
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE and isinstance(p.ds_id, int) and p.dtype == w.dtype
    assert sum(p.numel() for p in kept_model.parameters()) == 0
    assert not hasattr(next(whole_model.parameters()), "ds_id")  # whole parameters: DeepSpeed's non-ZeRO-3 face
    said = [r.getMessage() for r in records if "placeholders" in r.getMessage()]
    assert len(said) == 1 and "spmd.host_parameters" in said[0]


def test_training_is_the_same_with_placeholders(pair):
    *_, whole_losses, kept_losses = pair
    assert kept_losses == whole_losses


def test_gathered_parameters_bring_the_trained_values_and_keep_edits_only_with_a_modifier(pair):
    whole, whole_model, kept, kept_model, *_ = pair
    whole.module  # noqa: B018  (the host copy brought up to date)
    weight = kept_model.transformer.wte.weight
    with GatheredParameters(list(kept_model.parameters())):
        assert weight.ds_status == ZeroParamStatus.AVAILABLE
        for (name, p), (_, w) in zip(kept_model.named_parameters(), whole_model.named_parameters()):
            torch.testing.assert_close(p.detach(), w.detach(), rtol=0, atol=0, msg=name)
        with torch.no_grad():
            weight.zero_()  # no modifier_rank: dropped
        with GatheredParameters(weight):  # nested: still whole after the inner exit
            pass
        assert weight.shape == whole_model.transformer.wte.weight.shape
    assert weight.shape == (0,) and weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    with GatheredParameters(weight):
        assert weight.abs().sum() > 0
    head = kept_model.transformer.h[0].mlp.c_fc.bias
    with GatheredParameters(head, modifier_rank=0):
        with torch.no_grad():
            head.add_(1.0)  # kept: the devices' values change
    with torch.no_grad():
        whole_model.transformer.h[0].mlp.c_fc.bias.add_(1.0)
    with torch.no_grad():  # a forward with no backward: not a training draw
        assert kept(**batch(7)).loss.item() == whole(**batch(7)).loss.item()


def test_the_16bit_save_and_checkpoints_gather_from_the_devices(pair, tmp_path):
    whole, whole_model, kept, kept_model, *_ = pair
    saved, expected = kept._zero3_consolidated_16bit_state_dict(), whole._zero3_consolidated_16bit_state_dict()
    assert saved.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(saved[name], expected[name], rtol=0, atol=0, msg=name)
    assert all(p.shape == (0,) for p in kept_model.parameters())  # placeholders again
    kept.save_checkpoint(str(tmp_path), tag="t")
    after = train(kept, 1, first=10)
    kept.load_checkpoint(str(tmp_path), tag="t")
    assert train(kept, 1, first=10) == after
    assert train(whole, 1, first=10) == after  # the pair at the same step again, for the tests after


def test_generate_on_the_devices_and_on_the_host_from_placeholders(pair):
    whole, whole_model, kept, kept_model, *_ = pair
    kept.eval(), whole.eval()
    ids = torch.randint(3, 96, (8, 6), generator=torch.Generator().manual_seed(5))
    try:
        on_devices = kept.module.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=2)
        torch.testing.assert_close(on_devices, whole.module.generate(ids, max_new_tokens=5, do_sample=False,
                                                                     pad_token_id=2), rtol=0, atol=0)
        blocked = kept.module.generate(ids, max_new_tokens=5, no_repeat_ngram_size=2, pad_token_id=2)  # host
        torch.testing.assert_close(blocked, whole.module.generate(ids, max_new_tokens=5, no_repeat_ngram_size=2,
                                                                  pad_token_id=2), rtol=0, atol=0)
        assert all(p.shape == (0,) for p in kept_model.parameters())
    finally:
        kept.train(), whole.train()


def test_gathering_around_generate_on_the_devices_copies_nothing(pair, monkeypatch):
    """TRL's ``unwrap_model_for_generation`` at ZeRO-3 gathers every parameter around
    ``generate``: the shapes are whole inside, and as generation runs on the devices and reads
    no host value, no array comes to the host."""
    from torchax.ops import mappings

    whole, whole_model, kept, kept_model, *_ = pair
    copies, original = [], mappings.j2t
    monkeypatch.setattr(mappings, "j2t", lambda *a, **k: copies.append(a[0].shape) or original(*a, **k))
    ids = torch.randint(3, 96, (8, 6), generator=torch.Generator().manual_seed(6))
    kept.eval()
    try:
        with GatheredParameters(list(kept_model.parameters())):
            assert kept_model.lm_head.weight.shape == (96, 32)
            out = kept_model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=2)
    finally:
        kept.train()
    assert copies == [] and out.shape == (8, 10)
    assert all(p.shape == (0,) for p in kept_model.parameters())


def test_auto_keeps_a_small_model_whole_and_below_stage_3_nothing_changes():
    _, small = engine_for("auto")
    assert all(p.numel() > 0 and not hasattr(p, "ds_id") for p in small.parameters())
    _, stage2 = engine_for("placeholders", stage=2)
    assert all(p.numel() > 0 for p in stage2.parameters())


def test_a_deep_copy_of_placeholders_is_placeholders():
    """An EMA copy of a stage-3 model holds what DeepSpeed's would: the placeholders."""
    _, model = engine_for("placeholders")
    twin = copy.deepcopy(model)
    assert all(p.numel() == 0 for p in twin.parameters())
