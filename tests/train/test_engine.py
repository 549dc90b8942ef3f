"""The engine on 8 CPU devices against a plain single-device PyTorch loop, on both backends
where a test does not read one backend's tensors (torch_xla's sharding specs and metrics)."""

import contextlib
import copy

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs

import spmdzero
from spmdzero.observe.reports import model_state_bytes, sharding_spec
from spmdzero.optim.schedules import WarmupLR

from conftest import batches, run_python, tiny_mlp

GAS, MICRO_PER_DEVICE, N = 2, 2, 8
CLIP = 0.3
BACKENDS = ["torch_xla", "torchax"]


def config(stage, backend="torch_xla", **extra):
    spmd = {**extra.pop("spmd", {}), "backend": backend}
    return {"train_micro_batch_size_per_gpu": MICRO_PER_DEVICE, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}, "spmd": spmd, **extra}


def on(backend: str, cfg: dict) -> dict:
    return {**cfg, "spmd": {**cfg.get("spmd", {}), "backend": backend}}


def torch_xla_only(backend: str) -> None:
    if backend != "torch_xla":
        pytest.skip("reads torch_xla's tensors")


def reference_run(model, data):
    """Single-device PyTorch: the same model, batches, accumulation, clipping and schedule."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    sched = WarmupLR(opt, warmup_num_steps=3)
    losses = []
    for i, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        (loss / GAS).backward()
        if (i + 1) % GAS == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            sched.step()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def engine_run(engine, data):
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(engine(x), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss)
    return [l.item() for l in losses], {n: p.detach().cpu() for n, p in engine.module.named_parameters()}


@pytest.fixture(scope="module", params=[(stage, backend) for backend in BACKENDS for stage in (0, 1, 2, 3)],
                ids=lambda p: f"{p[1]}-stage{p[0]}")
def trained(request):
    """One short run per stage and backend, shared by the tests below (compile once, reuse)."""
    stage, backend = request.param
    model = tiny_mlp()
    data = batches(12, MICRO_PER_DEVICE * N)
    ref = reference_run(model, data)
    engine, _, _, _ = spmdzero.initialize(model=copy.deepcopy(model), config=config(stage, backend))
    inputs = []
    if backend == "torch_xla":
        engine.module.register_forward_pre_hook(lambda m, args: inputs.append(sharding_spec(args[0])))
    out = engine_run(engine, data)
    return stage, engine, ref, out, inputs


def test_stage_trains_like_single_device_pytorch(trained):
    stage, engine, (ref_losses, ref_params), (losses, params), _ = trained
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-5, msg=f"stage {stage}: {name}")
    assert engine.global_steps == 6 and engine.micro_steps == 12
    assert engine.global_samples == 6 * engine.train_batch_size()


def test_clipping_was_active(trained):
    _, engine, *_ = trained
    assert engine.get_global_grad_norm() > CLIP


def test_partition_specs_follow_the_stage(trained):
    stage, engine, _, _, inputs = trained
    torch_xla_only(engine.validated_config.spmd.backend)
    sharded = "{devices=[8,1]0,1,2,3,4,5,6,7}"
    w = engine.module[0].weight  # 64x16: the largest dim is 0
    # replicated below stage 3; at stage 3 laid out as the optimizer states (the compiler gathers them)
    assert all((sharding_spec(p) != "{replicated}") == (stage == 3) for p in engine.module.parameters())
    states = engine.optimizer.state[w]
    for key in ("exp_avg", "exp_avg_sq"):
        assert sharding_spec(states[key]) == (sharded if stage >= 1 else "{replicated}")
    assert inputs and all(spec == sharded for spec in inputs)


def test_gradients_live_only_between_boundaries_laid_out_by_the_plan(trained):
    """After a boundary no gradient is held; a micro-step's accumulated gradient is a
    device tensor with the plan's layout (the ZeRO-2 shard)."""
    stage, engine, *_ = trained
    torch_xla_only(engine.validated_config.spmd.backend)
    assert engine.grad_buffers() == {}
    x, y = batches(1, MICRO_PER_DEVICE * N, seed=7)[0]
    engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
    torch_xla.sync()  # the accumulated gradient is now the executed micro-step's output
    grad = engine.grad_buffers()["0.weight"]
    assert sharding_spec(grad) == ("{devices=[8,1]0,1,2,3,4,5,6,7}" if stage >= 2 else "{replicated}")
    engine.zero_grad()  # as DeepSpeed's: ZeRO-2 and 3 keep a window's gradients in their partitions
    assert (engine.grad_buffers() == {}) == (stage < 2)


