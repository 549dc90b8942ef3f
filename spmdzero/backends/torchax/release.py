"""Releasing JAX arrays off the training loop's thread.

Dropping the last reference to a JAX array costs the host a few microseconds (milliseconds a
step for an update's hundreds of inputs, docs/benchmarks.md, the torchax backend), and on some
runtimes it waits for a dispatched program still reading the array. The engine hands the arrays
it is done with (the gradients an update or a backward consumed) to one helper thread, as soon
as it is done with them: held any longer they are a second copy of the gradients on every
device, above ZeRO's accounting (docs/benchmarks.md, device memory). ``drain`` waits for what
was handed over, for a measurement of the memory held (``engine.wait()``)."""

from __future__ import annotations

import functools
import queue
import threading


def release_in_background(arrays) -> None:
    """Drop ``arrays`` (any structure of JAX arrays; None: nothing) on the helper thread."""
    if arrays is not None:
        _release_queue().put(arrays)


def drain() -> None:
    """Return once everything handed to ``release_in_background`` so far is released."""
    done = threading.Event()
    _release_queue().put(done)
    done.wait()


@functools.lru_cache(maxsize=None)
def _release_queue() -> queue.SimpleQueue:
    """One daemon thread for the process (every engine), started at the first release."""
    releases: queue.SimpleQueue = queue.SimpleQueue()

    def release_forever():
        while True:
            arrays = releases.get()
            if isinstance(arrays, threading.Event):  # drain's marker: everything before it is released
                arrays.set()
            del arrays  # the last reference: the arrays are released here, not in the training loop

    threading.Thread(target=release_forever, name="spmdzero-release", daemon=True).start()
    return releases
