"""Record DeepSpeed's LR schedules for every case in schedule_cases.py (the test oracle).

    python tests/oracle/deepspeed_schedules.py OUT.json

Needs deepspeed==0.19.8. For each case: the lrs (and betas) right after construction
(t = -1), then after each of STEPS calls to step().
"""

import json
import os
import sys

from deepspeed.runtime import lr_schedules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from schedule_cases import CASES, STEPS, make_optimizer  # noqa: E402


def record(name, params, kind, base_lrs):
    opt = make_optimizer(kind, base_lrs)
    sched = getattr(lr_schedules, name)(opt, **params)
    lrs, betas = [], []
    for t in range(STEPS + 1):
        if t:
            sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        betas.append([list(g["betas"]) if "betas" in g else None for g in opt.param_groups])
    return {"lrs": lrs, "betas": betas}


if __name__ == "__main__":
    import deepspeed

    out = {"deepspeed_version": deepspeed.__version__, "steps": STEPS,
           "cases": {case: record(*spec) for case, spec in CASES.items()}}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
