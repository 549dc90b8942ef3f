"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedules (``spmdzero.optim.schedules``)."""

from spmdzero.optim.schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: F401

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
