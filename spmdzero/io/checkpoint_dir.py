"""The atomic directory protocol: a save writes ``.saving.<tag>`` and renames it into place
once complete, then replaces ``latest``; re-saving a tag moves the old copy aside first. A
crash between renames is repaired by the next save (``recover``), and a load in between
reads whichever copy is complete. Saves into one directory take turns (``saving``: a lock
per process and a ``flock`` on the directory), so one save's recovery never takes another's
live staging directory for a leftover; loads share the directory lock (``reading``). Links
are never followed out of the directory, and nothing the user made is moved or deleted."""

from __future__ import annotations
import contextlib
import errno
import fcntl
import io
import os
import re
import shutil
import threading
import warnings
from typing import Callable, Iterator, Optional
import torch
from spmdzero.io.checkpoint_format import (ASIDE, CLIENT_FILE, CheckpointError, LATEST_FILE, LEGACY_ASIDE,
                                           LEGACY_META, LEGACY_STAGING, META_FILE, STAGING, STATE_DIR, is_writer)




def pickled_client_state(client_state: Optional[dict]) -> Optional[bytes]:
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


# One save or load at a time in this process: two threads saving with one engine read the
# device state at once (torch_xla segfaults there), and a save's ``latest.tmp.<pid>`` is one
# name per process. Reentrant, for a save nested in a caller's own ``saving``.
_IN_PROCESS = threading.RLock()
_HELD = threading.local()  # the directories this thread holds the lock of (not locked twice)

# Where a directory cannot be flock'ed (NFS emulates flock with POSIX locks, which need a file
# open for writing), the lock is taken on this file in it instead. A hidden name: never a tag.
LOCK_FILE = ".spmdzero.lock"
_NO_DIRECTORY_LOCK = (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)


@contextlib.contextmanager
def saving(save_dir: str) -> Iterator[None]:
    """Hold ``save_dir`` for one save: create it, wait for any other save into it (this
    process's threads, other processes, other runs on a shared file system), then repair
    what an interrupted save left. Recovery removes every staging directory, so it is only
    safe while no other save is writing one. Only process 0 locks and repairs: the other
    hosts of a run write their shards into the staging directory process 0 holds."""
    with _IN_PROCESS:
        try:
            os.makedirs(save_dir, exist_ok=True)
        except OSError as err:
            raise CheckpointError(f"cannot create checkpoint directory {save_dir!r}: {err.strerror}") from None
        if not os.access(save_dir, os.W_OK):
            raise CheckpointError(f"checkpoint directory {save_dir!r} is not writable")
        if not is_writer():
            yield
            return
        with _dir_lock(save_dir, exclusive=True):
            recover(save_dir)
            yield


@contextlib.contextmanager
def reading(load_dir: str) -> Iterator[None]:
    """Hold ``load_dir`` for one load: a save into it waits until the load is done, so a load
    never reads a copy that a concurrent re-save of its tag moves away. Best effort: a
    directory that cannot be locked (read-only, missing) is read as it is."""
    with _IN_PROCESS, _dir_lock(load_dir, exclusive=False):
        yield


def prepare_dir(save_dir: str) -> None:
    """Create ``save_dir`` and finish or undo whatever an interrupted save left there."""
    with saving(save_dir):
        pass


@contextlib.contextmanager
def _dir_lock(path: str, exclusive: bool) -> Iterator[None]:
    """``flock`` on the directory (released when the descriptor closes, so also when the
    process dies: nothing stale to clean up). Tells the user when it has to wait."""
    held = _HELD.__dict__.setdefault("dirs", set())
    key = os.path.realpath(path)
    if key in held:
        yield
        return
    fd = _lock(path, exclusive)
    held.add(key)
    try:
        yield
    finally:
        held.discard(key)
        if fd is not None:
            os.close(fd)


