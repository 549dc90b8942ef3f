"""``generate`` on the devices (spmdzero.backends.torchax.engine.generation): a transformers
causal LM trained by the engine decodes greedily from the engine's weights, with transformers'
tokens on plain PyTorch, no parameter copied to the host, and one compile per bucket."""

import copy
import json

import jax
import pytest
import torch
import transformers

import spmdzero

from conftest import run_python, spmdzero_log

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def tiny_lm(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=96,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config)


def prompts(batch: int = 4, longest: int = 7, seed: int = 3):
    """Left-padded prompts of different lengths, as a tokenizer pads them for generation."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (batch, longest), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, :row] = 0  # row r has r pad tokens on the left
        ids[row, :row] = 0
    return ids, mask


def trained_engine(family: str, stage: int, spmd: dict | None = None, model: torch.nn.Module | None = None,
                   ids_below: int = 96):
    """An engine after two optimizer steps, in eval mode: its host parameters are behind the
    devices. ``model``: another than ``tiny_lm(family)``, trained on token ids below ``ids_below``."""
    model = tiny_lm(family) if model is None else model
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.0,
              "spmd": spmd or {}}
    engine, *_ = spmdzero.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(3, ids_below, (8, 12), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.eval()
    return engine, model


def on_torch(engine) -> torch.nn.Module:
    """A plain PyTorch copy of the engine's trained model (reads the devices)."""
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    plain = tiny_lm("llama" if "Llama" in type(engine.host.wrapped).__name__ else "gpt2")
    plain.load_state_dict(state)
    return plain.eval()


@pytest.fixture
def host_copies(monkeypatch):
    """Counts the arrays copied from the devices to the host module (``HostCopy.current``)."""
    from torchax.ops import mappings

    copies = []
    original = mappings.j2t

    def counting(*args, **kwargs):
        copies.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(mappings, "j2t", counting)
    return copies


@pytest.mark.parametrize("family,stage", [("llama", 2), ("gpt2", 3), ("llama", 3)])
def test_greedy_generate_on_the_devices_gives_torchs_tokens_and_copies_no_weights(family, stage, host_copies):
    from spmdzero.backends.torchax.programs.static_cache import TRACED

    engine, model = trained_engine(family, stage)
    ids, mask = prompts(batch=8, longest=10)  # 8 rows: one a data-parallel device
    host_copies.clear()
    before = dict(TRACED)
    versions = [p._version for p in model.parameters()]  # an in-place copy to the host bumps them
    out = engine.module.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    direct = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10)
    unwrapped = model.generate(ids, attention_mask=mask, max_new_tokens=10)  # the script's own reference
    assert host_copies == []  # no array came from the devices to the host module
    assert [p._version for p in model.parameters()] == versions  # its parameters were not written
    assert engine.generation.calls == 3 and engine.traces["generate"] == 1  # one program for the three
    # each layer's new-token attention read the cache as it was, beside the new token (grouped
    # query heads included: Llama's 4 over 2); only the prompt's went through the cache
    layers = model.config.num_hidden_layers
    assert TRACED["one token"] - before.get("one token", 0) == layers
    assert TRACED["through the cache"] - before.get("through the cache", 0) == layers
    expected = on_torch(engine).generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                         pad_token_id=2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(direct, expected, rtol=0, atol=0)
    torch.testing.assert_close(unwrapped, expected, rtol=0, atol=0)
    if stage == 3 and family == "llama":  # the Hybrid Engine's layout: heads split over the fsdp devices
        weights = engine.generation.layout(8).weights
        assert weights["model.layers.0.self_attn.q_proj.weight"].spec[0] in ("fsdp", ("fsdp",))
        assert weights["model.layers.0.self_attn.o_proj.weight"].spec[1] in ("fsdp", ("fsdp",))