class RightMatmul(torch.nn.Module):
    """``x @ W`` with W stored [in, out] (transformers' Conv1D): its gradient is a plain matmul."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_in, d_out) / d_in ** 0.5)

    def forward(self, x):
        return x @ self.weight


@pytest.mark.parametrize("gas", [1, 2])
def test_the_global_norm_reads_each_gradient_in_memory_order(gas, monkeypatch):
    """A Linear weight's gradient is the transpose of a matmul and laid out transposed: the
    norm sums it that way round (XLA:CPU would copy it into row-major order first). A
    ``x @ W`` weight, a bias and a sum of micro-steps' gradients are row-major. The norm,
    and so the clipped update, is the one summed row-major."""
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), RightMatmul(64, 8))
        engine, *_ = spmdzero.initialize(model=model, config={**config(2), "gradient_accumulation_steps": gas,
                                                                     "scheduler": None})
        norms = []
        for i, (x, y) in enumerate(batches(2 * gas, MICRO_PER_DEVICE * N)):
            engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
            engine.step()
            if (i + 1) % gas == 0:
                norms.append(engine.get_global_grad_norm())
        return engine, norms, {n: p.detach().cpu() for n, p in engine.module.named_parameters()}

    engine, norms, params = run()
    kind = "one" if gas == 1 else "sum"
    assert engine._grad_orders == {("0.weight", kind): (1, 0) if gas == 1 else None, ("0.bias", kind): None,
                                   ("2.weight", kind): None}
    assert min(norms) > CLIP  # clipped: the norm reaches the parameters
    monkeypatch.setattr(spmdzero.backends.torch_xla.fused, "memory_order", lambda t: None)
    _, row_major_norms, row_major_params = run()
    np.testing.assert_allclose(norms, row_major_norms, rtol=1e-6)
    for name, value in row_major_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_model_state_bytes_match_zero_accounting():
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))  # noqa: E731
    P = sum(p.numel() for p in make().parameters())
    expected = {0: 16 * P, 1: 8 * P + 8 * P / N, 2: 4 * P + 12 * P / N, 3: 16 * P / N}
    for stage, want in expected.items():
        engine, *_ = spmdzero.initialize(model=make(), config=config(stage))
        got = model_state_bytes(engine)
        assert abs(got.params - (4 * P / N if stage == 3 else 4 * P)) < 0.03 * 4 * P / N
        assert abs(got.total - want) / want < 0.03, (stage, got, want)


def test_no_recompiles_or_device_reads_after_warmup():
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config(2))
    data = batches(20, MICRO_PER_DEVICE * N)

    def micro_step(i, x, y):
        if i == 15:
            engine.optimizer.param_groups[0]["lr"] = 0.0  # an lr of exactly 0 must not change the graph
        loss = torch.nn.functional.mse_loss(engine(x), y.to(engine.device))
        engine.backward(loss)
        engine.step()

    layouts = {k: sharding_spec(t) for k, (t, _) in engine.state_tensors().items()}
    for i, (x, y) in enumerate(data[:4]):
        micro_step(i, x, y)
    compiles = met.metric_data("CompileTime")[0]
    transfers = (met.metric_data("TransferFromDeviceTime") or [0])[0]
    donated = met.counter_value("XlaSetBufferDonation") or 0
    for i, (x, y) in enumerate(data[4:], start=4):
        micro_step(i, x, y)
    assert met.metric_data("CompileTime")[0] == compiles
    assert (met.metric_data("TransferFromDeviceTime") or [0])[0] == transfers
    assert engine.global_steps == 10
    # The update lays out its own results (nothing re-annotated after it): every state tensor
    # keeps the layout initialize gave it; and each boundary hands the old buffers of the 4
    # params and their 8 moments to the step's execution, as an in-place update would.
    assert {k: sharding_spec(t) for k, (t, _) in engine.state_tensors().items()} == layouts
    assert (met.counter_value("XlaSetBufferDonation") or 0) - donated == 12 * 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_d_mesh_shards_states_on_fsdp_and_batch_on_both(backend):
    model = tiny_mlp()
    data = batches(4, MICRO_PER_DEVICE * N)
    engine, *_ = spmdzero.initialize(model=copy.deepcopy(model),
                                     config=config(2, backend, spmd={"mesh": {"data": 2, "fsdp": -1}}))
    assert dict(engine.plan.mesh_shape) == {"data": 2, "fsdp": 4}
    assert engine.dp_world_size == 8 and engine.train_batch_size() == 32
    inputs = []
    if backend == "torch_xla":
        engine.module.register_forward_pre_hook(lambda m, args: inputs.append(sharding_spec(args[0])))
    losses, params = engine_run(engine, data)
    if backend == "torch_xla":
        assert inputs[0].startswith("{devices=[8,1]")
        state = engine.optimizer.state[engine.module[0].weight]["exp_avg"]
        assert sharding_spec(state).startswith("{devices=[4,1,2]") and "last_tile_dim_replicate" in sharding_spec(state)
    ref_losses, ref_params = reference_run(model, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(params["0.weight"], ref_params["0.weight"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_data_only_mesh_trains_as_plain_torch(backend):
    """``fsdp: 1``: every device holds whole states (nothing to shard over), the batch split 8
    ways. It stopped at initialize once (the fsdp_inner check, tests/sharding/test_mesh.py)."""
    model = tiny_mlp()
    data = batches(4, MICRO_PER_DEVICE * N)
    engine, *_ = spmdzero.initialize(model=copy.deepcopy(model),
                                     config=config(2, backend, spmd={"mesh": {"data": -1, "fsdp": 1}}))
    assert dict(engine.plan.mesh_shape) == {"data": 8, "fsdp": 1} and engine.dp_world_size == 8
    losses, params = engine_run(engine, data)
    ref_losses, ref_params = reference_run(model, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(params["0.weight"], ref_params["0.weight"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stage,bf16", [(1, False), (2, False), (2, True)])
def test_two_fsdp_axes_train_exactly_like_one(stage, bf16, backend):
    """The 16-chip layout (``fsdp x fsdp_inner``, two gradient stages) forced onto 8 devices:
    the same losses and parameters as the one-axis mesh, states tiled over both axes. Under
    bf16 the parameters are the fp32 masters' casts, gathered one fsdp axis at a time."""
    model, data = tiny_mlp(), batches(4, MICRO_PER_DEVICE * N)
    runs = {}
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    for inner in (1, 2):
        engine, *_ = spmdzero.initialize(model=copy.deepcopy(model),
                                         config=config(stage, backend, spmd={"mesh": {"fsdp_inner": inner}}, **extra))
        runs[inner] = engine_run(engine, data)
    assert dict(engine.plan.mesh_shape) == {"data": 1, "fsdp": 4, "fsdp_inner": 2}
    assert engine.dp_world_size == 8 and engine.plan["0.weight"].optimizer_state == ("fsdp", "fsdp_inner")
    if backend == "torch_xla" and not bf16:  # under bf16 the states are the masters'
        state = engine.optimizer.state[engine.module[0].weight]["exp_avg"]
        assert sharding_spec(state).startswith("{devices=[4,2]")
        assert sharding_spec(engine.optimizer.state[engine.module[0].bias]["exp_avg"]).startswith("{devices=[8]")
    np.testing.assert_allclose(runs[2][0], runs[1][0], rtol=1e-6, atol=1e-6)
    for name, p in runs[1][1].items():
        torch.testing.assert_close(runs[2][1][name], p, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", [(None, None), ("fsdp", None), (None, "fsdp_inner"), ("fsdp", "fsdp_inner"),
                                  (("fsdp", "fsdp_inner"), None), ("fsdp_inner", "data"), (("data", "fsdp"), "fsdp_inner")])
