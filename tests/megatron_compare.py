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

import contextlib
import copy
import re
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch


def stock_needs_a_process_group(installed: tuple[int, ...] | None) -> bool:
    """megatron-core 0.16 and 0.17's BlendedDataset calls `torch.distributed.get_rank()` on a
    cache miss, which raises without a process group (0.18 asks `is_initialized()` first)."""
    return installed is not None and tuple(installed[:2]) < (0, 18)


@contextlib.contextmanager
def one_rank_process_group(directory: Path) -> Iterator[None]:
    """A one-rank gloo process group (its file store in `directory`), as a Megatron-LM job has,
    destroyed on exit; nothing when one is already initialised."""
    if torch.distributed.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{directory / 'store'}", rank=0, world_size=1
        )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


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


def _normalise(text: str) -> str:
    """A message without what varies between runs and libraries' wording of values: paths,
    numbers, quoting and spacing."""
    text = re.sub(r"(/[\w.\-]+)+", "PATH", text)
    text = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    text = text.replace('"', "'")
    return " ".join(text.lower().split())


def refusal_message(error: BaseException) -> str:
    """The normalised message of a refusal; for a bare `assert` (no message), the normalised
    source of the assert that failed, so megatron-core's refusals are told apart."""
    message = str(error)
    if not message and isinstance(error, AssertionError):
        frames = traceback.extract_tb(error.__traceback__)
        message = frames[-1].line or "" if frames else ""
    return _normalise(message)


#: megatron-core's refusals that tokenmill words differently (the documented difference: a bare
#: assert becomes a message naming the field and value): each normalised megatron message (a
#: bare assert's source) as a regular expression, and the expression tokenmill's normalised
#: message must contain (`\1`... stand for megatron's groups). A megatron refusal not listed
#: here must be matched word for word.
DOCUMENTED_REFUSALS: dict[str, str] = {
    re.escape("assert all(map(lambda _: _ > n, weights))"): r"weights\[n\] must be > n, got n",
    (
        r"size_is_none => weights_are_none fails for (\w+) split this can occur with multiple "
        r"validation sets if datasets have weights"
    ): r"the \1 split has weights but no size: weighted blends need a size",
    # a split too short for one sample: megatron-core's numpy fails on an empty reduction
    re.escape("zero-size array to reduction operation minimum which has no identity"): (
        r"a split of n tokens has no room for a sample of n tokens"
    ),
    (
        r"the (\w+) blend oversamples the contributing datasets and, for example, requests n "
        r"samples from (\w+) number n in excess of its size n\. the current value of the config "
        r"attribute mid_level_dataset_surplus may be increased.*"
    ): (
        r"the \1 blend oversamples dataset n [(]\2 path[)]: it asks for n samples but the "
        r"dataset has n\. increase mid_level_dataset_surplus"
    ),
}


def refusal_family_matches(ours: BaseException, theirs: BaseException) -> bool:
    """tokenmill raises the same type or a subclass; where megatron-core asserts, an
    AssertionError, ValueError or IndexError (tokenmill's refusal classes derive from both
    AssertionError and ValueError); where megatron-core wraps its error in a bare Exception,
    any Exception."""
    if isinstance(theirs, AssertionError):
        return isinstance(ours, (AssertionError, ValueError, IndexError))
    if type(theirs) is Exception:
        return isinstance(ours, Exception)
    return isinstance(ours, type(theirs))


def assert_same_refusal(ours: BaseException | None, theirs: BaseException, where: str) -> None:
    """Both refused: the same type family and the same normalised message (or, for a refusal
    listed in DOCUMENTED_REFUSALS, tokenmill's message matching the listed pattern)."""
    assert ours is not None, f"{where}: megatron-core raised {theirs!r}, tokenmill did not"
    assert refusal_family_matches(ours, theirs), f"{where}: {ours!r} vs megatron's {theirs!r}"
    mine, reference = refusal_message(ours), refusal_message(theirs)
    if mine == reference:
        return
    for megatron_pattern, tokenmill_template in DOCUMENTED_REFUSALS.items():
        matched = re.fullmatch(megatron_pattern, reference)
        if matched:
            tokenmill_pattern = matched.expand(tokenmill_template)
            assert re.search(tokenmill_pattern, mine), (
                f"{where}: megatron-core refused with {reference!r}; tokenmill's {mine!r} does "
                f"not match the documented {tokenmill_pattern!r}"
            )
            return
    raise AssertionError(
        f"{where}: same refusal, different messages (list it in DOCUMENTED_REFUSALS if the "
        f"difference is intended): tokenmill {mine!r}, megatron-core {reference!r}"
    )


