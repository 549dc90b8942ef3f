"""The multi-host and multislice planning, without the hardware: config -> mesh shapes ->
partition specs -> each host's batch slice."""

import pytest
import torch

from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.config.load import parse_config
from spmdzero.sharding.batch import resolve_batch
from spmdzero.train.data import ShardedDataLoader
from spmdzero.sharding.mesh import global_shape, resolve_hybrid_shape, resolve_mesh_shape
from spmdzero.sharding.plan import make_plan


def shapes(spmd, devices):
    cfg = parse_config({"train_batch_size": 64, "spmd": spmd})
    return resolve_hybrid_shape(cfg.spmd.mesh, cfg.spmd.dcn_mesh, devices)


def test_multislice_keeps_fsdp_within_a_slice_and_data_across_slices():
    ici, dcn = shapes({"dcn_mesh": {"data": 2}}, devices=16)
    assert ici == {"data": 1, "fsdp": 8} and dcn == {"data": 2, "fsdp": 1}
    assert global_shape(ici, dcn) == {"data": 2, "fsdp": 8}
    ici, dcn = shapes({"mesh": {"data": 2, "fsdp": -1}, "dcn_mesh": {"data": 4}}, devices=64)
    assert global_shape(ici, dcn) == {"data": 8, "fsdp": 8}


def test_fsdp_never_crosses_dcn():
    with pytest.raises(ConfigError, match="spmd.dcn_mesh.fsdp"):
        parse_config({"train_batch_size": 8, "spmd": {"dcn_mesh": {"data": 2, "fsdp": 2}}})
    with pytest.raises(ConfigError, match="3 slices do not divide the 16 devices"):
        shapes({"dcn_mesh": {"data": 3}}, devices=16)


def test_partition_specs_on_the_global_mesh():
    ici, dcn = shapes({"dcn_mesh": {"data": 2}}, devices=16)
    plan = make_plan([("w", (1024, 64)), ("b", (64,))], global_shape(ici, dcn), stage=2)
    assert plan["w"].optimizer_state == ("fsdp", None) and plan["w"].grad == ("fsdp", None)
    assert plan["w"].param == (None, None)
    assert plan.batch_spec(2) == (("data", "fsdp"), None)


@pytest.mark.parametrize("hosts,devices_per_host", [(2, 4), (4, 4), (4, 8)])
def test_each_host_feeds_the_rows_of_its_own_devices(hosts, devices_per_host):
    devices = hosts * devices_per_host
    shape = resolve_mesh_shape(None, devices)
    batch = resolve_batch(DeepSpeedConfig(train_micro_batch_size_per_gpu=2), dp_devices=devices, processes=hosts)
    ranks = [list(batch.host_ranks(h)) for h in range(hosts)]
    assert [r for host in ranks for r in host] == list(range(devices))  # every rank, once, in order
    for device in range(shape["fsdp"]):  # the batch is split over devices in device order
        assert device in ranks[device // devices_per_host]


def test_a_host_loads_only_its_data_parallel_ranks():
    dataset = torch.utils.data.TensorDataset(torch.arange(64.0))
    batch = resolve_batch(DeepSpeedConfig(train_micro_batch_size_per_gpu=2), dp_devices=8, processes=2)
    loader = ShardedDataLoader(dataset, batch, process_index=1)
    assert [rank_loader.sampler.rank for rank_loader in loader.rank_loaders] == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match="8 data-parallel devices do not divide over 3 processes"):
        resolve_batch(DeepSpeedConfig(train_micro_batch_size_per_gpu=2), dp_devices=8, processes=3)


def test_under_the_process_rule_a_host_is_one_deepspeed_rank():
    dataset = torch.utils.data.TensorDataset(torch.arange(64.0))
    cfg = DeepSpeedConfig(train_micro_batch_size_per_gpu=8, spmd={"rank": "process"})
    batch = resolve_batch(cfg, dp_devices=8, processes=2)
    loader = ShardedDataLoader(dataset, batch, process_index=1)
    sampler = loader.rank_loaders[0].sampler
    assert len(loader.rank_loaders) == 1 and (sampler.rank, sampler.num_replicas) == (1, 2)
    assert loader.rank_loaders[0].batch_size == 8 and batch.rows_per_device == 2
