"""The atomic directory protocol: a save writes ``.saving.<tag>`` and renames it into place
once complete, then replaces ``latest``; re-saving a tag moves the old copy aside first. A
crash between renames is repaired by the next save (``recover``), and a load in between
reads whichever copy is complete."""

from __future__ import annotations
import contextlib
import io
import os
import re
import shutil
from typing import Optional
import torch
from spmdzero.io.checkpoint_format import (ASIDE, CLIENT_FILE, CheckpointError, LATEST_FILE, LEGACY_ASIDE,
                                           LEGACY_META, LEGACY_STAGING, META_FILE, STAGING, STATE_DIR, _is_writer)




def _pickle_client_state(client_state: Optional[dict]) -> Optional[bytes]:
    """Serialize first, so an object that cannot be pickled fails before anything is written."""
    if not client_state:
        return None
    buffer = io.BytesIO()
    try:
        torch.save(client_state, buffer)
    except Exception as err:
        raise CheckpointError(f"client_state cannot be saved (it must be picklable): {type(err).__name__}: {err}") \
            from None
    return buffer.getvalue()


def prepare_dir(save_dir: str) -> None:
    """Create ``save_dir`` and finish or undo whatever an interrupted save left there."""
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create checkpoint directory {save_dir!r}: {err.strerror}") from None
    if not os.access(save_dir, os.W_OK):
        raise CheckpointError(f"checkpoint directory {save_dir!r} is not writable")
    if _is_writer():
        recover(save_dir)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE)) or os.path.isfile(os.path.join(path, LEGACY_META))


def interrupted(save_dir: str) -> dict[str, tuple[str, str]]:
    """{tag: (copy moved aside, new copy)} for each re-save killed between its two renames
    (the old copy moved aside, the tag itself missing); also from format-1 saves, whose
    names end in ``.<pid>``."""
    found = {}
    names = set(os.listdir(save_dir)) if os.path.isdir(save_dir) else set()
    for name in sorted(names):
        if name.startswith(ASIDE):
            tag, new = name[len(ASIDE):], STAGING + name[len(ASIDE):]
        elif name.startswith(LEGACY_ASIDE) and re.fullmatch(r".+\.\d+", name[len(LEGACY_ASIDE):]):
            tag, new = name[len(LEGACY_ASIDE):].rsplit(".", 1)[0], LEGACY_STAGING + name[len(LEGACY_ASIDE):]
        else:
            continue
        if tag not in names:
            found[tag] = (os.path.join(save_dir, name), os.path.join(save_dir, new))
    return found


def recover(save_dir: str) -> list[str]:
    """Repair what a save killed part-way left behind; returns what it did. A re-save
    killed between its two renames gets its complete new copy put in place if there is
    one, else the old copy back. Then leftover staging and aside directories (the user's
    files in an aside copy moved into its tag first) and temporary ``latest`` files are
    removed. Only names spmdzero makes are touched."""
    done = []
    for tag, (old, new) in interrupted(save_dir).items():
        source = new if _complete(new) else old
        os.replace(source, os.path.join(save_dir, tag))
        done.append(f"restored {tag!r} from {os.path.basename(source)}")
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        tag = _leftover_tag(name)
        if tag is not None and os.path.isdir(path):
            if name.startswith((ASIDE, LEGACY_ASIDE)) and os.path.isdir(os.path.join(save_dir, tag)):
                carry_over(path, os.path.join(save_dir, tag))
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {name}")
        elif re.fullmatch(re.escape(LATEST_FILE) + r"\.tmp\.\d+", name) and not os.path.isdir(path):
            os.remove(path)
            done.append(f"removed {name}")
    return done


def _leftover_tag(name: str) -> Optional[str]:
    """The tag of a staging or aside directory's name, None for any other name (format-1
    names end in ``.<pid>``: a user's ``.tmp.cache`` is not one)."""
    for prefix in (STAGING, ASIDE):
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    for prefix in (LEGACY_STAGING, LEGACY_ASIDE):
        found = re.fullmatch(re.escape(prefix) + r"(.+)\.\d+", name)
        if found:
            return found.group(1)
    return None


def staging_dir(save_dir: str, tag: str) -> str:
    """One name per tag, so every host of a multi-host run writes its shards into the same
    staging directory."""
    staging = os.path.join(save_dir, STAGING + tag)
    if _is_writer():
        shutil.rmtree(staging, ignore_errors=True)
    return staging


def publish(save_dir: str, tag: str, staging: str, meta: str, client_bytes: Optional[bytes],
            save_latest: bool) -> None:
    """Complete the staging directory (client state, then meta: its presence marks a
    complete checkpoint), rename it to ``tag``, then replace ``latest``. Each step is a
    rename, so a reader sees the old checkpoint or the new one. Files of the user's in an
    older copy of the tag (a tokenizer, a config) are moved into the new one."""
    final = os.path.join(save_dir, tag)
    try:
        if client_bytes:
            _write_file(os.path.join(staging, CLIENT_FILE), lambda f: f.write(client_bytes))
        _write_file(os.path.join(staging, META_FILE), lambda f: f.write(meta.encode()))
        if os.path.exists(final):  # replace an older save of the same tag: move it aside first
            aside = os.path.join(save_dir, ASIDE + tag)
            os.replace(final, aside)
            os.replace(staging, final)
            carry_over(aside, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(staging, final)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {tag!r} in {save_dir!r} (the previous checkpoints are "
                              f"untouched): {err}") from None
    if save_latest:
        latest = os.path.join(save_dir, LATEST_FILE)
        try:
            _write_file(latest, lambda f: f.write(tag.encode()))
        except OSError as err:
            raise CheckpointError(f"checkpoint {tag!r} was saved to {final!r}, but {latest!r} could not be updated "
                                  f"to name it ({err}); load it with tag={tag!r}") from None


# What spmdzero writes into a tag's directory; anything else there is the user's.
OWN_FILES = (STATE_DIR, META_FILE, CLIENT_FILE, LEGACY_META)


def carry_over(old: str, new: str) -> None:
    """Move what the user added to an older copy of a tag into its new copy (DeepSpeed
    leaves such files alone when it saves a tag again)."""
    if not os.path.isdir(old):
        return
    for name in os.listdir(old):
        if name not in OWN_FILES and not os.path.lexists(os.path.join(new, name)):
            os.replace(os.path.join(old, name), os.path.join(new, name))


def _write_file(path: str, write) -> None:
    """Write ``path`` whole or not at all: a temporary file, fsync, then rename over it."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
