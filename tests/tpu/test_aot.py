"""The real training step compiled for a TPU topology (v5e:2x2) with libtpu's compile-only
client: what ZeRO-2 becomes on TPU, per-chip memory by stage, the shape-only trace, and
the report's arithmetic."""

import json
import re

import pytest

from conftest import NO_TORCH_XLA, TORCH_XLA as TORCH_XLA_INSTALLED, aot_json, run_python

TORCH_XLA = {"SPMDZERO_BACKEND": "torch_xla"}  # the torch_xla backend's runtime holds the child's devices

STAGES = """
    import json, sys, torch
    sys.path.insert(0, "examples")
    from model import TinyGPT
    from spmdzero.aot.steps import compare_stages
    config = {"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    make = lambda: TinyGPT()  # 466k params: big enough that TPU tile padding of small shards is noise
    reports = compare_stages(make, config, "v5e:2x2")
    shape_only = compare_stages(make, config, "v5e:2x2", stages=[2], shape_only=True)[0]
    P = sum(p.numel() for p in make().parameters())
    print(json.dumps({"P": P, "reports": [r.to_dict() for r in reports], "shape_only": shape_only.to_dict()}))
"""


@pytest.fixture(scope="module")
def compiled():
    if not TORCH_XLA_INSTALLED:
        pytest.skip(NO_TORCH_XLA)
    out = run_python(STAGES, env={**TORCH_XLA, "CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU"})
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_stage2_reduce_scatters_grads_and_gathers_only_params(compiled):
    P, stage2 = compiled["P"], compiled["reports"][2]
    collectives = stage2["collectives"]
    # the gradients are reduce-scattered: the shards they produce add up to (nearly) all of them
    assert collectives["reduce-scatter"]["tensors"] >= 8
    assert collectives["reduce-scatter"]["bytes"] * 4 == pytest.approx(4 * P, rel=0.05)
    # everything all-gathered is the parameters (fp32): no optimizer state is gathered
    assert collectives["all-gather"]["bytes"] == pytest.approx(4 * P, rel=0.02)
    assert stage2["chips"] == 4 and stage2["fits"]


@pytest.mark.slow
def test_stage0_all_reduces_instead(compiled):
    stage0 = compiled["reports"][0]["collectives"]
    assert "reduce-scatter" not in stage0 and "all-gather" not in stage0
    assert stage0["all-reduce"]["bytes"] >= 4 * compiled["P"]


@pytest.mark.slow
def test_per_chip_argument_bytes_follow_zero_accounting(compiled):
    P, N = compiled["P"], 4
    batch_bytes = 2 * 16 * 32 * 8  # tokens and targets, int64
    # the step's inputs are the persistent state: params (4P) and Adam's moments (8P, sharded
    # from stage 1). Gradients are no input: each step makes them (replicated at stages 0/1,
    # as reduce-scattered shards at stage 2) and hands them straight to the optimizer.
    expected = {0: 12 * P, 1: 4 * P + 8 * P / N, 2: 4 * P + 8 * P / N}
    for report in compiled["reports"]:
        got = report["memory"]["argument"] - batch_bytes
        assert got == pytest.approx(expected[report["stage"]], rel=0.03), report["stage"]


@pytest.mark.slow
def test_state_is_donated_so_counted_once(compiled):
    batch_bytes = 2 * 16 * 32 * 8
    for report in compiled["reports"]:
        memory = report["memory"]
        # every state tensor the step updates is aliased to its input: all arguments but the batch
        assert memory["alias"] == pytest.approx(memory["argument"] - batch_bytes, rel=0.01), report["stage"]
        assert report["total_bytes"] == (memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
                                         + memory["generated_code"])


@pytest.mark.slow
def test_shape_only_capture_compiles_the_same_program(compiled):
    materialized, shape_only = compiled["reports"][2], compiled["shape_only"]
    assert shape_only["memory"] == materialized["memory"]
    assert shape_only["collectives"] == materialized["collectives"]


@pytest.mark.slow
def test_roofline_estimate_comes_from_the_compiled_cost(compiled):
    report = compiled["reports"][2]
    assert report["cost"]["flops"] > 0 and report["cost"]["bytes accessed"] > 0
    roofline = report["roofline"]
    assert roofline["step_s"] == max(roofline["compute_s"], roofline["hbm_s"], roofline["ici_s"])
    assert roofline["compute_s"] == pytest.approx(report["cost"]["flops"] / 197e12)  # v5e peak bf16
    assert 0 < roofline["mfu"] <= 1
    assert report["traffic"]["ratio"] == pytest.approx(report["traffic"]["sent_per_chip"] / report["traffic"]["minimum"])


def test_out_of_memory_compile_becomes_a_verdict():
    from spmdzero.tpu.report import AotReport
    from spmdzero.tpu.compile import parse_resource_exhausted

    total = parse_resource_exhausted("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
                                     "memory space hbm. Used 19.31G of 15.75G hbm. Exceeded hbm capacity by 3.56G.")
    assert total["used"] == int(19.31 * 2**30) and total["over_by"] == int(3.56 * 2**30)
    single = parse_resource_exhausted("RESOURCE_EXHAUSTED: Allocation (size=17612800000) would exceed memory "
                                      "(size=17179869184) :: #allocation23 [shape = 'f32[40000,110000]']")
    assert single["over_by"] == 17612800000 - 17179869184
    assert parse_resource_exhausted("INVALID_ARGUMENT: bad shape") is None
    report = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, None, {}, {}, 0, out_of_memory=total, stage=0)
    assert not report.fits and report.verdict() == "DOES NOT FIT by 3.56 GiB"
    assert "ran out of HBM" in report.summary()


# libtpu 0.0.21's out-of-memory error, as it came for a JAX program on v5e:2x2 (two of its five
# allocations kept)
OOM_MESSAGE = """RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. \
Used 56.25G of 15.75G hbm. Exceeded hbm capacity by 40.50G.

Total hbm usage >= 56.50G:
    reserved        258.00M 
    program          56.25G 
    arguments            0B 

Output size 0B; shares 0B with arguments.

Program hbm requirement 56.25G:
    HLO temp         56.25G (100.0% utilization: Unpadded (56.25G) Padded (56.25G), 0.0% fragmentation (0B))

  Largest program allocations in hbm:

  1. Size: 16.00G
     Operator: op_name="jit(f)/jvp()/dot_general" source_file="/tmp/oom.py" source_line=10 source_end_line=10
     Shape: f32[64,8192,8192]{2,1,0:T(8,128)}
     Unpadded size: 16.00G
     XLA label: convolution_tanh_fusion = fusion(param, bitcast.34), kind=kOutput, calls=fused_computation.8
     Allocation type: HLO temp

  2. Size: 8.00G
     Operator: op_name="jit(f)/transpose(jvp())/dot_general"
     Shape: bf16[64,8192,8192]{2,1,0:T(8,128)(2,1)}
     Unpadded size: 8.00G
     XLA label: fusion.3 = fusion(convolution_exponential_fusion, convolution_tanh_fusion, bitcast.32), kind=kOutput
     Allocation type: HLO temp

"""


def test_out_of_memory_report_lists_the_largest_allocations():
    """What libtpu says the program held at its peak: the first clue to what to shrink."""
    from spmdzero.tpu.report import AotReport
    from spmdzero.tpu.compile import parse_resource_exhausted

    oom = parse_resource_exhausted(OOM_MESSAGE.replace("\\\n", ""))
    assert oom["over_by"] == int(40.5 * 2**30) and oom["usage"]["program"] == int(56.25 * 2**30)
    assert oom["usage"]["arguments"] == 0
    first, second = oom["largest_allocations"]
    assert first == {"bytes": 16 * 2**30, "shape": "f32[64,8192,8192]", "op": "jit(f)/jvp()/dot_general",
                     "source": "oom.py:10", "label": "convolution_tanh_fusion", "kind": "HLO temp"}
    assert second["shape"] == "bf16[64,8192,8192]" and second["source"] == ""
    summary = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, None, {}, {}, 0, out_of_memory=oom, stage=2).summary()
    assert "largest allocations" in summary and "16.00 GiB  f32[64,8192,8192]" in summary


