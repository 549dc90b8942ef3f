"""spmdzero's optimizers against torch.optim on CPU, step for step."""

import pytest
import torch

from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import OptimizerConfig
from spmdzero.optim.optimizers import (SGD, Adagrad, AdamW, Lamb, Lion, build_optimizer, drop_state, init_state,
                                      placeholder_state)


def run(opt_factory, steps=6, seed=0):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = opt_factory([p])
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        p.grad = torch.randn(5, 3, generator=g)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("ours,theirs", [
    (lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
    (lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1, adam_w_mode=False),
     lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1)),
    (lambda ps: SGD(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    (lambda ps: SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    (lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    (lambda ps: Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
     lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)),
])
def test_matches_torch_optim(ours, theirs):
    torch.testing.assert_close(run(ours), run(theirs), rtol=1e-5, atol=1e-6)


def test_state_exists_before_the_first_step():
    p = torch.nn.Parameter(torch.randn(4, 2))
    opt = AdamW([p])
    init_state(opt)
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_client_optimizers_state_is_left_to_its_first_step():
    """torch's first step is not a step from some initial state (SGD's momentum buffer is the
    first gradient), so none is made up for a torch.optim optimizer."""
    p = torch.nn.Parameter(torch.randn(4, 2))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    init_state(opt)
    assert not opt.state


def test_placeholder_state_has_the_first_steps_keys_changes_nothing_and_drops():
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(4, 2)), torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p, q], lr=0.1, weight_decay=0.5)
    q.grad = torch.ones(3)
    opt.step()
    q_state = {k: v.clone() for k, v in opt.state[q].items()}
    before, grad = p.detach().clone(), q.grad
    assert placeholder_state(opt) == [p]  # q has its state already: not stepped again
    assert torch.equal(p.detach(), before) and p.grad is None and q.grad is grad
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    assert all(torch.equal(opt.state[q][k], v) for k, v in q_state.items())
    drop_state(opt, [p])
    assert p not in opt.state and set(opt.state[q]) == set(q_state)


@pytest.mark.parametrize("type_name,cls", [("Adam", AdamW), ("adamw", AdamW), ("AdaGrad", Adagrad), ("SGD", SGD),
                                           ("RMSprop", torch.optim.RMSprop)])
def test_build_optimizer_by_deepspeed_name(type_name, cls):
    opt = build_optimizer(OptimizerConfig(type=type_name, params={"lr": 0.1}), [torch.nn.Parameter(torch.ones(2))])
    assert type(opt) is cls


def test_adam_means_adamw_unless_adam_w_mode_false():
    ps = [torch.nn.Parameter(torch.ones(2))]
    assert build_optimizer(OptimizerConfig(type="Adam", params={}), ps).param_groups[0]["adam_w_mode"] is True
    opt = build_optimizer(OptimizerConfig(type="Adam", params={"adam_w_mode": False}), ps)
    assert opt.param_groups[0]["adam_w_mode"] is False
    assert type(build_optimizer(OptimizerConfig(type="Adam", params={"torch_adam": True}), ps)) is torch.optim.AdamW


@pytest.mark.parametrize("cfg,match", [
    (OptimizerConfig(type="Adam", params={"max_grad_norm": 1.0}), "max_grad_norm"),
    (OptimizerConfig(type="sgd", params={}), "did you mean 'SGD'"),
    (OptimizerConfig(type="Adam", params={"lrr": 0.1}), "optimizer.params for 'Adam'.*lrr"),
])
def test_bad_optimizer_configs_name_the_problem(cfg, match):
    with pytest.raises(ConfigError, match=match):
        build_optimizer(cfg, [torch.nn.Parameter(torch.ones(2))])


def lamb_reference(p, grads, lr=0.01, betas=(0.9, 0.99), eps=1e-6, wd=0.01, max_coeff=10.0, min_coeff=0.01):
    """DeepSpeed's fused_lamb_cuda_kernel.cu, transcribed element by element (eps outside sqrt)."""
    p = p.clone().double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        update = m / (v.sqrt() + eps) + wd * p
        w, u = p.norm(), update.norm()
        coeff = min(max(float(w / u), min_coeff), max_coeff) if w > 0 and u > 0 else 1.0
        step_size = lr * (1 - betas[1] ** step) ** 0.5 / (1 - betas[0] ** step)
        p = p - step_size * coeff * update
    return p.float()


def lion_reference(p, grads, lr=0.01, betas=(0.9, 0.99), wd=0.1):
    """DeepSpeed's multi_tensor_lion.cu, transcribed."""
    p, m = p.clone(), torch.zeros_like(p)
    for g in grads:
        c = betas[0] * m + (1 - betas[0]) * g
        p = p * (1 - lr * wd) + torch.where(c > 0, -lr, lr)
        m = betas[1] * m + (1 - betas[1]) * g
    return p


