"""spmdzero on 4 CPU devices against DeepSpeed's own ZeRO-2 and ZeRO-3 runs (gloo, 4 ranks) of
the same model, data and config JSON, in fp32 and bf16: accumulation, clipping and a warmup
schedule on. Each on both backends (the loss is computed outside the module, as DeepSpeed scripts do).

The DeepSpeed side is recorded in tests/fixtures/ by tests/oracle/deepspeed_training.py
(see its docstring); DeepSpeed is not needed to run this test.
"""

import json
import pathlib

import numpy as np
import pytest

from conftest import REPO, run_python

pytestmark = pytest.mark.slow

FIXTURES = pathlib.Path(REPO, "tests", "fixtures")
# fp32 agrees to float rounding; bf16 to bf16 rounding (8 bits of mantissa)
TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-5), "bf16": dict(rtol=2e-2, atol=1e-2)}


BACKENDS = pytest.mark.parametrize("backend", ["torch_xla", "torchax"])


def _config(precision: str, backend: str, stage: int = 2) -> str:
    """The case's config at ZeRO ``stage``, for ``backend``, as Python source for the subprocess."""
    base = "CONFIG_BF16" if precision == "bf16" else "CONFIG"
    return f"{{**{base}, 'zero_optimization': {{'stage': {stage}}}, 'spmd': {{'backend': {backend!r}}}}}"


def _train_from_scratch(precision: str, backend: str, stage: int) -> dict:
    out = run_python(f"""
        import json, sys
        sys.path.insert(0, "tests/oracle")
        import torch, spmdzero
        from training_case import CONFIG, CONFIG_BF16, make_model, train_spmdzero
        engine, *_ = spmdzero.initialize(model=make_model(), config={_config(precision, backend, stage)})
        print(json.dumps(train_spmdzero(engine)))
    """, env={"CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU"})
    return json.loads(out.strip().splitlines()[-1])


@BACKENDS
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero2_matches_deepspeed(precision, backend):
    ds = json.loads((FIXTURES / f"deepspeed_zero2_{precision}.json").read_text())
    ours = _train_from_scratch(precision, backend, 2)
    assert ours["world"] == 4 and ours["global_steps"] == ds["global_steps"]
    assert_matches_deepspeed(ours, ds, 0, precision)


@BACKENDS
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_matches_deepspeed(precision, backend):
    """Stage 3 shards the parameters too; DeepSpeed's stage-3 run (its final parameters gathered
    whole) is the oracle, to the same tolerances as stage 2."""
    ds = json.loads((FIXTURES / f"deepspeed_zero3_{precision}.json").read_text())
    assert ds["config"]["zero_optimization"]["stage"] == 3
    ours = _train_from_scratch(precision, backend, 3)
    assert ours["world"] == 4 and ours["global_steps"] == ds["global_steps"]
    assert_matches_deepspeed(ours, ds, 0, precision)


def test_deepspeed_zero3_losses_are_its_zero2_losses():
    """DeepSpeed's stage 3 is stage 2's math with the parameters partitioned: its two recorded
    runs agree (to float rounding in fp32, to bf16 rounding in bf16), so one oracle checks the other."""
    for precision in ("fp32", "bf16"):
        zero2, zero3 = (json.loads((FIXTURES / f"deepspeed_zero{s}_{precision}.json").read_text()) for s in (2, 3))
        assert zero3["lrs"] == zero2["lrs"]
        np.testing.assert_allclose(zero3["losses"], zero2["losses"], **TOLERANCE[precision])
        for name, values in zero2["params"].items():
            np.testing.assert_allclose(zero3["params"][name], values, err_msg=name, **TOLERANCE[precision])


def assert_matches_deepspeed(ours: dict, ds: dict, start: int, precision: str) -> None:
    """DeepSpeed's lrs, losses (from micro-step ``start``) and final params, to tolerance."""
    loss_diff = np.abs(np.subtract(ours["losses"], ds["losses"][start:])).max()
    param_diff = max(np.abs(np.subtract(ours["params"][n], v)).max() for n, v in ds["params"].items())
    print(f"{precision}: max |loss - DeepSpeed's| {loss_diff:.3g}, max |param - DeepSpeed's| {param_diff:.3g}")
    assert ours["lrs"] == pytest.approx(ds["lrs"][start:], rel=1e-6)
    np.testing.assert_allclose(ours["losses"], ds["losses"][start:], **TOLERANCE[precision])
    for name, values in ds["params"].items():
        np.testing.assert_allclose(ours["params"][name], values, err_msg=name, **TOLERANCE[precision])


@BACKENDS
@pytest.mark.parametrize("precision,route", [("fp32", "load_checkpoint"), ("fp32", "import-deepspeed"),
                                             ("bf16", "load_checkpoint")])
def test_deepspeed_checkpoint_import_continues_as_deepspeed_did(precision, route, backend, tmp_path):
    """DeepSpeed saved a ZeRO-2 checkpoint (4 ranks) after 12 micro-steps of the fp32 run and
    went on; spmdzero loads that directory (directly, or converted by the CLI without
    devices) and continues on the same data."""
    ds = json.loads((FIXTURES / f"deepspeed_zero2_{precision}.json").read_text())
    start = ds["saved_after"]
    source = str(FIXTURES / f"deepspeed_zero2_{precision}_ckpt")
    if route == "import-deepspeed":
        converted = run_python(f"""
            import sys, spmdzero_cli
            code = spmdzero_cli.main(["checkpoint", "import-deepspeed", {source!r}, {str(tmp_path)!r}])
            print("exit", code, "torch_xla loaded:", "torch_xla" in sys.modules)
        """)
        assert "exit 0 torch_xla loaded: False" in converted
        source = str(tmp_path)
    out = run_python(f"""
        import json, sys
        sys.path.insert(0, "tests/oracle")
        import torch, spmdzero
        from training_case import CONFIG, CONFIG_BF16, train_spmdzero
        torch.manual_seed(123)  # a different init: everything must come from the checkpoint
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        engine, *_ = spmdzero.initialize(model=model, config={_config(precision, backend)})
        path, client = engine.load_checkpoint({source!r})
        counters = [engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps]
        print(json.dumps({{**train_spmdzero(engine, {start}), "client": client, "counters": counters}}))
    """, env={"CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU"})
    ours = json.loads(out.strip().splitlines()[-1])
    assert ours["client"] == {"epoch": 1}
    assert ours["counters"] == [6, 96, 12, 0]
    assert_matches_deepspeed(ours, ds, start, precision)


def test_a_deepspeed_zero3_checkpoint_is_named_as_such_with_the_way_to_its_weights(tmp_path):
    """Not read yet (each parameter split on its own over per-rank files): said, not "not a
    DeepSpeed checkpoint"."""
    from spmdzero.io.checkpoint_format import CheckpointError
    from spmdzero.io.deepspeed_import import import_deepspeed

    with pytest.raises(CheckpointError, match="is a DeepSpeed ZeRO-3 checkpoint .*zero_to_fp32.py"):
        import_deepspeed(str(FIXTURES / "deepspeed_zero3_fp32_ckpt"), str(tmp_path / "out"))
