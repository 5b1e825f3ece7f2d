"""Slow, obviously-correct pure-Python references for every C++ kernel.

Tests demand exact equality between a kernel and its reference on random inputs. Nothing here
is fast; nothing here is imported by the library.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# --- GPTDataset indices ------------------------------------------------------------------------


def shuffle_reference(values: np.ndarray, random_state: np.random.RandomState) -> None:
    """Fisher-Yates exactly as RandomState.shuffle draws it (masked rejection per step)."""
    for i in range(len(values) - 1, 0, -1):
        mask = (1 << i.bit_length()) - 1
        while True:
            if i <= 0xFFFFFFFF:
                word = int(random_state.randint(0, 2**32, dtype=np.uint32))
            else:  # pragma: no cover - arrays of 2^32 elements are not tested here
                high = int(random_state.randint(0, 2**32, dtype=np.uint32))
                word = (high << 32) | int(random_state.randint(0, 2**32, dtype=np.uint32))
            j = word & mask
            if j <= i:
                break
        values[i], values[j] = values[j], values[i]


def sample_index_reference(
    sizes: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_samples: int,
    extra_token: int,
) -> np.ndarray:
    """The sample-index walk, one token budget at a time (megatron-core's build_sample_idx)."""
    rows = [(0, 0)]
    position, offset = 0, 0
    last = len(document_index) - 1
    while len(rows) <= num_samples:
        remaining = sequence_length + extra_token
        while remaining != 0:
            available = int(sizes[document_index[position]]) - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - extra_token
                remaining = 0
            else:
                if position == last:
                    offset = int(sizes[document_index[position]]) - extra_token
                    break
                position += 1
                offset = 0
        rows.append((position, offset))
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def gpt_indices_reference(
    sizes: np.ndarray,
    indices: np.ndarray,
    num_samples: int | None,
    sequence_length: int,
    seed: int,
    extra_token: int = 1,
    drop_last: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All three GPTDataset indices from the spec, with numpy's own RandomState."""
    tokens_per_epoch = int(sum(int(sizes[i]) for i in indices))
    num_epochs = 1
    if num_samples is not None:
        while num_epochs * tokens_per_epoch < num_samples * sequence_length + extra_token:
            num_epochs += 1
    separate = False
    before_final = 0
    if num_epochs > 1:
        assert num_samples is not None
        before_final = ((num_epochs - 1) * tokens_per_epoch - extra_token) // sequence_length
        per_epoch = (tokens_per_epoch - extra_token) // sequence_length
        separate = num_samples - before_final < int(0.80 * per_epoch)
    random_state = np.random.RandomState(seed)
    if separate:
        head = np.tile(np.asarray(indices, dtype=np.int32), num_epochs - 1)
        tail = np.asarray(indices, dtype=np.int32).copy()
        shuffle_reference(head, random_state)
        shuffle_reference(tail, random_state)
        document_index = np.concatenate([head, tail])
    else:
        document_index = np.tile(np.asarray(indices, dtype=np.int32), num_epochs)
        shuffle_reference(document_index, random_state)
    total = num_epochs * tokens_per_epoch - extra_token
    if drop_last:
        count = max(total, 0) // sequence_length
    else:
        count = max(int(np.ceil(np.float32(total) / np.float32(sequence_length))), 0)
    sample_index = sample_index_reference(
        sizes, document_index, sequence_length, count, extra_token
    )
    split = before_final if separate else count
    first = np.arange(split, dtype=np.int64)
    second = np.arange(split, count, dtype=np.int64)
    shuffle_reference(first, random_state)
    if split < count:
        shuffle_reference(second, random_state)
    return document_index, sample_index, np.concatenate([first, second])


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


# --- token scan ----------------------------------------------------------------------------------


def token_positions_reference(tokens: Sequence[int], token: int) -> list[int]:
    """Positions of ``token`` in ``tokens``, one comparison at a time."""
    return [i for i, value in enumerate(tokens) if int(value) == token]
