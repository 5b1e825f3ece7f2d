"""The C++ GPT index kernels against the slow references and numpy's own RandomState."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill import _core
from tokenmill._core import _testing
from tokenmill.index.gpt_index import (
    build_gpt_indices,
    count_samples,
    num_tokens_per_epoch,
    plan_gpt_indices,
)

from reference import gpt_indices_reference, sample_index_reference, shuffle_reference


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64])
@pytest.mark.parametrize("size", [0, 1, 2, 3, 17, 1000, 70_001])
def test_shuffle_equals_numpy_random_state(dtype: type, size: int) -> None:
    expected = np.arange(size, dtype=dtype)
    np.random.RandomState(20240520).shuffle(expected)
    actual = np.arange(size, dtype=dtype)
    _core.shuffle_like_numpy(actual, 20240520)
    np.testing.assert_array_equal(actual, expected)


@given(st.integers(0, 2**32 - 1), st.integers(0, 300))
def test_shuffle_equals_reference(seed: int, size: int) -> None:
    expected = np.arange(size, dtype=np.int64)
    shuffle_reference(expected, np.random.RandomState(seed))
    actual = np.arange(size, dtype=np.int64)
    _core.shuffle_like_numpy(actual, seed)
    np.testing.assert_array_equal(actual, expected)


def test_shuffle_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="int32, uint32 or int64"):
        _core.shuffle_like_numpy(np.arange(4, dtype=np.float64), 1)
    with pytest.raises(ValueError, match="random_seed must be in"):
        _core.shuffle_like_numpy(np.arange(4, dtype=np.int32), 2**32)
    with pytest.raises(ValueError, match="random_seed must be in"):
        _core.shuffle_like_numpy(np.arange(4, dtype=np.int32), -1)
    with pytest.raises(ValueError, match="1-D"):
        _core.shuffle_like_numpy(np.zeros((2, 2), dtype=np.int32), 1)
    with pytest.raises(TypeError, match="C-contiguous"):
        _core.shuffle_like_numpy(np.arange(8, dtype=np.int32)[::2], 1)


document_sizes = st.lists(st.integers(0, 40), min_size=1, max_size=40)


@given(
    sizes=document_sizes,
    sequence_length=st.integers(1, 50),
    extra=st.integers(0, 1),
    epochs=st.integers(1, 3),
    seed=st.integers(0, 1000),
    threads=st.integers(1, 4),
)
def test_sample_index_equals_reference(
    sizes: list[int], sequence_length: int, extra: int, epochs: int, seed: int, threads: int
) -> None:
    sizes_array = np.array(sizes, dtype=np.int32)
    document_index = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
    np.random.default_rng(seed).shuffle(document_index)
    total = int(sizes_array[document_index].sum())
    for drop_last in (True, False):
        count = count_samples(total, sequence_length, extra, drop_last, exact=False)
        expected = sample_index_reference(
            sizes_array, document_index, sequence_length, count, extra
        )
        actual = np.empty((count + 1, 2), dtype=np.int64)
        _testing.build_sample_index(
            sizes_array, document_index, sequence_length, extra, actual, threads
        )
        np.testing.assert_array_equal(actual, expected)


def test_sample_index_worked_example() -> None:
    """The example in csrc/sample_index.hpp."""
    sizes = np.array([3, 2, 4], dtype=np.int32)
    rows = np.empty((3, 2), dtype=np.int32)
    _testing.build_sample_index(sizes, np.array([2, 0, 1], dtype=np.int32), 3, 1, rows, 1)
    np.testing.assert_array_equal(rows, [[0, 0], [0, 3], [1, 2]])


def test_sample_index_is_identical_for_any_thread_count() -> None:
    rng = np.random.default_rng(7)
    sizes = rng.integers(0, 3000, 300_000).astype(np.int32)
    document_index = rng.permutation(300_000).astype(np.int32)
    count = (int(sizes.sum()) - 1) // 2048
    results = []
    for threads in (1, 2, 3, 8):
        rows = np.empty((count + 1, 2), dtype=np.int32)
        _testing.build_sample_index(sizes, document_index, 2048, 1, rows, threads)
        results.append(rows)
    for rows in results[1:]:
        np.testing.assert_array_equal(rows, results[0])


@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=30),
    sequence_length=st.integers(1, 40),
    extra=st.integers(0, 1),
    seed=st.integers(0, 2**32 - 1),
    samples=st.one_of(st.none(), st.integers(0, 200)),
    drop_last=st.booleans(),
)
def test_gpt_indices_equal_reference(
    sizes: list[int],
    sequence_length: int,
    extra: int,
    seed: int,
    samples: int | None,
    drop_last: bool,
) -> None:
    sizes_array = np.array(sizes, dtype=np.int32)
    indices = np.arange(len(sizes), dtype=np.int32)
    if samples is not None and int(sizes_array.sum()) == 0:
        with pytest.raises(ValueError, match="cannot draw"):
            plan_gpt_indices(sizes_array, indices, samples, sequence_length, bool(extra), drop_last)
        return
    if samples is not None:
        # megatron-core requires at least one sample per epoch when it needs several epochs.
        per_epoch = (int(sizes_array.sum()) - extra) // sequence_length
        if per_epoch < 1 and samples * sequence_length + extra > int(sizes_array.sum()):
            return
    plan = plan_gpt_indices(sizes_array, indices, samples, sequence_length, bool(extra), drop_last)
    actual = build_gpt_indices(sizes_array, indices, plan, seed, sequence_length, bool(extra), 2)
    expected = gpt_indices_reference(
        sizes_array, indices, samples, sequence_length, seed, extra, drop_last
    )
    for got, want in zip(actual, expected):
        np.testing.assert_array_equal(got, want)
    assert actual[0].dtype == np.int32
    assert actual[1].dtype == np.int32
    assert actual[2].dtype == np.uint32


def test_separate_final_epoch_keeps_last_epoch_samples_last() -> None:
    sizes = np.full(100, 10, dtype=np.int32)
    indices = np.arange(100, dtype=np.int32)
    # 1000 tokens per epoch, 99 samples per epoch at S=10; 110 samples need a second epoch
    # from which only 11 samples come: fewer than 0.8 * 99, so the final epoch is separate.
    plan = plan_gpt_indices(sizes, indices, 110, 10, True, True)
    assert plan.num_epochs == 2 and plan.separate_final_epoch
    _, _, shuffle_index = build_gpt_indices(sizes, indices, plan, 3, 10, True)
    assert sorted(shuffle_index[: plan.shuffle_split]) == list(range(plan.shuffle_split))
    assert min(shuffle_index[plan.shuffle_split :]) == plan.shuffle_split


def test_float32_sample_count_is_reproduced_and_exact_count_available() -> None:
    """megatron-core's single-precision ceil overcounts for ~1e10 tokens at S=3000."""
    tokens = 9_999_039_001
    assert count_samples(tokens, 3000, 1, drop_last=False, exact=False) == 3_333_014
    assert count_samples(tokens, 3000, 1, drop_last=False, exact=True) == 3_333_013
    assert count_samples(tokens, 3000, 1, drop_last=True, exact=False) == 3_333_013


