"""Blending indices for a BlendedDataset, bit-identical to megatron-core 0.19.

A blend of n datasets is served through two arrays of the same length: ``dataset_index[i]`` says
which dataset sample i comes from and ``dataset_sample_index[i]`` which sample of that dataset.

Algorithm (megatron's rule, reproduced exactly). Greedy: for sample i let t = max(i, 1) as a
float64 and give every dataset d the error ``weights[d] * t - count[d]`` (the product rounded,
then the difference); the first dataset with the strictly largest error wins, its current count
is the sample's position inside it, and its count goes up by one. Exhaustive: the weights are
``sizes[d] / sum(sizes)`` and only datasets with samples left compete, until every dataset is
spent (the output length is ``sum(sizes)``).

Megatron evaluates every dataset at every sample: O(samples x datasets). The C++ kernel
(``csrc/blending.cpp``) keeps an *active set*: the datasets whose error may reach a threshold L
set just under the band where the winning errors lie. Only those are scanned (SIMD, AVX2 when the
CPU has it); a dataset whose error falls below L after a sample is booked on a calendar to come
back, conservatively early, when it can reach L again. If the best error in the set is below L,
nothing is proven and that sample takes a full scan, after which L is lowered. L follows the
winning errors window by window. Every decision is still taken by comparing the exact float64
errors, so rounding and ties come out as in megatron; L and the calendar only decide which
datasets are looked at. Below 48 datasets a branch-free scan is used; when the set stays large
(equal weights, whose winning band is wide) a kinetic tournament tree takes over. Measurements:
``benchmarks/BLENDING.md``.

The weights are used as given: megatron's BlendedDataset normalises them (``w / sum(w)`` in
float64) before calling its kernel, and so must a caller that wants the same samples.
"""

from __future__ import annotations

import operator
import os
import threading
from concurrent.futures import Future

import numpy as np
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.budget import check_allocation
from tokenmill.common.core_call import core_call
from tokenmill.index.cache_writes import current_context

__all__ = [
    "INT16_MAX_DATASETS",
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "compute_ahead",
    "dataset_index_dtype",
    "discard_ahead",
]

#: megatron-core's BlendedDataset asserts ``len(datasets) < 32767`` and stores dataset ids as
#: int16; tokenmill keeps int16 below that bound and switches to int32 at or above it.
INT16_MAX_DATASETS = 32767


def dataset_index_dtype(num_datasets: int) -> type[np.int16 | np.int32]:
    """The dtype of ``dataset_index`` for a blend of ``num_datasets`` datasets."""
    return np.int16 if num_datasets < INT16_MAX_DATASETS else np.int32


def _as_vector(values: npt.ArrayLike, name: str, kinds: str, dtype: type[np.generic]) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        msg = f"{name} must be 1-D, got shape {array.shape}"
        raise ValueError(msg)
    if array.size == 0:  # checked before the dtype: an empty list comes out as float64
        msg = f"{name} must not be empty"
        raise ValueError(msg)
    if array.dtype.kind not in kinds:
        kind = "real numbers" if "f" in kinds else "integers"
        msg = f"{name} must be {kind}, got dtype {array.dtype}"
        raise TypeError(msg)
    if array.dtype == np.uint64 and int(array.max()) > np.iinfo(np.int64).max:
        first = int(np.argmax(array > np.iinfo(np.int64).max))
        msg = f"{name}[{first}] = {int(array[first])} does not fit in int64"
        raise ValueError(msg)
    return np.ascontiguousarray(array, dtype=dtype)


def _outputs(num_datasets: int, size: int) -> tuple[np.ndarray, npt.NDArray[np.int64]]:
    if num_datasets > np.iinfo(np.int32).max:
        msg = f"at most {np.iinfo(np.int32).max} datasets can be blended, got {num_datasets}"
        raise ValueError(msg)
    check_allocation(
        size * (np.dtype(dataset_index_dtype(num_datasets)).itemsize + 8),
        f"the blending indices of {size:,} samples",
    )
    dataset_index = np.empty(size, dtype=dataset_index_dtype(num_datasets))
    dataset_sample_index = np.empty(size, dtype=np.int64)
    return dataset_index, dataset_sample_index


def _weights_and_size(weights: npt.ArrayLike, size: int) -> tuple[np.ndarray, int]:
    vector = _as_vector(weights, "weights", "iuf", np.float64)
    bad = np.flatnonzero(~(np.isfinite(vector) & (vector >= 0.0)))
    if bad.size:
        first = int(bad[0])
        msg = f"weights[{first}] must be finite and >= 0, got {float(vector[first])!r}"
        raise ValueError(msg)
    count = operator.index(size)
    if count < 0:
        msg = f"size must be >= 0, got {count}"
        raise ValueError(msg)
    return vector, count


