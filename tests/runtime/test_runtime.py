"""Process-level behaviour: each test runs a fresh interpreter with its own device count."""

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow

TRAIN_ONE_STEP = """
    import torch, spmdzero
    model = torch.nn.Linear(8, 8)
    engine, *_ = spmdzero.initialize(model=model, config={"train_batch_size": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    loss = engine(torch.randn(8, 8)).pow(2).mean()
    engine.backward(loss); engine.step()
    print("world", engine.dp_world_size, "loss", round(loss.item(), 3) == round(loss.item(), 3))
"""


TORCH_XLA = {"SPMDZERO_BACKEND": "torch_xla"}  # torch_xla's runtime at import: its process-level behaviour


def test_cpu_backward_after_import_does_not_break_xla_backward():
    out = run_python("""
        import torch, spmdzero
        w = torch.randn(3, requires_grad=True)
        (w * 2).sum().backward()   # a CPU backward first: harmless once spmdzero is imported
    """, TRAIN_ONE_STEP, env=TORCH_XLA)
    assert "world 8" in out


def test_device_count_comes_from_cpu_num_devices():
    out = run_python(TRAIN_ONE_STEP, env={"CPU_NUM_DEVICES": "4", "PJRT_DEVICE": "CPU"})
    assert "world 4" in out


def test_default_is_eight_cpu_devices():
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "PJRT_DEVICE", "SPMDZERO_BACKEND")}
    import subprocess
    import sys

    from conftest import REPO

    for backend, expected in [("", ["cpu", "8"]), ("torch_xla", ["CPU", "8"])]:
        proc = subprocess.run([sys.executable, "-c", "import spmdzero, os, jax; from spmdzero import runtime; "
                               "n = runtime.device_count(); print(os.environ.get('PJRT_DEVICE', jax.devices()[0].platform"
                               " if not runtime.torch_xla_started() else None), n)"],
                              cwd=REPO, env={**env, "SPMDZERO_BACKEND": backend}, capture_output=True, text=True,
                              timeout=300)
        assert proc.stdout.split() == expected, proc.stderr[-2000:]


@pytest.mark.parametrize("variable, fix", [
    ("torch_xla", "Import spmdzero before running any backward pass"),  # its runtime at the import: too late
    ("", "Set SPMDZERO_BACKEND=torch_xla before `import spmdzero`"),  # started by a config at initialize
])
def test_backward_trap_before_import_is_explained(variable, fix):
    out = run_python("""
        import torch
        w = torch.randn(3, requires_grad=True)
        (w * 2).sum().backward()   # CPU backward before the XLA runtime exists: the trap
        import spmdzero
        model = torch.nn.Linear(8, 8)
        engine, *_ = spmdzero.initialize(model=model, config={"train_batch_size": 8,
                                                              "spmd": {"backend": "torch_xla"}})
        try:
            engine.backward(engine(torch.randn(8, 8)).sum())
        except RuntimeError as err:
            print("ERR", err)
    """, env={"SPMDZERO_BACKEND": variable})
    assert "ERR XLA backward failed because a backward pass ran on CPU" in out
    assert fix in out


def test_reinitializing_in_the_same_process_works():
    out = run_python("""
        import torch, spmdzero
        import torch_xla.debug.metrics as met
        model = torch.nn.Linear(8, 8)
        for run in range(2):   # a notebook cell run twice
            engine, *_ = spmdzero.initialize(model=model, config={"train_batch_size": 8,
                "zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
            for _ in range(2):
                engine.backward(engine(torch.randn(8, 8)).pow(2).mean()); engine.step()
            print("run", run, engine.global_steps)
    """)
    assert "run 0 2" in out and "run 1 2" in out


@pytest.mark.parametrize("level, shown", [(None, False), ("0", True)])
def test_xla_compiler_warnings_show_only_when_asked_for(level, shown):
    """XLA prints "GSPMD sharding propagation is going to be deprecated" on every torch_xla
    compile; it is hidden unless TF_CPP_MIN_LOG_LEVEL asks for warnings."""
    import os
    import subprocess
    import sys
    import textwrap

    from conftest import REPO

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update(TORCH_XLA)
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(TRAIN_ONE_STEP)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("GSPMD sharding propagation is going to be deprecated" in proc.stderr) == shown, proc.stderr[-2000:]


# Programs with collectives dispatched back to back, no host read between them: XLA:CPU's client
# pool must hold more than one thread a device (spmdzero.runtime.devices.size_cpu_thread_pool).
# With the pool XLA sizes by default, each of these aborted the process on a 2-core host
# ("Termination timeout for `all gather RendezvousKey{...}`").
BACK_TO_BACK = {
    "torchax": """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()), ("x",))
        rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
        x = jax.device_put(jnp.ones((8 * 64, 256)), rows)
        @jax.jit
        def step(a):
            for _ in range(6):
                a = jax.lax.with_sharding_constraint(a, whole)
                a = jnp.tanh(a @ a[:256].T[:, :256] * 0.01)
                a = jax.lax.with_sharding_constraint(a, rows)
            return a
        for _ in range(300):
            x = step(x)
        x.block_until_ready()
        devices = len(jax.devices())
    """,
    "torch_xla": """
        import numpy as np, torch, torch_xla.core.xla_model as xm, torch_xla.distributed.spmd as xs
        from spmdzero import runtime
        devices = runtime.device_count()
        mesh = xs.Mesh(np.arange(devices), (devices,), ("x",))
        x = torch.ones(devices * 64, 256, device=xm.xla_device()); xs.mark_sharding(x, mesh, ("x", None))
        for _ in range(200):
            for _ in range(4):
                x = torch.tanh(x @ x[:256].T[:, :256] * 0.01)
                xs.mark_sharding(x, mesh, (None, None)); x = x + 1; xs.mark_sharding(x, mesh, ("x", None))
            xm.mark_step()
        xm.wait_device_ops()
    """,
}


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_sharded_programs_back_to_back_never_stall_in_xla_cpus_collectives(backend):
    import os
    import subprocess
    import sys
    import textwrap

    from conftest import LAUNCHER_VARIABLES, REPO

    # NPROC unset, as in a user's shell: spmdzero sizes the pool itself
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and k != "NPROC"}
    env.update(SPMDZERO_BACKEND=backend, CPU_NUM_DEVICES="8", PJRT_DEVICE="CPU")
    source = "import os, spmdzero\n" + textwrap.dedent(BACK_TO_BACK[backend]) + \
        "\nprint('devices', devices, 'threads', os.environ.get('NPROC') or len(os.sched_getaffinity(0)))"
    proc = subprocess.run([sys.executable, "-c", source], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[:2] == ["devices", "8"] and int(words[3]) >= 16, proc.stdout
