"""A torchax engine's state as checkpoints and reports read it (``train.engine_base``'s state
protocol): the names of the optimized tensors, the states as shards, the optimizer states made
lazily or as placeholders before the first step, and loading a checkpoint's values back onto
the devices. ``save_checkpoint``/``load_checkpoint`` are ``spmdzero.io``'s. A mixin of
``TorchaxEngine``."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from spmdzero.train.scan_layers import stacked_layers
from spmdzero.backends.torchax.optim import torch_optim



class StateProtocol:
    """The state part of ``TorchaxEngine`` (see the module docstring)."""

    # ---- the state protocol: what checkpoints use (spmdzero.io) ------------------------------------
    def optimized_names(self) -> dict[torch.Tensor, str]:
        """{optimizer target: its name in checkpoints}: the module's host parameters, which the
        optimizer's param groups hold (their values and states live on the devices)."""
        params = dict(self._module.named_parameters())
        return {params[name]: name for name in self._names}

    def stacked_layers(self) -> dict[str, str]:
        """{stacked parameter name: its stack's name} under ``spmd.scan_layers='stacked'`` (else
        empty): checkpoints record it so that they load into either form of the model, on
        either backend."""
        return stacked_layers(self._module)

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16): the loss scaler is then part of the state."""
        return self.state.loss_scale is not None

    @property
    def lazy_optimizer_state(self) -> bool:
        """Whether the optimizer creates its states at its first step (a torch.optim optimizer;
        spmdzero's make theirs up front)."""
        return self._torch_optimizer

    def placeholder_optimizer_state(self) -> list:
        """Give each trained parameter without optimizer states (a torch optimizer before its
        first step) the states that step creates, laid out by the plan, values meaning nothing,
        for a checkpoint load to write into; the host-kept ones (``torch_optim.HOST_KEYS``) go
        in ``optimizer.state``, as the torch_xla backend keeps them. On a shape-only engine each
        is a ``jax.ShapeDtypeStruct`` among the device states, where a later step has them all
        (what ``trace_step`` traces). Returns those parameters."""
        if not self._torch_optimizer:
            return []
        pending = [n for n in self._names if not self.state.opt_state[n]]
        if not pending:
            return []
        shapes = torch_optim.state_shapes(self.basic_optimizer, self._groups, self.state.masters or self.state.params, self._env,
                                          self._lr_mode)
        hosts = {name: p for p, name in self.optimized_names().items()}
        jax = self._jax
        for name in pending:
            device, host = {}, {}
            for key, shape in shapes[name].items():
                if self._shape_only:  # the states of a later step, all on the devices: what trace_step takes
                    device[key] = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=self._state_spec(name, shape))
                elif key in torch_optim.HOST_KEYS:
                    host[key] = torch.zeros(shape.shape, dtype=getattr(torch, str(shape.dtype)))
                else:
                    device[key] = jax.jit(functools.partial(jax.numpy.zeros, shape.shape, shape.dtype),
                                          out_shardings=self._state_spec(name, shape))()
            self.state = self.state._replace(opt_state={**self.state.opt_state, name: device})
            if host:
                self.basic_optimizer.state[hosts[name]] = host
        return [hosts[name] for name in pending]

    def drop_optimizer_state(self, targets) -> None:
        """Take the optimizer states of ``targets`` back to none (the next step creates them)."""
        names = self.optimized_names()
        for target in targets:
            self.state = self.state._replace(opt_state={**self.state.opt_state, names[target]: {}})
            self.basic_optimizer.state.pop(target, None)

    def _host_optimizer_state(self) -> None:
        """A torch optimizer's host-kept states (``torch_optim.HOST_KEYS``) copied into
        ``optimizer.state``, where a checkpoint saves them (a device read)."""
        for target, name in self.optimized_names().items():
            kept = {k: torch.tensor(np.asarray(v)) for k, v in self.state.opt_state[name].items()
                    if k in torch_optim.HOST_KEYS}
            if kept:
                self.basic_optimizer.state[target] = kept

    def _take_host_optimizer_state(self) -> None:
        """After a load: the host-kept states it wrote into ``optimizer.state`` go to the devices."""
        for target, name in self.optimized_names().items():
            kept = self.basic_optimizer.state.pop(target, {})
            values = {k: self.placement.put(torch.as_tensor(v, dtype=torch.float32), self.placement.replicated) for k, v in kept.items()
                      if k in torch_optim.HOST_KEYS}
            if values:
                self.state = self.state._replace(opt_state={**self.state.opt_state, name: {**self.state.opt_state[name], **values}})

    def state_shards(self):
        """The device side of checkpoints (``spmdzero.io.shards.StateShards``)."""
        from spmdzero.backends.torchax.engine.checkpoint import TorchaxStateShards

        return TorchaxStateShards(self)

    def _load_state(self, values: dict[str, Any]) -> None:
        """Put loaded values (JAX arrays by checkpoint key, any dtype and layout) in place of the
        live ones, in the live dtype and layout: the programs see the same inputs as before and
        are not traced again."""
        jax = self._jax

        def like(live, value):
            return jax.device_put(value.astype(live.dtype), live.sharding)

        for key, value in values.items():
            kind, _, rest = key.partition(".")
            if kind == "model" and rest in self.state.params:
                self.state = self.state._replace(params={**self.state.params, rest: like(self.state.params[rest], value)})
                self._module_stale = True
            elif kind in ("model", "buffer") and rest in self.state.constants:
                self.state = self.state._replace(constants={**self.state.constants, rest: like(self.state.constants[rest], value)})
                self._buffers_stale.add(rest)
            elif kind == "loss_scale" and self.state.loss_scale is not None:
                self.state = self.state._replace(loss_scale=self.state.loss_scale._replace(**{rest: like(getattr(self.state.loss_scale, rest), value)}))
            elif kind == "master":
                self.state = self.state._replace(masters={**self.state.masters, rest: like(self.state.masters[rest], value)})
            elif kind == "optim":
                name, _, state = rest.rpartition(".")
                if state in self.state.shared_state:  # one counter for every parameter: each saved copy is the same
                    self.state = self.state._replace(shared_state={**self.state.shared_state, state: like(self.state.shared_state[state], value)})
                else:
                    self.state = self.state._replace(opt_state={**self.state.opt_state,
                                       name: {**self.state.opt_state[name], state: like(self.state.opt_state[name][state], value)}})
            else:
                raise KeyError(f"{key!r} is not a state tensor of this engine")  # _select picks live keys only
        jax.block_until_ready((self.state.params, self.state.constants, self.state.masters, self.state.opt_state, self.state.shared_state,
                               self.state.loss_scale))

    def loaded(self, new_window: bool) -> None:
        """A checkpoint load has written the state: drop the gradients accumulated before it (they
        go with the weights they were computed at); a forward before it has no backward (its
        gradient would be another weights'). The host module is brought up to date when it is
        next read."""
        self._set_accum(None)
        self._window_reduced = False
        self._generation += 1
        self._last_skip = None
        if self._torch_optimizer:
            self._take_host_optimizer_state()

    # ---- checkpoints (spmdzero.io) -----------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False) -> bool:
        """DeepSpeed's ``save_checkpoint``, in the torch_xla backend's format (docs/checkpoints.md)."""
        from spmdzero.io.save import save_checkpoint

        self._take_host_changes()  # what the script changed on the module since the last forward is saved
        if not self._torch_optimizer:
            return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        self._host_optimizer_state()
        try:
            return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        finally:
            self.basic_optimizer.state.clear()

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, trust_client_state=None):
        """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``; loads either
        backend's checkpoints and DeepSpeed ZeRO-1/2 ones, on any device count."""
        from spmdzero.io.restore import load_checkpoint

        self._take_host_changes()  # the load then writes over the host's changes, not the reverse
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, trust_client_state)
