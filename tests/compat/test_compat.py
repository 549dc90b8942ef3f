"""The DeepSpeed compatibility layer: each DeepSpeed name scripts import resolves through
the ``deepspeed`` alias and behaves as DeepSpeed's does (or as a documented no-op)."""

import argparse
import importlib
import inspect
import itertools
import logging
import os
import sys
import subprocess
import textwrap
import types

import pytest
import torch
import torch.distributed as dist

import spmdzero
from spmdzero.compat import alias

from conftest import REPO, batches, free_port_pair, tiny_mlp


@pytest.fixture(scope="module")
def deepspeed():
    """The alias for this module's tests, then removed, so other tests see no ``deepspeed``."""
    from spmdzero.compat import hugging_face

    had_group = dist.is_initialized()
    environment = {k: os.environ.get(k) for k in ("USE_TORCH_XLA", "ACCELERATE_TORCH_DEVICE")}
    spmdzero.alias_deepspeed()
    import deepspeed as ds

    yield ds
    for key, value in environment.items():  # what the alias set for Hugging Face (compat.hugging_face)
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not isinstance(f, (alias.DeepSpeedAlias, hugging_face._PatchOnLoad))]
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]
    if dist.is_initialized() and not had_group:
        dist.destroy_process_group()


def test_the_deepspeed_distribution_is_spmdzeros_layer_while_the_alias_is_installed(deepspeed):
    """transformers and accelerate check DeepSpeed by its installed metadata
    (``dep_version_check("deepspeed")``): it answers, says whose it is, and compares as the
    DeepSpeed release it mirrors; only the name ``deepspeed`` is answered."""
    import importlib.metadata

    from packaging.version import Version

    version = importlib.metadata.version("deepspeed")
    assert version == deepspeed.__version__ and version.endswith("+spmdzero." + spmdzero.__version__)
    assert Version(version) >= Version("0.9.3")  # transformers' requirement
    assert "spmdzero" in importlib.metadata.metadata("deepspeed")["Summary"]
    finder = alias.DeepSpeedAlias()
    context = importlib.metadata.DistributionFinder.Context
    assert list(finder.find_distributions(context(name=None))) == []  # "all distributions": the real ones only
    assert list(finder.find_distributions(context(name="torch"))) == []
    assert os.environ["USE_TORCH_XLA"] == "0"  # HF's DeepSpeed path, not its torch_xla one