def _greedy(
    vector: np.ndarray, count: int
) -> tuple[npt.NDArray[np.signedinteger], npt.NDArray[np.int64]]:
    dataset_index, dataset_sample_index = _outputs(vector.size, count)
    core_call(_core.build_blending_indices, vector, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def compute_ahead(weights: npt.ArrayLike, size: int) -> None:
    """Start computing ``build_blending_indices(weights, size)`` on a background thread; the
    next call with the same weights (bit for bit) and size in the same build (the enclosing
    `cache_writes.BuildContext`) returns that result. Outside a build, nothing is started.

    Why: a builder knows a blend's weights and size before it builds the blend's members, and
    on a cold cache the members take most of the build on one core while the kernel (which
    runs without the GIL) would wait for them: ~50 ms at 1,000 sources and 265,000 samples,
    paid after the members otherwise. Inputs the real call would refuse are ignored here (the
    real call raises). :func:`discard_ahead` drops results nobody took.
    """
    context = current_context()
    if context is None:
        return
    try:
        vector, count = _weights_and_size(weights, size)
    except (TypeError, ValueError):
        return
    key = (vector.tobytes(), count)
    future: Future[tuple[np.ndarray, npt.NDArray[np.int64]]] = Future()
    with context.lock:
        if key in context.ahead:
            return
        context.ahead[key] = (os.getpid(), future)

    def run() -> None:
        try:
            future.set_result(_greedy(vector, count))
        except BaseException as error:  # raised again by the call that takes it
            future.set_exception(error)

    try:
        threading.Thread(target=run, name="tokenmill-blending-ahead", daemon=True).start()
    except RuntimeError:  # no thread could start: the real call computes it
        with context.lock:
            context.ahead.pop(key, None)


def discard_ahead() -> None:
    """Forget every result of :func:`compute_ahead` in this build not taken yet (a computation
    still running finishes and is freed)."""
    context = current_context()
    if context is not None:
        with context.lock:
            context.ahead.clear()


def _taken_ahead(
    vector: np.ndarray, count: int
) -> tuple[npt.NDArray[np.signedinteger], npt.NDArray[np.int64]] | None:
    """The result :func:`compute_ahead` started for these inputs in this build, if any."""
    context = current_context()
    if context is None or not context.ahead:
        return None
    with context.lock:
        found = context.ahead.pop((vector.tobytes(), count), None)
    # a forked child has no thread computing its parent's futures: it computes its own
    if found is None or found[0] != os.getpid():
        return None
    result: tuple[npt.NDArray[np.signedinteger], npt.NDArray[np.int64]] = found[1].result()
    return result


def build_blending_indices(
    weights: npt.ArrayLike, size: int
) -> tuple[npt.NDArray[np.signedinteger], npt.NDArray[np.int64]]:
    """Greedy blending indices, as megatron-core's ``helpers.build_blending_indices``.

    Args:
        weights: one finite, non-negative weight per dataset (used as given, not normalised).
        size: the number of samples to draw.

    Returns:
        ``(dataset_index, dataset_sample_index)``: int16 dataset ids (int32 from 32767 datasets
        on) and int64 positions inside each dataset, both of length ``size``.

    Raises:
        TypeError: weights that are not real numbers, or a size that is not an integer.
        ValueError: an empty or multi-dimensional weights array, a negative, NaN or infinite
            weight (named with its index), or a negative size.
    """
    vector, count = _weights_and_size(weights, size)
    ahead = _taken_ahead(vector, count)
    return ahead if ahead is not None else _greedy(vector, count)


def build_exhaustive_blending_indices(
    sizes: npt.ArrayLike,
) -> tuple[npt.NDArray[np.signedinteger], npt.NDArray[np.int64]]:
    """Exhaustive blending indices, as megatron-core's ``build_exhaustive_blending_indices``.

    Every dataset d contributes exactly ``sizes[d]`` samples, interleaved by the greedy rule with
    weights ``sizes[d] / sum(sizes)``.

    Args:
        sizes: the number of samples of each dataset, all > 0.

    Returns:
        ``(dataset_index, dataset_sample_index)`` of length ``sum(sizes)``, dtypes as in
        :func:`build_blending_indices`.

    Raises:
        TypeError: sizes that are not integers.
        ValueError: an empty or multi-dimensional sizes array, a size <= 0 (named with its
            index), or a total that overflows int64.
    """
    vector = _as_vector(sizes, "sizes", "iu", np.int64)
    bad = np.flatnonzero(vector <= 0)
    if bad.size:
        first = int(bad[0])
        msg = f"sizes[{first}] must be > 0, got {int(vector[first])}"
        raise ValueError(msg)
    total = sum(int(value) for value in vector)
    if total > np.iinfo(np.int64).max:
        msg = f"sum(sizes) = {total} overflows int64"
        raise ValueError(msg)
    dataset_index, dataset_sample_index = _outputs(vector.size, total)
    core_call(_core.build_exhaustive_blending_indices, vector, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index
