"""spmdzero on 4 CPU devices against DeepSpeed's own ZeRO-2 run (gloo, 4 ranks) of the same
model, data and config JSON: accumulation, clipping and a warmup schedule on.

The DeepSpeed side is recorded in tests/fixtures/ by tests/oracle/deepspeed_training.py
(see its docstring); DeepSpeed is not needed to run this test.
"""

import json
import pathlib

import pytest

from conftest import REPO, run_python

pytestmark = pytest.mark.slow

FIXTURE = pathlib.Path(REPO, "tests", "fixtures", "deepspeed_zero2_fp32.json")


def test_zero2_fp32_matches_deepspeed():
    ds = json.loads(FIXTURE.read_text())
    out = run_python("""
        import json, sys
        sys.path.insert(0, "tests/oracle")
        import torch, spmdzero
        from training_case import CONFIG, global_micro_batches, loss_fn, make_model
        engine, *_ = spmdzero.initialize(model=make_model(), config=CONFIG)
        losses, lrs = [], []
        for x, y in global_micro_batches():
            loss = loss_fn(engine(x), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss)
            lrs.append(engine.get_lr()[0])
        params = {n: p.detach().cpu().tolist() for n, p in engine.module.named_parameters()}
        print(json.dumps({"losses": [l.item() for l in losses], "lrs": lrs, "world": engine.dp_world_size,
                          "global_steps": engine.global_steps, "params": params}))
    """, env={"CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU"})
    ours = json.loads(out.strip().splitlines()[-1])
    assert ours["world"] == 4 and ours["global_steps"] == ds["global_steps"]
    assert ours["lrs"] == pytest.approx(ds["lrs"], rel=1e-12)
    assert ours["losses"] == pytest.approx(ds["losses"], rel=1e-5, abs=1e-5)
    for name, values in ds["params"].items():
        import numpy as np

        np.testing.assert_allclose(ours["params"][name], values, rtol=1e-5, atol=1e-5, err_msg=name)
