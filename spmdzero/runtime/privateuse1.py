"""torch's PrivateUse1 device in a process where torchax is imported: the ``jax`` device.

torchax names torch's PrivateUse1 device ``jax`` (``torch.utils.rename_privateuse1_backend``),
and its tensors say ``jax:0``, but it registers nothing behind the name: no aten kernels, no C++
hooks, no device guard. torchax's tensors are Python wrappers whose values are JAX arrays; torch
itself can put nothing on that device. So every device idiom of a torch script failed with a
raw aten error once torchax was imported, on either backend. ``install`` (run at ``import
spmdzero``) gives the name the meaning it has under SPMD, where one process drives every device
of its host through compiled programs and torch's own tensors stay on the host: the host.

* **Moves and factories run on the host** (``run_device_ops_on_host``). ``y.to(out.device)``,
  ``y.to(engine.local_rank)``, ``y.to(0)`` (after ``import torchax``, ``torch.device(0)`` is
  ``jax:0``: at::getAccelerator prefers a named PrivateUse1 backend) and ``torch.zeros(n,
  device=out.device)`` reach the PrivateUse1 kernel table (``empty_strided``,
  ``empty.memory_format``, ``tril_indices``...), which is empty. A fallback for the whole
  PrivateUse1 key runs each such op with the device replaced by the CPU: a move is a copy on the
  host, as ``engine.device`` (``cpu``) gives, and the engine places the result where its
  program needs it (a batch split over the devices, a target beside the outputs). One fallback,
  not a kernel per op: it covers every factory, in every thread (a global torch mode would
  miss other threads: modes are thread-local), at no cost to any other device. It acts only while PrivateUse1 is torchax's ``jax`` (or not
  yet named): a real PrivateUse1 backend imported later keeps its own errors.
* **torch.accelerator answers as on a host without an accelerator**
  (``answer_accelerator_queries``), as a CUDA build of torch does on a machine without GPUs: ``is_available()``
  False, ``device_count()`` 0, ``current_accelerator()`` the built-in name (``jax``),
  ``current_device_index()`` 0 (the process's one logical device, what ``LOCAL_RANK`` is under
  ``spmdzero launch``), ``set_device_index(i)`` and ``with device_index(i):`` do nothing (one
  process drives every device of its host), and its memory queries 0 bytes (``memory_allocated()``, the peaks, an
  empty ``memory_stats()``; ``empty_cache()`` and the resets do nothing; they hit an internal
  assert): torch holds no accelerator memory here, JAX does
  (``spmdzero.observe.reports.live_device_bytes``). The DataLoader pins memory only where
  ``is_available()`` says so; for
  ``jax`` pinning needs the C++ hooks (HF's Trainer pins by default: its first batch failed
  with "Please register PrivateUse1HooksInterface"), and pinned host memory means nothing to
  PJRT's transfers. Libraries that ask then take their CPU path, consistent with
  ``engine.device`` and DeepSpeed's ``get_accelerator().device_name()`` (``cpu``). A script's own
  ``tensor.pin_memory()`` returns the tensor unpinned (``pin_nothing_without_hooks``), as
  DeepSpeed's ``get_accelerator().pin_memory`` does here.
* **torch's own accelerator lookup answers cpu** (``keep_accelerator_lookup_working``):
  ``torch.distributed.barrier()`` calls ``torch._C._get_accelerator()`` first thing, which
  raises "Please register PrivateUse1HooksInterface" without hooks: every barrier of a script
  (DeepSpeed's cifar example, the HF Trainer's ``main_process_first``) failed once torchax was
  imported. Any other error of the lookup is raised as before.
* **The name exists from the start** (``name_the_device``, where JAX owns the devices): torchax
  is imported at ``import spmdzero``, not first at ``initialize``, so ``torch.device(0)`` means
  the same before and after it.

All of it is process-wide and acts only where torch would otherwise raise for the missing
hooks or kernels; CPU tensors, torch_xla's ``xla`` device and a real accelerator are untouched.
Hooks and a device guard cannot be registered from Python in torch 2.9: an index-less move
(``.to("jax")``, ``.to(torch.accelerator.current_accelerator())``, ``model.to("jax")``) asks
the guard for the current index and failed with "PyTorch is not linked with support for jax
devices". ``index_the_moves`` retries such a move at index 0 (the process's one logical
device); the first try costs nothing more. With torchax's own mode active (inside a traced forward), torchax
handles ``jax`` tensors itself and none of this is reached.
"""

