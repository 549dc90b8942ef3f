"""The main job and the benchmark run end to end (short versions)."""

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["torch_xla", "torchax"])
def test_example_trains_and_reports_model_state_bytes(backend):
    """What `make train` prints (stderr and stdout, as one terminal shows them): the batch numbers
    once, the step logs each on a line of its own above the progress bar, the table whole. On
    either backend (``SPMDZERO_BACKEND``; the example's config names none)."""
    out = run_python("""
        import sys
        sys.stderr = sys.stdout  # one stream, in the order it was written
        sys.argv = ["train.py", "--deepspeed_config", "examples/configs/zero1.json", "--steps", "10",
                    "--d-model", "64", "--samples", "512"]
        sys.path.insert(0, "examples")
        import train
        train.main()
    """, env={"SPMDZERO_BACKEND": backend})
    assert "ZeRO stage 1, mesh fsdp=8" in out
    assert "(10 optimizer steps, 0 skipped)" in out and "10/10" in out
    first, last = (float(v) for v in out.split("\nloss ")[1].split(" over")[0].split(" -> "))
    assert last < 0.9 * first  # it learns (10 steps of a small model)
    assert out.count("batch rule") == 1  # not again for each engine the table builds
    logs = [line for line in out.split("\n") if "[spmdzero] step=" in line]
    assert logs and all(line.split("\r")[-1].startswith("[spmdzero] step=") for line in logs), logs
    lines = out.split("\n")
    top = next(i for i, line in enumerate(lines) if "by ZeRO stage" in line)
    assert [line.split()[0] for line in lines[top + 1:top + 5]] == ["stage", "0", "*1", "2"], lines[top:top + 5]


def test_a_hugging_face_model_trains_unchanged():
    out = run_python("""
        import sys
        sys.path.insert(0, "examples")
        import train_hf
        print("ratio", train_hf.main(["--deepspeed_config", "examples/configs/zero2.json", "--steps", "10"]))
    """)
    assert "GPT2LMHeadModel" in out and float(out.split("ratio")[1]) < 0.95


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


def test_comparison_benchmark_writes_its_table(tmp_path):
    """The torch_xla backend's benchmark (torch_xla's hand-written loop and FSDPv2 beside it)."""
    import subprocess
    import sys

    from conftest import NO_TORCH_XLA, REPO, TORCH_XLA

    if not TORCH_XLA:
        pytest.skip(NO_TORCH_XLA)

    out_file = tmp_path / "results.md"
    proc = subprocess.run([sys.executable, "benchmarks/compare.py", "--devices", "2", "--widths", "64",
                           "--steps", "1", "--repeats", "1", "--out", str(out_file)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = out_file.read_text()
    assert table.startswith("Measured with `python benchmarks/compare.py --devices 2")
    for variant in ("stage 0", "stage 1", "stage 2", "hand ZeRO-2", "FSDPv2", "JAX ZeRO-2"):
        assert f"| {variant} |" in table
