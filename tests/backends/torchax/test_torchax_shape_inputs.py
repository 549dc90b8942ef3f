"""Inputs whose values are shapes (``shape_inputs``): an image grid given to the forward stays on
the host and joins the program's key, so a forward that reads it compiles, once per grid, and
trains as in torch; ``image_sizes`` too, for a model with Pixtral's tower only. A factory of
Python numbers inside a trace, the shape ops on it, and a host tensor moved to the devices there
are evaluated while tracing (``known_values``), as transformers' Qwen2.5-VL and Mistral 3 need."""

import copy

import pytest
import torch

import spmdzero
from test_torchax_host_reads import LR, data


class ByGrid(torch.nn.Module):
    """A vision tower's ways with ``image_grid_thw``: sizes read from it (``.tolist()``), the rows
    split by them, and positions made on the host from each grid, which scale the rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x, y, image_grid_thw):
        sizes = image_grid_thw.prod(-1).tolist()
        positions = torch.cat([torch.arange(h * w).repeat(t) for t, h, w in image_grid_thw.tolist()])
        parts = torch.split(self.fc(x), sizes)
        out = torch.cat([part * (1 + i) for i, part in enumerate(parts)]) * (1 + positions[:, None].to(x.device) / 16)
        return torch.nn.functional.mse_loss(out, y)


GRIDS = [torch.tensor([[1, 2, 4], [1, 2, 4]]), torch.tensor([[1, 1, 4], [1, 3, 4]])]  # 16 rows each


def test_a_forward_that_reads_its_image_grid_compiles_once_per_grid_and_trains_as_torch():
    model = ByGrid()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 16, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    for step, (x, y) in enumerate(data(4)):
        grid = GRIDS[step % 2]  # the same shapes, other values: another program, not the first one's
        loss = engine(x, y, image_grid_thw=grid)
        engine.backward(loss)
        engine.step()
        expected = reference(x, y, grid)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert not engine.host_reads.noted  # compiled, not eager
    assert engine.traces["train_forward"] == 2  # one program per grid, each traced once
    for name, p in reference.named_parameters():
        torch.testing.assert_close(dict(engine.module.named_parameters())[name].detach().cpu(), p.detach(),
                                   atol=1e-5, rtol=1e-5)


class Boundaries(torch.nn.Module):
    """transformers 4.x's Qwen2.5-VL window boundaries: a device tensor made from a Python list,
    then ``unique_consecutive`` of it, whose length is a value."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x, y):
        bounds = torch.unique_consecutive(torch.tensor([0, 4, 4, 8, 16, 16], device=x.device, dtype=torch.int32))
        lengths = (bounds[1:] - bounds[:-1]).tolist()  # 4, 4, 8: known while tracing
        out = torch.cat([part * (1 + i) for i, part in enumerate(torch.split(self.fc(x), lengths))])
        return torch.nn.functional.mse_loss(out, y)


def test_a_factory_of_numbers_and_a_shape_op_on_it_are_evaluated_while_tracing():
    from test_torchax_host_reads import _trains_as_torch

    engine = _trains_as_torch(Boundaries())
    assert not engine.host_reads.noted and engine.traces["train_forward"] == 1


class CachePositions(torch.nn.Module):
    """transformers 4.x's Jamba (Zamba, Zamba2): ``cache_position = torch.arange(length)`` in a
    forward without a cache, a causal mask sized by ``cache_position[-1] + 1`` (here over the
    rows); and a comparison of known ranges larger than a constant may be (800 x 800), which stays
    in the program."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x, y):
        cache_position = torch.arange(x.shape[0], device=x.device)
        target = cache_position[-1] + 1
        mask = torch.full((x.shape[0], target), -1e9, device=x.device).triu(1)
        mask = mask * (torch.arange(target, device=x.device) > cache_position.reshape(-1, 1))
        pairs = (torch.arange(800, device=x.device)[:, None] > torch.arange(800, device=x.device)[None]).sum()
        h = self.fc(x)
        out = torch.softmax(h @ h.T + mask, -1) @ h * (pairs / 319600)
        return torch.nn.functional.mse_loss(out, y)


def test_a_range_of_numbers_is_known_while_tracing_and_sizes_a_mask():
    from test_torchax_host_reads import _trains_as_torch

    engine = _trains_as_torch(CachePositions())
    assert not engine.host_reads.noted and engine.traces["train_forward"] == 1


class PixtralTransformer(torch.nn.Module):
    """Named as transformers' Pixtral vision tower, which crops each image by ``image_sizes``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)


class CropsBySizes(torch.nn.Module):
    """Mistral 3's ways with ``image_sizes``: moved to the device, then read (``.tolist()``) to
    split the rows per image."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tower = PixtralTransformer()

    def forward(self, x, y, image_sizes):
        rows = (torch.as_tensor(image_sizes, device=x.device) // 4).prod(dim=-1).tolist()
        out = torch.cat([part * (1 + i) for i, part in enumerate(torch.split(self.tower.fc(x), rows))])
        return torch.nn.functional.mse_loss(out, y)


def test_image_sizes_are_kept_for_a_model_that_crops_by_them_and_only_there():
    from spmdzero.backends.torchax.patches import shape_inputs

    assert "image_sizes" in shape_inputs.names(CropsBySizes())
    assert "image_sizes" not in shape_inputs.names(ByGrid())  # LLaVA-NeXT's are original sizes: inputs
    model = CropsBySizes()
    reference = copy.deepcopy(model)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 16, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    sizes = torch.tensor([[8, 8], [8, 16], [8, 8]])  # patches of 4: 4 + 8 + 4 rows
    x, y = data(1)[0]
    loss = engine(x, y, image_sizes=sizes)
    assert loss.item() == pytest.approx(reference(x, y, sizes).item(), rel=1e-5)
    assert not engine.host_reads.noted and engine.traces["train_forward"] == 1