def test_libtpu_lock_and_unknown_topology_are_clear_errors(monkeypatch):
    from jax.experimental import topologies

    from spmdzero.tpu import compile as tpu_compile
    from spmdzero.tpu.capture import check_traceable

    def locked(**_):
        raise RuntimeError('ABORTED: Internal error when accessing libtpu multi-process lockfile. Run '
                           '"$ sudo rm /tmp/libtpu_lockfile".')

    for name in ("LIBTPU_INIT_ARGS", "TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES"):  # _tpu_devices sets them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(topologies, "get_topology_desc", locked)
    with pytest.raises(RuntimeError, match="ALLOW_MULTIPLE_LIBTPU_LOAD=1"):
        tpu_compile._tpu_devices("v5e:2x2")
    monkeypatch.setattr(topologies, "get_topology_desc", lambda **_: (_ for _ in ()).throw(ValueError("no")))
    with pytest.raises(ValueError, match="unknown TPU topology 'v5e:3x3'.*v5e:16x16"):
        tpu_compile._tpu_devices("v5e:3x3")
    assert check_traceable("v5e:16x16") == 64  # traced on a quarter of the chips (spmdzero.tpu.retarget)


def test_model_that_does_not_build_on_meta_is_a_clear_error():
    import torch

    from spmdzero.aot.models import ModelSource, build_on_meta

    class ReadsItsWeights(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.scale = float(self.w.detach().sum())  # reads a value: impossible without the data

    with pytest.raises(ValueError, match="did not build with its parameters on the .meta. device.*--materialize"):
        build_on_meta(ModelSource("m.py:ReadsItsWeights", ReadsItsWeights, None, None))


def test_find_max_batch_bisects_on_fits(monkeypatch):
    from spmdzero import aot

    class Fake:
        def __init__(self, batch):
            self.micro_batch, self.fits = batch, batch <= 11

    monkeypatch.setattr(aot.steps, "compile_step", lambda source, config, topology, stage, batch, shape_only: Fake(batch))
    best, tried = aot.find_max_batch(None, {}, "v5e:2x2", 2)
    assert best == 11
    assert [r.micro_batch for r in tried] == [1, 2, 4, 8, 16, 12, 10, 11]


def test_find_max_batch_says_what_stops_the_next_size():
    from spmdzero.tpu.report import AotReport
    from spmdzero.aot.steps import describe_search, search_summary

    memory = {"argument": 2 * 2**30, "output": 2**30, "alias": 2**30, "temp": 10 * 2**30, "generated_code": 0}
    fits = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, memory, {}, {}, 4, stage=2, micro_batch=8)
    oom = {"used": 20 * 2**30, "capacity": 16 * 2**30, "over_by": 4 * 2**30, "message": "RESOURCE_EXHAUSTED",
           "largest_allocations": [{"bytes": 9 * 2**30, "shape": "f32[9,32,1024,1024]", "op": "", "source": "",
                                    "label": "fusion.1", "kind": "HLO temp"}]}
    misses = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, None, {}, {}, 4, stage=2, micro_batch=9, out_of_memory=oom)
    found = search_summary(8, [fits, misses], 12.0)
    assert found["total_bytes"] == 12 * 2**30 and found["next"]["over_by"] == 4 * 2**30
    line = describe_search(2, found, 16 * 2**30)
    assert line.startswith("stage 2: largest micro-batch per chip that fits: 8 (12.00 GiB of 16.00 GiB); "
                           "9 misses by 4.00 GiB, its largest allocation 9.00 GiB f32[9,32,1024,1024]")


@pytest.mark.slow
def test_bad_input_is_a_clear_error():
    out = run_python("""
        import importlib.util, torch, spmdzero
        from spmdzero import aot
        for topology in ["v9z:2x2", "v5e:2by2"]:
            try:
                aot.topology_chips(topology)
            except ValueError as err:
                print("TOPOLOGY", err)
        engine, *_ = spmdzero.initialize(model=torch.nn.Linear(8, 8), config={"train_batch_size": 8,
                                         "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        with aot.capture(engine) as step:
            engine.backward(engine(torch.randn(8, 8)).sum())
            engine.step()
        try:
            step.compile("v5e:2x2")
        except ValueError as err:
            print("CHIPS", err)
        real_find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "libtpu" else real_find_spec(name, *a)
        try:
            step.compile("v5e:2x4")
        except RuntimeError as err:
            print("LIBTPU", err)
        print("engine untouched:", engine.global_steps, engine.micro_steps)
    """, env=TORCH_XLA)
    assert "TOPOLOGY unknown TPU topology 'v9z:2x2'" in out and "TOPOLOGY unknown TPU topology 'v5e:2by2'" in out
    assert "CHIPS topology 'v5e:2x2' has 4 chips but the mesh has 8 devices" in out
    assert "LIBTPU libtpu is not installed; install it with: pip install 'spmdzero[aot]'" in out
    assert "engine untouched: 0 0" in out


@pytest.mark.slow
def test_cli_prints_the_stages_side_by_side(tmp_path):
    out = run_python(f"""
        import json, spmdzero_cli
        cfg = {{"train_batch_size": 8, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}}}
        json.dump(cfg, open({str(tmp_path / 'ds.json')!r}, "w"))
        print("exit", spmdzero_cli.main(["aot", "--topology", "v5e:2x2", "--deepspeed_config",
                                         {str(tmp_path / 'ds.json')!r}, "--stages", "0,2"]))
    """, env=TORCH_XLA)
    assert "exit 0" in out and "stage 0" in out and "stage 2" in out and "fits in HBM" in out


@pytest.mark.slow
def test_transformers_config_bf16_zero1_shape_only_as_json(tmp_path):
    """A GPT-2 config (no download), bf16 with fp32 masters, ZeRO-1, traced shape-only:
    the CLI's JSON has the memory, the collectives and the roofline."""
    model = {"model_type": "gpt2", "vocab_size": 1024, "n_positions": 16, "n_embd": 128, "n_layer": 2, "n_head": 2}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    result = aot_json(tmp_path, model, config, "--stages", "1", "--seq-len", "16", env=TORCH_XLA)
    report = result["reports"][0]
    assert result["shape_only"] and report["stage"] == 1 and report["micro_batch"] == 2 and report["fits"]
    P = report["gradient_bytes"] // 2  # bf16 communication
    # ZeRO-1 in bf16: params replicated in bf16 (2P), fp32 masters and the two Adam moments
    # sharded over 4 chips (12P / 4); gradients are made inside the step, no input; the batch is
    # input_ids + labels (int64)
    batch_bytes = 2 * 8 * 16 * 8
    assert report["memory"]["argument"] == pytest.approx(5 * P + batch_bytes, rel=0.05)
    assert report["memory"]["alias"] == pytest.approx(report["memory"]["argument"] - batch_bytes, rel=0.01)
    assert report["model_flops"] == 6 * P * 2 * 16
    assert report["roofline"]["mfu_flops"] == "6 x params x tokens"


@pytest.mark.slow
def test_find_max_batch_on_real_compiles_stops_where_libtpu_runs_out_of_memory(tmp_path):
    """The search against libtpu itself: the answer fits and one more sequence per chip does
    not, by the compiler's own verdict. One layer, 4096 tokens and 64 heads: the attention
    scores (batch x heads x 4096^2) outgrow a v5e's HBM within a few sequences, in two
    compiles of about 20 s (the bisection itself is tested above with a fake compiler)."""
    model = {"model_type": "gpt2", "vocab_size": 256, "n_positions": 4096, "n_embd": 64, "n_layer": 1,
             "n_head": 64, "attn_implementation": "eager"}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    json.dump(model, open(tmp_path / "config.json", "w"))
    json.dump(config, open(tmp_path / "ds.json", "w"))
    out = run_python(f"""
        import spmdzero_cli
        spmdzero_cli.main(["aot", "--topology", "v5e:2x2", "--deepspeed_config", {str(tmp_path / 'ds.json')!r},
                           "--model", {str(tmp_path)!r}, "--stages", "2", "--seq-len", "4096",
                           "--find-max-batch", "--json"])
    """, env=TORCH_XLA)
    result = json.loads(out[out.index("{"):])
    search = result["max_micro_batch"]["2"]
    tried = {int(batch): fits for batch, fits in search["tried"].items()}
    best = search["max_micro_batch"]
    assert best >= 1 and tried[best] is True and tried[best + 1] is False, tried
    assert all(fits == (batch <= best) for batch, fits in tried.items()), tried
    assert search["compiles"] == len(tried)
    assert result["reports"][0]["micro_batch"] == 1 and result["reports"][0]["fits"]


@pytest.mark.torch_xla
def test_capture_leaves_the_engine_state_untouched():
    """The traced update is dropped: the next sync must not execute it."""
    import torch
    import torch_xla

    import spmdzero
    from conftest import batches, tiny_mlp
    from spmdzero.tpu.capture import capture

    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "spmd": {"backend": "torch_xla"}})
    (x, y), = batches(1, 8)
    step_loss = lambda: torch.nn.functional.mse_loss(engine(x), y.to(engine.device))  # noqa: E731
    engine.backward(step_loss())
    engine.step()
    before = {k: t.cpu().clone() for k, (t, _) in engine.state_tensors().items()}
    with capture(engine) as step:
        engine.backward(step_loss())
        engine.step()
    torch_xla.sync()
    assert step.mlir and step.donate
    assert all(torch.equal(before[k], t.cpu()) for k, (t, _) in engine.state_tensors().items())
    assert engine.global_steps == 1


