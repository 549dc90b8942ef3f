"""The host module beside the devices' parameters: the engine answers as the ``nn.Module`` it
wraps (``train``, ``parameters``, ``state_dict``, attributes), the host parameters are brought up
to date from the devices when something reads them, and edits made on the host (``.data``,
in-place ops under ``no_grad``, ``requires_grad``) reach the devices at the next forward. The
parameters' tensor class is watched (``watch_parameters``) so that the first torch op on one
is noticed, without a check on every step. ``HostCopy`` is the engine's part that does it
(``engine.host``)."""

from __future__ import annotations

import functools
import warnings
import weakref

import torch
from torch.utils import _pytree as torch_pytree

from spmdzero.backends.torchax.programs import frozen
from spmdzero.backends.torchax.optim import optimizer_state_dict
from spmdzero.train import module_methods
from spmdzero.backends.torchax.engine.generation import library_generate
from spmdzero.backends.torchax.engine.host_placeholders import HostPlaceholders, chosen
from spmdzero.train.zero_params import is_placeholder, owned

# The torch_xla engine's public names this engine lacks (tests/test_torchax_backend.py checks
# the list against both classes): asking for one says which backend has it.
TORCH_XLA_ONLY = frozenset({
    "capture_steps", "lay_out_state",
    "restore_snapshot", "snapshot", "trained_parameters",
})



def optimizer_state_through_engine(optimizer, engine) -> None:
    """The base optimizer's ``state_dict()``/``load_state_dict()`` read and write the states the
    devices hold (``optimizer_state_dict``): its own ``state`` holds none of them. A weak
    reference: the methods do not keep the engine alive."""
    ref = weakref.ref(engine)

    def live():
        engine = ref()
        if engine is None:
            raise RuntimeError("optimizer.state_dict(): the engine that trained this optimizer's states is gone")
        return engine

    optimizer.state_dict = lambda: optimizer_state_dict.state_dict(live())
    optimizer.load_state_dict = lambda state_dict: optimizer_state_dict.load_state_dict(live(), state_dict)


class _SyncFromDevices:
    """The state-dict pre-hook of ``sync_before_state_dict``. A weak reference: the hook does
    not keep the engine alive. Pickled or deep-copied with the model (``torch.save(model)``,
    an EMA copy), it is a hook with no engine: the copy holds its own values."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine) if engine is not None else None

    def __call__(self, *_) -> None:
        live = self._engine() if self._engine is not None else None
        if live is not None:
            live.host.current()

    def __reduce__(self):
        return (_SyncFromDevices, (None,))


def sync_before_state_dict(module: torch.nn.Module, engine) -> None:
    """``model.state_dict()`` (``save_pretrained``, ``torch.save``) on the script's own reference
    to the model first brings the trained weights back from the devices, as ``engine.module``
    does."""
    sync = _SyncFromDevices(engine)
    # one engine's hooks per model: a model initialized again (a re-run notebook cell) is the
    # new engine's, and the old one must not write its values back into it
    for handle in getattr(module, "_spmdzero_state_dict_hooks", ()):
        handle.remove()
    module._spmdzero_state_dict_hooks = [sub.register_state_dict_pre_hook(sync) for sub in module.modules()]


def zero_grad_through_engine(optimizer, engine) -> None:
    """``engine.optimizer.zero_grad()`` is DeepSpeed's ZeRO optimizer's: it drops the
    accumulated gradients as that optimizer's does, stage by stage (``zero_grad_keeps_gradients``);
    the torch optimizer's own would clear the host parameters' ``.grad``, which hold nothing here."""
    ref = weakref.ref(engine)

    def zero_grad(set_to_none: bool = True):
        live = ref()
        if live is not None:
            live.gradients.zero_grad(by_optimizer=True)

    optimizer.zero_grad = zero_grad
_unwatched = torch._C.DisableTorchFunctionSubclass  # the engine's own reads and writes of the host parameters
_METADATA = frozenset({"__hash__", "size", "dim", "numel", "stride", "element_size", "is_floating_point",
                       "is_contiguous", "data_ptr"})  # tensor methods that read no values


@functools.cache
def _watchers():
    """host parameter -> a weak reference to the engine that trains it (by identity: tensors
    compare by value)."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


def _host_use(func, args: tuple, kwargs: dict) -> None:
    """Tell the engines of the watched parameters among an op's arguments, unless the op reads
    only what a step leaves alone (a shape, ``requires_grad``, a hash: no device read for those)."""
    owner = getattr(func, "__self__", None)
    through_data = owner is torch._C.TensorBase.data  # its getter or setter
    metadata = getattr(func, "__name__", None) in _METADATA or type(owner).__name__ == "getset_descriptor"
    if metadata and not through_data:
        return
    for t in torch_pytree.tree_leaves((args, kwargs)):
        if getattr(type(t), "_spmdzero_watched", False):
            ref = _watchers().get(t)
            engine = ref() if ref is not None else None
            if engine is not None:
                engine.host.use(t, through_data)


