"""``megatron.core.datasets.utils`` on tokenmill: `Split`, `normalize`, `get_blend_from_list`,
`compile_helpers` and `log_single_rank` (which megatron's module re-exports from
``megatron.core.utils`` and its config module imports from here).

`compile_helpers()` is a no-op: megatron-core builds its C++ helpers at run time with ``make``;
tokenmill's kernels are compiled when the package is installed, so there is nothing to build
(Megatron-LM's ``initialize_megatron`` and ``tools/prepare_cache.py`` call it at start-up).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.common.distributed import get_rank
from tokenmill.datasets.utils import Split, get_blend_from_list, normalize

__all__ = ["Split", "compile_helpers", "get_blend_from_list", "log_single_rank", "normalize"]

logger = logging.getLogger(__name__)


def compile_helpers() -> None:
    """Nothing to compile: tokenmill's C++ kernels are built when it is installed (megatron-core
    runs ``make`` on its ``helpers.cpp`` here)."""


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """`logger.log(*args, **kwargs)` on global rank `rank` only (every process when
    torch.distributed is not initialised), as megatron-core's ``log_single_rank``."""
    if get_rank() == rank:
        logger.log(*args, **kwargs)
