"""Typed wrappers over the C++ GPTDataset index kernels, with megatron-core's arithmetic.

`plan_gpt_indices` computes everything that is cheap and scalar (epochs, whether the final
epoch is shuffled separately, the sample count, the output dtypes) exactly as megatron-core
0.19 does; `build_gpt_indices` then fills the three arrays in one C++ call with the GIL
released. Outputs are allocated once, at their final dtype: peak memory is the size of the
three arrays (megatron-core builds int64 temporaries, about 2.3x).

Megatron facts reproduced here:

* epochs: the smallest e >= 1 with e * tokens_per_epoch >= num_samples * S + extra;
* separate final epoch: when the samples needed from the last epoch are fewer than
  int(0.80 * samples_per_epoch);
* sample count: (E*T - extra) // S, or, when the partial last sample is kept, ceil computed in
  single precision (float32(E*T - extra) / float32(S)), which can overcount by one above 2^24
  tokens; `exact_sample_count=True` uses the exact integer ceil instead;
* dtypes: sample_index int32 unless len(document_index) exceeds 2^31 - 1 (then int64;
  megatron-core also checks the longest document, which cannot exceed it: document lengths are
  int32 in both libraries); shuffle_index uint32 unless num_samples >= 2^32 - 2 (then int64);
  document_index always int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.budget import check_allocation
from tokenmill.common.core_call import core_call
from tokenmill.common.threads import default_build_threads

__all__ = [
    "GptIndexPlan",
    "build_gpt_indices",
    "megatron_sample_count",
    "num_tokens_per_epoch",
    "plan_gpt_indices",
]

_INT32_MAX = np.iinfo(np.int32).max
_UINT32_MAX = np.iinfo(np.uint32).max
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def as_document_ids(indices: npt.ArrayLike, name: str = "indexed_indices") -> npt.NDArray[np.int32]:
    """The split's document ids as a C-contiguous int32 array (range-checked)."""
    if (
        type(indices) is np.ndarray
        and indices.dtype == np.int32
        and indices.ndim == 1
        and indices.flags.c_contiguous
    ):
        return indices  # megatron's split ranges: called several times per dataset at build
    array = np.asarray(indices)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.dtype != np.int32:
        if array.size and (array.min() < 0 or array.max() > _INT32_MAX):
            raise OverflowError(f"{name} must fit int32, got range [{array.min()}, {array.max()}]")
        array = array.astype(np.int32)
    return np.ascontiguousarray(array)


def as_sizes(sizes: npt.ArrayLike) -> npt.NDArray[np.int32]:
    """Document lengths as a C-contiguous int32 array (range-checked)."""
    array = np.asarray(sizes)
    if array.dtype != np.int32:
        if array.size and (array.min() < 0 or array.max() > _INT32_MAX):
            raise OverflowError("sequence lengths must fit int32")
        array = array.astype(np.int32)
    return np.ascontiguousarray(array)


def num_tokens_per_epoch(sizes: npt.ArrayLike, indices: npt.ArrayLike) -> int:
    """sum(sizes[indices]) without materialising sizes[indices]."""
    return core_call(_core.sum_selected_lengths, as_sizes(sizes), as_document_ids(indices))