@pytest.mark.torch_xla
def test_capture_inside_an_accumulation_window_keeps_the_pending_gradients():
    """Capturing between two micro-steps of a window changes nothing: the window's gradients,
    counters and last loss are as they were, so the boundary applies exactly the update of an
    engine that never captured."""
    import torch
    import torch_xla

    import spmdzero
    from conftest import batches, tiny_mlp
    from spmdzero.tpu.capture import capture

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "spmd": {"backend": "torch_xla"}}
    (x1, y1), (x2, y2) = batches(2, 8)
    engines = []
    for captured in (False, True):
        engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config)
        loss = lambda x, y: torch.nn.functional.mse_loss(engine(x), y.to(engine.device))  # noqa: E731
        engine.backward(loss(x1, y1))
        engine.step()  # inside the window: gradients pending
        if captured:
            pending = {k: g.cpu().clone() for k, g in engine.grad_buffers().items()}
            last = engine._last_loss
            with capture(engine) as step:
                engine.backward(loss(x2, y2))
                engine.step()
            torch_xla.sync()
            assert step.mlir and engine.micro_steps == 1 and engine._last_loss is last
            assert pending and all(torch.equal(pending[k], g.cpu()) for k, g in engine.grad_buffers().items())
        engine.backward(loss(x2, y2))
        engine.step()  # the boundary
        engines.append(engine)
    plain, captured = ({k: t.cpu() for k, (t, _) in e.state_tensors().items()} for e in engines)
    assert engines[1].global_steps == 1
    differ = {k: (plain[k] - captured[k]).abs().max().item() for k in plain if not torch.equal(plain[k], captured[k])}
    assert differ == {}


def test_retarget_moves_each_sharding_to_the_same_axes_of_a_larger_mesh():
    import numpy as np

    from spmdzero.tpu.retarget import check_same_plan, retarget, trace_devices
    from spmdzero.sharding.plan import make_plan

    def sharding(tiles, replicate=False):
        dims = ",".join(map(str, tiles.shape))
        ids = ",".join(map(str, tiles.ravel()))
        return f'mhlo.sharding = "{{devices=[{dims}]{ids}{" last_tile_dim_replicate" if replicate else ""}}}"'

    small, big = np.arange(8).reshape(4, 2), np.arange(32).reshape(16, 2)  # (fsdp, inner) axes
    cases = [  # the same layouts built on both meshes: rows over fsdp, columns over inner, transposed...
        (lambda m: m.reshape(-1, 1), False), (lambda m: m, False), (lambda m: m.T, False),
        (lambda m: m.reshape(m.shape[0], 1, m.shape[1]), True),
        (lambda m: m.T.reshape(1, m.shape[1], m.shape[0]), True),
        (lambda m: m.reshape(-1), False)]
    text = "\n".join(sharding(make(small), rep) for make, rep in cases) + '\nmhlo.sharding = "{replicated}"'
    want = "\n".join(sharding(make(big), rep) for make, rep in cases) + '\nmhlo.sharding = "{replicated}"'
    assert retarget(text, {"fsdp": 4, "inner": 2}, {"fsdp": 16, "inner": 2}) == want
    with pytest.raises(ValueError, match="not a layout of the traced mesh"):
        retarget(sharding(np.array([1, 0, 2, 3, 4, 5, 6, 7])), {"fsdp": 4, "inner": 2}, {"fsdp": 16, "inner": 2})
    with pytest.raises(ValueError, match="each a whole multiple"):
        retarget(text, {"fsdp": 4, "inner": 2}, {"fsdp": 6, "inner": 2})
    assert [trace_devices(t) for t in ("v5e:2x2", "v5e:8x8", "v5e:16x16")] == [4, 64, 64]
    plan = make_plan([("w", (4096, 1024)), ("b", (1024,))], {"fsdp": 64}, 2)
    check_same_plan(plan, {"fsdp": 256})  # every tensor split over fsdp at both sizes
    with pytest.raises(ValueError, match=r"shards \['bias'\] differently"):
        check_same_plan(make_plan([("bias", (100,))], {"fsdp": 64}, 2), {"fsdp": 256})
    # stacked layer parameters (spmd.scan_layers='stacked') keep their layer dim whole at both sizes
    stacked = make_plan([("layers.w", (32, 4096, 4096))], {"fsdp": 32, "fsdp_inner": 2}, 2, stacked=["layers.w"])
    check_same_plan(stacked, {"fsdp": 128, "fsdp_inner": 2})


RETRACE = """
    import hashlib, sys
    from spmdzero.aot.steps import capture_step
    from spmdzero.aot.models import load_model_source
    from spmdzero.tpu.retarget import retarget, target_mesh_shape
    from spmdzero.sharding.mesh import mesh_shape
    source = load_model_source(sys.argv[-1], 32)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    step = capture_step(source, config, 2, shape_only=True, topology="v5e:2x4")
    traced = mesh_shape(step.engine.mesh)
    mlir = retarget(step.mlir, traced, target_mesh_shape(step.engine, 8)) if traced != {"fsdp": 8} else step.mlir
    print("MICRO", step.engine.train_micro_batch_size_per_gpu(), "DONATE", step.donate)
    print("MLIR", len(mlir), hashlib.sha256(mlir.encode()).hexdigest())
"""


