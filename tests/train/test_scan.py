"""spmd.scan_layers: the same training with the block stack scanned, and clear refusals. The
first part tests the torch_xla backend's scan (its graphs, metrics and HLO); the torchax
backend's (the default) follows."""

import functools
import json
import math
import re
import sys

import numpy as np
import pytest
import torch
import torch_xla.debug.metrics as met

import spmdzero
from spmdzero.io.checkpoint_format import CheckpointError
from spmdzero.io.consolidate import consolidate
from spmdzero.config.errors import ConfigError
from spmdzero.config.load import parse_config
from spmdzero.observe.hlo import split_computations
from spmdzero.observe.monitor import graph_count
from spmdzero.sharding.plan import make_plan
from spmdzero.backends.torch_xla.scan import apply_scan_layers
from spmdzero.train.scan_layers import find_layer_stack, restack_optimizer
from spmdzero.io.restack import stacking_mismatch

from conftest import REPO, run_python, tiny_mlp

sys.path.insert(0, f"{REPO}/examples")
from model import TinyGPT  # noqa: E402


def tiny_gpt():
    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=3)


def gpt2():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=16, vocab_size=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


def tiny_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg)


def gpt2_loss(engine, tokens):
    return engine(input_ids=tokens[:, :-1], attention_mask=torch.ones(8, 16, dtype=torch.long),
                  labels=tokens[:, :-1]).loss


def train(model, scan: bool, steps: int = 4):
    """SGD, so that parameters differ only as much as the gradients do (Adam would turn a
    rounding difference in a near-zero gradient into a step of size lr)."""
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"backend": "torch_xla", "scan_layers": scan},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    losses, compiles = [], []
    for _ in range(steps):
        loss = engine(tokens[:, :-1], tokens[:, 1:]) if isinstance(model, TinyGPT) else gpt2_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss)
        compiles.append(met.metric_data("CompileTime")[0])
    params = {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
    return [l.item() for l in losses], params, compiles


@pytest.mark.parametrize("make", [tiny_gpt, pytest.param(gpt2, marks=pytest.mark.slow),
                                  pytest.param(tiny_llama, marks=pytest.mark.slow)],
                         ids=["tinygpt", "gpt2", "llama"])
def test_scanned_layers_train_like_the_loop(make):
    loop_losses, loop_params, _ = train(make(), scan=False)
    scan_losses, scan_params, compiles = train(make(), scan=True)
    assert scan_losses == pytest.approx(loop_losses, rel=1e-6)
    assert loop_params.keys() == scan_params.keys()  # same names: plan and checkpoints unchanged
    for name in loop_params:
        torch.testing.assert_close(scan_params[name], loop_params[name], rtol=1e-5, atol=1e-6)
    assert compiles[1] == compiles[-1]  # nothing compiles after the first step


@pytest.mark.parametrize("make,scan", [(tiny_gpt, True), (tiny_llama, True), (tiny_gpt, "stacked")],
                         ids=["tinygpt", "llama", "tinygpt-stacked"])
def test_zero2_lays_out_each_block_gradient_inside_the_scanned_backward(make, scan):
    """The per-iteration backward graph gives each block weight's gradient its ZeRO layout
    (after a replicated pin): on TPU each loop trip reduce-scatters it
    (tests/tpu/test_tpu_collectives.py). Annotated only after the loop, libtpu all-reduced it in
    every trip. Llama iterates over a slice of its layers (``self.layers[:n]``), a new list
    every forward, which must keep the layouts."""
    import torch_xla

    model = make()
    stack_name, stack = find_layer_stack(model)
    block, layers = [n for n, _ in stack[0].named_parameters()], len(stack)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"backend": "torch_xla", "scan_layers": scan},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    if isinstance(model, TinyGPT):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
    else:
        loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
    engine.backward(loss)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(engine.grad_buffers().values()))
    planned = [engine.plan[f"{stack_name}.{n}" if scan == "stacked" else f"{stack_name}.0.{n}"] for n in block]
    # the loop also reads the stacked weights behind their replicated constraint (scan._replicated_inputs)
    stacked = {"[" + ",".join(map(str, p.shape if scan == "stacked" else (layers, *p.shape))) + "]" for p in planned}
    calls = [(re.search(r"\[[\d,]*\]", ins.shape).group(0), re.search(r"sharding=\{(\w+)", ins.rest).group(1))
             for name, body in split_computations(hlo).items() if name.startswith("FnComputation")
             for ins in body if ins.opcode == "custom-call" and 'custom_call_target="Sharding"' in ins.rest]
    assert {layout for shape, layout in calls if shape in stacked} == {"replicated"}
    layouts = [layout for shape, layout in calls if shape not in stacked]
    assert all(p.grad_stages for p in planned)  # all sharded on 8 devices
    assert layouts.count("replicated") == len(block)
    assert layouts.count("devices") == len(block)
    engine.zero_grad()
    model.eval()  # a slice of the stack keeps the mode: blocks run one by one
    assert list(stack[:1]) == [stack[0]]