def test_sharding_text_is_what_torch_xla_reads_back(spec):
    """The HLO sharding text that the fused update lays out its inner values with is the layout
    ``mark_sharding`` gives a tensor, on a mesh whose device ids are not in order."""
    from jax._src.lib import xla_client

    from spmdzero.backends.torch_xla.annotate import shard, sharding_text

    mesh = xs.Mesh(np.array([3, 1, 0, 2, 7, 5, 4, 6]), (2, 2, 2), ("data", "fsdp", "fsdp_inner"))
    t = torch.zeros(4, 6, device=torch_xla.device())
    shard(t, mesh, spec)
    ours, theirs = (xla_client.HloSharding.from_string(text) for text in (sharding_text(mesh, spec), sharding_spec(t)))
    assert ours == theirs, (str(ours), str(theirs))
    assert ours.tile_assignment_devices() == theirs.tile_assignment_devices()


def test_user_mesh_and_client_optimizer():
    mesh = xs.Mesh(np.arange(N), (4, 2), ("data", "fsdp"))
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    cfg = {k: v for k, v in config(1).items() if k != "optimizer"}
    engine, returned_opt, _, _ = spmdzero.initialize(model=model, optimizer=opt, mesh=mesh, config=cfg)
    assert returned_opt.optimizer is opt and engine.dp_world_size == 8  # DeepSpeed returns its ZeRO wrapper
    w = model[0].weight
    assert not opt.state[w]  # torch creates its state at the first step, as in DeepSpeed
    ref_losses, _ = reference_run(tiny_mlp(), batches(4, 16))
    losses, _ = engine_run(engine, batches(4, 16))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert sharding_spec(opt.state[w]["exp_avg"]).startswith("{devices=[2,1,4]")  # laid out by the plan


