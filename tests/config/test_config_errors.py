"""Malformed configs: each is refused with a ValueError (ConfigError) whose message names the
offending key or value, through the public entry point. None may surface as KeyError,
AttributeError or TypeError from inside the library."""

import pytest

import spmdzero
from spmdzero.config.errors import ConfigError

from conftest import tiny_mlp

BASE = {"train_batch_size": 16}
ADAM = {"type": "Adam", "params": {"lr": 1e-3}}

MALFORMED = [
    ({}, "Either train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 0}, "train_batch_size"),
    ({"train_batch_size": -8}, "train_batch_size"),
    ({"train_batch_size": "lots"}, "train_batch_size.*'lots'"),
    ({"train_batch_size": 12}, "train_micro_batch_size_per_gpu resolved to 1.*|12 != 1 \\* 1 \\* 8"),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, "gradient_accumulation_steps resolved to 0"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, "32 != 2 \\* 3 \\* 8"),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, "Either train_batch_size"),
    ({**BASE, "gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({**BASE, "gradient_clipping": -1.0}, "gradient_clipping"),
    ({**BASE, "gradient_clipping": "off"}, "gradient_clipping.*'off'"),
    ({**BASE, "steps_per_print": 0}, "steps_per_print"),
    ({**BASE, "wall_clock_breakdown": "sometimes"}, "wall_clock_breakdown"),
    ({**BASE, "zero_optimization": {"stage": 7}}, "zero_optimization.stage"),
    ({**BASE, "zero_optimization": {"stag": 2}}, "zero_optimization.stag.*did you mean 'stage'"),
    ({**BASE, "zero_optimization": {"stage": 2, "overlap_com": True}}, "overlap_com.*did you mean 'overlap_comm'"),
    ({**BASE, "zero_optimization": "two"}, "zero_optimization"),
    ({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16"),
    ({**BASE, "fp16": {"enable": True}}, "fp16.enable.*did you mean 'enabled'"),
    ({**BASE, "fp16": {"loss_scale": -1}}, "fp16.loss_scale"),
    ({**BASE, "fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ({**BASE, "bf16": {"enabled": "yes please"}}, "bf16.enabled"),
    ({**BASE, "tensorboard": {"enabled": True, "outputpath": "runs"}}, "tensorboard.outputpath.*output_path"),
    ({**BASE, "csv_monitor": {"enabled": True, "job": "x"}}, "csv_monitor.job.*job_name"),
    ({**BASE, "wandb": {"enabled": True, "projct": "x"}}, "wandb.projct.*project"),
    ({**BASE, "spmd": {"mesh": {"data": 3}}}, "does not cover the 8 devices"),
    ({**BASE, "spmd": {"mesh": {"data": -1, "fsdp": -1}}}, "at most one of 'data' and 'fsdp'"),
    ({**BASE, "spmd": {"mesh": {"data": 0}}}, "spmd.mesh.data"),
    ({**BASE, "spmd": {"meshes": {}}}, "spmd.meshes.*did you mean 'mesh'"),
    ({**BASE, "optimizer": {"params": {"lr": 0.1}}}, "optimizer.type"),
    ({**BASE, "optimizer": {"type": "Adamm"}}, "'Adamm'.*did you mean 'Adam'"),
    ({**BASE, "optimizer": {"type": "Adam", "params": {"lr": -0.1}}}, "lr must be a number >= 0"),
    ({**BASE, "optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}, "betas must be two numbers"),
    ({**BASE, "optimizer": {"type": "Adam", "params": {"eps": 0}}}, "eps must be > 0"),
    ({**BASE, "optimizer": {"type": "Adam", "params": {"learning_rate": 1e-3}}}, "unknown key 'learning_rate'"),
    ({**BASE, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}, "optimizer.params.*'lr' is 'auto'"),
    ({**BASE, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "max_grad_norm"),
    ({**BASE, "optimizer": {"type": "OneBitAdam", "params": {}}}, "OneBitAdam.*compiler emits the collectives"),
    ({**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 2.0}}}, "momentum must be in"),
    ({**BASE, "optimizer": ADAM, "scheduler": {"type": "WarmupCosine"}}, "did you mean 'WarmupCosineLR'"),
    ({**BASE, "optimizer": ADAM, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}},
     "warmup_num_steps must be a non-negative integer"),
    ({**BASE, "optimizer": ADAM, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
     "total_num_steps"),
    ({**BASE, "optimizer": ADAM, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
     "'warmup_max_lr' is 'auto'"),
    ({**BASE, "scheduler": {"type": "WarmupLR", "params": {}}}, "no optimizer to schedule"),
    ({**BASE, "optimizer": "Adam"}, "optimizer.*valid dictionary"),
    ({**BASE, "optimizer": {"type": "Adam", "params": {"weight_decay": "lots"}}}, "optimizer.params for 'Adam'"),
    ({**BASE, "optimizer": {"type": "Adam", "params": {"betas": 0.9}}}, "betas must be two numbers"),
    ({**BASE, "optimizer": ADAM, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "low"}}},
     "scheduler.params.warmup_min_lr must be a number.*'low'"),
    ({**BASE, "optimizer": ADAM, "scheduler": {"type": "WarmupLR", "params": []}}, "scheduler.params"),
    ({**BASE, "optimizer": ADAM, "scheduler": {"type": "StepLR", "params": {"step_size": 2, "gama": 0.5}}},
     "unknown key 'gama'.*did you mean 'gamma'"),
]


@pytest.mark.parametrize("cfg,match", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_config_is_a_clear_value_error(cfg, match):
    assert len(MALFORMED) >= 30
    with pytest.raises(ConfigError, match=match):
        spmdzero.initialize(model=tiny_mlp(), config=cfg)


def test_auto_batch_values_are_resolved_from_the_mesh():
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 2, "overlap_comm": "auto"}})
    assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()) == (4, 1)
    assert engine.gradient_clipping() == 1.0