@pytest.mark.parametrize("scan", [True, "stacked"])
def test_the_loop_keeps_no_copy_of_the_weights_for_the_backward(scan, monkeypatch):
    """What the scanned forward saves for its backward: each layer's weights are the loop's
    own inputs (torch_xla's scan then reads them from the stacks), not views of them (an
    ``nn.Linear``'s transpose), which the loop would copy into a second stack every trip: a
    copy of every weight (8.9 GiB per chip for a 7B on v5p-64)."""
    import torch_xla.experimental.scan as torch_xla_scan

    seen = []
    find = torch_xla_scan._find_input_activation_aliases

    def recording(carry, xs, num_out, fwd_graph):
        aliases = find(carry, xs, num_out, fwd_graph)
        seen.append(([tuple(x.shape) for x in torch.utils._pytree.tree_leaves(xs)], aliases))
        return aliases

    monkeypatch.setattr(torch_xla_scan, "_find_input_activation_aliases", recording)
    model = tiny_llama()
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"backend": "torch_xla", "scan_layers": scan},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss)
    engine.step()
    (shapes, aliases), = seen
    matrices = [i for i, shape in enumerate(shapes) if shape in {(32, 32), (64, 32), (32, 64)}]  # q, k, v, o, MLP
    assert len(matrices) == 7
    assert set(matrices) <= set(aliases), f"weights saved as copies: {[shapes[i] for i in matrices if i not in aliases]}"


def test_the_stack_found_is_the_block_list():
    assert find_layer_stack(tiny_gpt())[0] == "blocks"
    assert find_layer_stack(gpt2())[0] == "transformer.h"


def test_models_without_identical_blocks_are_refused_by_name():
    with pytest.raises(ConfigError, match="Sequential has no nn.ModuleList of two or more identical blocks"):
        find_layer_stack(tiny_mlp())
    model = gpt2()
    model.config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(ConfigError, match="GPT2LMHeadModel mixes layer types"):
        find_layer_stack(model)


