"""``spmdzero config check``."""

import json

import pytest

from spmdzero.cli.main import main

from conftest import run_python


def write(tmp_path, cfg):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_config_check_prints_the_resolved_config_noop_keys_and_memory(tmp_path, capsys):
    path = write(tmp_path, {"train_batch_size": 64, "gradient_accumulation_steps": 2,
                            "zero_optimization": {"stage": 2, "overlap_comm": True},
                            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
                            "spmd": {"mesh": {"data": 2, "fsdp": -1}}})
    assert main(["config", "check", path, "--devices", "8", "--params", "1000"]) == 0
    out = capsys.readouterr().out
    assert "data=2 x fsdp=4" in out and "data-parallel size 8" in out
    assert "micro batch per device    4" in out and "gradient accumulation     2" in out
    assert "Adam(lr=0.001)" in out and "WarmupLR(warmup_num_steps=10)" in out
    assert "zero_optimization.overlap_comm" in out
    # ZeRO-2, Adam, fsdp=4: 4P params + 4P/4 grads + 8P/4 states = 7 bytes/param
    assert "total                         7,000 B" in out


def test_config_check_counts_bf16_params_and_fp32_master_weights(tmp_path, capsys):
    """The README's bf16 ZeRO-2 figure, 2P + 14P/N: at N = 8, 3.75 bytes per parameter."""
    path = write(tmp_path, {"train_batch_size": 8, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert main(["config", "check", path, "--devices", "8", "--params", "1000"]) == 0
    out = capsys.readouterr().out
    assert "for 1,000 bfloat16 params" in out and "master weights" in out
    assert "total                         3,750 B" in out
    assert "under spmdzero launch (deepspeed.initialize) it is 'process'" in out  # the config sets no spmd.rank


@pytest.mark.parametrize("stage, total", [(2, "2,750"), (3, "1,000")])
def test_config_check_counts_bf16_master_weights_and_states_as_deepspeed_019_keeps_them(tmp_path, capsys, stage,
                                                                                        total):
    """``bf16_master_weights_and_grads`` with ``bf16_optimizer_states``: no fp32 masters, AdamW's
    states in bf16: 2P + 6P/N at stage 2 (2.75 bytes per parameter at N = 8), 8P/N at stage 3
    (the parameters sharded too; the check counted them whole at every stage)."""
    path = write(tmp_path, {"train_batch_size": 8,
                            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                     "bf16_optimizer_states": True},
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert main(["config", "check", path, "--devices", "8", "--params", "1000"]) == 0
    out = capsys.readouterr().out
    assert "master weights" not in out
    assert f"total                         {total} B" in out, out
    if stage == 3:  # the ZeRO-3 knob's stage-3 reason, as the runtime's warning gives it
        assert "stage3_param_persistence_threshold: XLA gathers each parameter" in out, out


def test_config_check_names_the_backend_initialize_would_build(tmp_path, capsys, monkeypatch):
    base = {"train_batch_size": 8, "optimizer": {"type": "AdamW"}}
    for spmd, variable, expected in [({}, "", "torchax (the config names none: the default"),
                                     ({}, "torch_xla", "torch_xla (the config names none"),
                                     ({"backend": "torch_xla"}, "", "torch_xla\n"),
                                     ({"backend": "torchax"}, "torch_xla", "torchax\n")]:
        monkeypatch.setenv("SPMDZERO_BACKEND", variable)
        path = write(tmp_path, {**base, "spmd": spmd})
        assert main(["config", "check", path, "--devices", "8"]) == 0
        assert f"backend (spmd.backend)    {expected}" in capsys.readouterr().out


def test_config_check_takes_a_config_as_the_hugging_face_docs_write_it(tmp_path, capsys):
    """The "auto" values are the Trainer's or accelerate's to fill in: said, not refused (they
    used to be: "'lr' is 'auto', which only an integration such as the HF Trainer can fill in")."""
    path = write(tmp_path, {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}})
    assert main(["config", "check", path, "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "AdamW(weight_decay=0.1)" in out
    assert 'optimizer.params lr, betas, eps are "auto": the Hugging Face Trainer or accelerate fills them in' in out
    assert 'scheduler.params hold "auto"' in out and 'the batch sizes are "auto"' in out


@pytest.mark.parametrize("cfg,devices,message", [
    ({"train_batch_size": 64}, 6, "64 != 10 \\* 1 \\* 6|train_batch_size"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": -1}}}, 8, "lr must be"),
    ({"train_batch_size": 8, "zero_optimization": {"stag": 1}}, 8, "did you mean 'stage'"),
])
def test_config_check_reports_errors_with_exit_code_2(tmp_path, capsys, cfg, devices, message):
    import re

    assert main(["config", "check", write(tmp_path, cfg), "--devices", str(devices)]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.slow
def test_console_entry_point_does_not_start_the_runtime(tmp_path):
    path = write(tmp_path, {"train_batch_size": 16})
    out = run_python(f"""
        import sys, spmdzero_cli
        code = spmdzero_cli.main(["config", "check", {path!r}])
        print("exit", code, "torch_xla loaded:", "torch_xla" in sys.modules)
    """, env={"CPU_NUM_DEVICES": "4"})
    assert "fsdp=4" in out and "exit 0 torch_xla loaded: False" in out


def test_the_commands_own_process_and_the_compile_process_leave_torch_unimported(tmp_path):
    """``spmdzero aot``'s own process only picks the backend and starts the child that traces;
    ``python -m spmdzero.tpu.compile`` only compiles text. Neither imports torch (about 2 s and
    570 MiB here, in every one of the command's processes before this was so), while
    ``spmdzero.initialize`` is still the function once its module has been imported by name."""
    path = write(tmp_path, {"train_batch_size": 8})
    out = run_python(f"""
        import os, sys
        os.environ["SPMDZERO_NO_RUNTIME"] = "1"
        import spmdzero_cli, spmdzero.cli.main, spmdzero.aot.command, spmdzero.tpu.compile
        from spmdzero.cli.main import _aot_backend
        backend = _aot_backend({path!r})
        print("backend", backend, "torch loaded:", "torch" in sys.modules)
        import spmdzero
        from spmdzero.initialize import with_backend
        print("initialize callable:", callable(spmdzero.initialize), "aot names:", callable(spmdzero.aot.compile_step))
    """, env={"SPMDZERO_BACKEND": "torchax"})
    assert "backend torchax torch loaded: False" in out, out
    assert "initialize callable: True aot names: True" in out, out


@pytest.mark.parametrize("shell, backend, traced", [
    (None, None, "torchax"), ("torch_xla", None, "torch_xla"), ("torchax", "torch_xla", "torch_xla"),
    (None, "torch_xla", "torch_xla"), ("torch_xla", "torchax", "torchax")])
def test_aot_traces_the_backend_initialize_would_build(tmp_path, monkeypatch, shell, backend, traced):
    """``spmdzero aot`` compiles the step of the engine ``spmdzero.initialize`` would build
    under this shell: the config's ``spmd.backend``, else ``SPMDZERO_BACKEND``'s (torchax when
    unset). torch_xla's is traced in a child whose devices are torch_xla's (the variable says so),
    one CPU device per chip; torchax's in a child whose devices are JAX's. Neither inherits
    SPMDZERO_NO_RUNTIME, and neither takes a TPU (PJRT_DEVICE=CPU)."""
    import subprocess

    seen = {}

    def fake_run(command, env):
        seen["command"], seen["env"] = command, env
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    if shell is None:
        monkeypatch.delenv("SPMDZERO_BACKEND", raising=False)
    else:
        monkeypatch.setenv("SPMDZERO_BACKEND", shell)
    monkeypatch.setenv("SPMDZERO_NO_RUNTIME", "1")
    path = write(tmp_path, {"train_batch_size": 8, **({"spmd": {"backend": backend}} if backend else {})})
    assert main(["aot", "--topology", "v5e:2x2", "--deepspeed_config", path]) == 0
    env = seen["env"]
    assert seen["command"][1:3] == ["-m", "spmdzero.aot"]
    assert "SPMDZERO_NO_RUNTIME" not in env and env["PJRT_DEVICE"] == "CPU"
    assert env["SPMDZERO_BACKEND"] == traced
    if traced == "torch_xla":
        assert env["CPU_NUM_DEVICES"] == "4"


def test_aot_refuses_a_backend_variable_that_names_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPMDZERO_BACKEND", "jax")
    path = write(tmp_path, {"train_batch_size": 8})
    assert main(["aot", "--topology", "v5e:2x2", "--deepspeed_config", path]) == 1
    assert "SPMDZERO_BACKEND='jax' is not a backend" in capsys.readouterr().err


@pytest.mark.parametrize("given, passed", [([], []), (["--scan-layers"], ["--scan-layers"]),
                                           (["--scan-layers", "stacked"], ["--scan-layers", "stacked"])])
def test_aot_passes_scan_layers_and_its_stacked_value_to_the_trace(tmp_path, monkeypatch, given, passed):
    import subprocess

    seen = {}
    monkeypatch.setattr(subprocess, "run", lambda command, env: seen.update(command=command)
                        or subprocess.CompletedProcess(command, 0))
    path = write(tmp_path, {"train_batch_size": 8})
    assert main(["aot", "--topology", "v5e:2x2", "--deepspeed_config", path, *given, "--json"]) == 0
    command = seen["command"]
    tail = command[command.index("--scan-layers"):-1] if "--scan-layers" in command else []
    assert tail == passed and command[-1] == "--json"


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_aot_traces_the_torchax_step_without_importing_torch_xla(tmp_path, monkeypatch, backend):
    """transformers imports accelerate, which imports torch_xla (3-4 s) unless USE_TORCH_XLA is
    off: the torchax child has it off, whatever this shell says; torch_xla's child keeps it."""
    import subprocess

    seen = {}
    monkeypatch.setenv("USE_TORCH_XLA", "1")
    monkeypatch.setattr(subprocess, "run", lambda command, env: seen.update(env=env)
                        or subprocess.CompletedProcess(command, 0))
    path = write(tmp_path, {"train_batch_size": 8, "spmd": {"backend": backend}})
    assert main(["aot", "--topology", "v5e:2x2", "--deepspeed_config", path, "--json"]) == 0
    assert seen["env"]["SPMDZERO_BACKEND"] == backend
    assert seen["env"]["USE_TORCH_XLA"] == ("0" if backend == "torchax" else "1")


def test_aot_refuses_another_scan_layers_value(tmp_path, capsys):
    path = write(tmp_path, {"train_batch_size": 8})
    with pytest.raises(SystemExit):
        main(["aot", "--topology", "v5e:2x2", "--deepspeed_config", path, "--scan-layers", "yes"])
    assert "'yes': give no value (spmd.scan_layers=true) or 'stacked'" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_spmdzero_is_the_spmdzero_command(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    path = write(tmp_path, {"train_batch_size": 16, "steps_per_print": 1e5,
                            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "set_grad_none": True}}})
    proc = subprocess.run([sys.executable, "-m", "spmdzero", "config", "check", path], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "set_grad_none=True" in proc.stdout
