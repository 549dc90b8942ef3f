"""Shared helpers. Importing spmdzero gives this process 8 JAX CPU devices (the default, torchax
backend's runtime); torch_xla's runtime is started beside it at once, before any test runs a CPU
backward (spmdzero.runtime.process), so that both backends' engines run in this one process.
Tests needing another device count run in a subprocess (``run_python``)."""

import atexit
import contextlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

# libtpu's compile-only client (spmdzero aot, step.compile) takes the machine-wide flock
# /tmp/libtpu_lockfile; without this, a compile fails ("libtpu is in use by another process")
# whenever any other process on the machine (another test run, a notebook) holds it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# JAX's persistent compilation cache, empty when the run starts: the suite builds the same small
# programs over and over, in engine after engine and process after process, and each is compiled
# once per run (tests/backends/torchax/test_torchax_backend.py: 106 s -> 96 s, paired runs). The settings are
# those of `spmd.compile_cache_dir` (spmdzero.runtime.jax_runtime.enable_compile_cache: every
# program, however quick to compile), set as environment variables so that the subprocesses the
# tests start inherit them. JAX's cache only: torch_xla's counts no compile on a hit, and its
# tests count compiles. `make test` names one directory for its three pytest runs
# (SPMDZERO_TEST_COMPILE_CACHE); else each session makes and removes its own.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _compile_cache = os.environ.get("SPMDZERO_TEST_COMPILE_CACHE")
    if not _compile_cache:
        _compile_cache = tempfile.mkdtemp(prefix="spmdzero-tests-jax-cache-")
        atexit.register(shutil.rmtree, _compile_cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_compile_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")

# XLA:CPU compiles without LLVM's optimizations. The tests' models are tiny, so compiling is nearly
# all of a test's time and running is nearly none. The flag reaches both backends' CPU clients
# (JAX's and torch_xla's) and the tests' subprocesses. libtpu's compile-only client ignores it, so
# the TPU programs that `spmdzero aot` reports stay the same. Paired whole-process runs of
# tests/optim/test_optim_semantics.py: 88.0 s with the optimizations, 62.2 s without (median of 2 pairs,
# ratio 0.71). A level set outside is left as it is.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import spmdzero  # noqa: E402,F401  (starts the runtime before any test creates tensors)


# torch_xla is frozen at torch 2.9: the newest stack `make test` runs (the Makefile's NEWEST_STACK_TESTS)
# has none, and there every test of the torch_xla backend is skipped, saying so.
TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
NO_TORCH_XLA = "torch_xla is not installed (it needs torch 2.9; this is the newest stack's run)"


def pytest_configure(config):
    """torch_xla's runtime beside JAX's devices, before any test runs a backward on the host, in
    the pytest process only (a test's subprocess that imports this module for its helpers stays
    a default process)."""
    if TORCH_XLA:
        spmdzero.runtime.start_torch_xla("the torch_xla backend's tests")
    if config.option.durations is None:  # the slowest tests in every run's summary: the suite's time budget
        config.option.durations = 15

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_mlp(seed: int = 0, d_in: int = 16, d_hidden: int = 64, d_out: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.Tanh(), torch.nn.Linear(d_hidden, d_out))


class ReadsBack(torch.nn.Module):
    """A model whose forward reads a device value on the host inside the step: branches on
    it (``bool``), or copies it to the host (``.tolist()``). The recompilation guard's tests
    (observe/test_monitor.py) and the torchax backend's (backends/torchax/test_torchax_backend.py)."""

    def __init__(self, read: str = "bool"):
        super().__init__()
        self.mlp = tiny_mlp()
        self.read = read

    def forward(self, x):
        out = self.mlp(x)
        if self.read == "tolist":
            self.seen = out.sum().tolist()
            return out
        return out if bool((out.abs().sum() > 0)) else -out


def batches(n: int, batch: int, d_in: int = 16, d_out: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(n)]


LAUNCHER_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                                "MASTER_ADDR", "MASTER_PORT"})


