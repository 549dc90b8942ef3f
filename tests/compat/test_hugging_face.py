"""Hugging Face's ``Trainer(args=TrainingArguments(deepspeed=...))`` and an accelerate loop
with ``Accelerator(deepspeed_plugin=...)``, unchanged, under ``spmdzero launch``
(tests/compat/hugging_face_scripts). Each is compared with the same script run as plain PyTorch on
the CPU (no DeepSpeed, no spmdzero), where the math is the same: the Trainer's own optimizer,
and the config's optimizer with DeepSpeed's WarmupLR (whose first two updates use lr 0: the
reference schedules its torch AdamW the same way). A run resumed from ``checkpoint-3``
reproduces the uninterrupted run's losses."""

import json
import os
import subprocess
import sys

import pytest

from conftest import LAUNCHER_VARIABLES, REPO

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

SCRIPTS = os.path.join(REPO, "tests", "compat", "hugging_face_scripts")
TRAINER = os.path.join(SCRIPTS, "trainer_gpt2.py")
LOOP = os.path.join(SCRIPTS, "accelerate_loop.py")

# HF's "auto" values everywhere TrainingArguments fills them
AUTO = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
CONFIG_OPTIMIZER = {**AUTO, "zero_optimization": {"stage": 2},
                    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                              "weight_decay": "auto"}},
                    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                                 "warmup_num_steps": "auto", "warmup_type": "linear"}}}
TRAINER_OPTIMIZER = {**AUTO, "zero_optimization": {"stage": 1}}
# the Trainer fills ZeRO-3's bucket sizes from the model's hidden size ("auto")
CONFIG_ZERO3 = {**CONFIG_OPTIMIZER, "zero_optimization": {
    "stage": 3, "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
    "reduce_bucket_size": "auto", "stage3_gather_16bit_weights_on_model_save": True}}


