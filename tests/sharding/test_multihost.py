"""The multi-host and multislice planning, without the hardware: config -> mesh shapes ->
partition specs -> each host's batch slice."""

import re
import warnings

import pytest
import torch

from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.config.load import parse_config
from spmdzero.runtime import jax_runtime
from spmdzero.sharding.batch import resolve_batch
from spmdzero.train.data import ShardedDataLoader
from spmdzero.sharding.mesh import global_shape, resolve_hybrid_shape, resolve_mesh_shape
from spmdzero.sharding.plan import make_plan


# These processes join through jax.distributed, and their reference runs here on the default
# backend. In a process whose devices torch_xla holds (SPMDZERO_BACKEND=torch_xla: make
# test-torch-xla) there is no such reference: torch_xla's CPU client cannot join processes.
against_a_jax_reference = pytest.mark.skipif(
    not jax_runtime.selected(), reason="multi-host on CPU runs on JAX's runtime, and this process's is torch_xla's")


def shapes(spmd, devices):
    cfg = parse_config({"train_batch_size": 64, "spmd": spmd})
    return resolve_hybrid_shape(cfg.spmd.mesh, cfg.spmd.dcn_mesh, devices)


def test_multislice_keeps_fsdp_within_a_slice_and_data_across_slices():
    ici, dcn = shapes({"dcn_mesh": {"data": 2}}, devices=16)
    assert ici == {"data": 1, "fsdp": 8} and dcn == {"data": 2, "fsdp": 1}
    assert global_shape(ici, dcn) == {"data": 2, "fsdp": 8}
    ici, dcn = shapes({"mesh": {"data": 2, "fsdp": -1}, "dcn_mesh": {"data": 4}}, devices=64)
    assert global_shape(ici, dcn) == {"data": 8, "fsdp": 8}


def test_fsdp_never_crosses_dcn():
    with pytest.raises(ConfigError, match="spmd.dcn_mesh.fsdp"):
        parse_config({"train_batch_size": 8, "spmd": {"dcn_mesh": {"data": 2, "fsdp": 2}}})
    with pytest.raises(ConfigError, match="3 slices do not divide the 16 devices"):
        shapes({"dcn_mesh": {"data": 3}}, devices=16)


def test_partition_specs_on_the_global_mesh():
    ici, dcn = shapes({"dcn_mesh": {"data": 2}}, devices=16)
    plan = make_plan([("w", (1024, 64)), ("b", (64,))], global_shape(ici, dcn), stage=2)
    assert plan["w"].optimizer_state == ("fsdp", None) and plan["w"].grad == ("fsdp", None)
    assert plan["w"].param == (None, None)
    assert plan.batch_spec(2) == (("data", "fsdp"), None)


@pytest.mark.parametrize("hosts,devices_per_host", [(2, 4), (4, 4), (4, 8)])
def test_each_host_feeds_the_rows_of_its_own_devices(hosts, devices_per_host):
    devices = hosts * devices_per_host
    shape = resolve_mesh_shape(None, devices)
    batch = resolve_batch(DeepSpeedConfig(train_micro_batch_size_per_gpu=2), dp_devices=devices, processes=hosts)
    ranks = [list(batch.host_ranks(h)) for h in range(hosts)]
    assert [r for host in ranks for r in host] == list(range(devices))  # every rank, once, in order
    for device in range(shape["fsdp"]):  # the batch is split over devices in device order
        assert device in ranks[device // devices_per_host]


def test_a_host_loads_only_its_data_parallel_ranks():
    dataset = torch.utils.data.TensorDataset(torch.arange(64.0))
    batch = resolve_batch(DeepSpeedConfig(train_micro_batch_size_per_gpu=2), dp_devices=8, processes=2)
    loader = ShardedDataLoader(dataset, batch, process_index=1)
    assert [rank_loader.sampler.rank for rank_loader in loader.rank_loaders] == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match="8 data-parallel devices do not divide over 3 processes"):
        resolve_batch(DeepSpeedConfig(train_micro_batch_size_per_gpu=2), dp_devices=8, processes=3)