def free_port_pair() -> int:
    """A port P with P + 1 free too (torch.distributed's store and JAX's coordinator), below the
    kernel's ephemeral range: a port that bind(0) lends is free only until some process's next
    outgoing connection or listener takes it, which on a busy machine (two test workers, each
    with multi-process tests) happens between our check and the launched processes' bind."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    start = 20000 if low > 21000 else 1024
    for _ in range(200):
        port = random.randrange(start, max(start + 2, low - 2))
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports below the ephemeral range")


def run_python(*code: str, env: dict | None = None, timeout: int = 600) -> str:
    """Run the code snippets, in order, in a fresh interpreter (its own device count);
    return stdout, fail on error."""
    # a fresh single process: the launcher's variables, if a test left them, would make it join
    # others through jax.distributed (spmdzero.runtime.jax_runtime)
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    full_env = {**inherited, **(env or {})}
    if full_env.get("SPMDZERO_BACKEND") == "torch_xla" and not TORCH_XLA:
        pytest.skip(NO_TORCH_XLA)
    source = "\n".join(textwrap.dedent(c) for c in code)
    proc = subprocess.run([sys.executable, "-c", source], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc.stdout


def aot_json(directory, model: dict, config: dict, *args: str, env: dict | None = None) -> dict:
    """``spmdzero aot --json`` on a transformers config (``model``, written with the DeepSpeed
    ``config`` into ``directory``) for v5e:2x2 unless ``args`` name a topology: its document."""
    import json

    json.dump(model, open(os.path.join(directory, "config.json"), "w"))
    json.dump(config, open(os.path.join(directory, "ds.json"), "w"))
    topology = [] if "--topology" in args else ["--topology", "v5e:2x2"]
    argv = ["aot", *topology, "--deepspeed_config", os.path.join(directory, "ds.json"), "--model", str(directory),
            *args, "--json"]
    out = run_python(f"import spmdzero_cli\nspmdzero_cli.main({argv!r})", env=env)
    return json.loads(out[out.index("{"):])


@contextlib.contextmanager
def spmdzero_log():
    """The records of the "spmdzero" logger (which does not propagate once its own handler is on)."""
    records, logger = [], logging.getLogger("spmdzero")
    handler = logging.Handler()
    handler.emit = records.append
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


BACKENDS = ["torchax", "torch_xla"]  # the default first


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Without torch_xla, a test that turns out to need it (an engine of ``spmd.backend:
    "torch_xla"``, a comparison with that backend, ``import torch_xla`` in the test or in its
    subprocess) is reported skipped, saying why, not failed: what it checks runs on the pinned
    stack, where torch_xla is installed."""
    outcome = yield
    report = outcome.get_result()
    if TORCH_XLA or call.excinfo is None or not report.failed:
        return
    error = call.excinfo.value
    text = str(error)
    if (isinstance(error, ModuleNotFoundError) and error.name and error.name.split(".")[0] == "torch_xla") or \
            "needs torch_xla, which is not installed" in text or "No module named 'torch_xla'" in text:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {NO_TORCH_XLA}")


def pytest_collection_modifyitems(config, items):
    """Without torch_xla, its backend's tests are skipped: those named for it (a ``torch_xla``
    parameter or name) and those marked ``torch_xla``."""
    if TORCH_XLA:
        return
    skip = pytest.mark.skip(reason=NO_TORCH_XLA)
    for item in items:
        if "torch_xla" in item.name or item.get_closest_marker("torch_xla"):
            item.add_marker(skip)


def compile_count(engine) -> int:
    """Programs compiled so far: the torchax engine's traces (a trace of a jitted program is
    its compile), or torch_xla's process-wide compile count."""
    if hasattr(engine, "traces"):
        return sum(engine.traces.values())
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def batch_device(backend: str) -> str:
    """Where the engine's loader leaves a batch: torch_xla's devices, or the host for the
    torchax engine, which places it at the forward."""
    return "xla" if backend == "torch_xla" else "cpu"


def on_host(t) -> torch.Tensor:
    """A CPU torch tensor of an engine's value: a torch_xla or torchax tensor, or a JAX array."""
    if isinstance(t, torch.Tensor):
        return t.detach().cpu()
    from torchax.ops import mappings

    return mappings.j2t(t, use_dlpack=False)
