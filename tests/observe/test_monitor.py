"""The recompilation guard, DeepSpeed-style step logs and monitors, and the console they print on."""

import io
import logging
import pathlib
import sys
import warnings

import pytest
import torch
import torch_xla.debug.metrics as met

import spmdzero

from conftest import BACKENDS, ReadsBack, batches, tiny_mlp

TORCH_XLA = {"backend": "torch_xla"}  # tests of what torch_xla's lazy tensors do


def config(**extra):
    return {"train_batch_size": 16, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, **extra}


def step(engine, x, y):
    engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))
    engine.step()


def test_guard_is_quiet_on_a_normal_run_and_warns_once_on_a_shape_change():
    # A model width no other test uses: XLA's in-process cache would otherwise already hold
    # the partial batch's program from an earlier test, and nothing would recompile.
    engine, *_ = spmdzero.initialize(model=tiny_mlp(d_in=11), config=config())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(6, 16, d_in=11):
            step(engine, x, y)
        assert not [w for w in caught if "recompiled" in str(w.message) or "graphs instead of one" in str(w.message)]
        for x, y in batches(2, 8, d_in=11):  # a smaller (partial) batch: a new program
            step(engine, x, y)
    fired = [w for w in caught if "recompiled after warm-up" in str(w.message)]
    assert len(fired) == 1 and "global step 7" in str(fired[0].message)
    assert "input shapes changed: [(16, 11)] -> [(8, 11)]" in str(fired[0].message)
    assert "a last, smaller batch? DataLoader(..., drop_last=True)" in str(fired[0].message)
    assert engine.recompile_guard.recompiles >= 1


def test_the_guard_tells_a_new_batch_size_from_new_sequence_lengths():
    from spmdzero.observe.monitor import _only_rows_changed

    assert _only_rows_changed(((16, 11), (16,)), ((8, 11), (8,)))
    assert not _only_rows_changed(((16, 18), (16, 18)), ((16, 15), (16, 15)))  # a seq2seq collator's padding
    assert not _only_rows_changed(((16, 11),), ((16, 11), (16,)))


@pytest.mark.parametrize("read", ["bool", "tolist"])
def test_guard_names_a_step_that_runs_two_graphs(read):
    """torch_xla cuts the step where the forward reads a value; the torchax backend runs such a
    forward eagerly (test_torchax_host_reads.py)."""
    engine, *_ = spmdzero.initialize(model=ReadsBack(read), config=config(spmd=TORCH_XLA))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(6, 16):
            step(engine, x, y)
    fired = [str(w.message) for w in caught if "graphs instead of one" in str(w.message)]
    assert len(fired) == 1 and "ran 2 graphs" in fired[0] and "global step 4" in fired[0]
    if read == "bool":  # named once: not also as the transfer torch_xla counts with it
        assert "counted 1 x aten::_local_scalar_dense (.item(), bool() or an `if` on a tensor) in the step" in fired[0]
    else:  # a read torch_xla counts nowhere
        assert "counted no .item() or bool() read" in fired[0] and ".tolist()" in fired[0]
    assert not [w for w in caught if "recompiled" in str(w.message)]


def test_max_recompiles_turns_the_warning_into_an_error():
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config(train_batch_size=32,
                                                                     spmd={"max_recompiles": 0}))
    for x, y in batches(4, 32):
        step(engine, x, y)
    with pytest.raises(RuntimeError, match="max_recompiles=0"):
        step(engine, *batches(1, 24)[0])  # a partial batch: a shape no earlier test compiled


@pytest.fixture
def spmdzero_log(caplog):
    """The spmdzero logger does not propagate (its lines would print twice); listen to it directly."""
    log = logging.getLogger("spmdzero")
    level = log.level
    log.addHandler(caplog.handler)
    log.setLevel(logging.INFO)
    yield caplog
    log.removeHandler(caplog.handler)
    log.setLevel(level)


