"""megatron-core's dataset log lines, emitted by tokenmill's megatron-compatible classes.

tokenmill's GPTDataset, BlendedDataset, builder, config and ``.idx`` reader *are* megatron-core's
classes under `tokenmill.patch_megatron`; they log megatron's lines, at megatron's levels, under
megatron's logger names (``megatron.core.datasets.<module>``), on global rank 0 only (megatron's
``log_single_rank``), so filters and levels a Megatron-LM user sets on those loggers keep
applying. Timings are measured (`elapsed`), in megatron's ``\\t> time elapsed: %4f seconds``
format. tokenmill's own facts (cache verdicts, data checks) go to its ``tokenmill.*`` loggers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tokenmill.common.distributed import get_rank

__all__ = ["elapsed", "log", "megatron_logger"]

_PACKAGE = "megatron.core.datasets"


def megatron_logger(module: str) -> logging.Logger:
    """The logger megatron-core's ``megatron.core.datasets.<module>`` logs to."""
    return logging.getLogger(f"{_PACKAGE}.{module}")


def log(logger: logging.Logger, level: int, message: str) -> None:
    """`message` at `level` on global rank 0 only (every process without a process group), as
    megatron-core's ``log_single_rank``; formatted only when the level is enabled."""
    if logger.isEnabledFor(level) and get_rank() == 0:
        logger.log(level, message)


def log_elapsed(logger: logging.Logger, seconds: float) -> None:
    """megatron's DEBUG timing line."""
    log(logger, logging.DEBUG, f"\t> time elapsed: {seconds:4f} seconds")


@contextmanager
def elapsed(logger: logging.Logger) -> Iterator[None]:
    """Time the block and log megatron's DEBUG timing line after it."""
    started = time.time()
    yield
    log_elapsed(logger, time.time() - started)
