"""Mixed precision: bf16 with sharded fp32 masters, fp16 with DeepSpeed's dynamic loss
scaling, overflow skipping in the graph; on both backends where a test reads no torch_xla
tensors or metrics."""

import json
import math
import pathlib
import sys

import numpy as np
import pytest
import torch
import torch_xla.debug.metrics as met

import spmdzero
from spmdzero.observe.reports import model_state_bytes, sharding_report, sharding_spec

from conftest import REPO

sys.path.insert(0, str(pathlib.Path(REPO, "tests", "oracle")))
from loss_scale_cases import CASES, PATTERN  # noqa: E402

RECORDED = json.loads(pathlib.Path(REPO, "tests", "fixtures", "deepspeed_loss_scale.json").read_text())
N = 8
SHARDED = "{devices=[8,1]0,1,2,3,4,5,6,7}"
BACKENDS = ["torch_xla", "torchax"]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))


def data(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)) for _ in range(n)]


def config(stage=2, backend="torch_xla", **extra):
    return {"train_batch_size": 16, "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "spmd": {"backend": backend}, **extra}


def run(engine, batches, overflow_pattern=None, observe=None):
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.to(engine.device))
        if overflow_pattern is not None:  # a device factor: the same graph with or without overflow
            # (sent as a 1-element array: torch_xla makes a 0-dim transfer of 1.0 a graph constant)
            factor = torch.tensor([float("inf") if overflow_pattern[i] else 1.0]).to(engine.device).reshape(())
            loss = loss * factor
        if observe:
            observe(i)
        engine.backward(loss)
        engine.step()
        losses.append(loss)
    return losses


def test_bf16_params_replicated_masters_and_moments_sharded_with_exact_accounting():
    engine, *_ = spmdzero.initialize(model=model(), config=config(bf16={"enabled": True}))
    run(engine, data(2))
    w = engine.module[0].weight
    master = engine.master_weights()["0.weight"]
    state = engine.optimizer.state[master]
    assert w.dtype == torch.bfloat16 and sharding_spec(w) == "{replicated}"
    assert master.dtype == torch.float32 and sharding_spec(master) == SHARDED
    assert state["exp_avg"].dtype == torch.float32 and sharding_spec(state["exp_avg"]) == SHARDED
    x, y = data(1)[0]
    engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y.to(engine.device)))
    grad = engine.grad_buffers()["0.weight"]
    assert grad.dtype == torch.bfloat16 and sharding_spec(grad) == SHARDED  # DeepSpeed's default accumulation dtype
    engine.step()  # consumes it (a ZeRO-2 zero_grad keeps it, as DeepSpeed's)
    assert engine.grad_buffers() == {}
    P = sum(p.numel() for p in engine.module.parameters())
    got = model_state_bytes(engine)
    step_counters = 4 * 4  # one fp32 scalar per parameter tensor, replicated
    assert (got.params, got.grads, got.master_weights) == (2 * P, 2 * P // N, 4 * P // N)
    assert got.optimizer_states == 8 * P // N + step_counters
    assert got.total == 2 * P + 14 * P // N + step_counters


def test_bf16_fp32_grad_accumulation_is_configurable():
    engine, *_ = spmdzero.initialize(model=model(), config=config(bf16={"enabled": True},
                                                                  data_types={"grad_accum_dtype": "fp32"}))
    x, y = data(1)[0]
    engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y.to(engine.device)))
    assert engine.grad_buffers()["0.weight"].dtype == torch.float32


