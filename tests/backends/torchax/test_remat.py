"""Activation checkpointing on the torchax backend (spmdzero.backends.torchax.lowering.remat):
``torch.utils.checkpoint`` and Hugging Face's ``gradient_checkpointing_enable()`` rematerialize in
the traced programs (counted in the jaxpr) and train exactly as without, dropout included."""

import functools
import warnings

import jax
import numpy as np
import pytest
import torch
import torch.utils.checkpoint
import transformers
from jax._src import core as jax_core
from jax._src.ad_checkpoint import remat_p
# bound at import, before any engine exists, as user code binds it
from torch.utils.checkpoint import checkpoint as checkpoint_bound_early

import spmdzero
from spmdzero.backends.torchax.lowering import remat

from conftest import batches
from spmdzero.compat.deepspeed import checkpointing as ds_checkpointing

STEPS = 3


def remat_regions(traced) -> int:
    """``jax.checkpoint`` regions in a traced program (a ``jax.stages.Traced``), nested ones included."""
    def count(jaxpr) -> int:
        return sum((eqn.primitive is remat_p) + sum(count(sub) for sub in jax_core.jaxprs_in_params(eqn.params))
                   for eqn in jaxpr.eqns)

    return count(traced.jaxpr.jaxpr)


def host_params(engine) -> dict:
    return {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}


def assert_same_training(a, b):
    (losses_a, params_a), (losses_b, params_b) = a, b
    np.testing.assert_allclose(losses_b, losses_a, rtol=0, atol=1e-6)
    for name, value in params_a.items():
        torch.testing.assert_close(params_b[name], value, atol=1e-6, rtol=0)


# ---- Hugging Face GPT-2: gradient_checkpointing_enable() ----------------------------------------

def tiny_gpt2(checkpointing: bool, dropout: float) -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(seed))


def train_gpt2(checkpointing: bool, dropout: float, scan: bool = False, policy: str = "none", stage: int = 2):
    config = {"train_batch_size": 8, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    if scan:
        config["spmd"] = {"scan_layers": True, "remat": policy}
    engine, *_ = spmdzero.initialize(model=tiny_gpt2(checkpointing, dropout), config=config)
    losses = []
    for _ in range(STEPS):
        out = engine(input_ids=tokens(0), labels=tokens(0))  # one batch again: the loss falls
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    assert sum(engine.traces.values()) == 2  # the training forward and the update, traced once
    return engine, (losses, host_params(engine))


@pytest.fixture(scope="module", params=[0.0, 0.1], ids=["no_dropout", "dropout"])
def gpt2_runs(request):
    return {checkpointing: train_gpt2(checkpointing, request.param) for checkpointing in (False, True)}


def test_gradient_checkpointing_enable_trains_as_without(gpt2_runs):
    assert_same_training(gpt2_runs[False][1], gpt2_runs[True][1])
    losses = gpt2_runs[True][1][0]
    assert losses[-1] < losses[0]  # it trained


def test_gradient_checkpointing_enable_rematerializes_each_block(gpt2_runs):
    """One remat region per GPT-2 block in the compiled step, none without checkpointing: this fails
    if torch's checkpoint stops reaching the hook (a torch that wraps it otherwise)."""
    assert remat.hook_available()
    step = {c: engine.trace_step(input_ids=tokens(0), labels=tokens(0)).traced for c, (engine, _) in gpt2_runs.items()}
    assert remat_regions(step[False]) == 0
    # each block's forward is a region; its backward is the region's recomputation and transpose
    assert remat_regions(step[True]) >= 2


def test_the_hook_is_gone_after_the_trace():
    """Outside the engine's trace, torch's checkpoint is torch's: autograd recomputes as usual."""
    first_loss(lambda layer, x: torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False))
    hook = getattr(torch.utils.checkpoint.checkpoint.__wrapped__, "__dynamo_disable", None)
    assert getattr(hook, "__module__", None) != remat.__name__
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    expected = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, expected)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="transformers 4.x's GPT2Block returns a tuple, which spmd.scan_layers refuses")
def test_scanned_layers_with_gradient_checkpointing_train_as_without():
    """spmd.scan_layers: the block checkpoints inside the loop's body, with the body's carried key."""
    (_, without), (engine, with_) = (train_gpt2(c, dropout=0.1, scan=True) for c in (False, True))
    assert_same_training(without, with_)
    assert remat_regions(engine.trace_step(input_ids=tokens(0), labels=tokens(0)).traced) >= 1


# ---- a plain torch module calling torch.utils.checkpoint ----------------------------------------

