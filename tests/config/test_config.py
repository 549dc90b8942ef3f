import json
import warnings

import pytest

from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.config.load import load_config, parse_config, read_config_file
from spmdzero.sharding.batch import resolve_batch


def batch(ws, **keys):
    return resolve_batch(DeepSpeedConfig(**keys), ws)


@pytest.mark.parametrize("keys,ws,expected", [
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2), 8, (32, 2, 2)),
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=2), 8, (32, 2, 2)),
    (dict(train_batch_size=32, gradient_accumulation_steps=2), 8, (32, 2, 2)),
    (dict(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2), 8, (32, 2, 2)),
    (dict(train_batch_size=32), 8, (32, 4, 1)),
    (dict(train_micro_batch_size_per_gpu=3), 4, (12, 3, 1)),
])
def test_batch_arithmetic_infers_like_deepspeed(keys, ws, expected):
    b = batch(ws, **keys)
    assert (b.global_batch, b.rows_per_rank, b.accumulation_steps) == expected
    assert b.ranks == ws and b.rows_per_micro_step == expected[1] * ws and b.rows_per_device == expected[1]


@pytest.mark.parametrize("keys,ws,match", [
    (dict(), 8, "Either train_batch_size or train_micro_batch_size_per_gpu"),
    (dict(train_batch_size=30, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2), 8, "30 != 2 \\* 2 \\* 8"),
    (dict(train_batch_size=4), 8, "train_micro_batch_size_per_gpu resolved to 0"),
    (dict(train_batch_size=36, train_micro_batch_size_per_gpu=2), 8, "36 != 2 \\* 2 \\* 8"),
])
def test_batch_arithmetic_rejects_like_deepspeed(keys, ws, match):
    with pytest.raises(ConfigError, match=match):
        batch(ws, **keys)


def test_unknown_key_in_a_section_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match="zero_optimization.stag.*did you mean 'stage'"):
        parse_config({"zero_optimization": {"stag": 2}})


def test_unknown_top_level_keys_are_ignored_like_deepspeed():
    assert parse_config({"train_batch_size": 8, "some_other_tool": {"x": 1}}).train_batch_size == 8


def test_wrong_type_names_the_key_and_value():
    with pytest.raises(ConfigError, match="gradient_clipping.*'big'"):
        parse_config({"gradient_clipping": "big"})


def test_stage3_is_accepted_and_stage_4_names_the_key():
    assert parse_config({"zero_optimization": {"stage": 3}}).zero_stage == 3
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        parse_config({"zero_optimization": {"stage": 4}})


def test_noop_keys_are_accepted_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_config({"zero_optimization": {"stage": 2, "overlap_comm": True}})
        parse_config({"zero_optimization": {"stage": 2, "overlap_comm": True}})
    relevant = [w for w in caught if "overlap_comm" in str(w.message)]
    assert len(relevant) <= 1  # once per process (an earlier test may already have warned)


def test_gradient_clipping_defaults_to_deepspeed_value():
    assert parse_config({}).gradient_clipping == 1.0


def test_config_sources(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16}))

    class Args:
        deepspeed_config = str(path)

    assert load_config(config=str(path)).train_batch_size == 16
    assert load_config(config_params={"train_batch_size": 8}).train_batch_size == 8
    assert load_config(args=Args()).train_batch_size == 16
    with pytest.raises(ConfigError, match="Not sure how to proceed"):
        load_config(args=Args(), config={"train_batch_size": 8})
    with pytest.raises(ConfigError, match="no DeepSpeed config"):
        load_config()
    with pytest.raises(ConfigError, match="not found: .*missing.json"):
        load_config(config=str(tmp_path / "missing.json"))


def test_duplicate_keys_in_a_file_are_refused(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        read_config_file(path)


def test_hjson_files_are_read(tmp_path):
    path = tmp_path / "ds.hjson"
    path.write_text("{\n  # a comment\n  train_batch_size: 8\n}\n")
    assert load_config(config=str(path)).train_batch_size == 8


def test_duplicate_keys_in_an_hjson_file_are_refused(tmp_path):
    path = tmp_path / "dup.hjson"
    path.write_text("{\n  # comment\n  zero_optimization: {stage: 1, stage: 2}\n}\n")
    with pytest.raises(ConfigError, match="duplicate key 'stage'"):
        read_config_file(path)


@pytest.mark.parametrize("rule,processes,expected", [
    # (global batch, DeepSpeed world size, rows per process per micro-step, rows per device)
    ("device", 1, (64, 8, 64, 8)),
    ("process", 1, (8, 1, 8, 1)),
    ("process", 2, (16, 2, 8, 2)),
    ("device", 2, (64, 8, 32, 8)),
])
def test_the_batch_rule_sets_deepspeeds_world_size(rule, processes, expected):
    b = resolve_batch(DeepSpeedConfig(train_micro_batch_size_per_gpu=8, spmd={"rank": rule}), 8, processes)
    assert (b.global_batch, b.ranks, b.rows_per_process, b.rows_per_device) == expected
    assert b.rule == rule and b.dp_devices == 8


def test_the_process_rule_accepts_deepspeed_chats_arithmetic():
    # DeepSpeed-Chat: train_batch_size = per_device_bs * torch.distributed.get_world_size() * gas, world = 1
    b = resolve_batch(DeepSpeedConfig(train_batch_size=16, train_micro_batch_size_per_gpu=4,
                                      gradient_accumulation_steps=4, spmd={"rank": "process"}), 8, 1)
    assert (b.global_batch, b.rows_per_process, b.rows_per_device) == (16, 4, None)
    with pytest.raises(ConfigError, match="16 != 4 \\* 4 \\* 8.*8 data-parallel devices.*spmd.rank"):
        resolve_batch(DeepSpeedConfig(train_batch_size=16, train_micro_batch_size_per_gpu=4,
                                      gradient_accumulation_steps=4), 8, 1)


def test_an_unknown_batch_rule_is_refused():
    with pytest.raises(ConfigError, match="spmd.rank"):
        parse_config({"train_batch_size": 8, "spmd": {"rank": "gpu"}})
