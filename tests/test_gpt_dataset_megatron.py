"""Differential tests: tokenmill's GPTDataset against megatron-core 0.19.2 itself.

For randomized corpora, configs and seeds both libraries build their indices independently
(separate cache directories) and must produce equal arrays (dtype, shape, values), equal
lengths, equal cache files byte for byte, and equal `__getitem__` outputs.

`test_gpt_dataset_matches_megatron` draws its cases from a covering design (tests/covering.py):
every pair of settings of the seven sample flags, the corpus (up to 10^4 documents, documents of
up to 10^5 tokens), the split, the num_samples kind and the sequence length (up to 8,192) meets
in at least one case, and the run prints the pairs its compared cases reached (refusals and
zero-length datasets counted apart). TOKENMILL_DIFFERENTIAL=nightly runs three designs (every
pair three times) with full sweeps of every sample; its report is tests/reports/.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from covering import NIGHTLY, all_pairs, pairs_of, pairwise_cases, suite

from conftest import TinyTokenizer, random_documents, write_megatron_shard
from oracles import import_oracle

# These tests build datasets with megatron's default create_attention_mask=True on purpose.
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning"),
]

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    megatron_gpt = import_oracle("megatron.core.datasets.gpt_dataset")
    megatron_indexed = import_oracle("megatron.core.datasets.indexed_dataset")
    megatron_utils = import_oracle("megatron.core.datasets.utils")

from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig, MockGPTDataset
from tokenmill.datasets.utils import Split
from tokenmill.formats.megatron import IndexedDataset

FLAGS = (
    "reset_position_ids",
    "reset_attention_mask",
    "eod_mask_loss",
    "create_attention_mask",
    "add_extra_token_to_sequence",
    "drop_last_partial_validation_sequence",
    "inter_document_masking",
)


def assert_same_indices(ours: Any, theirs: Any) -> None:
    for name in ("document_index", "sample_index", "shuffle_index"):
        mine, reference = np.asarray(getattr(ours, name)), np.asarray(getattr(theirs, name))
        assert mine.dtype == reference.dtype, name
        assert mine.shape == reference.shape, name
        np.testing.assert_array_equal(mine, reference, err_msg=name)
    assert len(ours) == len(theirs)


def assert_same_sample(ours: dict[str, Any], theirs: dict[str, Any], where: str) -> None:
    assert list(ours) == list(theirs), where
    for key in theirs:
        mine, reference = ours[key], theirs[key]
        assert mine.dtype == reference.dtype, f"{where} {key}"
        assert mine.shape == reference.shape, f"{where} {key}"
        assert torch.equal(mine, reference), f"{where} {key}"


def gpt_fields(prefix: str, **overrides: Any) -> dict[str, Any]:
    """Config fields shared by both libraries' GPTDatasetConfig in these tests."""
    fields: dict[str, Any] = {
        "random_seed": 9,
        "sequence_length": 50,
        "tokenizer": TinyTokenizer(),
        "blend": ([prefix], None),
        "split": "1",
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
    }
    fields.update(overrides)
    return fields


def their_dataset(
    prefix: str,
    indices: Any,
    num_samples: int | None,
    index_split: Split,
    cache: Any,
    /,
    **fields: Any,
) -> Any:
    """megatron-core's GPTDataset over `prefix` (cache None: megatron's default location)."""
    if cache is not None:
        fields["path_to_cache"] = str(cache)
    return megatron_gpt.GPTDataset(
        megatron_indexed.IndexedDataset(prefix),
        prefix,
        indices,
        num_samples,
        megatron_utils.Split[index_split.name],
        megatron_gpt.GPTDatasetConfig(**fields),
    )


def our_dataset(
    prefix: str,
    indices: Any,
    num_samples: int | None,
    index_split: Split,
    cache: Any,
    /,
    **fields: Any,
) -> GPTDataset:
    """tokenmill's GPTDataset over `prefix`, built the same way."""
    if cache is not None:
        fields["path_to_cache"] = str(cache)
    return GPTDataset(
        IndexedDataset(prefix),
        prefix,
        indices,
        num_samples,
        index_split,
        GPTDatasetConfig(**fields),
    )