@pytest.mark.parametrize("ours,reference", [
    (lambda ps: build_optimizer(OptimizerConfig(type="Lamb", params={"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-6,
                                                                      "weight_decay": 0.01}), ps), lamb_reference),
    (lambda ps: build_optimizer(OptimizerConfig(type="Lion", params={"lr": 0.01, "betas": [0.9, 0.99],
                                                                      "weight_decay": 0.1}), ps), lion_reference),
])
def test_lamb_and_lion_follow_deepspeed_kernels(ours, reference):
    torch.manual_seed(0)
    start = torch.randn(5, 3)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(5, 3, generator=g) for _ in range(6)]
    p = torch.nn.Parameter(start.clone())
    opt = ours([p])
    for grad in grads:
        p.grad = grad
        opt.step()
    torch.testing.assert_close(p.detach(), reference(start, grads), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("type_name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_communication_compressing_optimizers_are_refused_with_the_reason(type_name):
    with pytest.raises(ConfigError, match="compiler emits the collectives"):
        build_optimizer(OptimizerConfig(type=type_name, params={}), [torch.nn.Parameter(torch.ones(2))])


def _xla_run(opt_factory, fused_path: bool, monkeypatch, steps=3):
    """Two tensors of two shapes on the XLA device; the group update fused or per tensor."""
    import torch_xla

    from spmdzero.backends.torch_xla import fused

    monkeypatch.setattr(fused, "applies", fused.applies if fused_path else (lambda *a: False))
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g).to("xla")),
              torch.nn.Parameter(torch.randn(7, generator=g).to("xla"))]
    opt = opt_factory(params)
    init_state(opt)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to("xla")
        opt.step(group_update=fused.update)
        torch_xla.sync()
    return [p.detach().cpu() for p in params] + [v.cpu() for s in opt.state.values() for v in s.values()]


@pytest.mark.parametrize("factory", [
    lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1),
    lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1, adam_w_mode=False, bias_correction=False),
    lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda ps: Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=0.01),
    lambda ps: Lamb(ps, lr=0.01, weight_decay=0.01),
    lambda ps: Lion(ps, lr=0.01, weight_decay=0.1),
], ids=["adamw", "adam-l2", "sgd", "adagrad", "lamb", "lion"])
def test_fused_group_update_matches_the_per_tensor_update(factory, monkeypatch):
    from spmdzero.backends.torch_xla import fused

    lowered = len(fused._CACHE)
    fused_out = _xla_run(factory, True, monkeypatch)
    assert len(fused._CACHE) == lowered + 1  # one lowering for the group, reused by every step
    for a, b in zip(fused_out, _xla_run(factory, False, monkeypatch)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_results_take_the_targets_place_and_aliases_follow():
    """The fused update swaps its results in (no copy): the parameter objects stay the same,
    views and aliases taken before the step see the new values (``state_dict()`` is built
    from ``p.detach()``), and a step after another ``copy_`` into the parameter (what a
    checkpoint load does) still lands."""
    import torch_xla

    from spmdzero.backends.torch_xla import fused

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3, generator=g).to("xla"))
    ref = torch.nn.Parameter(p.detach().cpu().clone())
    opt, ref_opt = AdamW([p], lr=0.1, weight_decay=0.1), torch.optim.AdamW([ref], lr=0.1, weight_decay=0.1)
    init_state(opt)
    alias = p.detach()
    for step in range(3):
        if step == 1:
            with torch.no_grad():  # a load: new values copied into the live tensors
                p.copy_(p.detach() * 0.5)
                ref.mul_(0.5)
        grad = torch.randn(5, 3, generator=g)
        p.grad, ref.grad = grad.to("xla"), grad.clone()
        opt.step(group_update=fused.update)
        ref_opt.step()
        torch_xla.sync()
        torch.testing.assert_close(p.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(alias.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert opt.param_groups[0]["params"][0] is p and next(iter(opt.state)) is p


def test_each_param_group_keeps_its_fused_op_across_steps(monkeypatch):
    """Weight-decay and no-decay groups share the op's key; each must find its own op again
    each step, not lower (and read every tensor's sharding) anew."""
    import spmdzero
    import spmdzero.backends.torch_xla.fused as fused

    planned = []
    real = fused._shardings
    monkeypatch.setattr(fused, "_shardings", lambda targets: planned.append(len(targets)) or real(targets))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 4))
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    engine, *_ = spmdzero.initialize(model=model, model_parameters=groups, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "spmd": {"backend": "torch_xla"}})  # its fused update op
    x = torch.randn(8, 16)
    for _ in range(3):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert len(planned) == 2  # once per group, at the first step
