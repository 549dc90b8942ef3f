"""Stock transformers architectures (``transformers_zoo``), each built from a tiny config, train on
the default backend as in plain torch: 4 SGD steps at ZeRO-2, fp32, clipping off, from the same
weights on the same batches, losses within 1e-5 (relative) and parameters within 2e-5 of each
tensor's scale. Each compiles its training program and its update once, and never again.

``make test`` runs this file twice: on the transformers the venv has (5.x) and on 4.57 (the
``TRANSFORMERS_4`` overlay), whose models take other paths (attention masks, mixture-of-experts
loops). ``benchmarks/transformers_zoo.py`` prints the table."""

import gc
import inspect

import pytest
import torch

import transformers_zoo as zoo

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
TRANSFORMERS_4 = transformers.__version__.startswith("4.")

# cases that do not train yet, each with its cause; strict: one that starts passing must leave this list
KNOWN: dict[str, str] = {}

# cases whose forward reads a tensor's value on the host: their training program runs eagerly
# (spmdzero/backends/torchax/engine/host_reads.py), noted once
# (none now: 4.x's Jamba sized its causal mask by cache_position[-1] + 1, known since
# known_values.py evaluates torch.arange of numbers while tracing)
READS_VALUES: dict[str, str] = {}
# transformers 4.x's mixtures of experts loop over torch.where's data-dependent indices: while
# traced, their experts run as grouped matmuls instead (spmdzero/backends/torchax/patches/moe_experts.py),
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
# (spmdzero/backends/torchax/lowering/traced_checks.py): LLaVA and PaliGemma compile on both versions (5.x
# checks with torch._check_tensor_all_with, 4.x with a boolean index's shape), Gemma 3 on 5.x (4.x's
# loss picks its logits by a mask: eager, as any read). Qwen2-VL, Qwen2.5-VL and Qwen3-VL compile
# with their image grids on the host (shape_inputs.py) and their positions and deepstack features
# from tensor ops (vision_language.py); their rows' grids differ. On 5.x GLM-4V too, and SmolVLM with a
# padding image in odd rows (Idefics3, the same code, is the benchmark's; on 4.x these read on the host:
# eager, the benchmark's only).
# Mistral 3 (Pixtral's tower crops each image by image_sizes, kept on the host) with two image sizes.
# Qwen2.5-VL (window attention) and Qwen3-VL (deepstack) run on 4.x, whose window boundaries are the
# harder path (known_values.py); on 5.x, for the suite's time, the benchmark's, their positions tested below.
VLM = ["llava", "paligemma", "qwen2-vl", "mistral3"] + (
    ["qwen2.5-vl", "qwen3-vl"] if TRANSFORMERS_4 else ["gemma3-mm", "glm4v", "smolvlm"])
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


def _mrope_rows(model, video: bool) -> dict:
    """Four rows of 24 tokens for ``get_rope_index``: two images of other grids in a left-padded
    row; text alone, right-padded; a video (or an image) between texts; an image at the row's
    start. 4.x marks each with its vision start token, 5.x with ``mm_token_type_ids`` too."""
    config = model.config
    start = getattr(config, "vision_start_token_id", None) or config.image_start_token_id  # GLM-4V: its own name
    image, video_token = config.image_token_id, config.video_token_id
    text = [3, 4, 5]

    def item(token, count):
        return [start] + [token] * count

    if not video:
        middle = item(image, 8) + text * 4
    elif type(model).__name__.startswith("Qwen3"):  # its frames apart, a timestamp between them
        middle = item(video_token, 4) + text + item(video_token, 4) + text * 2 + [6, 6]
    else:
        middle = item(video_token, 8) + text * 4
    rows = [[0, 0, 0] + text + item(image, 4) + text + item(image, 8) + [6],
            text * 5 + [0] * 9,
            text + middle,
            item(image, 8) + text * 5]
    ids = torch.tensor(rows)
    mask = torch.tensor([[0, 0, 0] + [1] * 21, [1] * 15 + [0] * 9, [1] * 24, [1] * 24])
    grids = [[1, 4, 4], [1, 4, 8], *([] if video else [[1, 8, 4]]), [1, 4, 8]]
    batch = {"input_ids": ids, "attention_mask": mask, "image_grid_thw": torch.tensor(grids),
             "video_grid_thw": torch.tensor([[2, 4, 4]]) if video else None,
             "second_per_grid_ts": torch.tensor([1.5]) if video else None,
             "mm_token_type_ids": (ids == image).long() + 2 * (ids == video_token).long()}
    parameters = inspect.signature(type(model).get_rope_index).parameters
    return {k: v for k, v in batch.items() if k in parameters}


MROPE = [(name, video) for name in ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"] for video in (False, True)] + (
    [] if TRANSFORMERS_4 else [("glm4v", False)])  # GLM-4V: 5.x's token types, images (vision_language.py)


@pytest.mark.parametrize("name, video", MROPE, ids=[f"{n}-{'video' if v else 'images'}" for n, v in MROPE])
def test_qwen_vl_positions_computed_in_a_trace_are_transformers_own(name, video):
    """``vision_language``: the three positions of every token and each row's delta, computed with
    tensor ops in a jitted trace (the ids traced, the grids on the host), equal transformers' own
    ``get_rope_index`` run on the host, padding and all, on both versions."""
    import jax
    import torchax

    from spmdzero.backends.torchax.patches import vision_language

    build, _ = zoo.cases()[name][:2]
    model = build().model
    batch = _mrope_rows(model, video)
    original = type(model).__dict__["get_rope_index"]
    expected, expected_deltas = original(model, **batch)
    env = torchax.default_env()
    traced = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids")}

    def positions(arrays):
        with env:
            got = vision_language._traced(original)(model, **{**batch, **env.j2t_iso(arrays)})
            return env.t2j_iso(got)

    got, deltas = jax.jit(positions)({k: env.t2j_copy(v) for k, v in traced.items()})
    assert torch.equal(torch.from_numpy(jax.device_get(got).astype("int64")), expected)
    assert torch.equal(torch.from_numpy(jax.device_get(deltas).astype("int64")), expected_deltas.long())


def test_a_qwen_vl_trained_compiled_keeps_no_traced_deltas_and_generates_on_the_host():
    """The deltas transformers keeps on the model for generation (``rope_deltas``) are dropped
    after a traced step, where they were traced values; the module then generates on the host."""
    import spmdzero

    build, batch = zoo.cases()["qwen2-vl"][:2]
    model = build()
    engine, *_ = spmdzero.initialize(model=model, config={
        "train_batch_size": zoo.ROWS, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2}})
    inputs = batch(0)
    engine.backward(engine(**inputs).loss)
    engine.step()
    assert not engine.host_reads.noted and model.model.rope_deltas is None
    model.eval()
    with torch.no_grad():
        out = model.generate(**{k: v for k, v in inputs.items() if k != "labels"}, max_new_tokens=2, do_sample=False)
    assert out.shape == (zoo.ROWS, inputs["input_ids"].shape[1] + 2) and type(model.model.rope_deltas) is torch.Tensor