def test_bf16_trains_like_fp32_within_bf16_tolerance():
    batches = data(10)
    fp32, *_ = spmdzero.initialize(model=model(), config=config())
    bf16, *_ = spmdzero.initialize(model=model(), config=config(bf16={"enabled": True}))
    ref = [l.item() for l in run(fp32, batches)]
    got = [l.item() for l in run(bf16, batches)]
    np.testing.assert_allclose(got, ref, rtol=3e-2)
    master = bf16.master_weights()["2.weight"].cpu()
    torch.testing.assert_close(master, fp32.module[2].weight.detach().cpu(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp16_loss_scale_follows_deepspeed_step_by_step(case, backend):
    cfg = config(backend=backend, fp16={"enabled": True, **CASES[case]},
                 scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 100, "warmup_type": "linear"}})
    engine, optimizer, _, _ = spmdzero.initialize(model=model(), config=cfg)
    scales, snapshots = [], []

    def observe(i):
        scales.append(optimizer.loss_scale)
        snapshots.append([p.detach().cpu().clone() for p in engine.module.parameters()])

    run(engine, data(len(PATTERN)), PATTERN, observe)
    observe(len(PATTERN))
    assert scales == RECORDED["cases"][case]
    for i, overflow in enumerate(PATTERN):
        same = all(torch.equal(a, b) for a, b in zip(snapshots[i], snapshots[i + 1]))
        assert same == bool(overflow), i  # bit-identical across overflow steps, changed otherwise
    applied = len(PATTERN) - sum(PATTERN)
    assert engine.skipped_steps == sum(PATTERN) and engine.global_steps == len(PATTERN)
    # the schedule advanced only on applied steps: linear warmup lr = 1e-3 + 9e-3 * t / 100
    assert engine.get_lr()[0] == pytest.approx(1e-3 + 9e-3 * (applied - 1) / 100, rel=1e-5)
    if backend == "torchax":  # the schedule counted on the devices: the update traced once
        assert engine.traces["update"] == 1
    assert engine.was_step_applied() == (not PATTERN[-1])


def test_overflow_steps_neither_recompile_nor_read_the_device():
    cfg = config(fp16={"enabled": True, "initial_scale_power": 6, "loss_scale_window": 3},
                 scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                                           "cycle_first_step_size": 5}})
    engine, *_ = spmdzero.initialize(model=model(), config=cfg)
    batches = data(len(PATTERN))
    run(engine, batches[:2], PATTERN[:2])  # step 1, then step 2 with the schedule's lr on the device
    compiles = met.metric_data("CompileTime")[0]
    transfers = (met.metric_data("TransferFromDeviceTime") or [0])[0]
    run(engine, batches[2:], PATTERN[2:])
    assert met.metric_data("CompileTime")[0] == compiles
    assert (met.metric_data("TransferFromDeviceTime") or [0])[0] == transfers
    assert engine.skipped_steps == sum(PATTERN)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_overflow_checked_steps_compile_once(precision):
    """Every step but the first reads the skipped-step count and the schedule's step count and
    lr from the device; put there at initialize, they give the first step the same graph."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 64))  # a shape of its own
    cfg = config(**{precision: {"enabled": True}}, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}})
    engine, *_ = spmdzero.initialize(model=net, config=cfg)
    batches = data(3)
    run(engine, batches[:1])
    compiles = met.metric_data("CompileTime")[0]
    run(engine, batches[1:])
    assert met.metric_data("CompileTime")[0] == compiles
    assert engine.get_lr()[0] == pytest.approx(1e-2 * math.log(3) / math.log(10), rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_grad_norm_is_unscaled_and_pre_clip(backend):
    x, y = data(1)[0]
    norms = []
    for extra in ({}, {"fp16": {"enabled": True, "initial_scale_power": 10}}):
        engine, *_ = spmdzero.initialize(model=model(), config=config(backend=backend, **extra))
        run(engine, [(x, y)])
        norms.append(engine.get_global_grad_norm())
    assert norms[1] == pytest.approx(norms[0], rel=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_loss_scale_skips_overflow_without_changing_the_scale(backend):
    engine, optimizer, _, _ = spmdzero.initialize(model=model(), config=config(backend=backend, fp16={
        "enabled": True, "loss_scale": 128}))
    run(engine, data(3), [0, 1, 0])
    assert optimizer.loss_scale == 128.0 and engine.skipped_steps == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_floating_inputs_take_the_model_dtype_but_named_targets_keep_theirs(precision, backend):
    """``engine(x, target=y)``: x is cast to the model dtype (DeepSpeed's fp16.auto_cast); a
    regression target of 80000 is not (in fp16 it would be inf, and every step skipped)."""
    seen = {}

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, target):
            seen["x"], seen["target"] = x.dtype, target.dtype
            return torch.nn.functional.mse_loss(self.lin(x).float().squeeze(-1) * 1e4, target)

    engine, *_ = spmdzero.initialize(model=Regression(), config={
        "train_batch_size": 8, precision: {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "spmd": {"backend": backend}})
    loss = engine(torch.randn(8, 4), target=torch.full((8,), 80000.0))
    engine.backward(loss)
    engine.step()
    assert seen == {"x": getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision]), "target": torch.float32}
    assert math.isfinite(loss.item())  # an fp16 target of 80000 is inf


def _bf16(t):
    return t.to(torch.bfloat16).float()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_weights_update_the_bf16_parameters_with_fp32_math(stage):
    """DeepSpeed 0.19's ``bf16_master_weights_and_grads`` with ``bf16_optimizer_states``
    (DeepSpeedExamples' bf16_master_weight/configs/bf16_full.json): no fp32 masters, the states
    in bf16, and the update's math in fp32 on the bf16 values, rounded back at every step, as
    DeepSpeed's Adam kernels load and store them. The loss ``(x @ w.T).sum()`` with small
    integer inputs has gradients exact in bf16, so the reference is torch's AdamW in fp32 with
    the parameters and moments rounded to bf16 after each step."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 16, bias=False)
    xs = [torch.randint(-3, 4, (8, 64)).float() for _ in range(10)]
    hyper = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    weight = _bf16(layer.weight.detach())
    ref = torch.nn.Parameter(weight.clone())
    opt = torch.optim.AdamW([ref], **hyper)
    for x in xs:
        ref.grad = x.sum(0).expand(16, 64).clone()  # d/dw of (x @ w.T).sum(): exact in bf16
        opt.step()
        with torch.no_grad():
            ref.copy_(_bf16(ref))
            for state in opt.state[ref].values():
                if state.dim():
                    state.copy_(_bf16(state))
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {**hyper, "betas": list(hyper["betas"])}},
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
           "spmd": {"backend": "torchax"}}
    engine, *_ = spmdzero.initialize(model=layer, config=cfg)
    for x in xs:
        engine.backward(engine(x.bfloat16()).float().sum())
        engine.step()
    trained = engine.module.weight.detach().cpu()
    assert trained.dtype == torch.bfloat16
    # equal (measured: all 1,024); the same math in bf16 left 34% equal, some 79% apart. An fp32
    # rounding may still land a value on the other side of a bf16 halfway point: one bf16 step
    torch.testing.assert_close(trained.float(), ref.detach(), rtol=2 ** -7, atol=1e-6)
    assert (trained.float() == ref.detach()).float().mean() >= 0.99
    held = model_state_bytes(engine)
    assert held.master_weights == 0
    states = [e for e in sharding_report(engine).entries
              if e.role in ("exp_avg", "exp_avg_sq")]
    assert states and all(e.dtype.endswith("bfloat16") for e in states), states