def _env(plain: bool, backend: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and k not in ("USE_TORCH_XLA", "ACCELERATE_TORCH_DEVICE", "SPMDZERO_BACKEND")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SPMDZERO_NO_RUNTIME", None)
    if plain:
        env["USE_TORCH_XLA"] = "0"  # plain PyTorch on the CPU: the reference
    else:
        env["SPMDZERO_BACKEND"] = backend  # the HF config names no backend
    return env


def _run(script: str, *args: str, launch: bool, cwd, backend: str = "torch_xla", launch_args=(), env=None) -> str:
    head = ([sys.executable, "-c", "import sys, spmdzero_cli; sys.exit(spmdzero_cli.main())", "launch",
             *launch_args] if launch else [sys.executable])
    proc = subprocess.run([*head, script, *args], cwd=cwd, env={**_env(not launch, backend), **(env or {})},
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{'spmdzero launch ' if launch else ''}{os.path.basename(script)} {' '.join(args)} failed "
                    f"({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout + proc.stderr


def _trainer(tmp, name: str, config, *args: str, backend: str = "torch_xla") -> dict:
    out, results = os.path.join(tmp, name), os.path.join(tmp, name + ".json")
    deepspeed = ["--deepspeed", "none"]
    if config is not None:
        path = os.path.join(tmp, name + "_ds.json")
        with open(path, "w") as f:
            json.dump(config, f)
        deepspeed = ["--deepspeed", path]
    _run(TRAINER, *deepspeed, "--out", out, "--results", results, *args, launch=config is not None, cwd=tmp,
         backend=backend)
    with open(results) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The plain-PyTorch runs, which no backend changes."""
    tmp = str(tmp_path_factory.mktemp("hf_reference"))
    return {"config_reference": _trainer(tmp, "config_reference", None, "--scheduler", "deepspeed_warmup"),
            "trainer_reference": _trainer(tmp, "trainer_reference", None, "--scheduler", "linear")}


@pytest.fixture(scope="module", params=["torch_xla", "torchax"])
def trainer_runs(request, references, tmp_path_factory):
    """Each backend's Trainer runs. The Trainer's own optimizer and bf16 run on the default backend
    only (the suite's time): on torch_xla, a torch optimizer and bf16 against DeepSpeed are
    test_deepspeed_parity's."""
    backend = request.param
    tmp = str(tmp_path_factory.mktemp(f"hf_{backend}"))
    runs = {
        "backend": backend,
        "config": _trainer(tmp, "config", CONFIG_OPTIMIZER, backend=backend),
        "zero3": _trainer(tmp, "zero3", CONFIG_ZERO3, backend=backend),
        **references,
    }
    if backend == "torchax":
        runs["trainer"] = _trainer(tmp, "trainer", TRAINER_OPTIMIZER, "--scheduler", "linear", backend=backend)
        runs["bf16"] = _trainer(tmp, "bf16", TRAINER_OPTIMIZER, "--scheduler", "linear", "--bf16", backend=backend)
    # with GPT-2's stock dropout (0.1), then resumed: a copy of that run's directory without
    # checkpoint-6, resumed from checkpoint-3
    runs["dropout"] = _trainer(tmp, "dropout", CONFIG_OPTIMIZER, "--dropout", "0.1", backend=backend)
    resumed = os.path.join(tmp, "resumed")
    subprocess.run(["cp", "-r", os.path.join(tmp, "dropout"), resumed], check=True)
    subprocess.run(["rm", "-r", os.path.join(resumed, "checkpoint-6")], check=True)
    runs["resumed"] = _trainer(tmp, "resumed", CONFIG_OPTIMIZER, "--dropout", "0.1", "--resume",
                               os.path.join(resumed, "checkpoint-3"), backend=backend)
    runs["dir"] = tmp
    return runs


def _close(a, b, tol):
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def test_the_trainer_reaches_the_engine_with_hfs_auto_values_filled(trainer_runs):
    engine = trainer_runs["config"]["engine"]
    assert engine["class"] == {"torchax": "spmdzero.backends.torchax.engine.engine",
                               "torch_xla": "spmdzero.backends.torch_xla.engine"}[trainer_runs["backend"]]
    # TrainingArguments: per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5
    assert (engine["micro"], engine["gas"], engine["clipping"], engine["bf16"]) == (4, 2, 0.5, False)
    assert engine["deepspeed_version"].split("+")[1].startswith("spmdzero")  # says it is spmdzero's layer
    if "bf16" in trainer_runs:
        assert trainer_runs["bf16"]["engine"]["bf16"] is True


def test_the_configs_optimizer_and_scheduler_train_as_plain_torch_would(trainer_runs):
    run, reference = trainer_runs["config"], trainer_runs["config_reference"]
    assert run["steps"] == [1, 2, 3, 4, 5, 6]
    assert _close(run["loss"], reference["loss"], 1e-5), (run["loss"], reference["loss"])
    assert _close(run["grad_norm"], reference["grad_norm"], 1e-4), (run["grad_norm"], reference["grad_norm"])
    assert abs(run["eval_loss"] - reference["eval_loss"]) < 1e-4


def test_the_trainers_own_optimizer_and_schedule_train_as_plain_torch_would(trainer_runs):
    if "trainer" not in trainer_runs:
        pytest.skip("the Trainer's own optimizer runs on the default backend (trainer_runs)")
    run, reference = trainer_runs["trainer"], trainer_runs["trainer_reference"]
    assert _close(run["loss"], reference["loss"], 1e-5), (run["loss"], reference["loss"])
    assert _close(run["lr"], reference["lr"], 1e-9)
    assert _close(run["grad_norm"], reference["grad_norm"], 1e-4)  # clipped at 0.5: the norms are above it


def test_bf16_trains_close_to_fp32(trainer_runs):
    if "bf16" not in trainer_runs:
        pytest.skip("bf16 runs on the default backend (trainer_runs)")
    run, reference = trainer_runs["bf16"], trainer_runs["trainer_reference"]
    assert run["loss"] != reference["loss"]  # bf16 compute
    assert _close(run["loss"], reference["loss"], 2e-3), (run["loss"], reference["loss"])


def test_checkpoint_n_resumes_as_the_uninterrupted_run_dropout_included(trainer_runs):
    """With dropout on, the resumed steps draw the uninterrupted run's masks: on the torchax
    backend the dropout key folds a count of micro-steps, which a load used to set to
    global_steps x gradient_accumulation_steps while the Trainer's engine counts one per optimizer
    step (5.4e-4 apart at step 4); it is saved and restored as rng.position now."""
    uninterrupted, resumed = trainer_runs["dropout"], trainer_runs["resumed"]
    assert uninterrupted["loss"] != trainer_runs["config"]["loss"]  # the dropout is on
    checkpoint = os.path.join(trainer_runs["dir"], "dropout", "checkpoint-3")
    assert os.path.isfile(os.path.join(checkpoint, "latest"))  # DeepSpeed's layout: engine.save_checkpoint
    assert os.path.isdir(os.path.join(checkpoint, "global_step3"))
    assert not os.path.exists(os.path.join(checkpoint, "optimizer.pt"))  # not the Trainer's own (or XLA's) save
    assert resumed["steps"] == [1, 2, 3, 4, 5, 6]
    assert resumed["loss"][3:] == uninterrupted["loss"][3:]
    assert resumed["grad_norm"][3:] == uninterrupted["grad_norm"][3:]


def test_zero_3_trains_as_stage_2_and_saves_whole_weights(trainer_runs):
    """At ZeRO-3 the Trainer saves through ``_zero3_consolidated_16bit_state_dict`` and reloads
    with ``from_pretrained`` under ``deepspeed.zero.Init`` (both stopped on the compat layer)."""
    run, stage2 = trainer_runs["zero3"], trainer_runs["config"]
    assert _close(run["loss"], stage2["loss"], 1e-6), (run["loss"], stage2["loss"])
    assert _close(run["grad_norm"], stage2["grad_norm"], 1e-5)
    assert run["reloaded_equal"], run["reloaded_max_diff"]


def test_save_model_writes_what_from_pretrained_loads(trainer_runs):
    for name in ("config", "bf16"):
        if name in trainer_runs:
            assert trainer_runs[name]["reloaded_equal"], trainer_runs[name]["reloaded_max_diff"]


@pytest.mark.parametrize("backend,plugin", [("torch_xla", "hf_ds_config"), ("torch_xla", "arguments"),
                                            ("torchax", "hf_ds_config"), ("torchax", "environment")])
def test_an_accelerate_loop_with_a_deepspeed_plugin_trains_as_plain_torch(backend, plugin, tmp_path):
    """"environment": ``Accelerator()`` with no plugin, configured as ``accelerate launch
    --config_file accelerate.yaml`` configures it, here by ``spmdzero launch --config_file``."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
                                  "gradient_clipping": 0.5, "zero_optimization": {"stage": 2}}))
    launch_args = ()
    if plugin == "environment":
        (tmp_path / "accelerate.yaml").write_text(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 8\n"
            "deepspeed_config:\n  deepspeed_config_file: ds.json\n  zero3_init_flag: false\n")
        launch_args = ("--config_file", "accelerate.yaml")
    _run(LOOP, "--plugin", "none", "--results", str(tmp_path / "ref.json"), launch=False, cwd=tmp_path)
    out = _run(LOOP, "--plugin", plugin, "--config", str(config), "--results", str(tmp_path / "run.json"),
               launch=True, cwd=tmp_path, backend=backend, launch_args=launch_args)
    if plugin == "environment":  # one process per host drives every chip
        assert "ignoring num_processes=8" in out, out[-2000:]
    assert f"distributed_type DistributedType.DEEPSPEED engine spmdzero.backends.{backend}.engine" in out
    run, reference = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("run", "ref"))
    assert len(run["loss"]) == 8
    assert _close(run["loss"], reference["loss"], 1e-5), (run["loss"], reference["loss"])
    flat = [x for w in run["weights"] for x in (w if isinstance(w[0], float) else sum(w, []))]
    flat_ref = [x for w in reference["weights"] for x in (w if isinstance(w[0], float) else sum(w, []))]
    assert _close(flat, flat_ref, 1e-5)


def test_a_seq2seq_trainer_that_generates_at_zero_3_trains_and_predicts_as_plain_torch(tmp_path):
    """transformers' translation and summarization examples: ``Seq2SeqTrainer`` with
    ``predict_with_generate`` generates from the trained weights, token for token as plain
    PyTorch, at ZeRO-3 on the default backend, on the devices."""
    script = os.path.join(SCRIPTS, "seq2seq_t5.py")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**AUTO, "zero_optimization": {"stage": 3}}))
    _run(script, "--out", str(tmp_path / "ref"), "--results", str(tmp_path / "ref.json"), launch=False, cwd=tmp_path)
    _run(script, "--deepspeed", str(config), "--out", str(tmp_path / "run"), "--results", str(tmp_path / "run.json"),
         launch=True, cwd=tmp_path, backend="torchax")
    run, reference = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("run", "ref"))
    assert run["engine"] == "spmdzero.backends.torchax.engine.engine"
    assert len(run["loss"]) == 24 and run["loss"][-1] < run["loss"][0]
    assert len({tuple(g) for g in reference["generated"]}) > 8  # it learned: not one sequence for all
    assert _close(run["loss"], reference["loss"], 1e-5), (run["loss"], reference["loss"])
    assert _close(run["grad_norm"], reference["grad_norm"], 1e-4)
    assert abs(run["eval_loss"] - reference["eval_loss"]) < 1e-5
    assert run["generated"] == reference["generated"]
    assert run["device_generate_calls"] == 2  # predict's 2 batches: on the devices


def test_auto_find_batch_size_shrinks_the_batch_when_the_device_runs_out_of_memory(tmp_path):
    """XLA says RESOURCE_EXHAUSTED where CUDA says "out of memory."; the engine raises torch's
    OutOfMemoryError, so the Trainer's ``--auto_find_batch_size`` tries smaller batches, as plain
    PyTorch does when its allocator fails (spmdzero/runtime/out_of_memory.py). One device: on
    eight XLA:CPU devices a failed allocation inside the sharded program hangs instead of raising.
    The engines of the failed tries are released: the live device bytes are one engine's."""
    script = os.path.join(SCRIPTS, "trainer_out_of_memory.py")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**AUTO, "zero_optimization": {"stage": 2}}))
    _run(script, "--out", str(tmp_path / "ref"), "--results", str(tmp_path / "ref.json"), launch=False, cwd=tmp_path)
    _run(script, "--deepspeed", str(config), "--out", str(tmp_path / "run"), "--results", str(tmp_path / "run.json"),
         launch=True, cwd=tmp_path, backend="torchax", env={"CPU_NUM_DEVICES": "1", "PJRT_DEVICE": "CPU"})
    run, reference = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("run", "ref"))
    assert reference["batch_size"] == run["batch_size"] <= 2, (reference["batch_size"], run["batch_size"])
    assert len(run["loss"]) == 3 and _close(run["loss"], reference["loss"], 1e-5), (run["loss"], reference["loss"])
    assert _close(run["weight"], reference["weight"], 1e-5)
    # what the device holds is the last engine's model states (ZeRO's accounting, read from its
    # arrays): nothing of the engines built for the batches that did not fit
    assert run["engine_bytes"] >= 16 * run["parameters"]  # fp32 AdamW: parameters, gradients, two moments
    assert run["live_bytes"] <= 1.05 * run["engine_bytes"], (run["live_bytes"], run["engine_bytes"])
