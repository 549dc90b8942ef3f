"""Nothing silently wrong on the optimizer's side of the engine: a client torch.optim
optimizer's first step, ``engine.optimizer.step()`` called directly, ``engine.zero_grad()``
inside an accumulation window, and a checkpoint load between a backward and its step. Each
against plain PyTorch on one CPU device, or against what DeepSpeed 0.19.8 does (its source is
cited in each test); on both backends where the torchax backend has the call."""

import json
import os

import pytest
import torch
import torch_xla.debug.metrics as met

import spmdzero
from spmdzero.observe.reports import sharding_spec

from conftest import REPO, batches, run_python, tiny_mlp

ROWS = 16  # one micro-batch over the 8 devices
BACKENDS = ["torch_xla", "torchax"]


def mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def engine_for(stage, optimizer=None, backend="torch_xla", **extra):
    spmd = {"backend": backend, **extra.pop("spmd", {})}
    cfg = {"train_micro_batch_size_per_gpu": ROWS // 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "spmd": spmd, **extra}  # unclipped, as the plain torch loops here
    if optimizer is None:
        cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}})
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * 8 * cfg["gradient_accumulation_steps"]
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), optimizer=optimizer, config=cfg)
    return engine


def engine_params(engine):
    return {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}


def assert_params_close(got, want, atol=1e-6, rtol=1e-5, what=""):
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, atol=atol, rtol=rtol, msg=lambda m: f"{what} {name}: {m}")


def micro(engine, x, y):
    loss = mse(engine(x), y.to(engine.device))
    engine.backward(loss)
    return loss


# ---- 1. a client torch.optim optimizer's first step is torch's ----------------------------------

CLIENT_OPTIMIZERS = {
    "SGD(momentum, weight_decay)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "SGD(momentum, dampening)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3),
    "SGD(nesterov)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01),
    "Adam(amsgrad)": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "RMSprop(momentum, centered)": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True,
                                                                  weight_decay=0.01),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0, weight_decay=0.01),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01, weight_decay=0.01),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=0.01, weight_decay=0.01),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=0.01, weight_decay=0.01),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    # its step reads its count and two norms with .item(): the torchax backend runs a traced twin
    "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.01, t0=1),
}


class NormClippedSGD(torch.optim.SGD):
    """A step that reads a value on the host (``.item()``), as no torch.optim class does now."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.norm().item() > 1.0:
                    p.grad.div_(p.grad.norm())
        return super().step(closure)


def plain_torch(factory, data, steps):
    model = tiny_mlp()
    opt = factory(model.parameters())
    for x, y in data[:steps]:
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CLIENT_OPTIMIZERS))
def test_a_client_torch_optimizer_trains_like_torch(name, backend):
    """Three full-batch steps at ZeRO-2 land within 1e-6 of plain torch. The state used to be
    made up front by a step on zero gradients, keeping torch's first assignment to each key:
    SGD's momentum buffer then started as ``weight_decay * w`` instead of the first gradient."""
    factory = CLIENT_OPTIMIZERS[name]
    data = batches(3, ROWS)
    engine = engine_for(2, optimizer=factory, backend=backend)
    for x, y in data:
        micro(engine, x, y)
        engine.step()
    assert_params_close(engine_params(engine), plain_torch(factory, data, 3), what=name)


def test_a_client_optimizer_whose_step_reads_a_value_is_refused_on_torchax_naming_it():
    """The torchax backend compiles the client optimizer's step, which cannot stop to read a
    value: the first step says so, naming the class, and what runs instead."""
    engine = engine_for(2, optimizer=lambda ps: NormClippedSGD(ps, lr=0.1), backend="torchax")
    micro(engine, *batches(1, ROWS)[0])
    with pytest.raises(RuntimeError, match=r"runs NormClippedSGD.step\(\) inside the compiled update, and it cannot "
                                           r"be traced there: .*Give the optimizer in the config instead"):
        engine.step()