def test_sixty_four_bit_dtype_switches() -> None:
    """Plans only (no allocation): the dtypes widen exactly where megatron-core widens them."""
    sizes = np.array([1, 1], dtype=np.int32)
    indices = np.arange(2, dtype=np.int32)
    small = plan_gpt_indices(sizes, indices, 2**30 - 1, 1, False, True)
    assert small.sample_dtype == np.int32 and small.shuffle_dtype == np.uint32
    # len(document_index) = 2 * 2^30 = 2^31 > int32 max: the sample index widens.
    wide = plan_gpt_indices(sizes, indices, 2**31, 1, False, True)
    assert wide.num_epochs * 2 > 2**31 - 1
    assert wide.sample_dtype == np.int64 and wide.shuffle_dtype == np.uint32
    # 2^32 - 2 samples: the shuffle index widens to int64.
    huge = plan_gpt_indices(sizes, indices, 2**32 - 2, 1, False, True)
    assert huge.num_samples == 2**32 - 2 and huge.shuffle_dtype == np.int64
    below = plan_gpt_indices(sizes, indices, 2**32 - 5, 1, False, True)
    assert below.num_samples == 2**32 - 4 and below.shuffle_dtype == np.uint32


def test_num_tokens_per_epoch_checks_indices() -> None:
    sizes = np.array([3, 4, 5], dtype=np.int32)
    assert num_tokens_per_epoch(sizes, [0, 2, 2]) == 13
    with pytest.raises(IndexError, match=r"indices\[1\] = 7 is not a document id in \[0, 3\)"):
        num_tokens_per_epoch(sizes, [0, 7])
    with pytest.raises(OverflowError, match="must fit int32"):
        num_tokens_per_epoch(sizes, np.array([2**40], dtype=np.int64))
    with pytest.raises(TypeError, match="must hold integers"):
        num_tokens_per_epoch(sizes, np.array([0.5]))