@pytest.mark.parametrize("backend", BACKENDS)
def test_client_optimizer_callable_and_scheduler_callable(backend):
    engine, opt, _, sched = spmdzero.initialize(
        model=tiny_mlp(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        config=on(backend, {"train_batch_size": 16}))
    assert isinstance(opt.optimizer, torch.optim.SGD) and isinstance(sched, torch.optim.lr_scheduler.StepLR)
    assert engine.get_mom() == [0.9]
    x, y = batches(1, 16)[0]
    engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
    engine.step()
    assert engine.get_lr() == [0.05]


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_counters_and_boundary_follow_deepspeed(backend):
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config(2, backend))
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
    assert engine.get_lr() == [0.0]  # WarmupLR writes its t = -1 lr: the first step uses it
    assert engine.get_mom() == [(0.9, 0.999)]
    assert engine.gradient_accumulation_steps() == GAS and engine.train_micro_batch_size_per_gpu() == 2
    x, y = batches(1, 16)[0]
    loss = torch.nn.functional.mse_loss(engine(x), y.to(engine.device))
    scaled = engine.backward(loss)
    torch.testing.assert_close(scaled.cpu(), loss.cpu() / GAS)
    assert not engine.is_gradient_accumulation_boundary()
    engine.step()
    assert (engine.micro_steps, engine.global_steps) == (1, 0)
    assert engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
    engine.step()
    assert (engine.micro_steps, engine.global_steps) == (2, 0)
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
    engine.step()
    assert (engine.micro_steps, engine.global_steps) == (3, 1) and engine.was_step_applied()
    assert engine.get_lr() == [pytest.approx(0.0)]  # t = 0 of a log warmup is still 0
    with pytest.raises(AssertionError, match="ZeRO stage 2"):
        with engine.no_sync():
            pass


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_data_gives_sharded_batches_in_deepspeed_rank_order(backend):
    from torch.utils.data import DistributedSampler, TensorDataset

    xs_, ys_ = torch.arange(64.0).reshape(32, 2).repeat(1, 8), torch.zeros(32, 8)
    dataset = TensorDataset(xs_, ys_)
    engine, _, loader, _ = spmdzero.initialize(model=tiny_mlp(), training_data=dataset, config=config(2, backend))
    assert len(loader) == 2  # 32 samples / (2 per device x 8 devices)
    first_x, _ = next(iter(loader))
    assert first_x.shape == (16, 16)
    if backend == "torch_xla":  # the torchax engine places host batches at its forward
        assert sharding_spec(first_x) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    expected = torch.cat([xs_[list(DistributedSampler(dataset, num_replicas=8, rank=r))[:2]] for r in range(8)])
    torch.testing.assert_close(first_x.cpu(), expected)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(config={"train_batch_size": 16}), ValueError, "model is required"),
    (dict(model="not a module", config={"train_batch_size": 16}), TypeError, "torch.nn.Module"),
    (dict(model=tiny_mlp()), ValueError, "no DeepSpeed config"),
    (dict(model=tiny_mlp(), config={"train_batch_size": 16}, config_params={"train_batch_size": 16}),
     ValueError, "not both"),
    (dict(model=tiny_mlp(), config={"train_batch_size": 16},
          mesh=xs.Mesh(np.arange(8), (8,), ("data",))), ValueError, "no 'fsdp' axis"),
    (dict(model=tiny_mlp(), config={"train_batch_size": 16}, mesh="fsdp"), TypeError, "Mesh"),
    (dict(model=tiny_mlp(), config={"train_batch_size": 16, "spmd": {"mesh": {"data": 3}}}),
     ValueError, "does not cover the 8 devices"),
])
def test_bad_input_is_a_clear_error(kwargs, error, match):
    with pytest.raises(error, match=match):
        spmdzero.initialize(**kwargs)