def test_logging_reads_the_device_only_on_print_steps(spmdzero_log):
    caplog = spmdzero_log
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config(steps_per_print=4, spmd=TORCH_XLA))
    data = batches(12, 16)
    for x, y in data[:4]:  # warm-up, including the first print step
        step(engine, x, y)
    caplog.clear()
    transfers = []
    for x, y in data[4:]:
        step(engine, x, y)
        transfers.append((met.metric_data("TransferFromDeviceTime") or [0])[0])
    # steps 5..12: only the print step (8, 12) reads loss / grad norm from the device
    assert transfers[0] == transfers[1] == transfers[2] < transfers[3]
    assert transfers[3] == transfers[4] == transfers[5] == transfers[6] < transfers[7]
    lines = list(dict.fromkeys(r.getMessage() for r in caplog.records if r.name == "spmdzero"))
    assert len(lines) == 2 and lines[0].startswith("step=8, skipped=0, lr=[") and "loss=" in lines[0]
    assert "grad_norm=" in lines[0] and "samples/sec=" in lines[0]


def test_fp16_log_line_shows_the_loss_scale(spmdzero_log):
    caplog = spmdzero_log
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config(steps_per_print=2,
                                                                       fp16={"enabled": True, "initial_scale_power": 8}))
    for x, y in batches(2, 16):
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y.to(engine.device)))
        engine.step()
    assert "loss_scale=256" in caplog.records[-1].getMessage()


def test_sharding_report_agrees_with_the_shards_on_the_devices():
    import torch_xla
    import torch_xla.core.xla_model as xm

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    engine, *_ = spmdzero.initialize(model=model, config=config(bf16={"enabled": True}, spmd=TORCH_XLA))
    (x, y), = batches(1, 16, d_in=64, d_out=64)
    step(engine, x, y)
    between_steps = engine.sharding_report()  # no live gradient: its entries come from the plan
    engine.backward(torch.nn.functional.mse_loss(engine(x), y.to(engine.device)))  # a live gradient to compare
    torch_xla.sync()
    xm.wait_device_ops()  # the shards are read below: torch_xla refuses data an execution is still producing
    report = engine.sharding_report()
    assert between_steps.entries == report.entries
    tensors = {"param": lambda n: dict(engine.module.named_parameters())[n],
               "grad": lambda n: engine.grad_buffers()[n], "master": lambda n: engine.master_weights()[n]}
    for entry in report.entries:
        if entry.role in tensors:
            tensor = tensors[entry.role](entry.parameter)
        else:
            tensor = engine.optimizer.state[engine.master_weights()[entry.parameter]][entry.role]
        shards = torch_xla._XLAC._get_local_shards([tensor])[0]  # independent: the data on each device
        assert len(shards) == 8
        assert entry.device_bytes == max(s.numel() for s, _ in shards) * tensor.element_size(), entry
    totals = report.totals()
    assert totals["total"]["device"] == sum(e.device_bytes for e in report.entries)
    P = sum(p.numel() for p in model.parameters())
    assert report.zero_accounting()["total"] == pytest.approx(2 * P + 14 * P / 8, rel=0.01)
    assert "tiled 8x1" in str(report) and "<table>" in report._repr_html_()
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report)
    text = console.export_text()
    assert "exp_avg_sq" in text and "per-device totals" in text
    assert report.to_dict()["totals"]["params"]["device"] == 2 * P


