"""Value-range checks of cached index arrays, implied by the dataset that owns them.

A cache array with the right dtype and shape can still hold impossible values: a document id
outside the split, sample boundaries that go backwards or past their document, a shuffle that is
not a permutation of the samples. Such an entry used to pass ``build-cache --check`` and fail much
later with an error naming no file, or be served silently. The owner of an entry (GPTDataset,
BlendedDataset, PackedDataset) knows the bounds; it attaches a check to the entry's
:class:`~tokenmill.index.cache.ArraySpec` (``values=``), and `IndexCache` runs every check:

* **at build** (before the entry is written) and under ``build-cache`` / ``build-cache --check``
  (a `cache_session`): *full*, every value (the permutation test allocates one byte per sample);
* **on every other load**: *cheap*, the endpoints and a stride of at most 2^16 entries per array
  (about a millisecond whatever the size), so a systematically wrong file is caught without
  reading gigabytes on every rank; arrays of at most 2^16 entries get the full checks.

A problem is a string naming the field, the index and the value; `IndexCache` prefixes the file.
On the building rank a problem means a rebuild; elsewhere a ``CacheError`` naming the file.

Mixture states (`check_mixture_state`): the resume state of a mixture loader is a dict from a
checkpoint; every field is type-checked and bounded before it moves a position.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "ValuesCheck",
    "blended_checks",
    "check_mixture_state",
    "gpt_checks",
    "packing_checks",
    "value_problems",
]

ValuesCheck = Callable[[Mapping[str, npt.NDArray[Any]], bool], list[str]]
"""(all arrays of the entry, full) -> problems of one array ("field[i] = v ...")."""

_SAMPLE = 1 << 16
_CHUNK = 1 << 22
# the permutation test needs one byte per sample; above this it checks ranges only
_PERMUTATION_LIMIT = 1 << 33


def _positions(length: int, full: bool) -> npt.NDArray[np.int64] | None:
    """None for every position (full or small), else a stride plus the last position."""
    if full or length <= _SAMPLE:
        return None
    stride = -(-length // _SAMPLE)
    return np.unique(np.append(np.arange(0, length, stride, dtype=np.int64), length - 1))


def _range_problem(
    field: str, array: npt.NDArray[Any], low: int, high: int, full: bool
) -> str | None:
    """The first value outside [low, high] (all values when full, else a stride)."""
    flat = array.reshape(-1)
    positions = _positions(flat.shape[0], full)
    if positions is not None:
        values = np.asarray(flat[positions])
        bad = (values < low) | (values > high)
        if bad.any():
            at = int(positions[int(np.argmax(bad))])
            return f"{field}[{at}] = {int(flat[at])} is outside [{low}, {high}]"
        return None
    for start in range(0, flat.shape[0], _CHUNK):
        chunk = np.asarray(flat[start : start + _CHUNK])
        bad = (chunk < low) | (chunk > high)
        if bad.any():
            at = start + int(np.argmax(bad))
            return f"{field}[{at}] = {int(flat[at])} is outside [{low}, {high}]"
    return None


def _permutation_problem(field: str, array: npt.NDArray[Any], count: int) -> str | None:
    """The first repeated value of an array already known to hold values in [0, count)."""
    if count > _PERMUTATION_LIMIT or array.shape[0] != count:
        return None
    seen = np.zeros(count, dtype=np.bool_)
    for start in range(0, count, _CHUNK):
        chunk = np.asarray(array[start : start + _CHUNK], dtype=np.int64)
        # a repeat inside the chunk, or of a value seen in an earlier chunk
        order = np.sort(chunk)
        inside = order[1:] == order[:-1]
        repeated = seen[chunk]
        if inside.any() or repeated.any():
            value = int(order[int(np.argmax(inside))]) if inside.any() else None
            if value is None:
                value = int(chunk[int(np.argmax(repeated))])
            first = int(np.flatnonzero(np.asarray(array[: start + chunk.shape[0]]) == value)[1])
            return (
                f"{field}[{first}] = {value} repeats an earlier entry; the shuffle is not a "
                f"permutation of the {count} samples"
            )
        seen[chunk] = True
    return None


def _thorough(array: npt.NDArray[Any], full: bool) -> bool:
    """Whether the O(n log n) checks run: always at build/build-cache, on load for small arrays."""
    return full or array.shape[0] <= _SAMPLE


def gpt_checks(
    document_ids: npt.NDArray[Any],
    document_sizes: npt.NDArray[Any],
    num_samples: int | None,
    sequence_length: int | None = None,
) -> dict[str, ValuesCheck]:
    """The checks of a GPTDataset entry (document, sample and shuffle index).

    Thorough checks (every value; on load only for arrays of at most 2^16 entries): each epoch
    of the document index is a permutation of the split's documents; consecutive sample
    boundaries are exactly ``sequence_length`` tokens apart (the last sample at most that);
    the shuffle is a permutation of the samples.

    Args:
        document_ids: the split's document ids (``GPTDataset.indices``).
        document_sizes: the token count of every document of the low-level dataset.
        num_samples: the sample count the entry must hold, if known.
        sequence_length: the tokens between consecutive sample boundaries, if known.
    """
    ids = np.asarray(document_ids)

    def document(arrays: Mapping[str, npt.NDArray[Any]], full: bool) -> list[str]:
        if not ids.shape[0]:
            return []  # no split known (fast_cache_load): nothing to bound by
        # computed here, not above: a rank that trusts the builders never runs the checks
        low, high = int(ids.min()), int(ids.max())
        documents = arrays["document_index"]
        problem = _range_problem("document_index", documents, low, high, full)
        if (
            problem is None
            and _thorough(documents, full)
            and documents.shape[0] % ids.shape[0] == 0
        ):
            # every epoch holds each document once (megatron shuffles the epochs together)
            epochs = documents.shape[0] // ids.shape[0]
            found = np.sort(np.asarray(documents, dtype=np.int64))
            wrong = found != np.repeat(np.sort(ids.astype(np.int64)), epochs)
            if wrong.any():
                problem = (
                    f"document_index is not {epochs} epoch(s) of the split's {ids.shape[0]} "
                    f"documents: document {int(found[int(np.argmax(wrong))])} appears too "
                    "often, too rarely or is foreign"
                )
        return [problem] if problem else []

    def sample(arrays: Mapping[str, npt.NDArray[Any]], full: bool) -> list[str]:
        bounds, documents = arrays["sample_index"], arrays["document_index"]
        if bounds.ndim != 2 or bounds.shape[1] != 2 or bounds.shape[0] == 0:
            return []  # the shape check reports it
        rows = _positions(bounds.shape[0], full)
        picked = np.asarray(bounds if rows is None else bounds[rows], dtype=np.int64)
        where = np.arange(bounds.shape[0]) if rows is None else rows
        position, offset = picked[:, 0], picked[:, 1]
        bad = (position < 0) | (position >= max(documents.shape[0], 1)) | (offset < 0)
        if bad.any():
            at = int(where[int(np.argmax(bad))])
            return [
                f"sample_index[{at}] = {bounds[at].tolist()} points outside the "
                f"{documents.shape[0]}-entry document_index or has a negative offset"
            ]
        backwards = (position[1:] < position[:-1]) | (
            (position[1:] == position[:-1]) & (offset[1:] < offset[:-1])
        )
        if backwards.any():
            at = int(where[int(np.argmax(backwards)) + 1])
            return [
                f"sample_index[{at}] = {bounds[at].tolist()} goes back from the boundary before "
                "it; sample boundaries must be monotone"
            ]
        if documents.shape[0]:
            ids_at = np.asarray(documents[position], dtype=np.int64)
            valid = (ids_at >= 0) & (ids_at < document_sizes.shape[0])
            sizes = np.zeros_like(ids_at)
            sizes[valid] = np.asarray(document_sizes)[ids_at[valid]]
            past = valid & (offset > sizes)
            if past.any():
                at = int(where[int(np.argmax(past))])
                return [
                    f"sample_index[{at}] = {bounds[at].tolist()}: offset {int(bounds[at][1])} is "
                    f"past the end of document {int(ids_at[int(np.argmax(past))])} "
                    f"({int(sizes[int(np.argmax(past))])} tokens)"
                ]
            if sequence_length is not None and rows is None and bounds.shape[0] > 1:
                # token position of every boundary: tokens of the documents before it + offset
                ids_all = np.asarray(documents, dtype=np.int64)
                if ((ids_all < 0) | (ids_all >= document_sizes.shape[0])).any():
                    return []  # the document index check reports it
                before = np.zeros(ids_all.shape[0] + 1, dtype=np.int64)
                np.cumsum(np.asarray(document_sizes, dtype=np.int64)[ids_all], out=before[1:])
                positions = before[position] + offset
                gaps = np.diff(positions)
                wrong = gaps != sequence_length
                # a short last sample only where the epochs' tokens run out (drop_last False)
                last_ok = int(gaps[-1]) == sequence_length or (
                    0 <= int(gaps[-1]) < sequence_length
                    and int(positions[-1]) >= int(before[-1]) - 1
                )
                wrong[-1] = not last_ok
                if wrong.any():
                    at = int(np.argmax(wrong))
                    return [
                        f"sample_index[{at + 1}] = {bounds[at + 1].tolist()} is {int(gaps[at])} "
                        f"tokens after sample_index[{at}] = {bounds[at].tolist()}, expected "
                        f"{sequence_length}"
                    ]
        return []

    def shuffle(arrays: Mapping[str, npt.NDArray[Any]], full: bool) -> list[str]:
        order = arrays["shuffle_index"]
        count = num_samples if num_samples is not None else arrays["sample_index"].shape[0] - 1
        problem = _range_problem("shuffle_index", order, 0, count - 1, full)
        if problem is None and _thorough(order, full):
            problem = _permutation_problem("shuffle_index", order, count)
        return [problem] if problem else []

    return {"document_index": document, "sample_index": sample, "shuffle_index": shuffle}


def blended_checks(dataset_sizes: Sequence[int]) -> dict[str, ValuesCheck]:
    """The checks of a BlendedDataset entry: dataset ids in range, per-dataset sample ids below
    that dataset's length."""
    sizes = np.asarray([int(size) for size in dataset_sizes], dtype=np.int64)

    def dataset(arrays: Mapping[str, npt.NDArray[Any]], full: bool) -> list[str]:
        problem = _range_problem(
            "dataset_index", arrays["dataset_index"], 0, sizes.shape[0] - 1, full
        )
        return [problem] if problem else []

    def sample(arrays: Mapping[str, npt.NDArray[Any]], full: bool) -> list[str]:
        ids, samples = arrays["dataset_index"], arrays["dataset_sample_index"]
        if ids.shape != samples.shape:
            return []
        rows = _positions(ids.shape[0], full)
        where = np.arange(ids.shape[0]) if rows is None else rows
        picked_ids = np.asarray(ids if rows is None else ids[rows], dtype=np.int64)
        picked = np.asarray(samples if rows is None else samples[rows], dtype=np.int64)
        valid = (picked_ids >= 0) & (picked_ids < sizes.shape[0])
        limit = np.zeros_like(picked)
        limit[valid] = sizes[picked_ids[valid]]
        bad = valid & ((picked < 0) | (picked >= limit))
        if bad.any():
            at = int(np.argmax(bad))
            return [
                f"dataset_sample_index[{int(where[at])}] = {int(picked[at])} is outside dataset "
                f"{int(picked_ids[at])}'s {int(limit[at])} samples"
            ]
        return []

    return {"dataset_index": dataset, "dataset_sample_index": sample}