NAMES = [
    ("deepspeed", "initialize"), ("deepspeed", "init_distributed"), ("deepspeed", "add_config_arguments"),
    ("deepspeed", "get_accelerator"), ("deepspeed", "zero"), ("deepspeed", "comm"), ("deepspeed", "log_dist"),
    ("deepspeed", "logger"), ("deepspeed", "DeepSpeedEngine"), ("deepspeed", "__version__"),
    ("deepspeed.accelerator", "get_accelerator"), ("deepspeed.accelerator.real_accelerator", "get_accelerator"),
    ("deepspeed.comm", "get_rank"), ("deepspeed.comm", "get_world_size"), ("deepspeed.comm", "get_local_rank"),
    ("deepspeed.comm", "barrier"), ("deepspeed.comm", "all_reduce"), ("deepspeed.comm", "broadcast"),
    ("deepspeed.comm", "is_initialized"), ("deepspeed.comm", "init_distributed"), ("deepspeed.comm", "ReduceOp"),
    ("deepspeed.ops.adam", "FusedAdam"), ("deepspeed.ops.adam", "DeepSpeedCPUAdam"), ("deepspeed.ops.lamb", "FusedLamb"),
    ("deepspeed.utils", "logger"), ("deepspeed.utils", "log_dist"), ("deepspeed.utils", "RepeatingLoader"),
    ("deepspeed.comm", "all_gather_into_tensor"), ("deepspeed.comm", "reduce_scatter_tensor"),
    ("deepspeed.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint"),
    ("deepspeed.utils.zero_to_fp32", "convert_zero_checkpoint_to_fp32_state_dict"),
    ("deepspeed.utils.zero_to_fp32", "load_state_dict_from_zero_checkpoint"),
    ("deepspeed.runtime.lr_schedules", "VALID_LR_SCHEDULES"), ("deepspeed.runtime.lr_schedules", "WarmupLR"),
    ("deepspeed.runtime.lr_schedules", "WarmupDecayLR"), ("deepspeed.runtime.lr_schedules", "WarmupCosineLR"),
    ("deepspeed.runtime.lr_schedules", "OneCycle"), ("deepspeed.runtime.lr_schedules", "LRRangeTest"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine"), ("deepspeed.runtime.utils", "see_memory_usage"),
    ("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus"),
    ("deepspeed.runtime.zero.partition_parameters", "GatheredParameters"),
    ("deepspeed.runtime.zero", "Init"), ("deepspeed.compression.helper", "recursive_getattr"),
    ("deepspeed.compression.helper", "recursive_setattr"), ("deepspeed.checkpoint.utils", "clone_tensors_for_torch_save"),
    ("deepspeed.moe.utils", "split_params_into_different_moe_groups_for_optimizer"),
]


@pytest.mark.parametrize("module,name", NAMES, ids=[f"{m}.{n}" for m, n in NAMES])
def test_from_deepspeed_import_resolves_to_the_compat_module(deepspeed, module, name):
    imported = importlib.import_module(module)
    assert hasattr(imported, name)
    assert imported is sys.modules["spmdzero.compat" + "." + module]  # one module object under both names


@pytest.mark.parametrize("module,feature", [("deepspeed.pipe", "pipeline parallelism"),
                                            ("deepspeed.moe.layer", "Mixture of Experts"),
                                            ("deepspeed.inference", "DeepSpeed-Inference"),
                                            ("deepspeed.ops.sparse_attention", "sparse attention")])
def test_out_of_scope_features_raise_an_import_error_naming_them(deepspeed, module, feature):
    with pytest.raises(ImportError, match=feature) as err:
        importlib.import_module(module)
    assert not isinstance(err.value, ModuleNotFoundError)


def test_unknown_deepspeed_module_is_module_not_found_with_a_pointer(deepspeed):
    with pytest.raises(ModuleNotFoundError, match="compatibility layer does not provide"):
        importlib.import_module("deepspeed.no_such_module")
    with pytest.raises(AttributeError, match="DeepSpeed-Inference"):
        deepspeed.init_inference
    with pytest.raises(AttributeError, match="Mixture of Experts"):  # cifar10_deepspeed.py --moe
        deepspeed.moe.layer.MoE
    with pytest.raises(AttributeError, match="pipeline parallelism"):
        deepspeed.pipe


def test_alias_is_refused_when_the_real_deepspeed_is_imported(monkeypatch):
    real = types.ModuleType("deepspeed")
    real.__file__ = "/site-packages/deepspeed/__init__.py"
    monkeypatch.setitem(sys.modules, "deepspeed", real)
    with pytest.raises(RuntimeError, match="real DeepSpeed is already imported.*site-packages/deepspeed"):
        spmdzero.alias_deepspeed()


def test_version_compares_as_the_mirrored_deepspeed_release(deepspeed):
    from packaging import version

    assert version.parse(deepspeed.__version__) >= version.parse("0.19")
    assert "spmdzero" in deepspeed.__version__


def test_initialize_has_deepspeed_0_19_signature(deepspeed):
    assert list(inspect.signature(deepspeed.initialize).parameters) == [
        "args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "distributed_port", "mpu",
        "dist_init_required", "collate_fn", "config", "mesh_param", "config_params"]


def test_accelerator_describes_the_hosts_devices(deepspeed):
    """In the default process JAX holds the devices: a script's tensors stay on the host
    (``device_name() == "cpu"``) and the engine places each batch; counts come from JAX. Where
    torch_xla's runtime holds them (SPMDZERO_BACKEND=torch_xla), tensors go to ``xla``."""
    from deepspeed.accelerator import get_accelerator
    from spmdzero.runtime import jax_runtime

    acc = get_accelerator()
    assert acc is deepspeed.get_accelerator()
    expected = ("cpu", "cpu", 0, "cpu") if jax_runtime.selected() else ("xla", "xla:0", 0, "xla:0")
    assert (acc.device_name(), acc.device_name(0), acc.current_device(), acc.current_device_name()) == expected
    assert acc.device_count() == 8  # the host's devices (8 virtual CPU devices here)
    assert acc.is_bf16_supported() and acc.is_available()
    assert acc.communication_backend_name() == "gloo"
    acc.set_device(0)
    with pytest.raises(ValueError, match="one process per host"):
        acc.set_device(1)
    acc.manual_seed(7)
    first = torch.rand(4, device=acc.device_name())
    acc.manual_seed(7)
    assert torch.equal(first, torch.rand(4, device=acc.device_name()))
    acc.synchronize()
    acc.empty_cache()
    assert acc.memory_allocated() >= 0 and acc.max_memory_allocated() >= 0


def test_the_torch_xla_accelerator_describes_the_xla_device(deepspeed):
    """Under SPMDZERO_BACKEND=torch_xla the accelerator is torch_xla's device (its runtime is
    started in this test process beside JAX's, conftest.py)."""
    from spmdzero.compat.deepspeed.accelerator import XlaAccelerator

    acc = XlaAccelerator()
    assert (acc.device_name(), acc.device_name(0), acc.current_device(), acc.current_device_name()) == (
        "xla", "xla:0", 0, "xla:0")
    assert acc.device_count() == 8
    assert acc.is_bf16_supported() and acc.is_available()
    assert acc.get_compile_backend() == "openxla"
    acc.manual_seed_all(7)
    first = torch.rand(4, device=acc.device_name()).cpu()
    acc.manual_seed(7)
    assert torch.equal(first, torch.rand(4, device=acc.device_name()).cpu())
    acc.synchronize()
    assert acc.memory_allocated() >= 0 and acc.max_memory_allocated() >= 0


def test_accelerator_streams_and_events_are_neutral_stand_ins(deepspeed):
    """Code written for CUDA streams runs: XLA orders the device's work itself. Events time
    the host between their records."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    side = acc.Stream()
    side.wait_stream(acc.current_stream())
    with acc.stream(side):
        pass
    acc.current_stream().synchronize()
    acc.default_stream().wait_event(acc.Event())
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record()
    end.record()
    end.synchronize()
    assert 0 <= start.elapsed_time(end) < 1000
    with pytest.raises(RuntimeError, match="recorded"):
        acc.Event().elapsed_time(end)


def test_init_distributed_creates_a_real_process_group(deepspeed):
    import deepspeed.comm as ds_dist

    deepspeed.init_distributed()
    # gloo for host tensors; for XLA tensors gloo on a host copy (the HF Trainer's dist.all_gather of its loss)
    assert dist.is_initialized() and dist.get_backend() == "cpu:gloo,xla:spmdzero_host"
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)  # one process per host, one host
    loss = torch.full((1,), 3.0, device="xla")
    gathered = [torch.zeros(1, device="xla")]
    dist.all_gather(gathered, loss)
    dist.all_reduce(loss)
    assert gathered[0].device.type == "xla" and gathered[0].cpu().tolist() == [3.0] and loss.cpu().tolist() == [3.0]
    dist.barrier()
    assert (ds_dist.get_rank(), ds_dist.get_world_size(), ds_dist.get_local_rank()) == (0, 1, 0)
    assert ds_dist.is_initialized()
    value = torch.full((3,), 2.0, device="xla")
    ds_dist.all_reduce(value, op=ds_dist.ReduceOp.SUM)
    ds_dist.broadcast(value, src=0)
    assert value.device.type == "xla" and value.cpu().tolist() == [2.0, 2.0, 2.0]
    deepspeed.init_distributed()  # a second call keeps the group
    handle = ds_dist.all_reduce(value, async_op=True)  # done already: the collectives run on a host copy
    assert handle.wait() and handle.is_completed()
    gathered, scattered = torch.zeros(3, device="xla"), torch.zeros(3, device="xla")
    assert ds_dist.all_gather_into_tensor(gathered, value) is None
    ds_dist.reduce_scatter_tensor(scattered, value)
    assert gathered.cpu().tolist() == scattered.cpu().tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(AttributeError, match="deepspeed.comm' \\(spmdzero's compatibility layer\\) has no attribute"):
        ds_dist.no_such_collective


def test_a_gather_of_an_outputs_view_leaves_the_view_to_autograd(deepspeed):
    """A host-copy collective writes back only what it writes (all-gather's outputs): its input,
    a split of the engine's output, was written back too, which bumped its version, and autograd
    refused the split's use after it ("Output 0 of SplitBackward0 is a view and its base ... has
    been modified inplace"): TRL's online DPO gathers its chosen log-probs for a metric, then
    computes its rewards from them."""
    deepspeed.init_distributed()
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={"train_batch_size": 16, "spmd": {"backend": "torchax"},
                                                               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    x, _ = batches(1, 16)[0]
    chosen, rejected = torch.split(engine(x).sum(-1), 8)
    version = chosen._version
    gathered = [torch.empty_like(chosen)]
    dist.all_gather(gathered, chosen)
    assert chosen._version == version
    assert torch.equal(gathered[0].cpu(), chosen.detach().cpu())
    engine.backward((chosen - rejected.detach()).mean())  # refused before
    engine.step()


def test_an_engine_is_a_torch_module_to_isinstance_as_deepspeeds_is(deepspeed):
    """DeepSpeed's engine is a ``torch.nn.Module``; TRL's GRPO, RLOO and online DPO call a reward
    engine with its tokenized texts only if it is one (else as a reward function: with prompts
    and completions). The engine's type and attributes stay its own."""
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={"train_batch_size": 16, "spmd": {"backend": "torchax"},
                                                               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert isinstance(engine, torch.nn.Module) and isinstance(engine, deepspeed.DeepSpeedEngine)
    assert not issubclass(type(engine), torch.nn.Module) and engine.__class__.__name__ == type(engine).__name__
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in engine.module.named_parameters()]

    def reward(func, x):  # TRL's dispatch, in small
        return func(x) if isinstance(func, torch.nn.Module) else func(prompts=x)
    x, _ = batches(1, 16)[0]
    with torch.no_grad():
        assert torch.equal(reward(engine, x).cpu(), engine(x).cpu())


def test_a_trainer_subclasss_own_training_step_returns_its_loss_on_the_trainers_device():
    """transformers' Trainer compares each step's loss with its running total on ``args.device``
    (the host here); TRL's online DPO defines its own ``training_step``, not calling the
    Trainer's, and the Trainer refused its loss ("Calculated loss must be on the original
    device: cpu but device in use is jax:0"). The patch reaches subclasses defined after it."""
    from spmdzero.compat import hugging_face

    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={"train_batch_size": 16, "spmd": {"backend": "torchax"},
                                                               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    x, _ = batches(1, 16)[0]

    class Trainer:
        args = types.SimpleNamespace(device=torch.device("cpu"))

        def training_step(self, x):
            return engine(x).sum().detach()

    module = types.SimpleNamespace(Trainer=Trainer)
    hugging_face._loss_on_trainer_device(module)

    class OwnStep(Trainer):
        def training_step(self, x):
            return engine(x).mean().detach()

    class Inherited(OwnStep):
        pass

    for trainer in (Trainer(), OwnStep(), Inherited()):
        loss = trainer.training_step(x)
        assert loss.device == torch.device("cpu") and type(loss) is torch.Tensor, type(trainer).__name__


def test_zero_to_fp32_gives_the_fp32_masters_to_a_plain_module(deepspeed, tmp_path):
    from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                              get_fp32_state_dict_from_zero_checkpoint,
                                              load_state_dict_from_zero_checkpoint)

    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config={
        "train_batch_size": 16, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    x, y = batches(1, 16)[0]
    engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y.to(engine.device)))
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    masters = {name: t.cpu() for name, t in engine.master_weights().items()}
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(state[name], masters[name]) and state[name].dtype == torch.float32 for name in masters)
    convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert set(torch.load(tmp_path / "out" / "pytorch_model.bin")) == set(state)
    plain = load_state_dict_from_zero_checkpoint(tiny_mlp(seed=3), str(tmp_path / "ckpt"))
    assert all(torch.equal(p, masters[name]) for name, p in plain.state_dict().items())