def test_only_tensors_with_the_batch_dim_are_split():
    from spmdzero.backends.torch_xla.batches import to_device_sharded

    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config(2))
    x, mask = to_device_sharded((torch.randn(16, 4), torch.ones(4, 4)), engine.mesh, engine.plan.batch_spec, 8)
    assert sharding_spec(x) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert sharding_spec(mask) in ("", "{replicated}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_param_groups_left_empty_by_frozen_parameters_are_dropped(backend):
    """DeepSpeed drops them: ``get_lr()`` has one entry per group that trains."""
    model = tiny_mlp()
    model[0].requires_grad_(False)
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.2}]
    opt = torch.optim.AdamW(groups)
    engine, *_ = spmdzero.initialize(model=model, optimizer=opt, config=on(backend, {
        "train_batch_size": 16, "zero_optimization": {"stage": 2}}))
    assert engine.get_lr() == [0.2] and len(engine.optimizer.param_groups) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_refresh_fp32_params_gives_the_masters_the_modules_weights(backend):
    """After the module's weights are changed by hand, DeepSpeed's ``refresh_fp32_params`` makes
    the next step update them, not the old masters."""
    engine, optimizer, *_ = spmdzero.initialize(model=tiny_mlp(), config=on(backend, {
        "train_batch_size": 16, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}))
    with torch.no_grad():
        for p in engine.module.parameters():
            p.fill_(0.5)
    optimizer.refresh_fp32_params()
    if backend == "torch_xla":
        assert all(torch.all(m.cpu() == 0.5) for m in engine.master_weights().values())
    x, y = batches(1, 16)[0]
    engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y.to(engine.device)))
    engine.step()
    assert all((p.detach().float().cpu() - 0.5).abs().max() < 0.01 for p in engine.module.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forward_under_inference_mode_gives_outputs_the_script_can_slice_there(backend):
    """TRL scores with its reward engine under ``torch.inference_mode()`` and slices the logits
    there (``reward(**inputs).logits[:, 0]``). torch_xla refuses a view, under inference mode,
    of a tensor made outside it: the module's weights in the forward stopped it ("Cannot set
    version_counter for inference tensor"), and so would the outputs' slices."""
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=on(backend, {
        "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    x, _ = batches(1, 16)[0]
    with torch.no_grad():
        expected = engine(x).cpu()
    with torch.inference_mode():
        out = engine(x)
        assert torch.equal(out[:, 0].cpu(), expected[:, 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp16,expected", [({"enabled": True}, 0), ({"enabled": True, "loss_scale": 128}, 128)])
def test_loss_scale_is_deepspeeds_config_value_and_cur_scale_the_live_one(fp16, expected, backend):
    engine, optimizer, *_ = spmdzero.initialize(model=tiny_mlp(), config=on(backend, {
        "train_batch_size": 16, "fp16": fp16, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}))
    assert engine.loss_scale() == expected and engine.dynamic_loss_scale() is (expected == 0)
    assert optimizer.cur_scale == (2.0 ** 16 if expected == 0 else expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [16, 4])  # split over the 8 devices, and replicated (does not divide)
def test_an_input_that_requires_grad_gets_its_gradient_as_in_pytorch(rows, backend):
    """``x.requires_grad_()`` on a host input (input gradients: saliency, adversarial
    examples): after ``engine.backward`` the host tensor's ``.grad`` is torch's, as
    ``x.to(device)`` would give. The engine's sharded move to the devices used to be outside
    autograd, leaving ``x.grad`` None without a word."""
    model = tiny_mlp()
    x, y = batches(1, rows)[0]
    x_ref = x.clone().requires_grad_()
    torch.nn.functional.mse_loss(copy.deepcopy(model)(x_ref), y).backward()

    engine, *_ = spmdzero.initialize(model=model, config=on(backend, {
        "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    x.requires_grad_()
    with pytest.warns(UserWarning) if rows == 4 else contextlib.nullcontext():
        engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
    assert x.grad is not None and x.grad.device.type == "cpu"
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_the_torch_xla_engine_leaves_the_scripts_numpy_rng_alone():
    """A script that seeds NumPy and draws from it for its data (HelloDeepSpeed masks tokens
    with ``np.random``) draws the same numbers as under DeepSpeed. The torch_xla engine's first
    step imports JAX (the fused update's lowering), and that import drew about ten words from
    NumPy's global RNG: every later batch was masked otherwise. Fresh process: JAX unimported."""
    out = run_python("""
        import random
        import numpy as np, torch, spmdzero
        np.random.seed(0); torch.manual_seed(0); random.seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        engine, *_ = spmdzero.initialize(model=model, config={
            "train_batch_size": 8, "zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}})
        before = (np.random.get_state()[1].copy(), np.random.get_state()[2], torch.get_rng_state(), random.getstate())
        for _ in range(2):
            engine.backward(engine(torch.ones(8, 16)).pow(2).mean())
            engine.step()
        numpy_state = np.random.get_state()
        print("numpy", bool((numpy_state[1] == before[0]).all()) and numpy_state[2] == before[1],
              "torch", bool(torch.get_rng_state().equal(before[2])), "python", random.getstate() == before[3],
              "backend", type(engine).__module__)
    """, env={"SPMDZERO_BACKEND": "torch_xla"})
    assert "numpy True torch True python True backend spmdzero.backends.torch_xla" in out, out


@pytest.mark.parametrize("scale", [True, False], ids=["engine.scale", "loss.backward"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pytorch_style_backward_trains_as_plain_torch(backend, scale):
    """DeepSpeed 0.19's PyTorch-style backward (DeepSpeedExamples' bf16_master_weight/train.py):
    the script runs the backward itself, ``engine.scale(loss).backward()`` (or ``loss.backward()``),
    then ``engine.step()``. DeepSpeed divides the outputs' gradients by the accumulation steps
    there (hooks on the forward's outputs), so the script does not, where a plain torch loop
    divides its loss. ``engine.scale`` was missing on both backends, and the torch_xla backend
    refused the step ("no engine.backward()"). SGD, not Adam: Adam's update does not see a
    gradient's scale, which hid a missing division."""
    model = tiny_mlp()
    data = batches(6, MICRO_PER_DEVICE * N)
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_losses = []
    for i, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(reference(x), y)
        ref_losses.append(loss.item())
        (loss / GAS).backward()
        if (i + 1) % GAS == 0:
            sgd.step()
            sgd.zero_grad()
    ref_params = dict(reference.named_parameters())
    cfg = {k: v for k, v in config(2, backend).items() if k not in ("optimizer", "scheduler")}
    trained = copy.deepcopy(model)
    engine, *_ = spmdzero.initialize(model=trained, optimizer=torch.optim.SGD(trained.parameters(), lr=0.5),
                                     config={**cfg, "gradient_clipping": 0.0})
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(engine(x), y.to(engine.device))
        (engine.scale(loss) if scale else loss).backward()
        engine.step()
        losses.append(loss)
    assert [l.item() for l in losses] == pytest.approx(ref_losses, rel=1e-5)
    for name, p in engine.module.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), ref_params[name].detach(), rtol=1e-5, atol=1e-5, msg=name)
    assert engine.global_steps == len(data) // GAS


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_torch_optimizer_resumed_before_initialize_keeps_its_states(backend):
    """DeepSpeedExamples' ImageNet example resumes the PyTorch way, before ``initialize``:
    ``model.load_state_dict(...)``, ``optimizer.load_state_dict(...)`` on its torch SGD, then
    ``deepspeed.initialize(model, optimizer)``. The training continues from those states, as
    DeepSpeed's engine keeps its optimizer's. The torchax backend ignored them and restarted the
    momentum from zero, silently (``optimizer_state_dict.take_given_state``)."""
    model = tiny_mlp()
    data = batches(4, MICRO_PER_DEVICE * N)
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        torch.nn.functional.mse_loss(reference(x), y).backward()
        sgd.step()
        sgd.zero_grad()

    for x, y in data[:2]:
        step(x, y)
    saved = copy.deepcopy({"model": reference.state_dict(), "optimizer": sgd.state_dict()})
    for x, y in data[2:]:
        step(x, y)
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(saved["model"])
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(saved["optimizer"])
    cfg = {k: v for k, v in config(0, backend).items() if k not in ("optimizer", "scheduler")}
    engine, *_ = spmdzero.initialize(model=resumed, optimizer=optimizer, config={**cfg, "gradient_accumulation_steps": 1,
                                                                                 "gradient_clipping": 0.0})
    for x, y in data[2:]:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
        engine.step()
    for (name, p), want in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_scale_multiplies_by_fp16s_loss_scale_and_names_what_it_takes(backend):
    """Under fp16 the update divides the gradients by the loss scale, so a script's own
    backward must start from ``engine.scale(loss)``; in bf16 and fp32 it is the loss itself."""
    cfg = config(1, backend, fp16={"enabled": True, "loss_scale": 128})
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=cfg)
    x, y = batches(1, MICRO_PER_DEVICE * N)[0]
    loss = torch.nn.functional.mse_loss(engine(x.half()).float(), y.to(engine.device))
    assert engine.scale(loss).item() == pytest.approx(128 * loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"shape \(16, 8\).*tensor.backward\(grad\)"):
        engine.scale(engine(x.half()))
    engine.backward(loss)
