"""What ``spmdzero aot`` compiles: a model, a batch for it and its loss, from either a
``file.py:Name`` (a model with ``example_inputs(batch_size)`` whose forward returns the
loss, like ``examples/model.py``) or a transformers config (a ``config.json`` or the
directory holding it; nothing is downloaded) trained as a causal LM on its own labels.

Models build with their parameters on the ``meta`` device for shape-only capture
(``meta_parameters``): a parameter created on the CPU is moved to ``meta`` as it is
registered, before any initializer touches it, so building costs no memory; buffers stay
real (rotary tables and masks are computed, and small).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class ModelSource:
    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.nn.Module, int], tuple[tuple, dict]]  # (model, global batch) -> args, kwargs
    loss: Callable[[Any], torch.Tensor]  # forward output -> loss
    seq_len: int | None = None  # tokens per sequence when known (for model FLOPs)
    # the forward's output holds the loss (a scalar, ``.loss``...) and ``loss`` only picks it: the
    # torchax engine's training program takes its gradient from the module's own output
    returns_loss: bool = False


@contextlib.contextmanager
def meta_parameters():
    """Register every new parameter on the ``meta`` device (buffers stay on the CPU)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_on_meta(source: ModelSource) -> torch.nn.Module:
    """The model with every parameter on ``meta``; a clear error for one that cannot."""
    try:
        with meta_parameters():
            model = source.build()
    except ModelRefused:
        raise
    except Exception as err:
        raise ValueError(f"model {source.name} did not build with its parameters on the 'meta' device "
                         f"(shape-only capture): {type(err).__name__}: {_short(err)}. If it builds with real "
                         "parameters, pass --materialize") from err
    checked_module(source, model)
    real = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    if real:
        raise ValueError(f"model {source.name} does not build on 'meta': parameters {real[:3]} were created "
                         "outside nn.Module registration; pass --materialize")
    return model


def checked_module(source: ModelSource, model) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {source.name!r} gave a {type(model).__name__}, not a torch.nn.Module")
    return model


def _short(err: Exception, limit: int = 400) -> str:
    """An exception's message on one line, cut to ``limit`` characters (transformers lists every
    model type it knows in some of its errors)."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def load_model_source(spec: str, seq_len: int | None = None) -> ModelSource:
    """``PATH.py:NAME``, or a transformers config: a ``.json`` file or a directory with
    ``config.json``."""
    if os.path.isdir(spec) or spec.endswith(".json"):
        return _from_config(spec, seq_len)
    if seq_len is not None:
        raise ValueError(f"--seq-len applies to transformers configs; the model {spec!r} makes its own batch "
                         "(example_inputs)")
    return _from_file(spec)


class ModelRefused(ValueError):
    """A model that built but cannot be compiled as asked: said as it is, not as a failure to build on
    ``meta``."""


def with_gradient_checkpointing(source: ModelSource) -> ModelSource:
    """``source`` whose model, once built, has activation checkpointing enabled as a script
    enables it (transformers' ``gradient_checkpointing_enable()``, or its newer name
    ``activation_checkpointing_enable()`` where it has one), in training mode (transformers
    checkpoints only there): its blocks run through ``torch.utils.checkpoint``, which both
    backends rematerialize. A model with neither method is refused."""
    def build():
        model = source.build()
        enable = next((getattr(model, name) for name in ("activation_checkpointing_enable",
                                                         "gradient_checkpointing_enable")
                       if callable(getattr(model, name, None))), None)
        if enable is None:
            raise ModelRefused(f"--gradient-checkpointing: model {source.name} ({type(model).__name__}) has no "
                               "gradient_checkpointing_enable() method (transformers models have one); call "
                               "torch.utils.checkpoint.checkpoint in its forward instead")
        enable()
        return model.train()

    return dataclasses.replace(source, build=build)


def _from_file(spec: str) -> ModelSource:
    path, _, name = spec.rpartition(":")
    if not path or not os.path.isfile(path):
        raise ValueError(f"--model {spec!r}: expected PATH.py:NAME with an existing file, a transformers "
                         "config.json, or a directory holding one")
    module_spec = importlib.util.spec_from_file_location("spmdzero_aot_model", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's file: a syntax error, a missing import, anything it raises
        raise ValueError(f"--model {spec!r}: importing {path} failed: {type(err).__name__}: {_short(err)}") from err
    if not hasattr(module, name):
        raise ValueError(f"--model {spec!r}: {path} defines no {name!r}")
    factory = getattr(module, name)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {name!r} in {path} is a {type(factory).__name__}, not a model class or "
                         "a function returning a model")

    def inputs(model, batch):
        if not hasattr(model, "example_inputs"):
            raise ValueError(f"--model {spec!r}: the model has no example_inputs(batch_size) method giving a batch")
        return tuple(model.example_inputs(batch)), {}

    return ModelSource(spec, factory, inputs, lambda output: output, returns_loss=True)


def _from_config(spec: str, seq_len: int | None) -> ModelSource:
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(f"--model {spec!r}: no such file {path}")
    try:
        with open(path) as f:
            fields = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"--model {spec!r}: {path} is not valid JSON ({err})") from None
    import transformers

    if not isinstance(fields, dict):
        raise ValueError(f"--model {spec!r}: {path} holds a JSON {type(fields).__name__}, not a transformers config "
                         "(an object with 'model_type')")
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"--model {spec!r}: {path} has no 'model_type' (e.g. \"gpt2\", \"llama\")")
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--model {spec!r}: {_short(err)}") from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"--model {spec!r}: model_type {model_type!r} has no causal-LM model in transformers "
                         "(AutoModelForCausalLM); spmdzero aot trains a config as a causal LM on its own tokens. "
                         "For other models give PATH.py:NAME (a model with example_inputs)")
    limit = next((getattr(config, k) for k in ("n_positions", "max_position_embeddings") if hasattr(config, k)), None)
    seq_len = seq_len or min(limit or 1024, 1024)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's {limit} positions")
    vocab = config.vocab_size

    def build():
        return transformers.AutoModelForCausalLM.from_config(config)

    def inputs(model, batch):
        tokens = torch.randint(0, vocab, (batch, seq_len))
        return (), {"input_ids": tokens, "labels": tokens}  # the model shifts the labels itself

    return ModelSource(f"{model_type} ({os.path.basename(os.path.dirname(os.path.abspath(path)))})", build, inputs,
                       lambda output: output.loss, seq_len, returns_loss=True)
