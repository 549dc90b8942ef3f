"""spmd.scan_layers: the same training with the block stack scanned, and clear refusals."""

import re
import sys

import pytest
import torch
import torch_xla.debug.metrics as met

import spmdzero
from spmdzero.config import ConfigError
from spmdzero.inspect import split_computations
from spmdzero.scan import find_layer_stack

from conftest import REPO, tiny_mlp

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


def train(model, scan: bool, steps: int = 4):
    """SGD, so that parameters differ only as much as the gradients do (Adam would turn a
    rounding difference in a near-zero gradient into a step of size lr)."""
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"scan_layers": scan},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    losses, compiles = [], []
    for _ in range(steps):
        if isinstance(model, TinyGPT):
            loss = engine(tokens[:, :-1], tokens[:, 1:])
        else:
            loss = engine(input_ids=tokens[:, :-1], attention_mask=torch.ones(8, 16, dtype=torch.long),
                          labels=tokens[:, :-1]).loss
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


@pytest.mark.parametrize("make", [tiny_gpt, tiny_llama], ids=["tinygpt", "llama"])
def test_zero2_lays_out_each_block_gradient_inside_the_scanned_backward(make):
    """The per-iteration backward graph gives each block weight's gradient its ZeRO layout
    (after a replicated pin): on TPU each loop trip reduce-scatters it
    (tests/test_tpu_collectives.py). Annotated only after the loop, libtpu all-reduced it in
    every trip. Llama iterates over a slice of its layers (``self.layers[:n]``), a new list
    every forward, which must keep the layouts."""
    import torch_xla

    model = make()
    stack_name, stack = find_layer_stack(model)
    block = [n for n, _ in stack[0].named_parameters()]
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"scan_layers": True},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    if isinstance(model, TinyGPT):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
    else:
        loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
    engine.backward(loss)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(engine.grad_buffers().values()))
    layouts = [re.search(r"sharding=\{(\w+)", ins.rest).group(1)
               for name, body in split_computations(hlo).items() if name.startswith("FnComputation")
               for ins in body if ins.opcode == "custom-call" and 'custom_call_target="Sharding"' in ins.rest]
    assert all(engine.plan[f"{stack_name}.0.{n}"].grad_stages for n in block)  # all sharded on 8 devices
    assert layouts.count("replicated") == len(block)
    assert layouts.count("devices") == len(block)
    engine.zero_grad()
    model.eval()  # a slice of the stack keeps the mode: blocks run one by one
    assert list(stack[:1]) == [stack[0]]


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
            "train_batch_size": 8, "zero_optimization": {"stage": 2}, "spmd": {"scan_layers": True},
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
    from spmdzero.scan import _attention_with_float_mask_dropout

    q, k, v = (torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, 0] = True
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}, {"attn_mask": torch.where(mask, 0.0, -1e9)},
                   {"scale": 0.3, "is_causal": True}):
        torch.testing.assert_close(_attention_with_float_mask_dropout(q, k, v, **kwargs),
                                   torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs))