def test_repeating_loader_starts_the_loader_again(deepspeed):
    from deepspeed.utils import RepeatingLoader

    loader = RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]
    with pytest.raises(AttributeError, match="deepspeed.utils' \\(spmdzero's compatibility layer\\)"):
        deepspeed.utils.no_such_helper


def test_add_config_arguments_adds_deepspeed_flags(deepspeed):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json" and args.deepscale_config is None


def test_optimizer_classes_take_deepspeed_defaults(deepspeed):
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb

    params = [torch.nn.Parameter(torch.zeros(2))]
    adam = FusedAdam(params)
    assert isinstance(adam, spmdzero.optim.optimizers.AdamW)
    assert {k: adam.defaults[k] for k in ("lr", "eps", "weight_decay", "bias_correction", "adam_w_mode")} == {
        "lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True, "adam_w_mode": True}
    assert DeepSpeedCPUAdam(params, adamw_mode=False).defaults["adam_w_mode"] is False
    lamb = FusedLamb(params)
    assert (lamb.defaults["max_coeff"], lamb.defaults["min_coeff"], lamb.defaults["eps"]) == (10.0, 0.01, 1e-8)
    with pytest.raises(ValueError, match="gradient_clipping"):
        FusedLamb(params, max_grad_norm=1.0)


def test_lr_schedules_are_spmdzeros(deepspeed):
    from deepspeed.runtime import lr_schedules

    from spmdzero.optim.schedules import SCHEDULES

    assert sorted(lr_schedules.VALID_LR_SCHEDULES) == sorted(SCHEDULES)
    assert all(getattr(lr_schedules, name) is cls for name, cls in SCHEDULES.items())


def test_zero_init_and_gathered_parameters_are_no_ops_below_stage_3(deepspeed):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 2}}):
        model = tiny_mlp()
    weight = model[0].weight
    assert weight.shape == (64, 16) and not hasattr(weight, "ds_id")
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        with torch.no_grad():
            weight.fill_(1.0)
    assert bool((weight == 1.0).all())  # changes inside are kept
    assert ZeroParamStatus.NOT_AVAILABLE.name == "NOT_AVAILABLE"


