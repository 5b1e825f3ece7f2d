"""Slow, obviously-correct pure-Python references for every C++ kernel.

Tests demand exact equality between a kernel and its reference on random inputs. Nothing here
is fast; nothing here is imported by the library.
"""

from __future__ import annotations

from collections.abc import Sequence


def blending_indices_reference(weights: Sequence[float], size: int) -> tuple[list[int], list[int]]:
    """megatron-core's greedy blending, one dataset at a time (O(size x datasets)).

    Python floats are IEEE doubles and CPython never fuses ``w * t - c``, so the errors are the
    same floating-point values as megatron's C++.
    """
    counts = [0] * len(weights)
    dataset_index: list[int] = []
    dataset_sample_index: list[int] = []
    for i in range(size):
        t = float(max(i, 1))
        best = 0
        best_error = weights[0] * t - float(counts[0])
        for d in range(1, len(weights)):
            error = weights[d] * t - float(counts[d])
            if error > best_error:  # strictly: the first maximum wins ties
                best, best_error = d, error
        dataset_index.append(best)
        dataset_sample_index.append(counts[best])
        counts[best] += 1
    return dataset_index, dataset_sample_index


def exhaustive_blending_indices_reference(sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """megatron-core's exhaustive blending: weights sizes[d] / total, spent datasets drop out."""
    total = sum(sizes)
    weights = [size / float(total) for size in sizes]
    counts = [0] * len(sizes)
    dataset_index: list[int] = []
    dataset_sample_index: list[int] = []
    for i in range(total):
        t = float(max(i, 1))
        best = -1
        best_error = 0.0
        for d, weight in enumerate(weights):
            if counts[d] == sizes[d]:
                continue
            error = weight * t - float(counts[d])
            if best < 0 or error > best_error:
                best, best_error = d, error
        dataset_index.append(best)
        dataset_sample_index.append(counts[best])
        counts[best] += 1
    return dataset_index, dataset_sample_index
