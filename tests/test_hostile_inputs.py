"""Bad input, as a tough user gives it (issue #13, config and CLI): every error is one line
that names the key, file or argument, and the CLI exits 2. Device-free."""

import json
import re

import pytest

from spmdzero.cli.main import main
from spmdzero.config.errors import ConfigError
from spmdzero.config.load import load_config, parse_config

BATCH = {"train_batch_size": 8}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}


def write(tmp_path, cfg, name="ds.json"):
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


def cli_error(capsys, argv):
    """The CLI's exit code and its one line of stderr (argparse usage errors included)."""
    try:
        code = main(argv)
    except SystemExit as done:
        code = done.code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return code, err


# ---- strict types where DeepSpeed's meaning is unambiguous ---------------------------------------

@pytest.mark.parametrize("cfg,message", [
    ({"train_batch_size": 8, "zero_optimization": {"stage": True}}, "zero_optimization.stage: .*integer"),
    ({"train_batch_size": True}, "train_batch_size: .*integer"),
    ({"train_batch_size": "16"}, "train_batch_size: .*integer"),
    ({"train_batch_size": 1e30}, "train_batch_size: .*integer"),
    ({**BATCH, "gradient_clipping": float("inf")}, "gradient_clipping: .*finite"),
    ({**BATCH, "gradient_clipping": "1.0"}, "gradient_clipping: .*number"),
    ({**BATCH, "bf16": {"enabled": "false"}}, "bf16.enabled: .*boolean"),
    ({**BATCH, "fp16": {"enabled": 1}}, "fp16.enabled: .*boolean"),
    ({**BATCH, "steps_per_print": 10.5}, "steps_per_print: .*integer"),
])
def test_strict_section_types(cfg, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(cfg)


def test_whole_numbers_written_as_floats_are_integers():
    """``"steps_per_print": 1e5`` is a common idiom in Hugging Face-style configs."""
    cfg = parse_config({"train_batch_size": 16.0, "steps_per_print": 1e5,
                        "fp16": {"enabled": True, "min_loss_scale": 1.0, "loss_scale_window": 1000.0}})
    assert (cfg.train_batch_size, cfg.steps_per_print, cfg.fp16.min_loss_scale, cfg.fp16.loss_scale_window) == \
        (16, 100000, 1, 1000)
    assert all(type(v) is int for v in (cfg.train_batch_size, cfg.steps_per_print, cfg.fp16.min_loss_scale))


def test_strict_types_keep_what_deepspeed_configs_use():
    cfg = parse_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1,
                        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True},
                        "bf16": {"enabled": "auto"}, "fp16": {"enabled": False, "loss_scale": 0}})
    assert cfg.zero_stage == 2 and cfg.gradient_clipping == 1.0 and cfg.train_batch_size is None


@pytest.mark.parametrize("section,message", [
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": "false"}}}, "adam_w_mode must be true or false"),
    ({"optimizer": {"type": "Lamb", "params": {"bias_correction": "no"}}}, "bias_correction must be true or false"),
    ({"optimizer": {"type": "Adam", "params": {"torch_adam": "yes"}}}, "torch_adam must be true or false"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": 0}}}, "adam_w_mode must be true or false"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": "0.01"}}}, "weight_decay must be a number"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}, "lr must be a finite number"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}}, "lr must be a finite number"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, "0.99"]}}}, "betas must be two numbers"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": True}}}, "momentum must be a number"),
    ({"optimizer": ADAMW, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "100"}}},
     "total_num_steps must be a number"),
    ({"optimizer": ADAMW, "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}},
     "lr_range_test_step_size must be > 0"),
    ({"optimizer": {"type": "LBFGS"}}, "'LBFGS' needs a closure"),
])
def test_values_that_would_blow_up_later_fail_config_check(tmp_path, capsys, section, message):
    code, err = cli_error(capsys, ["config", "check", write(tmp_path, {**BATCH, **section}), "--devices", "8"])
    assert code == 2 and re.search(message, err), err


@pytest.mark.parametrize("text", ["", "  \n\t "])
def test_an_empty_config_file_is_named_as_empty(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=f"{re.escape(path)}.* is empty"):
        load_config(config=path)