@pytest.mark.slow
def test_a_step_traced_on_fewer_devices_and_moved_is_the_step_traced_on_all(tmp_path):
    """8 chips traced on 4 devices with twice the micro-batch, the shardings moved to 8: the
    very StableHLO (and donation) a trace on 8 devices exports; the route for 256 chips (the
    moves on a two-axis mesh are checked above)."""
    model = {"model_type": "gpt2", "vocab_size": 512, "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 2}
    json.dump(model, open(tmp_path / "config.json", "w"))
    code = RETRACE.replace("sys.argv[-1]", repr(str(tmp_path / "config.json")))
    direct = run_python(code, env={**TORCH_XLA, "CPU_NUM_DEVICES": "8", "PJRT_DEVICE": "CPU"})
    moved = run_python(code, env={**TORCH_XLA, "CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU"})
    pick = lambda out, tag: next(line for line in out.splitlines() if line.startswith(tag))  # noqa: E731
    assert pick(direct, "MICRO").startswith("MICRO 2 ") and pick(moved, "MICRO").startswith("MICRO 4 ")
    assert pick(direct, "MICRO").split("DONATE")[1] == pick(moved, "MICRO").split("DONATE")[1]
    assert pick(direct, "MLIR") == pick(moved, "MLIR")


def test_collectives_inside_a_loop_count_once_per_trip():
    """A scanned layer stack compiles to a while loop: its collectives run every trip. TPU
    states the trip count in the loop condition, CPU in the backend config."""
    from spmdzero.tpu.collectives import loop_trip_counts, summarize_collectives

    hlo = """HloModule step

%cond (p: (u32[], f32[8])) -> pred[] {
  %p = (u32[], f32[8]) parameter(0)
  %constant.1 = u32[] constant(0)
  %constant.2 = u32[] constant(12)
  %get-tuple-element.1 = u32[] get-tuple-element(%p), index=0
  ROOT %compare.1 = pred[] compare(%get-tuple-element.1, %constant.2), direction=LT
}

%body (p: (u32[], f32[8])) -> (u32[], f32[8]) {
  %p = (u32[], f32[8]) parameter(0)
  %get-tuple-element.2 = f32[8]{0} get-tuple-element(%p), index=1
  %all-reduce.1 = f32[8]{0} all-reduce(%get-tuple-element.2), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %tuple.1 = (u32[], f32[8]) tuple(%get-tuple-element.1, %all-reduce.1)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %all-gather.1 = f32[32]{0} all-gather(%a), replica_groups={{0,1,2,3}}, dimensions={0}
  %while.1 = (u32[], f32[8]) while(%tuple.0), condition=%cond, body=%body
  %while.2 = (u32[], f32[8]) while(%tuple.0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %get-tuple-element.9 = f32[8]{0} get-tuple-element(%while.1), index=1
}
"""
    assert loop_trip_counts(hlo) == [12, 3]
    collectives = summarize_collectives(hlo)
    assert collectives["all-reduce"]["count"] == 15 and collectives["all-reduce"]["bytes"] == 15 * 32
    assert collectives["all-gather"]["count"] == 1


# libtpu's windowed einsum reduce-scatter, as it compiles one (unidirectional): a loop libtpu
# unrolled by 2 (its counter steps by 2 from a copied 0 up to 8: 4 trips), a collective-permute
# of a partial shard inside a conditional that skips it in the last trip.
WINDOWED_HLO = """HloModule step

%window_collective_permute (w: f32[64,8]) -> f32[64,8] {
  %w = f32[64,8]{0,1} parameter(0)
  %collective-permute-start = (f32[64,8]{0,1}, f32[64,8]{0,1}, u32[], u32[]) collective-permute-start(%w), source_target_pairs={{0,1},{1,0}}
  ROOT %collective-permute-done = f32[64,8]{0,1} collective-permute-done(%collective-permute-start)
}

%last_iteration_noop (w.1: f32[64,8]) -> f32[64,8] {
  ROOT %w.1 = f32[64,8]{0,1} parameter(0)
}

%wide.body (p: (f32[64,8], u32[])) -> (f32[64,8], u32[]) {
  %p = (f32[64,8], u32[]) parameter(0)
  %get-tuple-element.1 = f32[64,8]{0,1} get-tuple-element(%p), index=0
  %get-tuple-element.2 = u32[] get-tuple-element(%p), index=1
  %constant.2 = u32[] constant(2)
  %compare.2 = pred[] compare(%get-tuple-element.2, %constant.2), direction=EQ
  %conditional.1 = f32[64,8]{0,1} conditional(%compare.2, %get-tuple-element.1, %get-tuple-element.1), true_computation=%window_collective_permute, false_computation=%last_iteration_noop
  %add.1 = u32[] add(%get-tuple-element.2, %constant.2)
  ROOT %tuple.1 = (f32[64,8], u32[]) tuple(%conditional.1, %add.1)
}

%wide.cond (p.1: (f32[64,8], u32[])) -> pred[] {
  %p.1 = (f32[64,8], u32[]) parameter(0)
  %constant.8 = u32[] constant(8)
  %get-tuple-element.3 = u32[] get-tuple-element(%p.1), index=1
  ROOT %compare.1 = pred[] compare(%get-tuple-element.3, %constant.8), direction=LT
}

ENTRY %main (a: f32[64,8]) -> f32[64,8] {
  %a = f32[64,8]{0,1} parameter(0)
  %constant.0 = u32[] constant(0)
  %copy.1 = u32[] copy(%constant.0)
  %tuple.0 = (f32[64,8], u32[]) tuple(%a, %copy.1)
  %while.1 = (f32[64,8], u32[]) while(%tuple.0), condition=%wide.cond, body=%wide.body
  ROOT %get-tuple-element.9 = f32[64,8]{0,1} get-tuple-element(%while.1), index=0
}
"""


def test_a_windowed_einsum_ring_counts_its_trips_and_skipped_permutes():
    """Read naively, this loop runs 8 times and permutes every time: 8 shards, twice what the
    ring sends. It runs 4 times (unrolled, step 2) and skips its last permute: 3."""
    from spmdzero.tpu.collectives import loop_trip_counts, summarize_collectives

    assert loop_trip_counts(WINDOWED_HLO) == [4]
    permutes = summarize_collectives(WINDOWED_HLO)["collective-permute"]
    assert permutes["count"] == 3 and permutes["sent"] == 3 * 64 * 8 * 4
    # a conditional of another kind counts its costlier branch every time (an upper bound)
    other = WINDOWED_HLO.replace("last_iteration_noop", "skip")
    assert summarize_collectives(other)["collective-permute"]["count"] == 4


def test_roofline_of_a_looped_program_counts_each_loop_body_per_trip():
    from spmdzero.tpu.report import AotReport

    memory = {"argument": 1, "output": 1, "alias": 1, "temp": 1, "generated_code": 1}
    cost = {"flops": 1e12, "bytes accessed": 1e9}
    plain = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, memory, {}, cost, 4, model_flops=6e12, stage=2)
    assert plain.roofline()["compute_s"] == pytest.approx(1e12 / 197e12) and plain.roofline()["mfu"] > 0
    per_step = {"flops": 7e12, "bytes accessed": 3e10}
    looped = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, memory, {}, cost, 4, model_flops=6e12, stage=2,
                       loops=[32], cost_per_step=per_step)
    roof = looped.roofline()
    assert roof["compute_s"] == pytest.approx(7e12 / 197e12) and roof["hbm_s"] == pytest.approx(3e10 / 819e9)
    assert roof["mfu"] == pytest.approx(6e12 / (roof["step_s"] * 197e12))
    assert "counted per trip" in looped.summary() and "MFU <=" in looped.summary()
    # without the per-trip cost (it failed): compute floored at 6PT, no MFU, and the reason
    failed = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, memory, {}, cost, 4, model_flops=6e12, stage=2,
                       loops=[32], cost_per_step_error="ValueError: no parse")
    roof = failed.roofline()
    assert roof["compute_s"] == pytest.approx(6e12 / 197e12) and roof["mfu"] is None
    assert "loop body once" in roof["note"] and "no parse" in roof["note"]
    assert "MFU <=" not in failed.summary()


PER_TRIP = """
    import json
    import jax, jax.numpy as jnp
    jax.config.update("jax_platforms", "cpu")
    from spmdzero.tpu.collectives import loop_trip_counts
    from spmdzero.tpu.compile import per_step_cost

    def scanned(w, x):
        def layer(h, wl):
            return jnp.tanh(h @ wl), None
        return (jax.lax.scan(layer, x, w)[0] ** 2).sum()

    def unrolled(w, x):
        for layer in range(w.shape[0]):
            x = jnp.tanh(x @ w[layer])
        return (x ** 2).sum()

    w, x = jnp.zeros((6, 256, 256)), jnp.zeros((128, 256))
    out = {}
    for name, fn in (("scanned", scanned), ("unrolled", unrolled)):
        compiled = jax.jit(jax.grad(fn)).lower(w, x).compile()
        cost = {k: float(v) for k, v in compiled.cost_analysis().items() if k in ("flops", "bytes accessed")}
        hlo = compiled.as_text()
        out[name] = {"cost": cost, "loops": loop_trip_counts(hlo), "per_step": per_step_cost(hlo, cost)}
    print(json.dumps(out))
"""


def test_per_step_cost_counts_a_scanned_loop_as_often_as_it_runs():
    """XLA's cost analysis counts a loop body once: a 6-layer scan's forward and backward
    come out at about a sixth of the FLOPs of the same layers unrolled. Counted per trip,
    they match the unrolled program's."""
    got = json.loads(run_python(PER_TRIP, env={"SPMDZERO_NO_RUNTIME": "1"}).strip().splitlines()[-1])
    scanned, unrolled = got["scanned"], got["unrolled"]
    assert scanned["loops"] == [6, 6] and unrolled["loops"] == []
    assert scanned["cost"]["flops"] < 0.5 * unrolled["cost"]["flops"]  # what the compiler says
    assert unrolled["per_step"] == unrolled["cost"]  # no loop, nothing to scale
    # the scan also computes the first layer's input gradient, which the unrolled program skips
    assert scanned["per_step"]["flops"] == pytest.approx(unrolled["cost"]["flops"], rel=0.1)
    assert scanned["per_step"]["flops"] >= unrolled["cost"]["flops"]


def test_report_names_gradients_all_reduced_in_full_at_stage_2():
    """A gradient the compiler all-reduced instead of reduce-scattering is named, by shape,
    with the tile rule that explains it; small all-reduces (biases, norms) are not."""
    from spmdzero.tpu.report import AotReport
    from spmdzero.tpu.collectives import largest_all_reduces

    hlo = """HloModule step

ENTRY %main (a: f32[50257,768], b: f32[768]) -> f32[50257,768] {
  %a = f32[50257,768]{0,1:T(8,128)} parameter(0)
  %b = f32[768]{0} parameter(1)
  %all-reduce.1 = f32[50257,768]{0,1:T(8,128)} all-reduce(%a), replica_groups={{0,1,2,3}}, to_apply=%add
  %all-reduce.2 = f32[768]{0} all-reduce(%b), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %r = f32[50257,768]{0,1} add(%all-reduce.1, %a)
}
"""
    found = largest_all_reduces(hlo)
    assert found == [{"shape": "f32[50257,768]", "bytes": 50257 * 768 * 4, "count": 1}]
    memory = {"argument": 1, "output": 1, "alias": 1, "temp": 1, "generated_code": 1}
    names = {"f32[50257,768]": ["transformer.wte.weight"], "f32[768]": ["transformer.ln_f.bias"]}
    report = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, memory, {}, {}, 4, stage=2, all_reduces=found,
                       gradient_names=names)
    assert report.all_reduced_gradients()[0]["parameters"] == ["transformer.wte.weight"]
    assert "all-reduced in full, not reduce-scattered: f32[50257,768] x1 (transformer.wte.weight)" in report.summary()
    assert report.to_dict()["all_reduced_gradients"][0]["shape"] == "f32[50257,768]"
    stage0 = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, memory, {}, {}, 4, stage=0, all_reduces=found,
                       gradient_names=names)
    assert stage0.all_reduced_gradients() == [] and "all-reduced in full" not in stage0.summary()


