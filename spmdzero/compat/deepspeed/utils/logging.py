"""``deepspeed.utils.logging``: a logger named "DeepSpeed" printing INFO to stdout, as DeepSpeed's."""

import logging

from spmdzero.observe.console import CurrentStreamHandler

logger = logging.getLogger("DeepSpeed")
if not logger.handlers:
    _handler = CurrentStreamHandler("stdout")  # the sys.stdout of the moment
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                            "%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_dist(message, ranks=None, level=logging.INFO) -> None:
    """Log on the listed ranks (processes) only; all of them when ``ranks`` is None or has -1."""
    from ..comm import get_rank

    rank = get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
