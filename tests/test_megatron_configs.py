"""Every config path of BlendedMegatronDatasetBuilder against the installed megatron-core.

Cases come from a covering design (tests/covering.py): every pair of settings of the form of the
blend (one prefix, weighted or unweighted blends, blend_per_split with any mix of single,
weighted, unweighted and absent splits, multiple_validation_sets with and without
full_validation, mock data), the corpora (including ones so small that "98,2,0" or "969,30,1"
give a split no documents), the split string, the size of every split (an int, 0 or None), the
seed, the sequence length, all seven sample flags, mid_level_dataset_surplus,
num_dataset_builder_threads, mmap_bin_files, the vocabulary (int32 shards and token_dtype_code 4
above 65536), the tokenizer's pad / special_tokens_dict / eos, and sequences_per_dataset read
back from the JSON file Megatron-LM's tools/build_sequences_per_dataset.py writes.

Both libraries build with their own cache directory and must give the same result: the same
datasets (class, length, description and hash, arrays, samples) and byte-identical cache files;
where megatron-core refuses a case, tokenmill must refuse it too, in the same exception family
and with the same normalised message (megatron_compare.assert_same_refusal). Then every
fast path reloads each library's caches with the other library: `defer_npy_index_mmap`,
`fast_cache_load` (blend_per_split and mock only, as megatron requires) and both, compared the
same way.

The run prints the pairs its compared cases reached (refusals and empty results counted apart);
TOKENMILL_DIFFERENTIAL=nightly runs three designs (its report: tests/reports/).

Per release: the file runs in each supported megatron-core's venv (0.19.2 in the main suite,
0.16.1 in .ci/run's version stage, every release in .ci/megatron-matrix), tokenmill following
the installed release as `patch_megatron()` makes it. A drawn flag the installed release's
GPTDatasetConfig does not have (`inter_document_masking` before 0.19) is left out of both
libraries' configs (and recorded as its default). megatron-core 0.16 and 0.17's BlendedDataset
asks `torch.distributed.get_rank()` on a cache miss, so there the cases run in a one-rank gloo
process group, as a Megatron-LM job does (without one, stock raises and tokenmill builds: the
documented difference, tests/test_megatron_versions.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from covering import NIGHTLY, all_pairs, pairs_of, pairwise_cases, suite

from conftest import random_documents, write_megatron_shard
from megatron_compare import (
    assert_same_refusal,
    cache_files,
    compare_results,
    one_rank_process_group,
    stock_needs_a_process_group,
)
from oracles import import_oracle

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning"),
]

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    megatron_builder = import_oracle("megatron.core.datasets.blended_megatron_dataset_builder")
    megatron_gpt = import_oracle("megatron.core.datasets.gpt_dataset")

from tokenmill.common import megatron_version
from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig, MockGPTDataset
from tokenmill.datasets.utils import parse_and_normalize_split
from tokenmill.megatron.indexed_dataset import _IndexReader

INSTALLED = megatron_version._parse(importlib.metadata.version("megatron-core"))
# The fields of the installed release's GPTDatasetConfig: a drawn flag it lacks is left out.
MEGATRON_FIELDS = frozenset(item.name for item in dataclasses.fields(megatron_gpt.GPTDatasetConfig))
# megatron-core 0.16 and 0.17's BlendedDataset ask torch.distributed.get_rank() on a cache miss
NEEDS_PROCESS_GROUP = stock_needs_a_process_group(INSTALLED)


@pytest.fixture(scope="module", autouse=True)
def _as_a_megatron_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """tokenmill follows the installed release (what `patch_megatron()` does at patch time; the
    patch itself would make the oracle's modules tokenmill's), and on 0.16 and 0.17 both run in
    a one-rank gloo process group."""
    megatron_version.follow_installed()
    with contextlib.ExitStack() as stack:
        if NEEDS_PROCESS_GROUP:
            stack.enter_context(one_rank_process_group(tmp_path_factory.mktemp("process-group")))
        yield
    megatron_version._followed = None


FLAGS = (
    "reset_position_ids",
    "reset_attention_mask",
    "eod_mask_loss",
    "create_attention_mask",
    "add_extra_token_to_sequence",
    "drop_last_partial_validation_sequence",
    "inter_document_masking",
)
SPLITS = ("969,30,1", "98,2,0", "1", "0.9 0.1", "80,10,10", "7/2/1", "1,1,1", "0,0,1", "3 5")
FORMS = ("single", "weighted", "unweighted", "per-split", "multiple-validation", "mock")
PER_SPLIT_KINDS = ("none", "single", "weighted", "unweighted")
# Every pair of settings of these dimensions meets in at least one case of the CI set
# (tests/covering.py); TOKENMILL_DIFFERENTIAL=nightly meets every pair three times. The split
# string, the corpora and the weights are drawn from each case's own generator.
CONFIG_DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "form": FORMS,
    **{name: (False, True) for name in FLAGS},
    "vocab": (1000, 70000),
    "pad": (None, 3, 0, 7),
    "special_tokens_dict": (False, True),
    "eos": (False, True),
    "sequence_length": (1, 3, 16, 64, 255),
    "mid_level_dataset_surplus": (0.0, 0.005, 0.2, 1.0),
    "num_dataset_builder_threads": (1, 2, 3),
    "mmap_bin_files": (False, True),
    "sizes": ("count", "zero", "mixed"),
    "sequences_per_dataset": (False, True),
}
CONFIG_CASES = pairwise_cases(CONFIG_DIMENSIONS, seed=3, repeat=3 if NIGHTLY else 1)
CONFIG_COVERAGE = suite("builder configs (test_megatron_configs)", CONFIG_DIMENSIONS)
# Weighted cases drawn again with a split of size None: megatron-core refuses them, and so must
# tokenmill (the refusals compared, counted apart).
REFUSAL_CASES = [n for n, drawn in enumerate(CONFIG_CASES) if drawn["form"] == "weighted"][:3]


class Tokenizer:
    """The attributes megatron's datasets read; pad / special tokens / eos only when given."""

    def __init__(
        self, vocab_size: int, pad: int | None, special: dict[str, int] | None, eos: int | None
    ) -> None:
        self.vocab_size = vocab_size
        self.eod = 0
        if pad is not None:
            self.pad = pad
        if special is not None:
            self.special_tokens_dict = special
        if eos is not None:
            self.eos = eos
        self.unique_identifiers = {"class": "Tokenizer", "vocab_size": vocab_size, "pad": pad}


