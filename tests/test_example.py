"""The main job and the benchmark run end to end (short versions)."""

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow


def test_example_trains_and_reports_model_state_bytes():
    out = run_python("""
        import sys
        sys.argv = ["train.py", "--deepspeed_config", "examples/configs/zero1.json", "--steps", "10",
                    "--d-model", "64", "--samples", "512"]
        sys.path.insert(0, "examples")
        import train
        train.main()
    """)
    assert "ZeRO stage 1, mesh fsdp=8" in out
    assert "(10 optimizer steps, 0 skipped)" in out and "step 10/10" in out
    first, last = (float(v) for v in out.split("\nloss ")[1].split(" over")[0].split(" -> "))
    assert last < 0.9 * first  # it learns (10 steps of a small model)
    assert "by ZeRO stage" in out and " *1 " in out


def test_benchmark_runs_and_prints_both_ratios():
    out = run_python("""
        import sys
        sys.argv = ["step_time.py", "--steps", "1", "--repeats", "1", "--heavy-width", "256"]
        sys.path.insert(0, "benchmarks")
        import step_time
        step_time.main()
    """)
    assert "hand-written SPMD ZeRO-2" in out and "ZeRO-2 / ZeRO-0" in out
    assert out.count("recompiles during timing: 0") == 2
