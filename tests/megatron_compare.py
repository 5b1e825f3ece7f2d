"""Helpers that compare tokenmill's datasets with megatron-core's (used by the differential tests).

`compare_results` walks the `build()` result of both builders (None, a dataset, or a list of
validation datasets) and checks every observable: class name, length, description and hash,
index arrays (dtype and values), and samples (all of them for short datasets, else a seeded
random subset plus the first, the last and the padding sample). megatron-core's mask cache is
turned off before any sample is read (`disable_mask_cache`): megatron-core 0.19 writes the first
sample's pad positions into its cached loss mask, so later samples depend on which one was read
first (the difference tokenmill documents; see test_megatron_compat.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch


def disable_mask_cache(dataset: Any) -> None:
    """Turn megatron-core's loss-mask/position cache off on `dataset` and every member."""
    if dataset is None:
        return
    if isinstance(dataset, list):
        for item in dataset:
            disable_mask_cache(item)
        return
    if hasattr(dataset, "masks_and_position_ids_are_cacheable"):
        dataset.masks_and_position_ids_are_cacheable = False
    for member in getattr(dataset, "datasets", []) or []:
        disable_mask_cache(member)


def array_names(dataset: Any) -> tuple[str, ...]:
    if hasattr(dataset, "dataset_index") and hasattr(dataset, "datasets"):
        return ("dataset_index", "dataset_sample_index")
    return ("document_index", "sample_index", "shuffle_index")


def assert_same_sample(ours: Any, theirs: Any, where: str) -> None:
    """Same keys in the same order, same dtype, shape and values (numpy scalars compared as
    numpy, tensors as tensors)."""
    assert list(ours) == list(theirs), f"{where}: keys {list(ours)} != {list(theirs)}"
    for key in theirs:
        mine, reference = ours[key], theirs[key]
        if isinstance(reference, torch.Tensor):
            assert isinstance(mine, torch.Tensor), f"{where} {key}: {type(mine)}"
            assert mine.dtype == reference.dtype, f"{where} {key}: {mine.dtype} {reference.dtype}"
            assert mine.shape == reference.shape, f"{where} {key}: {mine.shape} {reference.shape}"
            assert torch.equal(mine, reference), f"{where} {key}"
        else:
            assert np.asarray(mine).dtype == np.asarray(reference).dtype, f"{where} {key}"
            assert np.array_equal(np.asarray(mine), np.asarray(reference)), f"{where} {key}"


def same_outcome(theirs: Any, ours: Any, where: str) -> Any:
    """Run megatron-core's call, then tokenmill's: both raise the same exception type (None is
    returned), or both return (megatron's value, or the pair for samples)."""
    try:
        expected = theirs()
    except RuntimeError as error:
        if "expanded size" not in str(error):
            raise
        # megatron-core cannot pad cu_seqlens when a sample has more (empty) document parts
        # than tokens (inter_document_masking); tokenmill drops the empty parts instead (a
        # documented difference): the sample must be valid
        sample = ours()
        cu_seqlens = sample["cu_seqlens"]
        assert int(cu_seqlens[-1]) == cu_seqlens.shape[-1] - 1, where
        assert bool((cu_seqlens[1:] >= cu_seqlens[:-1]).all()), where
        return None
    except Exception as error:
        with pytest.raises(type(error)):
            ours()
        return None
    try:
        found = ours()
    except Exception as error:
        raise AssertionError(
            f"{where}: tokenmill raised {error!r}, megatron-core did not"
        ) from error
    if isinstance(expected, int):
        assert found == expected, f"{where}: {found} != {expected}"
        return expected
    return (expected, found)


def sample_indices(length: int, rng: np.random.Generator, limit: int) -> list[int | None]:
    """Every index of a short dataset, else `limit` random ones, the first and the last."""
    if length <= limit:
        indices: list[int | None] = list(range(length))
    else:
        indices = [0, *rng.integers(0, length, limit).tolist(), length - 1]
    return indices


def compare_datasets(
    ours: Any,
    theirs: Any,
    rng: np.random.Generator,
    where: str,
    *,
    limit: int = 24,
    padding_sample: bool = True,
) -> None:
    """Everything observable about one dataset (or a list of them) of each library."""
    if theirs is None:
        assert ours is None, f"{where}: tokenmill built {type(ours).__name__}, megatron None"
        return
    if isinstance(theirs, list):
        assert isinstance(ours, list), where
        assert len(ours) == len(theirs), where
        for number, (mine, reference) in enumerate(zip(ours, theirs)):
            compare_datasets(mine, reference, rng, f"{where}[{number}]", limit=limit)
        return
    assert type(ours).__name__ == type(theirs).__name__, where
    assert ours.unique_description == theirs.unique_description, where
    assert ours.unique_description_hash == theirs.unique_description_hash, where
    length = same_outcome(lambda: len(theirs), lambda: len(ours), f"{where} len")
    if length is None:
        return
    disable_mask_cache(theirs)
    indices = sample_indices(length, rng, limit)
    if padding_sample and length and not hasattr(theirs, "datasets"):
        indices.append(None)
    for idx in indices:
        pair = same_outcome(
            lambda idx=idx: theirs[idx], lambda idx=idx: ours[idx], f"{where} sample {idx}"
        )
        if pair is not None:
            assert_same_sample(pair[1], pair[0], f"{where} sample {idx}")
    for name in array_names(theirs):  # after the samples: deferred arrays are mapped by now
        mine, reference = getattr(ours, name), getattr(theirs, name)
        if reference is None:
            continue
        mine, reference = np.asarray(mine), np.asarray(reference)
        assert mine.dtype == reference.dtype, f"{where} {name}: {mine.dtype} {reference.dtype}"
        np.testing.assert_array_equal(mine, reference, err_msg=f"{where} {name}")
    if hasattr(theirs, "datasets"):
        for number, (mine, reference) in enumerate(zip(ours.datasets, theirs.datasets)):
            assert len(mine) == len(reference), f"{where} member {number}"
            assert mine.unique_description == reference.unique_description, where


def compare_results(
    ours: list[Any], theirs: list[Any], rng: np.random.Generator, where: str
) -> None:
    assert len(ours) == len(theirs) == 3, where
    for split, (mine, reference) in enumerate(zip(ours, theirs)):
        compare_datasets(mine, reference, rng, f"{where} split {split}")


def cache_files(directory: Path) -> dict[str, bytes]:
    """megatron-core's files of a cache directory (tokenmill adds a data fingerprint beside each
    entry and keeps a lock file; those are not megatron's)."""
    if not directory.exists():
        return {}
    return {
        path.name: path.read_bytes()
        for path in sorted(directory.iterdir())
        if not path.name.startswith(".") and not path.name.endswith("-data.tokenmill.json")
    }
