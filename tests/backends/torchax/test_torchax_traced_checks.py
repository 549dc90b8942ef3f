"""torch's tensor checks and formatting of traced values (``traced_checks``), and the host
tensors a factory makes from a device value (``host_tensors``), as transformers' vision-language
models use them: a traced step leaves out a check it cannot evaluate and says so once; with values
the check runs as in torch; a factory reads its size as torch does."""

import copy

import pytest
import torch

import spmdzero
from conftest import spmdzero_log
from spmdzero.backends.torchax.lowering import traced_checks
from test_torchax_host_reads import LR, _trains_as_torch, data


class CheckedCount(torch.nn.Module):
    """transformers 5.x's ``get_placeholder_mask``: a count checked by ``torch._check_tensor_all_with``
    with a message formatted beforehand from the count."""

    def __init__(self, limit: float = -1.0, reads: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 8)
        self.limit, self.reads = limit, reads

    def forward(self, x, y):
        count = (x > 0).sum()
        message = f"positive entries do not match: {count}"
        torch._check_tensor_all_with(ValueError, count > self.limit, lambda: message)
        if self.reads and x.sum() > 1e9:  # a read: the forward runs eagerly
            x = x * 0
        return torch.nn.functional.mse_loss(self.fc(x), y)


def test_a_traced_check_is_left_out_and_said_once_and_the_step_compiles():
    with spmdzero_log() as records:
        engine = _trains_as_torch(CheckedCount(), steps=3)
    assert not engine.host_reads.noted  # compiled: neither the check nor the message read
    assert engine.traces["train_forward"] == 1
    notes = [r.getMessage() for r in records if "torch._check_tensor_all_with" in r.getMessage()]
    assert len(notes) == 1, notes
    assert "test_torchax_traced_checks.py" in notes[0] and "positive entries do not match: <traced" in notes[0]


def test_with_values_the_check_runs_as_in_torch():
    failing = CheckedCount(limit=1e6, reads=True)
    x, y = data(1)[0]
    expected = f"positive entries do not match: {int((x > 0).sum())}\\b"
    with pytest.raises(ValueError, match=expected):
        copy.deepcopy(failing)(x, y)  # torch's message, with the count
    engine, *_ = spmdzero.initialize(model=failing, config={
        "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    with pytest.raises(ValueError, match=expected):
        engine(x, y)  # the eager run has the values: the check fails, its message holds the number
    assert engine.host_reads.noted


def test_transformers_4_placeholder_checks_are_dropped_at_their_own_lines():
    def get_placeholder_mask(self, input_ids, inputs_embeds, image_features):
        mask = (input_ids == 7).unsqueeze(-1).expand_as(inputs_embeds)
        if inputs_embeds[mask].numel() != image_features.numel():
            raise ValueError("Image features and image tokens do not match")
        return mask

    rewritten = traced_checks._without_checks(get_placeholder_mask)
    assert rewritten.__code__.co_firstlineno == get_placeholder_mask.__code__.co_firstlineno
    assert rewritten.__code__.co_filename == get_placeholder_mask.__code__.co_filename
    ids, embeds, features = torch.tensor([[7, 1, 7]]), torch.zeros(1, 3, 4), torch.zeros(1, 4)
    with pytest.raises(ValueError, match="do not match"):
        get_placeholder_mask(None, ids, embeds, features)
    assert torch.equal(rewritten(None, ids, embeds, features), get_placeholder_mask(None, ids, embeds, features[:0].new_zeros(2, 4)))

    def unchecked(self, input_ids):
        return input_ids == 7

    assert traced_checks._without_checks(unchecked) is None  # nothing to drop: transformers' own runs


class HostIndex(torch.nn.Module):
    """transformers 4.x's Qwen2-VL and Qwen2.5-VL vision towers: ``torch.arange(h)`` on the host,
    ``h`` a device value, padded by another (``F.pad(index, (0, pad))``), and a lazy view indexed by
    a boolean mask (``token_types[attention_mask[row].bool()]``); and transformers 4.x's Idefics3:
    a view written through a boolean mask (``position_ids[row][mask] = ids``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x, y):
        size = (x[0, 0] * 0).long() + 4
        index = torch.nn.functional.pad(torch.arange(size), (0, size), "constant", -1)  # 8 entries
        row = x[1]
        kept = row[row > 0]  # a view's entries picked by a mask
        positions = torch.zeros(2, 16, device=x.device)
        positions[1][row > 0] = 1.0  # a view's entries written through a mask
        scale = 1 + (index >= 0).float().mean() + kept.sum() * 0 + positions.mean()
        return torch.nn.functional.mse_loss(self.fc(x) * scale, y)


def test_a_host_factory_of_a_device_value_and_its_padding_run_as_in_torch():
    assert _trains_as_torch(HostIndex()).host_reads.noted  # eager: the size is a read, as in torch