SCANNED_TEMPORARIES = """
    import json, sys
    from spmdzero.aot.steps import compile_step
    from spmdzero.aot.models import load_model_source
    source = load_model_source(sys.argv[-1], seq_len=256)
    temps = {}
    for scan in (False, True):
        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "spmd": {"scan_layers": scan}}
        report = compile_step(source, config, "v5e:2x2", stage=2)
        temps[str(scan)] = report.memory["temp"]
    print(json.dumps(temps))
"""


@pytest.mark.slow
def test_scanned_layers_keep_few_more_temporaries_than_unrolled(tmp_path):
    """The scanned loop stacks what its backward reads over the layers; with AOTAutograd's
    default partition that was every intermediate of the block (4.4 x the unrolled step's
    temporaries at 4 x 256 tokens per chip). spmdzero.backends.torch_xla.scan uses the min-cut partition, which
    recomputes the cheap ones (1.2 x)."""
    model = {"model_type": "gpt2", "vocab_size": 2048, "n_positions": 256, "n_embd": 256, "n_layer": 4, "n_head": 4,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    json.dump(model, open(tmp_path / "config.json", "w"))
    code = SCANNED_TEMPORARIES.replace("sys.argv[-1]", repr(str(tmp_path / "config.json")))
    temps = json.loads(run_python(code, env={**TORCH_XLA, "CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU",
                                             "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}).strip().splitlines()[-1])
    assert temps["True"] <= 1.5 * temps["False"], temps


def test_every_aot_option_reaches_the_child_process():
    """``spmdzero aot`` runs ``python -m spmdzero.aot`` with its options again (``sys_argv_after``):
    each option set here, away from its default, comes back the same."""
    import argparse

    from spmdzero.aot.command import add_arguments
    from spmdzero.cli.main import sys_argv_after

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--topology", "v5e:2x2", "--deepspeed_config", "ds.json", "--model", "m.json",
                              "--stages", "1,2", "--seq-len", "8", "--micro-batch", "2", "--materialize",
                              "--scan-layers", "stacked", "--gradient-checkpointing", "--find-max-batch", "--json",
                              "--generate", "8:16:16", "--tensor-parallel", "2"])
    assert all(getattr(args, a.dest) != a.default for a in parser._actions if a.dest not in ("help", "topology",
                                                                                           "deepspeed_config"))
    assert vars(parser.parse_args(sys_argv_after(args))) == vars(args)


@pytest.mark.slow
def test_gradient_checkpointing_cuts_the_temporaries(tmp_path):
    """--gradient-checkpointing: the torchax step rematerializes each GPT-2 block
    (spmdzero.backends.torchax.lowering.remat), so what the backward keeps of the blocks is their inputs. A
    4-layer GPT-2 whose blocks' activations dominate (small vocabulary), 4 x 512 tokens per chip,
    ZeRO-2 on v5e:2x2, the exact attention path (its [L, S] scores in the blocks; the flash
    kernels keep none): 41% of the temporaries without it when measured (80 -> 33 MiB; 8 layers:
    32%, 242 -> 76 MiB). The dropouts are off, which shortens libtpu's compile (about 25 s a
    compile here)."""
    model = {"model_type": "gpt2", "vocab_size": 2048, "n_positions": 512, "n_embd": 256, "n_layer": 4, "n_head": 4,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "spmd": {"attention": "exact"}}
    json.dump(model, open(tmp_path / "config.json", "w"))
    json.dump(config, open(tmp_path / "ds.json", "w"))
    temps = {}
    for flag in ([], ["--gradient-checkpointing"]):
        out = run_python(f"""
            import spmdzero_cli
            spmdzero_cli.main(["aot", "--topology", "v5e:2x2", "--deepspeed_config", {str(tmp_path / 'ds.json')!r},
                               "--model", {str(tmp_path)!r}, "--stages", "2", "--json", *{flag!r}])
        """)
        report = json.loads(out[out.index("{"):])["reports"][0]
        assert report["backend"] == "torchax"
        temps[bool(flag)] = report["memory"]["temp"]
    assert temps[True] <= 0.5 * temps[False], temps


def _aot_report(tmp_path, model: dict, topology: str, stage: int, backend: str = "torchax", bf16: bool = True,
                micro_batch: int = 1, env: dict | None = None) -> dict:
    """``spmdzero aot --json``'s report for a transformers config (``model``), AdamW at ``stage``
    in bf16 (or fp32), ``micro_batch`` rows of 256 tokens, in a fresh process (``env`` added)."""
    config = {"train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "spmd": {"backend": backend},
              **({"bf16": {"enabled": True}} if bf16 else {})}
    json.dump(model, open(tmp_path / "config.json", "w"))
    json.dump(config, open(tmp_path / "ds.json", "w"))
    out = run_python(f"""
        import spmdzero_cli
        spmdzero_cli.main(["aot", "--topology", {topology!r}, "--deepspeed_config", {str(tmp_path / 'ds.json')!r},
                           "--model", {str(tmp_path)!r}, "--stages", "{stage}", "--seq-len", "256", "--json"])
    """, env=env)
    return json.loads(out[out.index("{"):])["reports"][0]


@pytest.mark.slow
def test_the_fused_loss_reads_the_logits_in_the_layout_the_head_wrote_them(tmp_path):
    """The loss takes the label's logit as a masked row sum (``cross_entropy.py``), which reads
    the logits where the head's matmul and the log-sum-exp have them. Taken with a gather
    (``take_along_axis``), libtpu first copied the whole ``[tokens, vocabulary]`` array into
    row-major order: here a second copy beside the one into the step's output (the module
    returns its logits); GPT-2 124M at 4 x 1024 tokens a chip, 412 MB each way (docs/tpu.md)."""
    # GPT-2's vocabulary: with 8,192 words the head writes row-major logits and nothing is copied
    model = {"model_type": "gpt2", "n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 50257,
             "n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    dump = tmp_path / "dump"
    _aot_report(tmp_path, model, "v5e:2x2", stage=2, micro_batch=4,
                env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"})
    [program] = [p.read_text() for p in dump.glob("*jit_step*after_optimizations.txt")]
    assert re.search(r"= bf16\[4,256,50257\]\{[^}]*\} convolution\(", program), "the head's matmul is not found"
    copies = re.findall(r"= bf16\[4,256,50257\]\{[^}]*\} copy\(", program)
    assert len(copies) <= 1, copies


@pytest.mark.slow
@pytest.mark.parametrize("backend,bf16", [("torchax", True), ("torch_xla", True), ("torch_xla", False)])
def test_stage_2_on_128_chips_all_gathers_the_parameters_one_axis_at_a_time(tmp_path, backend, bf16):
    """On v5p:4x4x8 (fsdp 16 x fsdp_inner 8) the updated parameters are gathered from their
    shards one fsdp axis at a time (``TensorPlan.gather_layouts``). Gathered over both axes at
    once, libtpu 0.0.21 all-reduced them whole: this 2-layer Llama sent 1.73x the data-parallel
    minimum with no all-gather at all on either backend, Llama-2-7B 1.52x (1.02x now, docs/tpu.md).
    In fp32 the torch_xla backend gathers them inside its fused update (``fused.update``'s
    ``gather``); without that it sent 1.54x."""
    model = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 2048,
             "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
             "max_position_embeddings": 256, "tie_word_embeddings": False}
    report = _aot_report(tmp_path, model, "v5p:4x4x8", stage=2, backend=backend, bf16=bf16)
    assert report["backend"] == backend
    params = report["gradient_bytes"]  # the gradients' dtype is the parameters': their bytes too
    gathered = report["collectives"].get("all-gather", {}).get("bytes", 0)
    assert 0.95 * params <= gathered <= 1.2 * params, (gathered, params)
    assert report["collectives"]["all-reduce"]["bytes"] < 0.6 * params, report["collectives"]
    assert report["traffic"]["ratio"] <= 1.3, report["traffic"]


@pytest.mark.slow
@pytest.mark.parametrize("dropout, kernel", [(0.0, "Pallas flash kernel x2"),
                                             (0.1, "Pallas flash kernel with dropout x2")])
def test_stage_3_gathers_the_weights_as_fsdp_within_its_traffic_minimum(tmp_path, dropout, kernel):
    """ZeRO-3 on the torchax backend: each parameter is gathered where the module reads it, so the
    step sends at most 1.1x FSDP's minimum 3(N-1)/N x P x bytes (a 2-layer GPT-2, bf16, v5e:2x2).
    Without the gather the partitioner moved activations instead: 2.26x. Its attention is Pallas's
    flash kernel, or with attention dropout spmdzero's own (flash_dropout.py), which the TPU
    compiler takes (Mosaic) and the report names."""
    model = {"model_type": "gpt2", "n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 4096, "n_positions": 256,
             "attn_pdrop": dropout}
    report = _aot_report(tmp_path, model, "v5e:2x2", stage=3)
    assert report["backend"] == "torchax" and report["stage"] == 3 and report["fits"]
    assert "all-gather" in report["collectives"]
    assert report["traffic"]["ratio"] <= 1.1, report["traffic"]
    assert report["attention"] == kernel, report["attention"]


# ---- the command's bad input, refused before anything compiles (review findings) ---------------------

def _write(path, text):
    path.write_text(text)
    return str(path)


@pytest.fixture
def aot_inputs(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    return {
        "ds": _write(tmp_path / "ds.json", json.dumps(ds)),
        "ds4": _write(tmp_path / "ds4.json", json.dumps({**ds, "zero_optimization": {"stage": 4}})),
        "syntax": _write(tmp_path / "syntax.py", "def f(:\n") + ":M",
        "missing_import": _write(tmp_path / "importerr.py", "import nosuchpackage_xyz\n") + ":M",
        "not_a_module": _write(tmp_path / "notmod.py", "def make():\n    return 3\n") + ":make",
        "list": _write(tmp_path / "list.json", "[1, 2]"),
        "t5": _write(tmp_path / "t5.json", json.dumps({"model_type": "t5", "num_layers": 1, "d_model": 64,
                                                        "num_heads": 2, "d_ff": 128, "vocab_size": 1024})),
        "plain": _write(tmp_path / "plain.py", "import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n"
                        "        super().__init__()\n        self.w = torch.nn.Linear(2, 1)\n") + ":M",
        "gpt2": _write(tmp_path / "gpt2.json", json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 64,
                                                          "n_head": 2, "vocab_size": 256, "n_positions": 32})),
    }


@pytest.mark.parametrize("case, extra, message", [
    ("ds4", [], "zero_optimization.stage"),
    ("syntax", [], r"importing .*syntax.py failed: SyntaxError"),
    ("missing_import", [], r"importing .*importerr.py failed: ModuleNotFoundError: No module named 'nosuchpackage_xyz'"),
    ("not_a_module", [], r"gave a int, not a torch.nn.Module"),
    ("list", [], r"holds a JSON list, not a transformers config"),
    ("t5", [], r"model_type 't5' has no causal-LM model in transformers"),
    ("gpt2", ["--topology", "v5e:0x2"], r"unknown TPU topology 'v5e:0x2'"),
    ("not_a_module", ["--seq-len", "16"], r"--seq-len applies to transformers configs"),
    ("plain", ["--gradient-checkpointing"], r"--gradient-checkpointing: model .*plain.py:M \(M\) has no "
                                           r"gradient_checkpointing_enable\(\) method"),
])
def test_the_command_refuses_bad_input_with_one_line(aot_inputs, capsys, case, extra, message):
    from spmdzero.aot import command

    model = aot_inputs[case] if case != "ds4" else aot_inputs["gpt2"]
    config = aot_inputs["ds4"] if case == "ds4" else aot_inputs["ds"]
    args = ["--topology", "v5e:2x2", "--deepspeed_config", config, "--model", model, "--stages", "2"]
    code = command.main(args + extra)
    err = capsys.readouterr().err
    assert code == 1 and re.search(message, err), err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flag, value", [("--stages", "x"), ("--stages", "1,4"), ("--seq-len", "0"),
                                         ("--micro-batch", "-1")])
