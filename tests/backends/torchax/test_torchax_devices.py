"""PyTorch's device idioms on the torchax backend (the default): torchax names torch's PrivateUse1
device ``jax`` (the outputs' device, and ``torch.device(0)``) with nothing behind it. A move or a
factory there is a copy on the host (``spmdzero.runtime.privateuse1``), ``torch.accelerator``
answers as on a host without an accelerator (so DataLoaders do not pin), and a host tensor an
output's op writes into gets the value (``backends/torchax/outputs/host_tensors.py``). Every idiom used
to raise "Could not run 'aten::empty_strided' with arguments from the 'jax' backend"."""

from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F

import spmdzero
from spmdzero.compat.deepspeed.accelerator import get_accelerator

from conftest import batches, run_python, tiny_mlp

VOCAB, ROWS, LENGTH = 32, 8, 6


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def sgd(stage: int = 1) -> dict:
    # a micro-batch of ROWS rows on the 8 devices (spmd.rank "device": a rank is a device)
    return {"train_micro_batch_size_per_gpu": ROWS // 8, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "spmd": {"backend": "torchax"}}


@pytest.fixture(scope="module")
def engine_and_output():
    engine, *_ = spmdzero.initialize(model=mlp(), config=sgd())
    with torch.no_grad():
        out = engine(torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(1)))
    assert out.device.type == "jax"  # a torchax tensor: the device these idioms name
    return engine, out


# ---- moves and factories ---------------------------------------------------------------------

MOVES = {
    "out.device": lambda engine, out: out.device,
    "engine.local_rank": lambda engine, out: engine.local_rank,
    "int 0": lambda engine, out: 0,
    "torch.device(out.device)": lambda engine, out: torch.device(out.device),
    "torch.device(0)": lambda engine, out: torch.device(0),
    "'jax:0'": lambda engine, out: "jax:0",
    "get_accelerator().device_name(0)": lambda engine, out: get_accelerator().device_name(0),
    "engine.device": lambda engine, out: engine.device,
    # without an index (torch asks a device guard for the current one: "not linked with support for jax devices")
    "'jax'": lambda engine, out: "jax",
    "torch.accelerator.current_accelerator()": lambda engine, out: torch.accelerator.current_accelerator(),
}


@pytest.mark.parametrize("target", list(MOVES))
def test_a_move_to_the_device_is_a_copy_on_the_host(engine_and_output, target):
    engine, out = engine_and_output
    for y in (torch.arange(6).view(2, 3), torch.randn(3, 4).t(), torch.randn(5, requires_grad=True)):
        moved = y.to(MOVES[target](engine, out))
        assert moved.device.type == "cpu" and moved.dtype == y.dtype  # int64 stays int64 on the host
        assert torch.equal(moved.detach(), y.detach())
    half = torch.ones(3).to(MOVES[target](engine, out), torch.float16, non_blocking=True)
    assert half.dtype == torch.float16 and half.device.type == "cpu"


def test_torch_device_0_is_the_outputs_device(engine_and_output):
    engine, out = engine_and_output
    assert torch.device(0) == torch.device(out.device) == out.device  # at::getAccelerator names jax
    assert engine.local_rank == 0 and engine.device == torch.device("cpu")


def test_outputs_print_and_format_as_torch_tensors(engine_and_output):
    """``f"loss {loss:.4f}"`` raised TypeError (torchax's tensor has no ``__format__``), and
    ``print(loss)`` or DeepSpeed-Chat's ``f"loss = {loss}"`` printed
    "Tensor(<class 'jaxlib._jax.ArrayImpl'> 6.93)". A one-number output formats as its number,
    as torch's does, and an output prints as torch prints a tensor, with its device."""
    engine, out = engine_and_output
    total = out.sum()
    assert f"{total:.3f}" == f"{total.item():.3f}" and f"{total}" == str(total.item())
    assert "%.2f" % total == "%.2f" % total.item()
    row = out[0, :3]
    assert repr(row) == str(row) == repr(torch.tensor(row.tolist()))[:-1] + ", device='jax:0')"
    assert repr(row.to(torch.bfloat16)).endswith("dtype=torch.bfloat16, device='jax:0')")
    with pytest.raises(TypeError):  # as torch: a format spec for a one-number tensor only
        f"{row:.3f}"


def test_a_move_keeps_its_gradient_on_the_host():
    y = torch.ones(3, requires_grad=True)
    (y.to(0) * torch.arange(3.0)).sum().backward()
    assert torch.equal(y.grad, torch.arange(3.0))