def test_on_a_two_axis_mesh_the_inner_fsdp_devices_are_the_tensor_parallel_group():
    """Llama's 2 KV heads do not divide over the 8 fsdp devices, but over ``fsdp_inner``'s 2:
    groups of 2 devices hold the heads (the cache split by them), the 4 groups split the rows,
    as ``spmdzero aot --generate --tensor-parallel 2`` lays them out."""
    engine, _ = trained_engine("llama", 3, {"mesh": {"fsdp_inner": 2}})
    layout = engine.generation.layout(8)
    assert layout.group == ("fsdp_inner",) and layout.plan.tensor_parallel == 2
    assert layout.weights["model.layers.0.self_attn.q_proj.weight"].spec[0] in ("fsdp_inner", ("fsdp_inner",))
    assert layout.cache.spec[:2] in ((("fsdp",), ("fsdp_inner",)), ("fsdp", "fsdp_inner"))
    ids, mask = prompts(batch=8, longest=10)
    out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8)
    expected = on_torch(engine).generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_one_program_per_bucket_and_eos_stops_as_in_transformers():
    engine, _ = trained_engine("llama", 2)
    plain = on_torch(engine)
    ids, mask = prompts()
    first = plain.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = int(first[0, ids.shape[1] + 3])  # a token greedy search reaches: rows end there
    for longest, new in [(7, 12), (5, 9), (30, 16)]:  # one prompt bucket (32), one new-token bucket (16)
        ids, mask = prompts(longest=longest)
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
        expected = plain.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos,
                                  pad_token_id=0)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # transformers' min-length processors: no EOS before the count, in the same program
    for least in ({"min_new_tokens": 6}, {"min_length": ids.shape[1] + 5}):
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, **least)
        expected = plain.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                  pad_token_id=0, **least)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert engine.traces["generate"] == 1
    ids, mask = prompts(longest=33)  # the next prompt bucket (64): a second program
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert engine.traces["generate"] == 2


def test_sampling_on_the_devices_is_reproducible_and_keeps_to_the_warped_tokens():
    engine, _ = trained_engine("llama", 2)
    plain = on_torch(engine)
    ids, mask = prompts()

    def sampled(seed, **knobs):
        torch.manual_seed(seed)
        return engine.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, pad_token_id=0, **knobs)

    first, again, other = sampled(5, top_k=5), sampled(5, top_k=5), sampled(6, top_k=5)
    torch.testing.assert_close(again, first, rtol=0, atol=0)  # a seed gives the same tokens
    assert not torch.equal(first, other)
    sampled(5, top_k=5, temperature=0.7)
    assert engine.traces["generate"] == 1  # new temperatures and seeds are inputs, not new programs
    # every drawn token is among the 5 likeliest after the tokens before it, on plain PyTorch (up
    # to a row's EOS token: the pad tokens after it were not drawn)
    with torch.no_grad():
        logits = plain(first, attention_mask=torch.cat([mask, torch.ones(4, 8, dtype=mask.dtype)], 1)).logits
    top5 = logits[:, ids.shape[1] - 1:-1].topk(5, dim=-1).indices
    new = first[:, ids.shape[1]:]
    drawn = (new == plain.config.eos_token_id).cumsum(1) - (new == plain.config.eos_token_id).int() == 0
    assert ((top5 == new[:, :, None]).any(-1) | ~drawn).all() and drawn.sum() > 16
    # top-k 1, and a top-p that keeps one token, are greedy search
    greedy = plain.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(sampled(7, top_k=1), greedy, rtol=0, atol=0)
    torch.testing.assert_close(sampled(7, top_k=0, top_p=1e-6), greedy, rtol=0, atol=0)
    assert engine.generation.calls == 6


def test_the_parity_setting_samples_as_pytorch_on_the_host():
    model = tiny_lm("llama")
    plain = copy.deepcopy(model).eval()
    config = {"train_micro_batch_size_per_gpu": 1, "spmd": {"generate": "host"}}
    engine, *_ = spmdzero.initialize(model=model, config=config)
    engine.eval()
    ids, mask = prompts()
    torch.manual_seed(5)
    with spmdzero_log() as records:
        out = engine.module.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=5)
    torch.manual_seed(5)
    torch.testing.assert_close(out, plain.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
                                                   top_k=5), rtol=0, atol=0)
    assert engine.generation.calls == 0
    assert any('"generate": "host"' in r.getMessage() for r in records)
    torch.manual_seed(6)  # the engine's own generate: the same, on the host module once
    direct = engine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=5)
    torch.manual_seed(6)
    torch.testing.assert_close(direct, plain.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
                                                      top_k=5), rtol=0, atol=0)


