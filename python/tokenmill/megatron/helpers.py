"""``megatron.core.datasets.helpers`` on tokenmill: the index builders with megatron's signatures.

* `build_blending_indices` and `build_exhaustive_blending_indices` fill the caller's
  ``dataset_index`` / ``dataset_sample_index`` arrays in place, as megatron-core's do, with
  tokenmill's C++ blending kernels (`tokenmill.index.blending`: the same output, much faster on
  large blends).
* `build_sample_idx` (and its int32/int64 variants) returns the ``[n + 1, 2]`` sample index of a
  given document order. tokenmill's own GPTDataset builds its three arrays in one fused C++ call
  (`tokenmill.index.gpt_index`), which shuffles the document order itself; for an arbitrary
  order this module computes megatron's walk in closed form instead: sample k ends at token
  ``k * S`` of the concatenated documents, so its row is the first document whose cumulative end
  reaches ``k * S + extra`` (one ``numpy.searchsorted`` over the cumulative lengths), and a
  sample past the end of the data takes megatron's end-of-data row (last document, its length
  minus the extra token). O(n log d) for n samples and d documents, 16 bytes per document and
  per sample of temporaries; equal to megatron-core's kernel on every input (tested against it).
* `build_mapping` and `build_blocks_mapping` (BERT/ICT sample mappings, used by megatron's own
  BERT/T5 datasets, which stay megatron's under `patch_megatron`) are megatron-core's compiled
  helpers, called through when megatron-core is installed; tokenmill does not implement them.

The count of samples follows megatron: ``(E * T - extra) // S`` when the last partial sample is
dropped, else the single-precision ceil of ``(E * T - extra) / S`` (which can count one sample
too many above 2^24 tokens; that sample is the end-of-data row again).
"""

from __future__ import annotations

import importlib
import operator
from typing import Any

import numpy
import numpy.typing as npt

from tokenmill.index import blending
from tokenmill.index.gpt_index import megatron_sample_count

__all__ = [
    "build_blending_indices",
    "build_blocks_mapping",
    "build_exhaustive_blending_indices",
    "build_mapping",
    "build_sample_idx",
    "build_sample_idx_int32",
    "build_sample_idx_int64",
]

_INT32_MAX = numpy.iinfo(numpy.int32).max