@pytest.mark.slow
def test_compile_cache_dir_stores_the_compiled_programs(tmp_path):
    """The cache is switched on and written. (On XLA:CPU torch_xla 2.9 cannot deserialize the
    SPMD executables it stored: a second process counts PersistentCacheDeserializeFailure
    and compiles again, so the warm start itself can only show on TPU.)"""
    from conftest import run_python

    out = run_python(f"""
        import torch, spmdzero
        import torch_xla.debug.metrics as met
        engine, *_ = spmdzero.initialize(model=torch.nn.Linear(16, 16), config={{"train_batch_size": 16,
            "optimizer": {{"type": "Adam"}}, "spmd": {{"compile_cache_dir": {str(tmp_path)!r}, "backend": "torch_xla"}}}})
        engine.backward(engine(torch.randn(16, 16)).pow(2).mean()); engine.step()
        engine.get_lr()
        print("misses", met.counter_value("PersistentCacheMiss"))
    """)
    assert int(out.split("misses")[1]) >= 1
    assert len(list(tmp_path.iterdir())) >= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_csv_monitor_and_wall_clock_breakdown_write_deepspeeds_events(tmp_path, spmdzero_log, backend):
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config(
        steps_per_print=3, wall_clock_breakdown=True, spmd={"backend": backend},
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "run"}))
    for x, y in batches(6, 16):
        step(engine, x, y)
    loss_csv = (tmp_path / "run" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert loss_csv[0] == "step,train_loss" and [l.split(",")[0] for l in loss_csv[1:]] == ["48", "96"]
    assert (tmp_path / "run" / "Train_Samples_lr.csv").exists()
    assert (tmp_path / "run" / "Train_Samples_elapsed_time_ms_forward.csv").exists()
    timing = [r.getMessage() for r in spmdzero_log.records if r.getMessage().startswith("time (ms) | forward:")]
    # the device's own time: torch_xla's execution metric (JAX gives no such clock)
    assert timing and ("| device:" in timing[-1]) == (backend == "torch_xla")


def test_tensorboard_monitor_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config(
        steps_per_print=2, tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}))
    for x, y in batches(4, 16):
        step(engine, x, y)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss] == [32, 64]


def warm_up_then_evaluate(engine, data, read: bool):
    """Six training steps, then an evaluation forward on ``data[6]``, its output read or not."""
    for x, y in data[:6]:
        step(engine, x, y)
    engine.eval()
    with torch.no_grad():
        out = engine(data[6][0])
        if read:
            out.sum().item()
    engine.train()
    return out


def test_an_unread_evaluation_is_named_as_the_likely_cause_of_a_recompile():
    """An evaluation forward whose result is not read joins the next step's graph: the
    warning says so instead of listing causes that do not apply."""
    engine, *_ = spmdzero.initialize(model=tiny_mlp(d_in=13), config=config(spmd=TORCH_XLA))  # its lazy graph
    data = batches(8, 16, d_in=13)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pending = warm_up_then_evaluate(engine, data, read=False)  # noqa: F841  (kept, never read)
        step(engine, *data[7])
    fired = [str(w.message) for w in caught if "recompiled after warm-up" in str(w.message)]
    assert len(fired) == 1 and "An evaluation forward" in fired[0] and "torch_xla.sync()" in fired[0]


def test_monitors_without_an_output_path_write_where_deepspeed_does(tmp_path, monkeypatch):
    """DeepSpeed joins an empty output_path with the job name: ./JOB/ in the working directory."""
    monkeypatch.chdir(tmp_path)
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config(
        steps_per_print=1, csv_monitor={"enabled": True, "job_name": "csvjob"}))
    step(engine, *batches(1, 16)[0])
    assert (tmp_path / "csvjob" / "Train_Samples_train_loss.csv").exists()


def test_an_evaluation_read_before_training_is_not_blamed_for_a_later_recompile():
    """The evaluation note lasts one step: a shape change many steps later is named as such."""
    engine, *_ = spmdzero.initialize(model=tiny_mlp(d_in=17), config=config())
    data = batches(10, 16, d_in=17)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warm_up_then_evaluate(engine, data, read=True)  # read: nothing pending
        for x, y in data[7:9]:
            step(engine, x, y)
        assert engine.recompile_guard._evaluated is False