@functools.cache
def _watched_class(cls: type) -> type:
    """``cls`` (``nn.Parameter`` or a subclass) whose torch ops, ``.data`` included, tell the
    engine first. Pickled (``torch.save(model)``) or deep-copied, such a parameter is a plain
    ``cls`` again."""

    def __torch_function__(klass, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _host_use(func, args, kwargs)
        return cls.__torch_function__(func, types, args, kwargs)

    def __repr__(self):  # as the parameter prints without the subclass
        _host_use(None, (self,), {})
        with _unwatched():
            return repr(torch.Tensor._make_subclass(cls, self.detach(), self.requires_grad))

    def __deepcopy__(self, memo):  # a copy (an EMA model's) holds the trained values and is no engine's
        if id(self) not in memo:
            _host_use(None, (self,), {})
            with _unwatched():
                cls.__deepcopy__(self, memo).__class__ = cls
        return memo[id(self)]

    return type(cls.__name__, (cls,), {"__torch_function__": classmethod(__torch_function__), "__repr__": __repr__,
                                       "__deepcopy__": __deepcopy__, "_spmdzero_watched": True,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def watch_parameters(module: torch.nn.Module, engine) -> None:
    """The module's parameters' torch ops tell ``engine`` first (a model initialized again is
    the new engine's)."""
    ref, watchers = weakref.ref(engine), _watchers()
    for p in module.parameters():
        if not getattr(type(p), "_spmdzero_watched", False):
            p.__class__ = _watched_class(type(p))
        watchers[p] = ref


class HostCopy:
    """The wrapped module on the host, beside the devices' arrays (see the module docstring): a
    part of ``TorchaxEngine`` (``engine.host``). What it owns: which host values are behind the
    devices (a step changed the parameters, a forward the buffers), and which the host changed
    (in-place versions, ``.data`` uses, ``requires_grad``). It reads and replaces
    ``engine.state``; it bumps ``engine.params_version`` when it gives the devices new parameters."""

    def __init__(self, engine, module: torch.nn.Module, host_parameters: str = "whole"):
        self._engine = weakref.proxy(engine)  # the engine holds this part; the part does not keep it alive
        self.wrapped = module  # as it is, not brought up to date (``current`` is)
        self._params_behind = False  # a step changed the parameters since the host last read them
        self._buffers_behind: set[str] = set()  # buffers a forward changed on the devices
        # the host tensors, listed once: reading them per forward costs ~1 us each, walking the module ~1 ms
        self._tensors = [*module.named_parameters(), *module.named_buffers()]
        self._params = [p for _, p in module.named_parameters()]
        self._trainable = self._requires_grad()
        self.frozen: frozenset = frozenset()  # trained parameters frozen since initialize (programs/frozen.py)
        self._versions_seen = self._versions()
        self._touched: set[int] = set()  # host parameters (by id) whose .data was used since the last forward
        self.configuring: set[str] = set()  # methods run on the host module for what they set (script_method)
        # at ZeRO-3, DeepSpeed's placeholders instead of whole parameters (host_placeholders.py)
        self.placeholders = HostPlaceholders(engine, self, module) if chosen(
            host_parameters, engine.plan.stage, module, engine.shape_only) else None
        self._versions_seen = self._versions()

    @staticmethod
    def unwatched():
        """The engine's own reads and writes of the host parameters (no watched-class hook)."""
        return _unwatched()

    def seen(self) -> None:
        """The host tensors as they are now are the engine's (a gather or release of placeholders)."""
        self._versions_seen = self._versions()

    def named_tensors(self) -> list:
        """The module's parameters and buffers by name, as listed at initialize (no device read)."""
        return self._tensors

    def params_changed(self) -> None:
        """The devices' parameters changed (a step, a load): the host's are behind until read."""
        self._params_behind = True

    def buffers_changed(self, names) -> None:
        """A forward or a load changed these buffers on the devices."""
        self._buffers_behind.update(names)

    def current(self, parameters: bool = True) -> torch.nn.Module:
        """The torch module, its buffers brought up to date from the devices when a forward
        changed them, and its parameters too when a step changed them since the last read (a
        device-to-host copy). ``parameters=False`` leaves them behind: the first torch op on one
        brings them all (``use``), and a call that only passes the module on (``engine.module``
        to ``generate``, which runs on the devices) copies nothing."""
        if parameters and self.placeholders is not None:
            self.placeholders.fill_pending()  # gathered ZeRO-3 placeholders about to be read
        params = parameters and self._params_behind
        if params or self._buffers_behind:
            from torchax.ops import mappings

            state = self._engine.state
            with torch.no_grad(), warnings.catch_warnings(), _unwatched():
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # it is copied
                for name, t in self._tensors:  # a frozen parameter's value is a constant, as a buffer's
                    if owned(t):  # a placeholder's values stay on the devices; gathered, filled above
                        continue
                    if params and name in state.params:
                        t.copy_(mappings.j2t(state.params[name], use_dlpack=False))
                    elif name in self._buffers_behind:
                        t.copy_(mappings.j2t(state.constants[name], use_dlpack=False))
            self._params_behind = self._params_behind and not params
            self._buffers_behind = set()
            self._versions_seen = self._versions()
        return self.wrapped

    def _versions(self) -> list[int]:
        """Each host parameter's and buffer's in-place version: a change made on the host (a
        ``load_state_dict``, an edit under ``no_grad``) shows as a new version."""
        with _unwatched():
            return [t._version for _, t in self._tensors]

    def _requires_grad(self) -> list[bool]:
        with _unwatched():
            return [p.requires_grad for p in self._params]

    def take_changes(self) -> None:
        """Before a forward: parameters and buffers changed on the host since the engine last
        wrote or read them go to the devices (fp32 master weights too), as the torch_xla
        engine's module is its device copy. A parameter frozen or unfrozen after initialize is
        treated as DeepSpeed treats it (``frozen``)."""
        engine = self._engine
        if self._requires_grad() != self._trainable:
            self._trainable = self._requires_grad()
            with _unwatched():
                self.frozen = frozen.frozen_since_initialize(self.wrapped, engine.trained.names)
        versions, touched = self._versions(), self._touched
        if versions == self._versions_seen and not touched:
            return
        self._touched = set()
        # what the host changed wins over a step's results not yet copied back (those are the
        # devices' own and stay there)
        for (name, t), version, before in zip(self._tensors, versions, self._versions_seen):
            if version == before and (id(t) not in touched or self._same_on_devices(name, t)) or is_placeholder(t):
                continue
            with _unwatched():
                self.put(name, t.detach())
        self._versions_seen = versions

    def put(self, name: str, t: torch.Tensor) -> None:
        """A host value of a parameter or buffer onto the devices, in place of theirs (the fp32
        master weights too)."""
        engine = self._engine
        placement, trained = engine.placement, engine.trained
        engine.gradients.settle()  # at the parameters the unconfirmed forwards saw
        state = engine.state
        if name in state.params:
            masters = state.masters if name not in state.masters else {
                **state.masters, name: placement.put(t.float(), trained.master_specs[name])}
            engine.state = state._replace(params={**state.params, name: placement.put(t, trained.param_specs[name])},
                                          masters=masters)
        else:
            engine.state = state._replace(constants={**state.constants, name: placement.put(t, placement.replicated)})
            self._buffers_behind.discard(name)
        engine.params_version += 1

    def _same_on_devices(self, name: str, t: torch.Tensor) -> bool:
        """Whether a host parameter whose ``.data`` was used holds what the devices hold (a
        read, not an edit: the fp32 master weights keep their precision). Reads the device."""
        from torchax.ops import mappings

        state = self._engine.state
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # only compared
            device = mappings.j2t(state.params[name] if name in state.params else state.constants[name],
                                  use_dlpack=False)
        with _unwatched():
            return t.shape == device.shape and t.dtype == device.dtype and torch.equal(t.detach(), device)

    def use(self, param: torch.Tensor, through_data: bool) -> None:
        """A torch op on a host parameter (an edit, a read, ``.data``): the trained values are
        brought to the host first (a device-to-host copy when a step changed them), so that it
        sees them as torch would. An edit in place shows as a new version at the next forward;
        one through ``.data`` does not, so the next forward compares the parameter with the
        devices' copy."""
        self.current()
        if through_data:
            self._touched.add(id(param))


def script_method(engine, configuring: set, name: str, *args, **kwargs):
    """``engine.<name>(...)``: with a tensor, the method in a program of its own, as the
    engine's forward; without one, on the host module. A method whose program returns no
    tensor was called for what it does to the module (``set_scale(t)``), which a program
    would not keep: it runs on the host module, then and from then on (``configuring``)."""
    if name not in configuring and module_methods.computes(args, kwargs):
        result = engine.forwards.run(args, kwargs, method=name)
        if module_methods.computes((result,), {}):
            return result
        configuring.add(name)
    return getattr(engine.module, name)(*args, **kwargs)


def engine_attribute(engine, name: str):
    """An attribute the engine lacks, from its module, as in DeepSpeed; a method of the model's
    own classes computes on the devices (``module_methods``)."""
    module = engine.host.wrapped
    if name == "generate" and library_generate(type(module)):  # on the devices (generation.py)
        own = type(module).__mro__[1] if type(module).__dict__.get("_spmdzero_engine_class") else type(module)
        # the fallback is the class's own generate: the module's would ask the engine again
        return lambda *args, **kwargs: engine.generation.generate(
            args, kwargs, lambda: own.generate(engine.module, *args, **kwargs))
    if module_methods.routed(module, name):
        return functools.partial(script_method, engine, engine.host.configuring, name)
    try:
        return getattr(engine.module, name)
    except AttributeError:
        if name in TORCH_XLA_ONLY:
            raise AttributeError(f"engine.{name} is not supported by the torchax backend (spmd.backend="
                                 "'torchax', see docs/config.md#the-torchax-backend); spmd.backend='torch_xla' "
                                 "has it") from None
        raise AttributeError(f"neither the engine nor its module ({type(module).__name__}) has an "
                             f"attribute {name!r}") from None
