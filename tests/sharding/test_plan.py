"""The sharding plan is pure data: these tests need no device."""

import pytest

from spmdzero.sharding.plan import batch_spec, make_plan, zero_spec

SHAPES = [("embed.weight", (1000, 64)), ("proj.weight", (64, 256)), ("proj.bias", (256,)),
          ("tiny.bias", (4,)), ("scale", ())]


FSDP8 = {"fsdp": 8}
SPLIT = {"fsdp": 4, "fsdp_inner": 2}  # the same 8 devices as two fsdp axes


def test_zero_spec_splits_the_largest_dim_and_first_on_ties():
    assert zero_spec((1000, 64), FSDP8) == (("fsdp", None),)
    assert zero_spec((64, 256), FSDP8) == ((None, "fsdp"),)
    assert zero_spec((32, 32), FSDP8) == (("fsdp", None),)


def test_tensors_smaller_than_the_fsdp_axis_stay_replicated():
    assert zero_spec((4,), FSDP8) == ()
    assert zero_spec((), FSDP8) == ()
    assert zero_spec((1000,), {"fsdp": 1}) == ()
    assert zero_spec((4,), SPLIT) == () and zero_spec((2, 2), SPLIT) == ()


def test_tied_embedding_tables_split_their_embedding_dim_not_their_rows():
    """A tied table's gradient is a matmul folded into a scatter-add of token rows: split by
    columns, the TPU compiler partitions the scatter instead of all-reducing the whole table."""
    plan = make_plan(SHAPES, {"fsdp": 8}, 2, tied_embeddings=["embed.weight"])
    assert plan["embed.weight"].grad == plan["embed.weight"].optimizer_state == (None, "fsdp")
    assert plan["embed.weight"].tied_embedding and not plan["proj.weight"].tied_embedding
    assert make_plan(SHAPES, {"fsdp": 8}, 2)["embed.weight"].grad == ("fsdp", None)  # untied: rows
    assert zero_spec((1000, 4), FSDP8, tied_embedding=True) == (("fsdp", None),)  # too narrow: rows after all


def test_uneven_dims_are_still_sharded_with_padding():
    assert zero_spec((10, 3), FSDP8) == (("fsdp", None),)


def test_even_plans_split_only_dims_that_divide():
    """JAX (the torchax backend) shards only dims that divide by the axis size."""
    assert zero_spec((10, 64), FSDP8, even=True) == ((None, "fsdp"),)  # a 10-class head: its columns
    assert zero_spec((10,), FSDP8, even=True) == ()  # no dim divides: replicated
    assert zero_spec((50257, 768), FSDP8, even=True) == ((None, "fsdp"),)
    assert zero_spec((50257, 768), FSDP8) == (("fsdp", None),)  # XLA pads: the rows, as before
    assert zero_spec((50257, 12), FSDP8, tied_embedding=True, even=True) == ()
    assert zero_spec((66, 64), SPLIT, even=True) == ((None, ("fsdp", "fsdp_inner")),)
    assert zero_spec((64, 256), SPLIT, even=True) == (("fsdp", None), ("fsdp", "fsdp_inner"))
    plan = make_plan([("head.weight", (10, 64)), ("head.bias", (10,))], FSDP8, 2, even=True)
    assert plan["head.weight"].grad == (None, "fsdp") and plan["head.bias"].grad == (None,)


def test_two_fsdp_axes_split_rows_then_the_last_dim_in_two_gradient_stages():
    """libtpu reduce-scatters over 16 chips only one mesh axis at a time: the gradient is
    constrained to the row split over ``fsdp`` first, then to both; a tall tensor's to the
    last dim's split over ``fsdp_inner`` first (libtpu all-reduced a tall gradient's rows)."""
    assert zero_spec((64, 256), SPLIT) == (("fsdp", None), ("fsdp", "fsdp_inner"))
    assert zero_spec((256, 256), SPLIT) == (("fsdp", None), ("fsdp", "fsdp_inner"))
    assert zero_spec((1000, 64), SPLIT) == ((None, "fsdp_inner"), ("fsdp", "fsdp_inner"))
    # the outer axis takes the largest dim but the last: the inner one keeps it
    assert zero_spec((3, 512, 64), SPLIT) == ((None, None, "fsdp_inner"), (None, "fsdp", "fsdp_inner"))
    assert zero_spec((3, 64, 512), SPLIT) == ((None, "fsdp", None), (None, "fsdp", "fsdp_inner"))
    plan = make_plan(SHAPES, SPLIT, 2)
    assert plan["proj.weight"].grad_stages == (("fsdp", None), ("fsdp", "fsdp_inner"))
    assert plan["proj.weight"].shard_dims == (0, 1)
    assert make_plan(SHAPES, SPLIT, 1)["proj.weight"].grad_stages == ()  # ZeRO-1: gradients replicated
    assert make_plan(SHAPES, SPLIT, 1)["proj.weight"].optimizer_state == ("fsdp", "fsdp_inner")


