"""What both engines (torch_xla's and the torchax backend's) answer the same way: DeepSpeed's
batch numbers and its accumulation boundary, read from the resolved config, the plan and the
precision policy. One definition, so the two backends cannot drift apart."""

from __future__ import annotations

import torch


class DeepSpeedCounters:
    """Needs ``_batch`` (config.BatchSizes), ``plan``, ``_config``, ``precision``, ``micro_steps``
    and ``_boundary_override`` on the engine."""

    # ---- DeepSpeed batch numbers -------------------------------------------------
    def train_batch_size(self) -> int:
        return self._batch.global_batch

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch.rows_per_rank

    def gradient_accumulation_steps(self) -> int:
        return self._batch.accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.plan.stage

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def bfloat16_enabled(self) -> bool:
        return self.precision.param_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.precision.param_dtype == torch.float16

    # ---- accumulation boundary -----------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary
