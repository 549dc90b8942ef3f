"""F.cross_entropy on the torchax backend (spmdzero.backends.torchax.cross_entropy): the fused loss
trains as torchax's own lowering of torch's loss does, and the calls it does not take go to that
lowering."""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spmdzero
from spmdzero.backends.torchax import cross_entropy

STEPS = 3
IGNORED = -7


class Head(torch.nn.Module):
    def __init__(self, kwargs: dict, upcast: bool):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 50))
        self.kwargs, self.upcast = kwargs, upcast

    def forward(self, x, labels):
        logits = self.net(x)
        if self.upcast:  # as transformers' causal-LM loss does
            logits = logits.float()
        loss = F.cross_entropy(logits, labels, **self.kwargs)
        return loss.mean() if loss.dim() else loss


def data(step: int):
    g = torch.Generator().manual_seed(step)
    labels = torch.randint(0, 50, (16,), generator=g)
    labels[::5] = IGNORED  # some rows left out
    return torch.randn(16, 16, generator=g), labels


# fused: mean and sum; torchax's own lowering: none and label smoothing
CASES = {"mean": ({"ignore_index": IGNORED}, True), "sum": ({"ignore_index": IGNORED, "reduction": "sum"}, True),
         "none": ({"ignore_index": IGNORED, "reduction": "none"}, False),
         "smoothing": ({"ignore_index": IGNORED, "label_smoothing": 0.1}, False)}


def train(kwargs: dict):
    engine, *_ = spmdzero.initialize(model=Head(kwargs, upcast=True), config={
        "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}})
    losses = []
    for step in range(STEPS):
        loss = engine(*data(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("case", CASES)
def test_cross_entropy_trains_as_torchax_lowers_it(case, monkeypatch):
    kwargs, taken = CASES[case]
    calls = []
    real = cross_entropy._loss

    def counted(ignore_index):
        calls.append(ignore_index)
        return real(ignore_index)

    monkeypatch.setattr(cross_entropy, "_loss", counted)
    losses, params = train(kwargs)
    assert calls == ([IGNORED] if taken else [])  # traced once
    monkeypatch.setattr(cross_entropy, "fused", lambda env: contextlib.nullcontext())
    expected, expected_params = train(kwargs)
    np.testing.assert_allclose(losses, expected, rtol=1e-6, atol=1e-6)
    for name, value in expected_params.items():
        torch.testing.assert_close(params[name], value, atol=1e-6, rtol=1e-5)