def packing_checks(num_rows: int | None = None) -> dict[str, ValuesCheck]:
    """The checks of a packing plan: row offsets monotone from 0 to the entry count, the row
    order a permutation of the rows."""

    def offsets(arrays: Mapping[str, npt.NDArray[Any]], full: bool) -> list[str]:
        row_offsets, entries = arrays["row_offsets"], arrays["entries"]
        if row_offsets.ndim != 1 or row_offsets.shape[0] == 0:
            return ["row_offsets is empty, expected at least [0]"] if row_offsets.ndim == 1 else []
        if int(row_offsets[0]) != 0 or int(row_offsets[-1]) != entries.shape[0]:
            return [
                f"row_offsets must run from 0 to the {entries.shape[0]} entries, got "
                f"row_offsets[0] = {int(row_offsets[0])}, row_offsets[-1] = {int(row_offsets[-1])}"
            ]
        values = np.asarray(row_offsets, dtype=np.int64)
        backwards = values[1:] <= values[:-1]  # a row holds at least one entry
        if backwards.any():
            at = int(np.argmax(backwards)) + 1
            return [
                f"row_offsets[{at}] = {int(values[at])} is not above row_offsets[{at - 1}] = "
                f"{int(values[at - 1])}; rows must be non-empty and in order"
            ]
        return []

    def order(arrays: Mapping[str, npt.NDArray[Any]], full: bool) -> list[str]:
        rows = arrays["row_offsets"].shape[0] - 1 if num_rows is None else num_rows
        if arrays["row_order"].shape[0] != rows:
            return [f"row_order has {arrays['row_order'].shape[0]} entries, expected {rows} rows"]
        problem = _range_problem("row_order", arrays["row_order"], 0, rows - 1, full)
        if problem is None and _thorough(arrays["row_order"], full):
            problem = _permutation_problem("row_order", arrays["row_order"], rows)
        return [problem] if problem else []

    return {"row_offsets": offsets, "row_order": order}