def split_bounds(split: str, documents: int) -> list[tuple[int, int] | None]:
    from tokenmill.datasets.utils import convert_split_vector_to_split_matrix

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [
        None
        if bookends is None
        else (int(round(bookends[0] * documents)), int(round(bookends[1] * documents)))
        for bookends in matrix
    ]


class Case:
    """One drawn configuration: the config fields, sizes and prefixes of both libraries."""

    def __init__(self, case: int, tmp_path: Path, refuse: bool = False, draw: int = 0) -> None:
        drawn = CONFIG_CASES[case]
        self.drawn = drawn
        self.refuse = refuse  # a weighted blend with a split of size None: refused by both
        rng = np.random.default_rng(7000 + case + 100_000 * draw)
        self.rng = rng
        self.form = drawn["form"]
        self.size_kind = drawn["sizes"]
        vocab = drawn["vocab"]
        self.token_dtype = np.int32 if vocab > 65536 else np.uint16
        tokenizer = Tokenizer(
            vocab,
            pad=drawn["pad"],  # 0 collides with EOD
            special={"eos_token": 7, "pad_token": 3} if drawn["special_tokens_dict"] else None,
            eos=7 if drawn["eos"] else None,
        )
        # flags of the installed release only; what was run is recorded (an absent flag at its
        # default, False), so the coverage report counts only the pairs this release reached
        flags = {name: drawn[name] for name in FLAGS if name in MEGATRON_FIELDS}
        self.recorded = {**drawn, **{name: False for name in FLAGS if name not in flags}}
        self.fields: dict[str, Any] = {
            "random_seed": int(rng.integers(0, 2**32)),
            "sequence_length": drawn["sequence_length"],
            "tokenizer": tokenizer,
            "mid_level_dataset_surplus": drawn["mid_level_dataset_surplus"],
            "num_dataset_builder_threads": drawn["num_dataset_builder_threads"],
            "mmap_bin_files": drawn["mmap_bin_files"],
            **flags,
        }
        self.prefixes: list[str] = []
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.tmp_path = tmp_path
        self.sizes: list[int | None] = [None, None, None]
        self._draw_form(rng)
        self.sequences_json = self.form != "mock" and drawn["sequences_per_dataset"]
        if self.sequences_json:
            self.fields["sequences_per_dataset"] = self._sequences_per_dataset()

    def _shard(self, documents: int) -> str:
        rng = self.rng
        vocab = self.fields["tokenizer"].vocab_size
        prefix = self.tmp_path / f"shard{len(self.prefixes)}"
        texts = random_documents(rng, documents, int(rng.choice([5, 40, 300])), vocab_size=vocab)
        for text in texts[:: int(rng.integers(3, 9))]:
            text[len(text) // 2] = 3  # real pad ids inside documents
        self.prefixes.append(write_megatron_shard(prefix, texts, self.token_dtype))
        return self.prefixes[-1]

    def _size(self, weighted: bool, may_be_empty: bool) -> int | None:
        """A split size of the case's kind: "count" (a number of samples), "zero" (0 where
        the blend allows, else a count: megatron-core refuses a blend with every size 0) or
        "mixed" (each split a count, 0 or, unweighted, None: one epoch). A split that may get
        no documents gets 0 when weighted (megatron builds nothing there), else None
        (megatron-core loops forever drawing samples from a split without tokens; see
        test_megatron_compat.py); weighted blends need a size for every split, so they never
        get None (that refusal has its own cases: REFUSAL_CASES)."""
        rng = self.rng
        if may_be_empty:
            return 0 if weighted else None
        kind = self.size_kind
        if kind == "mixed":
            kind = ["count", "zero", "count", "none"][int(rng.integers(4 if not weighted else 3))]
        if kind == "zero" and rng.random() < 0.5:
            return 0
        if kind == "none":
            return None
        return int(rng.integers(1, 300)) if rng.random() < 0.5 else int(rng.integers(300, 900))

    def _blend(self, count: int, weighted: bool, documents: int) -> tuple[list[str], Any]:
        prefixes = [self._shard(documents) for _ in range(count)]
        if not weighted:
            return prefixes, None
        weights = self.rng.uniform(0.05, 1.0, count)
        if self.rng.random() < 0.3:
            return prefixes, [int(w * 10) + 1 for w in weights]  # integer weights
        return prefixes, weights.tolist()

    def _draw_form(self, rng: np.random.Generator) -> None:
        form = self.form
        if form == "mock":
            # megatron's mock corpus is 100 000 documents of up to 4096 tokens: keep S large so
            # a one-epoch split stays small
            self.cls = "mock"
            # megatron's mock corpus is 100 000 documents of up to 4096 tokens: a short sequence
            # is 10^8 samples per epoch (gigabytes of index), so mock data always runs at 1024
            # (the one dimension a mock case does not take from the design); sizes are counts
            self.fields["sequence_length"] = 1024
            self.sizes = [
                int(rng.integers(1, 200)),
                int(rng.integers(0, 40)),
                int(rng.integers(1, 9)),
            ]
            return
        self.cls = "gpt"
        if form in ("single", "weighted", "unweighted"):
            weighted = form == "weighted"
            count = 1 if form == "single" else int(rng.integers(2, 6))
            # small corpora give some splits no documents (only for one-epoch sizes, see _size);
            # a weighted blend needs a size for every split, so its splits all get documents
            documents = int(rng.choice([3, 20, 60, 150])) if not weighted else 150
            while True:
                split = SPLITS[int(rng.integers(len(SPLITS)))]
                bounds = split_bounds(split, documents)
                if not weighted or all(b is None or b[1] - b[0] >= 2 for b in bounds):
                    break
            self.fields["split"] = split
            self.fields["blend"] = self._blend(count, weighted, documents)
            # a split without a share gets 0 in a weighted blend (megatron refuses None there:
            # weights need a size), else None
            self.sizes = [
                (0 if weighted else None)
                if bookends is None
                else self._size(weighted, may_be_empty=bookends[1] - bookends[0] < 2)
                for bookends in bounds
            ]
            if self.refuse:
                self.sizes[int(rng.integers(3))] = None  # refused by both (weights need a size)
            return
        per_split: list[Any] = []
        kinds = [PER_SPLIT_KINDS[int(rng.integers(len(PER_SPLIT_KINDS)))] for _ in range(3)]
        if all(kind == "none" for kind in kinds):
            kinds[0] = "single"
        if form == "multiple-validation":
            kinds[1] = "unweighted"
            self.fields["multiple_validation_sets"] = True
            if rng.random() < 0.5:
                self.fields["full_validation"] = True
        for split, kind in enumerate(kinds):
            if kind == "none":
                per_split.append(None)
                self.sizes[split] = int(rng.integers(0, 50))
                continue
            weighted = kind == "weighted"
            count = 1 if kind == "single" else int(rng.integers(2, 5))
            per_split.append(self._blend(count, weighted, int(rng.choice([20, 60, 150]))))
            self.sizes[split] = self._size(weighted, may_be_empty=False)
        if self.fields.get("full_validation"):
            self.sizes[1] = None
        self.fields["blend_per_split"] = per_split

    def _sequences_per_dataset(self) -> dict[str, Any]:
        """What tools/build_sequences_per_dataset.py writes: prefix -> (sequences, documents)
        from each `.idx` header, through a JSON file."""
        counts = {}
        for prefix in self.prefixes:
            reader = _IndexReader(prefix + ".idx", False)
            counts[prefix] = (reader.sequence_count, reader.document_count)
        path = self.tmp_path / "sequences_per_dataset.json"
        path.write_text(json.dumps(counts))
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded

    def build(self, library: str, cache: Path, **overrides: Any) -> tuple[list[Any] | None, Any]:
        """(datasets, None) or (None, the exception) for one library."""
        fields = {**self.fields, "path_to_cache": str(cache), **overrides}
        if library == "megatron":
            config_type: Any = megatron_gpt.GPTDatasetConfig
            builder_type: Any = megatron_builder.BlendedMegatronDatasetBuilder
            cls = megatron_gpt.MockGPTDataset if self.cls == "mock" else megatron_gpt.GPTDataset
        else:
            config_type, builder_type = GPTDatasetConfig, BlendedMegatronDatasetBuilder
            cls = MockGPTDataset if self.cls == "mock" else GPTDataset
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = config_type(**fields)
                return builder_type(cls, list(self.sizes), lambda: True, config).build(), None
        except Exception as error:  # compared below: both libraries must refuse alike
            return None, error

    def describe(self) -> str:
        shown = {k: v for k, v in self.fields.items() if k not in ("tokenizer",)}
        return f"form={self.form} sizes={self.sizes} {shown}"


def run_both(case: Case, name: str, **overrides: Any) -> tuple[Any, Any]:
    theirs, their_error = case.build("megatron", case.tmp_path / f"{name}-megatron", **overrides)
    ours, our_error = case.build("tokenmill", case.tmp_path / f"{name}-tokenmill", **overrides)
    where = f"{name}: {case.describe()}"
    if their_error is not None:
        assert_same_refusal(our_error, their_error, where)
        return None, None
    assert our_error is None, f"{where}: tokenmill raised {our_error!r}, megatron-core did not"
    compare_results(ours, theirs, case.rng, where)
    return ours, theirs


def all_empty(result: list[Any]) -> bool:
    """No split built a dataset with a sample (None, or every dataset of length 0)."""

    def empty(dataset: Any) -> bool:
        if dataset is None:
            return True
        if isinstance(dataset, list):
            return all(map(empty, dataset))
        return len(dataset) == 0

    return all(map(empty, result))


# Draws of a case's corpora, seed and weights (its design settings kept) before it gives up:
# a refusal by both (tiny corpora give a member no samples) is compared and counted, then the
# case is drawn again, so the design's pairs are reached by comparisons.
DRAWS = 6


@pytest.mark.parametrize("case", range(len(CONFIG_CASES)))
def test_config_paths_match_megatron(tmp_path: Path, case: int) -> None:
    for draw in range(DRAWS):
        drawn = Case(case, tmp_path / f"draw{draw}", draw=draw)
        _, theirs = run_both(drawn, "build")
        if theirs is not None:
            break
        CONFIG_COVERAGE.record(case, drawn.recorded, "refused", draw)
    else:
        return
    tmp_path = drawn.tmp_path
    megatron_files = cache_files(tmp_path / "build-megatron")
    tokenmill_files = cache_files(tmp_path / "build-tokenmill")
    assert tokenmill_files == megatron_files, drawn.describe()

    # Fast paths over the caches each library wrote, read by the other library.
    modes: list[dict[str, bool]] = [{"defer_npy_index_mmap": True}]
    if drawn.fields.get("blend") is None:
        modes += [
            {"fast_cache_load": True},
            {"fast_cache_load": True, "defer_npy_index_mmap": True},
        ]
    for number, mode in enumerate(modes):
        crossed = tmp_path / f"fast{number}"
        shutil.copytree(tmp_path / "build-megatron", crossed / "for-tokenmill")
        shutil.copytree(tmp_path / "build-tokenmill", crossed / "for-megatron")
        theirs_fast, their_error = drawn.build("megatron", crossed / "for-megatron", **mode)
        ours_fast, our_error = drawn.build("tokenmill", crossed / "for-tokenmill", **mode)
        where = f"{mode}: {drawn.describe()}"
        if their_error is not None:
            assert_same_refusal(our_error, their_error, where)
            continue
        assert our_error is None, f"{where}: tokenmill raised {our_error!r}"
        compare_results(ours_fast, theirs_fast, drawn.rng, where)
    outcome = "empty" if all_empty(theirs) else "compared"
    CONFIG_COVERAGE.record(case, drawn.recorded, outcome, draw)


@pytest.mark.parametrize("case", REFUSAL_CASES)
def test_weighted_blend_without_a_size_is_refused_like_megatron(tmp_path: Path, case: int) -> None:
    drawn = Case(case, tmp_path, refuse=True)
    _, theirs = run_both(drawn, "build")
    assert theirs is None, f"megatron-core built {drawn.describe()}"


def test_config_cases_cover_every_pair() -> None:
    covered = set().union(*(pairs_of(case, CONFIG_DIMENSIONS) for case in CONFIG_CASES))
    assert covered == all_pairs(CONFIG_DIMENSIONS)
    assert REFUSAL_CASES
