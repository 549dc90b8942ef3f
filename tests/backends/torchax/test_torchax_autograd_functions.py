"""A custom ``torch.autograd.Function`` trains with its own ``backward`` on the default (torchax)
backend (``spmdzero/backends/torchax/lowering/autograd_functions.py``): JAX used to differentiate its
forward instead, so a gradient reversal or a straight-through estimator trained silently on
the wrong gradient. Each Function here has a backward that is not its forward's derivative."""

import copy

import pytest
import torch

import spmdzero


class Reverse(torch.autograd.Function):
    """A gradient reversal layer: the identity forward, ``-scale * g`` backward (a number on ctx)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.scale * g, None


class StraightThrough(torch.autograd.Function):
    """``round`` forward, the gradient passed where |x| <= 2 (a saved tensor), zero elsewhere."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 2).to(g.dtype)


class Gate(torch.autograd.Function):
    """``setup_context`` style, an integer tensor input, a tuple output with a plain value, a
    tensor kept as a ctx attribute, and ``None`` for an input that wants no gradient."""

    @staticmethod
    def forward(x, weight, index):
        return x * weight[index], 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, index = inputs
        ctx.weight = weight
        ctx.index = index
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, g, _):
        (x,) = ctx.saved_tensors
        return 2 * g * ctx.weight[ctx.index], None, None  # twice the derivative, none for the weight


class Net(torch.nn.Module):
    def __init__(self, loss_inside: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.gate = torch.nn.Parameter(torch.rand(3, 16))
        self.loss_inside = loss_inside

    def forward(self, x, y=None):
        h = StraightThrough.apply(Reverse.apply(self.a(x), 0.5))
        h, three = Gate.apply(h, self.gate, torch.tensor([1, 2, 0])[1])
        out = self.b(torch.tanh(h)) * (three / 3)
        return torch.nn.functional.mse_loss(out, y) if self.loss_inside else out


def _trains_as_torch(model, losses, steps: int):
    """``model`` trained by the engine (ZeRO-2) and by torch, SGD, on ``losses(module, x, y)``:
    the losses agree at every step and the parameters at the end; returns the engine."""
    reference = copy.deepcopy(model)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 16, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g) * 2, torch.randn(16, 4, generator=g)
        loss, ref_loss = losses(engine, x, y), losses(reference, x, y)
        engine.backward(loss)
        engine.step()
        ref_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for (name, ours), theirs in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach(), rtol=1e-5, atol=1e-6, msg=name)
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("loss_inside", [True, False], ids=["loss_inside", "loss_outside"])
def test_a_custom_function_trains_on_its_own_backward(loss_inside):
    losses = ((lambda module, x, y: module(x, y)) if loss_inside else
              (lambda module, x, y: torch.nn.functional.mse_loss(module(x), y)))
    engine = _trains_as_torch(Net(loss_inside), losses, steps=3)
    x, y = torch.randn(16, 8) * 2, torch.randn(16, 4)
    engine.eval()
    with torch.no_grad():  # an evaluation program calls the Functions as they are
        out = engine(x, y) if loss_inside else engine(x)
    assert torch.isfinite(torch.as_tensor(out.detach().cpu())).all()


class Projected(torch.autograd.Function):
    """TRL's ``ChunkedLogProbFunction`` in small: ``None`` among the outputs and among the saved
    tensors (a missing bias), a boolean output, ``torch.mm(..., out=)`` into a preallocated
    buffer, and a backward that accumulates into slices with ``addmm_`` (twice the derivative of
    ``h``, so that its own backward shows)."""

    @staticmethod
    def forward(ctx, h, weight, bias):
        out = torch.empty(h.shape[0], weight.shape[0], device=h.device, dtype=h.dtype)
        torch.mm(h, weight.t(), out=out)
        ctx.save_for_backward(h, weight, bias)
        return out, None, out > 0

    @staticmethod
    def backward(ctx, g, _none, _mask):
        h, weight, bias = ctx.saved_tensors
        assert bias is None
        half = h.shape[0] // 2
        grad_h = torch.zeros(h.shape, device=h.device, dtype=torch.float32)
        grad_h[:half].addmm_(g[:half], weight)
        grad_h[half:].addmm_(g[half:], weight)
        grad_weight = torch.empty(weight.shape, device=weight.device, dtype=weight.dtype)
        torch.mm(g.t(), h, out=grad_weight)
        return 2 * grad_h, grad_weight, None


class ProjectedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.head = torch.nn.Parameter(torch.randn(6, 16) * 0.3)

    def forward(self, x):
        out, nothing, positive = Projected.apply(torch.tanh(self.a(x)), self.head, None)
        assert nothing is None and positive.dtype == torch.bool
        return out.square().mean() + positive.float().mean() * 0.0


def test_a_function_returning_and_saving_none_with_out_arguments_trains_on_its_backward():
    """It stopped with StopIteration (a ``None`` output taken for a traced one), then with
    "_aten_mm() got an unexpected keyword argument 'out'" and "aten::addmm_ has no lowering" in
    the backward, which JAX runs after the trace."""
    _trains_as_torch(ProjectedNet(), lambda module, x, y: module(x), steps=2)
