"""64-bit scale at index level: > 2^31 tokens, > 2^31 document-index entries, >= 2^32 samples.

Kept small in RAM and time on purpose:

* the token data is a sparse `.bin` (a few marker tokens written past 4 GiB, the rest holes), so
  a 6.4 GB dataset costs a few KB of disk and only the pages a sample touches;
* the 2^31-entry document index is `numpy.zeros` (calloc'ed, never written): reading it maps
  the kernel's shared zero page, so it costs virtual address space, not memory;
* 2^32 samples are checked at the plan level (dtypes and shapes), not materialised (the
  shuffle index alone would be 32 GiB).

Outputs are compared with megatron-core itself where it can run at that size.
"""

from __future__ import annotations

import os
import resource
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenmill._core import _testing
from tokenmill.index.gpt_index import plan_gpt_indices

from conftest import TinyTokenizer
from oracles import import_oracle

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning"),
]

INT32_MAX = 2**31 - 1


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def megatron_helpers() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_oracle("megatron.core.datasets.helpers")


# -- 2^31 document-index entries -----------------------------------------------------------------


def test_plan_switches_sample_index_to_int64_past_2_31_entries() -> None:
    """megatron-core: int32 while max(len(document_index), longest) <= 2^31 - 1, else int64."""
    sizes = np.array([3], dtype=np.int32)
    for entries, expected in [(INT32_MAX, np.int32), (INT32_MAX + 1, np.int64)]:
        indices = np.zeros(entries, dtype=np.int32)  # calloc: never written, no memory used
        plan = plan_gpt_indices(sizes, indices, None, 4096, True, True, False, 3 * entries)
        assert plan.sample_dtype is expected, entries
        assert plan.document_index_shape == (entries,)
        del indices
    # epochs count too: 2^16 documents x (2^15 + 1) epochs
    indices = np.zeros(2**16, dtype=np.int32)
    plan = plan_gpt_indices(sizes, indices, 3 * 2**31 // 4096 + 1, 4096, True, True)
    assert plan.num_epochs == 2**15 + 1
    assert plan.sample_dtype is np.int64
    plan = plan_gpt_indices(np.array([INT32_MAX], np.int32), np.zeros(2, np.int32), None, 8, 1, 1)
    assert plan.sample_dtype is np.int32  # a document of exactly 2^31 - 1 tokens still fits


def test_int64_sample_index_kernel_matches_megatrons() -> None:
    """The int64 rows equal megatron-core's int64 kernel (called directly on small inputs)."""
    helpers = megatron_helpers()
    rng = np.random.default_rng(0)
    for trial in range(20):
        sizes = rng.integers(1, 300, int(rng.integers(1, 200))).astype(np.int32)
        document_index = rng.integers(0, sizes.shape[0], int(rng.integers(1, 400)), np.int32)
        sequence_length, extra = int(rng.integers(1, 100)), int(trial % 2)
        tokens = int(sizes[document_index].sum())
        for drop_last in (True, False):
            theirs = helpers.build_sample_idx_int64(
                sizes, document_index, sequence_length, 1, tokens, drop_last, bool(extra)
            )
            ours = np.empty(theirs.shape, dtype=np.int64)
            _testing.build_sample_index(sizes, document_index, sequence_length, extra, ours, 2)
            np.testing.assert_array_equal(ours, theirs, err_msg=f"trial {trial}")


def test_sample_index_over_2_31_document_entries() -> None:
    """The C++ walk over 2^31 + 5 document-index entries writes int64 positions past 2^31:
    with every entry a 1-token document, sample k starts at position k * S, offset 0."""
    before = peak_rss_bytes()
    entries = INT32_MAX + 6
    sizes = np.array([1, 2], dtype=np.int32)
    document_index = np.zeros(entries, dtype=np.int32)  # every entry: document 0, 1 token
    sequence_length = 1 << 22
    plan = plan_gpt_indices(
        sizes, document_index, None, sequence_length, True, True, False, entries
    )
    assert plan.sample_dtype is np.int64
    assert plan.num_samples == (entries - 1) // sequence_length == 512
    ours = np.empty(plan.sample_index_shape, dtype=plan.sample_dtype)
    _testing.build_sample_index(sizes, document_index, sequence_length, 1, ours, 1)
    expected = np.zeros_like(ours)
    expected[:, 0] = np.arange(plan.num_samples + 1, dtype=np.int64) * sequence_length
    np.testing.assert_array_equal(ours, expected)
    assert int(ours[-1, 0]) > INT32_MAX  # positions past 2^31 are really stored
    # reading 8 GiB of never-written zeros costs no memory
    assert peak_rss_bytes() - before < 1 << 30


def test_int32_outputs_refuse_to_truncate() -> None:
    """Called directly with an int32 sample index, the kernel raises instead of wrapping."""
    document_index = np.zeros(INT32_MAX + 2, dtype=np.int32)
    sample_index = np.empty((3, 2), dtype=np.int32)
    with pytest.raises(OverflowError, match="int32 sample_index cannot hold document positions"):
        _testing.build_sample_index(np.array([1], np.int32), document_index, 4, 1, sample_index, 1)


# -- 2^32 samples ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "samples", "dtype"),
    [
        (2**32 - 2, 2**32 - 3, np.uint32),  # the largest uint32 shuffle index megatron builds
        (2**32 - 1, 2**32 - 2, np.int64),  # megatron switches at total >= 2^32 - 2
        (3 * INT32_MAX, 3 * INT32_MAX - 1, np.int64),
    ],
)
def test_plan_switches_shuffle_index_to_int64_at_2_32_samples(
    tokens: int, samples: int, dtype: type
) -> None:
    sizes = np.array([INT32_MAX, INT32_MAX, INT32_MAX], dtype=np.int32)
    plan = plan_gpt_indices(sizes, np.arange(3, dtype=np.int32), None, 1, True, True, False, tokens)
    assert plan.num_samples == samples
    assert plan.shuffle_dtype is dtype
    assert plan.sample_index_shape == (samples + 1, 2)
    # keeping the partial last sample: megatron's float32 ceil at this size
    kept = plan_gpt_indices(
        sizes, np.arange(3, dtype=np.int32), None, 3, True, False, False, tokens
    )
    assert kept.num_samples == int(np.ceil(np.float32(tokens - 1) / np.float32(3)))
    exact = plan_gpt_indices(
        sizes, np.arange(3, dtype=np.int32), None, 3, True, False, True, tokens
    )
    assert exact.num_samples == -(-(tokens - 1) // 3)


# -- > 2^31 tokens: a sparse dataset through both libraries ---------------------------------------

LENGTHS = [2**30 + 3, 2**30 - 7, 2**30 + 11, 5, 2**30 + 2**29]  # 4.8e9 tokens, 9.7 GB
MARKERS = {0: 11, 2**31 + 7: 22, 2**32 - 1: 33, 2**32 + 5: 44, sum(LENGTHS) - 1: 55}


def write_sparse_dataset(prefix: Path) -> str:
    """`.idx` for LENGTHS (uint16) and a sparse `.bin`: zeros except the MARKERS tokens."""
    lengths = np.array(LENGTHS, dtype=np.int32)
    pointers = np.zeros(len(LENGTHS), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * 2
    with open(str(prefix) + ".idx", "wb") as stream:
        stream.write(
            b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(LENGTHS), len(LENGTHS) + 1)
        )
        stream.write(lengths.tobytes() + pointers.tobytes())
        stream.write(np.arange(len(LENGTHS) + 1, dtype=np.int64).tobytes())
    descriptor = os.open(str(prefix) + ".bin", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(descriptor, int(lengths.sum(dtype=np.int64)) * 2)
        for position, token in MARKERS.items():
            os.pwrite(descriptor, struct.pack("<H", token), position * 2)
    finally:
        os.close(descriptor)
    return str(prefix)


def test_dataset_beyond_2_31_tokens_matches_megatron(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron_gpt = import_oracle("megatron.core.datasets.gpt_dataset")
        megatron_indexed = import_oracle("megatron.core.datasets.indexed_dataset")
        megatron_utils = import_oracle("megatron.core.datasets.utils")
    from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
    from tokenmill.datasets.utils import Split
    from tokenmill.formats.megatron import IndexedDataset

    prefix = write_sparse_dataset(tmp_path / "big")
    assert os.stat(prefix + ".bin").st_blocks * 512 < 1 << 20  # really sparse
    fields: dict[str, Any] = {
        "random_seed": 3,
        "sequence_length": 1 << 21,
        "tokenizer": TinyTokenizer(vocab_size=100, eod=99),  # the holes are token 0, not EOD
        "split": "1",
        "reset_position_ids": False,  # megatron loops in Python over every EOD
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
    }
    num_samples = 3000  # ~1.3 epochs of ~2300 samples
    indices = np.arange(len(LENGTHS), dtype=np.int32)
    ours = GPTDataset(
        IndexedDataset(prefix), prefix, indices, num_samples, Split.train,
        GPTDatasetConfig(path_to_cache=str(tmp_path / "ours"), **fields),
    )  # fmt: skip
    theirs = megatron_gpt.GPTDataset(
        megatron_indexed.IndexedDataset(prefix), prefix, indices, num_samples,
        megatron_utils.Split.train,
        megatron_gpt.GPTDatasetConfig(path_to_cache=str(tmp_path / "theirs"), **fields),
    )  # fmt: skip
    assert ours.dataset.index.sequence_pointers[-1] > 2**32
    for name in ("document_index", "sample_index", "shuffle_index"):
        mine, reference = np.asarray(getattr(ours, name)), np.asarray(getattr(theirs, name))
        assert mine.dtype == reference.dtype, name
        np.testing.assert_array_equal(mine, reference, err_msg=name)
    assert len(ours) == len(theirs) >= num_samples
    # Every marker token (positions 0, past 2^31, around 2^32 and the very last one) is read
    # back: find the sample that covers it (from the sample and document indices), check that
    # the marker is at the right position of its text, and that megatron's sample is identical.
    document_starts = np.concatenate(([0], np.cumsum(np.array(LENGTHS, dtype=np.int64))))
    shuffle = np.asarray(ours.shuffle_index)
    position_of_sample = np.empty(shuffle.shape[0], dtype=np.int64)
    position_of_sample[shuffle.astype(np.int64)] = np.arange(shuffle.shape[0])
    document_index = np.asarray(ours.document_index)
    sample_index = np.asarray(ours.sample_index)
    sequence_length = fields["sequence_length"]
    found = {}
    for sample in range(sample_index.shape[0] - 1):
        begin, begin_offset = (int(v) for v in sample_index[sample])
        end, end_offset = (int(v) for v in sample_index[sample + 1])
        filled = 0
        for row in range(begin, end + 1):
            document = int(document_index[row])
            first = begin_offset if row == begin else 0
            last = end_offset + 1 if row == end else LENGTHS[document]  # + the extra token
            for position, token in MARKERS.items():
                offset = position - int(document_starts[document])
                if (
                    position not in found
                    and 0 <= offset < LENGTHS[document]
                    and (first <= offset < last)
                ):
                    found[position] = (
                        int(position_of_sample[sample]),
                        filled + offset - first,
                        token,
                    )
            filled += last - first
    assert set(found) == set(MARKERS)  # every marker lies in some sample
    for position, (idx, in_text, token) in found.items():
        mine, reference = ours[idx], theirs[idx]
        for key in reference:
            assert torch.equal(mine[key], reference[key]), (position, key)
        if in_text < sequence_length:
            assert int(mine["tokens"][in_text]) == token, position
        if in_text >= 1:
            assert int(mine["labels"][in_text - 1]) == token, position
    batch = ours.get_batch([0, len(ours) - 1])
    assert torch.equal(batch["tokens"][1], theirs[len(ours) - 1]["tokens"])
