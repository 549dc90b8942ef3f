"""Mixtures of experts on the torchax backend: each chip routes its own rows (``moe_rows``), and
on TPU the experts' grouped matmuls are Pallas's megablox kernel. The zoo
(``test_transformers_zoo``) checks that such models train as in torch."""

import json

import numpy as np
import pytest

from conftest import aot_json, run_python

MIXTRAL = """
    import json, torch, spmdzero, transformers
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(config)
    engine, *_ = spmdzero.initialize(model=model, config={"train_batch_size": 8, "zero_optimization": {"stage": 2},
                                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    ids = torch.randint(0, 256, (8, 64))
    report = engine.collectives_report(input_ids=ids, labels=ids)
    print(json.dumps({"collectives": report.collectives, "ratio": report.total_traffic / report.minimum_traffic,
                      "experts": engine.expert_matmuls.describe()}))
"""


@pytest.mark.parametrize("transformers_4", [False, True], ids=["5.x", "4.x"])
def test_each_chip_sorts_and_multiplies_its_own_tokens_pairs(transformers_4):
    """A Mixtral's step at ZeRO-2 on 8 devices sends what a dense model's does: the gradients
    reduce-scattered and the parameters gathered. Sorted over the whole batch, the pairs went
    between the chips (2.7x the minimum on libtpu, all-gathered on XLA:CPU)."""
    import os
    import sys

    overlay = os.path.join(sys.prefix, "transformers4")  # beside the pinned stack's venv only
    env = {"PYTHONPATH": overlay} if transformers_4 else {}
    if transformers_4:
        pytest.importorskip("transformers")
        if not os.path.isdir(overlay):
            pytest.skip("transformers 4.x is installed by `make test` beside the pinned stack (.venv/transformers4)")
    result = json.loads(run_python(MIXTRAL, env=env).strip().splitlines()[-1])
    kinds = set(result["collectives"])
    assert kinds <= {"all-gather", "reduce-scatter (CPU: all-reduce + slice)", "all-reduce"}, kinds
    assert result["ratio"] <= 1.1, result
    calls = 2 * (3 if transformers_4 else 2)  # per layer: gate, up, down; 5.x's gate and up are one
    assert result["experts"] == f"XLA ragged_dot x{calls}, each chip's rows sorted among themselves", result


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megablox_weight_gradient_is_ragged_dots(dtype):
    """The TPU path (megablox's ``tgmm`` for the weight gradient, in Pallas's interpreter)
    against XLA's ragged_dot differentiated by JAX: forward and both gradients, with an empty
    group and rows past the groups (a sentinel's), which are zero."""
    import jax
    import jax.numpy as jnp

    from spmdzero.backends.torchax.patches import moe_rows

    rng = np.random.default_rng(0)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((64, 48)), dt)
    w = jnp.asarray(rng.standard_normal((4, 48, 40)), dt)
    offsets = jnp.array([10, 10, 37, 50], jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((64, 40)), dt)
    tiles = moe_rows.megablox_tiles(64, 48, 40)
    assert tiles == (64, 48, 40)

    def run(tiles):
        out, vjp = jax.vjp(lambda x, w: moe_rows.grouped_matmul(x, w, offsets, tiles, interpret=True), x, w)
        return (out, *vjp(cotangent))

    for ours, xla in zip(run(tiles), run(None)):
        assert ours.dtype == xla.dtype and bool(jnp.all(jnp.isfinite(ours)))
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(xla, np.float32), rtol=1e-6, atol=1e-5)
    out, dx, _ = run(tiles)
    assert not np.asarray(out[50:], np.float32).any() and not np.asarray(dx[50:], np.float32).any()


def test_megablox_tiles_divide_the_rows_or_are_not_taken():
    from spmdzero.backends.torchax.patches import moe_rows

    assert moe_rows.megablox_tiles(8192, 4096, 14336) == (512, 1024, 1024)
    assert moe_rows.megablox_tiles(4096 + 128, 1024, 512) == (128, 1024, 512)
    assert moe_rows.megablox_tiles(4100, 1024, 512) is None


@pytest.mark.slow
def test_on_the_tpu_compiler_the_weight_gradients_take_megablox_and_the_traffic_is_a_dense_models(tmp_path):
    """A Mixtral config compiled for v5e:2x2 by libtpu, shape-only: its experts' weight
    gradients are megablox's kernel (the Pallas call compiles for the pinned libtpu) and the
    step sends what data parallelism needs; its MFU counts the compiled FLOPs."""
    model = {"model_type": "mixtral", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "num_local_experts": 4,
             "num_experts_per_tok": 2, "max_position_embeddings": 256}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    report = aot_json(tmp_path, model, config, "--stages", "2", "--seq-len", "256")["reports"][0]
    assert report["experts"] == ("XLA ragged_dot, its weight gradient by Pallas megablox's tgmm x4, each chip's "
                                 "rows sorted among themselves"), report["experts"]
    assert report["fits"] and report["traffic"]["ratio"] <= 1.1, report["traffic"]
    assert "collective-permute" not in report["collectives"], report["collectives"]
    assert report["model_flops"] is None and report["roofline"]["mfu_flops"] == "compiled FLOPs"