def test_a_module_moved_to_the_device_stays_on_the_host():
    net = mlp()
    before = [p.detach().clone() for p in net.parameters()]
    assert net.to(0) is net and net.to("jax:0") is net
    assert all(p.device.type == "cpu" and torch.equal(p, q) for p, q in zip(net.parameters(), before))


FACTORIES = {
    "zeros": (lambda d: torch.zeros(2, 3, device=d), lambda: torch.zeros(2, 3)),
    "ones int64": (lambda d: torch.ones(4, dtype=torch.long, device=d), lambda: torch.ones(4, dtype=torch.long)),
    "full": (lambda d: torch.full((2,), 7.0, device=d), lambda: torch.full((2,), 7.0)),
    "arange": (lambda d: torch.arange(5, device=d), lambda: torch.arange(5)),
    "tensor": (lambda d: torch.tensor([[1, 2], [3, 4]], device=d), lambda: torch.tensor([[1, 2], [3, 4]])),
    "as_tensor": (lambda d: torch.as_tensor([1.0, 2.0], device=d), lambda: torch.as_tensor([1.0, 2.0])),
    "eye": (lambda d: torch.eye(3, device=d), lambda: torch.eye(3)),
    "linspace": (lambda d: torch.linspace(0, 1, 5, device=d), lambda: torch.linspace(0, 1, 5)),
    "tril_indices": (lambda d: torch.tril_indices(3, 3, device=d), lambda: torch.tril_indices(3, 3)),
    "zeros_like": (lambda d: torch.zeros_like(torch.ones(2, 2), device=d), lambda: torch.zeros(2, 2)),
    "empty (shape)": (lambda d: torch.tensor(torch.empty(2, 5, device=d).shape), lambda: torch.tensor([2, 5])),
    # random draws come from torch's CPU generator, as they would on the host
    "randn": (lambda d: torch.randn(4, device=d, generator=torch.Generator().manual_seed(3)),
              lambda: torch.randn(4, generator=torch.Generator().manual_seed(3))),
    "randint": (lambda d: torch.randint(0, 9, (4,), device=d, generator=torch.Generator().manual_seed(3)),
                lambda: torch.randint(0, 9, (4,), generator=torch.Generator().manual_seed(3))),
}


@pytest.mark.parametrize("factory", list(FACTORIES))
@pytest.mark.parametrize("device", ["out.device", "int 0", "'jax:0'"])
def test_a_factory_on_the_device_makes_a_host_tensor(engine_and_output, factory, device):
    engine, out = engine_and_output
    made, expected = FACTORIES[factory][0](MOVES[device](engine, out)), FACTORIES[factory][1]()
    assert made.device.type == "cpu" and made.dtype == expected.dtype
    assert torch.equal(made, expected)


def test_an_index_less_device_makes_a_factory_on_the_host():
    assert torch.zeros(2, device="jax").device.type == "cpu"


# ---- host tensors beside the outputs ----------------------------------------------------------

def test_host_tensors_made_on_the_device_combine_with_the_outputs(engine_and_output):
    engine, out = engine_and_output
    expected = out.detach().cpu()
    bias = torch.arange(8.0).to(out.device)
    assert torch.allclose((out + bias).cpu(), expected + torch.arange(8.0))
    labels = torch.arange(ROWS).remainder(8).to(out.device)
    assert float(F.cross_entropy(out, labels)) == pytest.approx(float(F.cross_entropy(expected, labels)), rel=1e-6)


def test_a_host_copy_of_an_output_is_the_scripts_own(engine_and_output):
    """``h = out.cpu(); h += 1``: torchax handed torch the array's host value, which JAX caches
    read-only and returns at every later read, so the write changed what the output read
    afterwards (a replicated output's; a sharded one's host value is assembled afresh)."""
    engine, out = engine_and_output
    for value in (out.detach(), out.detach().sum(0)):
        expected = value.tolist()
        host = value.cpu()
        host += 100.0
        assert value.tolist() == expected and value.cpu().tolist() == expected
        assert torch.equal(host, torch.tensor(expected) + 100.0)