def test_a_sharded_value_is_gathered_one_fsdp_axis_at_a_time():
    """``gather_layouts``: the ZeRO stages backwards, then replicated, at every stage from 1
    (stages 1-2 gather the updated parameters so; libtpu all-reduced a gather over both axes)."""
    for stage in (1, 2, 3):
        plan = make_plan([("proj.weight", (64, 256)), ("up.weight", (512, 256)), ("proj.bias", (64,))], SPLIT, stage)
        assert plan["proj.weight"].zero_stages == (("fsdp", None), ("fsdp", "fsdp_inner"))
        assert plan["proj.weight"].gather_layouts == (("fsdp", None), (None, None))
        assert plan["up.weight"].gather_layouts == ((None, "fsdp_inner"), (None, None))  # tall: inner first
        assert plan["proj.bias"].gather_layouts == ((None,),)  # one stage: straight to replicated
    assert make_plan([("w", (64, 256))], SPLIT, 0)["w"].gather_layouts == ((None, None),)


def test_two_fsdp_axes_split_a_tied_table_by_columns_over_both_in_one_stage():
    plan = make_plan(SHAPES, SPLIT, 2, tied_embeddings=["embed.weight"])
    assert plan["embed.weight"].grad_stages == ((None, ("fsdp", "fsdp_inner")),)


def test_two_fsdp_axes_split_vectors_and_odd_shapes_over_both_at_once():
    assert zero_spec((256,), SPLIT) == ((("fsdp", "fsdp_inner"),),)
    assert zero_spec((1000, 3), SPLIT) == (((("fsdp", "fsdp_inner")), None),)  # 3 columns do not halve
    assert zero_spec((2, 64), SPLIT) == ((None, ("fsdp", "fsdp_inner")),)  # 2 rows over 4 would be padding


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_params_stay_replicated_at_every_stage(stage):
    plan = make_plan(SHAPES, {"fsdp": 8}, stage)
    assert all(set(t.param) <= {None} for t in plan.tensors)


def test_stage0_replicates_everything():
    plan = make_plan(SHAPES, {"fsdp": 8}, 0)
    assert all(set(t.grad) <= {None} and set(t.optimizer_state) <= {None} for t in plan.tensors)


def test_stage1_shards_optimizer_state_only():
    plan = make_plan(SHAPES, {"fsdp": 8}, 1)
    assert plan["embed.weight"].optimizer_state == ("fsdp", None)
    assert plan["embed.weight"].grad == (None, None)
    assert plan["proj.weight"].optimizer_state == (None, "fsdp")


def test_stage2_shards_grads_and_optimizer_state():
    plan = make_plan(SHAPES, {"data": 2, "fsdp": 4}, 2)
    assert plan["proj.bias"].grad == ("fsdp",) and plan["proj.bias"].optimizer_state == ("fsdp",)
    assert plan["proj.bias"].grad_stages == (("fsdp",),) and plan["proj.bias"].shard_dims == (0,)
    assert plan["tiny.bias"].grad == ("fsdp",)  # 4 elements on 4 fsdp devices: splittable
    assert make_plan(SHAPES, {"fsdp": 8}, 2)["tiny.bias"].grad == (None,)


def test_batch_is_split_across_every_data_parallel_axis():
    assert batch_spec({"fsdp": 8}, 2) == ("fsdp", None)
    assert batch_spec({"data": 2, "fsdp": 4}, 3) == (("data", "fsdp"), None, None)
    assert make_plan(SHAPES, {"data": 2, "fsdp": 4}, 2).batch_spec(1) == (("data", "fsdp"),)
    assert batch_spec({"data": 1, **SPLIT}, 2) == (("data", "fsdp", "fsdp_inner"), None)


def test_plan_rejects_bad_stage_and_mesh_without_fsdp():
    with pytest.raises(ValueError, match="stage"):
        make_plan(SHAPES, {"fsdp": 8}, 4)
    with pytest.raises(ValueError, match="fsdp"):
        make_plan(SHAPES, {"data": 8}, 1)


def test_plan_prints_as_a_table():
    text = str(make_plan(SHAPES, {"fsdp": 8}, 2))
    assert "ZeRO stage 2 on mesh fsdp=8" in text
    assert "proj.weight" in text and "(-, fsdp)" in text


def test_unknown_parameter_name_is_a_clear_error():
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        make_plan(SHAPES, {"fsdp": 8}, 1)["nope"]
