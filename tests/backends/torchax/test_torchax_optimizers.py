"""torch.optim optimizers on the torchax backend (a client's ``initialize(optimizer=...)`` or
``optimizer.type`` naming a torch.optim class, with client LR schedulers): their own step traced
into the update program, with the torch_xla backend's results and checkpoints."""

import pytest
import torch

import spmdzero

from conftest import batches, tiny_mlp
from test_torchax_backend import WithLoss

STEPS = 6  # optimizer steps, 2 micro-steps each


def config(backend: str, **extra) -> dict:
    return {"train_batch_size": 32, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
            "zero_optimization": {"stage": 2}, "spmd": {"backend": backend}, **extra}


def adamw_with_step_lr(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.7)}


def sgd_callable_with_lambda_lr(model):
    return {"optimizer": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
            "lr_scheduler": lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))}


def rmsprop_by_type(model):
    return {"config": {"optimizer": {"type": "RMSprop", "params": {"lr": 1e-3, "momentum": 0.9}}}}


def adagrad_with_linear_lr(model):
    """The Trainer's ``--optim adagrad``: torch's Adagrad makes its states in its constructor (its
    step reads them without making them) and reads its step count with ``.item()``."""
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1,
                                    weight_decay=0.01)
    return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.2, STEPS)}


CASES = {"adamw-instance-steplr": adamw_with_step_lr, "sgd-callable-lambdalr": sgd_callable_with_lambda_lr,
         "rmsprop-type": rmsprop_by_type, "adagrad-instance-linearlr": adagrad_with_linear_lr}


def build(backend: str, case: str, seed: int = 0):
    model = WithLoss(tiny_mlp(seed=seed))
    given = CASES[case](model)
    engine, *_ = spmdzero.initialize(model=model, config=config(backend, **given.pop("config", {})), **given)
    return engine