def test_the_command_refuses_bad_numbers_as_usage_errors(aot_inputs, capsys, flag, value):
    from spmdzero.aot import command

    with pytest.raises(SystemExit) as exit_:
        command.main(["--topology", "v5e:2x2", "--deepspeed_config", aot_inputs["ds"], "--model", aot_inputs["gpt2"],
                      flag, value])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_find_max_batch_says_when_it_stopped_at_its_limit_and_reuses_known_compiles(monkeypatch):
    from spmdzero import aot

    compiled = []

    class Fits:
        def __init__(self, batch):
            self.micro_batch, self.fits, self.total_bytes = batch, True, 0

    def fake(source, config, topology, stage, batch, shape_only):
        compiled.append(batch)
        return Fits(batch)

    monkeypatch.setattr(aot.steps, "compile_step", fake)
    best, tried = aot.find_max_batch(None, {}, "v5e:2x2", 2, known={1: Fits(1)})
    assert best == aot.steps.SEARCH_LIMIT and compiled[0] == 2  # micro-batch 1 came from the report already compiled
    line = aot.describe_search(2, aot.search_summary(best, tried, 1.0), 16 * 2**30)
    assert f">= {aot.steps.SEARCH_LIMIT} (the search limit; larger sizes were not tried)" in line


@pytest.mark.torch_xla
def test_training_after_a_collectives_report_does_not_recompile():
    """The report traces a step and puts the engine back: a bf16 config schedule (its step
    count on the device) and the restored state must not make the next training step a new
    graph."""
    import torch
    import torch_xla.debug.metrics as met

    import spmdzero
    from conftest import batches, tiny_mlp

    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={
        "train_batch_size": 8, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "spmd": {"backend": "torch_xla"},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}})
    data = batches(6, 8)
    loss_fn = lambda out, y: torch.nn.functional.mse_loss(out.float(), y.to(engine.device))  # noqa: E731

    def train(pairs):
        for x, y in pairs:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        engine.wait() if hasattr(engine, "wait") else None

    train(data[:3])
    x, y = data[3]
    engine.collectives_report(x, loss_fn=lambda out: loss_fn(out, y))
    compiles = met.metric_data("CompileTime")[0]
    train(data[4:])
    assert met.metric_data("CompileTime")[0] == compiles
    assert engine.global_steps == 5


def test_the_stages_table_rows_add_up_to_the_total():
    """arguments + outputs - aliased + temporaries + code = total per chip."""
    from spmdzero.tpu.report import AotReport, stages_table

    mib = 2**20
    memory = {"argument": 40 * mib, "output": 30 * mib, "alias": 30 * mib, "temp": 20 * mib, "generated_code": 5 * mib}
    report = AotReport("v5e:2x2", 4, "TPU v5 lite", 1.0, memory, {}, {}, 4, stage=2, micro_batch=1)
    rows = {line[:28].strip(): line[28:].strip() for line in stages_table([report]).splitlines()[1:]}
    assert report.total_bytes == 65 * mib
    figures = [float(rows[k].split()[0]) for k in ("arguments (model states)", "outputs", "aliased (donated state)",
                                                   "temporaries", "code", "total per chip")]
    assert figures[0] + figures[1] - figures[2] + figures[3] + figures[4] == pytest.approx(figures[5])


HF_CONFIG = {  # as the Hugging Face Trainer's docs write it: the Trainer fills in every "auto"
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


NO_OPTIMIZER = ("it has no 'optimizer' section: compiled with AdamW (the optimizer the Hugging Face Trainer gives "
                "DeepSpeed by default)")


@pytest.mark.parametrize("config, extra, notes", [
    (HF_CONFIG, ["--micro-batch", "2"], [
        'optimizer.params lr, betas, eps, weight_decay are "auto": compiled with the optimizer\'s defaults (the values '
        "do not change the compiled step)",
        'scheduler.params hold "auto": compiled without the schedule (it sets the learning rate between steps; the '
        "compiled step is the same)"]),
    ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": True}, [], [NO_OPTIMIZER]),
    ({"train_micro_batch_size_per_gpu": 1, "zero_optimization": "auto", "optimizer": {"type": "SGD"}}, [], []),
    ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}, ["--micro-batch", "4"], [NO_OPTIMIZER]),
])
def test_the_command_compiles_configs_as_integrations_write_them(tmp_path, capsys, monkeypatch, config, extra, notes):
    """Each used to fail before compiling: "auto" optimizer parameters refused (only the HF
    Trainer fills them in, and they do not change the compiled step), ``"zero_optimization":
    true`` (DeepSpeed's old form) or "auto" a TypeError traceback, no optimizer section an
    AttributeError from inside the traced step. The compile itself is faked: each config is
    taken as far as the stage's engine config."""
    from spmdzero.aot import command, steps
    from spmdzero.aot.steps import _stage_config
    from spmdzero.config.load import parse_config

    class Reached(RuntimeError):
        pass

    def compile_step(source, config, topology, stage, micro_batch, shape_only):
        cfg = parse_config(_stage_config(config, stage, micro_batch))
        raise Reached(f"compiling stage {cfg.zero_stage} with {cfg.optimizer.type}")

    monkeypatch.setattr(steps, "compile_step", compile_step)  # command.main imports it from there when run
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    model = tmp_path / "model.py"
    model.write_text("def make():\n    raise AssertionError('not built: the compile is faked')\n")
    code = command.main(["--topology", "v5e:2x2", "--deepspeed_config", str(path), "--model", f"{model}:make",
                         "--stages", "2", *extra])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("spmdzero aot:")]
    assert code == 1 and said[-1] == "spmdzero aot: compiling stage 2 with " + config.get("optimizer", {}).get(
        "type", "AdamW"), said
    assert said[:-1] == [f"spmdzero aot: {path}: {note}" for note in notes], said