from __future__ import annotations

import functools

_MISSING_HOOKS = "PrivateUse1HooksInterface"
_TORCHAX_NAMES = ("jax", "privateuseone")  # torchax's name, or none yet (torchax not imported)
_libraries: list = []  # the registration lives as long as its Library object


def install() -> None:
    """The host device model for torchax's ``jax`` device (see the module docstring). Idempotent."""
    keep_accelerator_lookup_working()
    run_device_ops_on_host()
    answer_accelerator_queries()
    pin_nothing_without_hooks()
    index_the_moves()


def name_the_device() -> None:
    """Import torchax now, where JAX owns the devices (the torchax backend's process): torch's
    device ``0`` is ``jax:0`` from a script's first line, as after ``initialize`` (which imports
    it), so ``model.to(local_rank)`` before ``initialize`` means what it means after it, not a
    CUDA device this host lacks. A broken torchax install is left to the backend's own check,
    which says how to repair it."""
    try:
        import torchax  # noqa: F401
    except ImportError:
        pass


def keep_accelerator_lookup_working() -> None:
    """Make ``torch._C._get_accelerator`` answer ``cpu`` where PrivateUse1 has no hooks. Idempotent."""
    import torch

    lookup = torch._C._get_accelerator
    if getattr(lookup, "_spmdzero_cpu_without_hooks", False):
        return

    @functools.wraps(lookup)
    def get_accelerator(*args, **kwargs):
        try:
            return lookup(*args, **kwargs)
        except RuntimeError as err:
            if _MISSING_HOOKS not in str(err):
                raise
            return torch.device("cpu")

    get_accelerator._spmdzero_cpu_without_hooks = True
    torch._C._get_accelerator = get_accelerator


def _privateuse1_is_torchax() -> bool:
    import torch

    return torch._C._get_privateuse1_backend_name() in _TORCHAX_NAMES


def _on_host(device):
    """``device`` with a PrivateUse1 device (``jax:0``) replaced by the CPU."""
    import torch

    if isinstance(device, torch.device) and device.type == torch._C._get_privateuse1_backend_name():
        return torch.device("cpu")
    return device


def _run_on_host(op, *args, **kwargs):
    """The PrivateUse1 fallback: ``op`` with its device argument on the CPU."""
    import torch

    name = torch._C._get_privateuse1_backend_name()
    host_args = tuple(_on_host(a) for a in args)
    host_kwargs = {k: _on_host(v) for k, v in kwargs.items()}
    if name not in _TORCHAX_NAMES or (host_args, host_kwargs) == (args, kwargs):
        # another PrivateUse1 backend's missing kernel, or no device to move (never a torchax
        # tensor: those dispatch through Python, not PrivateUse1)
        raise NotImplementedError(f"{op} has no kernel for torch's PrivateUse1 device {name!r}")
    return op(*host_args, **host_kwargs)


def run_device_ops_on_host() -> None:
    """Every op torch sends to the ``jax`` device's kernel table runs on the host. Idempotent."""
    import torch

    if _libraries or not _privateuse1_is_torchax():
        return
    library = torch.library.Library("_", "IMPL")  # a fallback: the whole key, every op
    library.fallback(_run_on_host, "PrivateUse1")
    _libraries.append(library)


def _hooks_missing() -> bool:
    """torch's accelerator is a PrivateUse1 backend without C++ hooks (torchax's ``jax``)."""
    import torch

    lookup = torch._C._get_accelerator
    lookup = getattr(lookup, "__wrapped__", lookup)  # the original, under keep_accelerator_lookup_working
    try:
        lookup()
    except RuntimeError as err:
        return _MISSING_HOOKS in str(err)  # any other failure is the query's own to report
    return False


