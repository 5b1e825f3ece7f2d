"""GPTDataset: megatron-core's GPT dataset, bit for bit, with indices built in C++.

Sample k of a GPTDataset is `sequence_length + extra` consecutive tokens (extra = 1 by
default, shared with the next sample) of the split's documents concatenated in a shuffled
order, taken at the position the shuffle index maps k to. Three arrays say where:

* document_index [E * N] int32: the split's N document ids repeated over E epochs, shuffled;
* sample_index [n + 1, 2] int32/int64: (position in document_index, token offset) where each
  sample starts (row k + 1 is where sample k ends);
* shuffle_index [n] uint32/int64: the order in which samples are served.

Given the same IndexedDataset, config and seed, the arrays and every `__getitem__` output equal
megatron-core 0.19's. The arrays are built once by one C++ call (see `tokenmill.index.gpt_index`)
and cached under megatron-core's file names; see `tokenmill.index.cache` for what tokenmill adds
(atomic writes, a lock, validation of every hit).

`__getitem__` returns the same keys, dtypes and values as megatron-core, but the tensors are
never shared between samples (megatron-core returns one cached attention_mask and position_ids
object for every sample when no reset flag is set).

Serving: for an IndexedDataset mapped with `mmap=True` (the default) and integer tokens, samples
come from the C++ batched gather of `tokenmill.serving.gpt` (one call resolves shuffle -> sample
-> document positions and writes every output). `__getitem__` gathers one sample (about 7 µs at
2048 tokens on the shared 2-core dev VM, 8x megatron-core in the same run),
`__getitems__` / `get_batch` a whole batch into one tensor per key (about 5 µs per sample at 2048
with 32 samples, mostly the memory traffic of the int64 outputs; benchmarks/SERVING.md, raw
results in benchmarks/results/serving.json). The dataset is
`tokenmill.serving.Servable` (`batch_layout()`, `fill_batch()`), which is how BlendedDataset
gathers its members' rows into one batch. Other low-level datasets (mock data, `mmap=False`,
float tokens) take the per-document Python path, with identical results; a megatron-core
IndexedDataset mapped with `mmap=True` is gathered in C++ from a view of its own map.

Subclasses: every hook megatron-core lets a subclass override takes effect as there. The C++
paths stand in for GPTDataset's own methods only where the instance's class does not override
them (`_overrides`): the index build and cache for `_build_document_sample_shuffle_indices`
(its epochs come from `_get_num_tokens_per_epoch` / `_get_num_epochs` when those are
overridden), the gather for `_query_document_sample_shuffle_indices` and `__getitem__`; a class
that overrides either of the last two is fetched sample by sample (`__getitems__` returns
`[self[i] for i in indices]`).

Size: this module is about 1000 lines because it mirrors megatron-core's ``gpt_dataset`` module:
GPTDataset is one class whose methods are the hooks megatron users subclass
(``build_low_level_dataset``, ``_query_document_sample_shuffle_indices``, ``__getitem__``...),
kept together with its mock dataset; what is not Megatron's (the batched gather, buffers,
collate) lives in `tokenmill.serving`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.distributed import is_cache_builder
from tokenmill.common.megatron_log import log, log_elapsed, megatron_logger
from tokenmill.common.megatron_version import query_returns_lengths
from tokenmill.datasets.config import GPTDatasetConfig
from tokenmill.datasets.megatron_dataset import MegatronDataset
from tokenmill.datasets.utils import Split
from tokenmill.errors import (
    CacheError,
    CacheMissingError,
    MegatronAssertionError,
)
from tokenmill.index.cache import ArraySpec, EntrySpec, IndexCache, builders_verified
from tokenmill.index.cache_checks import gpt_checks
from tokenmill.index.gpt_index import (
    GptIndexPlan,
    as_document_ids,
    build_gpt_indices,
    megatron_sample_count,
    num_epochs_for,
    num_tokens_per_epoch,
    plan_gpt_indices,
)
from tokenmill.serving.batch import SampleBatch, as_index_array, stack_samples
from tokenmill.serving.gpt import GptBatchLayout, GptSampleServer, shared_causal_mask
from tokenmill.serving.layout import BatchLayout

if TYPE_CHECKING:
    import torch

__all__ = ["GPTDataset", "GPTDatasetConfig", "MockGPTDataset", "MockGPTLowLevelDataset"]

logger = logging.getLogger(__name__)
_MEGATRON_LOG = megatron_logger("gpt_dataset")

_ARRAY_NAMES = ("document_index", "sample_index", "shuffle_index")

# Per-process state that never travels through a pickle (rebuilt lazily in each worker).
_TRANSIENT = ("_server",)
_UNSET: Any = object()
_SERVER_LOCK = threading.Lock()
# classes whose per-sample batches were reported (once each, at DEBUG level)
_PER_SAMPLE_LOGGED: weakref.WeakSet[type] = weakref.WeakSet()


def _is_object_storage_path(path: str) -> bool:
    return path.startswith(("s3://", "msc://"))


class GPTDataset(MegatronDataset):
    """megatron-core's GPTDataset (same constructor, attributes and samples).

    Args:
        indexed_dataset: the low-level dataset (an IndexedDataset, or anything with
            `sequence_lengths` and `get(idx, offset, length)`).
        dataset_path: the dataset prefix, for bookkeeping and the cache key.
        indexed_indices: the sequence ids of this split.
        num_samples: samples to build, or None for exactly one epoch.
        index_split: which split this is.
        config: the GPTDatasetConfig.
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: str | None,
        indexed_indices: npt.NDArray[np.integer] | None,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(
            indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
        )
        self.config: GPTDatasetConfig = config
        # megatron-core's mask cache attributes, kept for subclasses that read them; tokenmill
        # never shares a mask between samples (see "Deliberate differences" in the README)
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss]
        )
        self.masks_and_position_ids_are_cached = False
        self.cached_attention_mask: Any = None
        self.cached_loss_mask: Any = None
        self.cached_position_ids: Any = None
        self._cache: IndexCache | None = None
        # the data behind the cache entry was checked in this process (or by the builders):
        # DataLoader workers, which get a pickled copy, do not fingerprint it again
        self._data_verified = False
        self.document_index: npt.NDArray[Any] | None
        self.sample_index: npt.NDArray[Any] | None
        self.shuffle_index: npt.NDArray[Any] | None
        (self.document_index, self.sample_index, self.shuffle_index) = (
            self._build_document_sample_shuffle_indices()
        )
        self._server: Any = _UNSET

    # -- low-level dataset -------------------------------------------------------------------

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        """GPT splits by sequence: the number of sequences of the IndexedDataset."""
        return int(low_level_dataset.sequence_lengths.shape[0])

    @staticmethod
    def _files_read_ahead(dataset_path: str, config: GPTDatasetConfig) -> list[tuple[str, bool]]:
        """The `.idx` (read whole by the IndexedDataset when small) and, when this rank checks
        the data behind the cache, the `.bin` (its sampled fingerprint on a cold build; a rank
        that trusts the builders' check reads none): local files only."""
        if config.mock or _is_object_storage_path(dataset_path):
            return []
        files = [(dataset_path + ".idx", True)]
        # (the cache is path_to_cache, or beside the data: checked whenever the policy says so)
        if config.cache_data_check != "off" and not builders_verified():
            files.append((dataset_path + ".bin", False))
        return files

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> Any:
        """Open the IndexedDataset at `dataset_path` as megatron-core does."""
        from tokenmill.formats.megatron import IndexedDataset

        if _is_object_storage_path(dataset_path):
            if config.object_storage_cache_path is None:
                raise MegatronAssertionError(
                    f"{dataset_path} is an object-storage path: set object_storage_cache_path"
                )
            from tokenmill.storage.object_storage import ObjectStorageConfig

            storage = config.object_storage_cache_path
            # megatron-core forces ObjectStorageConfig(path_to_idx_cache=...) here; tokenmill also
            # takes a whole ObjectStorageConfig in the field (chunk and cache sizes, prefetch)
            return IndexedDataset(
                dataset_path,
                multimodal=False,
                mmap=config.mmap_bin_files,
                object_storage_config=(
                    storage
                    if isinstance(storage, ObjectStorageConfig)
                    else ObjectStorageConfig(path_to_idx_cache=storage)
                ),
            )
        sequences_per_dataset = None
        if config.sequences_per_dataset:
            sequences_per_dataset = config.sequences_per_dataset[dataset_path]
        return IndexedDataset(
            dataset_path,
            multimodal=False,
            mmap=config.mmap_bin_files,
            # a rank that does not build skips the O(documents) .idx scan the builders ran
            fast_cache_load=config.fast_cache_load or builders_verified(),
            sequences_per_dataset=sequences_per_dataset,
            dtype_code=config.token_dtype_code,
        )

    # -- identity ----------------------------------------------------------------------------

    def _drop_last_partial_sequence(self) -> bool:
        if self.index_split == Split.valid:
            return bool(self.config.drop_last_partial_validation_sequence)
        return True

    def _extend_identifiers(self, identifiers: OrderedDict[str, Any]) -> None:
        # The exact count changes sample_index, so it must not share megatron's cache entry.
        if self.config.exact_sample_count and not self._drop_last_partial_sequence():
            identifiers["exact_sample_count"] = True

    # -- index construction ------------------------------------------------------------------

    def _overrides(self, name: str) -> bool:
        """Whether this instance's class replaces GPTDataset's method `name` (a megatron hook):
        the C++ path that stands in for that method then stays out of the way."""
        return getattr(type(self), name) is not getattr(GPTDataset, name)

    def _get_num_tokens_per_epoch(self) -> int:
        """The tokens of one epoch of this split (megatron-core's hook).

        With `indexed_indices` None (fast_cache_load) every sequence counts, as megatron's
        `sequence_lengths[None]` sums the whole low-level dataset.
        """
        lengths = np.asarray(self.dataset.sequence_lengths)
        if self.indices is None:
            return int(lengths.sum(dtype=np.int64))
        return num_tokens_per_epoch(lengths, as_document_ids(self.indices))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """The epochs `num_samples` needs (megatron-core's hook): 1 for None, else the smallest
        e >= 1 with e * tokens >= num_samples * S + extra.

        Raises:
            ValueError: samples are requested from a split without tokens (megatron-core loops
                forever there).
        """
        extra = int(self.config.add_extra_token_to_sequence)
        requested = (
            0 if self.num_samples is None else self.num_samples * self.config.sequence_length
        )
        return num_epochs_for(num_tokens_per_epoch, self.num_samples, requested + extra)

    def _plan(self) -> GptIndexPlan:
        """The scalar facts of this dataset's index (computed once: an O(documents) pass).

        A subclass's `_get_num_tokens_per_epoch` / `_get_num_epochs` decide the epochs, as in
        megatron-core; GPTDataset's own are computed by the C++ kernels in the plan.

        Raises:
            TypeError: `indexed_indices` is None (only a fast_cache_load run passes None, and it
                never builds indices).
        """
        cached: GptIndexPlan | None = self.__dict__.get("_plan_cache")
        if cached is not None:
            return cached
        if self.indices is None:
            raise TypeError(
                f"{type(self).__name__} {self.index_split.name}: cannot build indices without "
                "indexed_indices (None is only for fast_cache_load, which loads built caches)"
            )
        tokens: int | None = None
        epochs: int | None = None
        if self._overrides("_get_num_tokens_per_epoch") or self._overrides("_get_num_epochs"):
            tokens = int(self._get_num_tokens_per_epoch())
            epochs = int(self._get_num_epochs(tokens))
        plan = plan_gpt_indices(
            np.asarray(self.dataset.sequence_lengths),
            as_document_ids(self.indices),
            self.num_samples,
            self.config.sequence_length,
            self.config.add_extra_token_to_sequence,
            self._drop_last_partial_sequence(),
            exact_sample_count=self.config.exact_sample_count,
            tokens_per_epoch=tokens,
            num_epochs=epochs,
        )
        extra = int(self.config.add_extra_token_to_sequence)
        total = plan.num_epochs * plan.tokens_per_epoch
        sequence_length = self.config.sequence_length
        if (
            megatron_sample_count(total, sequence_length, extra, self._drop_last_partial_sequence())
            < 0
        ):
            raise ValueError(
                f"{type(self).__name__} {self.index_split.name}: a split of {total} tokens has "
                f"no room for a sample of {sequence_length} tokens plus the extra token "
                "(megatron-core counts a negative number of samples here and fails)"
            )
        self._plan_cache = plan
        return plan

    def _build_arrays(self, plan: GptIndexPlan) -> dict[str, npt.NDArray[Any]]:
        log(
            _MEGATRON_LOG,
            logging.INFO,
            f"Build and save the {type(self).__name__} {self.index_split.name} indices",
        )
        self._log_epoch_plan(plan)
        started = time.perf_counter()
        indices = as_document_ids(self.indices if self.indices is not None else [])
        document_index, sample_index, shuffle_index = build_gpt_indices(
            np.asarray(self.dataset.sequence_lengths),
            indices,
            plan,
            self.config.random_seed,
            self.config.sequence_length,
            self.config.add_extra_token_to_sequence,
            self.config.index_build_threads,
        )
        logger.debug(
            "built %s %s indices: %d samples, %d epochs, %.3f s",
            type(self).__name__,
            self.index_split.name,
            plan.num_samples,
            plan.num_epochs,
            time.perf_counter() - started,
        )
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def _log_epoch_plan(self, plan: GptIndexPlan) -> None:
        """megatron-core's DEBUG lines on separating the final epoch."""
        if plan.num_epochs > 1 and self.num_samples is not None:
            extra = int(self.config.add_extra_token_to_sequence)
            sequence_length = self.config.sequence_length
            tokens = plan.tokens_per_epoch
            sans_final = ((plan.num_epochs - 1) * tokens - extra) // sequence_length
            log(
                _MEGATRON_LOG,
                logging.DEBUG,
                f"> num_samples_from_final_epoch: {self.num_samples - sans_final}",
            )
            log(_MEGATRON_LOG, logging.DEBUG, "> threshold: 0.8")
            log(
                _MEGATRON_LOG,
                logging.DEBUG,
                f"> num_samples_per_epoch: {(tokens - extra) // sequence_length}",
            )
        log(_MEGATRON_LOG, logging.DEBUG, f"> separate_final_epoch: {plan.separate_final_epoch}")

    def _cache_directory(self) -> str | None:
        if self.config.path_to_cache:
            return self.config.path_to_cache
        if self.config.mock:
            return None
        reader = _remote_reader(self.dataset)
        if reader is not None and _is_object_storage_path(self.dataset.path_prefix):
            # megatron-core would make a local directory literally named "s3:/bucket/..." in the
            # working directory; keep it beside the cached .idx instead
            from tokenmill.storage.object_storage import local_cache_path

            local_prefix = local_cache_path(
                self.dataset.path_prefix, reader.config.path_to_idx_cache
            )
            return os.path.join(local_prefix, "cache", f"{type(self).__name__}_indices")
        return os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")

    def _array_specs(self, plan: GptIndexPlan | None) -> dict[str, ArraySpec]:
        int32, int64, uint32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint32)
        if plan is None:
            return {
                "document_index": ArraySpec((int32,), ndim=1),
                "sample_index": ArraySpec((int32, int64), ndim=2),
                "shuffle_index": ArraySpec((uint32, int64), ndim=1),
            }
        ids = np.empty(0, np.int64) if self.indices is None else as_document_ids(self.indices)
        checks = gpt_checks(
            ids,
            np.asarray(self.dataset.sequence_lengths),
            plan.num_samples,
            self.config.sequence_length,
        )
        return {
            "document_index": ArraySpec(
                (int32,), plan.document_index_shape, values=checks["document_index"]
            ),
            "sample_index": ArraySpec(
                (np.dtype(plan.sample_dtype),),
                plan.sample_index_shape,
                values=checks["sample_index"],
            ),
            "shuffle_index": ArraySpec(
                (np.dtype(plan.shuffle_dtype),),
                plan.shuffle_index_shape,
                values=checks["shuffle_index"],
            ),
        }

    def _build_document_sample_shuffle_indices(
        self,
    ) -> tuple[Any, Any, Any]:
        """(document_index, sample_index, shuffle_index): megatron-core's hook, built by one C++
        call and cached (a subclass that overrides it replaces both).

        With `defer_npy_index_mmap` nothing is loaded (the arrays are None and are mapped on
        first access, from the `path_to_*` attributes megatron-core sets); with
        `fast_cache_load` the cache is assumed complete and never built.

        Raises:
            CacheMissingError: fast_cache_load and the cache entry is missing (a
                FileNotFoundError, as megatron-core raises).
        """
        directory = self._cache_directory()
        if directory is not None:
            self._cache = IndexCache.create(
                directory,
                self.unique_description_hash,
                type(self).__name__,
                self.index_split.name,
                self.unique_description,
                _ARRAY_NAMES,
            )
        if self.config.defer_npy_index_mmap:
            assert self._cache is not None  # the config requires path_to_cache
            self.path_to_document_index = str(self._cache.array_path("document_index"))
            self.path_to_sample_index = str(self._cache.array_path("sample_index"))
            self.path_to_shuffle_index = str(self._cache.array_path("shuffle_index"))
            return None, None, None
        started = time.time()
        built = True
        if self._cache is None:
            arrays = self._build_arrays(self._plan())
        elif self.config.fast_cache_load:
            arrays, built = self._load_cached("fast_cache_load"), False
        else:
            plan = self._plan()
            spec = EntrySpec(
                self._array_specs(plan),
                data_prefixes=self.data_prefixes(),
                data_check=self.config.cache_data_check,
                kernel_built=True,
                data_read=self._data_read(),
            )
            arrays, built = self._cache.load_or_build(
                spec,
                lambda: self._build_arrays(plan),
                may_build=is_cache_builder(self.config.cache_build_scope),
            )
            self._data_verified = True
            self._check_consistency(arrays)
        self._log_indices(arrays, built, time.time() - started)
        return arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]

    def _log_indices(
        self, arrays: Mapping[str, npt.NDArray[Any]], built: bool, seconds: float
    ) -> None:
        """megatron-core's closing lines of an index build or load. A load logs its lines here,
        after the fact: tokenmill maps and checks the three arrays in one step, whose time the
        first timing line carries. Nothing is formatted when megatron's logger would drop
        every line (its default level, WARNING, and `logging.disable`): a warm blend of 1,000
        sources formatted ~10 lines per source for nothing, ~10 % of its open time."""
        if not _MEGATRON_LOG.isEnabledFor(logging.INFO):
            if built and self._cache is None:
                log(
                    _MEGATRON_LOG,
                    logging.WARNING,
                    f"Unable to save {type(self).__name__} indexes because path_to_cache is None",
                )
            return
        samples = f"> total number of samples: {arrays['sample_index'].shape[0] - 1}"
        if built:
            if self._cache is None:
                log(
                    _MEGATRON_LOG,
                    logging.WARNING,
                    f"Unable to save {type(self).__name__} indexes because path_to_cache is None",
                )
            log_elapsed(_MEGATRON_LOG, seconds)
            log(_MEGATRON_LOG, logging.INFO, samples)
            epochs = self._plan_cache.num_epochs if "_plan_cache" in self.__dict__ else None
            if epochs is not None:
                log(_MEGATRON_LOG, logging.INFO, f"> total number of epochs: {epochs}")
            return
        name = f"{type(self).__name__} {self.index_split.name}"
        log(_MEGATRON_LOG, logging.INFO, f"Load the {name} indices")
        assert self._cache is not None
        for number, (array, label) in enumerate(
            (
                ("document_index", "document index"),
                ("sample_index", "sample index"),
                ("shuffle_index", "shuffle index"),
            )
        ):
            path = os.path.basename(self._cache.array_path(array))
            log(_MEGATRON_LOG, logging.INFO, f"\tLoad the {label} from {path}")
            log_elapsed(_MEGATRON_LOG, seconds if number == 0 else 0.0)
        log(_MEGATRON_LOG, logging.INFO, samples)

    def data_prefixes(self) -> list[str]:
        """The `.bin`/`.idx` prefixes this dataset's indices are computed from (fingerprinted
        beside the cache entry); empty for mock and non-file low-level datasets, and for
        object-storage prefixes, whose reads are pinned to one object version by ETag instead.
        A megatron-core IndexedDataset counts as a file dataset (same attributes)."""
        prefix = getattr(self.dataset, "path_prefix", None)
        if (
            isinstance(prefix, str)
            and hasattr(self.dataset, "index")
            and not _is_object_storage_path(prefix)
        ):
            return [prefix]
        return []

    def _data_read(self) -> dict[str, Any] | None:
        """The `.idx` as its reader read it whole (fstat and bytes, what the indices are
        computed from), for the cache's data fingerprint; None when it was mapped (larger than
        64 KiB) or the low-level dataset is not tokenmill's."""
        index = getattr(self.dataset, "index", None)
        whole = getattr(index, "whole_read", None)
        path = getattr(index, "idx_path", None)
        return {path: whole} if whole is not None and isinstance(path, str) else None

    def _check_consistency(self, arrays: dict[str, npt.NDArray[Any]]) -> None:
        rows = arrays["sample_index"].shape[0]
        if arrays["shuffle_index"].shape[0] != rows - 1:
            assert self._cache is not None
            raise CacheError(
                f"{self._cache.array_path('shuffle_index')} has {arrays['shuffle_index'].shape[0]}"
                f" entries but the sample index has {rows - 1} samples"
            )

    def _load_cached(self, why: str) -> dict[str, npt.NDArray[Any]]:
        """The cached arrays, loaded without building (deferred mapping, fast_cache_load).

        Raises:
            CacheMissingError: a file of the entry is missing (megatron-core: FileNotFoundError).
            CacheError: a file is unreadable or does not fit (dtype, shape).
            StaleCacheError: the data changed since the entry was built.
        """
        assert self._cache is not None
        arrays, problems = self._cache.load(
            self._array_specs(None), check_description=not self.config.fast_cache_load
        )
        if arrays is None:
            message = (
                f"{type(self).__name__} {self.index_split.name}: no valid cache to load "
                f"({why} loads caches built beforehand, it never builds them): "
                + "; ".join(problems)
            )
            if not self._cache.all_present():
                raise CacheMissingError(message)
            raise CacheError(message)
        if not getattr(self, "_data_verified", False):
            self._cache.check_deferred(self.data_prefixes(), self.config.cache_data_check)
            self._data_verified = True
        self._check_consistency(arrays)
        return arrays

    def _load_deferred(self) -> None:
        arrays = self._load_cached(
            "defer_npy_index_mmap" if self.config.defer_npy_index_mmap else "a reload"
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    # -- pickling ----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # Cached indices travel as file names and are re-mapped on first use in the new process
        # (DataLoader workers under spawn), instead of being copied through the pickle.
        state = self.__dict__.copy()
        if self._cache is not None and self._cache.all_present():
            state["document_index"] = state["sample_index"] = state["shuffle_index"] = None
        for name in _TRANSIENT:
            state[name] = _UNSET
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in _TRANSIENT:
            self.__dict__[name] = _UNSET

    # -- sizes -------------------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of samples.

        With `defer_npy_index_mmap` this is megatron-core's analytic length from its two hooks
        (`_get_num_tokens_per_epoch`, `_get_num_epochs`; a double-precision ceil when the partial
        last sample is kept), whether or not the arrays were mapped since, as in megatron-core.
        An empty split then has length -1 with drop_last (megatron's formula), which `len()`
        refuses with ValueError, as it does for megatron-core.
        """
        if self.config.defer_npy_index_mmap:
            tokens = int(self._get_num_tokens_per_epoch())
            epochs = int(self._get_num_epochs(tokens))
            available = epochs * tokens - self.config.add_extra_token_to_sequence
            sequence_length = self.config.sequence_length
            if self._drop_last_partial_sequence():
                return available // sequence_length
            if self.config.exact_sample_count:
                return -(-available // sequence_length)
            return math.ceil(float(available) / sequence_length)
        if self.sample_index is None:
            self._load_deferred()
        assert self.sample_index is not None
        return int(self.sample_index.shape[0]) - 1

    # -- samples -----------------------------------------------------------------------------

    def _query_document_sample_shuffle_indices(
        self, idx: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], list[int]]:
        """(tokens of sample idx as int64 with padding, document ids, per-part lengths)."""
        if self.shuffle_index is None:
            self._load_deferred()
        assert self.shuffle_index is not None and self.sample_index is not None
        assert self.document_index is not None
        extra = int(self.config.add_extra_token_to_sequence)
        target = self.config.sequence_length + extra
        position = int(self.shuffle_index[idx])
        # The index arrays may come from a cache file: check every value before using it as a
        # position (numpy would wrap negative ones around silently), as the C++ gather does.
        if not 0 <= position < self.sample_index.shape[0] - 1:
            raise IndexError(
                f"corrupt index: shuffle_index[{idx}] = {position} is outside the sample index "
                f"of {self.sample_index.shape[0] - 1} samples"
            )
        begin, begin_offset = (int(v) for v in self.sample_index[position])
        end, end_offset = (int(v) for v in self.sample_index[position + 1])
        if not 0 <= begin <= end < self.document_index.shape[0]:
            raise IndexError(
                f"corrupt index: sample index rows [{begin}, {end}] are outside the document "
                f"index of {self.document_index.shape[0]} entries"
            )
        document_ids: list[int] = []
        parts: list[npt.NDArray[Any]] = []
        for i in range(begin, end + 1):
            document = int(self.document_index[i])
            if not 0 <= document < self.dataset.sequence_lengths.shape[0]:
                raise IndexError(
                    f"corrupt index: document_index[{i}] = {document} is not a sequence id in "
                    f"[0, {self.dataset.sequence_lengths.shape[0]})"
                )
            document_ids.append(document)
            offset: int
            length: int | None
            if begin == end:
                offset, length = begin_offset, end_offset - begin_offset + extra
            else:
                offset = begin_offset if i == begin else 0
                length = None if i < end else end_offset + extra
            parts.append(self.dataset.get(document, offset=offset, length=length))
        lengths = [len(part) for part in parts]
        if sum(lengths) > target:
            raise IndexError(
                f"corrupt index: sample {idx} covers {sum(lengths)} tokens, more than {target}"
            )
        text = np.empty(target, dtype=np.int64)
        filled = 0
        for part in parts:
            if np.asarray(part).dtype.kind not in "iub":
                # megatron-core's concatenation into int64 raises TypeError ("Cannot cast array
                # data ... according to the rule 'same_kind'"); numpy's assignment would cast
                # 1.5, NaN and inf to integers silently
                raise TypeError(
                    f"{_bin_path_of(self.dataset)}: tokens of dtype {np.asarray(part).dtype} "
                    "cannot be served as int64 token ids (megatron-core raises TypeError too); "
                    "the data must be integer tokens"
                )
            text[filled : filled + len(part)] = part
            filled += len(part)
        text[filled:] = self._pad_token_id
        if not query_returns_lengths():  # the contract of the megatron-core followed, < 0.19
            return text, np.asarray(document_ids, dtype=np.int64)  # type: ignore[return-value]
        return text, np.asarray(document_ids, dtype=np.int64), lengths

    # -- object storage: tell the chunk cache what comes next -------------------------------

    def _sample_byte_ranges(self, indices: Any) -> list[tuple[int, int]]:
        """The (byte offset, byte length) ranges of the `.bin` that samples `indices` read."""
        assert self.shuffle_index is not None and self.sample_index is not None
        assert self.document_index is not None
        dataset = self.dataset
        itemsize = np.dtype(dataset.dtype).itemsize
        pointers, lengths = dataset.sequence_pointers, dataset.sequence_lengths
        extra = int(self.config.add_extra_token_to_sequence)
        ranges: list[tuple[int, int]] = []
        for idx in indices:
            position = int(self.shuffle_index[idx])
            begin, begin_offset = (int(v) for v in self.sample_index[position])
            end, end_offset = (int(v) for v in self.sample_index[position + 1])
            for i in range(begin, end + 1):
                document = int(self.document_index[i])
                length = int(lengths[document])
                first = begin_offset if i == begin else 0
                stop = min(end_offset + extra, length) if i == end else length
                if stop > first:
                    start = int(pointers[document]) + first * itemsize
                    ranges.append((start, (stop - first) * itemsize))
        return ranges

    def prefetch(self, indices: Any) -> None:
        """Start fetching the data of samples `indices` in the background (object-storage
        datasets; a no-op for local ones). A sampler that knows its future indices may call it;
        `__getitem__` and `get_batch` already announce what they predict."""
        reader = _remote_reader(self.dataset)
        if reader is None:
            return
        if self.shuffle_index is None:
            self._load_deferred()
        reader.prefetch(self._sample_byte_ranges(indices))

    def _prefetch_ahead(self, idx: int) -> None:
        """After `idx`, announce the next `prefetch_samples` samples this process will read,
        predicted from the indices it has read (`datasets.prefetch.OrderPredictor`: consecutive,
        or runs of a data-parallel rank's micro-batches); re-announced every quarter window. The
        chunk cache skips chunks it holds or is fetching and takes at most half its budget."""
        reader = _remote_reader(self.dataset)
        if reader is None or self.shuffle_index is None:
            return
        depth = int(reader.config.prefetch_samples)
        count = int(self.shuffle_index.shape[0])
        if depth <= 0 or not -count <= idx < count:
            return
        from tokenmill.datasets.prefetch import OrderPredictor

        predictor = self.__dict__.get("_order_predictor")
        if predictor is None:
            predictor = self._order_predictor = OrderPredictor()
        predictor.observe(idx % count)
        since = self.__dict__.get("_prefetch_since", depth)
        if since < max(1, depth // 4):
            self._prefetch_since = since + 1
            return
        self._prefetch_since = 1
        self.prefetch(predictor.predict(depth, count))

    def _getitem_python(self, idx: int | None) -> dict[str, torch.Tensor]:
        """The sample at `idx` from `_query_document_sample_shuffle_indices` (GPTDataset's own,
        reading through `self.dataset.get`, or a subclass's), computed as megatron-core's
        `__getitem__` computes it, except that no tensor is shared between samples.

        The masks and positions follow the length of the text the query returns (megatron's
        `_get_ltor_masks_and_position_ids` does the same), so a subclass may return any length;
        cu_seqlens are padded to `sequence_length + 1` as in megatron-core.
        """
        import torch

        if idx is not None and _remote_reader(self.dataset) is not None:
            self._prefetch_ahead(idx)

        queried = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        # megatron-core before 0.19 returns (text, document ids): no lengths, no
        # inter_document_masking
        text = queried[0]
        document_lengths = queried[2] if len(queried) > 2 else [len(text)]
        text = np.asarray(text)
        if text.dtype != np.int64:  # megatron: torch.from_numpy(text).long()
            text = text.astype(np.int64)
        config = self.config
        pad = self._pad_token_id
        if config.add_extra_token_to_sequence:
            tokens = text[:-1].copy()
            labels = text[1:].copy()
        else:
            tokens = text
            labels = np.roll(text, -1)
            labels[-1] = pad
        length = int(tokens.shape[0])

        eod = config.tokenizer.eod
        is_eod = tokens == eod
        loss_mask = np.ones(length, dtype=np.float32)
        if config.eod_mask_loss:
            loss_mask[is_eod] = 0.0
        positions = np.arange(length, dtype=np.int64)
        document_starts: npt.NDArray[np.int64] | None = None
        if config.reset_position_ids or config.reset_attention_mask:
            # Every token after an EOD starts a new document.
            marks = np.zeros(length, dtype=np.int64)
            after_eod = np.flatnonzero(is_eod[:-1]) + 1
            marks[after_eod] = after_eod
            document_starts = np.maximum.accumulate(marks) if length else marks
        position_ids = positions
        if config.reset_position_ids and document_starts is not None:
            position_ids = positions - document_starts

        loss_mask[labels == pad] = 0.0
        tokens[tokens == pad] = 0
        labels[labels == pad] = 0
        if idx is None:
            loss_mask[:] = 0.0

        result: dict[str, torch.Tensor] = {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
        }
        if config.inter_document_masking:
            sequence_length = config.sequence_length
            cu_seqlens, part_positions = _document_boundaries(
                list(document_lengths), sequence_length, bool(config.add_extra_token_to_sequence)
            )
            padded = np.full(sequence_length + 1, sequence_length, dtype=np.int32)
            padded[: cu_seqlens.size] = cu_seqlens
            position_ids = position_ids.copy()
            covered = min(length, sequence_length)
            position_ids[:covered] = part_positions[:covered]
            result["loss_mask"] = torch.from_numpy(loss_mask)
            result["position_ids"] = torch.from_numpy(position_ids)
            result["cu_seqlens"] = torch.from_numpy(padded)
            result["max_seqlen"] = torch.tensor(np.diff(cu_seqlens).max(), dtype=torch.int32)
            return result
        if config.create_attention_mask:
            if config.reset_attention_mask and document_starts is not None:
                allowed = torch.ones(length, length, dtype=torch.bool).tril_()
                starts = torch.from_numpy(document_starts)
                allowed &= starts.unsqueeze(1) == starts.unsqueeze(0)
                result["attention_mask"] = (~allowed).unsqueeze(0)
            else:  # megatron's cached causal mask, shared by every sample
                result["attention_mask"] = shared_causal_mask(length)
        result["loss_mask"] = torch.from_numpy(loss_mask)
        result["position_ids"] = torch.from_numpy(np.ascontiguousarray(position_ids))
        return result

    # -- serving -----------------------------------------------------------------------------

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """The sample at `idx` (None: a padding sample, sample 0 with a zero loss mask).

        One C++ gather for a mapped IndexedDataset; the per-document Python path otherwise, and
        always when a subclass overrides `_query_document_sample_shuffle_indices`.

        Raises:
            IndexError: `idx` is outside [-len, len).
            TypeError: `idx` is not an integer or None.
        """
        server = self._server
        if server is _UNSET:
            server = self._serving()
        if server is None:
            return self._getitem_python(idx)
        result: dict[str, torch.Tensor] = server.one(idx)
        return result

    def __getitems__(self, indices: Sequence[int | None]) -> SampleBatch | list[Any]:
        """A batch (torch's batched-fetch protocol): see `get_batch` and `SampleBatch`.

        A subclass that overrides `__getitem__` or `_query_document_sample_shuffle_indices` gets
        `[self[i] for i in indices]`, exactly what torch's DataLoader fetches from a dataset
        without `__getitems__`, so its own method decides every sample (said once per class at
        DEBUG level).
        """
        if self._per_sample_batches():
            return [self[index] for index in indices]
        tensors = self.get_batch(indices)
        return SampleBatch(tensors, int(tensors["tokens"].shape[0]))

    def _per_sample_batches(self) -> bool:
        """Whether batches must be fetched sample by sample: the instance's class overrides a
        method the batched C++ gather would replace."""
        overridden = [
            name
            for name in ("__getitem__", "_query_document_sample_shuffle_indices")
            if self._overrides(name)
        ]
        if not overridden:
            return False
        name = type(self).__qualname__
        if type(self) not in _PER_SAMPLE_LOGGED:
            _PER_SAMPLE_LOGGED.add(type(self))
            logger.debug(
                "%s overrides %s: its batches are fetched sample by sample, without the batched "
                "C++ gather",
                name,
                " and ".join(overridden),
            )
        return True

    def get_batch(
        self, indices: Sequence[int | None] | npt.NDArray[np.integer], *, pin_memory: bool = False
    ) -> dict[str, torch.Tensor]:
        """Samples `indices` stacked: every tensor of `__getitem__` with a leading batch dim.

        The result equals `torch.stack` of the per-sample outputs key by key (dtype and value):
        tokens/labels/loss_mask/position_ids `[B, S]`, attention_mask `[B, 1, S, S]`,
        cu_seqlens `[B, S + 1]`, max_seqlen `[B]`.

        Args:
            indices: sample indices (negative counts from the end; None: a padding sample).
            pin_memory: allocate the outputs in page-locked memory (needs an accelerator).

        Returns:
            One tensor per key, in `__getitem__`'s key order.

        Raises:
            IndexError: an index is outside [-len, len) (the message names it).
            TypeError: the indices are not integers.
        """
        index_array, padding = as_index_array(indices)
        server = None if self._per_sample_batches() else self._serving()
        if server is None:
            self.prefetch(index_array.tolist())  # object storage: the batch's chunks in parallel
            pads = padding.tolist() if padding is not None else [False] * index_array.shape[0]
            samples = [
                self[None if pad else index] for index, pad in zip(index_array.tolist(), pads)
            ]
            if not samples:
                raise ValueError("get_batch needs at least one index on this dataset")
            stacked = stack_samples(samples)
            if pin_memory:
                stacked = {key: value.pin_memory() for key, value in stacked.items()}
            return stacked
        return server.serve(
            index_array.shape[0],
            [(self, index_array, None)],
            padding=padding,
            pin_memory=pin_memory,
        )

    # -- tokenmill.serving.Servable ------------------------------------------------------------

    def batch_layout(self) -> BatchLayout | None:
        """The layout of this dataset's served batches (`tokenmill.serving`), or None when its
        samples come from `__getitem__` one by one: the low-level dataset needs the per-document
        Python path (not a mapped, integer, single-modal IndexedDataset), or a subclass overrides
        `__getitem__` / `_query_document_sample_shuffle_indices`."""
        if self._per_sample_batches():
            return None
        server = self._serving()
        return None if server is None else server.layout

    def fill_batch(
        self,
        indices: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64] | None,
        buffers: Mapping[str, npt.NDArray[Any]],
        *,
        num_threads: int = 1,
    ) -> None:
        """Gather samples `indices` into rows `rows` (None: 0..B-1) of batch buffers laid out
        by `batch_layout()`, in one C++ call with the GIL released.

        Raises:
            IndexError: an index is outside [-len, len).
            TypeError: this dataset has no batch layout (`batch_layout()` is None).
        """
        server = None if self._per_sample_batches() else self._serving()
        if server is None:
            raise TypeError(
                f"{type(self).__name__} over {type(self.dataset).__name__} has no batch layout: "
                "its samples are read one by one (`batch_layout()` is None)"
            )
        server.gather(indices, rows, buffers, num_threads=num_threads)

    def _serving(self) -> GptSampleServer | None:
        """The C++-backed sample server (built once per process), or None when the low-level
        dataset needs the Python path (not a mapped, integer, single-modal IndexedDataset)."""
        server = self._server
        if server is _UNSET:
            with _SERVER_LOCK:  # loader threads: one server per dataset
                server = self._server
                if server is _UNSET:
                    server = self._make_server()
        result: GptSampleServer | None = server
        return result

    def _make_server(self) -> GptSampleServer | None:
        """The C++ gatherer over this dataset's arrays, or None (the per-sample Python path)
        when a subclass overrides `_query_document_sample_shuffle_indices` (its method decides
        what a sample's tokens are), when the low-level dataset has no mapped integer tokens
        (mock data, `mmap=False`, object storage, float or multimodal tokens; see
        `_mapped_tokens`), or when the index arrays do not have the dtypes megatron-core builds
        (a subclass's own `_build_document_sample_shuffle_indices`)."""
        if self.shuffle_index is None:
            self._load_deferred()
        assert self.shuffle_index is not None and self.sample_index is not None
        assert self.document_index is not None
        server = None
        source = (
            None
            if self._overrides("_query_document_sample_shuffle_indices")
            else _mapped_tokens(self.dataset)
        )
        if source is not None and _gatherable(
            self.shuffle_index, self.sample_index, self.document_index
        ):
            tokens, pointers, lengths = source
            config = self.config
            inter_document = bool(config.inter_document_masking)
            attention_mask = bool(config.create_attention_mask) and not inter_document
            layout = GptBatchLayout(
                sequence_length=config.sequence_length,
                token_dtype=self._output_dtype(),
                attention_mask=attention_mask,
                reset_attention_mask=attention_mask and bool(config.reset_attention_mask),
                inter_document=inter_document,
            )
            server = GptSampleServer(
                self.shuffle_index,
                self.sample_index,
                self.document_index,
                pointers,
                lengths,
                tokens,
                layout=layout,
                extra_token=int(config.add_extra_token_to_sequence),
                eod=int(config.tokenizer.eod),
                pad=int(self._pad_token_id),
                eod_mask_loss=bool(config.eod_mask_loss),
                reset_position_ids=bool(config.reset_position_ids),
                data_path=_bin_path_of(self.dataset),
            )
        self._server = server
        return server

    def _output_dtype(self) -> np.dtype[Any]:
        """The dtype of tokens and labels (config.token_output_dtype)."""
        choice = self.config.token_output_dtype
        if choice == "int64":
            return np.dtype(np.int64)
        storage = np.dtype(getattr(self.dataset, "dtype", np.int64))
        if choice == "int32":
            if storage.kind not in "iu" or storage.itemsize > 4 or storage == np.uint32:
                raise ValueError(
                    f"token_output_dtype='int32' cannot hold {storage} tokens of "
                    f"{self.dataset_path}; use 'int64' or 'storage'"
                )
            return np.dtype(np.int32)
        if storage.kind not in "iu":
            raise ValueError(
                f"token_output_dtype='storage' needs integer tokens, but {self.dataset_path} "
                f"stores {storage}"
            )
        return storage


def _remote_reader(dataset: Any) -> Any:
    """tokenmill's object-storage `.bin` reader of `dataset` (its chunk cache takes prefetch
    hints), or None: local files, mock data, and megatron-core's own readers."""
    reader = getattr(dataset, "bin_reader", None)
    return reader if callable(getattr(reader, "prefetch", None)) else None


def _bin_path_of(dataset: Any) -> str:
    """The `.bin` a low-level dataset maps, for error messages."""
    prefix = getattr(dataset, "path_prefix", None)
    return f"{prefix}.bin" if prefix is not None else repr(dataset)


def _mapped_tokens(dataset: Any) -> tuple[Any, Any, Any] | None:
    """(tokens, sequence_pointers, sequence_lengths) of a memory-mapped, single-modal
    IndexedDataset with integer tokens the gather reads, or None.

    tokenmill's IndexedDataset maps its `.bin` when `mmap=True`; megatron-core's maps it in its
    `_MMapBinReader` (`mmap=True`, its default), whose buffer is viewed here without copying,
    so a megatron-core IndexedDataset passed to tokenmill's GPTDataset gets the C++ gather too.
    None for `mmap=False` (a file reader in either library), object storage, multimodal data,
    float tokens and uint32/uint64 tokens (the gather widens to int64 and reads int8..int64 and
    uint8/uint16): those samples take the per-document Python path, with identical results.
    """
    index = getattr(dataset, "index", None)
    if index is None or getattr(dataset, "multimodal", False):
        return None
    tokens = getattr(dataset, "_tokens", None)
    if tokens is None:
        buffer = getattr(getattr(dataset, "bin_reader", None), "_bin_buffer", None)
        if buffer is None:
            return None
        dtype = np.dtype(index.dtype)
        view = memoryview(buffer)
        tokens = np.frombuffer(view, dtype=dtype, count=view.nbytes // dtype.itemsize)
    dtype = tokens.dtype
    if dtype.kind not in "iu" or dtype.itemsize > 8 or dtype in (np.uint32, np.uint64):
        return None
    return tokens, index.sequence_pointers, index.sequence_lengths


def _gatherable(shuffle_index: Any, sample_index: Any, document_index: Any) -> bool:
    """Whether the index arrays have the dtypes and shapes the C++ gather reads (megatron's)."""
    return (
        np.dtype(shuffle_index.dtype) in (np.uint32, np.int64)
        and np.dtype(sample_index.dtype) in (np.int32, np.int64)
        and sample_index.ndim == 2
        and sample_index.shape[1] == 2
        and np.dtype(document_index.dtype) == np.int32
    )


def _document_boundaries(
    document_lengths: list[int], sequence_length: int, extra_token: bool
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """cu_seqlens of the sample's document parts and positions restarting in each part."""
    lengths = list(document_lengths)
    if extra_token:
        lengths[-1] -= 1
        if lengths[-1] == 0:
            lengths.pop()
    shortfall = sequence_length - sum(lengths)
    if shortfall > 0:
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    cu_seqlens = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    if cu_seqlens.size > sequence_length + 1:
        # Only possible with empty parts (empty documents, or a sample starting at the very end
        # of a document), where megatron-core fails to pad; dropping them loses no token.
        cu_seqlens = np.unique(cu_seqlens)
    positions = np.arange(sequence_length, dtype=np.int64)
    part = np.searchsorted(cu_seqlens, positions, side="right") - 1
    return cu_seqlens, positions - cu_seqlens[part]


class MockGPTLowLevelDataset:
    """megatron-core's mock low-level data: 100 000 documents of lengths in [1, 4096).

    Document i of length L is `(arange(L - 1) + 1) % vocab_size` followed by the EOD token.
    """

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod_token = tokenizer.eod
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> npt.NDArray[np.int64]:
        length = int(self.sequence_lengths[idx])
        body = (np.arange(length - 1, dtype=np.int64) + 1) % self.vocab_size
        return np.concatenate([body, np.array([self.eod_token], dtype=np.int64)])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> npt.NDArray[np.int64]:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockGPTLowLevelDataset (megatron-core's mock data)."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: str | None,
        indices: npt.NDArray[np.integer] | None,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise MegatronAssertionError("MockGPTDataset needs a config with mock=True (no blend)")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(
        dataset_path: str | None, config: GPTDatasetConfig
    ) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)