class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down, self.drop = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width), \
            torch.nn.Dropout(0.2)

    def forward(self, x, scale=None):
        hidden = self.drop(torch.tanh(self.up(x)))
        if scale is not None:
            hidden = hidden * scale
        return x + self.down(hidden), None, {"hidden": hidden}  # nested, with None, as HF layers return


class Net(torch.nn.Module):
    """``how``: None (no checkpointing), "reentrant" (the name bound at import, positional
    arguments), "non_reentrant" (a ``functools.partial`` of the module's attribute, as transformers
    binds it, with a keyword argument for the function)."""

    def __init__(self, how, outside_loss: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.how, self.outside_loss = how, outside_loss
        self.blocks = torch.nn.ModuleList(Block(16) for _ in range(2))
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x, y=None):
        scale = torch.full((1,), 0.5)
        for block in self.blocks:
            if self.how is None:
                x, none, extra = block(x, scale=scale)
            elif self.how == "reentrant":
                x, none, extra = checkpoint_bound_early(block, x, scale, use_reentrant=True)
            elif self.how == "deepspeed":  # Megatron-style scripts: deepspeed.checkpointing.checkpoint(fn, *args)
                x, none, extra = ds_checkpointing.checkpoint(block, x, scale)
            else:
                bound = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False,
                                          preserve_rng_state=True)
                x, none, extra = bound(block, x, scale=scale)
            assert none is None and extra["hidden"].shape[-1] == 32
        out = self.head(x)
        return out if self.outside_loss else torch.nn.functional.mse_loss(out, y)