def is_cu_seqlens_overflow(error: BaseException) -> bool:
    """megatron-core's one documented failure on a valid sample: with inter_document_masking
    it cannot pad cu_seqlens when a sample has more (empty) document parts than tokens
    (`torch.full(...)[: n] = cu_seqlens` with n > sequence_length + 1)."""
    return isinstance(error, RuntimeError) and "expanded size" in str(error)


def expected_cu_seqlens_sample(theirs: Any, twin: Any, idx: int | None) -> dict[str, Any]:
    """The sample megatron-core would return where it fails on cu_seqlens: tokens, labels and
    loss mask from `twin` (megatron's dataset over the same data and config without
    inter_document_masking; those keys do not depend on it), position ids and cu_seqlens from
    megatron's own document parts of the sample (`_query_document_sample_shuffle_indices`),
    folded as megatron folds them. The one documented difference: tokenmill drops the empty
    document parts megatron would keep (each a repeated boundary), so cu_seqlens fits."""
    config = theirs.config
    length = config.sequence_length
    base = twin[idx]
    _, _, parts = theirs._query_document_sample_shuffle_indices(0 if idx is None else idx)
    parts = list(parts)
    if config.add_extra_token_to_sequence:
        parts[-1] -= 1
        if parts[-1] == 0:
            parts.pop()
    shortfall = length - sum(parts)
    if shortfall > 0:
        if parts:
            parts[-1] += shortfall
        else:
            parts.append(shortfall)
    parts = [part for part in parts if part > 0]  # the documented difference
    bounds = np.cumsum([0, *parts])
    positions = torch.cat([torch.arange(part, dtype=torch.long) for part in parts])
    cu_seqlens = torch.full((length + 1,), length, dtype=torch.int32)
    cu_seqlens[: bounds.size] = torch.from_numpy(bounds.astype(np.int32))
    return {
        "tokens": base["tokens"],
        "labels": base["labels"],
        "loss_mask": base["loss_mask"],
        "position_ids": positions,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": torch.tensor(max(parts), dtype=torch.int32),
    }


def documented_sample(theirs: Any, idx: int | None) -> dict[str, Any]:
    """expected_cu_seqlens_sample for sample `idx` of megatron's GPTDataset or BlendedDataset
    (the member's sample, after its dataset_id), the twin made by copying the dataset with
    inter_document_masking off (no rebuild: __getitem__ reads the flag per call)."""
    if hasattr(theirs, "datasets") and hasattr(theirs, "dataset_index"):
        assert idx is not None
        member = theirs.datasets[theirs.dataset_index[idx]]
        inner = int(theirs.dataset_sample_index[idx])
        return {"dataset_id": theirs.dataset_index[idx], **documented_sample(member, inner)}
    twin = copy.copy(theirs)
    twin.config = copy.copy(theirs.config)
    object.__setattr__(twin.config, "inter_document_masking", False)
    disable_mask_cache(twin)
    return expected_cu_seqlens_sample(theirs, twin, idx)


def same_outcome(theirs: Any, ours: Any, where: str, documented: Any = None) -> Any:
    """Run megatron-core's call, then tokenmill's: both refuse alike (None is returned), or both
    return (megatron's value, or the pair for samples). `documented()`: the sample megatron
    would return where it fails on cu_seqlens (expected_cu_seqlens_sample), compared instead."""
    try:
        expected = theirs()
    except Exception as error:
        if documented is not None and is_cu_seqlens_overflow(error):
            from covering import DOCUMENTED_DIFFERENCES

            DOCUMENTED_DIFFERENCES.append(where)
            return (documented(), ours())
        try:
            ours()
        except Exception as our_error:
            assert_same_refusal(our_error, error, where)
        else:
            raise AssertionError(f"{where}: megatron-core raised {error!r}, tokenmill did not")
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
            lambda idx=idx: theirs[idx],
            lambda idx=idx: ours[idx],
            f"{where} sample {idx}",
            documented=lambda idx=idx: documented_sample(theirs, idx),
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