def test_what_does_not_run_on_the_devices_yet_runs_on_the_host_as_before():
    engine, _ = trained_engine("llama", 2)
    plain = on_torch(engine)
    ids, mask = prompts()
    with spmdzero_log() as records:  # a processor the devices do not run yet
        blocked = engine.module.generate(ids, attention_mask=mask, max_new_tokens=6, no_repeat_ngram_size=2,
                                         pad_token_id=0)
    expected = plain.generate(ids, attention_mask=mask, max_new_tokens=6, no_repeat_ngram_size=2, pad_token_id=0)
    torch.testing.assert_close(blocked, expected, rtol=0, atol=0)
    assert engine.generation.calls == 0
    assert any("no_repeat_ngram_size" in r.getMessage() for r in records)
    # a generation after training resumes on the devices with the newest weights
    engine.train()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.eval()
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=6)
    torch.testing.assert_close(out, on_torch(engine).generate(ids, attention_mask=mask, max_new_tokens=6,
                                                              pad_token_id=2), rtol=0, atol=0)
    assert engine.generation.calls == 1


def test_a_peft_lora_model_generates_on_the_devices_with_its_adapters():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_lm("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                   lora_dropout=0.0))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "gradient_clipping": 0.0}
    engine, *_ = spmdzero.initialize(model=model, config=config)
    ids, mask = prompts()
    for _ in range(2):  # the adapters' B leaves 0: their update is in the tokens
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.eval()
    out = engine.module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert engine.generation.calls == 1
    plain = copy.deepcopy(engine.module).eval()  # reads the devices: the trained adapters
    without = plain.get_base_model()
    with plain.disable_adapter():
        unadapted = without.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert not torch.equal(expected, unadapted)  # the adapters change the tokens
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_grpo_shaped_loop_compiles_nothing_after_its_first_iteration():
    """Sample completions, train on them, again: the generation and training programs are
    traced in the first iteration only, and the recompile guard hears of no generation."""
    model = tiny_lm("llama")
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "spmd": {"max_recompiles": 0}}  # a training recompile after warm-up would raise
    engine, *_ = spmdzero.initialize(model=model, config=config)
    ids, mask = prompts(batch=8, longest=10)
    traced = []
    for iteration in range(3):
        torch.manual_seed(iteration)
        sequences = engine.module.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
                                           temperature=0.9, pad_token_id=0)
        full_mask = torch.cat([mask, torch.ones(8, sequences.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
        engine.backward(engine(input_ids=sequences, attention_mask=full_mask, labels=sequences).loss)
        engine.step()
        traced.append(sum(engine.traces.values()))
    assert traced[0] > 0 and traced[1] == traced[0] and traced[2] == traced[0]
    assert engine.generation.calls == 3 and engine.traces["generate"] == 1


def test_a_repetition_penalty_runs_on_the_devices_as_transformers_applies_it():
    """TRL's ``repetition_penalty`` (GRPO, RLOO): the logits of every token the row holds (the
    prompt as fed, pad tokens included, then each new one) divided by it, or multiplied where
    negative, before the other processors; a new value is an input, not a new program."""
    engine, _ = trained_engine("llama", 2)
    plain = on_torch(engine)
    ids, mask = prompts(batch=8, longest=10)
    calls = engine.generation.calls
    for penalty in (1.5, 0.7):
        out = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, repetition_penalty=penalty,
                              pad_token_id=0)
        expected = plain.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                  repetition_penalty=penalty, pad_token_id=0)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert engine.generation.calls == calls + 2 and engine.traces["generate"] == 1
    unpenalized = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    assert not torch.equal(unpenalized, out)  # the penalty changed the tokens


BEAM_SETTINGS = [dict(num_beams=3), dict(num_beams=4, num_return_sequences=2),
                 dict(num_beams=3, early_stopping=True), dict(num_beams=3, early_stopping="never", length_penalty=2.0),
                 dict(num_beams=2, length_penalty=0.5, repetition_penalty=1.3, min_new_tokens=3)]


@pytest.mark.parametrize("family,stage", [("llama", 2), ("gpt2", 3)])
def test_beam_search_on_the_devices_gives_transformers_beams(family, stage):
    """transformers' beam search, step for step (programs/beam_search.py): the same finished
    beams and lengths, with an EOS token greedy search reaches so that beams end early, for each
    early-stopping mode, length penalties, the processors and ``num_return_sequences``."""
    engine, _ = trained_engine(family, stage)
    plain = on_torch(engine)
    ids, mask = prompts(batch=4, longest=7)
    eos = int(plain.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)[1, -5])
    shorter = 0
    for setting in BEAM_SETTINGS:
        out = engine.module.generate(ids, attention_mask=mask, max_new_tokens=9, eos_token_id=eos, pad_token_id=0,
                                     **setting)
        expected = plain.generate(ids, attention_mask=mask, max_new_tokens=9, eos_token_id=eos, pad_token_id=0,
                                  do_sample=False, **setting)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        shorter += out.shape[1] < ids.shape[1] + 9
    assert shorter > 0  # some searches ended before the length limit: EOS ended their beams
    assert engine.generation.calls == len(BEAM_SETTINGS) and engine.traces["beam search"] == len(BEAM_SETTINGS)
    engine.module.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, eos_token_id=eos)
    assert engine.traces["beam search"] == len(BEAM_SETTINGS)  # a bucket's program again


