"""Checkpoints on the torchax backend: the torch_xla backend's format, so either backend resumes
the other's run, on any device count, and consolidation and DeepSpeed import work alike."""

import json
import os

import numpy as np
import pytest
import torch

import spmdzero
from spmdzero.io.checkpoint_format import CheckpointError

from conftest import REPO, batches, run_python, tiny_mlp
from test_torchax_backend import WithLoss, config
from test_torchax_optimizers import train as train_on

GAS, STEPS, SAVED_AT = 2, 4, 2  # optimizer steps; the save comes after SAVED_AT of them


def data():
    return batches(STEPS * GAS, 16)


def train(engine, start: int = 0, stop: int = STEPS) -> list[float]:
    """Micro-steps of optimizer steps ``start..stop`` on the shared data; their losses."""
    losses = []
    for x, y in data()[start * GAS:stop * GAS]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def engine_for(backend: str, seed: int = 0, **extra):
    engine, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=seed)), config=config(backend, GAS, **extra))
    return engine


def host_params(engine) -> dict:
    return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted torchax run, and a checkpoint of each backend after SAVED_AT steps."""
    root = tmp_path_factory.mktemp("runs")
    full = engine_for("torchax")
    losses = train(full)
    saved = {}
    for backend in ("torchax", "torch_xla"):
        engine = engine_for(backend)
        train(engine, 0, SAVED_AT)
        assert engine.save_checkpoint(str(root / backend), client_state={"epoch": 3, "ids": torch.arange(2)})
        saved[backend] = str(root / backend), host_params(engine)
    return {"losses": losses, "params": host_params(full), "lr": full.get_lr(), "saved": saved}


def resume(backend: str, ckpt: str, **extra):
    engine = engine_for(backend, seed=7, **extra)  # another init: everything must come from the checkpoint
    path, client = engine.load_checkpoint(ckpt)
    assert path == os.path.join(ckpt, f"global_step{SAVED_AT}") and client["epoch"] == 3
    assert (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps) == \
        (SAVED_AT, SAVED_AT * 32, SAVED_AT * GAS, 0)
    return engine


@pytest.mark.parametrize("saved_by,loaded_by", [("torchax", "torchax"), ("torchax", "torch_xla"),
                                                ("torch_xla", "torchax")])
def test_a_run_resumes_from_either_backends_checkpoint_as_if_uninterrupted(runs, saved_by, loaded_by):
    ckpt, params_at_save = runs["saved"][saved_by]
    engine = resume(loaded_by, ckpt)
    for name, value in host_params(engine).items():  # the module reads the loaded weights
        torch.testing.assert_close(value, params_at_save[name], atol=1e-6, rtol=1e-6)
    losses = train(engine, SAVED_AT)
    assert losses == pytest.approx(runs["losses"][SAVED_AT * GAS:], abs=1e-5)
    assert engine.get_lr() == pytest.approx(runs["lr"])  # the schedule went on
    for name, value in host_params(engine).items():
        torch.testing.assert_close(value, runs["params"][name], atol=1e-5, rtol=1e-5)
    if loaded_by == "torchax":  # the loaded arrays are laid out as the programs were traced for: no retrace
        assert engine.traces == {"train_forward": 2, "update": 1}


def test_both_backends_write_the_same_files(runs):
    """The same keys, shapes, dtypes and host state, and each tensor in the same chunks."""
    from spmdzero.io.read import open_state, read_meta

    metas, chunks = {}, {}
    for backend, (ckpt, _) in runs["saved"].items():
        path = os.path.join(ckpt, f"global_step{SAVED_AT}")
        assert sorted(os.listdir(path)) == ["client_state.pt", "meta.json", "state"]
        metas[backend] = read_meta(path)
        chunks[backend] = {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
                           for k, md in open_state(path).read_metadata().state_dict_metadata.items()}
    ours, theirs = metas["torchax"], metas["torch_xla"]
    assert ours["tensors"] == theirs["tensors"]
    assert chunks["torchax"] == chunks["torch_xla"]
    assert len(chunks["torchax"]["optim.net.0.weight.exp_avg"]) == 8  # one per device's shard, none gathered
    for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "mesh", "zero_stage",
                "module_keys", "stacked_layers"):
        assert ours[key] == theirs[key], key
    assert ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    assert ours["optimizer"]["host_state"] == {} and set(ours["rng"]) == {"torch", "xla", "python", "numpy", "position"}
    assert set(theirs["rng"]) == {"torch", "xla", "python", "numpy"}  # torch_xla's seed says where its stream is


def test_consolidate_a_torchax_checkpoint(runs, tmp_path):
    from spmdzero.cli.main import main as cli

    ckpt, params = runs["saved"]["torchax"]
    out = tmp_path / "model.pt"
    assert cli(["checkpoint", "consolidate", ckpt, str(out)]) == 0
    state = torch.load(out)
    assert state.keys() == params.keys()
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, atol=0, rtol=0)


def test_bf16_masters_and_states_resume_on_either_backend(tmp_path):
    bf16 = {"bf16": {"enabled": True}}
    full = engine_for("torchax", **bf16)
    expected = train(full)
    engine = engine_for("torchax", **bf16)
    train(engine, 0, SAVED_AT)
    masters = {n: np.asarray(m) for n, m in engine.state.masters.items()}
    engine.save_checkpoint(str(tmp_path), client_state={"epoch": 3})
    for backend in ("torchax", "torch_xla"):
        resumed = resume(backend, str(tmp_path), **bf16)
        if backend == "torchax":
            for name, value in resumed.state.masters.items():  # fp32 masters exactly, not their bf16 casts
                assert value.dtype == "float32" and np.array_equal(np.asarray(value), masters[name])
            assert train(resumed, SAVED_AT) == expected[SAVED_AT * GAS:]  # bit for bit on the same backend
        else:
            assert train(resumed, SAVED_AT) == pytest.approx(expected[SAVED_AT * GAS:], rel=1e-2)


def test_module_only_and_mismatched_loads(runs):
    ckpt, params_at_save = runs["saved"]["torchax"]
    engine = engine_for("torchax", seed=7)
    engine.load_checkpoint(ckpt, load_module_only=True)
    assert engine.global_steps == 0 and int(engine.optimizer_states()["net.0.weight"]["step"]) == 0
    for name, value in host_params(engine).items():
        torch.testing.assert_close(value, params_at_save[name], atol=0, rtol=0)
    wider, *_ = spmdzero.initialize(model=WithLoss(tiny_mlp(seed=0, d_hidden=32)), config=config("torchax", GAS))
    before = host_params(wider)
    with pytest.raises(CheckpointError, match=r"shapes do not match.*net.0.weight: checkpoint \(64, 16\) vs model "
                                              r"\(32, 16\)"):
        wider.load_checkpoint(ckpt)
    assert all(torch.equal(value, before[name]) for name, value in host_params(wider).items())


class SequentialWithLoss(torch.nn.Sequential):
    """The DeepSpeed case's model, its parameter names kept, returning its loss."""

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(super().forward(x).float(), y)