def _unless_hooks_missing(answer):
    """A decorator: the ``torch.accelerator`` function answers ``answer`` where the hooks are missing."""

    def wrap(query):
        @functools.wraps(query)
        def answered(*args, **kwargs):
            return answer if _hooks_missing() else query(*args, **kwargs)

        answered._spmdzero_without_hooks = True
        return answered

    return wrap


def answer_accelerator_queries() -> None:
    """``torch.accelerator`` answers as on a host without an accelerator while PrivateUse1 has no
    hooks: not available, no devices, the current index 0, no memory. Idempotent."""
    import collections

    import torch
    import torch.accelerator as accelerator
    import torch.accelerator.memory as memory

    # set_device_index: one process drives all its devices under SPMD, so choosing one does nothing
    answers = [("is_available", False), ("device_count", 0), ("current_device_index", 0),
               ("set_device_index", None), ("set_device_idx", None)]
    answers += [(name, 0) for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                                       "max_memory_reserved")]
    answers += [("memory_stats", collections.OrderedDict()), ("empty_cache", None),
                ("reset_peak_memory_stats", None), ("reset_accumulated_memory_stats", None)]
    # synchronize: a no-op for an accelerator never initialized, as torch documents it; torch
    # 2.12 raises "not linked with support for jax devices" instead (2.9 returned)
    answers += [("synchronize", None)]
    for name, answer in answers:
        for namespace in (accelerator, memory):
            query = getattr(namespace, name, None)
            if query is not None and not getattr(query, "_spmdzero_without_hooks", False):
                setattr(namespace, name, _unless_hooks_missing(answer)(query))
    # ``with torch.accelerator.device_index(i):`` exchanges the current index through these: the
    # previous one is 0, and nothing changes
    for name in ("_accelerator_exchangeDevice", "_accelerator_maybeExchangeDevice"):
        query = getattr(torch._C, name, None)
        if query is not None and not getattr(query, "_spmdzero_without_hooks", False):
            setattr(torch._C, name, _unless_hooks_missing(0)(query))


def pin_nothing_without_hooks() -> None:
    """``tensor.pin_memory()`` returns the tensor unpinned where pinning needs the missing hooks
    (a script's own ``batch.pin_memory()``, as DeepSpeed's ``get_accelerator().pin_memory`` does
    here); it raised "Please register PrivateUse1HooksInterface". Idempotent."""
    _instead_of_torchs_error("pin_memory", _MISSING_HOOKS, lambda pin, tensor, *args, **kwargs: tensor)


_NO_GUARD = "is not linked with support for"  # torch's words for a device type without a device guard


def _with_index(value):
    """``value`` with the PrivateUse1 device at index 0 where it names it without an index."""
    import torch

    name = torch._C._get_privateuse1_backend_name()
    if isinstance(value, str) and value == name:
        return f"{name}:0"
    if isinstance(value, torch.device) and value.type == name and value.index is None:
        return torch.device(name, 0)
    return value


def index_the_moves() -> None:
    """``tensor.to(<the jax device without an index>)`` moves to ``jax:0`` (see the module
    docstring); every other move, and every other error, as before. Idempotent."""
    def indexed(to, tensor, *args, **kwargs):
        return to(tensor, *(_with_index(a) for a in args), **{k: _with_index(v) for k, v in kwargs.items()})

    _instead_of_torchs_error("to", _NO_GUARD, indexed)


def _instead_of_torchs_error(name: str, words: str, instead) -> None:
    """``torch.Tensor.<name>`` answers ``instead(original, tensor, *args, **kwargs)`` where torch's
    own raises a RuntimeError saying ``words`` and PrivateUse1 is torchax's; as before otherwise
    (the first try costs nothing more). Idempotent."""
    import torch

    original = getattr(torch.Tensor, name)
    if getattr(original, "_spmdzero_without_hooks", False):
        return

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except RuntimeError as err:
            if words not in str(err) or not _privateuse1_is_torchax():
                raise
            return instead(original, self, *args, **kwargs)

    method._spmdzero_without_hooks = True
    setattr(torch.Tensor, name, method)