def _lock(path: str, exclusive: bool) -> Optional[int]:
    """The locked descriptor: the directory's, else its ``LOCK_FILE``'s where the file system
    cannot lock a directory. None when neither can be locked: a load goes on without; a
    save goes on with a warning, since it cannot tell whether another save runs."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    reason = None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        fd, reason = None, err.strerror
    if fd is not None:
        try:
            _flock(fd, mode, path, exclusive)
            return fd
        except BaseException as err:  # an interrupt while waiting too: the descriptor is closed
            os.close(fd)
            if not isinstance(err, OSError):
                raise
            if err.errno not in _NO_DIRECTORY_LOCK:
                raise CheckpointError(f"cannot lock checkpoint directory {path!r}: {err.strerror}") from None
            reason = err.strerror
    lock_file = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT if exclusive else os.O_RDONLY, 0o644)
        try:
            _flock(fd, mode, path, exclusive)
        except BaseException:
            os.close(fd)
            raise
        return fd
    except OSError as err:
        if exclusive:
            warnings.warn(f"spmdzero: cannot lock checkpoint directory {path!r} ({reason}; {lock_file!r}: "
                          f"{err.strerror}): a save into it from another process at the same time would not "
                          "wait for this one", stacklevel=2)
        return None


def _flock(fd: int, mode: int, path: str, exclusive: bool) -> None:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        busy = "another save into it, or a load from it, is" if exclusive else "a save into it is"
        warnings.warn(f"spmdzero: waiting {'to save into' if exclusive else 'to load from'} checkpoint directory "
                      f"{path!r}: {busy} under way in another process", stacklevel=2)
        fcntl.flock(fd, mode)


def check_target(save_dir: str, tag: str) -> None:
    """A save replaces the tag's directory: refuse a tag that is a link or a file. Through a
    link, a re-save would move the link (the user's) aside and the target's files (anywhere,
    also outside the checkpoint directory) into the new copy; neither is spmdzero's to move."""
    final = os.path.join(save_dir, tag)
    if os.path.islink(final):
        raise CheckpointError(f"cannot save checkpoint {tag!r}: {final!r} is a symbolic link (to "
                              f"{os.readlink(final)!r}); a save does not replace a link or write through one. "
                              "Remove the link, or save under another tag")
    if os.path.lexists(final) and not os.path.isdir(final):
        raise CheckpointError(f"cannot save checkpoint {tag!r}: {final!r} exists and is not a directory")


def is_complete(path: str) -> bool:
    """Whether ``path`` is a whole checkpoint (its meta is written last). A link is never one
    of ours: recovery does not put it in place of a tag."""
    if os.path.islink(path):
        return False
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
    removed. Only names spmdzero makes are touched, and a link under such a name is removed
    itself, never followed (an older spmdzero moved a linked tag aside as a link)."""
    done = []
    for tag, (old, new) in interrupted(save_dir).items():
        source = new if is_complete(new) else old
        os.replace(source, os.path.join(save_dir, tag))
        done.append(f"restored {tag!r} from {os.path.basename(source)}")
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        tag = _leftover_tag(name)
        if tag is not None and os.path.islink(path):
            os.unlink(path)
            done.append(f"removed link {name}")
        elif tag is not None and os.path.isdir(path):
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
    if is_writer():
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
        check_target(save_dir, tag)  # checked before the state was written too; the last word is here
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
    except CheckpointError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
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
    leaves such files alone when it saves a tag again). Never out of a link: what it points
    to is not the old copy."""
    if os.path.islink(old) or not os.path.isdir(old):
        return
    for name in os.listdir(old):
        if name not in OWN_FILES and not os.path.lexists(os.path.join(new, name)):
            os.replace(os.path.join(old, name), os.path.join(new, name))


def _write_file(path: str, write) -> None:
    """Write ``path`` whole or not at all, from ``write(file object)``."""
    def to(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)
    replace_file(path, to)


def replace_file(path: str, write_to: Callable[[str], None]) -> None:
    """Write ``path`` whole or not at all: ``write_to`` writes a temporary file next to it,
    which is synced and then renamed over ``path``. A failure (a full disk) removes the
    temporary file and leaves whatever was at ``path`` as it was."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        write_to(tmp)
        fd = os.open(tmp, os.O_RDONLY)  # on the disk before the rename makes it the file
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if os.path.isfile(path):  # keep the mode the user gave the file it replaces
            with contextlib.suppress(OSError):
                shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