def test_the_command_asks_for_micro_batch_when_the_config_has_no_batch_size(tmp_path, capsys):
    from spmdzero.aot import command

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_CONFIG))
    assert command.main(["--topology", "v5e:2x2", "--deepspeed_config", str(path), "--stages", "2"]) == 1
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("spmdzero aot:")]
    assert said == [f'spmdzero aot: {path}: train_batch_size and train_micro_batch_size_per_gpu are "auto" or '
                    "absent (an integration fills them in): pass --micro-batch"], said


@pytest.mark.torch_xla
def test_a_captured_step_without_an_optimizer_says_so():
    import torch

    import spmdzero
    from spmdzero.tpu.capture import capture

    engine, *_ = spmdzero.initialize(model=torch.nn.Linear(8, 8), config={"train_batch_size": 8,
                                                                          "spmd": {"backend": "torch_xla"}})
    with pytest.raises(RuntimeError, match=r"engine.step\(\) in spmdzero.aot.capture needs an optimizer"):
        with capture(engine):
            engine.backward(engine(torch.randn(8, 8)).sum())
            engine.step()


# ---- the torchax backend's step (spmd.backend: "torchax") ------------------------------------------

TORCHAX = {"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "spmd": {"backend": "torchax"}}

TORCHAX_STAGES = f"""
    import json, sys, jax
    sys.path.insert(0, "examples")
    from model import TinyGPT
    from spmdzero.aot.models import ModelSource
    from spmdzero.aot.steps import capture_step
    source = ModelSource("TinyGPT", TinyGPT, lambda m, b: (tuple(m.example_inputs(b)), {{}}), lambda out: out)
    reports, untouched = [], []
    for stage in (0, 1, 2):
        step = capture_step(source, {TORCHAX!r}, stage, topology="v5e:2x2")
        reports.append(step.compile("v5e:2x2").to_dict())
        engine = step.engine
        state = [engine.params(), engine.optimizer_states(), [t for t, _ in engine.state_tensors().values()]]
        untouched.append({{"global_steps": engine.global_steps, "runs": sum(engine.runs.values()),
                          "only_shapes": all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)),
                          "meta": all(p.device.type == "meta" for p in engine.host.wrapped.parameters())}})
    P = sum(p.numel() for p in TinyGPT().parameters())
    print(json.dumps({{"P": P, "reports": reports, "untouched": untouched}}))
"""


@pytest.fixture(scope="module")
def torchax_compiled():
    """TinyGPT's torchax step at ZeRO-0/1/2 for v5e:2x2, in a process where JAX owns the
    devices (as ``spmdzero aot`` traces it): shape-only, lowered on an abstract mesh."""
    out = run_python(TORCHAX_STAGES, env={"SPMDZERO_BACKEND": "torchax", "PJRT_DEVICE": "CPU"})
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_torchax_stage2_reduce_scatters_as_the_torch_xla_step_does(torchax_compiled, compiled):
    P, stage2 = torchax_compiled["P"], torchax_compiled["reports"][2]
    assert stage2["backend"] == "torchax" and compiled["reports"][2]["backend"] == "torch_xla"
    assert stage2["chips"] == 4 and stage2["fits"]
    collectives = stage2["collectives"]
    assert collectives["reduce-scatter"]["tensors"] >= 8
    assert collectives["reduce-scatter"]["bytes"] * 4 == pytest.approx(4 * P, rel=0.05)
    assert collectives["all-gather"]["bytes"] == pytest.approx(4 * P, rel=0.02)  # the parameters only
    stage0 = torchax_compiled["reports"][0]["collectives"]
    assert "reduce-scatter" not in stage0 and "all-gather" not in stage0 and stage0["all-reduce"]["bytes"] >= 4 * P
    for ours, theirs in zip(torchax_compiled["reports"], compiled["reports"]):
        assert ours["gradient_bytes"] == theirs["gradient_bytes"] == 4 * P
        assert ours["collectives"].keys() == theirs["collectives"].keys(), ours["stage"]


@pytest.mark.slow
def test_torchax_per_chip_bytes_follow_zero_accounting(torchax_compiled):
    P, N = torchax_compiled["P"], 4
    reports = torchax_compiled["reports"]
    batch_bytes = 2 * 4 * 32 * 4  # tokens and targets of 4 rows per chip, int32 (JAX without x64)
    expected = {0: 12 * P, 1: 4 * P + 8 * P / N, 2: 4 * P + 8 * P / N}
    for report in reports:
        memory = report["memory"]
        assert memory["argument"] - batch_bytes == pytest.approx(expected[report["stage"]], rel=0.03)
        # every state array the step updates is donated to its output: all arguments but the batch
        assert memory["alias"] == pytest.approx(memory["argument"] - batch_bytes, rel=0.01), report["stage"]
    totals = [r["total_bytes"] for r in reports]
    assert totals[0] > totals[1] >= totals[2], totals


@pytest.mark.slow
def test_torchax_aot_materializes_and_executes_nothing(torchax_compiled):
    for state in torchax_compiled["untouched"]:
        assert state == {"global_steps": 0, "runs": 0, "only_shapes": True, "meta": True}


def _main_results(mlir: str) -> dict:
    """``main``'s outputs by JAX's name for them (``result[0][0]['head.weight']``): their sharding."""
    signature = mlir[mlir.index("func.func public @main("):]
    signature = signature[:signature.index("{\n")]
    return dict(re.findall(r'jax.result_info = "([^"]*)", sdy.sharding = #sdy.sharding<@mesh, (\[[^\]]*\])>',
                           signature))


def _main_arguments(mlir: str) -> list[tuple[str, int]]:
    """``main``'s donated arguments: (sharding, the output it is aliased to)."""
    signature = mlir[mlir.index("func.func public @main("):]
    signature = signature[:signature.index("->")]
    return [(spec, int(out)) for spec, out in re.findall(
        r"sdy.sharding = #sdy.sharding<@mesh, (\[[^\]]*\])>, tf.aliasing_output = (\d+)", signature)]


def _constraints(mlir: str, function: str) -> list[str]:
    """The sharding constraints in one of the module's functions."""
    body = mlir[mlir.index(f"func.func private @{function}("):]
    body = body[:body.index("func.func", 10)]
    return re.findall(r"sdy.sharding_constraint %\S+ <@mesh, (\[[^\]]*\])>", body)


def test_torchax_step_module_carries_the_plans_shardings_and_donations():
    """The StableHLO JAX lowers for the torchax step, before any compile: parameters replicated,
    optimizer states split along fsdp from stage 1, each donated to its updated output; the
    gradients constrained to fsdp shards in the training program at stage 2 only."""
    import sys

    sys.path.insert(0, "examples")
    from model import TinyGPT

    from spmdzero.aot.models import ModelSource
    from spmdzero.aot.steps import capture_step

    source = ModelSource("TinyGPT", TinyGPT, lambda m, b: (tuple(m.example_inputs(b)), {}), lambda out: out)
    trained = len(list(TinyGPT().parameters()))
    for stage in (0, 1, 2):
        step = capture_step(source, TORCHAX, stage, topology="v5e:2x2")
        assert step.engine.mesh.shape == {"fsdp": 4} and "mhlo.num_partitions = 4" in step.mlir
        results = _main_results(step.mlir)
        names = list(re.findall(r'jax.result_info = "([^"]*)"', step.mlir))
        # the update's outputs: (Stepped, StepReport) (backends/torchax/programs/train_state.py)
        params = {k: v for k, v in results.items() if k.startswith("result[0][0].params")}
        states = {k: v for k, v in results.items() if k.startswith("result[0][0].opt_state")}
        assert len(params) == trained and len(states) == 2 * trained  # Adam's two moments (the step is shared)
        assert all("fsdp" not in spec for spec in params.values())
        assert all(("fsdp" in spec) == (stage >= 1) for spec in states.values()), stage
        donated = _main_arguments(step.mlir)
        assert len(donated) >= 3 * trained
        assert all(results[names[out]] == spec for spec, out in donated)  # updated in place, same layout
        grads = _constraints(step.mlir, "program_train")
        assert len(grads) == trained and all(("fsdp" in spec) == (stage == 2) for spec in grads), (stage, grads)


def test_torchax_step_without_a_loss_is_a_clear_error():
    import torch

    from spmdzero.aot.models import ModelSource
    from spmdzero.aot.steps import capture_step

    source = ModelSource("Linear", lambda: torch.nn.Linear(8, 8), lambda m, b: ((torch.randn(b, 8),), {}),
                         lambda out: out)
    with pytest.raises(ValueError, match=r"output holds no scalar loss \(Linear\)"):
        capture_step(source, TORCHAX, 2, topology="v5e:2x2")


def test_the_torchax_step_with_scan_layers_is_one_loop_over_the_stack():
    """``--scan-layers`` (and ``stacked``) on the torchax backend: the shape-only engine scans
    its block stack as training does, so the step is a loop (the forward's and the backward's)
    over the layers, with per-layer or stacked parameters."""
    import sys

    sys.path.insert(0, "examples")
    from model import TinyGPT

    from spmdzero.aot.models import ModelSource
    from spmdzero.aot.steps import capture_step

    source = ModelSource("TinyGPT", TinyGPT, lambda m, b: (tuple(m.example_inputs(b)), {}), lambda out: out,
                         returns_loss=True)
    for mode, stacked in ((True, False), ("stacked", True)):
        step = capture_step(source, {**TORCHAX, "spmd": {"backend": "torchax", "scan_layers": mode}}, 2,
                            topology="v5e:2x2")
        assert step.mlir.count("stablehlo.while") == 2, mode
        assert ("blocks.qkv.weight" in step.step.trained) == stacked
        assert ("blocks.1.qkv.weight" in step.step.trained) == (not stacked)


@pytest.mark.slow
def test_a_live_torchax_engine_traces_its_step_and_trains_on_unchanged():
    """``spmdzero.aot.trace_step`` on a training torchax engine (8 CPU devices here): nothing
    runs, its parameters and counters are as they were, the next step traces each program once
    (the recompile guard sees no extra trace), and the step compiles for 8 chips."""
    import sys

    import torch

    import spmdzero
    from spmdzero import aot

    sys.path.insert(0, "examples")
    from model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = spmdzero.initialize(model=model, config={**TORCHAX, "zero_optimization": {"stage": 2}})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = model.example_inputs(16)
    step = aot.trace_step(engine, *batch)
    assert not engine.runs and not engine.traces and engine.global_steps == 0
    report = step.compile("v5e:2x4")
    assert report.backend == "torchax" and report.chips == 8 and "reduce-scatter" in report.collectives
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    with pytest.raises(ValueError, match="has 4 chips but the step was traced for a mesh of 8 devices"):
        step.compile("v5e:2x2")
    with pytest.raises(TypeError, match=r"spmdzero.aot.trace_step\(engine, \*batch\)"):
        with aot.capture(engine):
            pass
    engine.backward(engine(*batch))
    engine.step()
    assert engine.global_steps == 1 and engine.traces == {"train_forward": 1, "update": 1}


@pytest.mark.slow
def test_the_command_compiles_the_torchax_step_for_16_chips_without_retargeting(tmp_path):
    """A config naming no backend in a shell whose ``SPMDZERO_BACKEND`` is torchax (the
    default): the torchax step, as ``initialize`` would build it, lowered on an abstract
    16-device mesh (no 16 CPU devices, no retargeting) and compiled for v5e:4x4."""
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    out = run_python(f"""
        import spmdzero_cli
        spmdzero_cli.main(["aot", "--topology", "v5e:4x4", "--deepspeed_config", {str(tmp_path / 'ds.json')!r},
                           "--stages", "0,2", "--json"])
    """, env={"SPMDZERO_BACKEND": "torchax"})
    result = json.loads(out[out.index("{"):])
    stage0, stage2 = result["reports"]
    assert result["backend"] == stage0["backend"] == stage2["backend"] == "torchax"
    assert stage2["chips"] == 16 and stage2["micro_batch"] == 2 and stage2["fits"]
    P = stage2["gradient_bytes"] // 4
    batch_bytes = 2 * 2 * 32 * 4
    # ZeRO-0: parameters and Adam's moments replicated (12P); ZeRO-2: the moments split over the
    # 16 chips (8 x 2 mesh), TinyGPT's small shards padded to whole TPU tiles
    assert stage0["memory"]["argument"] - batch_bytes == pytest.approx(12 * P, rel=0.01)
    assert 4 * P + 8 * P / 16 <= stage2["memory"]["argument"] - batch_bytes < 4 * P + 8 * P / 4
    # the gradients go through the plan's two stages (rows over fsdp, then columns over
    # fsdp_inner): libtpu reduce-scatters them, where straight to their spec it all-reduced all
    assert stage2["collectives"]["reduce-scatter"]["tensors"] >= 8


def test_tpu7x_counts_two_devices_a_chip_and_takes_its_other_names():
    """A TPU7x chip is two JAX devices (libtpu's compile-only client lists 8 for ``2x2x1``);
    the mesh and every per-chip figure count devices."""
    from spmdzero import aot
    from spmdzero.tpu.chips import canonical

    assert aot.topology_chips("tpu7x:2x2x1") == aot.topology_chips("v7x:2x2x1") == 8
    assert aot.chip_spec("v7:2x2x2").generation == "tpu7x" and canonical("V7X:2x2x2") == "tpu7x:2x2x2"
    assert aot.chip_spec("tpu7x:2x2x1").hbm_bytes == 96 * 2**30
    assert aot.topology_chips("v6e:2x2") == 4 and aot.topology_chips("v5p:2x2x1") == 4


def test_a_generation_newer_than_the_installed_libtpu_names_the_version_that_knows_it(monkeypatch):
    from spmdzero.tpu import compile as tpu_compile

    monkeypatch.setattr(tpu_compile, "_libtpu_version", lambda: "0.0.21")
    assert "tpu7x needs libtpu 0.0.42 or newer" in tpu_compile._newer_libtpu_needed("v7x:2x2x1")
    assert tpu_compile._newer_libtpu_needed("v6e:2x2") is None
    assert tpu_compile._newer_libtpu_needed("v9z:2x2") is None  # not a generation spmdzero knows
    monkeypatch.setattr(tpu_compile, "_libtpu_version", lambda: "0.0.42.1")
    assert tpu_compile._newer_libtpu_needed("tpu7x:2x2x1") is None


@pytest.mark.slow
def test_v6e_and_tpu7x_compile_or_name_the_libtpu_that_does(tmp_path, capsys):
    """The same small Llama step on v6e:2x2 and on TPU7x (4 chips, 8 devices) with the installed
    libtpu: a report with its chips, or, where libtpu predates TPU7x (0.0.21), one line naming
    the version that knows it. `make test` runs this on both stacks."""
    import importlib.metadata

    from spmdzero.tpu.compile import _version_tuple

    model = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "max_position_embeddings": 128}
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "bf16": {"enabled": True}}
    v6e = aot_json(tmp_path, model, config, "--topology", "v6e:2x2", "--stages", "2", "--seq-len", "128")
    assert v6e["reports"][0]["chips"] == 4 and "v6" in v6e["reports"][0]["device_kind"]
    if _version_tuple(importlib.metadata.version("libtpu")) >= (0, 0, 42):
        v7 = aot_json(tmp_path, model, config, "--topology", "v7x:2x2x1", "--stages", "2", "--seq-len", "128")
        report = v7["reports"][0]
        assert report["chips"] == 8 and report["device_kind"] == "TPU7x" and report["fits"]
        # its collectives run on the SparseCores, called through async-starts: counted as on v6e
        assert report["collectives"]["reduce-scatter"]["bytes"] > 0 and report["traffic"]["ratio"] > 0.9, report
    else:
        from spmdzero.aot import command

        code = command.main(["--topology", "v7x:2x2x1", "--deepspeed_config", str(tmp_path / "ds.json"),
                             "--model", str(tmp_path), "--stages", "2", "--seq-len", "128"])
        err = capsys.readouterr().err
        assert code == 1 and "tpu7x needs libtpu 0.0.42 or newer" in err, err
        assert "Traceback" not in err
