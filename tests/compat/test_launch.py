"""``spmdzero launch``: DeepSpeed scripts (tests/compat/deepspeed_scripts, which never import
spmdzero) train, save and resume, and feed the rows per step the batch rule says.

Under ``spmdzero launch`` a DeepSpeed rank is a process (one per host; one here), so
a forward gets ``train_micro_batch_size_per_gpu`` rows and ``global_samples`` grows by
``train_batch_size`` per optimizer step."""

import os
import re
import subprocess
import sys

import pytest

from spmdzero.cli.launch import _parser, _ignored_options

from conftest import REPO, free_port_pair

SCRIPTS = os.path.join(REPO, "tests", "compat", "deepspeed_scripts")
STEP = re.compile(r"^STEP (\d+) rows=(\d+) global_samples=(\d+)", re.M)


def launch(*args: str, cwd, **variables: str) -> str:
    """``spmdzero launch ARGS`` through the console entry point, in a fresh process (with
    ``variables`` added to its environment)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **variables}
    env.pop("SPMDZERO_NO_RUNTIME", None)
    if "SPMDZERO_BACKEND" not in variables:  # the default, unless the run names one
        env.pop("SPMDZERO_BACKEND", None)
    command = [sys.executable, "-c", "import sys, spmdzero_cli; sys.exit(spmdzero_cli.main())", "launch", *args]
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"spmdzero launch failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def steps(output: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in m) for m in STEP.findall(output)]


def test_launcher_options_are_parsed_and_the_meaningless_ones_named():
    args = _parser().parse_args(["--num_gpus", "8", "--hostfile=/job/hosts", "--master_port", "1234", "--no_ssh",
                                 "train.py", "--deepspeed", "--local_rank", "3", "-e", "2"])
    assert (args.user_script, args.user_args, args.master_port) == (
        "train.py", ["--deepspeed", "--local_rank", "3", "-e", "2"], 1234)
    assert _ignored_options(args) == ["--hostfile=/job/hosts", "--num_gpus=8", "--no_ssh"]


LOSS = re.compile(r"^STEP \d+ .* loss=([-\d.]+)$", re.M)


@pytest.fixture(scope="module")
def cifar_run(tmp_path_factory):
    """cifar_style.py under launch on the default backend: 2 steps, save, reload, 1 step, eval."""
    tmp_path = tmp_path_factory.mktemp("cifar")
    script = os.path.join(SCRIPTS, "cifar_style.py")
    return launch("--num_gpus", "8", script, "--steps", "2", "--save_dir", str(tmp_path / "ck"), "--reload",
                  cwd=tmp_path)


@pytest.mark.slow
def test_cifar_style_script_on_the_torch_xla_backend_prints_the_same_losses(cifar_run, tmp_path):
    """The script computes its loss outside the model (``criterion(model_engine(inputs), labels)``)
    and runs unchanged on the torch_xla backend (``--spmd`` names it: the launcher gives the
    devices to torch_xla's runtime): the same losses as on the default backend, through the save
    and the reload."""
    script = os.path.join(SCRIPTS, "cifar_style.py")
    out = launch("--spmd", '{"backend": "torch_xla"}', script, "--steps", "2", "--save_dir", str(tmp_path / "ck"),
                 "--reload", cwd=tmp_path)
    assert steps(out) == steps(cifar_run) == [(1, 16, 16), (2, 16, 32), (3, 16, 48)]
    assert LOSS.findall(out) == LOSS.findall(cifar_run) and len(LOSS.findall(out)) == 3
    assert "EVAL total=8" in out


@pytest.mark.slow
def test_cifar_style_script_trains_saves_and_reloads(cifar_run):
    out = cifar_run
    assert "ignoring --num_gpus=8" in out
    # train_batch_size 16, one process: 16 rows per forward, 16 samples per step
    assert "RELOADED global_steps=2 global_samples=32" in out  # loaded back into the same engine
    assert steps(out) == [(1, 16, 16), (2, 16, 32), (3, 16, 48)]
    assert "EVAL total=8" in out  # the original's test loop: batches of 4 through the engine


@pytest.mark.slow
def test_bert_style_script_with_its_own_loader_trains_saves_and_resumes(tmp_path):
    """On the default backend: its own loader, a transformers model computing its loss,
    `pad_to_multiple_of` (its collator's `src_tokens` beside the mask: left whole, said once)."""
    script = os.path.join(SCRIPTS, "bert_style.py")
    ckpt = str(tmp_path / "exp")
    # --spmd: shape buckets for its pad-to-longest collator, without touching the script
    out = launch("--spmd", '{"pad_to_multiple_of": 32}', script, "--checkpoint_dir", ckpt, "--num_iterations", "2",
                 "--batch_size", "8", cwd=tmp_path)
    # its DataLoader's batch_size is train_micro_batch_size_per_gpu: 8 rows per step, as on 1 GPU
    assert steps(out) == [(1, 8, 8), (2, 8, 16)]
    assert out.count("shape buckets leave a batch with keys ['src_tokens', 'tgt_tokens'] unpadded") == 1
    out = launch(script, "--load_checkpoint_dir", ckpt, "--num_iterations", "3", cwd=tmp_path)
    assert "RESUMED checkpoint_step=2 global_steps=2" in out
    assert steps(out) == [(3, 8, 24)]


@pytest.mark.slow
def test_bert_style_script_on_the_torch_xla_backend_trains_saves_and_resumes(tmp_path):
    """Its own loader, a transformers model computing its loss, `pad_to_multiple_of`, save and
    resume, on the torch_xla backend."""
    script = os.path.join(SCRIPTS, "bert_style.py")
    ckpt, spmd = str(tmp_path / "exp"), '{"pad_to_multiple_of": 32, "backend": "torch_xla"}'
    out = launch("--spmd", spmd, script, "--checkpoint_dir", ckpt, "--num_iterations", "2", "--batch_size", "8",
                 cwd=tmp_path)
    assert steps(out) == [(1, 8, 8), (2, 8, 16)]
    out = launch("--spmd", spmd, script, "--load_checkpoint_dir", ckpt, "--num_iterations", "3", cwd=tmp_path)
    assert "RESUMED checkpoint_step=2 global_steps=2" in out
    assert steps(out) == [(3, 8, 24)]


@pytest.mark.slow
def test_chat_style_script_with_world_size_arithmetic_trains_saves_and_resumes(tmp_path):
    script = os.path.join(SCRIPTS, "chat_style.py")
    out_dir = str(tmp_path / "out")
    # train_batch_size = 4 per device * torch.distributed world size 1 * 2 accumulation steps = 8
    out = launch(script, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                 "--max_steps", "2", "--gradient_checkpointing", "--output_dir", out_dir, cwd=tmp_path)
    assert steps(out) == [(1, 4, 8), (2, 4, 16)]
    assert "EVAL ppl=" in out and os.path.isfile(os.path.join(out_dir, "pytorch_model.bin"))
    out = launch(script, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                 "--max_steps", "3", "--resume_dir", out_dir, cwd=tmp_path)
    assert "RESUMED global_steps=2 global_samples=16 epoch=0" in out
    assert steps(out) == [(3, 4, 24)]


@pytest.mark.slow
def test_chat_style_script_on_the_torch_xla_backend_trains_saves_and_resumes(tmp_path):
    """DeepSpeed-Chat's shape on the torch_xla backend: FusedAdam, a transformers schedule,
    gradient checkpointing, its all-reduced eval loss, save and resume."""
    script = os.path.join(SCRIPTS, "chat_style.py")
    out_dir, spmd = str(tmp_path / "out"), '{"backend": "torch_xla"}'
    common = ["--spmd", spmd, script, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
    out = launch(*common, "--max_steps", "2", "--gradient_checkpointing", "--output_dir", out_dir, cwd=tmp_path)
    assert steps(out) == [(1, 4, 8), (2, 4, 16)]
    assert "EVAL ppl=" in out and os.path.isfile(os.path.join(out_dir, "pytorch_model.bin"))
    out = launch(*common, "--max_steps", "3", "--resume_dir", out_dir, cwd=tmp_path)
    assert "RESUMED global_steps=2 global_samples=16 epoch=0" in out
    assert steps(out) == [(3, 4, 24)]


def test_launcher_environment_is_deepspeeds_for_one_process_per_host(monkeypatch):
    from spmdzero.cli.launch import _master_addr, set_launcher_env

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK",
                "CROSS_SIZE"):
        monkeypatch.setenv(key, "")  # recorded, so that what set_launcher_env sets is undone after the test
        monkeypatch.delenv(key)
    assert _master_addr(None, 1) == "127.0.0.1" and _master_addr("10.0.0.2", 4) == "10.0.0.2"
    set_launcher_env(process_index=3, process_count=4, master_addr="10.0.0.2", master_port=29600)
    assert {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                                       "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_SIZE": "1", "CROSS_RANK": "3", "CROSS_SIZE": "4",
        "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29600"}


@pytest.mark.slow
def test_init_distributed_joins_the_hosts_into_one_process_group(tmp_path):
    """Two processes standing for two hosts (the runtime's process index/count patched; no
    devices needed) rendezvous at MASTER_ADDR/MASTER_PORT and all-reduce."""
    port = free_port_pair()
    code = (
        "import os, sys\n"
        "os.environ['SPMDZERO_NO_RUNTIME'] = '1'\n"
        "from spmdzero import runtime\n"
        "runtime.hosts = lambda: (int(sys.argv[1]), 2)\n"
        "import torch, torch.distributed as dist\n"
        "from spmdzero.compat.deepspeed import comm\n"
        "comm.init_distributed()\n"
        "t = torch.tensor([float(sys.argv[1]) + 1])\n"
        "comm.all_reduce(t)\n"
        "dist.barrier()\n"
        "print(dist.get_rank(), dist.get_world_size(), t.item())\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert [o[0].split()[-3:] for o in outs] == [["0", "2", "3.0"], ["1", "2", "3.0"]]


def test_deepspeeds_short_launcher_options_are_named_under_their_long_names():
    args = _parser().parse_args(["-i", "localhost:0", "-H", "hosts", "-e", "localhost:1", "-q", "train.py"])
    assert _ignored_options(args) == ["--hostfile=hosts", "--include=localhost:0", "--exclude=localhost:1", "--quiet"]


LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "CPU_NUM_DEVICES", "SPMDZERO_BACKEND", "PJRT_DEVICE")


@pytest.mark.parametrize("variable,value,message", [
    ("MASTER_PORT", "abc", "MASTER_PORT='abc' in the environment is not a port number (0-65535)"),
    ("MASTER_PORT", "", "MASTER_PORT='' in the environment is not a port number"),
    ("MASTER_PORT", "99999", "MASTER_PORT='99999' in the environment is not a port number"),
    ("CPU_NUM_DEVICES", "x", "the runtime did not start: CPU_NUM_DEVICES='x' is not a device count"),
    ("CPU_NUM_DEVICES", "0", "CPU_NUM_DEVICES='0' is not a device count"),
    ("CPU_NUM_DEVICES", "-1", "CPU_NUM_DEVICES='-1' is not a device count"),
    ("SPMDZERO_BACKEND", "jax", "SPMDZERO_BACKEND='jax' is not a backend"),
])
def test_a_bad_environment_is_one_line_naming_the_variable(monkeypatch, capsys, tmp_path, variable, value, message):
    """``MASTER_PORT=abc`` was a ValueError traceback from int(); ``CPU_NUM_DEVICES=x``, 0 or -1
    gave torch_xla no device at all (every later step failed far from the cause); a bad
    ``SPMDZERO_BACKEND`` was a traceback. In this process the runtime has started: the check
    runs where a fresh process would start it."""
    from spmdzero.cli.launch import main

    for key in LAUNCHER_ENV:  # recorded, so restored (or removed) after the test, whatever launch sets
        present = key in os.environ
        monkeypatch.setenv(key, os.environ.get(key, ""))
        if not present:
            monkeypatch.delenv(key)
    monkeypatch.setenv(variable, value)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    assert main([str(script)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spmdzero launch: ") and message in err and len(err.splitlines()) == 1, err


def test_a_master_port_argument_out_of_range_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as done:
        _parser().parse_args(["--master_port", "70000", "train.py"])
    assert done.value.code == 2 and "argument --master_port: must be a port number (0-65535), got '70000'" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_a_bad_device_environment_is_one_line_from_the_console_entry_point(tmp_path):
    """Through ``spmdzero launch`` in a fresh process, where the runtime starts: the package
    import used to start it first, so a bad CPU_NUM_DEVICES or PJRT_DEVICE was a traceback."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    for variable, value, message, backend in [
            ("CPU_NUM_DEVICES", "x", "CPU_NUM_DEVICES='x' is not a device count", ""),
            ("PJRT_DEVICE", "GPU", "(PJRT_DEVICE='GPU'): spmdzero's JAX devices are TPU or CPU devices; PJRT_DEVICE=GPU "
                                   "is neither", ""),
            ("PJRT_DEVICE", "GPU", "(PJRT_DEVICE='GPU'): No PjRtPlugin registered for: GPU", "torch_xla")]:
        env = {**os.environ, "PYTHONPATH": REPO, variable: value, "SPMDZERO_BACKEND": backend}
        env.pop("SPMDZERO_NO_RUNTIME", None)
        command = [sys.executable, "-c", "import sys, spmdzero_cli; sys.exit(spmdzero_cli.main())", "launch",
                   str(script)]
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        err = [line for line in proc.stderr.splitlines() if line.startswith("spmdzero launch:")]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(err) == 1 and message in err[0], \
            proc.stderr[-3000:]


def test_an_accelerate_config_becomes_the_environment_accelerate_launch_exports(tmp_path, monkeypatch):
    """``spmdzero launch --config_file accelerate.yaml``: the variables accelerate's launcher
    sets for a DeepSpeed run (``Accelerator()`` reads them), the multi-host keys as launch's
    own flags, and the GPU-picking keys named."""
    from spmdzero.cli.accelerate_config import read_accelerate_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text("{}")
    (tmp_path / "a.yaml").write_text(
        "distributed_type: DEEPSPEED\nmixed_precision: BF16\nnum_processes: 16\nnum_machines: 2\nmachine_rank: 1\n"
        "main_process_ip: 10.0.0.2\nmain_process_port: 29600\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
        "  zero3_init_flag: true\n  zero3_save_16bit_model: true\n  deepspeed_multinode_launcher: standard\n")
    launch = read_accelerate_config("a.yaml")
    assert launch.env == {
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_config_file,zero3_init_flag,zero3_save_16bit_model,"
                                       "deepspeed_multinode_launcher,mixed_precision"}
    assert launch.hosts == {"num_nodes": 2, "node_rank": 1, "master_addr": "10.0.0.2", "master_port": 29600}
    assert launch.ignored == ["deepspeed_config.deepspeed_multinode_launcher=standard", "num_processes=16"]
    (tmp_path / "b.json").write_text('{"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2, '
                                     '"gradient_clipping": 1.0, "offload_optimizer_device": "CPU"}}')
    launch = read_accelerate_config("b.json")
    assert (launch.env["ACCELERATE_DEEPSPEED_ZERO_STAGE"], launch.env["ACCELERATE_GRADIENT_CLIPPING"],
            launch.env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"], launch.env["ACCELERATE_MIXED_PRECISION"],
            launch.hosts) == ("2", "1.0", "cpu", "no", {})


def test_a_script_launched_as_accelerate_launches_it_gets_no_local_rank_argument(tmp_path):
    """``accelerate launch`` passes no ``--local_rank`` (it sets ``LOCAL_RANK``), and scripts written
    for it refuse one: transformers' ``run_clm_no_trainer.py`` stopped with "unrecognized arguments:
    --local_rank=0" under ``spmdzero launch --config_file``. DeepSpeed's launcher passes it."""
    (tmp_path / "a.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n")
    (tmp_path / "train.py").write_text("import os, sys\nprint('ARGV', sys.argv[1:], os.environ['LOCAL_RANK'])\n")
    as_accelerate = launch("--config_file", "a.yaml", "train.py", "--seed", "1", cwd=tmp_path)
    as_deepspeed = launch("train.py", "--seed", "1", cwd=tmp_path)
    assert "ARGV ['--seed', '1'] 0" in as_accelerate
    assert "ARGV ['--local_rank=0', '--seed', '1'] 0" in as_deepspeed


@pytest.mark.parametrize("text,message", [
    (None, "--config_file missing.yaml: cannot read it"),
    ("distributed_type: MULTI_GPU\n", "distributed_type is 'MULTI_GPU'; spmdzero launch runs DeepSpeed configs"),
    ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: nowhere.json\n",
     "deepspeed_config.deepspeed_config_file 'nowhere.json' is not a file"),
    ("distributed_type: DEEPSPEED\nnum_machines: two\n", "num_machines must be a whole number, got 'two'"),
    ("- a list\n", "an accelerate config is a mapping of settings, got list"),
])
def test_a_bad_accelerate_config_is_one_line_naming_the_file_and_key(tmp_path, capsys, monkeypatch, text, message):
    from spmdzero.cli.launch import main

    monkeypatch.chdir(tmp_path)
    name = "missing.yaml" if text is None else "a.yaml"
    if text is not None:
        (tmp_path / name).write_text(text)
    assert main(["--config_file", name, "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"spmdzero launch: --config_file {name}: ") and message in err and err.count("\n") == 1
