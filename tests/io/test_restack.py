"""spmdzero.io.restack: which checkpoint tensors make up each live one across
spmd.scan_layers='stacked', by key arithmetic alone (no devices)."""

from spmdzero.io.restack import Source, host_state_names, layer_names, sources

STACKED = {"h.attn.weight": "h"}
LAYERS = layer_names(STACKED, {"h.attn.weight": 3})


def per_layer(**extra):
    keys = {f"model.h.{i}.attn.weight": (4, 8) for i in range(3)}
    keys.update({f"optim.h.{i}.attn.weight.exp_avg": (4, 8) for i in range(3)})
    keys.update({f"optim.h.{i}.attn.weight.step": () for i in range(3)})
    keys.update({"model.wte.weight": (16, 4)}, **extra)
    return keys


def stacked(**extra):
    return {"model.h.attn.weight": (3, 4, 8), "optim.h.attn.weight.exp_avg": (3, 4, 8),
            "optim.h.attn.weight.step": (), "model.wte.weight": (16, 4), **extra}


def test_layer_names_follow_the_stack():
    assert LAYERS == {"h.attn.weight": ["h.0.attn.weight", "h.1.attn.weight", "h.2.attn.weight"]}


def test_a_stacked_engine_takes_a_per_layer_checkpoint_layer_by_layer():
    got = sources(stacked(), per_layer(), LAYERS, {})
    assert got["model.h.attn.weight"] == Source(tuple(f"model.h.{i}.attn.weight" for i in range(3)), "stack")
    assert got["optim.h.attn.weight.exp_avg"].how == "stack"
    # a step count is one per parameter either way: layer 0's
    assert got["optim.h.attn.weight.step"] == Source(("optim.h.0.attn.weight.step",))
    assert "model.wte.weight" not in got  # saved under its own name
    assert got["model.h.attn.weight"].shape(per_layer()) == (3, 4, 8)
    assert got["model.h.attn.weight"].layer_spec((None, "fsdp", None)) == ("fsdp", None)


def test_a_per_layer_engine_takes_its_slice_of_a_stacked_checkpoint():
    got = sources(per_layer(), stacked(), {}, LAYERS)
    assert got["model.h.1.attn.weight"] == Source(("model.h.attn.weight",), "slice", 1)
    assert got["optim.h.2.attn.weight.exp_avg"] == Source(("optim.h.attn.weight.exp_avg",), "slice", 2)
    assert got["optim.h.0.attn.weight.step"] == Source(("optim.h.attn.weight.step",))
    assert got["model.h.1.attn.weight"].shape(stacked()) == (4, 8)
    assert got["model.h.1.attn.weight"].layer_spec(("fsdp", None)) == (None, "fsdp", None)


def test_nothing_is_made_up_for_a_checkpoint_that_lacks_layers_or_names():
    partial = {k: v for k, v in per_layer().items() if ".2." not in k}
    assert "model.h.attn.weight" not in sources(stacked(), partial, LAYERS, {})
    # a stack of another length keeps its shape, which the caller then refuses as a mismatch
    two = layer_names(STACKED, {"h.attn.weight": 2})
    assert sources(per_layer(), {**stacked(), "model.h.attn.weight": (2, 4, 8)}, {}, two).get(
        "model.h.2.attn.weight") is None
    assert sources(stacked(), stacked(), LAYERS, {}) == {}  # same setting: nothing to do


def test_host_state_follows_the_same_names():
    assert host_state_names(["h.attn.weight", "wte.weight"], ["h.0.attn.weight", "h.1.attn.weight", "wte.weight"],
                            LAYERS, {}) == {"h.attn.weight": "h.0.attn.weight", "wte.weight": "wte.weight"}
    assert host_state_names(["h.0.attn.weight", "h.2.attn.weight"], ["h.attn.weight"], {}, LAYERS) == {
        "h.0.attn.weight": "h.attn.weight", "h.2.attn.weight": "h.attn.weight"}
