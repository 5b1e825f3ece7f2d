"""Structural checks of the on-disk token formats, shared by every reader.

A header check alone lets through an ``.idx`` whose *arrays* are impossible: negative or huge
lengths, pointers that are negative, off the item grid, past the end of the ``.bin`` or
overlapping, boundaries that decrease. Such a file used to open, pass ``inspect`` and serve
wrong tokens from one reader while another rejected it. Every reader of a format therefore calls
the one function here on open (`IndexedDataset` and its megatron-module alias, the builder's
``add_index`` behind ``merge``, ``inspect``, ``convert``), so no reader serves what another
rejects.

Megatron ``.idx`` (:func:`check_megatron_index`), in one C++ pass over the index arrays (never
the tokens; ``csrc/index_check.cpp``, with ``tests/reference.py`` as its slow reference), which
allocates nothing:

* ``sequence_lengths[i] >= 0``;
* ``sequence_pointers[0] == 0`` and ``sequence_pointers[i + 1] == sequence_pointers[i] +
  sequence_lengths[i] * itemsize``: the sequences tile the ``.bin`` with no gap or overlap, which
  is what every megatron writer produces;
* the last sequence ends exactly at the ``.bin`` size (when it is known);
* ``document_indices`` starts at 0, ends at the sequence count, never decreases.

Cost: a sequential read of the three arrays (20 bytes per sequence), without the GIL.

``.bos.idx`` (:func:`check_bos_index_consistency`): beyond the sorted/in-range checks of its
reader, the cheap facts a shard can confirm: a non-empty shard that starts with BOS has a
non-empty index starting at 0, the listed positions hold BOS (one gather), and no BOS follows the
last listed one (a scan of the last document only: a truncated, "partial" index is caught).

``.npy`` (:func:`check_npy_extent`): numpy accepts a header whose length field was changed, and
a file longer than its shape needs, then serves the data from the wrong offset. The header must
end with the newline numpy always writes, and header plus data must end exactly at the file size.

Every error is a :class:`~tokenmill.errors.DataFormatError` naming the file, the field, the index
and the value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.core_call import core_call
from tokenmill.errors import DataFormatError

__all__ = ["check_bos_index_consistency", "check_megatron_index", "check_npy_extent"]


def _first(mask: npt.NDArray[np.bool_]) -> int:
    return int(np.argmax(mask))


def check_megatron_index(
    path: str,
    sequence_lengths: npt.NDArray[Any],
    sequence_pointers: npt.NDArray[Any],
    document_indices: npt.NDArray[Any],
    itemsize: int,
    bin_size: int | None = None,
    bin_path: str | None = None,
) -> None:
    """Check the arrays of a Megatron ``.idx`` (see the module docstring).

    Args:
        path: the ``.idx`` path, for messages.
        sequence_lengths: int32 lengths (tokens) of the sequences.
        sequence_pointers: int64 byte offsets of the sequences in the ``.bin``.
        document_indices: int64 document boundaries (indices into the sequences).
        itemsize: the token size in bytes.
        bin_size: the ``.bin`` size in bytes; not checked if None.
        bin_path: the ``.bin`` path, for messages.

    Raises:
        DataFormatError: the first violated invariant, naming field, index and value.
    """
    count = int(sequence_lengths.shape[0])
    code, index, expected, end = core_call(
        _core.check_megatron_index_arrays,
        _native(sequence_lengths, np.int32, path, "sequence_lengths"),
        _native(sequence_pointers, np.int64, path, "sequence_pointers"),
        _native(document_indices, np.int64, path, "document_indices"),
        itemsize,
    )
    if code == _POINTER_COUNT:
        raise DataFormatError(
            f"{path}: sequence_pointers has {sequence_pointers.shape[0]} entries but "
            f"sequence_lengths has {count}"
        )
    if code == _NEGATIVE_LENGTH:
        raise DataFormatError(
            f"{path}: sequence_lengths[{index}] = {int(sequence_lengths[index])} is negative"
        )
    if code == _POINTER_MISMATCH:
        raise DataFormatError(
            f"{path}: sequence_pointers[{index}] = {int(sequence_pointers[index])}, expected "
            f"{expected} (the previous pointer + length x {itemsize}); the sequences "
            "overlap, leave a gap or are misaligned, so the index is corrupt"
        )
    if code == _OFFSET_OVERFLOW:
        raise DataFormatError(
            f"{path}: sequence_lengths[{index}] = {int(sequence_lengths[index])} takes the "
            "sequences past 2^63 bytes; the lengths are corrupt"
        )
    if bin_size is not None and end != bin_size:
        raise DataFormatError(
            f"{bin_path or path}: data file is {bin_size} bytes but its index {path} ends at byte "
            f"{end} (last pointer + last length x {itemsize}); the files do not belong "
            "together or one is truncated"
        )
    total = int(document_indices.shape[0])
    if code == _NO_BOUNDARIES:
        raise DataFormatError(f"{path}: document_indices is empty, expected at least [0]")
    if code == _FIRST_BOUNDARY:
        raise DataFormatError(
            f"{path}: document_indices must start at 0, got {int(document_indices[0])} "
            "(document_indices[0])"
        )
    if code == _LAST_BOUNDARY:
        raise DataFormatError(
            f"{path}: document_indices must end at the sequence count {count}, got "
            f"{int(document_indices[-1])} (document_indices[{total - 1}])"
        )
    if code == _DECREASING_BOUNDARY:
        raise DataFormatError(
            f"{path}: document_indices must be non-decreasing, but document_indices[{index}] = "
            f"{int(document_indices[index])} > document_indices[{index + 1}] = "
            f"{int(document_indices[index + 1])}"
        )
    if code != 0:
        raise AssertionError(f"check_megatron_index_arrays returned unknown code {code}")


# Violation codes of _core.check_megatron_index_arrays (csrc/index_check.hpp)
(
    _POINTER_COUNT,
    _NEGATIVE_LENGTH,
    _POINTER_MISMATCH,
    _OFFSET_OVERFLOW,
    _NO_BOUNDARIES,
    _FIRST_BOUNDARY,
    _LAST_BOUNDARY,
    _DECREASING_BOUNDARY,
) = range(1, 9)


def _native(
    values: npt.NDArray[Any], dtype: type[np.integer[Any]], path: str, field: str
) -> npt.NDArray[Any]:
    """`values` as a C-contiguous array of `dtype` (a view when it already is one; a checked
    conversion otherwise, so a value that does not fit is an error, not a wrapped number)."""
    array = np.asarray(values)
    if array.dtype == np.dtype(dtype) and array.flags.c_contiguous:
        return array
    if array.size and array.dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            raise DataFormatError(
                f"{path}: {field} holds values {low}..{high}, outside {np.dtype(dtype).name}"
            )
    return np.ascontiguousarray(array, dtype=dtype)


def check_bos_index_consistency(
    path: str, tokens: npt.NDArray[Any], positions: npt.NDArray[Any], bos_token: int
) -> None:
    """Check a ``.bos.idx`` (already sorted and in range) against its shard, cheaply.

    Args:
        path: the ``.bos.idx`` path, for messages.
        tokens: the shard's tokens.
        positions: the index's positions (ascending, below ``len(tokens)``).
        bos_token: the BOS token id.

    Raises:
        DataFormatError: the index is empty or starts late although the shard starts with BOS, a
            position does not hold BOS, or a BOS follows the last listed position.
    """
    count = int(tokens.shape[0])
    if count == 0:
        return
    starts_with_bos = int(tokens[0]) == bos_token
    if positions.shape[0] == 0:
        if starts_with_bos:
            raise DataFormatError(
                f"{path}: positions is empty but the {count}-token shard starts with the BOS "
                f"token {bos_token}; the index is empty or truncated"
            )
        return
    wrong = tokens[positions] != bos_token
    if wrong.any():
        at = _first(wrong)
        position = int(positions[at])
        raise DataFormatError(
            f"{path}: position[{at}] = {position} holds token {int(tokens[position])}, not the "
            f"BOS token {bos_token} ({int(wrong.sum())} of {positions.shape[0]} positions are "
            "wrong); the index is shifted or belongs to another shard"
        )
    if starts_with_bos and int(positions[0]) != 0:
        raise DataFormatError(
            f"{path}: position[0] = {int(positions[0])} but the shard's first token (position 0) "
            f"is the BOS token {bos_token}; the index is shifted or misses entries"
        )
    last = int(positions[-1])
    tail = tokens[last + 1 :]
    later = np.flatnonzero(tail == bos_token)
    if later.shape[0]:
        raise DataFormatError(
            f"{path}: lists {positions.shape[0]} positions ending at {last}, but position "
            f"{last + 1 + int(later[0])} also holds the BOS token {bos_token} "
            f"({later.shape[0]} unlisted after the last entry); the index is truncated"
        )


def check_npy_extent(
    path: str,
    header_end: bytes,
    offset: int,
    nbytes: int,
    size: int,
    shape: tuple[int, ...],
    dtype: Any,
) -> None:
    """Check that a ``.npy`` file is exactly its header plus its data.

    Args:
        path: the file, for messages.
        header_end: the byte before `offset` (numpy ends every header with a newline).
        offset: where the data starts (the header's length field).
        nbytes: the data's size from the header's shape and dtype.
        size: the file's size (or, for a read file, what a read of `nbytes + 1` reached).
        shape, dtype: the header's, for messages.

    Raises:
        DataFormatError: the header does not end with a newline where its length field says,
            or the file is shorter or longer than header + data.
    """
    if header_end != b"\n":
        raise DataFormatError(
            f"{path}: the .npy header (length field) ends at byte {offset} without the newline "
            "numpy writes; the header length field is corrupt"
        )
    if offset + nbytes != size:
        raise DataFormatError(
            f"{path}: the .npy header says {nbytes} data bytes from byte {offset} (shape "
            f"{tuple(shape)}, dtype {dtype}) but the file is {size} bytes"
        )
