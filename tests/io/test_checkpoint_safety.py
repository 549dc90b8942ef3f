"""Loading a checkpoint never runs code from it (issue #16): crafted files in spmdzero's own
format and in DeepSpeed's are refused with one CheckpointError naming the file, through
``load_checkpoint``, ``spmdzero checkpoint consolidate`` and ``import-deepspeed``; the
payload (it would create a marker file) never runs. Device-free where possible; one engine."""

import fractions
import os
import pickle
import shutil

import pytest
import torch

import spmdzero
from spmdzero.io.checkpoint_format import CheckpointError
from spmdzero.io.consolidate import consolidate
from spmdzero.io.read import read_meta
from spmdzero.cli.main import main as cli

from conftest import REPO, tiny_mlp

CONFIG = {"train_batch_size": 8, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
DS_FIXTURE = os.path.join(REPO, "tests", "fixtures", "deepspeed_zero2_fp32_ckpt")


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def engine():
    engine, *_ = spmdzero.initialize(model=tiny_mlp(), config=CONFIG)
    return engine


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("good")
    engine.save_checkpoint(str(ckpt), tag="t", client_state={"epoch": 2, "ids": torch.arange(3), "name": "x"})
    return ckpt


def params(engine):
    return {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}


def copy(saved, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(saved, out)
    return out


def refused(engine, ckpt, marker, file, *, via_cli=True, capsys=None):
    """load_checkpoint and the consolidate CLI both refuse naming ``file``; nothing ran,
    the model is untouched."""
    before = params(engine)
    with pytest.raises(CheckpointError, match=file):
        engine.load_checkpoint(str(ckpt))
    assert all(torch.equal(before[n], p) for n, p in params(engine).items())
    if via_cli:
        assert cli(["checkpoint", "consolidate", str(ckpt), str(ckpt / "out.pt")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and file in err, err
        assert not (ckpt / "out.pt").exists()
    assert not marker.exists(), "the checkpoint ran code"
    return err if via_cli else ""


def test_plain_client_state_round_trips_without_trust(engine, saved):
    path, client = engine.load_checkpoint(str(saved))
    assert client["epoch"] == 2 and client["name"] == "x" and torch.equal(client["ids"], torch.arange(3))
    assert sorted(os.listdir(saved / "t")) == ["client_state.pt", "meta.json", "state"]


def test_crafted_dcp_metadata_is_refused(engine, saved, tmp_path, capsys):
    ckpt, marker = copy(saved, tmp_path), tmp_path / "ran"
    (ckpt / "t" / "state" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    assert "posix.system" in refused(engine, ckpt, marker, "state/.metadata", capsys=capsys)


def test_a_tensor_recorded_as_pickled_bytes_is_refused(engine, saved, tmp_path, capsys):
    """DCP reads a key its .metadata calls bytes with torch.load(weights_only=False)."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from spmdzero.io.safe_pickle import DCP_METADATA

    ckpt, marker = copy(saved, tmp_path), tmp_path / "ran"
    state = ckpt / "t" / "state"
    metadata = DCP_METADATA.load(io.BytesIO((state / ".metadata").read_bytes()))
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    (state / "evil.distcp").write_bytes(payload.getvalue())
    metadata.state_dict_metadata["model.0.weight"] = BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != "model.0.weight"}
    metadata.storage_data[MetadataIndex("model.0.weight")] = _StorageInfo("evil.distcp", 0, len(payload.getvalue()))
    (state / ".metadata").write_bytes(pickle.dumps(metadata))
    assert "pickled bytes" in refused(engine, ckpt, marker, "state/.metadata", capsys=capsys)


def test_crafted_client_state_needs_trust_and_plain_objects_need_it_too(engine, saved, tmp_path):
    ckpt, marker = copy(saved, tmp_path), tmp_path / "ran"
    torch.save({"epoch": Payload(marker)}, ckpt / "t" / "client_state.pt")
    with pytest.raises(CheckpointError, match=r"client_state.pt.*posix.system.*trust_client_state"):
        engine.load_checkpoint(str(ckpt))
    assert not marker.exists()
    # consolidation never reads client_state
    consolidate(str(ckpt), str(tmp_path / "m.pt"))
    assert not marker.exists()
    torch.save({"ratio": fractions.Fraction(1, 3)}, ckpt / "t" / "client_state.pt")
    with pytest.raises(CheckpointError, match="fractions.Fraction"):
        engine.load_checkpoint(str(ckpt))
    assert engine.load_checkpoint(str(ckpt), trust_client_state=True)[1] == {"ratio": fractions.Fraction(1, 3)}


def legacy(saved, tmp_path, client_state=None):
    """The same checkpoint in format 1: everything in meta.pt, client_state inline."""
    ckpt = copy(saved, tmp_path)
    meta = read_meta(str(ckpt / "t"))
    meta.update(format=1, client_state=client_state if client_state is not None else {"epoch": 2})
    meta.pop("module_keys")
    meta["optimizer"].pop("type")
    torch.save(meta, ckpt / "t" / "meta.pt")
    os.remove(ckpt / "t" / "meta.json")
    os.remove(ckpt / "t" / "client_state.pt")
    return ckpt


def test_format_1_checkpoints_load_only_as_data(engine, saved, tmp_path, capsys):
    ckpt = legacy(saved, tmp_path / "ok")
    assert engine.load_checkpoint(str(ckpt))[1] == {"epoch": 2}
    assert cli(["checkpoint", "consolidate", str(ckpt), str(tmp_path / "m.pt")]) == 0
    marker = tmp_path / "ran"
    evil = legacy(saved, tmp_path / "evil", client_state={"x": Payload(marker)})
    refused(engine, evil, marker, "meta.pt", capsys=capsys)


def ds_copy(tmp_path):
    out = tmp_path / "ds"
    shutil.copytree(DS_FIXTURE, out)
    return out / "global_step6"


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_2_mp_rank_00_optim_states.pt"])
def test_crafted_deepspeed_files_are_refused(engine, tmp_path, capsys, name):
    from spmdzero.io.deepspeed_import import _DeepSpeedStandIn, _load

    def plain(value):  # stand-ins cannot be pickled again: the file keeps its tensors and containers
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(plain(v) for v in value)
        return None if isinstance(value, _DeepSpeedStandIn) else value

    step, marker = ds_copy(tmp_path), tmp_path / "ran"
    content = plain(_load(str(step / name)))
    content["sneaky"] = [Payload(marker)]
    torch.save(content, step / name)
    with pytest.raises(CheckpointError, match=f"{name}.*posix.system"):
        engine.load_checkpoint(str(step.parent))
    assert cli(["checkpoint", "import-deepspeed", str(step.parent), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and name in err and "posix.system" in err, err
    assert not (tmp_path / "out" / "global_step6").exists() and not marker.exists()


def test_deepspeed_globals_are_only_stand_ins():
    """A 'deepspeed.*' global is never imported, whatever it is called with."""
    import io

    from spmdzero.io.deepspeed_import import _PICKLE

    # protocol 2: GLOBAL deepspeed.runtime.utils system, ("touch x",), REDUCE
    raw = b"\x80\x02cdeepspeed.runtime.utils\nsystem\nX\x07\x00\x00\x00touch x\x85R."
    obj = _PICKLE.Unpickler(io.BytesIO(raw)).load()
    assert type(obj).__name__ == "system" and obj.args == ("touch x",)


def test_zero3s_tensor_rebuild_makes_only_tensors_from_allowed_globals():
    """DeepSpeed's ZeRO-3 files rebuild their partitions through torch's ``_rebuild_from_type_v2``:
    the rebuild it names is still checked against the allowlist, and what it makes must be a tensor."""
    import io

    from spmdzero.io.deepspeed_import import _PICKLE
    from spmdzero.io.safe_pickle import RefusedGlobal

    head = b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n("
    # rebuild = posix.system, args ("touch x",): refused at the global
    with pytest.raises(RefusedGlobal, match="posix.system"):
        _PICKLE.Unpickler(io.BytesIO(head + b"cposix\nsystem\nctorch\nTensor\nX\x07\x00\x00\x00touch x\x85}tR.")).load()
    # rebuild = builtins.set (allowed as a container), args (): not a tensor
    with pytest.raises(RefusedGlobal, match="non-tensor"):
        _PICKLE.Unpickler(io.BytesIO(head + b"cbuiltins\nset\nctorch\nTensor\n)}tR.")).load()