def train(engine, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("case", CASES)
def test_a_torch_optimizer_trains_as_on_the_torch_xla_backend(case):
    """The same losses, lrs and parameters as the torch_xla backend (they were refused); the
    update is traced at its first two steps (without, then with the states torch creates; once
    for Adagrad, whose constructor creates them), then never again, while the schedule changes
    the lr every step (a traced value: the change of a step at lr 1, scaled by it)."""
    data = batches(2 * STEPS, 16)
    ref = build("torch_xla", case)
    ref_losses = train(ref, data)
    engine = build("torchax", case)
    losses = train(engine, data[:6])
    warm = dict(engine.traces)
    losses += train(engine, data[6:])
    assert dict(engine.traces) == warm  # after 3 optimizer steps: nothing traced again
    assert warm["update"] == (1 if case.startswith("adagrad") else 2)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert engine.get_lr() == pytest.approx(ref.get_lr())
    if case != "rmsprop-type":  # the schedule moved the lr
        assert engine.get_lr()[0] < 0.5 * (1e-2 if case.startswith("adamw") else 0.1)
    for (name, p), (_, q) in zip(engine.module.named_parameters(), ref.module.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach().cpu(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("saved,loaded,case", [
    ("torchax", "torchax", "adamw-instance-steplr"), ("torchax", "torch_xla", "adamw-instance-steplr"),
    ("torch_xla", "torchax", "adamw-instance-steplr"), ("torch_xla", "torchax", "adagrad-instance-linearlr")])
def test_a_torch_optimizers_checkpoint_loads_on_either_backend(saved, loaded, case, tmp_path):
    """AdamW's states and its host-kept step count, the StepLR schedule and the counters: the
    run resumed by the other backend (from other initial weights) continues as the saving run
    does, in the torch_xla backend's format. Adagrad's states, which its constructor made, are
    those the checkpoint holds after the load."""
    data = batches(10, 16)
    engine = build(saved, case)
    first_lr = engine.get_lr()
    train(engine, data[:6])
    saved_lr = engine.get_lr()
    assert saved_lr != pytest.approx(first_lr)  # the schedule has moved
    engine.save_checkpoint(str(tmp_path))
    continued = train(engine, data[6:])
    resumed = build(loaded, case, seed=1)
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.global_steps == 3 and resumed.get_lr() == pytest.approx(saved_lr)
    assert train(resumed, data[6:]) == pytest.approx(continued, abs=1e-6)


class Embedder(torch.nn.Module):
    """An embedding of which each batch touches a few rows: the others' gradients and Adam
    states are exactly zero."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 1)

    def forward(self, ids, y):
        return torch.nn.functional.mse_loss(self.out(self.emb(ids)).mean(1).squeeze(-1), y)


def test_adamw_warming_up_from_lr_zero_stays_finite():
    """A warmup's first lr is 0 (HF's linear schedule, DeepSpeed's WarmupLR). torch's capturable
    AdamW divides by the lr: given it as a tensor, every embedding row no batch had touched
    became NaN after the first update. The torch_xla backend's parameters, finite."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, 16, (16, 4), generator=g), torch.randn(16, generator=g)) for _ in range(8)]
    engines = []
    for backend in ("torch_xla", "torchax"):
        model = Embedder()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / 2))
        engine, *_ = spmdzero.initialize(model=model, optimizer=optimizer, lr_scheduler=warmup,
                                         config=config(backend))
        engines.append((engine, train(engine, data)))
    (ref, ref_losses), (engine, losses) = engines
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    weight = engine.module.emb.weight.detach()
    assert torch.isfinite(weight).all()
    torch.testing.assert_close(weight, ref.module.emb.weight.detach().cpu(), atol=1e-5, rtol=1e-5)


def _transformers_adafactor(**options):
    def make(params):
        from transformers.optimization import Adafactor

        return Adafactor(params, **options)
    return make


# optimizers whose own step reads a value on the host, or made a state torchax could not
OWN_STEP_CASES = {
    # transformers' Adafactor as the Trainer's --optim adafactor makes it
    "transformers-adafactor": _transformers_adafactor(lr=1e-2, scale_parameter=False, relative_step=False,
                                                      warmup_init=False, weight_decay=0.01),
    # T5's recipe: step sizes from the count, scaled by each parameter's RMS, and a first moment
    "transformers-adafactor-relative-step": _transformers_adafactor(lr=None, scale_parameter=True, relative_step=True,
                                                                    warmup_init=True, beta1=0.9),
    # torch's own (2.5 and later): .item() of its count and of two norms
    "torch-adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2, weight_decay=0.01),
    # its eta state made by torch.as_tensor(lr, dtype=...), which torchax could not convert; t0=2: it averages
    "torch-asgd": lambda params: torch.optim.ASGD(params, lr=1e-2, t0=2, weight_decay=0.01),
}


@pytest.mark.parametrize("case", OWN_STEP_CASES)
def test_an_optimizer_whose_step_reads_values_trains_as_in_plain_torch_and_resumes(case, tmp_path):
    """transformers' Adafactor keeps its step count as a Python number and reads it with
    math.pow: traced as it is, the run stopped at its second step (KeyError: 'step'). torch's
    Adafactor reads its count and norms with .item(), and torch's ASGD makes a state with
    torch.as_tensor: both were refused at their first step. Their updates with the reads as
    tensors (factored second moments for matrices, unfactored for biases): the losses and
    parameters of plain torch over 6 steps, the update traced twice and never again, the states
    under torch's own keys, and a checkpoint taken after 3 steps resumes to the same losses."""
    make = OWN_STEP_CASES[case]
    data = batches(6, 16)
    reference = WithLoss(tiny_mlp())
    torch_optimizer = make(reference.parameters())
    expected = []
    for x, y in data:
        loss = reference(x, y)
        loss.backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        expected.append(loss.item())

    def engine_of(seed):
        model = WithLoss(tiny_mlp(seed=seed))
        engine, *_ = spmdzero.initialize(model=model, optimizer=make(model.parameters()),
                                         config={"train_batch_size": 16, "gradient_clipping": 0.0,
                                                 "zero_optimization": {"stage": 2}})
        return engine

    engine = engine_of(0)
    losses = train(engine, data[:3])
    engine.save_checkpoint(str(tmp_path))
    warm = dict(engine.traces)
    losses += train(engine, data[3:])
    assert warm["update"] == 2 and dict(engine.traces) == warm
    assert losses == pytest.approx(expected, abs=1e-5)
    for (name, p), (_, q) in zip(engine.module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
    states = engine.optimizer.state_dict()["state"]
    assert [sorted(states[i]) for i in sorted(states)] == [
        sorted(s) for s in torch_optimizer.state_dict()["state"].values()]
    resumed = engine_of(1)
    resumed.load_checkpoint(str(tmp_path))
    assert train(resumed, data[3:]) == pytest.approx(losses[3:], abs=1e-6)