def test_under_the_process_rule_a_host_is_one_deepspeed_rank():
    dataset = torch.utils.data.TensorDataset(torch.arange(64.0))
    cfg = DeepSpeedConfig(train_micro_batch_size_per_gpu=8, spmd={"rank": "process"})
    batch = resolve_batch(cfg, dp_devices=8, processes=2)
    loader = ShardedDataLoader(dataset, batch, process_index=1)
    sampler = loader.rank_loaders[0].sampler
    assert len(loader.rank_loaders) == 1 and (sampler.rank, sampler.num_replicas) == (1, 2)
    assert loader.rank_loaders[0].batch_size == 8 and batch.rows_per_device == 2


# ---- several processes (hosts) in one mesh: the torchax backend, through jax.distributed ------------------------

SCRIPT = '''
"""A DeepSpeed script as users write one; `spmdzero launch` runs it on every host."""
import argparse
import os

import torch


class Net(torch.nn.Module):  # returns its loss (the torchax backend takes the gradient in the forward), or its output
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))

    def forward(self, x, y=None):
        out = self.body(x)
        return out if y is None else torch.nn.functional.mse_loss(out, y)


def dataset():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(128, 16, generator=g), torch.randn(128, 8, generator=g))


# a DeepSpeed rank is a device: 2 rows x 8 devices x 2 accumulation steps, on 1 or 2 processes
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
          "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "spmd": {"rank": "device"}}  # the default backend (torchax)


def train(engine, loader, die_at=None, outside=False):
    losses, norms = [], []
    for x, y in loader:
        # outside: the loss computed from the output, with this process's targets (cifar10_deepspeed.py)
        loss = torch.nn.functional.mse_loss(engine(x), y) if outside else engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.micro_steps % 2 == 0:  # an optimizer step
            norms.append(engine.get_global_grad_norm())
        if engine.global_steps == die_at:
            print("DYING", flush=True)
            os._exit(1)
    return losses, norms


if __name__ == "__main__":
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from spmdzero import runtime

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("--out")
    parser.add_argument("--die_rank", type=int, default=-1)
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--outside", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(100 + rank)  # each host its own weights: deepspeed.initialize takes process 0's
    engine, _, loader, _ = deepspeed.initialize(model=Net(), config=CONFIG, training_data=dataset())
    if args.load:
        engine.load_checkpoint(args.load)
    losses, norms = train(engine, loader, die_at=2 if rank == args.die_rank else None, outside=args.outside)
    if args.save:
        engine.save_checkpoint(args.save)
    torch.save({"losses": losses, "norms": norms, "hosts": runtime.hosts(), "devices": runtime.device_count(),
                "local_devices": get_accelerator().device_count(),
                "world": (engine.dp_world_size, dist.get_rank(), dist.get_world_size()),
                "samples": engine.global_samples, "rows": len(loader) and loader.batch_size,
                "traces": dict(engine.traces),
                "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}, args.out)
'''


class _Launched(list):
    """The launched processes' Popen objects, and how to launch them again (``again``)."""
    again = None


def _launch_hosts(tmp_path, *script_args, hosts: int = 2, script_text: str = SCRIPT, launch_args: tuple = ()):
    """``spmdzero launch --num_nodes 2 --node_rank I ...`` for each I, as on two hosts of 4 CPU
    devices each; returns the Popen objects (stdout and stderr to files in tmp_path)."""
    import os
    import subprocess
    import sys

    from conftest import REPO, free_port_pair

    script = tmp_path / "train.py"
    script.write_text(script_text)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT",
                                                             "SPMDZERO_NO_RUNTIME", "XLA_FLAGS")}
    env.update({"PYTHONPATH": REPO, "SPMDZERO_BACKEND": "", "JAX_PLATFORMS": "cpu", "PJRT_DEVICE": "CPU",
                "CPU_NUM_DEVICES": "4", "SPMDZERO_DISTRIBUTED_INIT_TIMEOUT": "60",
                "SPMDZERO_DISTRIBUTED_HEARTBEAT_TIMEOUT": "10", "PYTHONUNBUFFERED": "1"})
    port = free_port_pair()
    procs = _Launched()
    procs.again = lambda: _launch_hosts(tmp_path, *script_args, hosts=hosts, script_text=script_text,
                                        launch_args=launch_args)
    for i in range(hosts):
        command = [sys.executable, "-c", "import sys, spmdzero_cli; sys.exit(spmdzero_cli.main())", "launch", *launch_args,
                   "--num_nodes", str(hosts), "--node_rank", str(i), "--master_addr", "127.0.0.1",
                   "--master_port", str(port), str(script), "--out", str(tmp_path / f"out{i}.pt"), *script_args]
        with open(tmp_path / f"log{i}.txt", "w") as log:  # the child keeps its own copy of the file
            procs.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


