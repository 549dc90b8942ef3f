"""Nothing silently wrong, nothing lost (issue #32, checkpoints): a tag that is a symbolic
link is refused and its target never touched; saves into one directory from two processes or
two threads wait for each other, and every save that reports success loads; consolidation
writes its output atomically, so a full disk leaves the previous output loadable and says so
in one line. One shared engine; the two-process test starts its own interpreters."""

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

from spmdzero.cli.main import main as cli
from spmdzero.io.checkpoint_format import CheckpointError

from conftest import REPO
from test_checkpoint_faults import CONFIG, engine, listing  # noqa: F401 (engine: the same module-scoped fixture)


def tree(path):
    """{relative path: bytes} of every file under ``path`` (links not followed)."""
    found = {}
    for root, dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                found[os.path.relpath(full, path)] = f.read()
    return found


# ---- item 9: a tag that is a symbolic link ------------------------------------------------------

@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_tag_that_is_a_link_is_refused_and_its_target_untouched(engine, tmp_path, where):
    """Re-saving through a link used to move the target's files into the new tag and leave a
    ``.replaced.<tag>`` link behind for good. The link and the target are the user's: refused."""
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt), tag="global_step0", client_state={"v": 1})
    if where == "outside":
        engine.save_checkpoint(str(tmp_path / "elsewhere"), tag="real", client_state={"v": 0})
        target = tmp_path / "elsewhere" / "real"
        link_text = str(target)
    else:
        target = ckpt / "global_step0"
        link_text = "global_step0"  # a relative link, as `ln -s global_step0 best` makes
    (target / "tokenizer.json").write_text("{}")
    os.symlink(link_text, ckpt / "best")
    before, before_listing = tree(target), listing(ckpt)
    with pytest.raises(CheckpointError, match=r"'best'.*symbolic link"):
        engine.save_checkpoint(str(ckpt), tag="best", client_state={"v": 2})
    assert tree(target) == before
    assert listing(ckpt) == before_listing  # no .replaced.best, no .saving.best
    assert os.readlink(ckpt / "best") == link_text
    assert engine.load_checkpoint(str(ckpt), tag="best")[1] == {"v": 0 if where == "outside" else 1}


def test_a_leftover_link_is_removed_without_following_it(engine, tmp_path):
    """A ``.replaced.<tag>`` link left by an older spmdzero: the next save removes the link
    itself and moves nothing out of its target."""
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"precious")
    engine.save_checkpoint(str(ckpt), tag="x", client_state={"v": 1})
    os.symlink(str(outside), ckpt / ".replaced.x")
    os.symlink(str(outside), ckpt / ".saving.y")
    engine.save_checkpoint(str(ckpt), tag="other")
    assert listing(ckpt) == ["latest", "other", "x"]
    assert listing(outside) == ["data.bin"] and (outside / "data.bin").read_bytes() == b"precious"
    assert listing(ckpt / "x") == ["client_state.pt", "meta.json", "state"]


# ---- item 10: concurrent saves into one directory ----------------------------------------------

SAVER = """
import json, os, sys, time, torch, spmdzero
torch.manual_seed(0)
engine, *_ = spmdzero.initialize(model=torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                 torch.nn.Linear(64, 8)), config=CONFIG)
open(os.path.join(READY, str(ME)), "w").close()
deadline = time.monotonic() + 300
while len(os.listdir(READY)) < 2 and time.monotonic() < deadline:  # start saving together
    time.sleep(0.01)
results = []
for k in range(SAVES):
    for tag in (f"p{ME}_{k}", "shared"):
        try:
            engine.save_checkpoint(CKPT, tag=tag, client_state={"who": ME, "k": k})
        except BaseException as err:
            results.append([tag, "raised", f"{type(err).__name__}: {err}"[:300]])
            continue
        try:
            client = engine.load_checkpoint(CKPT, tag=tag)[1]
        except BaseException as err:
            results.append([tag, "saved but does not load", f"{type(err).__name__}: {err}"[:300]])
            continue
        mine = client == {"who": ME, "k": k}
        results.append([tag, "ok" if mine or tag == "shared" else f"loads another save: {client}", ""])
print("RESULTS", json.dumps(results))
"""


def test_two_processes_saving_into_one_directory_lose_nothing(engine, tmp_path):
    """Each save's recovery used to delete every ``.saving.*`` directory, the other process's
    live one too: most saves raised, and some that reported success lacked a shard. Two
    processes, each saving its own tags and one shared tag: every save succeeds and loads,
    in the process right after it returned and here afterwards."""
    ckpt, ready = tmp_path / "ckpt", tmp_path / "ready"
    ready.mkdir()
    procs = []
    for me in (0, 1):
        script = (f"CONFIG = {CONFIG!r}\nCKPT = {str(ckpt)!r}\nREADY = {str(ready)!r}\nME = {me}\nSAVES = 3\n"
                  + textwrap.dedent(SAVER))
        procs.append(subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600) for p in procs]
    results = []
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
        results += json.loads(out.split("RESULTS", 1)[1])
    assert len(results) == 12
    assert [r for r in results if r[1] != "ok"] == []
    assert listing(ckpt) == ["latest", "p0_0", "p0_1", "p0_2", "p1_0", "p1_1", "p1_2", "shared"]
    for tag, *_ in results:
        client = engine.load_checkpoint(str(ckpt), tag=tag)[1]
        assert client["who"] == int(tag[1]) if tag != "shared" else client["who"] in (0, 1)