def value_problems(
    arrays: Mapping[str, npt.NDArray[Any]],
    checks: Mapping[str, ValuesCheck | None],
    full: bool,
    path_of: Callable[[str], object],
) -> list[str]:
    """Run every array's check; each problem is prefixed with the array's file.

    Args:
        arrays: the entry's arrays (each already of the right dtype and shape).
        checks: the check of each array name (None: none).
        full: every value (build, build-cache) or a stride (other loads).
        path_of: the file of an array name, for messages.
    """
    problems: list[str] = []
    for name, check in checks.items():
        if check is None or name not in arrays:
            continue
        try:
            found = check(arrays, full)
        except (IndexError, ValueError, OverflowError) as error:  # values no check foresaw
            found = [f"{name}: impossible values ({type(error).__name__}: {error})"]
        problems.extend(f"{path_of(name)}: {problem}" for problem in found)
    return problems


_STATE_INT_MAX = 1 << 62


def check_mixture_state(state: Mapping[str, Any], fields: Mapping[str, tuple[int, int]]) -> None:
    """Type- and range-check the integer fields of a resume state before they are used.

    Args:
        state: the state dict (from a checkpoint).
        fields: name -> (low, high) inclusive bounds of each required integer field.

    Raises:
        TypeError: the state is not a mapping, or a field is not an integer (bools refused).
        ValueError: a field is missing or outside its bounds.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"mixture state must be a dict, got {type(state).__name__}")
    for name, (low, high) in fields.items():
        if name not in state:
            raise ValueError(f"mixture state: missing or bad field: {name!r} is missing")
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            shown = repr(value)[:80]
            raise TypeError(
                f"mixture state: missing or bad field: {name!r} must be an integer, got "
                f"{type(value).__name__} {shown}"
            )
        if not low <= int(value) <= min(high, _STATE_INT_MAX):
            raise ValueError(
                f"mixture state: missing or bad field: {name!r} = {int(value)} is outside "
                f"[{low}, {high}]"
            )