def test_a_scanned_run_saves_and_resumes(tmp_path):
    """scan_layers imports torchax, which registers a device module that DCP's default
    overlapping host copy cannot drive; the checkpoint must not depend on it."""
    def make():
        engine, *_ = spmdzero.initialize(model=tiny_gpt(), config={
            "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"backend": "torch_xla", "scan_layers": True},
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
        return engine

    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(2))
    engine = make()
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    engine.save_checkpoint(str(tmp_path), tag="one")
    resumed = make()
    resumed.load_checkpoint(str(tmp_path), tag="one")
    assert resumed.global_steps == 1
    for (name, p), q in zip(engine.module.named_parameters(), resumed.module.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach().cpu(), msg=name)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gpt2_with_its_default_dropout_scans(attention):
    """torch's dropout saves a boolean mask that torch_xla's scan cannot stack; transformers'
    GPT-2 drops out by default (0.1), in attention too."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                                  attn_implementation=attention)
    assert cfg.attn_pdrop > 0 and cfg.resid_pdrop > 0
    _, params, compiles = train(transformers.GPT2LMHeadModel(cfg), scan=True, steps=3)
    assert all(torch.isfinite(p).all() for p in params.values())
    assert compiles[1] == compiles[-1]


def test_attention_written_out_matches_torch():
    from spmdzero.backends.torch_xla.scan import _attention_with_float_mask_dropout

    q, k, v = (torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, 0] = True
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}, {"attn_mask": torch.where(mask, 0.0, -1e9)},
                   {"scale": 0.3, "is_causal": True}):
        torch.testing.assert_close(_attention_with_float_mask_dropout(q, k, v, **kwargs),
                                   torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs))


# ---- "spmd": {"scan_layers": "stacked"}: one parameter [layers, ...] per block parameter name ----

def stacked_gpt2():
    model = gpt2()
    return model, apply_scan_layers(model, "stacked")


def unstacked(params: dict, stack: str = "transformer.h") -> dict:
    """Per-layer tensors under per-layer names, from stacked ones."""
    out = {}
    for name, value in params.items():
        if name.startswith(f"{stack}.") and not name[len(stack) + 1].isdigit():
            out.update({f"{stack}.{i}.{name[len(stack) + 1:]}": layer for i, layer in enumerate(value)})
        else:
            out[name] = value
    return out


def test_the_plan_never_splits_the_layer_dim_of_a_stacked_parameter():
    shapes = [("h.w", (12, 64, 256)), ("h.b", (12, 4)), ("h.tall", (64, 16)), ("tall", (64, 16))]
    stacked = ["h.w", "h.b", "h.tall"]
    plan = make_plan(shapes, {"fsdp": 8}, 2, stacked=stacked)
    assert plan["h.w"].grad == plan["h.w"].optimizer_state == (None, None, "fsdp")
    assert plan["h.w"].layer_grad_layouts == ((None, None), (None, "fsdp"))  # one layer's, in the loop
    assert plan["h.b"].grad == (None, None)  # 4 per layer: too small to split, whatever the layer count
    assert plan["h.tall"].grad == (None, "fsdp")  # the layer dim is the largest, and still not split
    assert plan["tall"].grad == ("fsdp", None)  # the same shape unstacked splits its rows
    assert all(t.param == (None,) * len(t.shape) for t in plan.tensors)
    two_axes = make_plan(shapes, {"fsdp": 4, "fsdp_inner": 2}, 2, stacked=stacked)
    assert two_axes["h.w"].grad_stages == ((None, "fsdp", None), (None, "fsdp", "fsdp_inner"))
    assert two_axes["h.w"].layer_grad_layouts == (("fsdp", None), ("fsdp", "fsdp_inner"))
    assert make_plan(shapes, {"fsdp": 8}, 1, stacked=stacked)["h.tall"].optimizer_state == (None, "fsdp")
    with pytest.raises(ValueError, match="tall is not a stacked parameter"):
        plan["tall"].layer_grad_layouts


def test_stacked_parameters_replace_the_per_layer_ones_under_block_names():
    model, _ = stacked_gpt2()
    stack = model.transformer.h
    names = dict(model.named_parameters())
    assert names["transformer.h.attn.c_attn.weight"].shape == (3, 32, 96)
    assert model.get_parameter("transformer.h.attn.c_attn.weight") is model.transformer.h.attn.c_attn.weight
    assert not any(n.startswith("transformer.h.0.") for n in names)
    assert len(names) == 4 + 12  # embeddings and final norm, 12 block names
    assert len(stack) == 3 and isinstance(stack[1], type(gpt2().transformer.h[0]))
    assert list(stack[1].parameters()) == []  # a block lends its slices for a call only
    hidden = torch.randn(2, 5, 32)
    reference = gpt2().transformer.h[1]
    torch.testing.assert_close(stack[1](hidden)[0], reference(hidden)[0])
    assert list(stack[1].parameters()) == []
    fresh, _ = stacked_gpt2()  # strict load_state_dict by the stacked names
    fresh.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})
    torch.testing.assert_close(fresh.transformer.h.ln_1.bias, model.transformer.h.ln_1.bias + 1)
    with pytest.raises(RuntimeError, match="Missing key.*transformer.h.ln_1.weight"):
        fresh.load_state_dict(gpt2().state_dict())


def test_a_stacked_model_evaluates_and_generates_like_the_loop():
    """Out of training the blocks run one by one, each with its layer's slices: transformers'
    KV cache (per-layer ``layer_idx``) works as before."""
    model, reference = stacked_gpt2()[0].eval(), gpt2().eval()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
        kwargs = dict(max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def decay_groups(model) -> list[dict]:
    """Weight decay by name, as DeepSpeed examples group it."""
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if "bias" in n or "ln_" in n]
    return [{"params": [p for n, p in named if not ("bias" in n or "ln_" in n)], "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0}]


def test_a_client_optimizer_built_on_per_layer_parameters_updates_the_stacked_ones():
    model = gpt2()
    optimizer = torch.optim.AdamW(decay_groups(model), lr=1e-3)
    restack_optimizer(optimizer, apply_scan_layers(model, "stacked"))
    names = {id(p): n for n, p in model.named_parameters()}
    grouped = [{names[id(p)] for p in g["params"]} for g in optimizer.param_groups]
    assert grouped == [{names[id(p)] for p in g["params"]} for g in decay_groups(model)]  # same rule, stacked names
    assert "transformer.h.attn.c_attn.weight" in grouped[0] and "transformer.h.ln_1.weight" in grouped[1]
    assert sum(len(g) for g in grouped) == len(names)


def test_optimizer_groups_that_split_the_layers_of_a_name_are_refused():
    model = gpt2()
    by_layer = torch.optim.SGD([{"params": model.transformer.h[0].parameters(), "lr": 0.1},
                                {"params": [p for n, p in model.named_parameters() if not n.startswith("transformer.h.0.")]}],
                               lr=0.01)
    with pytest.raises(ConfigError, match=r"layers of 'transformer.h.ln_1.weight' in param groups 0 and 1"):
        restack_optimizer(by_layer, apply_scan_layers(model, "stacked"))
    model = gpt2()
    first_layer_only = torch.optim.SGD(model.transformer.h[0].parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"only some layers of 'transformer.h.ln_1.weight' \(layers \[1, 2\]"):
        restack_optimizer(first_layer_only, apply_scan_layers(model, "stacked"))


def test_scan_layers_takes_true_false_or_stacked():
    assert parse_config({"train_batch_size": 8, "spmd": {"backend": "torch_xla", "scan_layers": "stacked"}}).spmd.scan_layers == "stacked"
    for bad in ("yes", 1, "Stacked"):
        with pytest.raises(ConfigError, match=r'spmd.scan_layers: .*must be true, false or "stacked"'):
            parse_config({"train_batch_size": 8, "spmd": {"scan_layers": bad}})


def train_gpt2(scan, steps: int = 3):
    """A client optimizer built before initialize with weight decay grouped by name."""
    model = gpt2()
    optimizer = torch.optim.SGD(decay_groups(model), lr=0.1)
    engine, *_ = spmdzero.initialize(model=model, optimizer=optimizer, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"backend": "torch_xla", "scan_layers": scan}})
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    losses, compiles, graphs, traced = [], [], [], []
    for _ in range(steps):
        loss = gpt2_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss)
        compiles.append(met.metric_data("CompileTime")[0])
        graphs.append(graph_count())
        traced.append(list(engine.module.transformer.h.__dict__.get("_scan_fns", {}).values()))
    assert graphs[-1] - graphs[-2] == 1  # one graph per step: nothing read back to the host
    assert traced[0] == traced[-1]  # one layer function, whose traced graphs torch_xla's scan reuses
    engine.module.eval()
    with torch.no_grad():
        logits = engine(input_ids=tokens[:, :-1]).logits.cpu()
    params = {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
    return [l.item() for l in losses], params, compiles, logits


def test_stacked_layers_train_like_the_loop():
    loop_losses, loop_params, _, loop_logits = train_gpt2(False)
    losses, params, compiles, logits = train_gpt2("stacked")
    assert losses == pytest.approx(loop_losses, rel=1e-5)
    assert "transformer.h.mlp.c_fc.weight" in params
    params = unstacked(params)
    assert params.keys() == loop_params.keys()
    for name in loop_params:
        torch.testing.assert_close(params[name], loop_params[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, loop_logits, rtol=1e-5, atol=1e-5)  # eval: the blocks one by one
    assert compiles[1] == compiles[-1]  # nothing compiles after the first step


@pytest.mark.slow
def test_stacked_and_per_layer_scans_train_alike():
    scan_losses, scan_params, _, _ = train_gpt2(True)
    losses, params, _, _ = train_gpt2("stacked")
    assert losses == pytest.approx(scan_losses, rel=1e-5)
    params = unstacked(params)
    for name in scan_params:
        torch.testing.assert_close(params[name], scan_params[name], rtol=1e-5, atol=1e-6)


def adamw_tiny_gpt(scan="stacked", bf16: bool = False):
    engine, *_ = spmdzero.initialize(model=tiny_gpt(), config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"backend": "torch_xla", "scan_layers": scan},
        "bf16": {"enabled": bf16}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}})
    return engine


def train_step(engine, seed: int) -> float:
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(seed))
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_a_stacked_run_resumes_exactly_and_its_checkpoint_loads_into_per_layer_engines(tmp_path):
    make = adamw_tiny_gpt
    engine = make()
    assert engine.plan["blocks.qkv.weight"].shape[0] == 3
    train_step(engine, 2)
    engine.save_checkpoint(str(tmp_path), tag="one")
    after = [train_step(engine, 3), train_step(engine, 4)]
    resumed = make()
    resumed.load_checkpoint(str(tmp_path), tag="one")
    assert resumed.global_steps == 1
    assert [train_step(resumed, 3), train_step(resumed, 4)] == after
    for (name, p), q in zip(engine.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(q.detach().cpu(), p.detach().cpu()), name
    consolidate(str(tmp_path), str(tmp_path / "plain.pt"), tag="one")
    plain = tiny_gpt()
    plain.load_state_dict(torch.load(tmp_path / "plain.pt"))  # strict: the per-layer names again
    resumed.load_checkpoint(str(tmp_path), tag="one")
    saved = unstacked({n: p.detach().cpu() for n, p in resumed.module.named_parameters()}, stack="blocks")
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name
    # the other settings take each layer's slice of the stacks (spmdzero.io.restack), optimizer
    # states included, and train on as the stacked run does
    for scan in (True, False):
        per_layer = make(scan=scan)
        per_layer.load_checkpoint(str(tmp_path), tag="one")
        assert per_layer.global_steps == 1
        assert [train_step(per_layer, 3), train_step(per_layer, 4)] == pytest.approx(after, rel=1e-5)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_per_layer_checkpoint_loads_into_a_stacked_engine(tmp_path, bf16):
    """A run switches to stacked parameters between a save and a load: each stacked
    parameter, fp32 master and optimizer state is its layers' saved tensors, stacked."""
    def make(scan):
        return adamw_tiny_gpt(scan, bf16)

    def saved_state(engine):
        return {key: tensor.detach().cpu().clone() for key, (tensor, _) in engine.state_tensors().items()}

    plain = make(False)
    train_step(plain, 2)
    plain.save_checkpoint(str(tmp_path), tag="plain")
    at_save = saved_state(plain)
    after = [train_step(plain, 3), train_step(plain, 4)]
    stacked = make("stacked")
    stacked.load_checkpoint(str(tmp_path), tag="plain")
    assert stacked.global_steps == 1
    loaded = saved_state(stacked)
    keys = ["model.blocks.qkv.weight", "optim.blocks.qkv.weight.exp_avg", "optim.blocks.qkv.weight.exp_avg_sq"]
    assert ("master.blocks.qkv.weight" in loaded) == bf16
    for key in keys + ["master.blocks.qkv.weight"] * bf16:
        assert torch.equal(loaded[key], torch.stack([at_save[key.replace("blocks.", f"blocks.{i}.", 1)]
                                                     for i in range(3)])), key
    assert torch.equal(loaded["optim.blocks.qkv.weight.step"], at_save["optim.blocks.0.qkv.weight.step"])
    assert torch.equal(loaded["model.head.weight"], at_save["model.head.weight"])
    assert [train_step(stacked, 3), train_step(stacked, 4)] == pytest.approx(after, rel=1e-2 if bf16 else 1e-5)
    if bf16:
        return
    # a checkpoint with fewer layers than the stack is refused, and says why
    torch.manual_seed(0)
    deeper, *_ = spmdzero.initialize(model=TinyGPT(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=4),
                                     config={"train_batch_size": 8, "zero_optimization": {"stage": 2},
                                             "spmd": {"backend": "torch_xla", "scan_layers": "stacked"}})
    with pytest.raises(CheckpointError, match="missing keys .*model.blocks.qkv.weight.*not every layer"):
        deeper.load_checkpoint(str(tmp_path), tag="plain", load_optimizer_states=False)


STACKED_ON_TPU = """
    import json, torch, spmdzero
    from transformers import GPT2Config, GPT2LMHeadModel
    from spmdzero.tpu.report import CollectivesReport
    from spmdzero.tpu.capture import capture
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_positions=64, n_embd=256, n_layer=3, n_head=4))
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "spmd": {"backend": "torch_xla", "scan_layers": "stacked"}})
    tokens = torch.randint(0, 2048, (8, 64))
    with capture(engine) as step:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        step.loss = loss
        engine.step()
    report = step.compile("v5e:2x2")
    P = sum(p.numel() for p in model.parameters())
    print(json.dumps({"loops": report.loops, "ratio": CollectivesReport(4, report.collectives, 4 * P).ratio,
                      "all_reduced": report.all_reduced_gradients(), "collectives": report.collectives,
                      "stacked": {n: p.numel() for n, p in model.named_parameters() if p.dim() == 3}}))
"""


@pytest.mark.slow
def test_libtpu_reduce_scatters_stacked_gradients_inside_the_loop():
    """The TPU compiler (libtpu, compile-only) on v5e:2x2: each layer's slice of a stacked
    matrix is reduce-scattered in its loop trip (the plan's layout without the layer dim), no
    gradient is all-reduced, and the traffic stays at the data-parallel minimum."""
    out = run_python(STACKED_ON_TPU, env={"CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU",
                                          "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
    got = json.loads(out.strip().splitlines()[-1])
    assert got["loops"] == [3, 3]  # the forward's loop and the backward's
    assert got["all_reduced"] == []
    assert got["ratio"] <= 1.05
    # every layer's slice of every stacked matrix, each a quarter per chip
    assert got["collectives"]["reduce-scatter"]["bytes"] * 4 == pytest.approx(4 * sum(got["stacked"].values()) +
                                                                             4 * 2048 * 256, rel=0.02)


def test_a_checkpoint_mismatch_by_stacking_alone_is_named():
    per_layer = ["model.transformer.h.0.ln_1.weight", "model.transformer.h.1.ln_1.weight"]
    stacked = ["model.transformer.h.ln_1.weight"]
    assert "this model stacks them" in stacking_mismatch(missing=stacked, unexpected=per_layer)
    assert "this model has per-layer ones" in stacking_mismatch(missing=per_layer, unexpected=stacked)
    assert stacking_mismatch(missing=["model.head.weight"], unexpected=["model.lm_head.weight"]) == ""


# ---- the torchax backend: the stack as one jax.lax.scan (spmdzero.backends.torchax.engine.scan) ----

CLIP = 0.05  # below the gradients' norm: clipping applies at every step


def torchax_config(scan, backend: str = "torchax") -> dict:
    return {"train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 2}, "spmd": {"backend": backend, "scan_layers": scan}}


def train_either(make, scan, backend: str = "torchax", steps: int = 2):
    """``steps`` optimizer steps of 2 micro-steps on ``backend``: SGD from the config for
    TinyGPT, a client torch.optim.SGD built on the per-layer parameters (weight decay grouped
    by name, restacked by initialize) for the transformers models. Returns (losses, per-layer
    parameters, training traces after each step, eval logits, engine)."""
    model = make()
    config, kwargs = torchax_config(scan, backend), {}
    if isinstance(model, TinyGPT):
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    else:
        kwargs["optimizer"] = torch.optim.SGD(decay_groups(model), lr=0.1)
    engine, *_ = spmdzero.initialize(model=model, config=config, **kwargs)
    stack = find_layer_stack(model)[0]
    generator = torch.Generator().manual_seed(1)
    losses, traces = [], []
    for _ in range(2 * steps):
        tokens = torch.randint(0, 64, (8, 17), generator=generator)
        loss = engine(tokens[:, :-1], tokens[:, 1:]) if isinstance(model, TinyGPT) else gpt2_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        traces.append(sum(n for kind, n in engine.traces.items() if kind != "forward") if backend == "torchax" else 0)
    assert engine.get_global_grad_norm() > CLIP
    engine.eval()  # the blocks one by one, each with its layer's slices when stacked
    with torch.no_grad():
        logits = engine(tokens[:, :-1], tokens[:, 1:]) if isinstance(model, TinyGPT) else \
            engine(input_ids=tokens[:, :-1]).logits
    params = unstacked({n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}, stack)
    return losses, params, traces, logits.cpu(), engine


@functools.lru_cache(maxsize=None)
def unrolled_on_torchax(make):
    return train_either(make, False)[:4]


@pytest.mark.slow
@pytest.mark.parametrize("make,scan", [(tiny_gpt, True), (tiny_gpt, "stacked"), (gpt2, "stacked")],
                         ids=["tinygpt", "tinygpt-stacked", "gpt2-stacked"])
def test_torchax_scanned_layers_train_like_its_loop_and_like_torch_xlas_scan(make, scan):
    """Gradient accumulation 2, clipping, ZeRO-2, fp32: the losses, parameters and eval logits
    of torch_xla's scan with the same setting, and (TinyGPT) of the unrolled torchax run. The
    training programs are traced at the first two micro-steps (without, then with accumulated
    gradients) and never again."""
    losses, params, traces, logits, engine = train_either(make, scan)
    assert traces[1] == traces[-1]
    assert bool(engine.stacked_layers()) == (scan == "stacked")
    assert all(engine.plan[name].stacked for name in engine.stacked_layers())
    references = [train_either(make, scan, backend="torch_xla")[:4]]
    if make is tiny_gpt:
        references.append(unrolled_on_torchax(make))
    for ref_losses, ref_params, _, ref_logits in references:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert params.keys() == ref_params.keys()
        for name in ref_params:
            torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_torchax_llama_scans_the_slice_of_its_stack_like_its_loop():
    """Llama iterates over ``self.layers[: config.num_hidden_layers]``, a new list every forward,
    whose stacked weights are slices of the traced parameters: one training forward's loss and
    gradients are the unrolled run's, and so are those of the same loss computed outside the
    module from the logits (the VJP program and the compiled backward, through the loop)."""
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    ids = tokens[:, :-1]
    results = []
    for scan, outside in ((False, False), ("stacked", False), ("stacked", True)):
        engine, *_ = spmdzero.initialize(model=tiny_llama(), config={
            "train_batch_size": 8, "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "spmd": {"backend": "torchax", "scan_layers": scan}})
        if outside:  # what transformers' causal LM loss computes from the labels
            logits = engine(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
        else:
            loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        grads = {name: torch.from_numpy(np.array(g)) for name, g in engine.accumulated_gradients().items()}
        results.append((loss.item(), unstacked(grads, stack="model.layers")))
    (loop_loss, loop_grads), *scanned = results
    for loss, grads in scanned:
        assert loss == pytest.approx(loop_loss, rel=1e-6)
        assert grads.keys() == loop_grads.keys()
        for name in loop_grads:
            torch.testing.assert_close(grads[name], loop_grads[name], rtol=1e-5, atol=1e-6)


def lowered_training_program(model, scan, monkeypatch, steps: int = 1):
    """The training program of ``model`` on torchax with ``scan``, as JAX lowered it (the
    engine's ``jax.jit`` recorded: its first call's arguments lowered), after ``steps``
    optimizer steps."""
    import jax

    jit, lowered = jax.jit, []

    def recording(fn, *args, **kwargs):
        jitted = jit(fn, *args, **kwargs)
        if getattr(fn, "__name__", "") != "program_train":
            return jitted

        def call(*inputs):
            if not lowered:
                lowered.append(jitted.lower(*inputs))
            return jitted(*inputs)

        return call

    monkeypatch.setattr(jax, "jit", recording)
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "spmd": {"backend": "torchax", "scan_layers": scan}})
    tokens = torch.randint(0, model.tok.num_embeddings, (8, model.pos.num_embeddings + 1),
                           generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    monkeypatch.undo()
    return lowered[0], engine


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    """JAX's partitioner for the test: Shardy (JAX's default) or GSPMD (what torch_xla switches
    JAX to, process-wide, when it first calls JAX: after a torch_xla scan, for one)."""
    import jax

    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", before)


def small_tiny_gpt(layers: int) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=layers)


def shape_text(shape) -> str:
    return f"f32[{','.join(map(str, shape))}]"


@pytest.mark.slow
def test_the_torchax_stacked_program_is_one_loop_whatever_the_depth(monkeypatch):
    """The block is traced once, into a forward and a backward loop: the program lowered and
    compiled at 4 layers is the one at 2."""
    sizes = {}
    for layers in (2, 4):
        lowered, _ = lowered_training_program(small_tiny_gpt(layers), "stacked", monkeypatch)
        text, compiled = lowered.as_text(), lowered.compile().as_text()
        assert text.count("stablehlo.while") == 2  # the forward's loop and the backward's
        sizes[layers] = (len(text.splitlines()), len(compiled.splitlines()))
    assert sizes[2] == sizes[4]


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, "stacked"])
def test_torchax_zero2_reduces_each_layers_gradient_in_its_loop_trip(scan, partitioner, monkeypatch):
    """XLA:CPU's program, under either partitioner: the backward loop carries each stacked
    gradient sharded by the plan, and each trip reduces its layer's weight gradients into
    their shards (all-reduce, then the device's slice: what TPU compiles to a reduce-scatter),
    and nothing else: under GSPMD, without the layouts inside the loop
    (``backends/torchax/engine/scan.py``), it all-gathered the activations instead. Nothing
    all-reduces a whole [layers, ...] gradient."""
    layers = 2
    lowered, engine = lowered_training_program(small_tiny_gpt(layers), scan, monkeypatch)
    comps = split_computations(lowered.compile().as_text())
    loops = [ins for ins in comps["ENTRY"] if ins.opcode == "while"]
    assert len(loops) == 2
    bodies = [comps[re.search(r"body=%([\w.\-]+)", ins.rest).group(1)] for ins in loops]
    moved = [{ins.shape.split("{")[0] for ins in body if ins.opcode.startswith(("all-", "collective-permute"))}
             for body in bodies]
    backward = max(range(len(loops)), key=lambda i: len(moved[i]))
    assert not moved[1 - backward]  # the forward loop moves nothing: the weights are replicated
    everywhere = {ins.shape.split("{")[0] for body in comps.values() for ins in body
                  if ins.opcode.startswith("all-reduce")}
    stack, _ = find_layer_stack(engine.module)
    names = [n for n, _ in engine.module.named_parameters() if n.startswith(f"{stack}.")]
    one_layer = {}
    for name in names:  # each block parameter once, by its plan (the stacked one, or layer 0's)
        if scan == "stacked" or name.startswith(f"{stack}.0."):
            planned = engine.plan[name]
            shape = planned.shape[1:] if scan == "stacked" else planned.shape
            one_layer[name] = (shape, planned.grad[1:] if scan == "stacked" else planned.grad)
    assert len(one_layer) == 12  # two norms, qkv, proj, the MLP's two linears: weights and biases
    layer_shapes = {shape_text(shape) for shape, _ in one_layer.values()}
    layer_shapes |= {shape_text(tuple(reversed(shape))) for shape, _ in one_layer.values()}  # transposed
    assert moved[backward] <= layer_shapes  # only gradients, no activation
    for name, (shape, grad) in one_layer.items():
        assert any(axis is not None for axis in grad), name  # all split on 8 devices
        local = [size // 8 if axis else size for size, axis in zip(shape, grad)]
        assert shape_text((layers, *local)) in loops[backward].shape, name  # the sharded accumulator
        assert shape_text((layers, *shape)) not in everywhere, name


@pytest.mark.slow
def test_libtpu_reduce_scatters_torchax_stacked_gradients_inside_the_loop(partitioner, monkeypatch):
    """The TPU compiler (libtpu, compile-only) on v5e:2x4 with the torchax backend's stacked
    program: each layer's slice of every stacked parameter, and the head, is reduce-scattered
    (an eighth of its bytes per chip), the stacked ones in the backward's layer loop, once per
    trip; no gradient is all-reduced (the embedding tables' are computed on their shards from
    the gathered token ids)."""
    from spmdzero.tpu.capture import compile_mlir

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=2048, seq_len=64, d_model=256, n_heads=4, n_layers=3)
    lowered, engine = lowered_training_program(model, "stacked", monkeypatch)
    report = compile_mlir(lowered.as_text(), "v5e:2x4")
    P = sum(p.numel() for p in model.parameters())
    stacked = sum(math.prod(engine.plan[name].shape) for name in engine.stacked_layers())
    assert report["loops"].count(3) >= 2  # the forward's layer loop and the backward's
    assert report["all_reduces"] == []
    collectives = report["collectives"]
    assert collectives["reduce-scatter"]["bytes"] * 8 == pytest.approx(4 * stacked + 4 * 2048 * 256, rel=0.02)
    assert collectives["reduce-scatter"]["count"] > 3  # one per trip of the backward's loop, and the head's
    assert collectives.get("all-reduce", {}).get("bytes", 0) < 0.01 * 4 * P


def adamw_tiny_gpt_on(backend: str, scan):
    engine, *_ = spmdzero.initialize(model=tiny_gpt(), config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"backend": backend, "scan_layers": scan},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}})
    return engine