def test_a_client_optimizers_state_is_laid_out_by_the_plan_after_its_first_step_and_never_recompiles():
    """torch creates the state in the first step (a warm-up graph of its own); the engine lays
    it out by the plan right after, and the steps after warm-up compile nothing."""
    engine = engine_for(2, optimizer=CLIENT_OPTIMIZERS["SGD(momentum, weight_decay)"])
    w = engine.module[0].weight
    assert not engine.optimizer.state[w]  # torch's state before the first step: none
    data = batches(8, ROWS)
    for x, y in data[:4]:
        micro(engine, x, y)
        engine.step()
    assert sharding_spec(engine.optimizer.state[w]["momentum_buffer"]) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    compiles = met.metric_data("CompileTime")[0]
    for x, y in data[4:]:
        micro(engine, x, y)
        engine.step()
    assert met.metric_data("CompileTime")[0] == compiles
    assert_params_close(engine_params(engine), plain_torch(CLIENT_OPTIMIZERS["SGD(momentum, weight_decay)"], data, 8))


# ---- 2. engine.optimizer.step() called directly ----------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_optimizer_step_called_directly_applies_the_update_as_deepspeeds_zero_optimizer(stage, backend):
    """DeepSpeed's ZeRO optimizer.step() (stage_1_and_2.py, step) clips, steps and drops the
    reduced gradients; the engine's counters and LR schedule are the engine's and stay. At
    stage 0 in fp32 DeepSpeed's optimizer is torch's (engine.py, _configure_optimizer), which
    does not clip: the engine's _take_model_step clips before calling it."""
    clip = 0.05
    data = batches(2, ROWS)
    engine = engine_for(stage, backend=backend, gradient_clipping=clip)
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    for x, y in data:
        micro(engine, x, y)
        engine.optimizer.step()
        mse(model(x), y).backward()
        if stage > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    # atol 2e-5: Adam divides by sqrt(v), which magnifies fp32 rounding of the clipped gradient on
    # elements whose gradient is near zero (9e-6 on 2 of 1024 weights on some CPUs' XLA kernels)
    assert_params_close(engine_params(engine), {n: p.detach() for n, p in model.named_parameters()}, atol=2e-5)
    assert engine.get_global_grad_norm() > clip  # so the clipping, or its absence, shows
    assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (0, 0, 0)
    assert engine.grad_buffers() == {}
    with pytest.raises(RuntimeError, match="no engine.backward"):  # its gradients were used: DeepSpeed fails too
        engine.step()


@pytest.mark.parametrize("backend", BACKENDS)
def test_optimizer_step_inside_an_accumulation_window_is_refused(backend):
    """Mid-window DeepSpeed's ZeRO optimizer has no reduced gradients yet (averaged_gradients is
    built at the boundary's backward) and fails; here the error says why."""
    engine = engine_for(2, backend=backend, gradient_accumulation_steps=2)
    x, y = batches(1, ROWS)[0]
    micro(engine, x, y)
    with pytest.raises(RuntimeError, match="accumulation boundary"):
        engine.optimizer.step()
    with pytest.raises(RuntimeError, match="no engine.backward"):
        engine_for(2, backend=backend).optimizer.step()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_inside", [True, False], ids=["loss_inside", "loss_outside"])
