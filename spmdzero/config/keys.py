"""Every key DeepSpeed 0.19 reads at stages 0-2, classified as data: ``NOOP_KEYS`` have no
meaning under GSPMD (accepted, warned about once when switched on, with the reason);
``REFUSED_KEYS`` would change the math (refused when switched on). One table, so that no
other module decides what a DeepSpeed key means."""

from __future__ import annotations


OFFLOAD_REASON = ("CPU/NVMe offload is not implemented: optimizer states and parameters stay in device memory "
                  "(ZeRO sharding still divides them over the devices)")


ZERO3_REASON = "ZeRO-3 only; DeepSpeed ignores it at stage 0-2 too (never warned)"


def zero3_reason(name: str):
    """Why a ZeRO-3 knob (``ZERO3_KEYS``) changes nothing at stage 3, where it is warned about:
    the parameters are sharded by annotation and XLA gathers each where the step uses it. None
    for the one that is read: ``stage3_gather_16bit_weights_on_model_save`` is what
    ``engine.zero_gather_16bit_weights_on_model_save()`` answers (the Hugging Face Trainer then
    saves whole 16-bit weights, or a checkpoint for zero_to_fp32, as with DeepSpeed)."""
    if "gather_16bit_weights_on_model_save" in name or "gather_fp16_weights_on_model_save" in name:
        return None
    if name.startswith(("zero_quantized", "zeropp", "zero_hpz", "mics")):
        return ("ZeRO++/MiCS variants of the collectives: XLA's all-gathers and reduce-scatters run "
                "unquantized over the whole fsdp axis")
    if name in ("sub_group_size", "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
                "leaf_module", "save_muon_momentum_buffer_in_memory"):
        return "DeepSpeed's stage-3 runtime mechanics (hooks, sub-groups, module wrapping), which the compiled step has not"
    return ("XLA gathers each parameter where the compiled step uses it and schedules the gathers itself: "
            "prefetch, persistence, live-parameter and bucket limits have nothing to tune")


# ZeRO-3 tuning knobs, by DeepSpeed's JSON names (stage3_* aliases and field names).
ZERO3_KEYS = (
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "prefetch_bucket_size",
    "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
    "gather_16bit_weights_on_model_save", "module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "allgather_sequential", "sub_group_size", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
    "mics_hierarchical_params_gather", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply", "save_muon_momentum_buffer_in_memory", "leaf_module",
)


# Values that mean "off" beyond false/null/"none"/{"enabled": false}: DeepSpeed's defaults.
OFF_VALUES: dict[str, tuple] = {
    "gradient_predivide_factor": (1, 1.0),
    "gradient_allreduce_op": ("mean", "MEAN", "Mean"),
    "checkpoint.tag_validation": ("Warn", "WARN", "warn", "Ignore", "IGNORE", "ignore"),
    "tensor_parallel": ({"autotp_size": 0}, {"autotp_size": 1}),
    "seq_parallel_communication_data_type": ("fp32",),  # DeepSpeed's default, stated
}


# No-op keys whose values DeepSpeed still checks (and refuses when invalid): checked here too.
NOOP_VALID_VALUES: dict[str, tuple[str, ...]] = {
    "checkpoint.tag_validation": ("ignore", "warn", "fail"),
    "seq_parallel_communication_data_type": ("fp32", "fp16", "bf16"),
}