def make_corpus(tmp_path: Path, rng: np.random.Generator, kind: str, sequence_length: int) -> str:
    """A corpus of `kind`, with at least two samples' worth of tokens for `sequence_length`
    (more documents of the same kind are added until it has), so no case is empty by design."""
    if kind == "short":  # many length-1 and tiny documents
        count = max(80, 2 * sequence_length)
        documents = [
            [0] if rng.random() < 0.4 else [1, 2, 0][: rng.integers(1, 4)] for _ in range(count)
        ]
    elif kind == "long":  # documents much longer than the sequence
        documents = random_documents(rng, 12, max_length=3000)
    elif kind == "huge-documents":  # documents of up to 10^5 tokens
        documents = random_documents(rng, 24, max_length=100_000)
    elif kind == "many-documents":  # a corpus of 10^4 documents
        documents = random_documents(rng, 10_000, max_length=120)
    else:
        documents = random_documents(rng, 150, max_length=400)
    while sum(map(len, documents)) < 2 * (sequence_length + 1):
        documents += random_documents(rng, 16, max_length=3000)
    return write_megatron_shard(tmp_path / f"corpus-{kind}", documents)


CORPORA = ("mixed", "short", "long", "huge-documents", "many-documents")
SPLIT_NAMES = (Split.train, Split.valid, Split.test)
SAMPLE_KINDS = ("one epoch", "part of an epoch", "several epochs")
SEQUENCE_LENGTHS = (1, 2, 7, 64, 257, 2048, 8192)
# Every pair of settings of these dimensions (two flags, a flag and the corpus, the corpus and
# the sequence length, ...) meets in at least one case of the CI set; the nightly run
# (TOKENMILL_DIFFERENTIAL=nightly) meets every pair three times, from three designs.
GPT_DIMENSIONS: dict[str, tuple[Any, ...]] = {
    **{name: (False, True) for name in FLAGS},
    "corpus": CORPORA,
    "split": SPLIT_NAMES,
    "samples": SAMPLE_KINDS,
    "sequence_length": SEQUENCE_LENGTHS,
}
GPT_CASES = pairwise_cases(GPT_DIMENSIONS, seed=1, repeat=3 if NIGHTLY else 1)
GPT_COVERAGE = suite("GPTDataset samples (test_gpt_dataset_megatron)", GPT_DIMENSIONS)
# Samples compared per case beyond a full sweep: the first, the last, the padding sample and
# this many random ones (fewer where a sample is large: S >= 2048 with a dense attention mask).
RANDOM_SAMPLES = 40
FULL_SWEEP_TOKENS = 10**7 if NIGHTLY else 400_000
FULL_SWEEP_SAMPLES = 20_000 if NIGHTLY else 600


def test_gpt_cases_cover_every_pair() -> None:
    covered = set().union(*(pairs_of(case, GPT_DIMENSIONS) for case in GPT_CASES))
    assert covered == all_pairs(GPT_DIMENSIONS)


