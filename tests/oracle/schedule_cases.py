"""LR schedule cases recorded from DeepSpeed (``deepspeed_schedules.py``) and replayed by
tests/optim/test_schedules.py: each names a schedule, its config params, the optimizer kind and
the param-group base lrs."""

import torch

STEPS = 1200

CASES = {
    "warmup_log_default": ("WarmupLR", {}, "adam", [0.01]),
    "warmup_linear": ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 500,
                                   "warmup_type": "linear"}, "adam", [0.01]),
    "warmup_two_groups": ("WarmupLR", {"warmup_min_lr": [0.0, 1e-5], "warmup_max_lr": [1e-3, 2e-3],
                                       "warmup_num_steps": 100}, "adam", [0.01, 0.02]),
    "warmup_one_step": ("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}, "sgd", [0.1]),
    "decay_log": ("WarmupDecayLR", {"total_num_steps": 1100, "warmup_num_steps": 300}, "adam", [0.01]),
    "decay_linear_past_end": ("WarmupDecayLR", {"total_num_steps": 800, "warmup_num_steps": 100,
                                                "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3,
                                                "warmup_type": "linear"}, "adam", [0.01]),
    "cosine_log": ("WarmupCosineLR", {"total_num_steps": 1100, "warmup_num_steps": 100,
                                      "warmup_min_ratio": 0.1, "cos_min_ratio": 1e-3}, "adam", [0.01]),
    "cosine_linear_two_groups": ("WarmupCosineLR", {"total_num_steps": 900, "warmup_num_steps": 50,
                                                    "warmup_type": "linear"}, "adam", [0.01, 0.003]),
    "onecycle_decay": ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 300,
                                    "cycle_second_step_size": 200, "decay_lr_rate": 0.5, "decay_step_size": 100,
                                    "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.1},
                       "adam", [0.01]),
    "onecycle_stairs": ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 5e-3, "cycle_first_step_size": 250,
                                     "cycle_second_step_size": 350, "cycle_first_stair_count": 5,
                                     "cycle_second_stair_count": 7}, "adam", [0.01]),
    "onecycle_sgd_no_momentum": ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-1,
                                              "cycle_first_step_size": 400}, "sgd", [0.1]),
    "range_test": ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 50,
                                   "lr_range_test_step_rate": 0.5}, "adam", [0.01]),
    "range_test_staircase": ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 70,
                                             "lr_range_test_staircase": True}, "sgd", [0.01]),
}


def make_optimizer(kind: str, base_lrs, sgd_cls=torch.optim.SGD, adam_cls=torch.optim.AdamW):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in base_lrs]
    return sgd_cls(groups, lr=base_lrs[0]) if kind == "sgd" else adam_cls(groups, lr=base_lrs[0])
