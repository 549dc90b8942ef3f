"""Bad input, as a tough user gives it (issues #13 and #32, config, CLI, model and optimizer
parameters): every error is one line that names the key, file, argument or module, and the CLI
exits 2. Device-free but for a few initialize calls that are refused before any step."""

import json
import re

import pytest
import torch

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


# ---- issue #32: a sparse embedding, huge batch numbers, bytes and depths the reader chokes on --------

class _SparseLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.ModuleDict({"wte": torch.nn.Embedding(16, 4, sparse=True)})
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.model["wte"](ids)).float().pow(2).mean()


@pytest.mark.parametrize("backend", ["torch_xla", "torchax"])
def test_a_sparse_embedding_is_refused_at_initialize_naming_the_module(backend):
    """torch_xla failed in engine.backward with ~100 lines of NotImplementedError naming no module
    (a sparse gradient cannot be sharded by annotation); the torchax backend ignored the flag."""
    import spmdzero

    model = _SparseLM()
    with pytest.raises(ValueError, match=r"module 'model.wte' \(Embedding\) has sparse=True: .* sparse=False"):
        spmdzero.initialize(model=model, config={"train_batch_size": 8, "optimizer": {"type": "SGD",
                                                 "params": {"lr": 0.1}}, "spmd": {"backend": backend}})
    assert all(p.device.type == "cpu" for p in model.parameters())  # refused before anything was touched
    with pytest.raises(ValueError, match=r"the model \(EmbeddingBag\) has sparse=True"):
        spmdzero.initialize(model=torch.nn.EmbeddingBag(16, 4, sparse=True), config={"train_batch_size": 8})