def test_an_output_saved_with_torch_save_loads_as_a_host_tensor(engine_and_output):
    """DeepSpeedExamples' ImageNet example saves ``best_acc1``, a metric computed from the outputs,
    in its checkpoint: pickle could not name the outputs' class ("Can't pickle local object
    'output_tensor_class.<locals>.Output'"). It is saved as its value on the host."""
    import io
    import pickle

    engine, out = engine_and_output
    buffer = io.BytesIO()
    torch.save({"best_acc1": out.detach().sum(), "logits": out.detach()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert type(loaded["logits"]) is torch.Tensor and torch.equal(loaded["logits"], out.detach().cpu())
    assert loaded["best_acc1"].item() == pytest.approx(out.detach().sum().item())
    assert torch.equal(pickle.loads(pickle.dumps(out.detach())), out.detach().cpu())


def test_a_trained_model_pickles_whole_with_its_trained_values():
    """``torch.save(model)`` (the whole module, not its state dict) failed: "Can't pickle local
    object 'sync_before_state_dict.<locals>.sync'", the hook that brings the trained values
    back. The file holds a plain module with the trained values, and a later step leaves it be."""
    import copy
    import io

    model = mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = spmdzero.initialize(model=model, config=sgd())
    x, y = torch.randn(ROWS, 16), torch.randn(ROWS, 8)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded, copied = torch.load(buffer, weights_only=False), copy.deepcopy(model)
    trained = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert not torch.equal(trained["0.weight"], before["0.weight"])
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()  # the copies are not the engine's
    for other in (loaded, copied):
        assert type(other) is torch.nn.Sequential
        assert {type(p) for p in other.parameters()} == {torch.nn.Parameter}
        for name, value in other.state_dict().items():
            assert torch.equal(value, trained[name]), name


CHECKED = {  # functions on outputs whose C++ made a number (or data) a tensor on their device, or refused them
    "where(mask, out, 0.0)": lambda out: torch.where(out > 0, out, 0.0),
    "where(mask, -1, out)": lambda out: torch.where(out > 0, -1, out),
    "where(mask, 1, 0)": lambda out: torch.where(out > 0, 1, 0),
    "where(mask, 2.5, 0)": lambda out: torch.where(out > 0, 2.5, 0),
    "out.where(mask, 0.0)": lambda out: out.where(out > 0, 0.0),
    "bf16 out.where(mask, 0.5)": lambda out: out.to(torch.bfloat16).where(out > 0, 0.5),
    "bf16 where(mask, out, 0.5)": lambda out: torch.where(out > 0, out.to(torch.bfloat16), 0.5),
    "int where(mask, ids, -100)": lambda out: torch.where(out > 0, out.argmax(-1, keepdim=True), -100),
    "new_tensor(list)": lambda out: out.new_tensor([1.5, 2.5]),
    "new_tensor(host tensor)": lambda out: out.new_tensor(torch.arange(3)),
    "new_tensor(dtype=long)": lambda out: out.new_tensor([1, 2], dtype=torch.long),
    "take_along_dim(out, host ids, dim)": lambda out: torch.take_along_dim(out, torch.tensor([[1], [3]] * 4), dim=1),
    "out.take_along_dim(argmax, dim)": lambda out: out.take_along_dim(out.argmax(-1, keepdim=True), dim=-1),
    "take_along_dim(out, broadcast ids, 0)": lambda out: torch.take_along_dim(out, torch.tensor([[7], [0]]), 0),
    "take_along_dim(out, flat ids)": lambda out: torch.take_along_dim(out, torch.tensor([5, 0, 63])),
    "one_hot(argmax)": lambda out: F.one_hot(out.argmax(-1), 8),
    "one_hot(argmax) classes read": lambda out: F.one_hot(out.argmax(-1)),
}


@pytest.mark.parametrize("op", list(CHECKED))
def test_functions_that_torch_checks_before_the_outputs_ops_give_torchs_values(engine_and_output, op):
    """torch's C++ sees an output's device as ``meta`` and its integers as int32: a number it
    made a tensor there lost its value ("Cannot copy out of meta tensor; no data!"), and
    ``take_along_dim`` and ``one_hot`` refused the host's or int32 indices
    (``output_functions``). TRL's distillation losses mask with ``torch.where(mask, 0.0, logps)``,
    ORPO's ``log1mexp`` is a ``torch.where``, online DPO takes its log-probs along its ids."""
    engine, out = engine_and_output
    result = CHECKED[op](out.detach())
    expected = CHECKED[op](out.detach().cpu())
    assert result.device == out.device
    # torchax makes torch's int64 int32 (JAX without x64), as for ``out.argmax(-1)``
    assert result.dtype == (torch.int32 if expected.dtype == torch.int64 else expected.dtype)
    assert torch.equal(result.cpu(), expected)


def test_an_outputs_value_written_into_a_host_tensor_lands_there(engine_and_output):
    """``total += loss``, ``buf[:] = out.argmax(-1)``, ``copy_`` and ``out=``: the op runs in JAX
    on a copy of the host tensor; the value used to stay in the copy (the host tensor kept 0)."""
    engine, out = engine_and_output
    host = out.detach().cpu()
    total = torch.zeros((), device=out.device)
    total += out.sum().detach()
    total += out.sum().detach()
    assert float(total) == pytest.approx(2 * float(host.sum()), rel=1e-5)
    buf = torch.zeros(ROWS, dtype=torch.long, device=0)
    buf[:] = out.argmax(-1)
    assert torch.equal(buf, host.argmax(-1)) and buf.dtype == torch.long
    rows = torch.zeros(ROWS, 8)
    rows[2:5] = out[2:5].detach()
    assert torch.equal(rows[2:5], host[2:5]) and not rows[:2].any() and not rows[5:].any()
    copied = torch.empty(ROWS, 8).copy_(out.detach())
    assert torch.equal(copied, host)
    written = torch.zeros(ROWS)
    torch.add(out[:, 0].detach(), 1.0, out=written)
    assert torch.allclose(written, host[:, 0] + 1.0)


def test_a_traced_forward_moves_to_its_device_by_index_or_name():
    """``x.to(0)`` and ``x.to("jax:0")`` inside the traced forward: torchax compared the raw
    argument with its device type and went through the host, which a traced value cannot."""

    class Moves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            h = self.net(x)
            shift = torch.ones(8).to(0) + torch.zeros(8, device=h.device) + torch.ones(8).to("jax:0")
            return (h.to(0) + h.to("jax:0") - h.to(torch.device(0)) + shift.to(0)).to("jax:0")

    engine, *_ = spmdzero.initialize(model=Moves(), config=sgd())
    x = torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = engine(x)
        expected = mlp()(x) + 2.0
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


# ---- a loss outside the module, its target moved to the device ----------------------------------

LMOutput = namedtuple("LMOutput", "logits")


class TinyLM(torch.nn.Module):
    """What ``out.logits`` comes from in a Hugging Face script."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        return LMOutput(logits=self.head(torch.tanh(self.embed(input_ids))))


TARGETS = [  # how each step's script moves its labels, given the engine and the output's logits
    ("host", lambda labels, engine, logits: labels),
    ("logits.device", lambda labels, engine, logits: labels.to(logits.device)),
    ("engine.local_rank", lambda labels, engine, logits: labels.to(engine.local_rank)),
    ("int 0", lambda labels, engine, logits: labels.to(0)),
    ("torch.device(logits.device)", lambda labels, engine, logits: labels.to(torch.device(logits.device))),
    ("get_accelerator()", lambda labels, engine, logits: labels.to(get_accelerator().device_name(engine.local_rank))),
    ("torch.tensor(device=logits.device)",
     lambda labels, engine, logits: torch.tensor(labels.tolist(), device=logits.device)),
]


@pytest.mark.slow
def test_a_loss_outside_the_module_trains_as_torch_with_its_labels_moved_to_the_device():
    """``F.cross_entropy(out.logits.view(-1, V), labels.to(out.device).view(-1))`` and
    ``engine.backward(loss)``: each step moves its labels another way; losses and parameters are
    plain torch's (SGD, fp32, no clipping), and nothing recompiles after the first step."""
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g), torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g))
            for _ in TARGETS]
    reference = TinyLM()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected = []
    for ids, labels in data:
        loss = F.cross_entropy(reference(ids).logits.view(-1, VOCAB), labels.view(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())

    engine, *_ = spmdzero.initialize(model=TinyLM(), config=sgd(stage=2))
    losses, traces = [], []
    for (ids, labels), (name, move) in zip(data, TARGETS):
        out = engine(ids.to(engine.local_rank))
        target = move(labels, engine, out.logits)
        assert target.device.type == "cpu" and target.dtype == torch.long, name
        loss = F.cross_entropy(out.logits.view(-1, VOCAB), target.view(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        traces.append(sum(engine.traces.values()))
    assert losses == pytest.approx(expected, abs=1e-5)
    for (name, p), q in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
    assert traces[1:] == traces[:1] * (len(TARGETS) - 1)  # compiled at the first step only


# ---- torch.accelerator and DataLoaders ------------------------------------------------------------

def test_torch_accelerator_answers_as_a_host_without_an_accelerator():
    """As a CUDA build of torch on a machine without GPUs answers, with the index answered."""
    assert torch.accelerator.is_available() is False
    assert torch.accelerator.current_accelerator().type == "jax"  # the device type torch was given
    assert torch.accelerator.current_accelerator(check_available=True) is None
    assert torch.accelerator.device_count() == 0
    assert torch.accelerator.current_device_index() == 0
    assert torch._C._get_accelerator() == torch.device("cpu")  # torch.distributed.barrier's lookup
    # torch holds no accelerator memory here (they hit an internal assert: "Allocator for jax is not a DeviceAllocator")
    for query in (torch.accelerator.memory_allocated, torch.accelerator.max_memory_allocated,
                  torch.accelerator.memory_reserved, torch.accelerator.memory.max_memory_reserved):
        assert query() == 0
    assert torch.accelerator.memory_stats() == {}
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    torch.accelerator.synchronize()
    torch.accelerator.set_device_index(0)  # one process drives every device: nothing to choose
    with torch.accelerator.device_index(0):
        assert torch.accelerator.current_device_index() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host with a GPU keeps torch's own CUDA calls")
def test_a_gpu_scripts_device_choice_and_memory_resets_do_nothing_without_a_gpu():
    """DeepSpeedExamples' bf16_master_weight/train.py calls ``torch.cuda.set_device(local_rank)``
    and ``torch.cuda.reset_peak_memory_stats()`` first: both raised "Found no NVIDIA driver on
    your system" (``spmdzero.runtime.cuda_calls``). Calls that ask about a GPU keep torch's error."""
    torch.cuda.set_device(0)
    torch.cuda.set_device(torch.device("cuda", 0))
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_max_memory_allocated()
    torch.cuda.reset_accumulated_memory_stats()
    assert torch.cuda.max_memory_allocated() == 0
    assert torch.cuda.current_device() == 0
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.get_device_name()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host with a GPU keeps torch's own CUDA calls")
def test_a_gpu_scripts_cuda_device_is_the_accelerator_without_a_gpu():
    """DeepSpeedExamples' GAN names ``torch.device("cuda", local_rank)`` for its modules, batches
    and noise, and calls ``torch.cuda.synchronize()`` around its timing: each raised "Found no
    NVIDIA driver" here. ``cuda`` now means the runtime's device, as ``y.to(out.device)`` does: a
    host tensor is copied on the host (a copy, as a move to a GPU is), an output stays the
    engine's, and the training equals the same script with ``device = "cpu"``."""
    device = torch.device("cuda", 0)

    def train(device):
        model = tiny_mlp().to(device)
        assert next(model.parameters()).device.type == "cpu"
        engine, *_ = spmdzero.initialize(model=model, config={
            "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        losses = []
        for x, y in batches(3, 16):
            loss = F.mse_loss(engine(x.to(device)), y.cuda() if device.type == "cuda" else y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.to(device).detach().cpu()))
        torch.cuda.synchronize()
        return losses, engine, loss

    losses, engine, loss = train(device)
    assert losses == train(torch.device("cpu"))[0]
    assert type(loss.to(device)) is type(loss) and type(loss.cuda()) is type(loss)  # an output stays
    x = torch.randn(2, 3)
    moved = x.to(device, non_blocking=True)
    assert type(moved) is torch.Tensor and moved.device.type == "cpu" and moved is not x
    assert torch.equal(moved, x) and torch.equal(x.cuda(), x)
    for made in (torch.zeros(2, device="cuda"), torch.randn(2, device=device), torch.arange(3, device="cuda:0"),
                 torch.tensor([1.0], device=device), torch.full((2,), 1.0, device=device),
                 x.new_zeros(2, device=device)):
        assert made.device.type == "cpu"
    assert x.pin_memory(device) is x


def test_pinning_a_tensor_leaves_it_on_the_host_unpinned():
    x = torch.randn(3)
    assert x.pin_memory() is x and not x.is_pinned()  # it raised "Please register PrivateUse1HooksInterface"


def test_pinned_dataloaders_load_unpinned_batches_in_a_fresh_process():
    """``DataLoader(pin_memory=True)`` (HF's Trainer default) with 0 and 2 workers (forked and
    spawned), in a process that only imported spmdzero: torch skips pinning, as without an
    accelerator. It used to raise "Please register PrivateUse1HooksInterface"."""
    out = run_python("""
        import spmdzero, torch, warnings

        def main():
            data = torch.utils.data.TensorDataset(torch.arange(16.0).view(8, 2), torch.arange(8))
            print("device", torch.device(0))
            for workers, context in ((0, None), (2, None), (2, "spawn")):
                loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True, num_workers=workers,
                                                     multiprocessing_context=context)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's "no accelerator is found" note
                    batches = [(x.sum().item(), y.tolist(), x.is_pinned(), x.device.type) for x, y in loader]
                print("loaded", workers, context, batches)

        if __name__ == "__main__":
            main()
    """, timeout=300)
    assert "device jax:0" in out  # importing spmdzero names the device: torchax is imported
    expected = [(28.0, [0, 1, 2, 3], False, "cpu"), (92.0, [4, 5, 6, 7], False, "cpu")]
    for case in ("0 None", "2 None", "2 spawn"):
        assert f"loaded {case} {expected}" in out, out


# ---- the torch_xla backend's devices are untouched ----------------------------------------------

def test_xla_devices_and_the_host_are_untouched():
    import torch_xla

    xla = torch_xla.device()
    y = torch.arange(4.0)
    assert y.to(xla).device.type == "xla" and torch.zeros(2, device=xla).device.type == "xla"
    assert torch.equal(y.to(xla).cpu(), y)
    assert y.to("cpu") is y and torch.zeros(2).device.type == "cpu"


def _writes_through_views(out: torch.Tensor) -> dict:
    """Post-processing that writes through views, as DeepSpeed-Chat's PPO step does: torch's
    answers on a host tensor, the backend's on an output."""
    rewards = -0.1 * (out - out * 0.5)
    ends = [3, 4, 5, 6, 2, 3, 4, 5]
    for j in range(ROWS):
        rewards[j, 1:ends[j]][-1] += 10.0  # a slice of a slice, then one element of it
    values = out.detach()[:, :-1]  # detach shares the values, as a slice does
    for i in range(ROWS):
        values[i, ends[i]:] = 0
    first, second = out.clone().split(4, dim=1)
    second.t()[0].mul_(3)  # through a transpose of a split
    base = out.clone()
    row = base[2]
    base[2, 0] = 7.0  # the root changes: the view made before sees it
    return {"rewards": rewards, "values": values, "out": out, "split": torch.cat([first, second], 1),
            "row": row.clone(), "base": base}


def test_writes_through_views_of_the_outputs_reach_them_as_in_torch(engine_and_output):
    """Slices, ``detach`` and ``split`` of an output alias it: a write through one reaches the
    output, and a write to the output shows in its views (they were copies: DeepSpeed-Chat's
    rewards never got their reward)."""
    engine, _ = engine_and_output
    x = torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = engine(x)
    host = torch.tensor(out.tolist())
    got, want = _writes_through_views(out), _writes_through_views(host.clone())
    for name in want:
        torch.testing.assert_close(torch.as_tensor(got[name].tolist()), want[name], atol=1e-6, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_factories_keep_torchs_device_contexts(tmp_path):
    """The factories a GPU script's ``cuda`` is answered in (``cuda_calls``) are still the ones
    ``with torch.device("meta")`` places: wrapped, they made host tensors there, and transformers
    5's ``from_pretrained`` (which builds the model on the meta device) left BERT's
    ``position_ids`` buffer uninitialized: a "index out of bounds" error, or NaN losses."""
    from transformers import BertConfig, BertForSequenceClassification

    with torch.device("meta"):
        made = [torch.arange(3), torch.tensor([1]), torch.zeros(2), torch.empty(2), torch.full((2,), 1.0),
                torch.randn(2), torch.ones_like(torch.empty(2))]
    assert [t.device.type for t in made] == ["meta"] * len(made)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    loaded = BertForSequenceClassification.from_pretrained(tmp_path)
    assert torch.equal(loaded.bert.embeddings.position_ids, torch.arange(32).expand(1, -1))
    assert not loaded.bert.embeddings.token_type_ids.any()


def test_torchscript_compiles_functions_that_call_the_factories():
    """transformers 4.57's DeBERTa-v2 scripts its position helpers with ``torch.jit.script``;
    with the factories answering for ``cuda`` (``runtime.cuda_calls``) TorchScript met Python
    wrappers and failed ("... was expected, got builtin_function_or_method")."""

    @torch.jit.script
    def positions(n: int) -> torch.Tensor:
        return torch.arange(n) + torch.zeros(n, dtype=torch.long) + torch.tensor([1])

    assert positions(3).tolist() == [1, 2, 3]
