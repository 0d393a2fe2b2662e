"""Logging for ``vime train``: the stdlib ``logging`` module, rank 0 by default.

``--log-level info`` (the default) prints rank 0's messages; ``--log-level debug`` prints every
rank's, each line prefixed with its rank, so a multi-node run can be read rank by rank;
``warning`` prints only problems. Lines go to stderr as ``vime train: <message>`` (rank 0) or
``vime train [rank 3]: <message>``.

Example: ``configure_logging("debug", rank=1)`` then ``logging.getLogger("vime.train").debug(
"step 0")`` prints ``vime train [rank 1]: step 0``.
"""

import logging
import sys

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


class RankFilter(logging.Filter):
    """Passes records on rank 0, and on every rank at debug level; a record logged with
    ``extra={"any_rank": True}`` (what only this rank can see, e.g. a generate function it
    still waits for) on every rank."""

    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        return self.all_ranks or self.rank == 0 or getattr(record, "any_rank", False)


def configure_logging(level: str, rank: int) -> logging.Logger:
    """Set up the ``vime`` logger for this rank (idempotent: one handler, replaced)."""
    logger = logging.getLogger("vime")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    prefix = "vime train" if level != "debug" else f"vime train [rank {rank}]"
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
    handler.addFilter(RankFilter(rank, all_ranks=level == "debug"))
    logger.addHandler(handler)
    logger.setLevel(_LEVELS[level])
    logger.propagate = False
    return logger