def test_gathered_parameters_broadcast_the_modifiers_values_to_the_other_processes(tmp_path):
    """Two processes (gloo): rank 0 changes a parameter inside ``GatheredParameters(...,
    modifier_rank=0)``, as Hugging Face's ZeRO-3 loading does, and rank 1 has it on exit;
    without a modifier rank each keeps its own."""
    script = tmp_path / "gathered.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist, torch.multiprocessing as mp

        def work(rank):
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["TEST_PORT"])
            dist.init_process_group("gloo", rank=rank, world_size=2)
            from spmdzero.compat.deepspeed.runtime.zero.partition_parameters import GatheredParameters
            w = torch.nn.Parameter(torch.zeros(3))
            with GatheredParameters([w], modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        w.fill_(7.0)
            own = torch.nn.Parameter(torch.full((2,), float(rank)))
            with GatheredParameters(own, modifier_rank=None):
                pass
            with open(os.path.join(os.path.dirname(__file__), f"rank{rank}.txt"), "w") as f:
                f.write(f"{w.tolist()} {own.tolist()}")
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(work, nprocs=2)
    """))
    env = {**os.environ, "SPMDZERO_NO_RUNTIME": "1", "PYTHONPATH": REPO, "TEST_PORT": str(free_port_pair())}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert seen == ["[7.0, 7.0, 7.0] [0.0, 0.0]", "[7.0, 7.0, 7.0] [1.0, 1.0]"]


def test_transformers_zero3_loading_and_resizing_run_on_the_compat_layer(deepspeed, tmp_path):
    """With a ZeRO-3 config registered (``HfDeepSpeedConfig``, as ``TrainingArguments(deepspeed=
    ...)`` registers it), ``from_pretrained`` builds under ``deepspeed.zero.Init`` and loads through
    ``GatheredParameters`` (it used to stop at a name of DeepSpeed's the layer lacked), and
    ``resize_token_embeddings`` keeps the old rows."""
    transformers = pytest.importorskip("transformers")
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import (is_deepspeed_zero3_enabled, set_hf_deepspeed_config,
                                                     unset_hf_deepspeed_config)

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).state_dict()
    deepspeed.init_distributed()  # as the Trainer does: the ZeRO-3 loader asks torch.distributed its rank
    # what TrainingArguments(deepspeed=...) registers (transformers' own class derives from this one
    # only if DeepSpeed was importable when transformers first loaded, which depends on test order)
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    set_hf_deepspeed_config(keep)
    assert is_deepspeed_zero3_enabled()
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    model.resize_token_embeddings(72)
    weight = model.get_input_embeddings().weight
    assert weight.shape == (72, 32) and torch.equal(weight[:64], saved["transformer.wte.weight"])
    unset_hf_deepspeed_config()
    del keep
    from deepspeed.compression.helper import recursive_getattr, recursive_setattr

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    replacement = torch.nn.Identity()
    recursive_setattr(model, "0.0", replacement)
    assert model[0][0] is replacement


def test_clone_tensors_for_torch_save_copies_views_to_their_own_storage(deepspeed):
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    base = torch.arange(10.0)
    out = clone_tensors_for_torch_save({"a": [base[:2]], "b": 3})
    assert out["b"] == 3 and out["a"][0].tolist() == [0.0, 1.0]
    assert out["a"][0].untyped_storage().nbytes() == 2 * 4  # not the 10-element storage of the view


def test_logger_and_log_dist(deepspeed):
    from deepspeed.utils import log_dist, logger

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        log_dist("on rank 0", ranks=[0])
        log_dist("on rank 1", ranks=[1])
    finally:
        logger.removeHandler(handler)
    assert logger.name == "DeepSpeed"
    assert [r.getMessage() for r in records] == ["[Rank 0] on rank 0"]


def test_moe_param_groups_pass_through_without_experts(deepspeed):
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = tiny_mlp()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": iter(model.parameters()), "name": "p"})
    assert len(groups) == 1 and len(groups[0]["params"]) == 4


def test_deepspeed_initialize_counts_ranks_as_processes(deepspeed, tmp_path):
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, optimizer, _, _ = deepspeed.initialize(model=tiny_mlp(), config=config)
    assert dist.is_initialized()
    # one process: DeepSpeed's world size is 1, so a micro-step is 8 rows and a step 16
    assert (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size(), engine.dp_world_size) == (8, 16, 1)
    assert engine.config["spmd"] == {"rank": "process"} and engine.config.get("gradient_accumulation_steps") == 2
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 16, "spmd": {"rank": "device"}}')
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    engine, *_ = deepspeed.initialize(args=args, model=tiny_mlp(), optimizer=torch.optim.SGD, config_params=None)
    assert engine.dp_world_size == 8 and engine.train_micro_batch_size_per_gpu() == 2  # the config's rule kept
    with pytest.raises(ValueError, match="model parallelism"):
        deepspeed.initialize(model=tiny_mlp(), config=config, mpu=object())


def test_engine_deepspeed_api(deepspeed, tmp_path):
    config = {"train_batch_size": 16, "bf16": {"enabled": True}, "optimizer": {"type": "Adam"},
              "zero_optimization": {"stage": 2, "stage3_gather_16bit_weights_on_model_save": True}}
    model = tiny_mlp()
    model.custom_flag = "from the module"
    engine, *_ = spmdzero.initialize(model=model, config=config)
    assert (engine.local_rank, engine.global_rank) == (0, 0)
    assert engine.config["train_batch_size"] == 16 and engine.config.get("fp16") is None
    assert engine.custom_flag == "from the module" and engine.state_dict  # module attributes, engine methods
    with pytest.raises(AttributeError, match="neither the engine nor its module"):
        engine.no_such_attribute
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    # DeepSpeed's config getters, as its examples and save helpers call them
    assert (engine.zero_optimization(), engine.zero_optimization_partition_gradients(),
            engine.zero_optimization_partition_weights()) == (True, True, False)
    assert (engine.steps_per_print(), engine.wall_clock_breakdown(), engine.optimizer_name()) == (None, False, "adam")
    assert (engine.dynamic_loss_scale(), engine.loss_scale(), engine.get_data_parallel_rank()) == (False, 1.0, 0)
    assert list(engine.module_state_dict()) == list(model.state_dict())
    seen, dropped = [], []
    engine.register_post_step_hook(lambda e: seen.append(e.global_steps))
    handle = engine.register_post_step_hook(lambda e: dropped.append(e.global_steps))
    for i, (x, y) in enumerate(batches(4, 16)):
        if i == 1:
            handle.remove()
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.to(engine.device))
        engine.backward(loss)
        engine.step()
    assert seen == [1, 2, 3, 4] and dropped == [1]  # after each optimizer step, until removed
    timer = engine.tput_timer
    assert (timer.batch_size, timer.global_step_count) == (16, 4)
    assert timer.avg_samples_per_sec() > 0  # steps 3 and 4 are timed (after start_step=2)
    timer.update_epoch_count()
    assert timer.epoch_count == 1
    assert engine.save_16bit_model(str(tmp_path), "model.bin")
    saved = torch.load(tmp_path / "model.bin")
    assert saved["0.weight"].dtype == torch.bfloat16 and saved["0.weight"].device.type == "cpu"
    plain = tiny_mlp().to(torch.bfloat16)
    plain.load_state_dict(saved)
    engine.destroy()


def test_training_loader_has_deepspeed_loader_attributes(deepspeed):
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 8))
    engine, _, loader, _ = deepspeed.initialize(model=tiny_mlp(), training_data=data,
                                                config={"train_batch_size": 16, "optimizer": {"type": "Adam"}})
    assert loader.dataset is data and loader.batch_size == 16
    loader.data_sampler.set_epoch(1)
    assert loader.sampler.epoch == 1


def test_activation_checkpointing_recomputes_the_same_dropout_on_xla():
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    linear, drop = torch.nn.Linear(16, 16).to("xla"), torch.nn.Dropout(0.5)
    x = torch.randn(4, 16).to("xla")
    grads = []
    for use_checkpoint in (False, True):
        linear.zero_grad()
        xm.set_rng_state(123)
        fn = lambda t: drop(torch.tanh(linear(t)))  # noqa: E731
        (checkpoint(fn, x, use_reentrant=False) if use_checkpoint else fn(x)).sum().backward()
        torch_xla.sync()
        grads.append(linear.weight.grad.cpu())
    assert torch.allclose(grads[0], grads[1]) and grads[0].abs().sum() > 0


@pytest.mark.slow
def test_engine_compile_uses_openxla_with_the_same_losses_and_no_recompiles():
    import torch_xla.debug.metrics as met

    config = {"train_batch_size": 16, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}, "spmd": {"backend": "torch_xla"}}  # its dynamo backend
    runs = []
    for compiled in (False, True):
        engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config)
        if compiled:
            with pytest.warns(UserWarning, match="does not target XLA"):
                engine.compile(backend="inductor")
            assert engine.is_compiled
        losses = []
        for i, (x, y) in enumerate(batches(5, 16)):
            loss = torch.nn.functional.mse_loss(engine(x), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if i == 1:
                warm = met.metric_data("CompileTime")[0]
        runs.append(losses)
        assert met.metric_data("CompileTime")[0] == warm  # no recompiles after two steps
    assert runs[0] == pytest.approx(runs[1], rel=1e-5)


def test_the_deepspeed_logger_writes_to_the_stdout_of_the_moment(deepspeed, monkeypatch):
    """Its handler used to keep the ``sys.stdout`` of import time: once pytest (or a notebook)
    had swapped and closed it, each line printed "--- Logging error --- ... closed file"."""
    import io

    from deepspeed.utils import logger

    first = io.StringIO()
    monkeypatch.setattr(sys, "stdout", first)
    logger.info("one")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stdout", second)
    logger.info("two")
    assert second.getvalue().rstrip().endswith("two")


def test_every_tensor_reads_as_available_and_none_as_partitioned(deepspeed):
    """TRL's ``maybe_gather_lm_head_ctx`` reads ``p.ds_status`` under ZeRO-3 unchecked
    ("'Tensor' object has no attribute 'ds_status'", on the traced values of the LM head too);
    DeepSpeed-Chat and transformers ask ``hasattr(p, "ds_id")``, which must stay False."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for t in (torch.nn.Parameter(torch.ones(2)), torch.ones(2), tiny_mlp().weight if hasattr(tiny_mlp(), "weight")
              else next(tiny_mlp().parameters())):
        assert t.ds_status == ZeroParamStatus.AVAILABLE and not hasattr(t, "ds_id")


def _trls_generation_hooks(engine) -> None:
    """What TRL's ``unwrap_model_for_generation`` does to a ZeRO-3 engine around generation
    (``trl.models.utils.remove_hooks`` and ``add_hooks``, 1.16), written out."""
    offload = (engine.optimizer.parameter_offload if hasattr(engine.optimizer, "parameter_offload")
               else engine.optimizer)
    for param in [p for _, p in itertools.chain(offload.module.named_parameters(recurse=True),
                                                offload.module.ds_external_parameters())]:
        param.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    offload._register_deepspeed_module(offload.module)


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_trls_zero_3_generation_hooks_find_deepspeeds_names_and_training_goes_on(deepspeed, backend):
    """TRL's GRPO generates with the unwrapped model at ZeRO-3 between two hook calls that reach
    DeepSpeed's stage-3 optimizer (``'AdamW' object has no attribute 'module'``). Here there are
    no hooks to remove, and the engine trains on as before."""
    data = batches(3, 8)
    runs = {}
    for stage, hooks in ((3, True), (3, False), (2, False)):
        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=tiny_mlp(), config={
            "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "spmd": {"backend": backend}})
        assert hasattr(engine.optimizer, "parameter_offload") == (stage == 3)
        losses = []
        for x, y in data:
            if hooks:
                _trls_generation_hooks(engine)
            out = engine(x)
            loss = torch.nn.functional.mse_loss(out, y.to(out.device))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        runs[stage, hooks] = losses
    assert runs[3, True] == runs[3, False]
    assert runs[3, True] == pytest.approx(runs[2, False], rel=1e-6)


class _RewardModel(torch.nn.Module):
    """DeepSpeed-Chat's reward model in small: the PPO step trains its critic from
    ``forward_value``, called through the engine."""

    def __init__(self):
        super().__init__()
        self.net = tiny_mlp()

    def forward(self, x):
        return self.net(x)

    def forward_value(self, x, return_value_only=False):
        values = self.net(x).sum(-1)
        return values if return_value_only else {"values": values}


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_a_critic_trains_from_its_forward_value_called_through_the_engine(deepspeed, backend):
    """``critic_engine.forward_value(seq, mask)`` then ``critic_engine.backward(loss)``, as
    DeepSpeed-Chat's step 3 does: the same losses as the same model in plain torch."""
    losses = {}
    for run in ("engine", "torch"):
        torch.manual_seed(0)
        model = _RewardModel()
        if run == "engine":
            critic, *_ = deepspeed.initialize(model=model, config={
                "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
                "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "spmd": {"backend": backend}})
        else:
            critic, optimizer = model, torch.optim.SGD(model.parameters(), lr=0.01)
        losses[run] = []
        for x, y in batches(3, 8):
            values = critic.forward_value(x, return_value_only=True)
            loss = ((values - y.to(values.device).sum(-1)) ** 2).mean()
            if run == "engine":
                critic.backward(loss)
                critic.step()
            else:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            losses[run].append(float(loss.detach()))
    assert losses["engine"] == pytest.approx(losses["torch"], rel=1e-5), losses
    assert losses["torch"][-1] < losses["torch"][0]