def test_requires_grad_changed_after_initialize_as_deepspeed(backend, loss_inside):
    """DeepSpeed builds its parameter groups at initialize: a parameter frozen later gets no
    gradient and its optimizer steps it with zeros (Adam's moments decay, weight decay
    applies); one unfrozen later is in no group and is never updated. The torchax backend
    refused the change (it fixed the trained set when it traced the update)."""
    data = batches(4, ROWS)
    model = tiny_mlp()
    model[2].weight.requires_grad_(False)  # frozen at initialize
    cfg = {"train_micro_batch_size_per_gpu": ROWS // 8, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}}, "spmd": {"backend": backend}}
    if loss_inside:
        class WithLoss(torch.nn.Module):
            def __init__(self, net):
                super().__init__()
                self.net = net

            def forward(self, x, y):
                return mse(self.net(x), y)
        engine, *_ = spmdzero.initialize(model=WithLoss(model), config=cfg)
        net = engine.module.net
    else:
        engine, *_ = spmdzero.initialize(model=model, config=cfg)
        net = engine.module
    reference = tiny_mlp()
    reference[2].weight.requires_grad_(False)
    trained = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=0.02, weight_decay=0.01)
    for i, (x, y) in enumerate(data):
        if i == 2:  # after two steps: freeze the first layer's weight, unfreeze the last one's
            for m in (net, reference):
                m[0].weight.requires_grad_(False)
                m[2].weight.requires_grad_(True)
        loss = engine(x, y.to(engine.device)) if loss_inside else mse(engine(x), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        mse(reference(x), y).backward()
        for p in trained:
            if p.grad is None:  # no gradient from torch's backward: DeepSpeed's optimizer steps zeros
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    got = {n.removeprefix("net."): p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    want = {n: p.detach() for n, p in reference.named_parameters()}
    assert not torch.equal(want["0.weight"], tiny_mlp()[0].weight.detach())
    assert torch.equal(got["2.weight"], tiny_mlp()[2].weight.detach())  # in no group: never updated
    assert_params_close(got, want, atol=2e-5)


# ---- 3. engine.zero_grad() inside an accumulation window ----------------------------------

def torch_window(data, used):
    """Plain torch: one AdamW step on the micro-batches ``used`` of a 2-step window."""
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    for i, (x, y) in enumerate(data):
        if i in used:
            (mse(model(x), y) / 2).backward()
    opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stage,kept", [(0, [1]), (1, [1]), (2, [0, 1]), (3, [0, 1])])
def test_zero_grad_between_micro_steps_follows_deepspeed_stage_by_stage(stage, kept, backend):
    """backward, step, zero_grad per micro-step, two micro-steps a window. DeepSpeed keeps a
    ZeRO-2 window's gradients in the optimizer's partitions (stage_1_and_2.py:
    independent_gradient_partition_epilogue accumulates all_grad_tensors), which
    engine.zero_grad() (engine.py: param.grad = None) does not touch; at stages 0 and 1 they
    are param.grad until the boundary's reduction, and zero_grad drops them."""
    data = batches(2, ROWS)
    engine = engine_for(stage, backend=backend, gradient_accumulation_steps=2)
    for x, y in data:
        micro(engine, x, y)
        engine.step()
        engine.zero_grad()
    assert engine.global_steps == 1
    assert_params_close(engine_params(engine), torch_window(data, kept), what=f"stage {stage}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stage,zero_grad", [(1, "engine"), (1, "optimizer"), (2, "engine")])
def test_zero_grad_after_the_boundarys_backward_keeps_the_reduced_gradients(stage, zero_grad, backend):
    """At ZeRO-1/2 the boundary's backward reduces the window into the optimizer's partitions
    (averaged_gradients), which neither zero_grad touches: the step applies the whole window."""
    data = batches(2, ROWS)
    engine = engine_for(stage, backend=backend, gradient_accumulation_steps=2)
    micro(engine, *data[0])
    engine.step()
    micro(engine, *data[1])
    (engine if zero_grad == "engine" else engine.optimizer).zero_grad()
    engine.step()
    assert_params_close(engine_params(engine), torch_window(data, [0, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["before the forward", "between forward and backward"])
def test_zero3s_optimizer_zero_grad_lets_the_next_backward_replace_the_window(where, backend):
    """DeepSpeed's stage-3 optimizer.zero_grad() resets micro_step_id (stage3.py), and a backward
    at micro-step 0 copies its gradient into the partitions: the window's earlier micro-batches
    are dropped by that backward, wherever the zero_grad came before it."""
    data = batches(2, ROWS)
    engine = engine_for(3, backend=backend, gradient_accumulation_steps=2)
    micro(engine, *data[0])
    engine.step()
    if where == "before the forward":
        engine.optimizer.zero_grad()
        micro(engine, *data[1])
    else:
        loss = mse(engine(data[1][0]), data[1][1].to(engine.device))
        engine.optimizer.zero_grad()
        engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1
    assert_params_close(engine_params(engine), torch_window(data, [1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero3s_optimizer_zero_grad_with_no_backward_after_it_drops_nothing(backend):
    """The replacement happens at the next backward: a step right after the zero_grad still
    applies the whole window, as DeepSpeed's partitions still hold it."""
    data = batches(2, ROWS)
    engine = engine_for(3, backend=backend, gradient_accumulation_steps=2)
    micro(engine, *data[0])
    engine.step()
    micro(engine, *data[1])
    engine.optimizer.zero_grad()
    engine.step()
    assert engine.global_steps == 1
    assert_params_close(engine_params(engine), torch_window(data, [0, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_grad_that_drops_everything_leaves_nothing_to_step(backend):
    """Stage 0 keeps gradients in param.grad until the step; after zero_grad there is nothing
    to apply, and the step says so instead of decaying the weights on zero gradients."""
    engine = engine_for(0, backend=backend)
    micro(engine, *batches(1, ROWS)[0])
    engine.zero_grad()
    with pytest.raises(RuntimeError, match="no engine.backward"):
        engine.step()


# ---- 4. a checkpoint load between backward and step ------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_load_between_backward_and_step_trains_like_a_clean_load(stage, backend, tmp_path):
    """forward, backward, load_checkpoint, forward, backward, step: the step applies only the
    gradient computed after the load, as after a clean load (the load starts a new window)."""
    data = batches(4, ROWS)
    saver = engine_for(stage, backend=backend)
    micro(saver, *data[0])
    saver.step()
    saver.save_checkpoint(str(tmp_path))

    clean = engine_for(stage, backend=backend)
    clean.load_checkpoint(str(tmp_path))
    micro(clean, *data[2])
    clean.step()

    engine = engine_for(stage, backend=backend)
    micro(engine, *data[1])  # a gradient of the weights the load replaces
    engine.load_checkpoint(str(tmp_path))
    micro(engine, *data[2])
    engine.step()
    assert_params_close(engine_params(engine), engine_params(clean), atol=0, rtol=0)


def test_a_step_right_after_a_load_has_no_gradients(tmp_path):
    engine = engine_for(2)
    engine.save_checkpoint(str(tmp_path))
    micro(engine, *batches(1, ROWS)[0])
    engine.load_checkpoint(str(tmp_path))
    assert engine.grad_buffers() == {}
    with pytest.raises(RuntimeError, match="no engine.backward"):
        engine.step()


# ---- what a lazily created state asks of the rest of the engine -----------------------------------

SGD_MOMENTUM = CLIENT_OPTIMIZERS["SGD(momentum, weight_decay)"]


def test_a_client_optimizer_resumes_from_a_checkpoint_as_it_continues(tmp_path):
    """A fresh engine has no optimizer state to load into until its first step: the load gives
    it torch's keys, then the checkpoint's values (Adam's host-side step count included)."""
    for name in ("SGD(momentum, weight_decay)", "Adam"):
        data = batches(4, ROWS)
        engine = engine_for(2, optimizer=CLIENT_OPTIMIZERS[name])
        for x, y in data[:2]:
            micro(engine, x, y)
            engine.step()
        engine.save_checkpoint(str(tmp_path / name))
        for x, y in data[2:]:
            micro(engine, x, y)
            engine.step()
        resumed = engine_for(2, optimizer=CLIENT_OPTIMIZERS[name])
        resumed.load_checkpoint(str(tmp_path / name))
        w = resumed.module[0].weight
        assert sharding_spec(next(v for v in resumed.optimizer.state[w].values() if v.dim() == 2)).startswith(
            "{devices=[8,1]")
        for x, y in data[2:]:
            micro(resumed, x, y)
            resumed.step()
        assert_params_close(engine_params(resumed), engine_params(engine), atol=0, rtol=0, what=name)
        assert_params_close(engine_params(resumed), plain_torch(CLIENT_OPTIMIZERS[name], data, 4), what=name)


@pytest.mark.parametrize("saved_with", ["config-optimizer", "torch-optimizer"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_resumes_the_same_update_given_the_other_optimizer_kind(backend, saved_with, tmp_path):
    """The config's AdamW counts its steps on the devices, torch's AdamW on the host. A run that
    moves to a script passing torch's AdamW (accelerate's) resumed with Adam's bias correction
    refused ("has no value for the optimizer state ... step"), and so did the other way (the HF
    Trainer's own optimizer, then an ``optimizer`` section: "checkpoint has no optimizer/precision
    state"). The step count is read from where the checkpoint holds it; the resumed run continues
    as the uninterrupted one."""
    adamw = {"lr": 0.02, "weight_decay": 0.01}
    torch_adamw = lambda ps: torch.optim.AdamW(ps, **adamw)  # noqa: E731
    first, then = (None, torch_adamw) if saved_with == "config-optimizer" else (torch_adamw, None)
    data = batches(4, ROWS)
    engine = engine_for(2, backend=backend, optimizer=first)  # None: the config's AdamW, with `adamw`
    for x, y in data[:2]:
        micro(engine, x, y)
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    for x, y in data[2:]:
        micro(engine, x, y)
        engine.step()
    resumed = engine_for(2, backend=backend, optimizer=then)
    resumed.load_checkpoint(str(tmp_path))
    for x, y in data[2:]:
        micro(resumed, x, y)
        resumed.step()
    assert_params_close(engine_params(resumed), engine_params(engine), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_saved_before_the_first_step_loads_no_optimizer_state(backend, tmp_path):
    """As torch's load_state_dict: no saved state, none after the load, and the next step is
    torch's first again (a fresh engine; one that had stepped drops its state)."""
    data = batches(2, ROWS)
    engine_for(2, optimizer=SGD_MOMENTUM, backend=backend).save_checkpoint(str(tmp_path))
    fresh = engine_for(2, optimizer=SGD_MOMENTUM, backend=backend)
    fresh.load_checkpoint(str(tmp_path))
    stepped = engine_for(2, optimizer=SGD_MOMENTUM, backend=backend)
    micro(stepped, *data[0])
    stepped.step()
    stepped.load_checkpoint(str(tmp_path))
    for engine in (fresh, stepped):
        assert not any(engine.optimizer.state.values())
        for x, y in data:
            micro(engine, x, y)
            engine.step()
        assert_params_close(engine_params(engine), plain_torch(SGD_MOMENTUM, data, 2))


def test_an_overflowed_first_step_leaves_no_state():
    """Under overflow checks (bf16 here) a skipped first step must not keep the state it
    created: the first applied step is then torch's first, as if the skipped one never ran."""
    data = batches(3, ROWS)
    runs = []
    for skipped_first in (True, False):
        engine = engine_for(2, optimizer=SGD_MOMENTUM, bf16={"enabled": True})
        if skipped_first:
            x, y = data[0]
            engine.backward(mse(engine(x).float(), y.to(engine.device)) * float("inf"))
            engine.step()
            assert not engine.was_step_applied() and not any(engine.optimizer.state.values())
        for x, y in data[1:]:
            engine.backward(mse(engine(x).float(), y.to(engine.device)))
            engine.step()
        runs.append(engine_params(engine))
    assert_params_close(runs[0], runs[1], atol=0, rtol=0)


def test_skipped_first_steps_are_warm_up_however_many():
    """Each skipped step that created state reads its overflow flag (a second graph) and leaves
    the state to the next: warm-up for the recompile guard, however long it lasts."""
    import warnings

    data = batches(8, ROWS)
    engine = engine_for(2, optimizer=SGD_MOMENTUM, bf16={"enabled": True}, spmd={"max_recompiles": 0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data):
            scale = float("inf") if i < 5 else 1.0
            engine.backward(mse(engine(x).float(), y.to(engine.device)) * scale)
            engine.step()
    assert engine.skipped_steps == 5 and engine.optimizer.state[engine.master_weights()["0.weight"]]
    assert not [str(w.message) for w in caught if "graphs instead of one" in str(w.message)
                or "recompiled" in str(w.message)]


def test_a_capture_before_the_first_step_leaves_no_state():
    """The TPU capture traces a step and puts the engine back: the state that step created too."""
    data = batches(2, ROWS)
    engine = engine_for(2, optimizer=SGD_MOMENTUM)
    engine.collectives_report(data[0][0], loss_fn=lambda out: mse(out, data[0][1].to(engine.device)))
    assert not any(engine.optimizer.state.values())
    for x, y in data:
        micro(engine, x, y)
        engine.step()
    assert_params_close(engine_params(engine), plain_torch(SGD_MOMENTUM, data, 2))


def test_a_capture_puts_back_adams_host_side_step_count():
    data = batches(3, ROWS)
    engine = engine_for(2, optimizer=CLIENT_OPTIMIZERS["Adam"])
    micro(engine, *data[0])
    engine.step()
    engine.collectives_report(data[1][0], loss_fn=lambda out: mse(out, data[1][1].to(engine.device)))
    assert float(engine.optimizer.state[engine.module[0].weight]["step"]) == 1
    for x, y in data[1:]:
        micro(engine, x, y)
        engine.step()
    assert_params_close(engine_params(engine), plain_torch(CLIENT_OPTIMIZERS["Adam"], data, 3))


def test_the_tpu_compile_of_a_torch_optimizer_traces_a_later_step():
    """``spmdzero aot`` compiles the step every step after the first runs: a torch optimizer's
    state is its input (donated), whether the engine is materialized or shape-only. (In a fresh
    process: a real engine's step after a shape-only engine crashes torch_xla.) On torch_xla's
    runtime (the torch_xla engine's capture); the torchax step's below."""
    out = run_python("""
        import json, torch
        from conftest import tiny_mlp
        from spmdzero.aot.models import ModelSource
        from spmdzero.aot.steps import capture_step
        source = ModelSource("mlp", tiny_mlp, lambda m, b: ((torch.randn(b, 16),), {}), lambda out: out.square().mean())
        config = {"train_batch_size": 16, "optimizer": {"type": "RMSprop", "params": {"lr": 0.01, "momentum": 0.9}}}
        for shape_only in (False, True):
            step = capture_step(source, config, stage=2, shape_only=shape_only)
            state = [k for k in step.inputs if k.startswith("optim.")] if step.inputs else [
                k for k in step.engine.state_tensors() if k.startswith("optim.")]
            print(json.dumps([shape_only, len(state), len(step.donate)]))
    """, env={"PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")]),
              "SPMDZERO_BACKEND": "torch_xla"})
    runs = [json.loads(line) for line in out.strip().splitlines()[-2:]]
    # square_avg and momentum_buffer of 4 tensors (the step count is on the host), donated with the parameters
    assert runs == [[False, 8, 4 + 8], [True, 8, 4 + 8]]


def test_the_torchax_tpu_compile_of_a_torch_optimizer_traces_a_later_step():
    """The torchax step (``spmdzero aot``'s default): the torch optimizer's states, which its
    first step creates, are inputs of the compiled step and donated, as every later step has
    them (the step count on the devices too); the loss is the source's, taken in the forward."""
    import re

    from conftest import tiny_mlp
    from spmdzero.aot.models import ModelSource
    from spmdzero.aot.steps import capture_step

    source = ModelSource("mlp", tiny_mlp, lambda m, b: ((torch.randn(b, 16),), {}), lambda out: out.square().mean())
    config = {"train_batch_size": 16, "optimizer": {"type": "RMSprop", "params": {"lr": 0.01, "momentum": 0.9}},
              "spmd": {"backend": "torchax"}}
    step = capture_step(source, config, stage=2, topology="v5e:2x4")
    states = step.engine.optimizer_states()
    assert sorted(states) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(sorted(s) == ["momentum_buffer", "square_avg", "step"] for s in states.values()), states
    # the 4 parameters and their 12 states, donated to their updated outputs (and the skip counter)
    donated = re.findall(r"tf.aliasing_output = \d+", step.mlir)
    assert len(donated) >= 4 + 12
