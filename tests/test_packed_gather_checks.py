"""The packed-row gather (`_core.gather_packed_rows`) against corrupt packing plans.

A plan is read from a cache file and its documents from an .idx, so every value it uses can be
anything: each corrupt field must raise IndexError naming the field (never read out of bounds or
overflow; the sanitizer stage of .ci/run runs this file), misaligned plan arrays must work, and
whatever a mutated plan still lets through must be exactly what a slow reference computes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill import _core

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
ROW = 16  # row_length
PIECES = 4  # max_pieces_per_row
BOS, PAD, IGNORE = 1, 0, -100


def documents() -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.uint16]]:
    """(pointers in bytes, lengths, tokens) of five uint16 documents laid end to end."""
    lengths = np.array([5, 9, 3, 12, 7], np.int32)
    tokens = (np.arange(int(lengths.sum())) % 60 + 2).astype(np.uint16)
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * 2
    return pointers, lengths, tokens


def plan() -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """A valid plan: entries (document, offset, length, masked, flags) and row offsets."""
    entries = np.array(
        [
            [1, 0, 9, 0, 0],
            [0, 0, 5, 0, 0],
            [3, 0, 12, 0, 0],
            [4, 2, 3, 1, 1],  # the rest of a cropped document behind an inserted BOS
            [2, 0, 3, 0, 0],
        ],
        np.int64,
    )
    return entries, np.array([0, 2, 4, 5], np.int64)


def gather(
    entries: npt.NDArray[Any],
    row_offsets: npt.NDArray[Any],
    rows: npt.NDArray[np.int64],
    pointers: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int32],
    tokens: npt.NDArray[np.uint16],
) -> dict[str, npt.NDArray[Any]]:
    batch = len(rows)
    out: dict[str, npt.NDArray[Any]] = {
        "input_ids": np.full((batch, ROW), 7777, np.int64),
        "labels": np.full((batch, ROW), 7777, np.int64),
        "position_ids": np.full((batch, ROW), 7777, np.int64),
        "doc_ids": np.full((batch, ROW), 7777, np.int32),
        "cu_seqlens": np.full((batch, PIECES + 1), 7777, np.int32),
    }
    _core.gather_packed_rows(
        entries, row_offsets, rows, pointers, lengths, tokens, ROW, PIECES, BOS, PAD, IGNORE,
        True, **out,
    )  # fmt: skip
    return out


def reference(
    entries: npt.NDArray[Any],
    row_offsets: npt.NDArray[Any],
    rows: npt.NDArray[np.int64],
    pointers: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int32],
    tokens: npt.NDArray[np.uint16],
) -> dict[str, npt.NDArray[Any]]:
    """The packed rows, one token at a time (python/tokenmill/datasets/packed.py's meaning)."""
    batch = len(rows)
    out: dict[str, npt.NDArray[Any]] = {
        "input_ids": np.zeros((batch, ROW), np.int64),
        "labels": np.zeros((batch, ROW), np.int64),
        "position_ids": np.zeros((batch, ROW), np.int64),
        "doc_ids": np.zeros((batch, ROW), np.int32),
        "cu_seqlens": np.zeros((batch, PIECES + 1), np.int32),
    }
    for b, row in enumerate(rows):
        begin, end = int(row_offsets[row]), int(row_offsets[row + 1])
        position, last_start = 0, 0
        for number, e in enumerate(range(begin, end)):
            document, offset, size, masked, flags = (int(v) for v in entries[e])
            first = int(pointers[document]) // 2
            length = int(lengths[document])
            start = position
            out["cu_seqlens"][b, number] = start
            last_start = start
            if flags & 1:
                out["input_ids"][b, position] = BOS
                out["labels"][b, position] = IGNORE
                position += 1
            for j in range(size):
                out["input_ids"][b, position + j] = tokens[first + offset + j]
                ignored = j < masked or offset + j + 1 >= length
                out["labels"][b, position + j] = (
                    IGNORE if ignored else tokens[first + offset + j + 1]
                )
            position += size
            for p in range(start, position):
                out["doc_ids"][b, p] = number
                out["position_ids"][b, p] = p - start
        pieces = end - begin
        for p in range(position, ROW):
            out["input_ids"][b, p] = PAD
            out["labels"][b, p] = IGNORE
            out["doc_ids"][b, p] = max(pieces - 1, 0)
            out["position_ids"][b, p] = p - last_start if pieces > 0 else p
        out["cu_seqlens"][b, pieces:] = ROW
        out["cu_seqlens"][b, 0] = 0
    return out


def assert_same(got: dict[str, npt.NDArray[Any]], want: dict[str, npt.NDArray[Any]]) -> None:
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_a_valid_plan_gives_the_reference_rows() -> None:
    entries, offsets = plan()
    pointers, lengths, tokens = documents()
    rows = np.array([0, 1, 2, 1], np.int64)
    assert_same(
        gather(entries, offsets, rows, pointers, lengths, tokens),
        reference(entries, offsets, rows, pointers, lengths, tokens),
    )


def test_misaligned_plan_arrays_are_read_correctly() -> None:
    # A plan mapped from a file may sit at any byte offset (the gather reads it with memcpy).
    entries, offsets = plan()
    pointers, lengths, tokens = documents()

    def shifted(array: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        raw = np.zeros(array.nbytes + 1, np.uint8)
        raw[1:] = array.view(np.uint8).reshape(-1)
        view = np.frombuffer(raw.data, np.int64, offset=1).reshape(array.shape)
        assert not view.flags.aligned
        return view

    rows = np.arange(3, dtype=np.int64)
    assert_same(
        gather(shifted(entries), shifted(offsets), rows, pointers, lengths, tokens),
        reference(entries, offsets, rows, pointers, lengths, tokens),
    )
    # Caller-made arrays must be aligned: a misaligned view is an error, not undefined behaviour.
    with pytest.raises(ValueError, match="rows must be aligned"):
        gather(entries, offsets, shifted(rows), pointers, lengths, tokens)


# (what to corrupt, value, words the IndexError must contain)
CORRUPTIONS: list[tuple[str, int, str]] = [
    ("entries[0, 0]", -1, r"entries\[0, 0\] \(document\) = -1"),
    ("entries[0, 0]", 5, r"entries\[0, 0\] \(document\) = 5 is not a document id"),
    ("entries[0, 0]", INT64_MIN, r"entries\[0, 0\] \(document\)"),
    ("entries[0, 1]", -1, r"entries\[0, 1\] \(offset\) = -1"),
    ("entries[0, 1]", 10, r"points outside its document: entries\[0, 1\] \(offset\) = 10"),
    ("entries[0, 1]", INT64_MAX, r"entries\[0, 1\] \(offset\) = 9223372036854775807"),
    ("entries[0, 2]", -5, r"entries\[0, 2\] \(length\) = -5"),
    ("entries[0, 2]", 10, r"points outside its document.*entries\[0, 2\] \(length\) = 10"),
    ("entries[0, 2]", INT64_MAX, r"entries\[0, 2\] \(length\) = 9223372036854775807"),
    ("entries[1, 2]", 6, r"points outside its document"),
    ("entries[3, 2]", 4, r"entries\[3, 2\] \(length\) = 4 plus an inserted BOS"),
    ("row_offsets[0]", -1, r"row_offsets\[0:2\] = \[-1, 2\]"),
    ("row_offsets[1]", 9, r"row_offsets\[0:2\] = \[0, 9\] is not a range"),
    ("row_offsets[1]", INT64_MAX, r"row_offsets\[0:2\]"),
    ("row_offsets[0]", INT64_MIN, r"row_offsets\[0:2\]"),
    ("row_offsets[2]", 1, r"row_offsets\[1:3\] = \[2, 1\]"),
    ("sequence_pointers[1]", -2, r"sequence_pointers\[1\] = -2"),
    ("sequence_pointers[1]", 11, r"sequence_pointers\[1\] = 11 is negative or not a multiple"),
    ("sequence_pointers[1]", 2 * 36, r"document 1 .* lies outside the token buffer of 36"),
    ("sequence_pointers[1]", INT64_MAX - 1, r"document 1 .* lies outside the token buffer"),
    ("sequence_lengths[1]", -3, r"sequence_lengths\[1\] = -3 is negative"),
    ("sequence_lengths[1]", 2**31 - 1, r"document 1 .* lies outside the token buffer"),
]


@pytest.mark.parametrize(("target", "value", "message"), CORRUPTIONS)
def test_a_corrupt_field_raises_index_error_naming_it(
    target: str, value: int, message: str
) -> None:
    entries, offsets = plan()
    pointers, lengths, tokens = documents()
    arrays: dict[str, npt.NDArray[Any]] = {
        "entries": entries,
        "row_offsets": offsets,
        "sequence_pointers": pointers,
        "sequence_lengths": lengths,
    }
    name, index = target.rstrip("]").split("[")
    arrays[name][tuple(int(i) for i in index.split(", "))] = value
    with pytest.raises(IndexError, match=message) as raised:
        gather(entries, offsets, np.array([0, 1, 2], np.int64), pointers, lengths, tokens)
    assert "7777" not in str(raised.value)


def test_bad_rows_and_shapes() -> None:
    entries, offsets = plan()
    pointers, lengths, tokens = documents()
    with pytest.raises(IndexError, match="row 3 is out of range"):
        gather(entries, offsets, np.array([3], np.int64), pointers, lengths, tokens)
    with pytest.raises(IndexError, match="row -1 is out of range"):
        gather(entries, offsets, np.array([-1], np.int64), pointers, lengths, tokens)
    with pytest.raises(IndexError, match="holds 5 entries, more than max_pieces_per_row = 4"):
        gather(entries, np.array([0, 5], np.int64), np.array([0], np.int64), pointers, lengths,
               tokens)  # fmt: skip
    with pytest.raises(ValueError, match=r"entries must have shape \[E, 5\]"):
        gather(entries.reshape(-1), offsets, np.array([0], np.int64), pointers, lengths, tokens)
    with pytest.raises(ValueError, match="row_offsets must be 1-D"):
        gather(entries, offsets[:0], np.array([0], np.int64), pointers, lengths, tokens)
    with pytest.raises(ValueError, match="same length"):
        gather(entries, offsets, np.array([0], np.int64), pointers[:3], lengths, tokens)
    out = np.empty((1, ROW), np.int64)
    small = np.empty((1, ROW), np.int32)
    for row_length, pieces, match in [
        (0, PIECES, "row_length must be in"),
        (2**31, PIECES, "row_length must be in"),
        (ROW, 0, "max_pieces_per_row must be in"),
        (ROW, INT64_MAX, "max_pieces_per_row must be in"),
    ]:
        with pytest.raises(ValueError, match=match):
            _core.gather_packed_rows(
                entries, offsets, np.array([0], np.int64), pointers, lengths, tokens, row_length,
                pieces, BOS, PAD, IGNORE, True, out, out.copy(), out.copy(), small,
                np.empty((1, PIECES + 1), np.int32),
            )  # fmt: skip


EXTREMES = st.sampled_from([INT64_MIN, -(2**31), -2, -1, 0, 1, 2, 3, 9, 12, 2**31 - 1, INT64_MAX])


@settings(max_examples=300, deadline=None)
@given(
    mutations=st.lists(
        st.tuples(
            st.sampled_from(["entries", "row_offsets", "pointers", "lengths"]),
            st.integers(0, 24),
            st.one_of(EXTREMES, st.integers(-40, 40)),
        ),
        min_size=1,
        max_size=4,
    ),
    rows=st.lists(st.integers(0, 2), min_size=1, max_size=4),
)
def test_mutated_plans_raise_or_match_the_reference(
    mutations: list[tuple[str, int, int]], rows: list[int]
) -> None:
    entries, offsets = plan()
    pointers, lengths, tokens = documents()
    arrays: dict[str, npt.NDArray[Any]] = {
        "entries": entries.reshape(-1),
        "row_offsets": offsets,
        "pointers": pointers,
        "lengths": lengths,
    }
    for name, position, value in mutations:
        array = arrays[name]
        if array.dtype == np.int32:
            value = int(np.clip(value, -(2**31), 2**31 - 1))
        array[position % array.size] = value
    batch = np.array(rows, np.int64)
    try:
        got = gather(entries, offsets, batch, pointers, lengths, tokens)
    except IndexError:
        return
    assert_same(got, reference(entries, offsets, batch, pointers, lengths, tokens))
