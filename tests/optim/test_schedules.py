"""DeepSpeed's LR schedules, step for step against values recorded from DeepSpeed 0.19.8."""

import json
import pathlib
import sys

import pytest
import torch

from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import SchedulerConfig
from spmdzero.optim.optimizers import SGD, AdamW
from spmdzero.optim.schedules import WarmupLR, build_scheduler

from conftest import REPO

sys.path.insert(0, str(pathlib.Path(REPO, "tests", "oracle")))
from schedule_cases import CASES, STEPS, make_optimizer  # noqa: E402

RECORDED = json.loads(pathlib.Path(REPO, "tests", "fixtures", "deepspeed_schedules.json").read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_schedule_matches_deepspeed_at_every_step(case):
    name, params, kind, base_lrs = CASES[case]
    opt = make_optimizer(kind, base_lrs, sgd_cls=SGD, adam_cls=AdamW)
    sched = build_scheduler(SchedulerConfig(type=name, params=params), opt)
    want = RECORDED["cases"][case]
    assert len(want["lrs"]) == STEPS + 1 >= 1001
    for t in range(STEPS + 1):
        if t:
            sched.step()
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(want["lrs"][t], rel=1e-12, abs=1e-18), t
        betas = [list(g["betas"]) if "betas" in g else None for g in opt.param_groups]
        assert betas == want["betas"][t], t


@pytest.mark.parametrize("case", sorted(CASES))
def test_device_formulas_match_deepspeed_in_float32(case):
    """The in-graph form of each schedule (used when steps can be skipped) on a vector of t."""
    from spmdzero.optim.ops import TORCH_OPS

    name, params, kind, base_lrs = CASES[case]
    opt = make_optimizer(kind, base_lrs, sgd_cls=SGD, adam_cls=AdamW)
    sched = build_scheduler(SchedulerConfig(type=name, params=params), opt)
    t = torch.arange(-1, STEPS, dtype=torch.float32)
    want = torch.tensor(RECORDED["cases"][case]["lrs"][:STEPS + 1], dtype=torch.float64)
    got = torch.stack([lr.double() for lr in sched.lr_at(t, TORCH_OPS)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)  # float32 cancellation near cycle ends
    if getattr(sched, "cycle_momentum", False):
        moms = torch.stack([m.double() for m in sched.momentum_at(t, TORCH_OPS)], dim=1)
        want_moms = torch.tensor([[b[0] for b in row] for row in RECORDED["cases"][case]["betas"][:STEPS + 1]],
                                 dtype=torch.float64)
        torch.testing.assert_close(moms[1:], want_moms[1:], rtol=1e-5, atol=1e-7)


def test_step_if_does_not_advance_on_skipped_steps():
    import torch_xla

    opt = make_optimizer("adam", [0.01], adam_cls=AdamW)
    sched = build_scheduler(SchedulerConfig(type="WarmupLR", params={"warmup_num_steps": 10,
                                                                     "warmup_type": "linear"}), opt)
    device = torch_xla.device()
    for applied in [True, False, False, True, True]:
        sched.step_if(torch.tensor(applied).to(device))
    assert sched.state_dict() == {"last_batch_iteration": 2}
    assert sched.get_last_lr() == pytest.approx([0.01 * 2 / 10])


def test_first_optimizer_step_uses_the_t_minus_one_lr():
    opt = make_optimizer("adam", [0.01], adam_cls=AdamW)
    sched = WarmupLR(opt, warmup_min_lr=1e-5, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 1e-5 and sched.last_batch_iteration == -1


def test_state_dict_round_trip_and_get_last_lr():
    opt = make_optimizer("adam", [0.01], adam_cls=AdamW)
    sched = build_scheduler(SchedulerConfig(type="WarmupDecayLR", params={"total_num_steps": 50}), opt)
    for _ in range(7):
        sched.step()
    state = sched.state_dict()
    other = build_scheduler(SchedulerConfig(type="WarmupDecayLR", params={"total_num_steps": 50}),
                            make_optimizer("adam", [0.01], adam_cls=AdamW))
    other.load_state_dict(state)
    assert other.get_lr() == sched.get_lr() == sched.get_last_lr()


def test_torch_lr_scheduler_by_exact_name():
    opt = make_optimizer("sgd", [0.1], sgd_cls=SGD)
    sched = build_scheduler(SchedulerConfig(type="StepLR", params={"step_size": 2, "gamma": 0.5}), opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)


@pytest.mark.parametrize("cfg,match", [
    (SchedulerConfig(type="WarmupLr", params={}), "did you mean 'WarmupLR'"),
    (SchedulerConfig(type="WarmupLR", params={"warmup_steps": 10}), "warmup_steps.*did you mean 'warmup_num_steps'"),
    (SchedulerConfig(type="WarmupLR", params={"warmup_num_steps": -1}), "warmup_num_steps must be a non-negative integer"),
    (SchedulerConfig(type="WarmupLR", params={"warmup_type": "cosine"}), "warmup_type must be 'log' or 'linear'"),
    (SchedulerConfig(type="WarmupDecayLR", params={}), "missing.*total_num_steps"),
    (SchedulerConfig(type="OneCycle", params={"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0}),
     "cycle_first_step_size must be positive"),
    (SchedulerConfig(type="WarmupLR", params={"warmup_min_lr": [0.1, 0.2]}), "expected 1 values"),
])
def test_bad_schedule_configs_name_the_problem(cfg, match):
    with pytest.raises(ConfigError, match=match):
        build_scheduler(cfg, make_optimizer("adam", [0.01], adam_cls=AdamW))


TRAINING_SCHEDULES = {
    "WarmupLR": {"warmup_num_steps": 4},
    "WarmupDecayLR": {"total_num_steps": 8, "warmup_num_steps": 3},
    "WarmupCosineLR": {"total_num_steps": 8, "warmup_num_steps": 3},
    "OneCycle": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3, "decay_lr_rate": 0.5,
                 "decay_step_size": 2, "decay_mom_rate": 0.1},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2},
}


@pytest.mark.parametrize("name", sorted(TRAINING_SCHEDULES))
def test_training_under_each_schedule_never_recompiles_after_warmup(name):
    import torch_xla.debug.metrics as met

    import spmdzero
    from conftest import batches, tiny_mlp

    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={
        "train_batch_size": 16, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "scheduler": {"type": name, "params": TRAINING_SCHEDULES[name]}})
    lrs, compiles = [], []
    for x, y in batches(10, 16):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
        engine.step()
        lrs.append(engine.get_lr()[0])
        compiles.append(met.metric_data("CompileTime")[0])
    assert len(set(lrs)) >= 4  # the lr really moved
    assert compiles[2:] == [compiles[1]] * 8, compiles


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_no_warmup_is_two_steps_as_deepspeed_makes_it(kind):
    """transformers' Trainer fills an "auto" warmup_num_steps with 0 when no warmup is asked
    (its default): DeepSpeed takes it as max(2, 0) = 2, and so does spmdzero (it was refused)."""
    params = {"warmup_num_steps": 0, **({"total_num_steps": 10} if kind != "WarmupLR" else {}),
              **({"warmup_max_lr": 0.01} if kind != "WarmupCosineLR" else {})}
    opt = make_optimizer("adam", [0.01], adam_cls=AdamW)
    sched = build_scheduler(SchedulerConfig(type=kind, params=params), opt)
    assert sched.warmup_num_steps == 2