class ConstantLoss(torch.nn.Module):
    """Its loss is the batch's first value: each micro-step's loss is chosen by the test."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.w * x[0, 0]


def test_train_loss_is_the_mean_over_the_accumulation_window(tmp_path, spmdzero_log):
    """Micro-batch losses 1, 2, 3, 4 in a window of 4: the step's train_loss is 2.5 (the window's
    mean, what older DeepSpeed engines log), not the last micro-batch's 4."""
    engine, *_ = spmdzero.initialize(model=ConstantLoss(), config={
        "train_batch_size": 32, "gradient_accumulation_steps": 4, "steps_per_print": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}})
    compiles = []
    for window in range(3):
        for value in (1.0, 2.0, 3.0, 4.0):
            engine.backward(engine(torch.full((8, 1), value + window)))
            engine.step()
        compiles.append(met.metric_data("CompileTime")[0])
    rows = (tmp_path / "run" / "Train_Samples_train_loss.csv").read_text().splitlines()[1:]
    assert [float(r.split(",")[1]) for r in rows] == [2.5, 3.5, 4.5]
    assert engine.step_loss() == 4.5 and engine.last_loss() == 6.0
    lines = [r.getMessage() for r in spmdzero_log.records if r.getMessage().startswith("step=")]
    assert "loss=4.5" in lines[-1]
    assert compiles[1] == compiles[2]  # the window's sum adds no graph after warm-up


class MseLoss(torch.nn.Module):
    """tiny_mlp with its loss: both backends take it (the torchax engine needs the loss returned)."""

    def __init__(self):
        super().__init__()
        self.mlp = tiny_mlp()

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.mlp(x), y)


def train_with_monitors(tmp_path, steps: int, backend: str = "torch_xla", **monitors):
    """``steps`` optimizer steps of 16 samples, printing every step, with csv_monitor on beside
    ``monitors``; returns the csv monitor's events as {(name, global samples): value}."""
    engine, *_ = spmdzero.initialize(model=MseLoss(), config=config(
        steps_per_print=1, spmd={"backend": backend},
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "csv"}, **monitors))
    for x, y in batches(steps, 16):
        engine.backward(engine(x, y))
        engine.step()
    events = {}
    for path in (tmp_path / "csv").iterdir():
        header, *rows = path.read_text().splitlines()
        name = "Train/Samples/" + header.split(",")[1]
        events.update({(name, int(step)): float(value) for step, value in (r.split(",") for r in rows)})
    return events


