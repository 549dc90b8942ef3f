"""Releasing JAX arrays off the training loop's thread.

Dropping the last reference to a JAX array costs the host a few microseconds (milliseconds a
step for an update's hundreds of inputs, docs/benchmarks.md, the torchax backend), and on some
runtimes it waits for a dispatched program still reading the array. The engine hands the arrays
it is done with (the gradients an update or a backward consumed) to one helper thread, as soon
as it is done with them: held any longer they are a second copy of the gradients on every
device, above ZeRO's accounting (docs/benchmarks.md, device memory). ``drain`` waits for what
was handed over, for a measurement of the memory held (``engine.wait()``).

The thread is stopped at the interpreter's exit, after what it holds is released: a daemon
thread still releasing an array when Python finalizes is ended by the C library's forced unwind
inside jaxlib's destructor, and the process aborts ("terminate called after throwing an instance
of ''", exit -6) after the script's last line has run."""

from __future__ import annotations

import atexit
import functools
import queue
import threading


def release_in_background(arrays) -> None:
    """Drop ``arrays`` (any structure of JAX arrays; None: nothing) on the helper thread."""
    if arrays is not None:
        _release_thread()[0].put(arrays)


def drain() -> None:
    """Return once everything handed to ``release_in_background`` so far is released."""
    done = threading.Event()
    releases, thread = _release_thread()
    releases.put(done)
    while not done.wait(timeout=1.0):
        if not thread.is_alive():  # stopped at exit: nothing is released any more
            return


@functools.lru_cache(maxsize=None)
def _release_thread() -> tuple[queue.SimpleQueue, threading.Thread]:
    """One daemon thread for the process (every engine), started at the first release, stopped
    at exit once it has released everything handed to it."""
    releases: queue.SimpleQueue = queue.SimpleQueue()

    def release_forever():
        while True:
            arrays = releases.get()
            if arrays is _STOP:
                return
            if isinstance(arrays, threading.Event):  # drain's marker: everything before it is released
                arrays.set()
            del arrays  # the last reference: the arrays are released here, not in the training loop

    thread = threading.Thread(target=release_forever, name="spmdzero-release", daemon=True)
    thread.start()

    def stop_at_exit():
        releases.put(_STOP)
        thread.join()

    # registered after jax's own exit handlers (jax is imported by now), so it runs before them
    atexit.register(stop_at_exit)
    return releases, thread


_STOP = object()  # the exit's marker: the thread returns
