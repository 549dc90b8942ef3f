"""Odd models and odd call sequences (issue #13, engine): what DeepSpeed accepts works."""

import pytest
import torch

import spmdzero

from conftest import BACKENDS, tiny_mlp


def test_frozen_layers_with_model_parameters_train_the_rest():
    """DeepSpeed's usual call passes model.parameters(), frozen ones included; its ZeRO
    optimizers keep only those that require grad."""
    model = tiny_mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    trained = model[2].weight.detach().clone()
    engine, optimizer, *_ = spmdzero.initialize(
        model=model, model_parameters=model.parameters(),
        config={"train_batch_size": 8, "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}})
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
    engine.step()
    assert torch.equal(model[0].weight.detach().cpu(), frozen)
    assert not torch.equal(model[2].weight.detach().cpu(), trained)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nonfinite_fp32_loss_is_told_once_at_a_print_step_and_a_save(tmp_path, backend):
    import warnings

    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={
        "train_batch_size": 8, "steps_per_print": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "spmd": {"backend": backend}})

    def transfers():  # torch_xla's reads of the device (the torchax engine reads JAX arrays: not counted)
        if backend != "torch_xla":
            return 0
        import torch_xla.debug.metrics as met

        return (met.metric_data("TransferFromDeviceTime") or [0])[0]

    x, y = torch.randn(8, 16), torch.randn(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
        engine.step()
        before = transfers()
        bad = torch.tensor([float("nan")]).to(engine.device).reshape(())
        engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)) * bad)
        engine.step()  # a print step: the loss is read there anyway
        assert transfers() > before or backend != "torch_xla"
        for _ in range(2):
            engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
            engine.step()
        engine.save_checkpoint(str(tmp_path))
    told = [str(w.message) for w in caught if "no longer finite" in str(w.message)]
    assert len(told) == 1 and "the loss is nan at global step 2" in told[0], told


def test_without_print_steps_a_save_tells(tmp_path):
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={
        "train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": float(1e30)}}})
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    for _ in range(2):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)) * 1e30)
        engine.step()
    with pytest.warns(UserWarning, match="gradient norm of the last step is (nan|inf)"):
        engine.save_checkpoint(str(tmp_path))


def test_reading_the_grad_norm_tells_of_a_nonfinite_fp32_run_once():
    """What HF Trainer / accelerate do after every step: read get_global_grad_norm()."""
    import warnings

    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={
        "train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for scale in (1.0, float("inf"), 1.0):
            engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)) * scale)
            engine.step()
            engine.get_global_grad_norm()
    told = [str(w.message) for w in caught if "no longer finite" in str(w.message)]
    assert len(told) == 1 and "gradient norm of the last step is" in told[0] and "global step 2" in told[0], told


def test_a_step_without_backward_is_refused_and_changes_nothing():
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={
        "train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}})
    with pytest.raises(RuntimeError, match="no engine.backward"):
        engine.step()
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
    engine.step()
    before = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    with pytest.raises(RuntimeError, match="no engine.backward"):
        engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 1
    assert all(torch.equal(before[n], p.detach().cpu()) for n, p in engine.module.named_parameters())