@pytest.mark.slow
def test_stacked_checkpoints_load_across_the_backends(tmp_path):
    """A stacked run saved on torch_xla resumes on torchax, stacked, and the torchax run's
    checkpoint resumes on torch_xla and on a torchax run with per-layer parameters (each
    layer its slice of the stacks, optimizer states included): all train on as the first."""
    xla = adamw_tiny_gpt_on("torch_xla", "stacked")
    train_step(xla, 2)
    xla.save_checkpoint(str(tmp_path), tag="xla")
    after = [train_step(xla, 3), train_step(xla, 4)]
    tax = adamw_tiny_gpt_on("torchax", "stacked")
    tax.load_checkpoint(str(tmp_path), tag="xla")
    assert tax.global_steps == 1
    assert train_step(tax, 3) == pytest.approx(after[0], rel=1e-5)
    tax.save_checkpoint(str(tmp_path), tag="torchax")
    xla.load_checkpoint(str(tmp_path), tag="torchax")
    per_layer = adamw_tiny_gpt_on("torchax", False)
    per_layer.load_checkpoint(str(tmp_path), tag="torchax")
    for engine in (tax, xla, per_layer):
        assert engine.global_steps == 2
        assert train_step(engine, 4) == pytest.approx(after[1], rel=1e-5)