def test_samples_of_each_prompt_are_drawn_on_the_devices():
    """``num_return_sequences`` with sampling: each prompt's row repeated, drawn apart."""
    engine, _ = trained_engine("llama", 2)
    ids, mask = prompts(batch=4)
    torch.manual_seed(1)
    out = engine.module.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, num_return_sequences=2,
                                 pad_token_id=0)
    assert out.shape[0] == 8 and engine.generation.calls == 1
    torch.testing.assert_close(out[::2, :ids.shape[1]], ids, rtol=0, atol=0)
    torch.testing.assert_close(out[1::2, :ids.shape[1]], ids, rtol=0, atol=0)
    assert not torch.equal(out[::2], out[1::2])  # two draws of each prompt


SAMPLE_ON_DEVICES = """
    import json, sys
    sys.path.insert(0, "tests/backends/torchax"); sys.path.insert(0, "tests")
    import torch, spmdzero
    from test_torchax_generation import prompts, tiny_lm
    engine, *_ = spmdzero.initialize(model=tiny_lm("llama"), config={"train_micro_batch_size_per_gpu": 1})
    engine.eval()
    ids, mask = prompts(batch=8)
    torch.manual_seed(5)
    out = engine.module.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
    print(json.dumps({"devices": __import__("jax").device_count(), "calls": engine.generation.calls,
                      "tokens": out.tolist()}))
"""


@pytest.mark.slow  # two more processes
def test_sampling_from_a_seed_gives_the_same_tokens_on_any_device_count():
    """The draws depend on the seed and the token's index only, not on how the rows and the
    weights are split (JAX's partitionable random bits): 1, 2 and 8 devices sample alike."""
    results = [json.loads(run_python(SAMPLE_ON_DEVICES, env={"CPU_NUM_DEVICES": str(n), "PJRT_DEVICE": "CPU"})
                          .strip().splitlines()[-1]) for n in (1, 2)]
    engine, *_ = spmdzero.initialize(model=tiny_lm("llama"), config={"train_micro_batch_size_per_gpu": 1})
    engine.eval()
    ids, mask = prompts(batch=8)
    torch.manual_seed(5)
    out = engine.module.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
    results.append({"devices": jax.device_count(), "calls": engine.generation.calls, "tokens": out.tolist()})
    assert [r["devices"] for r in results] == [1, 2, 8] and all(r["calls"] == 1 for r in results)
    assert results[0]["tokens"] == results[1]["tokens"] == results[2]["tokens"]
    assert len({tuple(row) for row in results[0]["tokens"]}) == 8  # the rows drew apart
