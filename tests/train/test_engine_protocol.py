"""Both backends' engines implement the typed engine interface (``train/engine_protocol.py``):
every method and property it names is defined on each engine class, and every attribute it
names is set on a built torchax engine."""

import typing

import pytest

from spmdzero.train.engine_protocol import Engine


def _members(protocol) -> tuple[set, set]:
    """(methods and properties, data attributes) the protocol and its bases name."""
    callables, data = set(), set()
    for base in protocol.__mro__:
        if base is object or base is typing.Protocol or base is typing.Generic:
            continue
        data |= set(getattr(base, "__annotations__", {}))
        callables |= {n for n, v in vars(base).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return callables, data - callables


def test_the_protocol_names_the_faces_the_lower_layers_read():
    callables, data = _members(Engine)
    assert {"state_tensors", "state_shards", "loaded", "get_global_grad_norm", "step_loss", "backward", "step"} <= callables
    assert {"plan", "mesh", "precision", "module", "global_steps"} <= data
    assert {"validated_config", "grad_buffers", "train_micro_batch_size_per_gpu"} <= callables  # tpu's


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_each_engine_class_defines_every_method_of_the_protocol(backend):
    if backend == "torch_xla":
        engine_class = pytest.importorskip("spmdzero.backends.torch_xla.engine").SpmdZeroEngine
    else:
        from spmdzero.backends.torchax.engine.engine import TorchaxEngine as engine_class
    callables, _ = _members(Engine)
    missing = sorted(n for n in callables if not hasattr(engine_class, n))
    assert not missing, f"{engine_class.__name__} lacks {missing}"


def test_a_built_engine_holds_every_attribute_of_the_protocol():
    import torch

    import spmdzero
    from conftest import tiny_mlp

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}}
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=config)
    _, data = _members(Engine)
    missing = sorted(n for n in data if not hasattr(engine, n))
    assert not missing, f"the engine lacks {missing}"
    assert isinstance(engine.plan, object) and isinstance(engine.module, torch.nn.Module)


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_each_engine_class_has_its_face_for_the_tpu_compile(backend):
    """The torchax engine is traced (``TracedEngine``), the torch_xla one intercepted
    (``InterceptedEngine``): each class defines every method of its face."""
    from spmdzero.tpu.captured_engine import InterceptedEngine, TracedEngine

    if backend == "torch_xla":
        engine_class = pytest.importorskip("spmdzero.backends.torch_xla.engine").SpmdZeroEngine
        face = InterceptedEngine
    else:
        from spmdzero.backends.torchax.engine.engine import TorchaxEngine as engine_class
        face = TracedEngine
    callables, _ = _members(face)
    missing = sorted(n for n in callables if not hasattr(engine_class, n))
    assert not missing, f"{engine_class.__name__} lacks {missing}"
