"""F.cross_entropy on the torchax backend (spmdzero.backends.torchax.lowering.cross_entropy): the fused loss
trains as torchax's own lowering of torch's loss does, and the calls it does not take go to that
lowering."""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spmdzero
from spmdzero.backends.torchax.lowering import cross_entropy

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


def train(kwargs: dict, model=Head, **config):
    """STEPS SGD steps of ``model(kwargs)``: the losses (asserted fp32, as torch's loss of fp32
    logits) and the parameters."""
    engine, *_ = spmdzero.initialize(model=model(kwargs, upcast=True), config={
        "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, **config})
    losses = []
    for step in range(STEPS):
        loss = engine(*data(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert loss.dtype == torch.float32
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


class HalfHead(Head):
    """A bf16 model whose loss upcasts its logits and flattens them, as transformers' causal-LM
    loss does (``logits.float()``, then ``.view(-1, vocab)``)."""

    def forward(self, x, labels):
        logits = self.net(x).view(4, 4, 50).float()
        return F.cross_entropy(logits.view(-1, 50), labels, **self.kwargs)


def test_upcast_logits_go_in_as_their_half_precision_values_and_train_the_same(monkeypatch):
    """The fused loss takes the bf16 logits an fp32 upcast came from (through the reshapes
    after it): no fp32 copy of them is made. Losses and parameters are those of the same loss
    on the upcast copy to bf16's precision: an upcast is exact and the loss's arithmetic is fp32
    either way, but on the copy XLA folds the upcast into the head's matmul (an fp32 result,
    never rounded to bf16 as torch rounds it), so the two differ in the logits' last bits."""
    seen = []
    real = cross_entropy._loss

    def loss_of(ignore_index):
        fused = real(ignore_index)

        def call(x, labels):
            seen.append(str(x.dtype))
            return fused(x, labels)

        return call

    def run():
        return train({"ignore_index": IGNORED}, HalfHead, bf16={"enabled": True})

    monkeypatch.setattr(cross_entropy, "_loss", loss_of)
    losses, params = run()
    assert seen == ["bfloat16"], seen  # traced once, on the bf16 logits
    seen.clear()
    monkeypatch.setattr(cross_entropy._Upcasts, "source", lambda self, value: None)
    expected, expected_params = run()
    assert seen == ["float32"], seen
    np.testing.assert_allclose(losses, expected, rtol=1e-4, atol=0)
    for name, value in expected_params.items():
        torch.testing.assert_close(params[name], value, atol=4e-3, rtol=0)
