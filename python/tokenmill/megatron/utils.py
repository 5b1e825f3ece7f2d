"""``megatron.core.datasets.utils`` on tokenmill: `Split`, `normalize`, `get_blend_from_list`,
`compile_helpers` and `log_single_rank` (which megatron's module re-exports from
``megatron.core.utils`` and its config module imports from here).

`get_blend_from_list` is where Megatron-LM turns ``--data-path`` (and the per-split lists) into
a blend; tokenmill's marks each entry naming raw text (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``,
``.parquet``, a directory or a glob: `tokenmill.datasets.raw_text.is_raw_text`) as a
`RawTextEntry` carrying a default ``tokenmill.RawText()``, so the builder tokenizes it at build
time, by all ranks, into ``<path_to_cache>/raw_text`` (a config's own ``raw_text`` wins).
Prefixes come back unchanged, as megatron-core returns them.

`compile_helpers()` is a no-op: megatron-core builds its C++ helpers at run time with ``make``;
tokenmill's kernels are compiled when the package is installed, so there is nothing to build
(Megatron-LM's ``initialize_megatron`` and ``tools/prepare_cache.py`` call it at start-up).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenmill.common.distributed import get_rank
from tokenmill.datasets.raw_text import RawTextEntry, is_raw_text
from tokenmill.datasets.utils import Blend, Split, normalize
from tokenmill.datasets.utils import get_blend_from_list as _prefix_blend_from_list

__all__ = ["Split", "compile_helpers", "get_blend_from_list", "log_single_rank", "normalize"]

logger = logging.getLogger(__name__)


def get_blend_from_list(blend: Sequence[str] | None) -> Blend | None:
    """megatron-core's `get_blend_from_list`, with entries naming raw text marked for
    tokenization at build time (see the module docstring)."""
    parsed = _prefix_blend_from_list(blend)
    if parsed is None:
        return None
    prefixes, weights = parsed
    if not any(is_raw_text(prefix) for prefix in prefixes):
        return parsed
    from tokenmill.raw_text import RawText

    resolver = RawText()
    marked: list[str] = [
        RawTextEntry(prefix, resolver) if is_raw_text(prefix) else prefix for prefix in prefixes
    ]
    return marked, weights


def compile_helpers() -> None:
    """Nothing to compile: tokenmill's C++ kernels are built when it is installed (megatron-core
    runs ``make`` on its ``helpers.cpp`` here)."""


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """`logger.log(*args, **kwargs)` on global rank `rank` only (every process when
    torch.distributed is not initialised), as megatron-core's ``log_single_rank``."""
    if get_rank() == rank:
        logger.log(*args, **kwargs)
