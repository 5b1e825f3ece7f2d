"""Packing plans: a thin typed wrapper over the C++ planner (see csrc/packing.hpp).

A plan is two arrays. `entries` [E, 5] int64 holds (document, token offset, length, masked
prefix, flags) for every piece placed, row after row; `row_offsets` [R + 1] int64 says which
entries form row r. Flags bit 0 marks a piece that starts behind a BOS token the planner
inserted (BOS-aligned mode, the remainder of a cropped document).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.core_call import core_call

__all__ = ["INSERTED_BOS", "PackingPlan", "plan_packing"]

INSERTED_BOS = 1
"""Flag of an entry that starts behind an inserted BOS token."""

_SEGMENT_DOCUMENTS = 1 << 20
"""Documents per independently planned segment: fixed, so plans never depend on threads."""


@dataclass(frozen=True)
class PackingPlan:
    """Which pieces of which documents fill each row."""

    entries: npt.NDArray[np.int64]
    row_offsets: npt.NDArray[np.int64]
    padding: int
    inserted_bos: int

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.shape[0]) - 1


def plan_packing(
    lengths: npt.ArrayLike,
    sequence_length: int,
    *,
    overlap: int = 0,
    max_documents_per_row: int = 64,
    bos_aligned: bool = False,
    window: int = 2048,
    num_threads: int = 1,
) -> PackingPlan:
    """Plan rows of `sequence_length` tokens for documents of `lengths`, taken in that order.

    Entry documents are positions in `lengths`. Raises ValueError for invalid options or
    negative lengths (naming the value).
    """
    lengths_array = np.ascontiguousarray(lengths, dtype=np.int32)
    entries, row_offsets, padding, inserted_bos = core_call(
        _core.plan_packing,
        lengths_array,
        sequence_length,
        overlap,
        max_documents_per_row,
        window,
        2 * window,
        _SEGMENT_DOCUMENTS,
        bos_aligned,
        num_threads,
    )
    return PackingPlan(entries, row_offsets, int(padding), int(inserted_bos))