def test_two_threads_saving_at_once_take_turns(engine, tmp_path, monkeypatch):
    """Two threads saving with one engine used to run the device reads of both saves at once
    (1 run in 7-10 segfaulted in get_global_grad_norm). Saves in one process now take turns:
    the state is never gathered by two saves at once, and each save loads."""
    active, most = [0], [0]
    real = engine.state_tensors

    def gathering(*args, **kwargs):
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.3)  # wide enough for the other thread to arrive
        try:
            return real(*args, **kwargs)
        finally:
            active[0] -= 1

    monkeypatch.setattr(engine, "state_tensors", gathering)
    errors = []

    def save(me):
        try:
            for k in range(2):
                engine.save_checkpoint(str(tmp_path), tag=f"t{me}_{k}", client_state={"who": me, "k": k})
                engine.save_checkpoint(str(tmp_path), tag="shared", client_state={"who": me, "k": k})
        except BaseException as err:  # noqa: B036 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=save, args=(me,)) for me in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and most[0] == 1
    monkeypatch.undo()
    for me in (0, 1):
        for k in range(2):
            assert engine.load_checkpoint(str(tmp_path), tag=f"t{me}_{k}")[1] == {"who": me, "k": k}
    assert engine.load_checkpoint(str(tmp_path), tag="shared")[1]["k"] == 1
    assert not [n for n in listing(tmp_path) if n.startswith(".")]


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_SH)  # what a load in another process holds
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_save_waits_for_a_load_in_another_process_and_says_so(engine, tmp_path):
    engine.save_checkpoint(str(tmp_path), tag="t", client_state={"v": 1})
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.warns(UserWarning, match="waiting to save into checkpoint directory .*under way in another"):
            engine.save_checkpoint(str(tmp_path), tag="t", client_state={"v": 2})
        assert holder.poll() is not None and time.monotonic() - start > 0.5
    finally:
        holder.kill()
        holder.wait()
    assert engine.load_checkpoint(str(tmp_path))[1] == {"v": 2}


def test_where_a_directory_cannot_be_locked_a_lock_file_is(engine, tmp_path, monkeypatch):
    """NFS emulates flock with POSIX locks, which refuse a directory opened read-only
    (EBADF): the lock is then taken on ``.spmdzero.lock``, which recovery leaves alone, and
    still makes a second holder wait."""
    import fcntl
    import stat

    import spmdzero.io.checkpoint_dir as C

    real = fcntl.flock

    def nfs_like(fd, mode):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real(fd, mode)

    monkeypatch.setattr(fcntl, "flock", nfs_like)
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.save_checkpoint(str(tmp_path), tag="u")
    assert listing(tmp_path) == [".spmdzero.lock", "latest", "t", "u"]
    order = []

    def second():
        with C._dir_lock(str(tmp_path), exclusive=True):  # another thread: no lock held there
            order.append("second")

    with C._dir_lock(str(tmp_path), exclusive=True):
        thread = threading.Thread(target=second)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            thread.start()
            deadline = time.monotonic() + 60
            while not caught and time.monotonic() < deadline:  # the second holder is waiting
                time.sleep(0.05)
        order.append("first")
    thread.join(timeout=60)
    assert order == ["first", "second"]
    assert "waiting to save into" in str(caught[0].message)
    assert engine.load_checkpoint(str(tmp_path), tag="u")[0].endswith("u")


# ---- item 11: consolidation on a full disk -----------------------------------------------------

def full_disk(kind):
    """A writer that puts part of a file at ``path``, then fails as the disk filling up makes
    torch.save (a RuntimeError of its own) or safetensors fail, or with a plain ENOSPC."""
    def write(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half a file")
        if kind == "torch":
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 576 vs 534")
        if kind == "safetensors":
            from safetensors import SafetensorError
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


@pytest.mark.parametrize("kind", ["torch", "oserror", "safetensors"])
def test_consolidating_onto_a_full_disk_keeps_the_previous_output(engine, tmp_path, monkeypatch, capsys, kind):
    """Consolidation wrote in place: a full disk left the previous good file unloadable, and
    torch.save's own error escaped as a traceback. Now a temporary file is renamed over the
    output once complete; a failure is one line naming the output, and nothing else is left."""
    import safetensors.torch

    engine.save_checkpoint(str(tmp_path / "ck"))
    out = tmp_path / ("m.safetensors" if kind == "safetensors" else "m.pt")
    flags = ["--safetensors"] if kind == "safetensors" else []
    assert cli(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out), *flags]) == 0
    capsys.readouterr()
    good = out.read_bytes()
    if kind == "safetensors":
        monkeypatch.setattr(safetensors.torch, "save_file", full_disk(kind))
    else:
        monkeypatch.setattr(torch, "save", full_disk(kind))
    assert cli(["checkpoint", "consolidate", str(tmp_path / "ck"), str(out), *flags]) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "unchanged" in err, err
    assert out.read_bytes() == good and listing(tmp_path) == ["ck", out.name]
    if kind == "safetensors":
        assert set(safetensors.torch.load_file(str(out))) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    else:
        assert set(torch.load(str(out))) == {"0.weight", "0.bias", "2.weight", "2.bias"}
