"""``.bos.idx`` sidecars: the token positions of the BOS tokens of a nanogpt shard.

Two layouts, told apart by their first four bytes and nothing else:

* **int32, headerless** (NeMo Automodel's layout): the file is ``int32[n]``, little-endian, the
  ascending token positions of the BOS tokens in ``<name>.bin`` (position 0 is the first token
  after the 1024-byte header). Its first int32, if any, is a position and therefore >= 0.
* **int64, with a header** (tokenmill, for shards whose positions pass 2**31 - 1): a 32-byte
  header, then ``int64[n]`` positions. The header starts with int32 -1 (``ff ff ff ff``), which no
  valid int32 file can start with, followed by the 8 bytes ``TMBOSIDX``, a uint32 version (1), the
  int64 count n and the int64 BOS token id (-1 when unknown).

So: a file starting with ``ff ff ff ff`` must carry the full int64 header (or it is an error); any
other file is the headerless int32 layout. No size or value heuristic is involved.

Checks on read (each failure raises :class:`~tokenmill.errors.DataFormatError` naming the file):
the size is a whole number of entries (and matches the header count), positions are strictly
ascending, >= 0 and below the shard's token count. :func:`check_bos_positions` additionally checks
that every listed position holds the BOS token: NeMo's ``nanogpt_data_processor.py`` writes
``file.tell() + index`` (a *byte* offset that includes the header, plus a token index), while its
dataset reads the values as token positions; such a file fails this check instead of silently
shifting every sample. ``tokenmill convert`` or :func:`write_bos_index` rebuild it.

Writers pick int32 whenever every position fits, so files stay readable by NeMo; the int64
variant is written only for larger shards (or on request). Both are written atomically.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.atomic import AtomicFile
from tokenmill.errors import DataFormatError

__all__ = [
    "BOS_INDEX_SUFFIX",
    "WIDE_HEADER",
    "WIDE_MAGIC",
    "BosIndex",
    "bos_index_path",
    "check_bos_positions",
    "read_bos_index",
    "write_bos_index",
]

BOS_INDEX_SUFFIX = ".bos.idx"
WIDE_MAGIC = b"TMBOSIDX"
WIDE_VERSION = 1
WIDE_HEADER = struct.Struct("<i8sIqq")
"""int32 -1, magic, uint32 version, int64 count, int64 BOS token id (-1: unknown): 32 bytes."""
_INT32_MAX = 2**31 - 1


def bos_index_path(bin_path: str | os.PathLike[str]) -> str:
    """The sidecar of a shard, NeMo's rule: the ``.bin`` suffix replaced by ``.bos.idx``."""
    return str(Path(os.fspath(bin_path)).with_suffix(BOS_INDEX_SUFFIX))


@dataclass(frozen=True)
class BosIndex:
    """A parsed ``.bos.idx``: ``positions`` is a read-only view (int32 or int64)."""

    path: str
    positions: npt.NDArray[np.integer[Any]]
    wide: bool
    bos_token: int | None

    def __len__(self) -> int:
        return int(self.positions.shape[0])


def read_bos_index(path: str | os.PathLike[str], token_count: int | None = None) -> BosIndex:
    """Read and check a ``.bos.idx``.

    Args:
        path: the sidecar.
        token_count: the shard's token count; positions must be below it (not checked if None).

    Returns:
        The positions, zero-copy over the file's bytes.

    Raises:
        FileNotFoundError: no such file.
        DataFormatError: a bad header or size, or positions unsorted, negative or out of range.
    """
    path = os.fspath(path)
    data = np.fromfile(path, dtype=np.uint8)
    bos_token: int | None = None
    if data.shape[0] >= 4 and data[:4].tobytes() == b"\xff\xff\xff\xff":
        if data.shape[0] < WIDE_HEADER.size:
            raise DataFormatError(
                f"{path}: starts like a tokenmill int64 BOS index (ff ff ff ff) but is only "
                f"{data.shape[0]} bytes, shorter than its {WIDE_HEADER.size}-byte header"
            )
        _, magic, version, count, token = WIDE_HEADER.unpack(data[: WIDE_HEADER.size].tobytes())
        if magic != WIDE_MAGIC:
            raise DataFormatError(
                f"{path}: first int32 is -1, which only a tokenmill int64 BOS index may start "
                f"with, but the magic is {magic!r}, expected {WIDE_MAGIC!r}"
            )
        if version != WIDE_VERSION:
            raise DataFormatError(f"{path}: int64 BOS index version {version}, expected 1")
        body = data.shape[0] - WIDE_HEADER.size
        if count < 0 or body != count * 8:
            raise DataFormatError(
                f"{path}: header says {count} int64 positions ({count * 8} bytes) but "
                f"{body} bytes follow the header"
            )
        positions: npt.NDArray[Any] = data[WIDE_HEADER.size :].view("<i8")
        wide = True
        bos_token = None if token < 0 else int(token)
    else:
        if data.shape[0] % 4:
            raise DataFormatError(
                f"{path}: {data.shape[0]} bytes is not a whole number of int32 positions"
            )
        positions = data.view("<i4")
        wide = False
    positions.flags.writeable = False
    _check_positions(path, positions, token_count)
    return BosIndex(path, positions, wide, bos_token)