@pytest.mark.parametrize("cfg,message", [
    ({"train_batch_size": 10**30}, r"train_batch_size=1000000000000000000000000000000 is too large: .*64-bit"),
    ({"train_micro_batch_size_per_gpu": 10**30}, r"train_micro_batch_size_per_gpu=10+ is too large"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2**63},
     r"gradient_accumulation_steps=9223372036854775808 is too large"),
    ({"train_micro_batch_size_per_gpu": 2**60, "gradient_accumulation_steps": 2**10},
     r"train_batch_size resolved to \d+ = train_micro_batch_size_per_gpu 1152921504606846976 x "
     r"gradient_accumulation_steps 1024 x world size 8"),
])
def test_huge_batch_numbers_are_one_config_error_naming_the_key(cfg, message):
    """With a training_data loader, 10**30 used to end in "ValueError: Stop argument for islice()"
    at the first batch, naming no key."""
    import spmdzero

    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 4))
    with pytest.raises(ConfigError, match=message):
        engine, _, loader, _ = spmdzero.initialize(model=torch.nn.Linear(4, 4), training_data=data, config={
            **cfg, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        next(iter(loader))


def test_a_batch_size_larger_than_the_dataset_that_fits_in_64_bits_is_accepted_as_deepspeed_accepts_it():
    from spmdzero.sharding.batch import resolve_batch

    batch = resolve_batch(parse_config({"train_batch_size": 2**62}), 8)
    assert (batch.global_batch, batch.rows_per_rank) == (2**62, 2**59)


@pytest.mark.parametrize("content,message", [
    (b'\xff\xfe{"train_batch_size": 8}', r"is not UTF-8 text \(byte 0"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    ('{"train_batch_size": 8, "fp16": {"enabled": true, "initial_scale_power": 2000}}',
     r"fp16.initial_scale_power: .*at most 127: the loss scale 2\*\*initial_scale_power is kept in float32"),
    ('{"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": 1e300}}',
     r"fp16.loss_scale: .*at most 3.403e\+38"),
])
def test_config_check_of_bytes_depths_and_scales_that_used_to_escape_as_tracebacks(tmp_path, capsys, content,
                                                                                   message):
    """A non-UTF-8 file (UnicodeDecodeError), a deeply nested one (RecursionError) and an fp16
    scale 2**2000 (OverflowError) escaped `config check` as tracebacks naming nothing."""
    path = tmp_path / "ds.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = cli_error(capsys, ["config", "check", str(path), "--devices", "8", "--params", "1000"])
    assert code == 2 and re.search(message, err) and str(path) in err, err


def test_config_check_of_a_directory_and_a_bom(tmp_path, capsys):
    code, err = cli_error(capsys, ["config", "check", str(tmp_path), "--devices", "8"])
    assert code == 2 and f"{str(tmp_path)!r} is a directory" in err, err
    path = tmp_path / "bom.json"
    path.write_bytes(b'\xef\xbb\xbf{"train_batch_size": 8}')  # what some Windows editors write
    assert main(["config", "check", str(path), "--devices", "8"]) == 0


@pytest.mark.parametrize("value", ["x", "0", "-1", ""])
def test_config_check_with_a_bad_cpu_num_devices_names_it(tmp_path, capsys, monkeypatch, value):
    """``CPU_NUM_DEVICES=x`` was a ValueError traceback; 0 or -1 a message about fsdp_inner."""
    monkeypatch.setenv("CPU_NUM_DEVICES", value)
    code, err = cli_error(capsys, ["config", "check", write(tmp_path, BATCH)])
    assert code == 2 and f"CPU_NUM_DEVICES={value!r} is not a device count" in err and "--devices" in err, err


# ---- optimizer parameters DeepSpeed passes through to torch ----------------------------------------

@pytest.mark.parametrize("type_,params", [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "maximize": True, "foreach": False, "fused": False,
             "differentiable": False}),
    ("SGD", {"lr": 0.1, "nesterov": True, "momentum": 0.9, "foreach": None}),
    ("Adagrad", {"lr": 0.1, "eps": 1e-8, "maximize": True, "foreach": False, "differentiable": False, "fused": None}),
])
def test_torch_optimizer_params_deepspeed_passes_through_train_as_torch(type_, params):
    """DeepSpeed builds "SGD" and "Adagrad" as torch.optim's with the params as kwargs, so
    ``maximize``, ``foreach``, ``fused`` and ``differentiable`` are accepted there; they were
    refused here as unknown keys."""
    from spmdzero.config.schema import OptimizerConfig
    from spmdzero.optim.optimizers import build_optimizer

    def run(make):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5, 3))
        opt, g = make([p]), torch.Generator().manual_seed(1)
        for _ in range(4):
            p.grad = torch.randn(5, 3, generator=g)
            opt.step()
        return p.detach()

    ours = run(lambda ps: build_optimizer(OptimizerConfig(type=type_, params=params), ps))
    torch.testing.assert_close(ours, run(lambda ps: getattr(torch.optim, type_)(ps, **params)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [True, False])
def test_adams_fp32_optimizer_states_is_taken_out_as_deepspeed_takes_it_out(value):
    """DeepSpeed pops it for any Adam (it sets the CPU-offloaded moments' precision); it was
    refused here as an unknown key of FusedAdam's signature."""
    from spmdzero.config.schema import OptimizerConfig
    from spmdzero.optim.optimizers import AdamW, build_optimizer

    opt = build_optimizer(OptimizerConfig(type="Adam", params={"lr": 0.1, "fp32_optimizer_states": value}),
                          [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, AdamW)
    with pytest.raises(ConfigError, match="fp32_optimizer_states must be true or false"):
        build_optimizer(OptimizerConfig(type="Adam", params={"fp32_optimizer_states": "yes"}),
                        [torch.nn.Parameter(torch.zeros(2))])


class _NoLoss(torch.nn.Module):
    """A forward that returns None (a loss computed only when some argument is given)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x, labels=None):
        return None if labels is None else self.layer(x).sub(labels).pow(2).mean()


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_backward_of_none_says_the_loss_is_none(backend):
    """``engine.backward(None)``: the torchax backend said the loss "depends on no output of this
    engine's forward", torch_xla named the type only. Both now say the loss is None."""
    import spmdzero

    engine, *_ = spmdzero.initialize(model=_NoLoss(), config={
        "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "spmd": {"backend": backend}})
    with pytest.raises(TypeError, match=r"engine.backward\(loss\) was given None: the loss is None\. The forward "
                                        r"returned no loss .*labels="):
        engine.backward(engine(torch.randn(8, 4)))
    with pytest.raises(TypeError, match=r"engine.backward\(loss\) expects the loss tensor, got a float"):
        engine.backward(1.0)
    x = torch.randn(8, 4)
    engine.backward(engine(x, labels=x))  # nothing was lost: the engine still trains
    engine.step()
    assert engine.global_steps == 1 and engine.global_samples == 8