def read_wandb_history(run_file) -> dict:
    """The history rows of an offline run's .wandb file, as {(name, step): value}. The file is a
    LevelDB-style log of wandb's protobuf Records (32 KiB blocks, 7-byte chunk headers) after a
    7-byte ":W&B" header."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, pending, history = run_file.read_bytes(), 7, b"", {}
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the block's padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    name = item.key or "/".join(item.nested_key)  # "a/b" comes as nested_key ["a", "b"]
                    if not name.startswith("_"):  # wandb's own (_step, _runtime, _timestamp)
                        history[name, record.history.step.num] = json.loads(item.value_json)
    return history


@pytest.mark.parametrize("backend", ["torch_xla", "torchax"])
def test_wandb_monitor_logs_deepspeeds_events_at_their_global_samples(tmp_path, monkeypatch, backend):
    import wandb

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(name, value)
    try:
        csv_events = train_with_monitors(tmp_path, 3, backend, wandb={"enabled": True, "project": "p"})
        project, run_dir = wandb.run.project, pathlib.Path(wandb.run.dir).parent  # the run the engine started
    finally:
        wandb.finish()
        wandb.teardown()  # the next wandb.init reads the environment again (WANDB_DIR)
    (run_file,) = run_dir.glob("run-*.wandb")
    assert project == "p" and run_dir.name.startswith("offline-run-")
    history = read_wandb_history(run_file)
    assert {n for n, _ in csv_events} >= {"Train/Samples/train_loss", "Train/Samples/lr"}
    assert {s for _, s in csv_events} == {16, 32, 48}
    assert history.keys() == csv_events.keys()
    assert history == pytest.approx(csv_events, rel=1e-9)


def test_comet_monitor_logs_deepspeeds_events_every_samples_log_interval(tmp_path, monkeypatch):
    """Offline (``online: false``): the experiment is a zip of messages in COMET_OFFLINE_DIRECTORY.
    An event is logged the first time, then once ``samples_log_interval`` samples have passed."""
    import json
    import zipfile

    # read when comet_ml is first imported: no error reports to Comet's Sentry (no network here)
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "0")
    import comet_ml

    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    for what in ("ENV_DETAILS", "CODE", "GIT_METADATA", "GIT_PATCH", "ENV_CPU", "ENV_HOST", "ENV_GPU",
                 "ENV_NETWORK", "ENV_DISK", "CLI_ARGUMENTS"):  # nothing of this machine: faster, and not needed
        monkeypatch.setenv(f"COMET_AUTO_LOG_{what}", "0")
    try:
        csv_events = train_with_monitors(tmp_path, 5, comet={
            "enabled": True, "online": False, "project": "p", "experiment_name": "run", "samples_log_interval": 32})
    finally:
        experiment = comet_ml.get_running_experiment()
        experiment.end()
    assert experiment.get_name() == "run"
    (archive,) = (tmp_path / "comet").glob("*.zip")
    messages = [json.loads(line) for line in zipfile.ZipFile(archive).read("messages.json").decode().splitlines()]
    metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
    logged = {(m["metricName"], m["step"]): m["metricValue"] for m in metrics
              if m["metricName"].startswith("Train/")}
    # steps at 16, 32, 48, 64, 80 samples: logged at 16 (first), 48 and 80 (32 samples later each)
    assert logged == pytest.approx({k: v for k, v in csv_events.items() if k[1] in (16, 48, 80)}, rel=1e-9)
    assert {n for n, _ in logged} >= {"Train/Samples/train_loss", "Train/Samples/lr"}


def test_a_missing_monitor_package_is_named_once_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    monkeypatch.setitem(sys.modules, "comet_ml", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        csv_events = train_with_monitors(tmp_path, 2, wandb={"enabled": True}, comet={"enabled": True})
    said = [str(w.message) for w in caught if "package" in str(w.message)]
    assert len(said) == 2, said
    assert "wandb.enabled needs the 'wandb' package" in said[0] and "comet.enabled needs the 'comet_ml'" in said[1]
    assert ("Train/Samples/train_loss", 32) in csv_events  # the other monitors still write


def test_only_the_first_process_writes_the_monitors(tmp_path):
    """As DeepSpeed's MonitorMaster: the monitors of process 1 write nothing, but it still reads the
    device at the same steps as process 0 (the interval depends on the config only)."""
    from spmdzero.config.load import load_config
    from spmdzero.observe.monitor import StepLogger

    cfg = load_config(config=config(csv_monitor={"enabled": True, "output_path": str(tmp_path)}))
    first, second = StepLogger(cfg, process_index=0), StepLogger(cfg, process_index=1)
    assert len(first.monitors.writers) == 1 and second.monitors.writers == []
    assert first.interval == second.interval == 10


def test_step_logs_print_above_a_running_tqdm_bar_on_the_stderr_of_the_moment(monkeypatch):
    """The handler writes to sys.stderr as it is at each line (pytest closes the streams it swaps
    in: a handler bound to one printed "--- Logging error ---"), and through tqdm.write while a
    bar runs, so the line stands whole above the bar."""
    from tqdm import tqdm

    from spmdzero.observe import console

    log = logging.getLogger("spmdzero")
    saved = log.handlers, log.level, log.propagate
    log.handlers = []
    log.setLevel(logging.NOTSET)
    try:
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        console.log_block(["first"])  # the handler is made while this stream is sys.stderr
        sys.stderr.close()
        now = io.StringIO()
        monkeypatch.setattr(sys, "stderr", now)
        bar = tqdm(total=3, desc="training", mininterval=0)  # on sys.stderr: now; drawn at each update
        bar.update(1)
        console.log_block(["step=1, loss=2.0"])
        bar.update(1)
        bar.close()
    finally:
        log.handlers = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]
    text = now.getvalue()
    (line,) = [line for line in text.split("\n") if "step=1, loss=2.0" in line]
    assert line.split("\r")[-1] == "[spmdzero] step=1, loss=2.0", repr(text)
    assert "1/3" in text.split("step=1")[0] and "2/3" in text.split("step=1")[1]  # the bar, then below it
    assert "Logging error" not in text
