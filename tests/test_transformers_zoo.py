"""Stock transformers architectures (``transformers_zoo``), each built from a tiny config, train on
the default backend as in plain torch: 4 SGD steps at ZeRO-2, fp32, clipping off, from the same
weights on the same batches, losses within 1e-5 (relative) and parameters within 2e-5 of each
tensor's scale. Each compiles its training program and its update once, and never again.

``make test`` runs this file twice: on the transformers the venv has (5.x) and on 4.57 (the
``TRANSFORMERS_4`` overlay), whose models take other paths (attention masks, mixture-of-experts
loops). ``benchmarks/transformers_zoo.py`` prints the table."""

import gc

import pytest

import transformers_zoo as zoo

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
TRANSFORMERS_4 = transformers.__version__.startswith("4.")

# cases that do not train yet, each with its cause; strict: one that starts passing must leave this list
KNOWN: dict[str, str] = {}

# cases whose forward reads a tensor's value on the host: their training program runs eagerly
# (spmdzero/backends/torchax/host_reads.py), noted once
READS_VALUES = {
    "wav2vec2": "its forward reads labels.max() on the host, and its CTC loss selects targets by a mask",
    "deberta-v2-cls": "its classification loss indexes labels by (labels >= 0).nonzero(), a data-dependent shape",
}
if TRANSFORMERS_4:
    READS_VALUES["jamba"] = "transformers 4.x's Jamba sizes its causal mask by cache_position[-1] + 1, a value"
# transformers 4.x's mixtures of experts loop over torch.where's data-dependent indices: while
# traced, their experts run as grouped matmuls instead (spmdzero/backends/torchax/moe_experts.py),
# so they compile as 5.x's do


def _known(name):
    return pytest.param(name, marks=pytest.mark.xfail(reason=KNOWN[name], strict=True)) if name in KNOWN else name


# of the second list (``zoo.more_names()``, all of which the benchmark trains on both versions), the
# ones whose code paths the first list lacks: sliding windows, multi-head latent attention and
# shared experts, attention sinks, alternating local attention, state spaces, shifted windows, the
# mixtures of experts transformers 4.x loops over (tests moe_experts.py on 4.57), and a gated linear
# recurrence whose 4.57 code takes another path under a compiler (trace_view.EAGER_PATHS) and cuts
# its attention window under no_grad. Its rows are not padded: with a left-padded batch 4.57's
# RecurrentGemma (its cache on, the default; off, torch's own second backward fails) still parts
# from torch by 5e-4 in loss over 4 steps, its query projection's gradient differing; cause not found.
MORE = ["gemma3", "modernbert", "mamba", "swin", "qwen3-moe", "deepseek-v3", "gpt-oss", "glm4-moe", "minimax",
        "recurrent-gemma"]
assert set(MORE) <= set(zoo.more_names())
# ``zoo.moe_names()``: on 4.x, every one (the blocks moe_experts.py restates, the recurrent masks
# recurrent_masks.py keeps, Mixtral with LoRA (grouped) and DoRA (dense) on its experts); on 5.x,
# which groups most experts itself, the three that did not train there: JetMoE (its router reads
# the token counts), Jamba (its cache copies a slice) and LoRA on the expert weights (PEFT
# registers a parametrization), and the three whose experts loop on 5.x too (moe_layouts.py)
MOE = zoo.moe_names() if TRANSFORMERS_4 else ["jamba", "mixtral-lora-experts", "jetmoe", "dbrx", "longcat-flash",
                                              "switch-transformers"]


# vision-language models on images, whose image-token checks a traced step leaves out
# (spmdzero/backends/torchax/traced_checks.py): LLaVA and PaliGemma compile on both versions (5.x
# checks with torch._check_tensor_all_with, 4.x with a boolean index's shape), Gemma 3 on 5.x (4.x's
# loss picks its logits by a mask: eager, as any read). Qwen2-VL and Qwen2.5-VL read their image
# grid and run eagerly, 23 s each here, most of it compiling each op once: the benchmark's only, for
# the suite's time (tests/test_torchax_traced_checks.py holds their reads' mechanisms).
VLM = ["llava", "paligemma"] + ([] if TRANSFORMERS_4 else ["gemma3-mm"])
assert set(VLM) <= set(zoo.vlm_names())


@pytest.mark.parametrize("name", [_known(n) for n in [*zoo.names(), *MORE, *MOE, *VLM]])
def test_a_stock_architecture_trains_as_in_plain_torch(name):
    result = zoo.train_both(name)
    gc.collect()
    assert all(abs(loss) < 1e3 for loss in result["ours"]), result  # finite: no NaN from padded rows
    assert result["loss_diff"] <= 1e-5, result
    assert result["param_diff"] <= 2e-5, result
    # one training program, one update: four batches of one shape never recompile (a program that
    # reads a value: its one trace, which stopped at the read, and none while it runs eagerly)
    assert result["traces"] == {"train_forward": 1, "update": 1}, result
    assert result["eager"] == (name in READS_VALUES), result
