"""Differential tests of blends and splits against megatron-core 0.19.2.

Blends drawn from covering designs (tests/covering.py; every pair of settings meets in some
case, and the run prints the pairs its compared cases reached): 1-40 datasets, random, tiny,
near-tie (a few ulps apart), extreme (1e-12 to 1, one dataset holding all but 1e-9) and equal
weights, no weights, per-split blends, sizes with None, every form of split string: both builders run on the same shards with their
own cache directories and must give identical arrays, identical samples and identical cache
files (names are md5 hashes of the descriptions, so equal names prove equal hashes).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from covering import NIGHTLY, all_pairs, pairs_of, pairwise_cases, suite

from conftest import TinyTokenizer, random_documents, write_megatron_shard
from megatron_compare import assert_same_refusal
from oracles import import_oracle

# These tests build datasets with megatron's default create_attention_mask=True on purpose.
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning"),
]

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    megatron_builder = import_oracle("megatron.core.datasets.blended_megatron_dataset_builder")
    megatron_blended = import_oracle("megatron.core.datasets.blended_dataset")
    megatron_gpt = import_oracle("megatron.core.datasets.gpt_dataset")
    megatron_config = import_oracle("megatron.core.datasets.blended_megatron_dataset_config")
    megatron_utils = import_oracle("megatron.core.datasets.utils")

from tokenmill.datasets import utils
from tokenmill.datasets.blended import BlendedDataset
from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig, MockGPTDataset


def shards(
    tmp_path: Path, rng: np.random.Generator, count: int, documents: int | None = None
) -> list[str]:
    """`count` shards. megatron-core loops forever on a split with no tokens, so every split
    must get documents: 60+ per shard covers 2 % splits, and callers whose split strings give a
    split 1/1000 of the documents ask for 1000+."""
    return [
        write_megatron_shard(
            tmp_path / f"shard{i}",
            random_documents(
                rng,
                documents or int(rng.integers(60, 120)),
                200 if documents is None else 60,
            ),
        )
        for i in range(count)
    ]


def compare_datasets(ours: Any, theirs: Any, rng: np.random.Generator, where: str) -> None:
    if theirs is None:
        assert ours is None, where
        return
    if isinstance(theirs, list):
        assert isinstance(ours, list)
        assert len(ours) == len(theirs)
        for i, (mine, reference) in enumerate(zip(ours, theirs)):
            compare_datasets(mine, reference, rng, f"{where}[{i}]")
        return
    assert type(ours).__name__ == type(theirs).__name__, where
    assert len(ours) == len(theirs), where
    assert ours.unique_description == theirs.unique_description, where
    names = (
        ("dataset_index", "dataset_sample_index")
        if isinstance(theirs, megatron_blended.BlendedDataset)
        else ("document_index", "sample_index", "shuffle_index")
    )
    if not isinstance(theirs, megatron_blended.BlendedDataset):
        # the split's document ids (megatron's `indices`): the same ids and dtype; tokenmill's
        # view one shared counting array, which nothing may write to
        assert ours.indices.dtype == theirs.indices.dtype, where
        np.testing.assert_array_equal(ours.indices, theirs.indices, err_msg=f"{where} indices")
        assert not ours.indices.flags.writeable, where
    for name in names:
        mine, reference = np.asarray(getattr(ours, name)), np.asarray(getattr(theirs, name))
        assert mine.dtype == reference.dtype, f"{where} {name}"
        np.testing.assert_array_equal(mine, reference, err_msg=f"{where} {name}")
    if len(theirs) == 0:
        return
    for idx in rng.integers(0, len(theirs), 4).tolist():
        mine, reference = ours[idx], theirs[idx]
        assert list(mine) == list(reference), where
        for key in reference:
            if key == "dataset_id":
                assert int(mine[key]) == int(reference[key])
                assert np.asarray(mine[key]).dtype == np.asarray(reference[key]).dtype
            else:
                assert torch.equal(mine[key], reference[key]), f"{where} {idx} {key}"


def build_both(
    tmp_path: Path, sizes: list[int | None], **fields: Any
) -> tuple[list[Any], list[Any]]:
    tokenizer = TinyTokenizer()
    common = {
        "random_seed": 1234,
        "sequence_length": 31,
        "tokenizer": tokenizer,
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
        **fields,
    }
    their_builder = megatron_builder.BlendedMegatronDatasetBuilder(
        megatron_gpt.MockGPTDataset
        if "blend" not in fields and "blend_per_split" not in fields
        else megatron_gpt.GPTDataset,
        sizes,
        lambda: True,
        megatron_gpt.GPTDatasetConfig(path_to_cache=str(tmp_path / "megatron"), **common),
    )
    our_builder = BlendedMegatronDatasetBuilder(
        MockGPTDataset if "blend" not in fields and "blend_per_split" not in fields else GPTDataset,
        sizes,
        lambda: True,
        GPTDatasetConfig(path_to_cache=str(tmp_path / "tokenmill"), **common),
    )
    try:
        theirs = their_builder.build()
    except Exception as refusal:
        # megatron-core refuses (e.g. asserts that a member split is too short for one
        # sample); tokenmill must refuse alike: type family and normalised message
        with pytest.raises(Exception) as ours:
            our_builder.build()
        assert_same_refusal(ours.value, refusal, f"sizes {sizes} {fields}")
        return [], []
    return our_builder.build(), theirs


def assert_same_cache_files(tmp_path: Path) -> None:
    theirs = sorted(p.name for p in (tmp_path / "megatron").iterdir())
    ours = sorted(p.name for p in (tmp_path / "tokenmill").iterdir() if not p.name.startswith("."))
    # tokenmill adds one data fingerprint beside each entry; megatron's files are byte-identical
    fingerprints = {name for name in ours if name.endswith("-data.tokenmill.json")}
    assert fingerprints == {
        name.replace("-description.txt", "-data.tokenmill.json")
        for name in theirs
        if name.endswith("-description.txt")
    }
    ours = [name for name in ours if name not in fingerprints]
    assert ours == theirs
    for name in theirs:
        assert (tmp_path / "tokenmill" / name).read_bytes() == (
            tmp_path / "megatron" / name
        ).read_bytes(), name


SPLITS = ["969,30,1", "98/2/0", "1", "0.9 0.1", "80,10,10", "7,2,1"]


def blend_weights(style: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """Weights of a style: random; random with one tiny weight; near ties (equal weights a
    few ulps apart, where rounding of weight x t decides); extreme (spanning 1e-12 to 1, and
    one dataset holding all but 1e-9 of the blend); exactly equal."""
    if style == "tiny":
        weights = rng.uniform(0.01, 1.0, count)
        weights[rng.integers(0, count)] = 1e-4
        return weights
    if style == "near-tie":
        return 0.5 * (1.0 + np.arange(count) * np.finfo(np.float64).eps * rng.integers(1, 4))
    if style == "extreme":
        weights = np.logspace(-12, 0, count)
        if rng.random() < 0.5:
            weights = np.full(count, 1e-9 / count)
            weights[rng.integers(0, count)] = 1.0
        return rng.permutation(weights)
    if style == "equal":
        return np.full(count, 1.0 / count)
    return rng.uniform(0.01, 1.0, count)


# Every pair of settings meets in some case (tests/covering.py); the nightly run three times.
WEIGHTED_DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "datasets": ("few", "many"),
    "split": tuple(SPLITS),
    "weights": ("random", "tiny", "near-tie", "extreme", "equal"),
    "sizes": ("small", "large"),
    # megatron-core refuses extreme weights at 0.005 (its members are sized weight x size x
    # 1.005, and the dominant one is oversampled): tests/test_megatron_configs.py compares
    # that refusal; here the blends are built
    "mid_level_dataset_surplus": (0.1, 0.5),
}
WEIGHTED_CASES = pairwise_cases(WEIGHTED_DIMENSIONS, seed=5, repeat=3 if NIGHTLY else 1)
WEIGHTED_COVERAGE = suite("builder weighted blends (test_builder_megatron)", WEIGHTED_DIMENSIONS)
UNWEIGHTED_DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "datasets": ("one", "few"),
    "split": tuple(SPLITS),
    "train size": ("count", "one epoch"),
    "test size": ("count", "one epoch"),
}
UNWEIGHTED_CASES = pairwise_cases(UNWEIGHTED_DIMENSIONS, seed=6, repeat=3 if NIGHTLY else 1)
UNWEIGHTED_COVERAGE = suite(
    "builder unweighted blends (test_builder_megatron)", UNWEIGHTED_DIMENSIONS
)


def builder_outcome(theirs: list[Any]) -> str:
    if not theirs:
        return "refused"
    return "compared" if any(d is not None and len(d) for d in theirs) else "empty"


def test_builder_cases_cover_every_pair() -> None:
    for dimensions, cases in (
        (WEIGHTED_DIMENSIONS, WEIGHTED_CASES),
        (UNWEIGHTED_DIMENSIONS, UNWEIGHTED_CASES),
    ):
        covered = set().union(*(pairs_of(case, dimensions) for case in cases))
        assert covered == all_pairs(dimensions)


@pytest.mark.parametrize("case", range(len(WEIGHTED_CASES)))
def test_weighted_blends_match_megatron(tmp_path: Path, case: int) -> None:
    """A refusal by both (megatron-core oversamples a member of an extreme blend) is compared
    and counted; the case's shards, weights and sizes are then drawn again (its design
    settings kept), so its pairs are reached by a comparison."""
    drawn = WEIGHTED_CASES[case]
    for draw in range(6):
        rng = np.random.default_rng(case + 1000 * draw)
        root = tmp_path / f"draw{draw}"
        root.mkdir()
        count = int(rng.integers(2, 8)) if drawn["datasets"] == "few" else int(rng.integers(20, 41))
        split = drawn["split"]
        # "969,30,1" gives the test split 1/1000 of the documents: 3000 give every member's
        # test split tokens for a sample, however small its weight
        prefixes = shards(root, rng, count, 3000 if split == "969,30,1" else None)
        weights = blend_weights(drawn["weights"], count, rng)
        sizes: list[int | None] = (
            [int(rng.integers(50, 400)), int(rng.integers(5, 60)), int(rng.integers(1, 20))]
            if drawn["sizes"] == "small"
            else [
                int(rng.integers(2000, 6000)),
                int(rng.integers(100, 400)),
                int(rng.integers(20, 80)),
            ]
        )
        ours, theirs = build_both(
            root,
            sizes,
            blend=(prefixes, weights.tolist()),
            split=split,
            mid_level_dataset_surplus=drawn["mid_level_dataset_surplus"],
        )
        WEIGHTED_COVERAGE.record(case, drawn, builder_outcome(theirs), draw)
        if theirs:
            break
    for i, (mine, reference) in enumerate(zip(ours, theirs)):
        compare_datasets(mine, reference, rng, f"split {i} {drawn}")
    if theirs:
        assert_same_cache_files(root)


@pytest.mark.parametrize("case", range(len(UNWEIGHTED_CASES)))
def test_unweighted_blends_match_megatron(tmp_path: Path, case: int) -> None:
    drawn = UNWEIGHTED_CASES[case]
    rng = np.random.default_rng(100 + case)
    count = 1 if drawn["datasets"] == "one" else int(rng.integers(2, 6))
    split = drawn["split"]
    prefixes = shards(tmp_path, rng, count, 1000 if split == "969,30,1" else None)
    sizes: list[int | None] = [
        None if drawn["train size"] == "one epoch" else int(rng.integers(10, 500)),
        None,
        None if drawn["test size"] == "one epoch" else int(rng.integers(1, 30)),
    ]
    ours, theirs = build_both(tmp_path, sizes, blend=(prefixes, None), split=split)
    for i, (mine, reference) in enumerate(zip(ours, theirs)):
        compare_datasets(mine, reference, rng, f"split {i} {drawn}")
    if theirs:
        assert_same_cache_files(tmp_path)
    UNWEIGHTED_COVERAGE.record(case, drawn, builder_outcome(theirs))


@pytest.mark.parametrize("case", range(6))
def test_blend_per_split_matches_megatron(tmp_path: Path, case: int) -> None:
    rng = np.random.default_rng(200 + case)
    prefixes = shards(tmp_path, rng, 6)
    train = (prefixes[:3], rng.uniform(0.1, 1, 3).tolist())
    valid = (prefixes[3:5], None)
    test = (prefixes[5:], None) if case % 2 else None
    sizes: list[int | None] = [int(rng.integers(50, 300)), int(rng.integers(5, 50)), 7]
    fields: dict[str, Any] = {"blend_per_split": [train, valid, test]}
    if case >= 3:
        fields["multiple_validation_sets"] = True
        if case == 5:
            fields["full_validation"] = True
            sizes[1] = None
    ours, theirs = build_both(tmp_path, sizes, **fields)
    for i, (mine, reference) in enumerate(zip(ours, theirs)):
        compare_datasets(mine, reference, rng, f"split {i}")
    if theirs:
        assert_same_cache_files(tmp_path)


def test_mock_splits_match_megatron(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    ours, theirs = build_both(tmp_path, [300, 40, 20])
    for i, (mine, reference) in enumerate(zip(ours, theirs)):
        compare_datasets(mine, reference, rng, f"split {i}")


def test_oversampling_raises_index_error_like_megatron(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    prefixes = shards(tmp_path, rng, 3)
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=31,
        tokenizer=TinyTokenizer(),
        blend=(prefixes, None),
        split="1",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    members = (
        BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config)
        .build()[0]
        .datasets
    )
    with pytest.raises(IndexError, match="oversamples dataset"):
        BlendedDataset(members, [1.0, 1.0, 1.0], 10 * sum(len(m) for m in members), config)


@pytest.mark.parametrize(
    "split", ["969,30,1", "98/2/0", "1", "0.9 0.1", "1,1,1", "0,0,1", "3 5", "0.5,0.25,0.25"]
)
def test_split_helpers_match_megatron(split: str) -> None:
    vector = utils.parse_and_normalize_split(split)
    assert vector == megatron_config.parse_and_normalize_split(split)
    assert utils.convert_split_vector_to_split_matrix(
        vector
    ) == megatron_config.convert_split_vector_to_split_matrix(vector)
    other = utils.parse_and_normalize_split("98,1,1")
    assert utils.convert_split_vector_to_split_matrix(
        vector, other
    ) == megatron_config.convert_split_vector_to_split_matrix(vector, other)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), min_size=1, max_size=12))
def test_split_document_ids_are_the_aranges_megatron_makes(bounds: list[tuple[int, int]]) -> None:
    """Each split's ids equal megatron's ``numpy.arange(begin, end, dtype=int32)``, and stay
    equal while later, longer requests replace the shared counting array they view."""
    made = []
    for begin, length in bounds:
        ids = utils.split_document_ids(begin, begin + length)
        assert ids.dtype == np.int32 and not ids.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            ids[:1] = 7
        made.append((begin, begin + length, ids))
    for begin, end, ids in made:
        np.testing.assert_array_equal(ids, np.arange(begin, end, dtype=np.int32))


@pytest.mark.parametrize(
    "blend",
    [
        None,
        ["a", "b", "c"],
        ["30", "a", "70", "b"],
        ["a", "b"],
        ["30", "a", "b", "c"],
        [" 1", " a ", "2", "b "],
    ],
)
def test_get_blend_from_list_matches_megatron(blend: list[str] | None) -> None:
    assert utils.get_blend_from_list(blend) == megatron_utils.get_blend_from_list(blend)