def test_documents_longer_than_int32_are_refused_before_planning() -> None:
    """Lengths are int32, so no document can decide the sample-index dtype (megatron-core's
    `max(len(document_index), sizes.max())` rule reduces to the document-index length)."""
    int32_max = int(np.iinfo(np.int32).max)
    sizes = np.array([3, int32_max + 1], dtype=np.int64)
    indices = np.arange(2, dtype=np.int32)
    for tokens_per_epoch in (None, int32_max + 4):
        with pytest.raises(OverflowError, match="sequence lengths must fit int32"):
            plan_gpt_indices(sizes, indices, None, 8, True, True, False, tokens_per_epoch)


def test_kernels_reject_bad_arguments() -> None:
    sizes = np.array([3, 4], dtype=np.int32)
    documents = np.array([0, 1], dtype=np.int32)
    rows = np.empty((3, 2), dtype=np.int32)
    with pytest.raises(ValueError, match="sequence_length must be >= 1, got 0"):
        _testing.build_sample_index(sizes, documents, 0, 1, rows, 1)
    with pytest.raises(ValueError, match="must be 0 or 1, got 2"):
        _testing.build_sample_index(sizes, documents, 2, 2, rows, 1)
    with pytest.raises(TypeError, match="document_index must have dtype int32"):
        _testing.build_sample_index(sizes, documents.astype(np.int64), 2, 1, rows, 1)
    with pytest.raises(IndexError, match=r"document_index\[1\] = 9"):
        _testing.build_sample_index(sizes, np.array([0, 9], np.int32), 2, 1, rows, 1)
    with pytest.raises(ValueError, match=r"shape \[num_samples \+ 1, 2\]"):
        _testing.build_sample_index(sizes, documents, 2, 1, np.empty((3, 3), np.int32), 1)
    with pytest.raises(TypeError, match="sample_index must be int32 or int64"):
        _testing.build_sample_index(sizes, documents, 2, 1, np.empty((3, 2), np.float32), 1)
    read_only = np.empty((3, 2), dtype=np.int32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        _testing.build_sample_index(sizes, documents, 2, 1, read_only, 1)
    with pytest.raises(ValueError, match="num_epochs \\* len\\(indices\\)"):
        _core.build_gpt_indices(
            sizes, documents, 1, 2, False, 2, 2, 1,
            np.empty(3, np.int32), np.empty((3, 2), np.int32), np.empty(2, np.uint32), 1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="shuffle_split must be in"):
        _core.build_gpt_indices(
            sizes, documents, 1, 1, False, 5, 2, 1,
            np.empty(2, np.int32), np.empty((3, 2), np.int32), np.empty(2, np.uint32), 1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="indices must not be empty"):
        _core.build_gpt_indices(
            sizes, documents[:0], 1, 1, False, 0, 2, 1,
            np.empty(0, np.int32), np.empty((1, 2), np.int32), np.empty(0, np.uint32), 1,
        )  # fmt: skip