def build_sample_idx(
    sizes: npt.NDArray[Any],
    document_indices: npt.NDArray[Any],
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> npt.NDArray[Any]:
    """The ``[n + 1, 2]`` sample index of `document_indices` (an order of document ids into
    `sizes`): int32 when the document order and every size fit int32, else int64 (megatron's
    rule). Row k is (position in `document_indices`, token offset) where sample k starts.

    Raises:
        ValueError: see `build_sample_idx_int32`.
    """
    sizes = numpy.asarray(sizes)
    document_indices = numpy.asarray(document_indices)
    largest = max(document_indices.shape[0], int(sizes.max()) if sizes.size else 0)
    build = build_sample_idx_int32 if largest <= _INT32_MAX else build_sample_idx_int64
    return build(
        sizes,
        document_indices,
        sequence_length,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        1 if add_extra_token_to_sequence else 0,
    )


def build_sample_idx_int32(
    sizes: npt.NDArray[Any],
    document_idx: npt.NDArray[Any],
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> npt.NDArray[numpy.int32]:
    """`build_sample_idx` with an int32 result (megatron's ``build_sample_idx_int32``).

    Raises:
        ValueError: `seq_length` < 1, samples are asked of an empty document order, or a
            document id is outside `sizes`.
    """
    result: npt.NDArray[numpy.int32] = _sample_index(
        sizes,
        document_idx,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        add_extra_token_to_sequence,
        numpy.int32,
    )
    return result


def build_sample_idx_int64(
    sizes: npt.NDArray[Any],
    document_idx: npt.NDArray[Any],
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> npt.NDArray[numpy.int64]:
    """`build_sample_idx` with an int64 result (megatron's ``build_sample_idx_int64``).

    Raises:
        ValueError: see `build_sample_idx_int32`.
    """
    result: npt.NDArray[numpy.int64] = _sample_index(
        sizes,
        document_idx,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        add_extra_token_to_sequence,
        numpy.int64,
    )
    return result


def _sample_index(
    sizes: npt.NDArray[Any],
    document_idx: npt.NDArray[Any],
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool,
    extra: int,
    dtype: type[numpy.integer[Any]],
) -> Any:
    sequence_length = operator.index(seq_length)
    if sequence_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {sequence_length}")
    extra = int(extra)
    documents = numpy.asarray(document_idx).astype(numpy.int64, copy=False).reshape(-1)
    lengths_of = numpy.asarray(sizes).astype(numpy.int64, copy=False).reshape(-1)
    count = megatron_sample_count(
        int(num_epochs) * int(tokens_per_epoch),
        sequence_length,
        extra,
        bool(drop_last_partial_sequence),
    )
    sample_index = numpy.zeros((max(count + 1, 0), 2), dtype=dtype)
    if count <= 0:  # -1: no rows at all, as megatron's kernel returns
        return sample_index
    if documents.shape[0] == 0:
        raise ValueError(f"cannot place {count} samples in an empty document order")
    if documents.min() < 0 or documents.max() >= lengths_of.shape[0]:
        raise ValueError(
            f"document ids must be in [0, {lengths_of.shape[0]}), got range "
            f"[{int(documents.min())}, {int(documents.max())}]"
        )
    lengths = lengths_of[documents]
    ends = numpy.cumsum(lengths)
    starts = ends - lengths
    boundaries = numpy.arange(1, count + 1, dtype=numpy.int64) * sequence_length
    rows = numpy.searchsorted(ends, boundaries + extra, side="left")
    past_end = rows >= documents.shape[0]
    offsets = boundaries - starts[numpy.minimum(rows, documents.shape[0] - 1)]
    rows[past_end] = documents.shape[0] - 1
    offsets[past_end] = lengths[-1] - extra
    sample_index[1:, 0] = rows
    sample_index[1:, 1] = offsets
    return sample_index


def build_blending_indices(
    dataset_index: npt.NDArray[Any],
    dataset_sample_index: npt.NDArray[Any],
    weights: npt.ArrayLike,
    num_datasets: int,
    size: int,
    verbose: bool,
) -> None:
    """Fill ``dataset_index[:size]`` and ``dataset_sample_index[:size]`` with megatron's greedy
    blend of `weights` (used as given: megatron's BlendedDataset normalises them first).

    Raises:
        ValueError: `num_datasets` differs from the number of weights, an array is shorter than
            `size`, or a weight is negative or not finite.
    """
    vector = numpy.asarray(weights, dtype=numpy.float64).reshape(-1)
    _check_outputs(dataset_index, dataset_sample_index, vector.shape[0], num_datasets, size)
    chosen, positions = blending.build_blending_indices(vector, size)
    dataset_index[:size] = chosen
    dataset_sample_index[:size] = positions
    if verbose:
        _report(chosen, vector / vector.sum() if vector.sum() > 0 else vector)


def build_exhaustive_blending_indices(
    dataset_index: npt.NDArray[Any],
    dataset_sample_index: npt.NDArray[Any],
    sizes: npt.ArrayLike,
    num_datasets: int,
) -> None:
    """Fill ``dataset_index`` and ``dataset_sample_index`` (``sum(sizes)`` entries each) with
    megatron's exhaustive blend: every dataset contributes exactly ``sizes[d]`` samples.

    Raises:
        ValueError: `num_datasets` differs from the number of sizes, an array is shorter than
            ``sum(sizes)``, or a size is not positive.
    """
    vector = numpy.asarray(sizes).reshape(-1)
    total = int(vector.sum()) if vector.size else 0
    _check_outputs(dataset_index, dataset_sample_index, vector.shape[0], num_datasets, total)
    chosen, positions = blending.build_exhaustive_blending_indices(vector)
    dataset_index[:total] = chosen
    dataset_sample_index[:total] = positions


def _check_outputs(
    dataset_index: npt.NDArray[Any],
    dataset_sample_index: npt.NDArray[Any],
    found: int,
    num_datasets: int,
    size: int,
) -> None:
    if int(num_datasets) != found:
        raise ValueError(f"num_datasets is {num_datasets} but {found} weights/sizes were given")
    for name, array in (
        ("dataset_index", dataset_index),
        ("dataset_sample_index", dataset_sample_index),
    ):
        if numpy.asarray(array).shape[0] < size:
            raise ValueError(
                f"{name} has {numpy.asarray(array).shape[0]} entries, fewer than {size}"
            )


def _report(dataset_index: npt.NDArray[Any], weights: npt.NDArray[numpy.float64]) -> None:
    """megatron's verbose printout: each dataset's target weight and achieved share."""
    counts = numpy.bincount(dataset_index, minlength=weights.shape[0])
    total = max(int(counts.sum()), 1)
    print(f"> blended {total} samples from {weights.shape[0]} datasets:")
    for number, (weight, count) in enumerate(zip(weights.tolist(), counts.tolist())):
        print(f"   dataset {number}: weight {weight:.6f}, achieved {count / total:.6f}")


def _megatron_helper(name: str) -> Any:
    try:
        helpers_cpp = importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError as error:
        raise NotImplementedError(
            f"{name} (the BERT/ICT sample mapping of megatron's BERT and T5 datasets) is "
            "megatron-core's compiled helper, which tokenmill does not implement: install "
            "megatron-core to use those datasets"
        ) from error
    return getattr(helpers_cpp, name)


def build_mapping(*args: Any, **kwargs: Any) -> Any:
    """megatron-core's ``helpers_cpp.build_mapping`` (BERT sample mapping), called through.

    Raises:
        NotImplementedError: megatron-core is not installed.
    """
    return _megatron_helper("build_mapping")(*args, **kwargs)


def build_blocks_mapping(*args: Any, **kwargs: Any) -> Any:
    """megatron-core's ``helpers_cpp.build_blocks_mapping`` (ICT block mapping), called through.

    Raises:
        NotImplementedError: megatron-core is not installed.
    """
    return _megatron_helper("build_blocks_mapping")(*args, **kwargs)