# gloo's own rendezvous on localhost fails now and then on a loaded machine, before any of our
# code runs between the processes (pytorch/pytorch#53270 is the same in torch's own tests): one
# process stuck in torch's connectFullMesh while its peer had passed it and timed out in JAX's.
RENDEZVOUS_FAILURES = ("Gloo connectFullMesh failed", "Gloo context initialization failed")


def _all_succeed(procs, tmp_path, timeout: int = 240) -> None:
    """Wait for every launched process; on a failure show each one's log, since the first to
    report is often only the peer of the one that failed (a rendezvous error names the other).
    Processes that failed in gloo's rendezvous alone are launched once more, with a warning."""
    codes = [proc.wait(timeout=timeout) for proc in procs]
    logs = [(tmp_path / f"log{i}.txt").read_text() for i in range(len(procs))]
    rendezvous = any(failure in log for log in logs for failure in RENDEZVOUS_FAILURES)
    if any(codes) and rendezvous and procs.again is not None:
        warnings.warn(f"gloo's rendezvous failed (exit codes {codes}); the processes were launched once more")
        relaunched = procs.again()
        relaunched.again = None  # once
        return _all_succeed(relaunched, tmp_path, timeout)
    if any(codes):
        shown = "\n".join(f"--- process {i} (exit {code}):\n" + log[-3000:]
                          for i, (code, log) in enumerate(zip(codes, logs)))
        pytest.fail(f"exit codes {codes}\n{shown}")


def _reference(tmp_path):
    """The same script's model, data and config on this process's 8 devices."""
    import runpy

    import spmdzero

    (tmp_path / "ref.py").write_text(SCRIPT)
    script = runpy.run_path(str(tmp_path / "ref.py"))
    torch.manual_seed(100)
    engine, _, loader, _ = spmdzero.initialize(model=script["Net"](), config=script["CONFIG"],
                                               training_data=script["dataset"]())
    losses, norms = script["train"](engine, loader)
    return losses, norms, {n: p.detach().clone() for n, p in engine.module.named_parameters()}, engine


