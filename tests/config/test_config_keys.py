"""Every DeepSpeed 0.19 config key meaningful at stage 0-2 is classified: used, a documented
no-op (warned once, only when switched on) or refused when switched on. Real configs from
DeepSpeed-Chat, the transformers docs and accelerate are accepted. parse_config only: no devices."""

import warnings

import pytest

import spmdzero.config
from spmdzero.config.keys import NOOP_KEYS, REFUSED_KEYS, ZERO3_KEYS, ZERO3_REASON
from spmdzero.config.errors import ConfigError
from spmdzero.config.load import parse_config

BASE = {"train_batch_size": 8}

# A value that switches each key's feature on, and one that leaves it off (DeepSpeed's default or
# the form real configs use to disable it). Unlisted keys: True / False.
ON = {
    "zero_optimization.reduce_bucket_size": 2e8, "zero_optimization.allgather_bucket_size": 2e8,
    "zero_optimization.offload_optimizer": {"device": "cpu", "pin_memory": True},
    "zero_optimization.offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
    "aio": {"block_size": 1048576, "queue_depth": 8}, "gradient_predivide_factor": 2.0,
    "seq_parallel_communication_data_type": "bf16", "flops_profiler": {"enabled": True},
    "comms_logger": {"enabled": True}, "autotuning": {"enabled": True},
    "timers": {"throughput": {"enabled": True}}, "eigenvalue": {"enabled": True},
    "activation_checkpointing.number_checkpoints": 4, "pipeline": {"stages": 2},
    "compile": {"deepcompile": True}, "log_level": "info", "checkpoint.tag_validation": "Fail",
    "nebula": {"enabled": True}, "datastates_ckpt": {"host_cache_size": 16},
    "zero_optimization.zenflow": {"topk_ratio": 0.1}, "amp": {"enabled": True, "opt_level": "O1"},
    "gradient_allreduce_op": "sum", "data_types.buffer_dtype": "bf16",
    "progressive_layer_drop": {"enabled": True, "theta": 0.5}, "curriculum_learning": {"enabled": True},
    "data_efficiency": {"enabled": True}, "quantize_training": {"enabled": True},
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}},
    "weight_quantization": {"post_init_quant": {"fc": {"num_bits": 8}}},
    "sparse_attention": {"mode": "fixed"}, "elasticity": {"enabled": True}, "hybrid_engine": {"enabled": True},
    "tensor_parallel": {"autotp_size": 2}, "expert_parallel": {"enabled": True},
}
OFF = {
    "zero_optimization.offload_optimizer": {"device": "none"}, "zero_optimization.offload_param": {"device": "none"},
    "gradient_predivide_factor": 1.0, "flops_profiler": {"enabled": False}, "comms_logger": {"enabled": False},
    "autotuning": {"enabled": False}, "eigenvalue": {"enabled": False}, "nebula": {"enabled": False},
    "activation_checkpointing.number_checkpoints": None,
    "checkpoint.tag_validation": "Warn", "amp": {"enabled": False},
    "gradient_allreduce_op": "mean", "data_types.buffer_dtype": None, "progressive_layer_drop": {"enabled": False},
    "curriculum_learning": {"enabled": False}, "data_efficiency": {"enabled": False},
    "quantize_training": {"enabled": False},
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False},  # its groups' numbers
                                                     "different_groups": {"wq1": {"params": {"start_bits": 8}}}}},
    "elasticity": {"enabled": False}, "hybrid_engine": {"enabled": False, "max_out_tokens": 512},
    "tensor_parallel": {"autotp_size": 0}, "expert_parallel": {"enabled": False},
    "seq_parallel_communication_data_type": "fp32",
}


def with_key(key: str, value) -> dict:
    section, _, name = key.rpartition(".")
    config = dict(BASE)
    if section == "optimizer":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}, name: value}
    elif section:
        config[section] = {name: value}
    else:
        config[name] = value
    return config