def _check_positions(path: str, positions: npt.NDArray[Any], token_count: int | None) -> None:
    if positions.shape[0] == 0:
        return
    first = int(positions[0])
    if first < 0:
        raise DataFormatError(f"{path}: position[0] = {first} is negative")
    # compare neighbours instead of np.diff: a difference of two int32 (or int64) positions can
    # wrap around and make a descending pair look ascending (found by fuzzing)
    descending = positions[1:] <= positions[:-1]
    if descending.any():
        at = int(np.argmax(descending))
        raise DataFormatError(
            f"{path}: positions must be strictly ascending, but position[{at}] = "
            f"{int(positions[at])} and position[{at + 1}] = {int(positions[at + 1])}"
        )
    last = int(positions[-1])
    if token_count is not None and last >= token_count:
        at = int(np.searchsorted(positions, token_count))
        raise DataFormatError(
            f"{path}: position[{at}] = {int(positions[at])} is out of range for a shard of "
            f"{token_count} tokens"
        )


def check_bos_positions(
    path: str, tokens: npt.NDArray[Any], positions: npt.NDArray[Any], bos_token: int
) -> None:
    """Check that every listed position holds ``bos_token`` (one vectorised gather), that a
    shard starting with BOS is listed from 0, and that no BOS follows the last listed position
    (`tokenmill.formats.validate.check_bos_index_consistency`: a partial index is refused).

    Raises:
        DataFormatError: a position holds another token (the message names the first one), or
            the index is empty, shifted or truncated.
    """
    if positions.shape[0] == 0:
        from tokenmill.formats.validate import check_bos_index_consistency

        check_bos_index_consistency(path, tokens, positions, bos_token)
        return
    wrong = tokens[positions] != bos_token
    if wrong.any():
        at = int(np.argmax(wrong))
        position = int(positions[at])
        raise DataFormatError(
            f"{path}: position[{at}] = {position} holds token {int(tokens[position])}, not the "
            f"BOS token {bos_token} ({int(wrong.sum())} of {positions.shape[0]} positions are "
            "wrong). NeMo's nanogpt_data_processor.py stores byte offsets in .bos.idx; rebuild "
            "the index with tokenmill.formats.bos_index.write_bos_index or `tokenmill convert`"
        )
    from tokenmill.formats.validate import check_bos_index_consistency

    check_bos_index_consistency(path, tokens, positions, bos_token)


def write_bos_index(
    path: str | os.PathLike[str],
    positions: npt.ArrayLike,
    *,
    token_count: int | None = None,
    bos_token: int | None = None,
    wide: bool | None = None,
) -> None:
    """Write a ``.bos.idx`` atomically.

    Args:
        path: the sidecar path (see :func:`bos_index_path`).
        positions: ascending token positions.
        token_count: the shard's token count, to check the positions against.
        bos_token: stored in the int64 header (the int32 layout has nowhere to keep it).
        wide: force the int64 variant (True) or int32 (False); None picks int32 when every
            position fits.

    Raises:
        DataFormatError: the positions are not strictly ascending, negative or out of range.
        OverflowError: ``wide=False`` but a position exceeds 2**31 - 1.
    """
    path = os.fspath(path)
    array = np.asarray(positions)
    if array.ndim != 1 or (array.shape[0] and array.dtype.kind not in "iu"):
        raise TypeError(f"{path}: positions must be a 1-D integer array, got {array.dtype}")
    array = array.astype(np.int64)
    _check_positions(path, array, token_count)
    largest = int(array[-1]) if array.shape[0] else 0
    if wide is None:
        wide = largest > _INT32_MAX
    if not wide and largest > _INT32_MAX:
        raise OverflowError(f"{path}: position {largest} does not fit the int32 .bos.idx layout")
    target = AtomicFile(path)
    try:
        if wide:
            header = WIDE_HEADER.pack(
                -1, WIDE_MAGIC, WIDE_VERSION, array.shape[0], -1 if bos_token is None else bos_token
            )
            target.stream.write(header)
            target.stream.write(array.astype("<i8").tobytes())
        else:
            target.stream.write(array.astype("<i4").tobytes())
        target.commit()
    except BaseException:
        target.abort()
        raise
