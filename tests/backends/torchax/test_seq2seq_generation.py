"""``generate`` of an encoder-decoder on the devices (``programs/model_feeds.py``): T5, BART and
Marian trained by the engine give transformers' tokens on plain PyTorch, the prompt through the
encoder once, the cross-attention's keys and values cached by the first token; no parameter
copied to the host, one program for the calls of a bucket. The transformers 4.57 run of the
suite runs this file too."""

import copy

import pytest
import torch
import transformers

from test_torchax_generation import trained_engine

SMALL = dict(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
             dropout=0.0, init_std=0.5, forced_eos_token_id=None)


def tiny_seq2seq(family: str) -> torch.nn.Module:
    """Random weights large enough that greedy search does not repeat one token."""
    torch.manual_seed(0)
    if family == "t5":  # relative positions; 4.57 registers its shared embedding three times
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=96, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, dropout_rate=0.0,
            initializer_factor=8.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    if family == "bart":  # learned absolute positions
        return transformers.BartForConditionalGeneration(transformers.BartConfig(
            **SMALL, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2))
    return transformers.MarianMTModel(transformers.MarianConfig(  # sinusoidal positions
        **{**SMALL, "init_std": 2.0}, pad_token_id=95, eos_token_id=0, decoder_start_token_id=95))


def trained(family: str, stage: int):
    """The engine after two steps, its model, and a plain PyTorch copy of the trained weights."""
    engine, model = trained_engine(family, stage, model=tiny_seq2seq(family), ids_below=90)
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    plain = copy.deepcopy(tiny_seq2seq(family))
    plain.load_state_dict(state)
    return engine, model, plain.eval()


def sources(pad: int, batch: int = 8, longest: int = 10):
    """Right-padded sources of different lengths, as a tokenizer pads them for an encoder."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 90, (batch, longest), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, longest - row:] = 0
        ids[row, longest - row:] = pad
    return ids, mask


@pytest.mark.parametrize("family,stage", [("t5", 3), ("bart", 2), ("marian", 3)])
def test_an_encoder_decoder_generates_on_the_devices_with_transformers_tokens(family, stage):
    from torchax.ops import mappings

    engine, model, plain = trained(family, stage)
    ids, mask = sources(model.config.pad_token_id)
    copies, original = [], mappings.j2t
    mappings.j2t = lambda *a, **k: copies.append(a[0].shape) or original(*a, **k)
    try:
        out = engine.module.generate(ids, attention_mask=mask, max_new_tokens=9)
        direct = model.generate(input_ids=ids, attention_mask=mask, max_length=8)  # 7 new tokens
    finally:
        mappings.j2t = original
    assert copies == []  # no array came from the devices to the host module
    assert engine.generation.calls == 2 and engine.traces["generate"] == 1  # one program (one bucket)
    expected = plain.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    assert len({tuple(row) for row in expected.tolist()}) > 4  # the rows differ: a real check
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(direct, plain.generate(ids, attention_mask=mask, max_length=8, do_sample=False),
                               rtol=0, atol=0)


def test_an_encoder_decoder_stops_at_eos_and_runs_transformers_processors():
    engine, model, plain = trained("t5", 2)
    ids, mask = sources(0)
    first = plain.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    eos = int(first[1, 3])  # a token greedy search reaches: rows end there
    forced = {"forced_bos_token_id": 7, "forced_eos_token_id": 9}  # BART's and Marian's configs set these
    for extra in ({}, {"min_new_tokens": 5}, {"min_length": 4}, {"repetition_penalty": 1.5}, forced):
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=9, eos_token_id=eos, **extra)
        expected = plain.generate(ids, attention_mask=mask, max_new_tokens=9, eos_token_id=eos, do_sample=False,
                                  **extra)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # with the penalty, with the forced tokens, and with neither: a program each
    assert engine.generation.calls == 5 and engine.traces["generate"] == 3
    torch.manual_seed(0)
    sampled = engine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=20, **forced)
    assert engine.generation.calls == 6 and (sampled[:, 1] == 7).all()
    ended = (sampled[:, 1:-1] == model.config.eos_token_id).any(1)  # rows that ended are padded after EOS
    assert sampled.shape[1] == 7 and ((sampled[:, -1] == 9) | ended).all() and (~ended).any()


def test_an_encoder_decoder_s_beam_search_runs_on_the_devices_with_transformers_beams():
    engine, model, plain = trained("t5", 3)
    ids, mask = sources(0)
    # the best beam of each prompt: this T5's runners-up tie within rounding (scores 1e-5 apart),
    # which transformers orders one way and the devices may order the other
    for setting in (dict(num_beams=3), dict(num_beams=4, length_penalty=0.6, early_stopping=True)):
        out = engine.module.generate(ids, attention_mask=mask, max_new_tokens=9, **setting)
        expected = plain.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, **setting)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert engine.generation.calls == 2 and engine.traces["beam search"] == 2