def train_net(how, outside_loss: bool = False):
    engine, *_ = spmdzero.initialize(model=Net(how, outside_loss), config={
        "train_batch_size": 16, "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    losses = []
    for x, y in batches(STEPS, 16):
        if outside_loss:  # the engine's VJP program, the loss computed from its output
            loss = torch.nn.functional.mse_loss(engine(x), y.to(engine.device))
        else:
            loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, (losses, host_params(engine))


@pytest.fixture(scope="module")
def net_runs():
    return {how: train_net(how) for how in (None, "reentrant", "non_reentrant", "deepspeed")}


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant", "deepspeed"])
def test_torch_checkpoint_trains_as_without(net_runs, how):
    assert_same_training(net_runs[None][1], net_runs[how][1])
    x, y = batches(1, 16)[0]
    assert remat_regions(net_runs[how][0].trace_step(x, y).traced) >= 2
    assert remat_regions(net_runs[None][0].trace_step(x, y).traced) == 0


def test_torch_checkpoint_in_the_vjp_program_trains_as_without():
    """The loss computed outside the module: the forward is the engine's VJP program."""
    assert_same_training(train_net(None, outside_loss=True)[1], train_net("non_reentrant", outside_loss=True)[1])


# ---- torch's arguments ----------------------------------------------------------------------------

class Calls(torch.nn.Module):
    def __init__(self, call):
        super().__init__()
        self.layer, self.call = torch.nn.Linear(4, 1), call

    def forward(self, x):
        return self.call(self.layer, x).mean()


def first_loss(call):
    engine, *_ = spmdzero.initialize(model=Calls(call), config={
        "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return engine(torch.ones(8, 4)).item()


def trained(model, **config):
    """``model`` trained STEPS SGD steps on 16-row batches by the engine (``config``: more of its
    keys); the engine and the losses."""
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **config})
    losses = []
    for x, y in batches(STEPS, 16):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


class Captured(torch.nn.Module):
    """Checkpointed blocks whose inner layer's output a forward hook keeps, and the loss reads
    after the blocks, as transformers' output capture keeps the routers' logits of a mixture of
    experts (``output_router_logits``: the load-balancing loss TRL adds)."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.checkpointed = checkpointed
        self.blocks = torch.nn.ModuleList(Block(16) for _ in range(2))
        self.head = torch.nn.Linear(16, 8)
        self.kept: list = []
        for block in self.blocks:
            block.up.register_forward_hook(lambda module, inputs, output: self.kept.append(output))

    def forward(self, x, y):
        self.kept.clear()
        for block in self.blocks:
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)[0]
            else:
                x = block(x)[0]
        return torch.nn.functional.mse_loss(self.head(x), y) + 0.1 * sum(h.square().mean() for h in self.kept)


def test_a_module_output_held_outside_the_region_is_the_regions_value():
    """Captured inside a region, the value was a tracer of the region's trace: JAX's
    UnexpectedTracerError where the loss read it, and the step ran eagerly. It compiles, trains
    as without checkpointing, and keeps its regions."""
    runs = []
    for checkpointed in (False, True):
        model = Captured(checkpointed).eval()  # no dropout: the two runs compute the same function
        engine, losses = trained(model, zero_optimization={"stage": 2}, gradient_clipping=0.0)
        assert not engine.host_reads.noted, "the step ran eagerly"
        runs.append((losses, host_params(engine)))
    assert_same_training(*runs)
    x, y = batches(1, 16)[0]
    assert remat_regions(engine.trace_step(x, y).traced) >= 2


def test_reentrant_checkpoint_refuses_keyword_arguments_as_torch_does():
    def call(layer, x):
        return torch.utils.checkpoint.checkpoint(lambda x, k: layer(x) * k, x, k=2.0, use_reentrant=True)

    with pytest.raises(ValueError, match="Unexpected keyword arguments: k"):
        first_loss(call)


def test_context_fn_is_ignored_and_said_once():
    def call(layer, x):
        return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False,
                                                 context_fn=lambda: torch.utils.checkpoint.noop_context_fn())

    remat._warned.discard("context_fn")
    with pytest.warns(UserWarning, match=r"context_fn=\.\.\.\) is ignored on the torchax backend"):
        assert np.isfinite(first_loss(call))


class Normed(torch.nn.Module):
    """Batch norm inside ``checkpoint_sequential``: its running statistics are updated in place in
    a region."""

    def __init__(self, checkpointing: bool):
        super().__init__()
        torch.manual_seed(0)
        self.checkpointing = checkpointing
        self.seq = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 8))

    def forward(self, x, y):
        if self.checkpointing:
            out = torch.utils.checkpoint.checkpoint_sequential(self.seq, 2, x, use_reentrant=False)
        else:
            out = self.seq(x)
        return torch.nn.functional.mse_loss(out, y)


def test_running_statistics_updated_in_a_region_are_updated_once():
    runs = {}
    for checkpointing in (False, True):
        engine, losses = trained(Normed(checkpointing))
        x, y = batches(1, 16)[0]
        runs[checkpointing] = engine, (losses, host_params(engine)), {
            n: b.detach().cpu().clone() for n, b in engine.module.named_buffers()}
    assert_same_training(runs[False][1], runs[True][1])
    for name, value in runs[False][2].items():
        torch.testing.assert_close(runs[True][2][name], value, atol=1e-6, rtol=0)
    assert int(runs[True][2]["seq.1.num_batches_tracked"]) == STEPS
    assert remat_regions(runs[True][0].trace_step(x, y).traced) >= 1


# ---- spmd.remat: a policy for the scanned layer stack ---------------------------------------------

@pytest.mark.slow
def test_a_remat_policy_for_the_scanned_stack_trains_as_without_and_rematerializes():
    """``"spmd": {"scan_layers": true, "remat": ...}``: "full" and "save_matmuls" put the scan's
    body under ``jax.checkpoint`` (one region, whatever the depth), "none" does not; with dropout
    on, every policy trains to the same losses and parameters (a recomputed layer draws the same
    masks)."""
    runs = {policy: train_gpt2(False, dropout=0.1, scan=True, policy=policy)
            for policy in ("none", "full", "save_matmuls")}
    for policy in ("full", "save_matmuls"):
        assert_same_training(runs["none"][1], runs[policy][1])
    regions = {policy: remat_regions(engine.trace_step(input_ids=tokens(0), labels=tokens(0)).traced)
               for policy, (engine, _) in runs.items()}
    assert regions == {"none": 0, "full": 1, "save_matmuls": 1}


@pytest.mark.slow
def test_zero_3_scanned_layers_gather_each_layer_and_train_as_zero_2():
    """At stage 3 each trip of the loop gathers its layer's weights, which the backward never gets
    saved (under "none" too: the body is then one remat region that saves all but them); the
    training is stage 2's, dropout included."""
    zero_2 = train_gpt2(False, dropout=0.1, scan=True)
    for policy in ("none", "full"):
        engine, run = train_gpt2(False, dropout=0.1, scan=True, policy=policy, stage=3)
        assert_same_training(zero_2[1], run)
        assert remat_regions(engine.trace_step(input_ids=tokens(0), labels=tokens(0)).traced) == 1


def _gathers(eqn) -> bool:
    """Whether ``eqn`` is ZeRO-3's gather of a weight (``zero3_gather.gathered``: a custom VJP
    whose body names its result ``GATHERED``)."""
    from spmdzero.backends.torchax.lowering.zero3_gather import GATHERED

    return any(inner.primitive.name == "name" and inner.params.get("name") == GATHERED
               for sub in jax_core.jaxprs_in_params(eqn.params) for inner in sub.eqns)


def region_inputs_and_gathers(traced) -> tuple:
    """Per remat region at the top of a traced program: (how many of its inputs are gathered
    weights made outside it, how many gathers it makes inside)."""
    def inside(sub) -> int:
        return sum(_gathers(eqn) + sum(inside(s) for s in jax_core.jaxprs_in_params(eqn.params)) for eqn in sub.eqns)

    found = []

    def walk(sub):
        gathered = {id(v) for eqn in sub.eqns if _gathers(eqn) for v in eqn.outvars}
        for eqn in sub.eqns:
            if eqn.primitive is remat_p:
                found.append((sum(id(v) in gathered for v in eqn.invars),
                              sum(inside(s) for s in jax_core.jaxprs_in_params(eqn.params))))
            else:
                for s in jax_core.jaxprs_in_params(eqn.params):
                    walk(s)

    walk(traced.jaxpr.jaxpr)
    return found


@pytest.mark.slow
def test_zero_3_with_gradient_checkpointing_enable_gathers_inside_each_block():
    """Hugging Face's checkpointing at stage 3: each block's region takes its weights' shards and
    gathers them inside, so the backward's recomputation gathers again and nothing keeps a whole
    weight from the forward to the backward. Gathered ahead of the module, the regions took the
    gathered weights as inputs and kept them: Llama-2-7B on v5e:4x4 needed 19.37 GiB a chip
    (docs/tpu.md). Dropout on: the training is stage 2's without checkpointing."""
    _, without = train_gpt2(False, dropout=0.1)
    engine, run = train_gpt2(True, dropout=0.1, stage=3)
    assert_same_training(without, run)
    regions = region_inputs_and_gathers(engine.trace_step(input_ids=tokens(0), labels=tokens(0)).traced)
    assert len(regions) >= 2  # the two blocks (and their recomputations)
    # no gathered weight enters a region; the gathers are inside (before: 12 entered, 0 inside)
    assert all(outside == 0 and inside > 0 for outside, inside in regions), regions


@pytest.mark.parametrize("spmd, message", [
    ({"remat": "full"}, 'remat=.full. applies to a scanned layer stack: set "scan_layers"'),
    ({"scan_layers": True, "remat": "sometimes"}, "spmd.remat"),
])
def test_a_remat_policy_without_a_scanned_stack_or_unknown_names_the_key(spmd, message):
    from spmdzero.config import parse_config
    from spmdzero.config.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_config({"train_batch_size": 8, "spmd": spmd})


def test_a_remat_policy_on_the_torch_xla_backend_says_where_it_runs():
    from spmdzero.config.errors import ConfigError

    with pytest.raises(ConfigError, match="spmd.remat='full' is implemented on the torchax backend"):
        spmdzero.initialize(model=tiny_gpt2(False, 0.0), config={
            "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "spmd": {"backend": "torch_xla", "scan_layers": True, "remat": "full"}})


def test_deepspeed_checkpointings_settings_are_named_once_as_no_ops(monkeypatch):
    """``deepspeed.checkpointing.configure``, as Megatron-style scripts call it, from the config's
    section: each setting switched on is named with its reason, once."""
    monkeypatch.setattr(ds_checkpointing, "_said", set())
    config = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                           "contiguous_memory_optimization": False, "number_checkpoints": None}}
    with pytest.warns(UserWarning) as caught:
        ds_checkpointing.configure(None, deepspeed_config=config)
    text = str(caught[0].message)
    assert "partition_activations: activations are already sharded" in text and "checkpoint_in_cpu:" in text
    assert "contiguous_checkpointing" not in text and ds_checkpointing.is_configured()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds_checkpointing.configure(None, deepspeed_config=config)  # said once


class SplitByValue(torch.nn.Module):
    """Checkpointed blocks that split their input by sizes read on the host, as Qwen2-VL's vision
    blocks split attention by ``cu_seqlens.tolist()``: the forward runs eagerly, and there the
    regions run without rematerialization, training as torch does."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.checkpointed = checkpointed
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 8)

    def block(self, layer, x):
        sizes = (x[:, 0] * 0).long() + 1  # one row each, read as torch reads it
        return torch.cat([layer(part) for part in torch.split(x, sizes.tolist())])

    def forward(self, x, y):
        for layer in self.blocks:
            x = (torch.utils.checkpoint.checkpoint(self.block, layer, x, use_reentrant=False) if self.checkpointed
                 else self.block(layer, x))
        return torch.nn.functional.mse_loss(self.head(x), y)


def test_a_checkpointed_region_that_reads_runs_eagerly_as_without():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, losses = trained(SplitByValue(True))
    _, expected = trained(SplitByValue(False))
    assert engine.host_reads.noted
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert [w for w in caught if "without rematerialization" in str(w.message)]