@pytest.mark.parametrize("case", range(len(GPT_CASES)))
def test_gpt_dataset_matches_megatron(tmp_path: Path, case: int) -> None:
    """Arrays, length, description, cache files and every key of the samples (a full sweep
    where the dataset holds at most FULL_SWEEP_SAMPLES samples and FULL_SWEEP_TOKENS tokens
    of them, else the first, the
    last, the padding sample and random ones, then one batch through `__getitems__` and torch's
    default collate) equal megatron-core's; where megatron refuses, tokenmill refuses alike;
    where megatron fails on cu_seqlens (inter_document_masking), the sample it would return
    (megatron_compare.expected_cu_seqlens_sample) is compared instead."""
    from torch.utils.data import default_collate

    from megatron_compare import (
        assert_same_refusal,
        assert_same_sample,
        disable_mask_cache,
        documented_sample,
        same_outcome,
    )

    drawn = GPT_CASES[case]
    flags = {name: drawn[name] for name in FLAGS}
    corpus, split, kind = drawn["corpus"], drawn["split"], drawn["samples"]
    sequence_length = drawn["sequence_length"]
    rng = np.random.default_rng(1000 + case)
    prefix = make_corpus(tmp_path, rng, corpus, sequence_length)
    seed = int(rng.integers(0, 2**32))
    low_level = IndexedDataset(prefix)
    count = len(low_level)
    extra = int(flags["add_extra_token_to_sequence"])
    begin = int(rng.integers(0, count))
    end = int(rng.integers(begin + 1, count + 1))
    if int(low_level.sequence_lengths[begin:end].sum()) - extra < sequence_length:
        begin, end = 0, count  # a range too short for one sample: the whole corpus
    indices = np.arange(begin, end, dtype=np.int32)
    tokens = int(low_level.sequence_lengths[indices].sum())
    per_epoch = max((tokens - 1) // sequence_length, 1)
    # None (one epoch), a fraction of an epoch, or several epochs (with or without a
    # separate final epoch, decided by the 0.8 rule).
    num_samples = {
        "one epoch": None,
        "part of an epoch": max(int(per_epoch * rng.uniform(0.05, 0.95)), 1),
        "several epochs": int(per_epoch * rng.uniform(1.05, 4.0)),
    }[kind]
    tokenizer = TinyTokenizer()
    common = {"random_seed": seed, "sequence_length": sequence_length, "tokenizer": tokenizer}
    common |= {"blend": ([prefix], None), "split": "1", **flags}
    where = f"case {case} {corpus} {split.name} {kind} S={sequence_length} {flags}"
    try:
        theirs = their_dataset(prefix, indices, num_samples, split, tmp_path / "megatron", **common)
    except Exception as refusal:
        with pytest.raises(Exception) as ours_refused:
            our_dataset(prefix, indices, num_samples, split, tmp_path / "tokenmill", **common)
        assert_same_refusal(ours_refused.value, refusal, where)
        GPT_COVERAGE.record(case, drawn, "refused")
        return
    ours = our_dataset(prefix, indices, num_samples, split, tmp_path / "tokenmill", **common)
    disable_mask_cache(theirs)  # see test_megatron_compat.py: megatron's loss-mask leak
    assert ours.unique_description == theirs.unique_description
    assert ours.unique_description_hash == theirs.unique_description_hash
    assert_same_indices(ours, theirs)
    for name in sorted(p.name for p in (tmp_path / "megatron").iterdir()):
        assert (tmp_path / "tokenmill" / name).read_bytes() == (
            tmp_path / "megatron" / name
        ).read_bytes(), name
    if len(theirs) == 0:
        GPT_COVERAGE.record(case, drawn, "empty")
        return
    large = sequence_length >= 2048 and flags["create_attention_mask"]
    sweep = len(theirs) <= FULL_SWEEP_SAMPLES and len(theirs) * sequence_length <= FULL_SWEEP_TOKENS
    if len(theirs) <= 48 or (sweep and not (large and not NIGHTLY)):
        picked = list(range(len(theirs)))
    else:
        # a dense S x S mask (64 MiB at 8,192) that megatron builds document by document when
        # reset_attention_mask is on: seconds per sample, so one random sample in CI
        limit = (RANDOM_SAMPLES if NIGHTLY else 1) if large else RANDOM_SAMPLES
        picked = [0, *rng.integers(0, len(theirs), limit).tolist(), len(theirs) - 1]
    expected: dict[int | None, dict[str, Any]] = {}
    for idx in [*picked, None]:
        pair = same_outcome(
            lambda idx=idx: theirs[idx],
            lambda idx=idx: ours[idx],
            f"{where} idx {idx}",
            documented=lambda idx=idx: documented_sample(theirs, idx),
        )
        assert pair is not None, f"{where} idx {idx}: both refused a valid index"
        assert_same_sample(pair[1], pair[0], f"{where} idx {idx}")
        expected[idx] = pair[0]
    batch = picked[: 4 if large else 16]
    expected_batch = default_collate([expected[idx] for idx in batch])
    assert_same_sample(default_collate(ours.__getitems__(batch)), expected_batch, where)
    GPT_COVERAGE.record(case, drawn, "compared")


def test_pad_token_and_real_pads_match_megatron(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    documents = random_documents(rng, 60, max_length=100)
    for document in documents[::3]:
        document[len(document) // 2] = 7  # a real pad token inside documents
    prefix = write_megatron_shard(tmp_path / "padded", documents)
    for pad, allow in [(7, False), (0, False), (0, True)]:
        tokenizer = TinyTokenizer(pad=pad)
        common = {
            "random_seed": 3,
            "sequence_length": 33,
            "tokenizer": tokenizer,
            "blend": ([prefix], None),
            "split": "1",
            "reset_position_ids": True,
            "reset_attention_mask": False,
            "eod_mask_loss": True,
            "allow_ambiguous_pad_tokens": allow,
            "drop_last_partial_validation_sequence": False,
        }
        indices = np.arange(60, dtype=np.int32)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            theirs = their_dataset(prefix, indices, None, Split.valid, None, **common)
            ours = our_dataset(
                prefix, indices, None, Split.valid, tmp_path / f"t{pad}{allow}", **common
            )
        assert ours._pad_token_id == theirs._pad_token_id
        for idx in range(len(theirs)):
            assert_same_sample(ours[idx], theirs[idx], f"pad {pad} idx {idx}")


def test_mock_dataset_matches_megatron(tmp_path: Path) -> None:
    tokenizer = TinyTokenizer(vocab_size=500, eod=3)
    common = {
        "random_seed": 11,
        "sequence_length": 128,
        "tokenizer": tokenizer,
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
    }
    their_config = megatron_gpt.GPTDatasetConfig(**common)
    our_config = GPTDatasetConfig(**common)
    assert our_config.mock
    assert our_config.split_matrix == their_config.split_matrix
    their_low = megatron_gpt.MockGPTDataset.build_low_level_dataset(None, their_config)
    our_low = MockGPTDataset.build_low_level_dataset(None, our_config)
    np.testing.assert_array_equal(our_low.sequence_lengths, their_low.sequence_lengths)
    indices = np.arange(0, 2000, dtype=np.int32)
    theirs = megatron_gpt.MockGPTDataset(
        their_low, None, indices, 500, megatron_utils.Split.train, their_config
    )
    ours = MockGPTDataset(our_low, None, indices, 500, Split.train, our_config)
    assert_same_indices(ours, theirs)
    for idx in range(0, 500, 37):
        assert_same_sample(ours[idx], theirs[idx], f"mock {idx}")


def test_cache_written_by_megatron_is_a_hit(
    tmp_path: Path, shard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = gpt_fields(shard, path_to_cache=str(tmp_path / "cache"))
    indices = np.arange(200, dtype=np.int32)
    theirs = their_dataset(shard, indices, 700, Split.train, None, **common)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}

    def no_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("tokenmill rebuilt an index megatron-core had cached")

    monkeypatch.setattr("tokenmill.datasets.gpt.build_gpt_indices", no_build)
    ours = our_dataset(shard, indices, 700, Split.train, None, **common)
    assert_same_indices(ours, theirs)
    after = {
        p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir() if p.name[0] != "."
    }
    # megatron's files are untouched and nothing is added to its folder (a sidecar is written
    # only where the user asks for strict data checks: cache_data_check="error")
    assert after == before
    for idx in range(0, len(ours), 97):
        assert_same_sample(ours[idx], theirs[idx], f"idx {idx}")


def test_cache_written_by_tokenmill_is_a_hit_for_megatron(
    tmp_path: Path, shard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = gpt_fields(
        shard,
        path_to_cache=str(tmp_path / "cache"),
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=True,
    )
    indices = np.arange(200, dtype=np.int32)
    ours = our_dataset(shard, indices, 1500, Split.train, None, **common)
    from megatron.core.datasets import helpers

    def no_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("megatron-core rebuilt an index tokenmill had cached")

    monkeypatch.setattr(helpers, "build_sample_idx", no_build)
    theirs = their_dataset(shard, indices, 1500, Split.train, None, **common)
    assert_same_indices(ours, theirs)
    for idx in range(0, len(ours), 131):
        assert_same_sample(ours[idx], theirs[idx], f"idx {idx}")


@pytest.mark.parametrize(
    ("fraction", "separate"), [(1.1, True), (1.5, True), (1.9, False), (3.3, True), (3.95, False)]
)
def test_final_epoch_rule_matches_megatron(
    tmp_path: Path, shard: str, fraction: float, separate: bool
) -> None:
    """Both sides of the 0.80 separate-final-epoch threshold, over several epochs."""
    from tokenmill.index.gpt_index import plan_gpt_indices

    low_level = IndexedDataset(shard)
    indices = np.arange(len(low_level), dtype=np.int32)
    sequence_length = 64
    per_epoch = (int(low_level.sequence_lengths.sum()) - 1) // sequence_length
    num_samples = int(per_epoch * fraction)
    plan = plan_gpt_indices(
        np.asarray(low_level.sequence_lengths), indices, num_samples, sequence_length, True, True
    )
    assert plan.separate_final_epoch is separate
    assert plan.num_epochs == int(np.ceil(fraction))
    common = gpt_fields(
        shard,
        random_seed=42,
        sequence_length=sequence_length,
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=True,
    )
    theirs = their_dataset(shard, indices, num_samples, Split.train, tmp_path / "m", **common)
    ours = our_dataset(shard, indices, num_samples, Split.train, tmp_path / "t", **common)
    assert_same_indices(ours, theirs)
    for idx in range(0, len(ours), max(1, len(ours) // 10)):
        assert_same_sample(ours[idx], theirs[idx], f"idx {idx}")


def test_megatron_tokenizer_object_works_as_is(tmp_path: Path) -> None:
    null_tokenizer = import_oracle(
        "megatron.core.tokenizers.text.libraries.null_tokenizer"
    ).NullTokenizer(1000)
    rng = np.random.default_rng(8)
    prefix = write_megatron_shard(tmp_path / "nt", random_documents(rng, 50, 100, eod=999))
    indices = np.arange(50, dtype=np.int32)
    common = gpt_fields(
        prefix,
        random_seed=1,
        sequence_length=16,
        tokenizer=null_tokenizer,
        reset_position_ids=True,
        eod_mask_loss=True,
    )
    theirs = their_dataset(prefix, indices, 100, Split.train, tmp_path / "m", **common)
    ours = our_dataset(prefix, indices, 100, Split.train, tmp_path / "t", **common)
    assert ours.unique_description_hash == theirs.unique_description_hash
    for idx in range(len(theirs)):
        assert_same_sample(ours[idx], theirs[idx], f"idx {idx}")