@dataclass(frozen=True)
class GptIndexPlan:
    """The scalar facts of one GPTDataset index build."""

    num_documents: int
    tokens_per_epoch: int
    num_epochs: int
    separate_final_epoch: bool
    num_samples: int
    shuffle_split: int
    sample_dtype: type[np.integer]
    shuffle_dtype: type[np.integer]

    @property
    def document_index_shape(self) -> tuple[int]:
        return (self.num_documents * self.num_epochs,)

    @property
    def sample_index_shape(self) -> tuple[int, int]:
        return (self.num_samples + 1, 2)

    @property
    def shuffle_index_shape(self) -> tuple[int]:
        return (self.num_samples,)


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, requested_tokens: int) -> int:
    """Epochs megatron-core builds: 1 for None, else the smallest e >= 1 covering the request."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError(
            f"cannot draw {num_samples} samples from a split with {tokens_per_epoch} tokens"
        )
    return max(1, -(-requested_tokens // tokens_per_epoch))


def count_samples(
    total_tokens: int, sequence_length: int, extra_token: int, drop_last: bool, exact: bool
) -> int:
    """Number of samples in `total_tokens` tokens (megatron's float32 ceil unless `exact`)."""
    available = total_tokens - extra_token
    if drop_last:
        return max(available, 0) // sequence_length
    if exact:
        return max(-(-available // sequence_length), 0)
    ratio = np.float32(available) / np.float32(sequence_length)
    return max(int(np.ceil(ratio)), 0)


def megatron_sample_count(
    total_tokens: int, sequence_length: int, extra_token: int, drop_last: bool
) -> int:
    """The sample count exactly as megatron-core's C++ computes it, truncating toward zero:
    `count_samples`, except that a split without tokens at sequence length 1 with the extra
    token counts -1 (megatron-core then fails)."""
    available = total_tokens - extra_token
    if drop_last:
        quotient = abs(available) // sequence_length
        return quotient if available >= 0 else -quotient
    return int(np.ceil(np.float32(available) / np.float32(sequence_length)))


def plan_gpt_indices(
    sizes: npt.NDArray[np.int32],
    indices: npt.NDArray[np.int32],
    num_samples: int | None,
    sequence_length: int,
    add_extra_token: bool,
    drop_last_partial_sequence: bool,
    exact_sample_count: bool = False,
    tokens_per_epoch: int | None = None,
    num_epochs: int | None = None,
) -> GptIndexPlan:
    """Compute epochs, the final-epoch rule, the sample count and the output dtypes.

    `tokens_per_epoch` and `num_epochs` override the computed values (what a GPTDataset subclass
    returns from megatron's `_get_num_tokens_per_epoch` / `_get_num_epochs` hooks).
    """
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be >= 1, got {sequence_length}")
    if num_samples is not None and num_samples < 0:
        raise ValueError(f"num_samples must be >= 0 or None, got {num_samples}")
    extra = 1 if add_extra_token else 0
    sizes = as_sizes(sizes)  # OverflowError for a document longer than 2^31 - 1
    if tokens_per_epoch is None:
        tokens_per_epoch = num_tokens_per_epoch(sizes, indices)
    requested = 0 if num_samples is None else num_samples * sequence_length + extra
    if num_epochs is None:
        num_epochs = num_epochs_for(tokens_per_epoch, num_samples, requested)
    elif num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")

    separate_final_epoch = False
    samples_before_final_epoch = 0
    if num_epochs > 1:
        if num_samples is None:  # only a subclass's _get_num_epochs can get here
            raise TypeError(f"{num_epochs} epochs need a sample count, got num_samples=None")
        samples_before_final_epoch = (
            (num_epochs - 1) * tokens_per_epoch - extra
        ) // sequence_length
        from_final_epoch = num_samples - samples_before_final_epoch
        per_epoch = (tokens_per_epoch - extra) // sequence_length
        if not 0 <= from_final_epoch <= per_epoch + 1:
            raise ValueError(
                f"inconsistent epoch arithmetic: {from_final_epoch} samples from the final epoch "
                f"with {per_epoch} per epoch"
            )
        separate_final_epoch = from_final_epoch < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)

    total_samples = count_samples(
        num_epochs * tokens_per_epoch,
        sequence_length,
        extra,
        drop_last_partial_sequence,
        exact_sample_count,
    )
    num_documents = int(indices.shape[0])
    # megatron-core also switches when the longest document exceeds 2^31 - 1; document lengths
    # are int32 here (checked above), so only the document-index length can.
    sample_dtype: type[np.integer] = (
        np.int32 if num_documents * num_epochs <= _INT32_MAX else np.int64
    )
    shuffle_dtype: type[np.integer] = np.uint32 if total_samples < _UINT32_MAX - 1 else np.int64
    return GptIndexPlan(
        num_documents=num_documents,
        tokens_per_epoch=tokens_per_epoch,
        num_epochs=num_epochs,
        separate_final_epoch=separate_final_epoch,
        num_samples=total_samples,
        shuffle_split=samples_before_final_epoch if separate_final_epoch else total_samples,
        sample_dtype=sample_dtype,
        shuffle_dtype=shuffle_dtype,
    )


def build_gpt_indices(
    sizes: npt.NDArray[np.int32],
    indices: npt.NDArray[np.int32],
    plan: GptIndexPlan,
    seed: int,
    sequence_length: int,
    add_extra_token: bool,
    num_threads: int | None = None,
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.integer], npt.NDArray[np.integer]]:
    """Build (document_index, sample_index, shuffle_index) for `plan` in one C++ call.

    A split with no documents (one epoch, no samples requested) gives megatron-core's arrays of
    an empty split: no documents, the single sample-index row (0, 0) and no samples.
    """
    if plan.num_documents == 0:
        if plan.num_samples != 0:
            raise ValueError(
                f"cannot build {plan.num_samples} samples from a split with no documents"
            )
        return (
            np.empty(0, dtype=np.int32),
            np.zeros((1, 2), dtype=plan.sample_dtype),
            np.empty(0, dtype=plan.shuffle_dtype),
        )
    sample_bytes = np.dtype(plan.sample_dtype).itemsize * 2 * (plan.num_samples + 1)
    check_allocation(
        4 * plan.num_documents * plan.num_epochs
        + sample_bytes
        + np.dtype(plan.shuffle_dtype).itemsize * plan.num_samples,
        f"the GPT index arrays ({plan.num_samples:,} samples, {plan.num_epochs:,} epochs of "
        f"{plan.num_documents:,} documents)",
    )
    document_index = np.empty(plan.document_index_shape, dtype=np.int32)
    sample_index = np.empty(plan.sample_index_shape, dtype=plan.sample_dtype)
    shuffle_index = np.empty(plan.shuffle_index_shape, dtype=plan.shuffle_dtype)
    core_call(
        _core.build_gpt_indices,
        as_sizes(sizes),
        as_document_ids(indices),
        seed,
        plan.num_epochs,
        plan.separate_final_epoch,
        plan.shuffle_split,
        sequence_length,
        1 if add_extra_token else 0,
        document_index,
        sample_index,
        shuffle_index,
        num_threads if num_threads is not None else default_build_threads(),
    )
    return document_index, sample_index, shuffle_index
