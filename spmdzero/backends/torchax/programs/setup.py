"""What the programs are built from, named: one value the engine makes once and every builder
takes (``build_forward``, ``build_backward``), instead of reading the engine's attributes.

Why: a program is a plain function of arrays; what it closes over (the module, the plan's
layouts, the precision policy, the kernels chosen) is written here, so its builder can be read
without the engine."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class ProgramSetup:
    """The fixed inputs of the engine's program builders."""

    env: Any  # torchax's environment: torch ops on JAX
    module: Any  # the torch module traced (its parameters are inputs, not constants)
    trained: tuple  # the trained parameters' names
    plan: Any  # sharding.plan.ShardingPlan
    sharding: Callable  # a partition spec -> a NamedSharding on the engine's mesh
    param_specs: dict  # the parameters' layouts, by name
    grad_specs: dict  # the gradients' layouts, by name
    policy: Any  # optim.precision.PrecisionPolicy
    attention_kernels: Any  # which SDPA kernel runs (lowering.attention.AttentionChoice)
    expert_matmuls: Any  # how the experts' grouped matmuls split their rows (patches.moe_rows.Split)
    processes: int  # hosts of the mesh (a cotangent from each process's rows is combined)
    count_trace: Callable[[str], None]  # counts a trace of a program kind (the recompile guard reads them)
    compile: Any  # jit, or an eager run for a module that reads values (engine/host_reads.Fallback)
