"""What a run prints on the console: the "spmdzero" logger and its handler, which writes to the
``sys.stderr`` of the moment and above a running tqdm progress bar, and the blocks said once per
process (``initialize``'s batch numbers).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("spmdzero")


class CurrentStreamHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` (or ``sys.stdout``) as it is when a line is written, not as it
    was when the handler was made: pytest and notebooks swap it, and a handler bound to a
    stream since closed prints "--- Logging error ---"."""

    def __init__(self, name: str = "stderr"):
        self._stream_name = name  # (logging.Handler has its own _name)
        super().__init__()

    @property
    def stream(self):
        return getattr(sys, self._stream_name)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it: the property decides
        pass


class ConsoleHandler(CurrentStreamHandler):
    """The "spmdzero" logger's console: the ``sys.stderr`` of the moment, and above a running
    tqdm progress bar (``tqdm.write``) so that a step line never breaks into the bar."""

    def __init__(self):
        super().__init__("stderr")
        self.setFormatter(logging.Formatter("[spmdzero] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        bars = _running_tqdm()
        if bars is None:
            return super().emit(record)
        try:
            bars.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _running_tqdm():
    """tqdm's class while one of its bars is open, else None. tqdm is not imported here: a
    bar can only run if the application imported it."""
    module = sys.modules.get("tqdm")
    bars = getattr(module, "tqdm", None)
    return bars if getattr(bars, "_instances", None) else None


def ensure_handler() -> None:
    """Like DeepSpeed, show INFO step logs on our own handler, unless the application
    configured the "spmdzero" logger itself."""
    if not logger.handlers and logger.level == logging.NOTSET:
        logger.addHandler(ConsoleHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False


def log_block(lines: list[str]) -> None:
    """A few INFO lines as one record."""
    ensure_handler()
    logger.info("\n  ".join(lines))


_SAID: set[tuple[str, ...]] = set()  # the blocks say_once has said in this process


def say_once(lines: list[str]) -> None:
    """``log_block``, once per process for the same lines (``initialize``'s resolved batch
    numbers: a script that builds several engines with one batch config hears them once; a
    changed batch config is news and is said)."""
    if tuple(lines) not in _SAID:
        _SAID.add(tuple(lines))
        log_block(lines)
