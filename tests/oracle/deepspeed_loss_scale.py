"""Record DeepSpeed's DynamicLossScaler on the overflow patterns in loss_scale_cases.py.

    python tests/oracle/deepspeed_loss_scale.py OUT.json

Needs deepspeed==0.19.8. For each case: the scale in effect at each step (the one the
step's loss is multiplied by), then the scale after the last update.
"""

import json
import os
import sys

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_scale_cases import CASES, PATTERN  # noqa: E402


def record(fp16):
    scaler = DynamicLossScaler(init_scale=2.0 ** fp16["initial_scale_power"], scale_window=fp16["loss_scale_window"],
                               min_scale=fp16["min_loss_scale"], delayed_shift=fp16["hysteresis"],
                               consecutive_hysteresis=fp16.get("consecutive_hysteresis", False),
                               raise_error_at_min_scale=False, dtype=torch.half)
    scales = []
    for overflow in PATTERN:
        scales.append(scaler.cur_scale)
        scaler.update_scale(bool(overflow))
    return scales + [scaler.cur_scale]


if __name__ == "__main__":
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")  # update_scale logs with the rank
    with open(sys.argv[1], "w") as f:
        json.dump({"pattern": PATTERN, "cases": {name: record(fp16) for name, fp16 in CASES.items()}}, f)
