"""DeepSpeed features outside spmdzero (ZeRO data parallelism under GSPMD), by module.

Importing one of these names through the ``deepspeed`` alias raises
``UnsupportedFeatureError``: an ImportError (so ``try: import ... except ImportError``
still works) whose message names the feature, rather than a bare "No module named".
"""

UNSUPPORTED = {
    "deepspeed.pipe": "pipeline parallelism (PipelineModule)",
    "deepspeed.runtime.pipe": "pipeline parallelism (PipelineModule)",
    "deepspeed.moe.layer": "Mixture of Experts (MoE)",
    "deepspeed.moe.sharded_moe": "Mixture of Experts (MoE)",
    "deepspeed.moe.experts": "Mixture of Experts (MoE)",
    "deepspeed.inference": "DeepSpeed-Inference",
    "deepspeed.module_inject": "DeepSpeed-Inference kernel injection",
    "deepspeed.ops.sparse_attention": "sparse attention kernels",
    "deepspeed.ops.transformer": "DeepSpeed's CUDA transformer kernels",
    "deepspeed.sequence": "sequence parallelism (Ulysses)",
    "deepspeed.runtime.zero.stage3": "DeepSpeed's hand-partitioned ZeRO-3 optimizer (spmdzero's stage 3 is a "
                                     "sharding layout of its engine: \"zero_optimization\": {\"stage\": 3})",
    "deepspeed.runtime.hybrid_engine": "the hybrid (RLHF) engine",
}


class UnsupportedFeatureError(ImportError):
    pass


def check_supported(fullname: str) -> None:
    for prefix, feature in UNSUPPORTED.items():
        if fullname == prefix or fullname.startswith(prefix + "."):
            raise UnsupportedFeatureError(
                f"{fullname}: {feature} is not supported by spmdzero, which runs DeepSpeed's ZeRO data "
                "parallelism under GSPMD (see docs/migrating.md)", name=fullname)


def unsupported_attribute(package: str, name: str) -> AttributeError:
    """For ``deepspeed.moe.layer.MoE`` reached as attributes, without an import statement:
    an AttributeError (``hasattr`` stays False) with the same message."""
    fullname = f"{package}.{name}"
    try:
        check_supported(fullname)
    except UnsupportedFeatureError as err:
        return AttributeError(str(err))
    return AttributeError(f"module {package!r} (spmdzero's compatibility layer) has no attribute {name!r}")
