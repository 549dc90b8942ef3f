"""``deepspeed.comm`` (see ``comm.py``)."""

from .comm import (  # noqa: F401
    CompletedWork, ReduceOp, TORCH_DISTRIBUTED_DEFAULT_PORT, all_gather, all_gather_into_tensor, all_gather_object,
    all_reduce, reduce_scatter_tensor, barrier, broadcast,
    broadcast_object_list, configure, destroy_process_group, get_global_rank, get_local_rank, get_rank,
    get_world_group, get_world_size, inference_all_reduce, init_distributed, is_available, is_initialized,
    log_summary, new_group, reduce,
)


def __getattr__(name):
    from .._unsupported import unsupported_attribute

    raise unsupported_attribute("deepspeed.comm", name)
