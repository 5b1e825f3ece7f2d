"""The code points new in Unicode 17.0, on which gigatoken and the reference tokenizers disagree.

gigatoken 0.10 classifies characters with Unicode 17.0 tables; tiktoken (the ``regex`` crate)
and HF ``tokenizers`` (Oniguruma) use older ones, where these 4,803 code points are unassigned.
A pre-tokenizer pattern such as GPT-2's (``\\p{L}+``, ``\\p{N}+``, ``[^\\s\\p{L}\\p{N}]+``) then
splits text around them differently, and the ids differ. Measured with gigatoken 0.10.0,
tiktoken 0.14.0 and tokenizers 0.23.3 on every code point (a probe vocabulary that merges a
letter, a digit or a symbol with each UTF-8 lead byte): they disagree on exactly 4,657 code
points, all in this table (the other 146 are marks and symbols that every version puts in the
same class). Nothing else differs.

The gigatoken backend scans every document for these code points (``_core.find_code_points``:
ASCII is skipped eight bytes at a time, about 6 GB/s) and encodes the documents that hold one
with the reference backend, so its ids equal the reference's everywhere; the pipeline counts
them (``unicode17_documents`` in the sidecar). Without the reference library installed they
keep gigatoken's ids, and the sidecar says so (``"unicode17": "gigatoken"``).

The table is the ``17.0`` lines of Unicode's ``DerivedAge.txt``, made by
``scripts/make_unicode17_table.py``.
"""

from __future__ import annotations

import re

import numpy
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.core_call import core_call

__all__ = ["UNICODE_17_RANGES", "documents_with_new_code_points", "texts_with_new_code_points"]

# 4,803 code points in 47 ranges (scripts/make_unicode17_table.py)
UNICODE_17_RANGES: tuple[tuple[int, int], ...] = (
    (0x088F, 0x088F),
    (0x0C5C, 0x0C5C),
    (0x0CDC, 0x0CDC),
    (0x1ACF, 0x1ADD),
    (0x1AE0, 0x1AEB),
    (0x20C1, 0x20C1),
    (0x2B96, 0x2B96),
    (0xA7CE, 0xA7CF),
    (0xA7D2, 0xA7D2),
    (0xA7D4, 0xA7D4),
    (0xA7F1, 0xA7F1),
    (0xFBC3, 0xFBD2),
    (0xFD90, 0xFD91),
    (0xFDC8, 0xFDCE),
    (0x10940, 0x10959),
    (0x10EC5, 0x10EC7),
    (0x10ED0, 0x10ED8),
    (0x10EFA, 0x10EFB),
    (0x11B60, 0x11B67),
    (0x11DB0, 0x11DDB),
    (0x11DE0, 0x11DE9),
    (0x16EA0, 0x16EB8),
    (0x16EBB, 0x16ED3),
    (0x16FF2, 0x16FF6),
    (0x187F8, 0x187FF),
    (0x18D09, 0x18D1E),
    (0x18D80, 0x18DF2),
    (0x1CCFA, 0x1CCFC),
    (0x1CEBA, 0x1CED0),
    (0x1CEE0, 0x1CEF0),
    (0x1E6C0, 0x1E6DE),
    (0x1E6E0, 0x1E6F5),
    (0x1E6FE, 0x1E6FF),
    (0x1F6D8, 0x1F6D8),
    (0x1F777, 0x1F77A),
    (0x1F8D0, 0x1F8D8),
    (0x1FA54, 0x1FA57),
    (0x1FA8A, 0x1FA8A),
    (0x1FA8E, 0x1FA8E),
    (0x1FAC8, 0x1FAC8),
    (0x1FACD, 0x1FACD),
    (0x1FAEA, 0x1FAEA),
    (0x1FAEF, 0x1FAEF),
    (0x1FBFA, 0x1FBFA),
    (0x2B73A, 0x2B73F),
    (0x2CEA2, 0x2CEAD),
    (0x323B0, 0x33479),
)

_RANGES = numpy.array(UNICODE_17_RANGES, dtype=numpy.uint32).reshape(-1)
_PATTERN = re.compile(
    "[" + "".join(f"\\U{first:08x}-\\U{last:08x}" for first, last in UNICODE_17_RANGES) + "]"
)


def documents_with_new_code_points(
    data: bytes, ends: npt.NDArray[numpy.int64]
) -> npt.NDArray[numpy.int64]:
    """Indices (ascending, unique) of the packed documents holding a Unicode 17.0 code point.

    Args:
        data: packed documents (``tokenmill.tokenize.packed_text.PackedText.data``).
        ends: each document's end in ``data`` (``PackedText.ends()``).
    """
    positions = core_call(_core.find_code_points, data, _RANGES)
    if positions.shape[0] == 0:
        return positions
    return numpy.unique(numpy.searchsorted(ends, positions, side="right"))


def texts_with_new_code_points(texts: list[str]) -> list[int]:
    """Indices of the strings holding a Unicode 17.0 code point (ASCII strings cost nothing)."""
    search = _PATTERN.search
    return [index for index, text in enumerate(texts) if not text.isascii() and search(text)]