def parse_quietly(config: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_config(config)


WARNED = [k for k, reason in NOOP_KEYS.items() if reason != ZERO3_REASON]


@pytest.mark.parametrize("key", WARNED)
def test_a_noop_key_is_accepted_and_named_only_when_switched_on(key):
    assert key in parse_quietly(with_key(key, ON.get(key, True))).noop_keys
    assert key not in parse_quietly(with_key(key, OFF.get(key, False))).noop_keys
    assert key not in parse_quietly(with_key(key, "auto")).noop_keys


@pytest.mark.parametrize("name", ZERO3_KEYS)
def test_zero3_only_keys_are_accepted_silently_below_stage_3(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        cfg = parse_config({**BASE, "zero_optimization": {"stage": 2, name: True}})
    assert cfg.zero_stage == 2 and not cfg.noop_keys


@pytest.mark.parametrize("name", [k for k in ZERO3_KEYS if "weights_on_model_save" not in k])
def test_zero3_keys_at_stage_3_are_named_as_no_ops_with_their_reason(name, monkeypatch):
    monkeypatch.setattr(spmdzero.config.load, "_warned", set())  # once per process: forget earlier tests
    with pytest.warns(UserWarning, match=f"zero_optimization.{name}: ") as caught:
        cfg = parse_config({**BASE, "zero_optimization": {"stage": 3, name: True}})
    assert cfg.zero_stage == 3 and cfg.noop_keys == (f"zero_optimization.{name}",)
    reason = str(caught[0].message).split(f"zero_optimization.{name}: ")[1]
    assert "never warned" not in reason and len(reason) > 40


@pytest.mark.parametrize("name", [k for k in ZERO3_KEYS if "weights_on_model_save" in k])
def test_zero3s_gather_on_model_save_is_read_not_warned(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = parse_config({**BASE, "zero_optimization": {"stage": 3, name: True}})
    assert cfg.zero_stage == 3 and not cfg.noop_keys


@pytest.mark.parametrize("key", REFUSED_KEYS)
def test_a_refused_key_is_an_error_naming_it_only_when_switched_on(key):
    with pytest.raises(ConfigError, match=f"{key}=.*not supported: "):
        parse_quietly(with_key(key, ON.get(key, True)))
    parse_quietly(with_key(key, OFF.get(key, False)))


def test_noop_warning_is_one_warning_for_all_new_keys(monkeypatch):
    monkeypatch.setattr(spmdzero.config.load, "_warned", set())  # once per process: forget earlier tests
    keys = ["zero_optimization.legacy_stage1", "zero_optimization.cpu_offload_param", "dump_state"]
    config = {**BASE, "zero_optimization": {"legacy_stage1": True, "cpu_offload_param": True}, "dump_state": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_config(config)
        parse_config(config)
    messages = [str(w.message) for w in caught if "no effect under GSPMD" in str(w.message)]
    assert len(messages) == 1 and all(k in messages[0] for k in keys)


def test_bfloat16_is_deepspeeds_old_name_for_bf16():
    assert parse_quietly({**BASE, "bfloat16": {"enabled": True}}).bf16.enabled
    assert parse_quietly({**BASE, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}).bf16.enabled
    with pytest.raises(ConfigError, match="'bf16' and its old name 'bfloat16'"):
        parse_config({**BASE, "bf16": {"enabled": True}, "bfloat16": {"enabled": False}})


def test_zero_optimization_as_a_bool_is_deepspeeds_old_stage_1():
    assert parse_quietly({**BASE, "zero_optimization": True}).zero_stage == 1
    assert parse_quietly({**BASE, "zero_optimization": False}).zero_stage == 0


def test_param_dtype_must_agree_with_the_precision_mode():
    assert parse_quietly({**BASE, "bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}}).bf16.enabled
    with pytest.raises(ConfigError, match="param_dtype='fp16' conflicts with the precision mode \\(bf16\\)"):
        parse_config({**BASE, "bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}})


def test_a_misspelt_noop_key_still_gets_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'offload_optimizer'"):
        parse_config({**BASE, "zero_optimization": {"offload_optimiser": {"device": "cpu"}}})


def deepspeed_chat_train_config(offload: bool, dtype: str, stage: int = 2, hybrid_engine: bool = False) -> dict:
    """The dict shape of DeepSpeed-Chat's dschat/utils/ds_utils.get_train_ds_config (defaults),
    after its main.py sets the batch numbers from torch.distributed's world size (1 here)."""
    device = "cpu" if offload else "none"
    precision = ("fp16", {"enabled": True, "loss_scale_window": 100}) if dtype == "fp16" else \
                ("bfloat16", {"enabled": True})
    return {
        "train_batch_size": 4 * 1 * 2, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
                              "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        precision[0]: precision[1],
        "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": hybrid_engine, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": False, "output_path": "/step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"},
        "spmd": {"rank": "process"},  # what `spmdzero launch` sets
    }


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_deepspeed_chat_config_is_accepted(offload, dtype):
    cfg = parse_quietly(deepspeed_chat_train_config(offload, dtype))
    assert cfg.zero_stage == 2 and cfg.gradient_clipping == 1.0
    assert cfg.bf16.enabled == (dtype == "bf16") and cfg.fp16.enabled == (dtype == "fp16")
    offloads = {"zero_optimization.offload_param", "zero_optimization.offload_optimizer"}
    assert set(cfg.noop_keys) == {"zero_optimization.overlap_comm"} | (offloads if offload else set())


def test_deepspeed_chats_step_3_config_with_the_hybrid_engine_is_accepted():
    """DeepSpeed-Chat's shipped step-3 scripts pass --enable_hybrid_engine: generation runs on the
    module with its own generate, so the section is named as a no-op, not refused."""
    cfg = parse_quietly(deepspeed_chat_train_config(False, "bf16", hybrid_engine=True))
    assert "hybrid_engine" in cfg.noop_keys


def test_transformers_docs_zero2_config_with_auto_filled_is_accepted():
    # transformers' DeepSpeed docs, "ZeRO-2 example", after the Trainer fills "auto"
    config = {
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-5,
                                                     "warmup_num_steps": 500}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                              "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 2000,
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "wall_clock_breakdown": False,
    }
    cfg = parse_quietly(config)
    assert cfg.fp16.enabled and cfg.optimizer.type == "AdamW" and cfg.zero_stage == 2
    assert "zero_optimization.offload_optimizer" in cfg.noop_keys


@pytest.mark.parametrize("offload_device", ["none", "cpu", "nvme"])
def test_accelerates_injected_keys_are_accepted(offload_device):
    # accelerate's DeepSpeedPlugin config, plus what Accelerator._prepare_deepspeed fills in
    nvme = "/nvme" if offload_device == "nvme" else None
    config = {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2,
                              "offload_optimizer": {"device": offload_device, "nvme_path": nvme},
                              "offload_param": {"device": offload_device, "nvme_path": nvme},
                              "stage3_gather_16bit_weights_on_model_save": False,
                              "reduce_bucket_size": 64 * 64, "stage3_prefetch_bucket_size": 0.9 * 64 * 64,
                              "stage3_param_persistence_threshold": 10 * 64},
        "gradient_clipping": 1.0, "steps_per_print": float("inf"), "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
    }
    cfg = parse_quietly(config)
    assert cfg.steps_per_print is None and cfg.bf16.enabled
    assert ("zero_optimization.offload_optimizer" in cfg.noop_keys) == (offload_device != "none")
