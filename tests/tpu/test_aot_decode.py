"""Generation's layout (``sharding/decode_plan.py``) and ``spmdzero aot --generate``: a transformers
causal LM's decode step, tensor-parallel by annotations, compiled for a TPU topology."""

import pytest

from conftest import aot_json
from spmdzero.sharding.decode_plan import decode_plan, weight_spec

LLAMA = {"model_type": "llama", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 2, "max_position_embeddings": 256}
CONFIG = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_projections_split_as_the_hybrid_engine_slices_them():
    """Columns (heads, MLP in) split the output features, rows (attention out, MLP out) the
    input features; the vocabulary of the output head; the width of the embedding table."""
    t = 4
    assert weight_spec("model.layers.0.self_attn.q_proj.weight", (256, 256), t) == ("tensor", None)
    assert weight_spec("model.layers.0.mlp.up_proj.weight", (512, 256), t) == ("tensor", None)
    assert weight_spec("model.layers.0.self_attn.o_proj.weight", (256, 256), t) == (None, "tensor")
    assert weight_spec("model.layers.0.mlp.down_proj.weight", (256, 512), t) == (None, "tensor")
    assert weight_spec("lm_head.weight", (1024, 256), t) == ("tensor", None)
    assert weight_spec("model.embed_tokens.weight", (1024, 256), t) == (None, "tensor")


def test_norms_biases_and_dims_that_do_not_divide_stay_replicated():
    assert weight_spec("model.layers.0.input_layernorm.weight", (256,), 4) == (None,)
    assert weight_spec("model.layers.0.self_attn.q_proj.bias", (256,), 4) == (None,)
    assert weight_spec("model.layers.0.self_attn.q_proj.weight", (250, 256), 4) == (None, None)
    assert weight_spec("model.layers.0.self_attn.q_proj.weight", (256, 256), 1) == (None, None)


def test_the_cache_splits_by_heads_only_when_the_group_divides_them():
    plan = decode_plan([("lm_head.weight", (1024, 256))], data=2, tensor=4, kv_heads=8)
    assert plan.cache == ("data", "tensor", None, None) and plan.tensor_parallel == 4
    gqa = decode_plan([("lm_head.weight", (1024, 256))], data=1, tensor=16, kv_heads=8)
    assert gqa.cache == ("data", None, None, None)
    assert "replicated over the tensor group" in gqa.describe()
    with pytest.raises(ValueError, match="positive axes"):
        decode_plan([], data=0, tensor=4, kv_heads=8)


def test_generate_takes_three_positive_integers():
    from spmdzero.aot.decode import Generation

    assert Generation.parse("64:512:512").max_length == 1024
    for bad in ("64:512", "64:0:8", "a:b:c"):
        with pytest.raises(ValueError, match="BATCH:PROMPT:NEW"):
            Generation.parse(bad)


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    return aot_json(directory, LLAMA, CONFIG, "--stages", "2", "--seq-len", "32", "--generate", "8:32:32")


@pytest.mark.slow
def test_the_decode_step_compiles_beside_the_training_step_and_reads_its_hbm_floor(decode):
    report = decode["decode"]
    assert decode["reports"][0]["stage"] == 2 and report["mesh"] == {"data": 1, "tensor": 4}
    # every projection and both tables split 4 ways; norms replicated: the weights a chip holds
    P_split = 2 * (4 * 256 * 256 + 3 * 512 * 256) + 2 * 1024 * 256
    P_norms = 2 * 2 * 256 + 256
    assert report["weight_bytes"] == 2 * (P_split // 4 + P_norms)
    # the cache: 2 layers x keys and values x [8, 8 heads / 4, 64 slots, 32] in bf16
    assert report["cache_bytes"] == 2 * 2 * 8 * 2 * 64 * 32 * 2
    assert report["memory"]["alias"] >= report["cache_bytes"]  # updated in place, donated
    assert report["floor_s"] > 0
    # the step's HBM traffic (from its memory spaces) is near the bytes it must read: the cache is
    # updated in place and read once (programs/static_cache.py); the cost analysis, which also
    # counts the copies into on-chip memory, says several times more
    assert 0.8 <= report["floor_ratio"] < 1.5 < report["cost_analysis_ratio"]


@pytest.mark.slow
def test_the_decode_step_never_gathers_the_cache(decode):
    """Attention runs where its heads are: the only collectives are the tensor-parallel
    all-reduces and small gathers, none as large as one layer's keys (the reference SDPA
    lowering merged batch and heads, and the partitioner all-gathered every layer's cache)."""
    collectives = decode["decode"]["collectives"]
    layer_keys = 8 * 8 * 64 * 32 * 2
    assert "all-reduce" in collectives
    gathered = collectives.get("all-gather", {"bytes": 0, "count": 1})
    assert gathered["bytes"] / gathered["count"] < layer_keys


@pytest.mark.slow
def test_the_reshard_from_zero_3_moves_less_than_a_gather_of_the_model(decode):
    """The weights go from ZeRO-3's layout (each split over the 4 chips) to the generation one,
    compiled: a reshard (all-to-alls, small gathers), where gathering them whole for every token
    would send 3/4 of the model per chip per token."""
    reshard = decode["decode"]["reshard"]
    model_bytes = 2 * (2 * (4 * 256 * 256 + 3 * 512 * 256) + 2 * 1024 * 256 + 2 * 2 * 256 + 256)
    assert 0 < reshard["sent_bytes"] < model_bytes * 3 / 4 / 2
    assert reshard["roofline"]["step_s"] > 0


def test_a_bad_generate_value_is_refused_before_any_compile(tmp_path, capsys):
    import json

    from spmdzero.aot import command

    json.dump(CONFIG, open(tmp_path / "ds.json", "w"))
    json.dump(LLAMA, open(tmp_path / "config.json", "w"))
    code = command.main(["--topology", "v5e:2x2", "--deepspeed_config", str(tmp_path / "ds.json"),
                         "--model", str(tmp_path), "--generate", "8:32"])
    assert code == 1 and "--generate '8:32': give BATCH:PROMPT:NEW" in capsys.readouterr().err
