"""The module a script gave ``initialize``, called by the script itself, trains as the engine does.

Under DeepSpeed the engine and the module it wraps share their parameters, so a script may keep
calling its own reference: DeepSpeedExamples' GAN (``training/gan/gan_deepspeed_train.py``)
runs ``output = netD(real)``, ``model_engineD.backward(criterion(output, label))`` and
``netD.zero_grad()``, where ``netD`` is the module and ``model_engineD`` its engine. Here the
module's parameters are host copies beside the devices' values: its own forward ran on the host,
so ``engine.backward`` refused a loss that no engine forward made, and its ``zero_grad()``
cleared host ``.grad`` fields that hold nothing, leaving the engine's accumulated gradients in
place. The GAN's generator step sends its loss back through the discriminator's engine too, and
those gradients, which ``netD.zero_grad()`` drops under DeepSpeed, went into the
discriminator's next step.

So for the module an engine wraps (that object, not a copy of it):

* ``module(...)`` in training mode with grad enabled is ``engine(...)``: the same program, the
  same outputs, and a loss ``engine.backward`` takes. In eval mode or without grad (an
  evaluation loop, ``generate``) it runs on the host as before, where each new shape would
  otherwise compile a program;
* ``module.zero_grad()`` is ``engine.zero_grad()``: DeepSpeed's engine does no more than clear
  the parameters' ``.grad``, so which accumulated gradients it drops depends on the ZeRO stage
  in the same way (``EngineBase.zero_grad_keeps_gradients``).

Calls made while an engine traces (its own module inside its program, another engine's inline)
are left alone. Only the wrapped module changes: its class becomes a subclass of its own, of the
same name, with these two methods (``_engine_class``), as the parameters' class is watched
(``host_module``). A global patch of ``nn.Module.__call__`` would reach every module of the
process: torch.compile traced through it, and torch_xla's compiled step gave other losses.
A pickle or a copy of the module has its own class again and runs on the host.
"""

from __future__ import annotations

import copyreg
import functools
import weakref

import torch

from spmdzero.backends.torchax.engine import other_engines
from spmdzero.backends.torchax.engine.generation import library_generate

# id(module) -> (a weak reference to the module, a weak reference to the engine that wraps it)
_wrapped: dict = {}


def register(module: torch.nn.Module, engine) -> None:
    """``module`` is ``engine``'s: the script's calls to it go through the engine (see the module
    docstring). A module initialized again is the new engine's."""
    if not getattr(type(module), "_spmdzero_engine_class", False):
        module.__class__ = _engine_class(type(module))
    key = id(module)
    _wrapped[key] = (weakref.ref(module, lambda _: _wrapped.pop(key, None)), weakref.ref(engine))


def engine_of(module: torch.nn.Module):
    """The live engine that wraps ``module`` itself, or None."""
    entry = _wrapped.get(id(module))
    if entry is None or entry[0]() is not module:
        return None
    return entry[1]()


def _engine_to_call(module: torch.nn.Module):
    """The engine that a call of ``module`` goes through now, or None (see the module docstring)."""
    if not (module.training and torch.is_grad_enabled()) or other_engines.tracing_engine() is not None:
        return None
    return engine_of(module)


@functools.cache
def _engine_class(cls: type) -> type:
    """``cls`` whose calls in training, and ``zero_grad``, go through the module's engine."""

    def __call__(self, *args, **kwargs):
        engine = _engine_to_call(self)
        if engine is not None:
            return engine(*args, **kwargs)
        return cls.__call__(self, *args, **kwargs)

    def zero_grad(self, set_to_none: bool = True):
        engine = engine_of(self)
        if engine is not None:
            engine.zero_grad()
        return cls.zero_grad(self, set_to_none)

    def generate(self, *args, **kwargs):  # on the devices (generation.py), else the class's own
        engine = engine_of(self)
        if engine is None or other_engines.tracing_engine() is not None:
            return cls.generate(self, *args, **kwargs)
        return engine.generation.generate(args, kwargs, lambda: cls.generate(engine.module, *args, **kwargs))

    def __reduce_ex__(self, protocol):
        """Pickled and copied as ``cls``: ``copyreg.__newobj__`` must get the object's own
        class, its older sibling ``_reconstructor`` takes any (both from the standard library,
        so a pickle loads without spmdzero)."""
        reduced = list(cls.__reduce_ex__(self, protocol))
        if reduced[0] is copyreg.__newobj__ and reduced[1][:1] == (engine_class,) and len(reduced[1]) == 1:
            reduced[:2] = [copyreg._reconstructor, (cls, object, None)]
        return tuple(reduced)

    methods = {"__call__": __call__, "zero_grad": zero_grad, "__reduce_ex__": __reduce_ex__}
    if library_generate(cls):
        methods["generate"] = generate
    engine_class = type(cls.__name__, (cls,), {
        **methods,
        "_spmdzero_engine_class": True, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return engine_class
