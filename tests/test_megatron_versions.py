"""tokenmill follows the installed megatron-core's hook contracts (run this file in each
version's venv: `.ci/megatron-matrix`). A subclass written against the installed release's
`_query_document_sample_shuffle_indices` (2 values before 0.19, 3 from 0.19) behaves as on
stock megatron-core."""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokenmill
from tokenmill.common import megatron_version
from tokenmill.megatron import MODULES

from conftest import TinyTokenizer, random_documents, write_megatron_shard
from megatron_compare import assert_same_sample, cache_files

pytestmark = pytest.mark.megatron

with warnings.catch_warnings():  # megatron-core's imports warn about torch deprecations
    warnings.simplefilter("ignore")
    THEIRS = {
        name: importlib.import_module(f"megatron.core.datasets.{name}")
        for name in ("gpt_dataset", "indexed_dataset", "utils", "blended_megatron_dataset_builder")
    }
OURS = {name: importlib.import_module(f"tokenmill.megatron.{name}") for name in MODULES}
INSTALLED = tuple(int(part) for part in importlib.metadata.version("megatron-core").split(".")[:2])


@pytest.fixture(autouse=True)
def _follow_installed() -> Iterator[None]:
    """What `patch_megatron()` does at patch time (the patch itself would make megatron's own
    modules, the oracle here, import tokenmill's)."""
    megatron_version.follow_installed()
    yield
    megatron_version._followed = None


def test_the_installed_release_is_followed() -> None:
    assert megatron_version.followed() == INSTALLED
    assert megatron_version.query_returns_lengths() == (INSTALLED >= (0, 19))


class ReversedText:
    """Overrides the query hook as the installed release defines it: unpacks what super()
    returns (2 or 3 values) and returns the same arity."""

    def _query_document_sample_shuffle_indices(self, idx: int) -> Any:
        queried = super()._query_document_sample_shuffle_indices(idx)  # type: ignore[misc]
        assert len(queried) == (3 if INSTALLED >= (0, 19) else 2)
        return (queried[0][::-1].copy(), *queried[1:])


class Unchanged:
    """A subclass that overrides nothing."""


@pytest.mark.parametrize("mixin", [ReversedText, Unchanged])
def test_a_subclass_of_the_installed_release_behaves_as_on_stock(
    tmp_path: Path, mixin: type
) -> None:
    rng = np.random.default_rng(11)
    prefix = write_megatron_shard(tmp_path / "shard", random_documents(rng, 60, 120))
    fields = {
        "random_seed": 5, "sequence_length": 32, "tokenizer": TinyTokenizer(),
        "blend": ([prefix], None), "split": "1", "reset_position_ids": False,
        "reset_attention_mask": False, "eod_mask_loss": False,
    }  # fmt: skip
    indices = np.arange(60, dtype=np.int32)
    theirs = type("InHouse", (mixin, THEIRS["gpt_dataset"].GPTDataset), {})(
        THEIRS["indexed_dataset"].IndexedDataset(prefix), prefix, indices, 80,
        THEIRS["utils"].Split.train,
        THEIRS["gpt_dataset"].GPTDatasetConfig(path_to_cache=str(tmp_path / "m"), **fields),
    )  # fmt: skip
    ours = type("InHouse", (mixin, OURS["gpt_dataset"].GPTDataset), {})(
        OURS["indexed_dataset"].IndexedDataset(prefix), prefix, indices, 80,
        OURS["utils"].Split.train,
        OURS["gpt_dataset"].GPTDatasetConfig(path_to_cache=str(tmp_path / "t"), **fields),
    )  # fmt: skip
    assert len(ours) == len(theirs)
    for idx in range(len(ours)):
        assert_same_sample(ours[idx], theirs[idx], f"sample {idx}")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(
        p.name for p in (tmp_path / "t").iterdir() if not p.name.endswith(".json")
    )


def test_a_blend_cache_miss_without_a_process_group(tmp_path: Path) -> None:
    """megatron-core 0.16 and 0.17's BlendedDataset calls `torch.distributed.get_rank()` on a
    cache miss, which raises without a process group (0.18 asks `is_initialized()` first).
    tokenmill builds there on every release (docs/megatron.md, "Versions"); stock 0.16 / 0.17
    then reads tokenmill's cache (a hit asks no rank) and serves the same samples, and from 0.18
    stock builds the same cache files itself."""
    import torch

    assert not torch.distributed.is_initialized()
    rng = np.random.default_rng(12)
    prefixes = [
        write_megatron_shard(tmp_path / f"shard{n}", random_documents(rng, 40, 90)) for n in (0, 1)
    ]
    fields = {
        "random_seed": 9, "sequence_length": 16, "tokenizer": TinyTokenizer(),
        "blend": (prefixes, [0.3, 0.7]), "split": "8,2,0", "reset_position_ids": False,
        "reset_attention_mask": False, "eod_mask_loss": False, "create_attention_mask": False,
    }  # fmt: skip
    sizes = [120, 30, 0]
    ours = tokenmill.BlendedMegatronDatasetBuilder(
        OURS["gpt_dataset"].GPTDataset, sizes, lambda: True,
        OURS["gpt_dataset"].GPTDatasetConfig(path_to_cache=str(tmp_path / "t"), **fields),
    ).build()  # fmt: skip

    def stock(cache: Path) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return THEIRS["blended_megatron_dataset_builder"].BlendedMegatronDatasetBuilder(
                THEIRS["gpt_dataset"].GPTDataset, sizes, lambda: True,
                THEIRS["gpt_dataset"].GPTDatasetConfig(path_to_cache=str(cache), **fields),
            ).build()  # fmt: skip

    if INSTALLED < (0, 18):
        with pytest.raises(ValueError, match="process group"):
            stock(tmp_path / "m")
        theirs = stock(tmp_path / "t")  # tokenmill's cache: a hit on every entry
    else:
        theirs = stock(tmp_path / "m")
        assert cache_files(tmp_path / "m") == cache_files(tmp_path / "t")
    for mine, reference in zip(ours[:2], theirs[:2]):
        assert type(mine).__name__ == type(reference).__name__ == "BlendedDataset"
        assert len(mine) == len(reference)
        for idx in range(len(reference)):
            assert_same_sample(mine[idx], reference[idx], f"sample {idx}")


def test_mains_varlen_sbhd_validation_excludes_hybrid_context_parallel() -> None:
    """Megatron-LM main asserts it; tokenmill refuses it on every release (the field is
    main's)."""
    with pytest.raises(AssertionError, match="hybrid_context_parallel"):
        OURS["gpt_dataset"].GPTDatasetConfig(
            random_seed=1, sequence_length=4, tokenizer=TinyTokenizer(),
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            varlen_sbhd_validation=True, hybrid_context_parallel=True,
        )  # fmt: skip
    assert isinstance(tokenmill.MegatronAssertionError("x"), ValueError)