@pytest.mark.slow
@against_a_jax_reference
def test_two_processes_of_four_devices_train_as_one_process_of_eight(tmp_path):
    procs = _launch_hosts(tmp_path)
    losses, norms, params, engine = _reference(tmp_path)  # meanwhile, here
    _all_succeed(procs, tmp_path)
    outs = [torch.load(tmp_path / f"out{i}.pt") for i in range(2)]
    for i, out in enumerate(outs):
        assert out["hosts"] == (i, 2) and out["devices"] == 8 and out["local_devices"] == 4
        assert out["world"] == (8, i, 2)  # DeepSpeed's world: 8 devices; torch.distributed's: the 2 processes
        assert out["samples"] == engine.global_samples == 128 and out["rows"] == 2
        assert out["traces"] == dict(engine.traces)  # compiled once each, as on one process
        assert len(out["losses"]) == len(losses) == 8
        assert out["losses"] == pytest.approx(losses, abs=1e-6, rel=1e-6)  # global losses, the same on each
        assert out["norms"] == pytest.approx(norms, abs=1e-6, rel=1e-6)
        for name, value in params.items():  # process 0's initial weights (seeded 100), trained on all rows
            torch.testing.assert_close(out["params"][name], value, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@against_a_jax_reference
def test_a_loss_computed_outside_the_module_trains_on_two_processes_as_on_one(tmp_path):
    """``criterion(engine(x), y)`` on each host with its own targets: each process sees its own
    rows of the output (its DeepSpeed ranks' micro-batches) and its own loss, and the step
    applies the gradient of the processes' mean loss, as DeepSpeed averages its ranks'. The
    parameters and gradient norms are one process's of 8 devices with the loss in the module."""
    procs = _launch_hosts(tmp_path, "--outside")
    losses, norms, params, _ = _reference(tmp_path)
    _all_succeed(procs, tmp_path)
    outs = [torch.load(tmp_path / f"out{i}.pt") for i in range(2)]
    mean = [(a + b) / 2 for a, b in zip(outs[0]["losses"], outs[1]["losses"])]
    assert mean == pytest.approx(losses, abs=1e-6, rel=1e-6)  # each its own rows: their mean is the global loss
    assert all(a != pytest.approx(b, abs=1e-6) for a, b in zip(outs[0]["losses"], outs[1]["losses"]))
    for out in outs:
        assert out["norms"] == pytest.approx(norms, abs=1e-6, rel=1e-6)
        assert out["traces"]["vjp_forward"] == 1 and out["traces"]["backward"] <= 2  # compiled once each
        for name, value in params.items():
            torch.testing.assert_close(out["params"][name], value, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@against_a_jax_reference
def test_a_checkpoint_moves_from_one_process_to_two_and_back(tmp_path):
    """One process of 8 devices saves; two processes of 4 load it, train a pass and save, each
    host writing its own shards; one process loads that. Each resumed pass is the uninterrupted
    run's."""
    import runpy

    import spmdzero

    (tmp_path / "ref.py").write_text(SCRIPT)
    script = runpy.run_path(str(tmp_path / "ref.py"))

    def engine_seeded(seed):  # the weights a load must replace
        torch.manual_seed(seed)
        return spmdzero.initialize(model=script["Net"](), config=script["CONFIG"], training_data=script["dataset"]())

    def params(engine):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    engine, _, loader, _ = engine_seeded(100)
    script["train"](engine, loader)
    engine.save_checkpoint(str(tmp_path / "by_one"))
    second, after_second = script["train"](engine, loader), params(engine)
    third, after_third = script["train"](engine, loader), params(engine)

    procs = _launch_hosts(tmp_path, "--load", str(tmp_path / "by_one"), "--save", str(tmp_path / "by_two"))
    _all_succeed(procs, tmp_path)
    for i in range(2):
        out = torch.load(tmp_path / f"out{i}.pt")
        assert out["hosts"] == (i, 2) and out["samples"] == 2 * 128
        assert (out["losses"], out["norms"]) == (pytest.approx(second[0], abs=1e-6, rel=1e-6),
                                                 pytest.approx(second[1], abs=1e-6, rel=1e-6))
        for name, value in after_second.items():
            torch.testing.assert_close(out["params"][name], value, atol=1e-6, rtol=1e-6)
    state = tmp_path / "by_two" / "global_step8" / "state"
    assert sorted(p.name for p in state.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # a file per host

    engine, _, loader, _ = engine_seeded(7)
    engine.load_checkpoint(str(tmp_path / "by_two"))
    assert engine.global_steps == 8 and engine.global_samples == 2 * 128
    for name, value in params(engine).items():
        torch.testing.assert_close(value, after_second[name], atol=1e-6, rtol=1e-6)
    losses, norms = script["train"](engine, loader)
    assert losses == pytest.approx(third[0], abs=1e-6, rel=1e-6) and norms == pytest.approx(third[1], abs=1e-6,
                                                                                             rel=1e-6)
    for name, value in params(engine).items():
        torch.testing.assert_close(value, after_third[name], atol=1e-6, rtol=1e-6)


ACCELERATE_SCRIPT = """
import torch
from accelerate import Accelerator

accelerator = Accelerator()  # its DeepSpeed settings from the accelerate config, as accelerate launch exports them
loader = accelerator.prepare_data_loader(torch.utils.data.DataLoader(list(range(16)), batch_size=2))
print("ACCELERATE", accelerator.num_processes, accelerator.process_index, accelerator.distributed_type,
      [batch.tolist() for batch in loader], flush=True)
"""


@pytest.mark.slow
def test_accelerate_counts_the_hosts_and_gives_each_its_own_batches(tmp_path):
    """accelerate's ``PartialState`` found no process-group backend on a host without CUDA and took
    every host for process 0 of 1: its DeepSpeed batch size counted one process (refused by the
    batch check) and each host would have loaded the same batches. transformers'
    ``run_clm_no_trainer.py`` on 2 hosts now matches DeepSpeed's 2 ranks (docs/migrating.md)."""
    import ast

    (tmp_path / "accelerate.yaml").write_text("distributed_type: DEEPSPEED\nnum_machines: 2\n"
                                              "deepspeed_config:\n  zero_stage: 2\n")
    procs = _launch_hosts(tmp_path, script_text=ACCELERATE_SCRIPT, launch_args=("--config_file", "accelerate.yaml"))
    batches = []
    _all_succeed(procs, tmp_path)
    for i in range(len(procs)):
        log = (tmp_path / f"log{i}.txt").read_text()
        line = next(line for line in log.splitlines() if line.startswith("ACCELERATE "))
        count, index, kind, rest = line.split(" ", 4)[1:]
        assert (count, index, kind) == ("2", str(i), "DistributedType.DEEPSPEED"), line
        batches.append(ast.literal_eval(rest))
    rows = [row for host in batches for batch in host for row in batch]
    assert sorted(rows) == list(range(16)) and batches[0] != batches[1]  # each row once, on one host


TRAINER_SCRIPT = """
import argparse, json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int)
parser.add_argument("--out")
parser.add_argument("--rows", type=int)
args = parser.parse_args()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
row = {"input_ids": list(range(1, 17)), "labels": list(range(1, 17))}  # every row alike: any sharding, one batch
config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
training = TrainingArguments(output_dir=args.out + ".run", per_device_train_batch_size=args.rows, max_steps=3,
                             logging_steps=1, optim="sgd", learning_rate=0.5, report_to="none", save_strategy="no",
                             deepspeed=config)
trainer = Trainer(model=model, args=training, train_dataset=[row] * 64)
trainer.train()
logs = [(log["loss"], log["grad_norm"]) for log in trainer.state.log_history if "loss" in log]
print("TRAINER", training.world_size, json.dumps(logs), flush=True)
"""


@pytest.mark.slow
def test_the_trainers_loss_on_two_hosts_is_the_one_host_loss(tmp_path):
    """With ``average_tokens_across_devices`` the Trainer multiplies a loss by the process count,
    for DeepSpeed's ranks, each of which sums only its own tokens. The engine's module sums every
    host's (one global batch): on 2 hosts its loss and gradient came out doubled. 2 hosts of 4
    rows and 1 host of 8 train on the same batch here (every row alike), with SGD: the same
    logged losses and gradient norms."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    procs = _launch_hosts(tmp_path, "--rows", "4", script_text=TRAINER_SCRIPT)
    (tmp_path / "one.py").write_text(TRAINER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT",
                                                             "SPMDZERO_NO_RUNTIME", "XLA_FLAGS")}
    env.update({"PYTHONPATH": REPO, "SPMDZERO_BACKEND": "", "JAX_PLATFORMS": "cpu", "PJRT_DEVICE": "CPU",
                "CPU_NUM_DEVICES": "8"})
    one = subprocess.run([sys.executable, "-c", "import sys, spmdzero_cli; sys.exit(spmdzero_cli.main())", "launch",
                          str(tmp_path / "one.py"), "--out", str(tmp_path / "one"), "--rows", "8"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-4000:]
    runs = [one.stdout]
    _all_succeed(procs, tmp_path)
    runs += [(tmp_path / f"log{i}.txt").read_text() for i in range(len(procs))]
    results = []
    for out in runs:
        line = next(line for line in out.splitlines() if line.startswith("TRAINER "))
        world, logs = line.split(" ", 2)[1:]
        results.append((int(world), json.loads(logs)))
    assert [world for world, _ in results] == [1, 2, 2]
    reference = results[0][1]
    assert len(reference) == 3 and reference[2][0] < reference[0][0]  # SGD learned
    for _, logs in results[1:]:
        assert sum(logs, []) == pytest.approx(sum(reference, []), rel=1e-5), (logs, reference)


@pytest.mark.slow
def test_a_lost_process_stops_the_others_with_an_error_naming_it(tmp_path):
    import time

    procs = _launch_hosts(tmp_path, "--die_rank", "1")
    assert procs[1].wait(timeout=240) == 1
    died = time.monotonic()
    code = procs[0].wait(timeout=120)
    waited = time.monotonic() - died
    log = (tmp_path / "log0.txt").read_text()
    assert "DYING" in (tmp_path / "log1.txt").read_text()
    assert code != 0 and waited < 60, (code, waited, log[-3000:])
    # JAX's coordination service names the lost process: task N is --node_rank N. Its words depend
    # on where process 0 was when the heartbeats stopped (a collective, or already at the shutdown
    # barrier on a loaded machine: "heartbeat timeout"); jax 0.7 writes "/job:jax_worker/replica:0/task:1",
    # jax 0.10 the task's number alone on the line after "unhealthy (stopped sending heartbeats):"
    named = "task:1" in log or re.search(r"stopped sending heartbeats\):\s*\n\s*1\s*\n", log)
    assert ("stopped sending heartbeats" in log or "heartbeat timeout" in log) and named, log[-3000:]


@pytest.mark.slow
def test_a_process_whose_peers_never_come_says_so_within_the_initialization_timeout(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import REPO, free_port_pair

    env = {k: v for k, v in os.environ.items() if k not in ("SPMDZERO_NO_RUNTIME", "XLA_FLAGS")}
    env.update({"PYTHONPATH": REPO, "SPMDZERO_BACKEND": "", "JAX_PLATFORMS": "cpu", "PJRT_DEVICE": "CPU",
                "CPU_NUM_DEVICES": "4", "SPMDZERO_DISTRIBUTED_INIT_TIMEOUT": "3", "WORLD_SIZE": "2", "RANK": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_pair())})
    # a plain script (no launcher): the variables alone make `import spmdzero` join the others
    proc = subprocess.run([sys.executable, "-c", "import spmdzero"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "process 1 of 2 could not join the others through jax.distributed at 127.0.0.1:" in proc.stderr, \
        proc.stderr[-3000:]


def test_the_environment_names_the_processes_jax_distributed_joins(monkeypatch):
    from spmdzero.runtime import jax_runtime
    from spmdzero.runtime.jax_runtime import distributed_settings

    monkeypatch.setattr(jax_runtime, "_on_cloud_tpu_vm", lambda: True)

    base = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29600"}
    assert distributed_settings(base, "CPU") == {"coordinator_address": "10.0.0.2:29601", "num_processes": 2,
                                                 "process_id": 1}
    timeouts = {"SPMDZERO_DISTRIBUTED_INIT_TIMEOUT": "30", "SPMDZERO_DISTRIBUTED_HEARTBEAT_TIMEOUT": "10"}
    assert distributed_settings({**base, **timeouts}, "CPU") == {
        "coordinator_address": "10.0.0.2:29601", "num_processes": 2, "process_id": 1,
        "initialization_timeout": 30, "heartbeat_timeout_seconds": 10}
    assert distributed_settings({"MASTER_ADDR": "h0", "WORLD_SIZE": "3", "RANK": "0"}, "CPU")[
        "coordinator_address"] == "h0:29501"  # DeepSpeed's default MASTER_PORT, 29500
    assert distributed_settings({}, "CPU") is None and distributed_settings({"WORLD_SIZE": "1"}, "CPU") is None
    assert distributed_settings({**base, "SPMDZERO_DISTRIBUTED": "0"}, "CPU") is None
    assert distributed_settings({}, "TPU") == {}  # JAX finds the TPU VM's hosts itself
    assert distributed_settings(timeouts, "TPU") == {"initialization_timeout": 30, "heartbeat_timeout_seconds": 10}
    monkeypatch.setattr(jax_runtime, "_on_cloud_tpu_vm", lambda: False)
    assert distributed_settings({}, "TPU") is None  # libtpu without chips (this machine): nothing to discover
    for environ, message in [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 asks for 2 processes but RANK and MASTER_ADDR are not set"),
        ({**base, "RANK": "2"}, "RANK='2': this process's index among WORLD_SIZE=2 processes, 0 to 1"),
        ({**base, "WORLD_SIZE": "two"}, "WORLD_SIZE='two': the number of processes"),
        ({**base, "MASTER_PORT": "x"}, "MASTER_PORT='x': a TCP port"),
        ({**base, "SPMDZERO_DISTRIBUTED_HEARTBEAT_TIMEOUT": "0"}, "SPMDZERO_DISTRIBUTED_HEARTBEAT_TIMEOUT='0'"),
        ({"SPMDZERO_DISTRIBUTED": "maybe"}, "SPMDZERO_DISTRIBUTED='maybe'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            distributed_settings(environ, "CPU")


def test_launch_flags_name_the_hosts_and_are_checked():
    from spmdzero.cli.launch import _hosts_from_flags, _parser

    def hosts(*flags, join=True):
        return _hosts_from_flags(_parser().parse_args([*flags, "train.py"]), join)

    assert hosts() is None and hosts("--num_nodes", "1") == (0, 1)
    assert hosts("--num_nodes", "4", "--node_rank", "3", "--master_addr", "10.0.0.2") == (3, 4)
    # torch_xla's runtime finds a pod's hosts and their addresses: the flags are only checked against it
    assert hosts("--num_nodes", "4", join=False) == (None, 4)
    for flags, message in [
        (("--num_nodes", "2", "--master_addr", "h0"), "--num_nodes 2 needs --node_rank, this host's index (0 to 1)"),
        (("--num_nodes", "2", "--node_rank", "2", "--master_addr", "h0"), "(0 to 1), got 2"),
        (("--node_rank", "1",), "--node_rank 1 needs --num_nodes"),
        (("--num_nodes", "0",), "--num_nodes 0: the number of hosts"),
    ]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            hosts(*flags)


def test_torch_xlas_runtime_refuses_hosts_it_cannot_join(tmp_path, capsys, monkeypatch):
    """torch_xla's runtime finds its hosts itself (one here, on CPU): flags naming two are refused."""
    from spmdzero.cli.launch import main
    from spmdzero.runtime import jax_runtime

    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SPMDZERO_BACKEND", "torch_xla")
    monkeypatch.setattr(jax_runtime, "_decided", jax_runtime._decided)  # the launcher decides again: restored after
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert main(["--num_nodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1", str(script)]) == 2
    err = capsys.readouterr().err
    assert "--num_nodes 2 --node_rank 1, but the runtime found process 0 of 1" in err
    assert "use the torchax backend (the default: unset SPMDZERO_BACKEND" in err


GENERATE_SCRIPT = r'''
import argparse, os
import torch, transformers


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2))


def prompts(rank: int):
    """Each process its own left-padded prompts, of its own lengths (process 1's longer)."""
    g = torch.Generator().manual_seed(10 + rank)
    longest = 6 + 4 * rank
    ids = torch.randint(3, 96, (4, longest), generator=g)
    mask = torch.ones_like(ids)
    for row in range(4):
        mask[row, :row] = 0
        ids[row, :row] = 0
    return ids, mask


if __name__ == "__main__":
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "spmd": {"rank": "device"}}
    engine, *_ = deepspeed.initialize(model=tiny_llama(), config=config)
    engine.eval()
    ids, mask = prompts(rank)
    out = engine.module.generate(ids, attention_mask=mask, max_new_tokens=6 + 2 * rank, do_sample=False,
                                 pad_token_id=0)
    sampled = [engine.module.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=8,
                                      pad_token_id=0) for _ in range(2)]
    torch.save({"out": out, "sampled": sampled, "calls": engine.generation.calls,
                "traces": dict(engine.traces)}, args.out)
'''


@pytest.mark.slow
@against_a_jax_reference
def test_two_processes_generate_on_the_devices_each_its_own_prompts(tmp_path):
    """Each host's ``generate`` runs the program with the other's, on both hosts' prompts (of
    other lengths and token budgets), and keeps its own rows: plain PyTorch's greedy tokens for
    its prompts, stopped where PyTorch stops them; sampling draws from process 0's seed."""
    import runpy

    procs = _launch_hosts(tmp_path, script_text=GENERATE_SCRIPT)
    (tmp_path / "ref.py").write_text(GENERATE_SCRIPT)
    script = runpy.run_path(str(tmp_path / "ref.py"))
    plain = script["tiny_llama"]().eval()
    _all_succeed(procs, tmp_path)
    for rank in range(2):
        out = torch.load(tmp_path / f"out{rank}.pt")
        ids, mask = script["prompts"](rank)
        expected = plain.generate(ids, attention_mask=mask, max_new_tokens=6 + 2 * rank, do_sample=False,
                                  pad_token_id=0)
        torch.testing.assert_close(out["out"], expected, rtol=0, atol=0)
        assert out["calls"] == 3  # on the devices, not the host module
        assert out["traces"]["generate"] == 2  # greedy and sampled: one program each, both processes alike
        first, second = out["sampled"]
        assert first.shape == (4, ids.shape[1] + 5) and not torch.equal(first, second)  # a new seed a call
