"""Mesh shapes from the config, without devices."""

import pytest

from spmdzero.config.errors import ConfigError
from spmdzero.config.load import parse_config
from spmdzero.sharding.mesh import data_parallel_size, fsdp_size, resolve_hybrid_shape, resolve_mesh_shape


def shape(spmd, devices):
    return resolve_mesh_shape(parse_config({"train_batch_size": 64, "spmd": spmd}).spmd.mesh, devices)


def test_sixteen_or_more_fsdp_devices_get_a_second_fsdp_axis():
    """libtpu reduce-scatters over 16 chips one axis at a time (docs/tpu.md)."""
    assert resolve_mesh_shape(None, 8) == {"fsdp": 8}
    assert resolve_mesh_shape(None, 16) == {"fsdp": 8, "fsdp_inner": 2}
    assert shape({"mesh": {"data": 2}}, 32) == {"data": 2, "fsdp": 8, "fsdp_inner": 2}
    # from 128 fsdp devices an inner axis of 8 (measured on v5p:4x4x8, spmdzero/sharding/mesh.py)
    assert resolve_mesh_shape(None, 128) == {"fsdp": 16, "fsdp_inner": 8}
    assert resolve_mesh_shape(None, 256) == {"fsdp": 32, "fsdp_inner": 8}
    assert shape({"mesh": {"data": 2}}, 256) == {"data": 2, "fsdp": 16, "fsdp_inner": 8}
    assert resolve_mesh_shape(None, 64) == {"fsdp": 32, "fsdp_inner": 2}
    assert resolve_mesh_shape(None, 132) == {"fsdp": 66, "fsdp_inner": 2}  # 8 does not divide 132
    assert shape({"mesh": {"data": 2}}, 16) == {"data": 2, "fsdp": 8}  # 8 fsdp devices: one axis


def test_fsdp_inner_overrides_the_split_and_keeps_the_world_size():
    split = shape({"mesh": {"fsdp_inner": 2}}, 8)
    assert split == {"data": 1, "fsdp": 4, "fsdp_inner": 2}
    assert fsdp_size(split) == data_parallel_size(split) == 8
    assert shape({"mesh": {"fsdp_inner": 1}}, 64) == {"data": 1, "fsdp": 64}
    assert shape({"mesh": {"fsdp_inner": 4}}, 16) == {"data": 1, "fsdp": 4, "fsdp_inner": 4}


def test_bad_fsdp_inner_names_the_key():
    with pytest.raises(ConfigError, match="spmd.mesh.fsdp_inner: 3 must divide the fsdp size 8"):
        shape({"mesh": {"fsdp_inner": 3}}, 8)
    with pytest.raises(ConfigError, match="spmd.mesh.fsdp_inner"):
        shape({"mesh": {"fsdp_inner": 0}}, 8)


def test_multislice_splits_fsdp_within_a_slice_only():
    cfg = parse_config({"train_batch_size": 64, "spmd": {"dcn_mesh": {"data": 2}}})
    ici, dcn = resolve_hybrid_shape(cfg.spmd.mesh, cfg.spmd.dcn_mesh, 32)
    assert ici == {"data": 1, "fsdp": 8, "fsdp_inner": 2} and dcn == {"data": 2, "fsdp": 1, "fsdp_inner": 1}


def test_one_device_and_data_only_meshes_keep_a_single_fsdp_axis():
    """One chip (a v5e-1, a CPU run) and ``fsdp: 1`` (data parallel only) were refused by the
    fsdp_inner check: an inner axis of 1 is no split, whatever the fsdp size."""
    assert resolve_mesh_shape(None, 1) == {"fsdp": 1}
    assert shape({"mesh": {"data": -1, "fsdp": 1}}, 8) == {"data": 8, "fsdp": 1}
    assert shape({"mesh": {"fsdp_inner": 1}}, 1) == {"data": 1, "fsdp": 1}
    assert shape({"mesh": {"data": 16, "fsdp": 1}}, 16) == {"data": 16, "fsdp": 1}
    with pytest.raises(ConfigError, match="spmd.mesh.fsdp_inner: 2 must divide the fsdp size 1"):
        shape({"mesh": {"fsdp_inner": 2}}, 1)