def test_a_deepspeed_checkpoint_continues_on_torchax_as_deepspeed_did():
    """DeepSpeed's ZeRO-2 fixture (4 ranks, 2 micro-batches of 2 rows per rank per step), loaded
    on 8 devices with the same global batch, goes on as DeepSpeed's own run did."""
    import sys

    sys.path.insert(0, os.path.join(REPO, "tests", "oracle"))
    from training_case import CONFIG, global_micro_batches

    with open(os.path.join(REPO, "tests", "fixtures", "deepspeed_zero2_fp32.json")) as f:
        ds = json.load(f)
    torch.manual_seed(123)
    model = SequentialWithLoss(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    cfg = {k: v for k, v in CONFIG.items() if k != "train_micro_batch_size_per_gpu"}
    engine, *_ = spmdzero.initialize(model=model, config={**cfg, "train_batch_size": 16,
                                                          "spmd": {"backend": "torchax"}})
    _, client = engine.load_checkpoint(os.path.join(REPO, "tests", "fixtures", "deepspeed_zero2_fp32_ckpt"))
    assert client == {"epoch": 1} and (engine.global_steps, engine.global_samples) == (6, 96)
    losses, lrs = [], []
    for x, y in global_micro_batches()[ds["saved_after"]:]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx(ds["lrs"][ds["saved_after"]:], rel=1e-6)
    np.testing.assert_allclose(losses, ds["losses"][ds["saved_after"]:], rtol=1e-5, atol=1e-5)
    for name, p in engine.module.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), ds["params"][name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_elastic_a_torchax_checkpoint_from_8_devices_resumes_on_4_and_back(runs, tmp_path):
    """Saved on 8 devices, resumed by a process whose JAX has 4 (SPMDZERO_BACKEND=torchax), which
    saves again; that 4-device checkpoint resumes here on 8 with torch_xla."""
    ckpt, _ = runs["saved"]["torchax"]
    out = run_python(f"""
        import json, sys
        sys.path[:0] = ["tests", "tests/backends/torchax"]  # conftest, and this folder's test modules
        import spmdzero
        from test_torchax_checkpoint import SAVED_AT, resume, train
        engine = resume("torchax", {ckpt!r})
        assert engine.mesh.devices.size == 4
        losses = train(engine, SAVED_AT, SAVED_AT + 1)
        engine.save_checkpoint({str(tmp_path)!r})
        print(json.dumps(losses))
    """, env={"SPMDZERO_BACKEND": "torchax", "CPU_NUM_DEVICES": "4"})
    on_4 = json.loads(out.strip().splitlines()[-1])
    assert on_4 == pytest.approx(runs["losses"][SAVED_AT * GAS:(SAVED_AT + 1) * GAS], abs=1e-5)
    engine = engine_for("torch_xla", seed=7)
    engine.load_checkpoint(str(tmp_path))
    assert engine.global_steps == SAVED_AT + 1
    assert train(engine, SAVED_AT + 1) == pytest.approx(runs["losses"][(SAVED_AT + 1) * GAS:], abs=1e-5)


@pytest.mark.slow
def test_checkpoints_move_between_zero_stages_2_and_3_and_device_counts(runs, tmp_path):
    """A stage-2 checkpoint resumes at stage 3 (parameters sharded) and the run goes on as if
    uninterrupted; that stage-3 engine saves, zero_to_fp32 reads its whole weights, and the
    checkpoint resumes at stage 2 on 4 devices (another process) and at stage 1 here, each
    continuing the same run."""
    ckpt, _ = runs["saved"]["torchax"]
    stage3 = resume("torchax", ckpt, zero_optimization={"stage": 3})
    assert not stage3.params()["net.0.weight"].sharding.is_fully_replicated
    assert train(stage3, SAVED_AT, SAVED_AT + 1) == pytest.approx(
        runs["losses"][SAVED_AT * GAS:(SAVED_AT + 1) * GAS], abs=1e-5)
    stage3.save_checkpoint(str(tmp_path))
    from spmdzero.compat.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    whole = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))  # zero_to_fp32 of a stage-3 checkpoint
    for name, value in host_params(stage3).items():
        torch.testing.assert_close(whole[name], value, atol=0, rtol=0)
    rest = runs["losses"][(SAVED_AT + 1) * GAS:]
    out = run_python(f"""
        import json, sys
        sys.path[:0] = ["tests", "tests/backends/torchax"]  # conftest, and this folder's test modules
        import spmdzero
        from test_torchax_checkpoint import SAVED_AT, engine_for, train
        engine = engine_for("torchax", seed=7, zero_optimization={{"stage": 2}})
        engine.load_checkpoint({str(tmp_path)!r})
        assert engine.mesh.devices.size == 4 and engine.global_steps == SAVED_AT + 1
        print(json.dumps(train(engine, SAVED_AT + 1)))
    """, env={"SPMDZERO_BACKEND": "torchax", "CPU_NUM_DEVICES": "4"})
    assert json.loads(out.strip().splitlines()[-1]) == pytest.approx(rest, abs=1e-5)
    stage1 = engine_for("torchax", seed=7, zero_optimization={"stage": 1})
    stage1.load_checkpoint(str(tmp_path))
    assert train(stage1, SAVED_AT + 1) == pytest.approx(rest, abs=1e-5)
    for name, value in host_params(stage1).items():
        torch.testing.assert_close(value, runs["params"][name], atol=1e-5, rtol=1e-5)


class DropoutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.3), torch.nn.Tanh(),
                                        torch.nn.Linear(64, 8))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.body(x), y)


def _accelerate_steps(engine, pairs) -> list[float]:
    """accelerate's ``DeepSpeedEngineWrapper.backward``: the boundary set by the caller, and
    ``engine.step()`` at the boundary only (the Trainer's path), 2 micro-batches a step."""
    losses = []
    for i, (x, y) in enumerate(pairs):
        boundary = i % 2 == 1
        engine.set_gradient_accumulation_boundary(boundary)
        loss = engine(x, y)
        engine.backward(loss)
        if boundary:
            engine.step()
        losses.append(loss.item())
    return losses


def test_a_run_with_dropout_resumes_exactly_when_the_caller_owns_the_boundary(tmp_path):
    """The dropout key folds a count of micro-steps. A load used to set it to global_steps x
    gradient_accumulation_steps, but the engine counts one micro-step per ``step()`` call, and
    accelerate and the Trainer call it at the boundary only: the resumed masks were other masks
    (the Trainer's GPT-2 with dropout 0.1 parted by 5.4e-4 in loss). It is saved as rng.position."""
    pairs = batches(12, 16, seed=5)
    cfg = {"train_batch_size": 32, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD",
           "params": {"lr": 0.1}}, "spmd": {"backend": "torchax"}}
    engine, *_ = spmdzero.initialize(model=DropoutMLP(), config=cfg)
    first = _accelerate_steps(engine, pairs[:6])
    engine.save_checkpoint(str(tmp_path), tag="three")
    uninterrupted = _accelerate_steps(engine, pairs[6:])
    resumed_engine, *_ = spmdzero.initialize(model=DropoutMLP(), config=cfg)
    resumed_engine.load_checkpoint(str(tmp_path), tag="three")
    resumed = _accelerate_steps(resumed_engine, pairs[6:])
    assert resumed == uninterrupted
    assert len(set(first)) == len(first)  # the masks differ from micro-step to micro-step
    with open(os.path.join(tmp_path, "three", "meta.json")) as f:
        assert json.load(f)["rng"]["position"] == 3  # one micro-step per step() call: 3 steps of 2 micro-batches


def test_a_load_into_the_live_engine_draws_as_the_saved_run_after_one_more_step(tmp_path):
    """The forwards of a micro-step draw by their index in it. Loaded back into the same engine
    one step after the save, the loaded micro-step was the one the last forward had drawn in,
    and the next forward took the second draw: other dropout masks (GPT-2 with dropout 0.1 parted
    by 6e-3 in loss). A load restarts the count."""
    pairs = batches(4, 16, seed=7)
    cfg = {"train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "spmd": {"backend": "torchax"}}
    engine, *_ = spmdzero.initialize(model=DropoutMLP(), config=cfg)
    train_on(engine, pairs[:2])
    engine.save_checkpoint(str(tmp_path), tag="two")
    once = train_on(engine, pairs[2:3])
    engine.load_checkpoint(str(tmp_path), tag="two")
    assert train_on(engine, pairs[2:3]) == once