# DeepSpeed 0.19 keys (dotted paths) that have no effect under GSPMD at stage 0-2: accepted,
# dropped before validation, and warned about once when enabled (see ``_enabled``).
NOOP_KEYS: dict[str, str] = {
    "zero_optimization.overlap_comm": "XLA schedules and overlaps collectives itself",
    "zero_optimization.contiguous_gradients": "XLA owns buffer layout; there are no gradient buckets to pack",
    "zero_optimization.reduce_scatter": "the compiler always emits a reduce-scatter for sharded gradients",
    "zero_optimization.reduce_bucket_size": "XLA's collective combiner sizes fused collectives",
    "zero_optimization.allgather_bucket_size": "XLA's collective combiner sizes fused collectives",
    "zero_optimization.allgather_partitions": "the compiler always all-gathers updated parameters",
    "zero_optimization.round_robin_gradients": "no per-rank gradient ownership to balance under SPMD",
    "zero_optimization.use_multi_rank_bucket_allreduce": "no buckets under SPMD",
    "zero_optimization.legacy_stage1": "there is one ZeRO-1 implementation",
    "zero_optimization.load_from_fp32_weights": "checkpoints always hold fp32 state",
    "zero_optimization.elastic_checkpoint": "checkpoints are resharded by torch.distributed.checkpoint",
    "zero_optimization.ignore_unused_parameters": "unused parameters get zero gradients in the graph",
    "zero_optimization.log_trace_cache_warnings": "there is no ZeRO-3 trace cache",
    "zero_optimization.enable_sanity_checks": "there are no hand-made partitions to check",
    # CPU/NVMe offload: one warning for all of them (same reason text).
    "zero_optimization.offload_optimizer": OFFLOAD_REASON,
    "zero_optimization.offload_param": OFFLOAD_REASON,
    "zero_optimization.cpu_offload": OFFLOAD_REASON,
    "zero_optimization.cpu_offload_param": OFFLOAD_REASON,
    "zero_optimization.cpu_offload_use_pin_memory": OFFLOAD_REASON,
    "aio": OFFLOAD_REASON,
    **{f"zero_optimization.{key}": ZERO3_REASON for key in ZERO3_KEYS},
    # Gradient averaging: DeepSpeed divides each rank's gradient by the world size before
    # (prescale) or partly before (predivide factor f: x/f, all-reduce, x*f/N) its all-reduce
    # sum; every variant yields the mean over ranks and differs only in fp16 rounding. Under
    # SPMD the loss is over the whole batch, so the gradient is that mean with no rank sum.
    "prescale_gradients": "the gradient is the mean over the global batch inside one graph; there is no "
                          "per-rank sum to pre-scale (the result equals DeepSpeed's up to rounding)",
    "gradient_predivide_factor": "the gradient is the mean over the global batch inside one graph; there is no "
                                 "per-rank sum to pre-divide (the result equals DeepSpeed's up to rounding)",
    # DeepSpeed 0.19.8 removed the feature and refuses the key; older configs keep working here.
    "sparse_gradients": "it sent embedding gradients sparse through DeepSpeed's all-reduce; gradients are dense "
                        "under XLA (same values). An nn.Embedding(sparse=True) itself is refused by initialize",
    "disable_allgather": "the compiler emits the all-gathers",
    "seq_parallel_communication_data_type": "there is no sequence parallelism",
    "use_data_before_expert_parallelism": "there is no expert parallelism",
    "bf16.immediate_grad_update": "gradients are folded into the ZeRO buffers inside the traced step",
    "optimizer.legacy_fusion": "the optimizer update is one traced XLA graph",
    "zero_allow_untested_optimizer": "any torch.optim optimizer is accepted",
    "zero_force_ds_cpu_optimizer": "there is no CPU optimizer (no offload)",
    "graph_harvesting": "CUDA graphs do not apply; XLA compiles the step once",
    "dump_state": "use engine.sharding_report()",
    "memory_breakdown": "use engine.sharding_report() and torch_xla's memory info",
    "flops_profiler": "the step log prints an estimated model TFLOP/s",
    "comms_logger": "use engine.collectives_report()",
    "autotuning": "not available",
    "timers": "steps_per_print logs samples/sec",
    "eigenvalue": "only consumed by DeepSpeed's quantizer and progressive layer drop, not available",
    # deepspeed.checkpointing.checkpoint(fn, *args) rematerializes (it is torch.utils.checkpoint); its
    # settings are about DeepSpeed's own model parallelism and memory handling
    "activation_checkpointing.partition_activations": "activations are already sharded with the batch; there is "
                                                      "no model-parallel group to partition them over",
    "activation_checkpointing.cpu_checkpointing": "checkpointed activations stay on the devices (no host offload)",
    "activation_checkpointing.contiguous_memory_optimization": "XLA allocates the step's buffers",
    "activation_checkpointing.number_checkpoints": "XLA allocates the step's buffers",
    "activation_checkpointing.synchronize_checkpoint_boundary": "the step is one compiled program: there is no "
                                                                "boundary to synchronize",
    "activation_checkpointing.profile": "the step log times whole steps",
    "pipeline": "applies to PipelineModule only (pipeline parallelism is out of scope)",
    "compile": "spmdzero always compiles the step with XLA",
    "log_level": "spmdzero logs through the 'spmdzero' logger",
    "checkpoint.tag_validation": "one process per host saves a single tag",
    "checkpoint.load_universal": "spmdzero checkpoints load on any mesh; convert DeepSpeed checkpoints "
                                 "with `spmdzero checkpoint import-deepspeed`",
    "checkpoint.use_node_local_storage": "every host writes its own shards",
    "checkpoint.parallel_write": "torch.distributed.checkpoint writes shards in parallel",
    "nebula": "checkpoints are written by torch.distributed.checkpoint",
    "hybrid_engine": "generation runs on the devices (spmd.generate), at ZeRO-3 with the weights laid out "
                     "tensor-parallel for the call: the Hybrid Engine as annotations, whatever this key says "
                     "(DeepSpeed-Chat calls actor.module.generate either way); its kernel knobs tune nothing here",
    "datastates_ckpt": "checkpoints are written by torch.distributed.checkpoint",
}


# Keys whose feature would change the training math, or is out of scope: refused when enabled.
REFUSED_KEYS: dict[str, str] = {
    "zero_optimization.zenflow": "ZenFlow updates part of the gradients asynchronously on the CPU; not available",
    "amp": "NVIDIA apex AMP does not exist on XLA; use the bf16 (or fp16) section",
    "gradient_allreduce_op": "'sum' would add the ranks' gradients instead of averaging them; spmdzero "
                             "computes the mean over the global batch",
    "fp16.fp16_master_weights_and_grads": "spmdzero keeps fp32 master weights and gradients",
    "data_types.buffer_dtype": "module buffers keep their dtype",
    "progressive_layer_drop": "progressive layer drop is not available",
    "curriculum_learning": "curriculum learning (legacy) is not available",
    "data_efficiency": "DeepSpeed's data efficiency library is not available",
    "compression_training": "DeepSpeed compression is not available",
    "quantize_training": "quantized training (MoQ) is not available",
    "weight_quantization": "weight quantization is not available",
    "sparse_attention": "sparse attention is out of scope",
    "elasticity": "elastic batch sizing is not available; checkpoints resume on any mesh",
    "tensor_parallel": "tensor parallelism is out of scope",
    "expert_parallel": "mixture-of-experts parallelism is out of scope",
}


