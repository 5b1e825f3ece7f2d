"""Blending indices (placeholder wrapper; replaced by the blending branch)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from tokenmill import _core

MAX_INT16_DATASETS = 32767


def _index_dtype(count: int) -> type[np.integer]:
    return np.int16 if count < MAX_INT16_DATASETS else np.int32


def build_blending_indices(
    weights: Sequence[float], size: int
) -> tuple[npt.NDArray[np.integer], npt.NDArray[np.int64]]:
    weights_array = np.ascontiguousarray(weights, dtype=np.float64)
    dataset_index = np.zeros(size, dtype=_index_dtype(len(weights_array)))
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    _core.build_blending_indices(weights_array, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(
    sizes: Sequence[int],
) -> tuple[npt.NDArray[np.integer], npt.NDArray[np.int64]]:
    sizes_array = np.ascontiguousarray(sizes, dtype=np.int64)
    total = int(sizes_array.sum())
    dataset_index = np.zeros(total, dtype=_index_dtype(len(sizes_array)))
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    _core.build_exhaustive_blending_indices(sizes_array, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index