@pytest.mark.parametrize("extra, stage, message", [
    ({"bf16_optimizer_states": True}, 2, "bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads"),
    ({"bf16_master_weights_and_grads": True}, 0, "bf16.bf16_master_weights_and_grads needs ZeRO stage 1, 2 or 3"),
])
def test_bf16_master_weight_settings_are_refused_where_deepspeed_refuses_them(extra, stage, message):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "bf16": {"enabled": True, **extra}}
    with pytest.raises(spmdzero.ConfigError, match=message):
        spmdzero.initialize(model=model(), config=cfg)


def test_bf16_master_weights_on_the_torch_xla_backend_are_refused_naming_the_key():
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "spmd": {"backend": "torch_xla"},
           "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
    with pytest.raises(spmdzero.ConfigError, match="bf16.bf16_master_weights_and_grads is implemented on the torchax"):
        spmdzero.initialize(model=model(), config=cfg)


class RotaryLike(torch.nn.Module):
    """Two linears with a region the model keeps in fp32 (``torch.autocast(enabled=False)``, as
    transformers' rotary embeddings do), recording each result's dtype while it runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)
        self.seen = []

    def forward(self, x, y):
        h = self.a(x)
        h = torch.cat((h[:1], h[1:]))  # autocast's "promote" ops take lists (ViT's embeddings)
        with torch.autocast(device_type=h.device.type, enabled=False):
            kept = self.b(torch.tanh(h.float()))
        out = self.b(torch.tanh(h))
        # a classifier's loss in the module (transformers' heads): fp32 under autocast, from bf16 logits
        classes = torch.nn.functional.cross_entropy(out, y.argmax(-1))
        self.seen[:] = [h.dtype, kept.dtype, classes.dtype]
        return torch.nn.functional.mse_loss(out.float() + 0.1 * kept, y) + 0.1 * classes


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_autocast_computes_in_bf16_with_fp32_parameters_as_deepspeed(backend):
    """DeepSpeed's ``torch_autocast`` section (DeepSpeedExamples' ``bf16_full.json``) was refused.
    The forward now runs under autocast: the linears compute in bf16 (a region the model turns
    autocast off in stays fp32), the parameters and the optimizer stay fp32. The losses are plain
    torch's under CPU autocast to bf16 rounding (the two round the matmuls' outputs at other
    places), and not fp32's."""
    batches = data(3)
    cfg = {**config(backend=backend), "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    engine, *_ = spmdzero.initialize(model=RotaryLike(), config=cfg)
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.module.seen == [torch.bfloat16, torch.float32, torch.float32]  # (torchax: its trace's)
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}

    def plain(autocast: bool):
        module = RotaryLike()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)
        out = []
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = module(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out, module.seen

    autocast, seen = plain(True)
    assert seen == [torch.bfloat16, torch.float32, torch.float32]
    fp32, _ = plain(False)
    assert losses == pytest.approx(autocast, rel=1e-2)
    assert max(abs(a - b) for a, b in zip(losses, fp32)) > 1e-5  # fp32 engines agree with fp32 to ~1e-6


@pytest.mark.parametrize("section", [True, False], ids=["torch_autocast", "no-section"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scripts_cuda_autocast_region_is_the_accelerators(backend, section):
    """``with torch.autocast("cuda", dtype=torch.bfloat16):`` around the engine's forward and the
    loss (DeepSpeedExamples' ``bf16_master_weight/train.py``) raised on a host without a GPU
    ("Current CUDA Device does not support bfloat16"). It is the accelerator's autocast now: the
    loss computed in it from bf16 logits is fp32, as torch's cross-entropy under autocast. The
    forward follows the config's ``torch_autocast`` section whatever the region, as DeepSpeed's
    engine does: bf16 logits with it, fp32 without."""
    cfg = {**config(backend=backend), "gradient_clipping": 0.0}
    if section:
        cfg["torch_autocast"] = {"enabled": True}
    engine, *_ = spmdzero.initialize(model=model(), config=cfg)
    x, y = torch.randn(16, 64), torch.randint(0, 64, (16,))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = engine(x)
        loss = torch.nn.functional.cross_entropy(logits, y.to(logits.device))
    engine.backward(loss)
    engine.step()
    assert logits.dtype == (torch.bfloat16 if section else torch.float32)
    if backend == "torchax" or not section:  # torch_xla's autocast list for XLA keeps nll_loss in bf16
        assert loss.dtype == torch.float32
    assert math.isfinite(loss.item())


class _Bf16Gate(torch.nn.Module):
    """An fp32 model with one bf16 parameter and buffer, as Apertus' xIELU activation keeps its
    ``alpha_p`` and ``beta`` (transformers 4.57)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.alpha = torch.nn.Parameter(torch.tensor(0.8, dtype=torch.bfloat16).unsqueeze(0))
        self.register_buffer("beta", torch.tensor(0.5, dtype=torch.bfloat16))

    def forward(self, x):
        return (self.fc(x) * torch.nn.functional.softplus(self.alpha) * self.beta).square().mean()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_parameter_keeps_its_own_dtype_and_the_step_compiles_once(stage):
    """The update gave the bf16 parameter its fp32 gradient's dtype: the forward computed in fp32
    from the second step, and retraced there."""
    engine, *_ = spmdzero.initialize(model=_Bf16Gate(), config={
        "train_batch_size": 8, "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for step in range(3):
        loss = engine(torch.randn(8, 8, generator=torch.Generator().manual_seed(step)))
        engine.backward(loss)
        engine.step()
    assert dict(engine.traces) == {"train_forward": 1, "update": 1}
    assert str(engine.state.params["alpha"].dtype) == "bfloat16"  # on the devices, as the module holds it
