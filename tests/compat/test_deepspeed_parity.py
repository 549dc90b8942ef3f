"""spmdzero on 4 CPU devices against DeepSpeed's own ZeRO-2 and ZeRO-3 runs (gloo, 4 ranks) of
the same model, data and config JSON, in fp32 and bf16: accumulation, clipping and a warmup
schedule on. Each on both backends (the loss is computed outside the module, as DeepSpeed scripts do).

The DeepSpeed side is recorded in tests/fixtures/ by tests/oracle/deepspeed_training.py and,
for a ZeRO-3 checkpoint layout the shared case does not reach, deepspeed_zero3_layout.py (see
their docstrings); DeepSpeed is not needed to run this test.
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
                                             ("bf16", "load_checkpoint"), ("fp32", "torch-optimizer"),
                                             ("fp32", "import-deepspeed+torch-optimizer")])
def test_deepspeed_checkpoint_import_continues_as_deepspeed_did(precision, route, backend, tmp_path):
    """DeepSpeed saved a ZeRO-2 checkpoint (4 ranks) after 12 micro-steps of the fp32 run and
    went on; spmdzero loads that directory (directly, or converted by the CLI without
    devices) and continues on the same data. "torch-optimizer": the engine trains a torch
    ``AdamW`` given to ``initialize`` (accelerate's scripts), which keeps its step count on the
    host; DeepSpeed's file holds it beside the moments."""
    _continue_from_deepspeed(2, precision, route, backend, tmp_path)


@pytest.mark.parametrize("precision,route,backend", [
    ("fp32", "load_checkpoint", "torchax"), ("fp32", "load_checkpoint", "torch_xla"),
    ("fp32", "import-deepspeed", "torchax"), ("bf16", "load_checkpoint", "torchax")])
def test_a_deepspeed_zero3_checkpoint_continues_as_deepspeed_did(precision, route, backend, tmp_path):
    """The same from DeepSpeed's ZeRO-3 checkpoint of its stage-3 run: per-rank model files with
    the parameters empty, each parameter split on its own over the ranks' optimizer files
    (one backend for the routes the reading alone decides)."""
    _continue_from_deepspeed(3, precision, route, backend, tmp_path)


def _continue_from_deepspeed(stage: int, precision: str, route: str, backend: str, tmp_path) -> None:
    """Load DeepSpeed's ZeRO-``stage`` checkpoint into a stage-``stage`` engine on 4 devices,
    train on, and match DeepSpeed's own continuation."""
    ds = json.loads((FIXTURES / f"deepspeed_zero{stage}_{precision}.json").read_text())
    start = ds["saved_after"]
    source = str(FIXTURES / f"deepspeed_zero{stage}_{precision}_ckpt")
    if route.startswith("import-deepspeed"):
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
        config, optimizer = {_config(precision, backend, stage)}, None
        if {route.endswith("torch-optimizer")}:  # the config's AdamW, as a torch optimizer
            params = config.pop("optimizer")["params"]
            optimizer = torch.optim.AdamW(model.parameters(), **{{**params, "betas": tuple(params["betas"])}})
        engine, *_ = spmdzero.initialize(model=model, optimizer=optimizer, config=config)
        path, client = engine.load_checkpoint({source!r})
        counters = [engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps]
        print(json.dumps({{**train_spmdzero(engine, {start}), "client": client, "counters": counters}}))
    """, env={"CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU"})
    ours = json.loads(out.strip().splitlines()[-1])
    assert ours["client"] == {"epoch": 1}
    assert ours["counters"] == [6, 96, 12, 0]
    assert_matches_deepspeed(ours, ds, start, precision)


def test_a_deepspeed_zero3_checkpoint_reads_as_its_zero2_checkpoint():
    """DeepSpeed's two runs are the same math (test above), so its two checkpoints, one whole
    module file and one per rank with each parameter split on its own, hold the same state: the
    reader's rank order and slicing must give stage 2's tensors and host state back."""
    from spmdzero.io.deepspeed_import import read_deepspeed_checkpoint

    for precision in ("fp32", "bf16"):
        zero2, zero3 = (read_deepspeed_checkpoint(str(FIXTURES / f"deepspeed_zero{s}_{precision}_ckpt" / "global_step6"))
                        for s in (2, 3))
        assert sorted(zero3[0]) == sorted(zero2[0])
        for key, value in zero2[0].items():
            assert zero3[0][key].dtype == value.dtype and zero3[0][key].shape == value.shape, key
            np.testing.assert_allclose(zero3[0][key].detach().float().numpy(), value.detach().float().numpy(), err_msg=key,
                                       **TOLERANCE[precision])
        assert {k: v for k, v in zero3[1].items() if k != "ds_config"} == \
            {k: v for k, v in zero2[1].items() if k != "ds_config"}


def test_a_deepspeed_zero3_checkpoint_missing_a_rank_is_refused_naming_it(tmp_path):
    """A stage-3 directory copied in part (one rank's optimizer file lost) cannot be put back
    together: said, with the count, not an IndexError."""
    import shutil

    from spmdzero.io.checkpoint_format import CheckpointError
    from spmdzero.io.deepspeed_import import import_deepspeed

    copy = tmp_path / "ds"
    shutil.copytree(FIXTURES / "deepspeed_zero3_fp32_ckpt", copy)
    (copy / "global_step6" / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"3 \*zero_pp_rank_\*_mp_rank_00_optim_states.pt files for a dp "
                                              r"world size of 4"):
        import_deepspeed(str(copy), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_deepspeed_zero3_checkpoint_with_a_frozen_parameter_and_padded_slices_loads_exactly():
    """DeepSpeed's ZeRO-3 layout beyond the shared case (tests/oracle/deepspeed_zero3_layout.py):
    sizes 4 ranks do not divide (each parameter's last slice padded), a frozen bias, saved as
    fragments in the per-rank model files, and two param groups (weight decay on the weights
    only). The engine gets DeepSpeed's gathered parameters exactly, moments for the trainable
    ones only, and trains on."""
    ds = json.loads((FIXTURES / "deepspeed_zero3_layout.json").read_text())
    source = str(FIXTURES / "deepspeed_zero3_layout_ckpt")
    out = run_python(f"""
        import json, torch, spmdzero
        model = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
        model.get_parameter("0.bias").requires_grad_(False)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # the oracle's groups
        groups = [{{"params": [p for n, p in trainable if n.endswith("weight")], "weight_decay": 0.1}},
                  {{"params": [p for n, p in trainable if not n.endswith("weight")], "weight_decay": 0.0}}]
        engine, *_ = spmdzero.initialize(model=model, model_parameters=groups,
                                         config={{**{ds["config"]!r}, "zero_optimization": {{"stage": 3}}}})
        engine.load_checkpoint({source!r})
        loaded = {{n: p.detach().float().cpu().tolist() for n, p in engine.module.named_parameters()}}
        loss = engine(torch.randn(8, 8)).pow(2).mean(); engine.backward(loss); engine.step()
        print(json.dumps({{"params": loaded, "steps": engine.global_steps,
                          "loss": loss.item()}}))
    """, env={"CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU"})
    ours = json.loads(out.strip().splitlines()[-1])
    assert set(ours["params"]) == set(ds["params"])
    for name, values in ds["params"].items():
        np.testing.assert_array_equal(ours["params"][name], values, err_msg=name)
    from spmdzero.io.deepspeed_import import read_deepspeed_checkpoint

    tensors, _ = read_deepspeed_checkpoint(source + "/global_step4")
    moments = {key.split(".exp_avg_sq")[0][len("optim."):] for key in tensors if key.endswith(".exp_avg_sq")}
    assert moments == set(ds["params"]) - set(ds["frozen"])
    assert ours["steps"] == ds["global_steps"] + 1 and np.isfinite(ours["loss"])
