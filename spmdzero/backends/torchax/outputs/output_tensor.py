"""The tensors the engine's outputs come back as: torchax tensors whose torch ops run in the
torchax environment whoever calls them, so that a training loop's reads and arithmetic on them
(``loss.item()``, ``logits.argmax(-1)``, ``f"{loss:.4f}"``, ``total += loss``) work outside it, and
whose views alias them as torch's do (``output_views``). Split from ``forward.py``, which makes
them, since they live on in the script after the forward returned."""

from __future__ import annotations

import functools
import warnings

import torch
from torch.utils import _pytree as torch_pytree

from spmdzero.backends.torchax.outputs import host_fallback
from spmdzero.backends.torchax.outputs import host_tensors
from spmdzero.backends.torchax.outputs import output_functions
from spmdzero.backends.torchax.outputs import output_views
from spmdzero.backends.torchax.lowering.values import INT64_TRUNCATED, READ_ONLY_HOST_VALUE
from spmdzero.runtime import out_of_memory

_VALUE = "_spmdzero_value"  # where an output keeps its JAX array (``Output._elem``)


@functools.lru_cache(maxsize=None)
def output_tensor_class():
    """torchax tensors whose torch ops run in the torchax environment, whoever calls them, so
    the outputs a training loop reads (``loss.item()``, ``logits.argmax(-1)``, ``loss * 2``)
    work outside it; their results are such tensors too."""
    import jax
    import torchax
    from torchax import tensor as ttensor
    from torchax.ops import mappings as torch_mappings

    env = torchax.default_env()

    class Output(ttensor.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            # the few functions whose C++ refuses outputs or loses a value (``output_functions``)
            result = output_functions.replaced(func, args, kwargs or {}, lambda t: Output(env.t2j_copy(t), env))
            if result is not NotImplemented:
                return result
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            written = host_tensors.write_back(func, args, kwargs or {})  # `total += loss`: into a host tensor
            given = (args, kwargs or {})
            # host tensors mixed in (a target on the CPU) are copied to JAX, as the module's inputs
            args, kwargs = torch_pytree.tree_map_only(
                torch.Tensor, lambda t: t if isinstance(t, ttensor.Tensor) else ttensor.Tensor(env.t2j_copy(t), env),
                (args, kwargs or {}))
            try:
                with env, warnings.catch_warnings():
                    # torch's int64 (labels, argmax) is int32 under JAX without x64, as torchax
                    # intends: JAX's warning at each such op is noise in a loop (cifar's accuracy
                    # count printed it)
                    warnings.filterwarnings("ignore", INT64_TRUNCATED, UserWarning)
                    warnings.filterwarnings("ignore", READ_ONLY_HOST_VALUE, UserWarning)  # copied below
                    result = func(*args, **kwargs)
            except ttensor.OperatorNotFound:  # an op torchax cannot lower: torch's, on the host
                result = host_fallback.run(func, *given, lambda t: Output(env.t2j_copy(t), env))
            except RuntimeError as err:  # a program that ran out of memory fails at its outputs' first read
                if not out_of_memory.is_device_out_of_memory(err):
                    raise
                raise out_of_memory.as_torch_out_of_memory(err) from err
            if func is torch.ops.aten._to_copy.default and not isinstance(result, ttensor.Tensor):
                # ``out.cpu()``: torchax hands torch the array's host value, which JAX caches
                # read-only and gives every later read. A write into the host tensor (``h =
                # out.cpu(); h += 1``) changed what the output read afterwards; torch's copy is
                # the script's own
                result = result.clone()
            if written is not None:
                written(args, kwargs)
            # an in-place op returns the tensor it wrote (``y = x.add_(1)`` is ``x``)
            result = torch_pytree.tree_map_only(
                ttensor.Tensor, lambda t: t if isinstance(t, Output) else Output(t._elem, env), result)
            if output_views.is_view(func) and isinstance(args[0], Output):
                listed = isinstance(result, (list, tuple))  # split, unbind, chunk: pick each result
                for index, view in enumerate(result if listed else [result]):
                    output_views.record(view, args[0], (func, args[1:], kwargs or {}, index if listed else None))
            return result

        # the value, kept in the instance's dict: a view's is its root's replayed when the root
        # changed, and a write to a view reaches its root (``output_views``)
        @property
        def _elem(self):
            state = self.__dict__
            root = state.get(output_views.ROOT)
            if root is not None and state[output_views.SEEN] != output_views.version(root):
                state[_VALUE] = output_views.replay(state[output_views.CHAIN], root._elem, env)
                state[output_views.SEEN] = output_views.version(root)
            return state[_VALUE]

        @_elem.setter
        def _elem(self, value):
            state = self.__dict__
            state[_VALUE] = value
            root = state.get(output_views.ROOT)
            if root is None:
                state[output_views.VERSION] = state.get(output_views.VERSION, 0) + 1
            else:
                root._elem = output_views.scatter(root._elem, state[output_views.CHAIN], value, env)
                state[output_views.SEEN] = output_views.version(root)

        # torchax's Tensor writes these two in Python, past torch's dispatch: its flatten returned a
        # plain torchax tensor with no autograd (``logits.flatten(0, 1)`` in a loss computed outside
        # the module: unusable outside the environment, and cut from the backward), and its
        # type_as cast the tensor itself in place. torch's own run through the dispatch above
        def flatten(self, start_dim=0, end_dim=-1):
            return torch.flatten(self, start_dim, end_dim)

        def type_as(self, other):
            return self.to(other.dtype)

        def detach(self):
            # shares the values, as torch's detach: a write to either shows in the other
            detached = Output(jax.lax.stop_gradient(self._elem), env)
            output_views.record(detached, self, (torch.ops.aten.alias.default, (), {}, None))
            return detached

        @property
        def data(self):
            # torchax logs "In-place to .data modifications still results a copy" at each read; a
            # loop reads outputs.data (cifar's torch.max(outputs.data, 1)): a detached view, as torch's
            return self.detach()

        @data.setter
        def data(self, other):
            ttensor.Tensor.data.fset(self, other)

        def __format__(self, spec: str) -> str:
            # torch formats a one-number tensor as the number (``f"loss {loss:.4f}"``, DeepSpeed-Chat's
            # ``f"loss = {loss}"``): a host read the script asks for, as ``loss.item()`` is. torchax
            # printed its own repr, and a format spec raised TypeError
            if self.dim() == 0:
                return self.item().__format__(spec)
            return object.__format__(self, spec)

        def __repr__(self, *, tensor_contents=None) -> str:
            # as torch prints a tensor, with the outputs' device: "tensor(2.4690, device='jax:0')"
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", READ_ONLY_HOST_VALUE)  # only printed
                    host = repr(torch_mappings.j2t(self._elem, use_dlpack=False))
            except Exception:  # values spread over other processes: torchax's own form
                return ttensor.Tensor.__str__(self)
            grad = ", requires_grad=True" if self.requires_grad else ""
            return f"{host[:-1]}, device='{self.device}'{grad})"

        __str__ = __repr__

        def __reduce_ex__(self, protocol):
            # ``torch.save`` (pickle) of an output, a metric a script keeps with its checkpoint
            # (ImageNet's ``best_acc1``): its value as a host tensor, which loads anywhere. This
            # class is made per process, and pickle could not name it ("Can't pickle local object")
            return self.detach().cpu().__reduce_ex__(protocol)

    return Output