# ---- the CLI ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--devices", "0"], "argument --devices: must be a positive integer, got 0"),
    (["--devices", "-4"], "argument --devices: must be a positive integer, got -4"),
    (["--devices", "four"], "argument --devices: must be a positive integer, got 'four'"),
    (["--params", "0"], "argument --params: must be a positive integer, got 0"),
    (["--params", "-5"], "argument --params: must be a positive integer, got -5"),
])
def test_config_check_arguments(tmp_path, capsys, argv, message):
    code, err = cli_error(capsys, ["config", "check", write(tmp_path, BATCH), *argv])
    assert code == 2 and message in err, err


def test_config_check_of_a_missing_file(tmp_path, capsys):
    code, err = cli_error(capsys, ["config", "check", str(tmp_path / "nope.json"), "--devices", "8"])
    assert code == 2 and "not found" in err and "nope.json" in err


def test_checkpoint_commands_on_missing_and_wrong_paths(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    for argv, message in [
        (["checkpoint", "consolidate", missing, str(tmp_path / "o.pt")], "does not exist"),
        (["checkpoint", "import-deepspeed", missing, str(tmp_path / "o")], "does not exist"),
        (["checkpoint", "consolidate", str(tmp_path), str(tmp_path / "o.pt")], "no 'latest' file"),
        (["checkpoint", "consolidate", str(tmp_path), str(tmp_path / "o.pt"), "--tag", "../x"],
         "invalid checkpoint tag"),
        (["checkpoint", "consolidate", str(tmp_path), str(tmp_path / "o.pt"), "--dtype", "fp64"], "argument --dtype"),
        (["checkpoint"], "required: action"),
    ]:
        code, err = cli_error(capsys, argv)
        assert code == 2 and message in err, (argv, err)


def test_a_near_miss_of_a_deepspeed_key_is_named_and_other_unknown_keys_pass_quietly():
    """``zero_optimisation`` would silently train at ZeRO-0: ignored (as DeepSpeed does) but named."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = parse_config({"train_batch_size": 16, "zero_optimisation": {"stage": 2}, "my_run_name": "x"})
    messages = [str(w.message) for w in caught]
    assert cfg.zero_stage == 0
    assert any("'zero_optimisation' is ignored" in m and "did you mean 'zero_optimization'" in m for m in messages)
    assert not any("my_run_name" in m for m in messages)


@pytest.mark.parametrize("given,read", [("FP32", "fp32"), ("torch.bfloat16", "bfloat16"), ("BF16", "bf16")])
def test_dtype_names_are_read_in_any_case_with_or_without_torch(given, read):
    cfg = parse_config({"train_batch_size": 16, "communication_data_type": given,
                        "data_types": {"grad_accum_dtype": given}})
    assert cfg.communication_data_type == cfg.data_types.grad_accum_dtype == read


def test_a_base64_config_and_the_deprecated_deepscale_config_are_read_as_deepspeed_reads_them():
    import argparse
    import base64
    import json
    import warnings

    from spmdzero.config.load import load_config

    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 24}).encode()).decode()
    assert load_config(config=encoded).train_batch_size == 24
    with pytest.warns(UserWarning, match="deepscale_config is deprecated"):
        assert load_config(args=argparse.Namespace(deepscale_config=encoded, deepspeed_config=None)).train_batch_size == 24
    with pytest.raises(ConfigError, match="not found: 'nope.json'"):
        load_config(config="nope.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match="not found"):
            load_config(config="notbase64!!")


@pytest.mark.parametrize("cfg,key", [({"checkpoint": {"tag_validation": "strict"}}, "checkpoint.tag_validation"),
                                     ({"seq_parallel_communication_data_type": "int8"},
                                      "seq_parallel_communication_data_type")])
def test_a_no_op_keys_invalid_value_is_refused_as_deepspeed_refuses_it(cfg, key):
    with pytest.raises(ConfigError, match=f"{key}=.* is not one of"):
        parse_config({"train_batch_size": 16, **cfg})
    parse_config({"train_batch_size": 16, **{k: ({"tag_validation": "FAIL"} if k == "checkpoint" else "bf16")
                                              for k in cfg}})