class Dropping(torch.nn.Module):
    """A block that scales and drops out: what comes out of a stack of them shows which masks
    the layers drew."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(width))
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x * self.scale)


class DroppingStack(torch.nn.Module):
    def __init__(self, layers: int = 4, width: int = 256):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Dropping(width) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return {"loss": x.mean(), "out": x}


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, "stacked"])
def test_torchax_dropout_in_the_loop_draws_a_new_mask_per_layer_and_step(scan):
    """The key dropout draws from is carried through the loop: four layers at p=0.5 keep an
    element with probability 1/16 (the same mask in every layer would keep half), scaled by
    2**4; the next micro-step draws other masks; torchax's environment holds no traced key
    after the loop."""
    import jax
    import torchax

    engine, *_ = spmdzero.initialize(model=DroppingStack(), config={
        "train_batch_size": 16, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "spmd": {"backend": "torchax", "scan_layers": scan}})
    x = torch.ones(8, 256)
    outs = []
    for _ in range(2):
        result = engine(x)
        engine.backward(result["loss"])
        engine.step()
        outs.append(result["out"].cpu())
    for out in outs:
        assert set(out.unique().tolist()) == {0.0, 16.0}
        assert 0.91 < (out == 0).float().mean().item() < 0.965
    assert not torch.equal(outs[0], outs[1])
    assert not isinstance(torchax.default_env().prng_key, jax.core.Tracer)


def test_a_model_without_identical_blocks_is_refused_alike_on_both_backends():
    messages = []
    for backend in ("torch_xla", "torchax"):
        with pytest.raises(ConfigError) as refused:
            spmdzero.initialize(model=tiny_mlp(), config={
                "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "spmd": {"backend": backend, "scan_layers": "stacked"}})
        messages.append(str(refused.value))
    assert messages[0] == messages[1]
    assert "spmd.scan_layers: Sequential has no nn.ModuleList of two or more identical blocks" in messages[0]


class _TupleBlock(torch.nn.Module):
    """A block returning ``(hidden,)`` and Nones, as transformers 4.x's GPT-2, OPT, Phi and
    GPT-NeoX blocks do; ``extra``: something else after it (attention weights)."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.linear, self.extra = torch.nn.Linear(16, 16), extra

    def forward(self, x):
        y = x + torch.tanh(self.linear(x))
        return (y, y.sum()) if self.extra else (y, None)


class _TupleModel(torch.nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_TupleBlock(extra) for _ in range(3))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        for block in self.blocks:
            outputs = block(x)
            x = outputs[0]  # as transformers 4.x's models take it
        return ((self.head(x) - y) ** 2).mean()


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_blocks_returning_a_tuple_of_the_hidden_state_and_nones_scan(backend):
    """transformers 4.x's GPT-2 blocks return ``(hidden_states,)``: the loop hands its result
    back in that form, and training matches the unscanned loop's (3 SGD steps). A block that
    returns more than the hidden state is refused by name."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(3))
    runs = {}
    for scan in (False, True):
        engine, *_ = spmdzero.initialize(model=_TupleModel(), config={
            "train_batch_size": 8, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "spmd": {"backend": backend, "scan_layers": scan}})
        losses = []
        for _ in range(3):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[scan] = losses, {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-6)
    for name, value in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], value, rtol=1e-5, atol=1e-6)
    engine, *_ = spmdzero.initialize(model=_TupleModel(extra=True), config={
        "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "spmd": {"backend": backend, "scan_layers": True}})
    with pytest.raises(TypeError, match=r"_TupleBlock returns tuple with more than the hidden state"):
        engine.backward(engine(x, y))
