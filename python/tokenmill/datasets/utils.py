"""Split and blend helpers with megatron-core's names and exact arithmetic.

`parse_and_normalize_split("969,30,1")` gives `[0.969, 0.03, 0.001]`; the split matrix is the
cumulative book-ends `[(0, 0.969), (0.969, 0.999), (0.999, 1.0)]`, built with the same float
additions in the same order as megatron-core so that its JSON text (part of every cache key)
is identical. A low-level dataset of N sequences gives split i the ids
`[int(round(lo * N)), int(round(hi * N)))`.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from enum import Enum

import numpy as np

from tokenmill.errors import MegatronAssertionError

__all__ = [
    "Split",
    "convert_split_vector_to_split_matrix",
    "get_blend_from_list",
    "get_size_per_split_per_dataset",
    "normalize",
    "parse_and_normalize_split",
    "split_bounds",
    "split_document_ids",
]

Blend = tuple[list[str], list[float] | None]
SplitMatrix = list[tuple[float, float] | None]


class Split(Enum):
    """The three dataset splits, in megatron-core's order."""

    train = 0
    valid = 1
    test = 2


def normalize(weights: Sequence[float]) -> list[float]:
    """Divide by the sum in float64 (megatron-core's `normalize`).

    Raises:
        ValueError: if a weight is negative or not finite, or the sum is zero.
    """
    array = np.asarray(weights, dtype=np.float64)
    if array.size == 0:
        raise ValueError("weights must not be empty")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    with np.errstate(over="ignore"):
        total = np.sum(array)
    if not np.isfinite(total):
        # megatron-core divides by inf here and returns zeros, which blends nothing
        raise ValueError(
            f"weights sum to more than a float64 holds, got {list(weights)[:8]}; use relative "
            "weights of ordinary size"
        )
    if total <= 0:
        raise ValueError(f"weights must not sum to zero, got {list(weights)}")
    return [float(value) for value in (array / total)]


def get_blend_from_list(blend: Sequence[str] | None) -> Blend | None:
    """Parse a command-line blend list.

    An odd-length list holds prefixes only; an even-length one alternates weight and prefix
    ("30 path/a 70 path/b"). If any weight is not a number the whole list is taken as prefixes.

    Returns:
        (prefixes, weights or None), or None for None.
    """
    if blend is None:
        return None
    items = list(blend)
    weights: list[float] | None = None
    prefixes = items
    if len(items) % 2 == 0:
        parsed: list[float | None] = []
        for raw in items[0::2]:
            try:
                parsed.append(float(raw))
            except ValueError:
                parsed.append(None)
        first_missing = next((i for i, w in enumerate(parsed) if w is None), None)
        if first_missing is None:
            weights = [w for w in parsed if w is not None]
            prefixes = items[1::2]
        elif any(w is not None for w in parsed[first_missing:]):
            # megatron-core rejects a number after a non-number in the weight positions.
            raise MegatronAssertionError(f"blend mixes weights and prefixes ambiguously: {items}")
    return [prefix.strip() for prefix in prefixes], weights


def parse_and_normalize_split(split: str) -> list[float]:
    """Parse "969,30,1", "98/2/0", "0.9 0.1" or "1" into three normalised ratios.

    Raises:
        ValueError: if there are more than three numbers, none at all, or they sum to zero.
    """
    values = [float(token) for token in re.findall(r"[.0-9]+", split)]
    if len(values) > len(Split):
        raise MegatronAssertionError(f"split must have at most {len(Split)} parts, got {split!r}")
    values += [0.0] * (len(Split) - len(values))
    if sum(values) <= 0:
        raise ValueError(f"split must contain a positive number, got {split!r}")
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: Sequence[float], vector_b: Sequence[float] | None = None
) -> SplitMatrix:
    """Cumulative book-ends of each split, overlapped with an optional second vector.

    `[0.99, 0.01, 0.0]` gives `[(0, 0.99), (0.99, 1.0), None]`. The first bound is the integer
    0, as in megatron-core (it appears as `0` in cache descriptions).
    """
    if vector_b is None:
        vector_b = vector_a

    def expand(vector: Sequence[float]) -> list[float]:
        bounds: list[float] = [0]
        for value in vector:
            bounds.append(bounds[-1] + value)
        return bounds

    bounds_a, bounds_b = expand(vector_a), expand(vector_b)
    matrix: SplitMatrix = []
    for (a_lo, a_hi), (b_lo, b_hi) in zip(
        zip(bounds_a[:-1], bounds_a[1:]), zip(bounds_b[:-1], bounds_b[1:])
    ):
        lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
        matrix.append(None if hi <= lo else (lo, hi))
    return matrix


def split_bounds(bookends: tuple[float, float], num_elements: int) -> tuple[int, int]:
    """The [begin, end) ids a split covers in a low-level dataset of `num_elements`."""
    return int(round(bookends[0] * float(num_elements))), int(
        round(bookends[1] * float(num_elements))
    )


# The counting array every split's document ids view (split_document_ids), replaced by a longer
# one when a dataset needs more ids; read-only, so a view cannot change another dataset's ids.
_counting = np.arange(0, dtype=np.int32)
_counting.flags.writeable = False
_counting_lock = threading.Lock()


def split_document_ids(begin: int, end: int) -> np.ndarray:
    """``numpy.arange(begin, end, dtype=numpy.int32)``, the document ids of a split (megatron's
    ``indices``), as a read-only view of one shared counting array.

    Why not a fresh ``arange`` per dataset as megatron-core makes: a blend of 1,000 sources of
    10,000 documents allocates 40 MB of ids that way, and faulting in those fresh pages costs a
    warm open more than reading its 3,000 cached arrays; the ids are the same integers for every
    dataset, and nothing writes to them.
    """
    global _counting
    counting = _counting
    if end > len(counting):
        with _counting_lock:
            if end > len(_counting):
                # a quarter more than asked, so datasets of growing sizes do not each remake it
                grown = np.arange(max(end, min(len(_counting) * 5 // 4, 2**31)), dtype=np.int32)
                grown.flags.writeable = False
                _counting = grown
            counting = _counting
    return counting[begin:end]


def get_size_per_split_per_dataset(
    normalized_weights: Sequence[float],
    target_size_per_split: Sequence[int | None],
    surplus: float = 0.0,
) -> list[list[int]]:
    """Samples to request from each dataset for each split: ceil(ceil(size * w) * (1 + surplus)).

    Raises:
        ValueError: if the weights do not sum to 1 or a split size is None.
    """
    if not math.isclose(sum(normalized_weights), 1.0, rel_tol=1e-5, abs_tol=1e-8):
        raise MegatronAssertionError(f"weights must be normalised, got {list(normalized_weights)}")
    result: list[list[int]] = []
    for weight in normalized_weights:
        row: list[int] = []
        for target in target_size_per_split:
            if target is None:
                raise ValueError("weighted blends need a size for every split, got None")
            row.append(int(math.ceil(math.ceil(target * weight) * (1 + surplus))))
        result.append(row)
    return result
