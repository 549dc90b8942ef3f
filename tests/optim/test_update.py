"""The boundary update (spmdzero/optim/update.py) is one set of pure functions: on torch tensors
and on JAX arrays it gives the same results, and its loss scaler follows DeepSpeed's."""

import json
import pathlib

import numpy as np
import pytest
import torch

from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.optim.ops import TORCH_OPS, jax_ops
from spmdzero.optim.optimizers import AdamW, SGD
from spmdzero.optim.precision import precision_policy
from spmdzero.optim.update import boundary_update, init_loss_scale, next_loss_scale, sum_of_squares, update_group
from tests.oracle.loss_scale_cases import CASES, PATTERN

RECORDED = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" / "deepspeed_loss_scale.json").read_text())


def _policy(**fp16):
    return precision_policy(DeepSpeedConfig.model_validate({"train_batch_size": 8, "fp16": {"enabled": True, **fp16}}))


@pytest.mark.parametrize("namespace", ["torch", "jax"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_scaler_follows_deepspeed_on_either_namespace(case, namespace):
    import jax.numpy as jnp

    policy = _policy(**CASES[case])
    array, ops = (torch.tensor, TORCH_OPS) if namespace == "torch" else (jnp.asarray, jax_ops())
    state = type(init_loss_scale(policy))(*(array(v, dtype=torch.float32 if namespace == "torch" else jnp.float32)
                                            for v in init_loss_scale(policy)))
    scales = [float(state.scale)]
    for overflow in PATTERN:
        state = next_loss_scale(state, array(bool(overflow)), policy, ops)
        scales.append(float(state.scale))
    assert scales == RECORDED["cases"][case]


def test_no_loss_scaler_without_fp16():
    policy = precision_policy(DeepSpeedConfig.model_validate({"train_batch_size": 8, "bf16": {"enabled": True}}))
    assert init_loss_scale(policy) is None


def _step(ops, array, optimizer, targets, grads, states, clipping, policy, loss_scale=None):
    group = optimizer.param_groups[0]
    hp = {k: array(v) for k, v in optimizer._hyper_values(group).items()}
    static = {k: v for k, v in group.items() if isinstance(v, bool)}

    def apply(scale):
        return update_group(optimizer, targets, grads, states, hp, static, scale, ops)

    return boundary_update(sum_of_squares(grads, ops), loss_scale, clipping, policy, ops, apply)


@pytest.mark.parametrize("make", [lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1),
                                  lambda ps: SGD(ps, lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
@pytest.mark.parametrize("bad_gradient", [False, True], ids=["finite", "inf"])
def test_one_update_gives_the_same_result_on_torch_and_jax(make, bad_gradient):
    import jax.numpy as jnp

    torch.manual_seed(0)
    params = [torch.randn(4, 3), torch.randn(3)]
    grads = [torch.randn(4, 3) * 10, torch.randn(3) * 10]
    if bad_gradient:
        grads[1][0] = float("inf")
    optimizer = make([torch.nn.Parameter(p.clone()) for p in params])
    policy = precision_policy(DeepSpeedConfig.model_validate({"train_batch_size": 8, "bf16": {"enabled": True}}))
    states = [optimizer._initial_state(p, optimizer.param_groups[0]) for p in params]

    def as_jax(t):
        return jnp.asarray(t.numpy()) if isinstance(t, torch.Tensor) else jnp.asarray(t, dtype=jnp.float32)

    on_torch = _step(TORCH_OPS, lambda v: torch.tensor(v, dtype=torch.float32), optimizer, params, grads, states,
                     1.0, policy)
    on_jax = _step(jax_ops(), as_jax, optimizer, [as_jax(p) for p in params], [as_jax(g) for g in grads],
                   [{k: as_jax(v) for k, v in s.items()} for s in states], 1.0, policy)
    assert bool(on_torch.scale.skip) == bool(on_jax.scale.skip) == bad_gradient
    assert float(on_torch.scale.norm) == pytest.approx(float(on_jax.scale.norm), rel=1e-6)
    (torch_targets, torch_states), (jax_targets, jax_states) = on_torch.applied, on_jax.applied
    for a, b, before in zip(torch_targets, jax_targets, params):
        np.testing.assert_allclose(a.numpy(), np.asarray(b), rtol=1e-6, atol=1e-7)
        assert torch.equal(a, before) == bad_gradient  # skipped: the old values, bit for bit
    for a, b in zip(torch_states, jax_states):
        for key in a:
            np.testing.assert_allclose(a[key].numpy(), np.asarray(b[key]), rtol=1e-6, atol=1e-7)


def test_clipping_divides_by_deepspeeds_coefficient_and_never_scales_up():
    policy = precision_policy(DeepSpeedConfig.model_validate({"train_batch_size": 8}))
    grads = [torch.tensor([3.0, 4.0])]  # norm 5
    optimizer = SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    for clipping, expected in [(1.0, 1 / (5 + 1e-6)), (10.0, 1.0), (0.0, None)]:
        result = _step(TORCH_OPS, lambda v: torch.tensor(v), optimizer, [torch.zeros(2)], grads, [{}], clipping,
                       policy)
        assert float(result.scale.norm) == pytest.approx(5.0)
        if expected is None:
            assert result.scale.multiplier is None
        else:
            assert float(result.scale.multiplier) == pytest.approx(expected, rel=1e-6)
