"""BlendedDataset: megatron-core's weighted blend of mid-level datasets, bit for bit.

Sample i of a blend is sample `dataset_sample_index[i]` of member `dataset_index[i]`. With a
size, the two arrays come from the greedy rule (the member furthest below its weighted share
takes the next sample, first one on ties); with size None every member contributes exactly
`weights[d]` samples (the exhaustive rule). Both kernels are C++ and bit-identical to
megatron-core's (see `tokenmill.index.blending`).

Cache: only when `config.path_to_cache` is set, under megatron-core's names
(`<md5>-BlendedDataset-<split>-{description.txt,dataset_index.npy,dataset_sample_index.npy}`),
written atomically under a lock and validated on every hit (see `tokenmill.index.cache`).
`dataset_index` is int16 (megatron-core) below 32 767 members and int32 beyond.

Serving: `__getitems__(indices)` / `get_batch(indices)` look up the members of the whole batch
with two vectorised numpy gathers and, when the members present share one batch layout
(`tokenmill.serving.Servable`), let each gather its samples straight into the rows of one shared
set of batch tensors (one C++ call per member, GIL released). The result equals stacking `__getitem__` outputs, with `dataset_id` a `[B]`
`torch.int16` tensor (`torch.int32` for blends of 32 767 members or more), i.e. what torch's
default collate makes of the per-sample numpy scalars.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.distributed import is_cache_builder
from tokenmill.common.megatron_log import log, log_elapsed, megatron_logger
from tokenmill.datasets.config import BlendedMegatronDatasetConfig
from tokenmill.datasets.megatron_dataset import describe, described_text
from tokenmill.datasets.utils import normalize
from tokenmill.errors import CacheError, CacheMissingError, MegatronAssertionError
from tokenmill.index.blending import (
    INT16_MAX_DATASETS,
    build_blending_indices,
    build_exhaustive_blending_indices,
)
from tokenmill.index.cache import ArraySpec, EntrySpec, IndexCache
from tokenmill.index.cache_checks import blended_checks
from tokenmill.serving.batch import SampleBatch, as_index_array, stack_samples
from tokenmill.serving.layout import BatchLayout
from tokenmill.serving.server import BatchServer

if TYPE_CHECKING:
    import torch

__all__ = ["BlendedDataset"]

logger = logging.getLogger(__name__)
_MEGATRON_LOG = megatron_logger("blended_dataset")

_ARRAY_NAMES = ("dataset_index", "dataset_sample_index")


class BlendedDataset:
    """megatron-core's BlendedDataset (same constructor, arrays, samples and cache).

    Args:
        datasets: the members, all of one class and one split.
        weights: blend weights (normalised when `size` is given), or per-member sample counts
            when `size` is None.
        size: samples to draw, or None to draw exactly `weights[d]` from member d.
        config: the dataset config.

    Raises:
        ValueError: for inconsistent members or weights.
        IndexError: when the blend asks a member for more samples than it has.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[int | float],
        size: int | None,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if len(datasets) == 0:
            raise ValueError("a BlendedDataset needs at least one dataset")
        if len(datasets) != len(weights):
            raise MegatronAssertionError(
                f"got {len(datasets)} datasets but {len(weights)} weights; they must match"
            )
        first = datasets[0]
        for number, dataset in enumerate(datasets):
            if type(dataset) is not type(first):
                raise MegatronAssertionError(
                    f"dataset {number} is a {type(dataset).__name__}, dataset 0 a "
                    f"{type(first).__name__}: a blend holds one class"
                )
            if dataset.index_split != first.index_split:
                raise MegatronAssertionError(
                    f"dataset {number} is from split {dataset.index_split.name}, dataset 0 "
                    f"from {first.index_split.name}: a blend holds one split"
                )
        for number, weight in enumerate(weights):
            if not weight > 0:
                raise MegatronAssertionError(f"weights[{number}] must be > 0, got {weight}")
            if type(weight) is not type(weights[0]):
                raise MegatronAssertionError(
                    "weights must all have one type (all int or all float)"
                )
        if size is None and isinstance(weights[0], float):
            for number, weight in enumerate(weights):
                if weight != int(weight):
                    raise MegatronAssertionError(
                        f"weights[{number}] = {weight}: without a size, weights are sample "
                        "counts and must be whole numbers"
                    )
        if size is not None and size < 0:
            raise ValueError(f"size must be >= 0 or None, got {size}")
        if len(datasets) == 1:
            log(
                _MEGATRON_LOG,
                logging.WARNING,
                "Building a BlendedDataset for a single MegatronDataset",
            )

        self.datasets = list(datasets)
        self.split = first.index_split
        self.weights: list[Any] = normalize(weights) if size is not None else list(weights)
        self.size = size
        self.config = config

        identifiers: OrderedDict[str, Any] = OrderedDict()
        identifiers["class"] = type(self).__name__
        identifiers["datasets"] = [dataset.unique_identifiers for dataset in self.datasets]
        identifiers["split"] = self.split.name
        identifiers["weights"] = self.weights
        identifiers["size"] = self.size
        self.unique_identifiers = identifiers
        self.unique_description, self.unique_description_hash = describe(
            identifiers, known={"datasets": [described_text(d) for d in self.datasets]}
        )

        self._cache: IndexCache | None = None
        # the data behind the cache entry was checked in this process (or by the builders):
        # DataLoader workers, which get a pickled copy, do not fingerprint it again
        self._data_verified = False
        if config.path_to_cache:
            self._cache = IndexCache.create(
                config.path_to_cache,
                self.unique_description_hash,
                type(self).__name__,
                self.split.name,
                self.unique_description,
                _ARRAY_NAMES,
            )
        self.dataset_index: npt.NDArray[Any] | None
        self.dataset_sample_index: npt.NDArray[Any] | None
        self.dataset_index, self.dataset_sample_index = self._build_indices()
        # one batch server per member layout (usually one), built on first use in each process
        self._servers: dict[BatchLayout, BatchServer] = {}

    # -- indices -----------------------------------------------------------------------------

    def _total(self) -> int:
        return int(self.size) if self.size is not None else int(sum(self.weights))

    def _specs(self) -> dict[str, ArraySpec]:
        index_dtype = np.int16 if len(self.datasets) < INT16_MAX_DATASETS else np.int32
        length = (self._total(),)
        checks = blended_checks([len(dataset) for dataset in self.datasets])
        return {
            "dataset_index": ArraySpec(
                (np.dtype(index_dtype),), length, values=checks["dataset_index"]
            ),
            "dataset_sample_index": ArraySpec(
                (np.dtype(np.int64),), length, values=checks["dataset_sample_index"]
            ),
        }

    def _compute(self) -> dict[str, npt.NDArray[Any]]:
        log(_MEGATRON_LOG, logging.INFO, f"Build and save the {type(self).__name__} indices")
        log(_MEGATRON_LOG, logging.INFO, "\tBuild and save the dataset and dataset sample indexes")
        started = time.perf_counter()
        if self.size is not None:
            dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
        else:
            dataset_index, dataset_sample_index = build_exhaustive_blending_indices(
                [int(weight) for weight in self.weights]
            )
        self._check_oversampling(dataset_index)
        logger.debug(
            "built BlendedDataset %s indices: %d samples from %d datasets, %.3f s",
            self.split.name,
            dataset_index.shape[0],
            len(self.datasets),
            time.perf_counter() - started,
        )
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def _check_oversampling(self, dataset_index: npt.NDArray[np.integer]) -> None:
        counts = np.bincount(dataset_index, minlength=len(self.datasets))
        for number, count in enumerate(counts.tolist()):
            available = len(self.datasets[number])
            if count > available:
                dataset = self.datasets[number]
                raise IndexError(
                    f"The {self.split.name} blend oversamples dataset {number} "
                    f"({type(dataset).__name__} {getattr(dataset, 'dataset_path', None)}): it "
                    f"asks for {count} samples but the dataset has {available}. Increase "
                    "mid_level_dataset_surplus (currently "
                    f"{self.config.mid_level_dataset_surplus}), e.g. two- or ten-fold."
                )

    def _build_indices(self) -> tuple[Any, Any]:
        """(dataset_index, dataset_sample_index): megatron-core's hook, built by the C++ blending
        kernels and cached (a subclass that overrides it replaces both). With
        `defer_npy_index_mmap` they are None until first use (megatron's `path_to_*` attributes
        name the files); with `fast_cache_load` the cache entry is loaded and never built."""
        if self.config.defer_npy_index_mmap:
            if self._cache is not None:
                self.path_to_dataset_index = str(self._cache.array_path("dataset_index"))
                self.path_to_dataset_sample_index = str(
                    self._cache.array_path("dataset_sample_index")
                )
            return None, None
        started = time.time()
        built = True
        if self._cache is None:
            arrays = self._compute()
        elif self.config.fast_cache_load:
            arrays, built = self._load_cached("fast_cache_load"), False
        else:
            spec = EntrySpec(
                self._specs(),
                data_prefixes=self.data_prefixes(),
                data_check=self._data_check(),
                kernel_built=type(self)._compute is BlendedDataset._compute,
            )
            arrays, built = self._cache.load_or_build(
                spec,
                self._compute,
                may_build=is_cache_builder(getattr(self.config, "cache_build_scope", "global")),
            )
            self._data_verified = True
        self._log_indices(built, time.time() - started)
        return arrays["dataset_index"], arrays["dataset_sample_index"]

    def _log_indices(self, built: bool, seconds: float) -> None:
        """megatron-core's closing lines of a build, or its lines of a load (after the fact:
        tokenmill maps and checks both arrays in one step, whose time the first timing line
        carries)."""
        if built:
            if self._cache is None:
                log(
                    _MEGATRON_LOG,
                    logging.WARNING,
                    f"Cannot save the {type(self).__name__} indexes because path_to_cache is None",
                )
            log_elapsed(_MEGATRON_LOG, seconds)
            return
        assert self._cache is not None
        log(_MEGATRON_LOG, logging.INFO, f"Load the {type(self).__name__} indices")
        for number, (array, label) in enumerate(
            (("dataset_index", "dataset index"), ("dataset_sample_index", "dataset sample index"))
        ):
            path = self._cache.array_path(array)
            log(_MEGATRON_LOG, logging.INFO, f"\tLoad the {label} from {path}")
            log_elapsed(_MEGATRON_LOG, seconds if number == 0 else 0.0)

    def data_prefixes(self) -> list[str]:
        """The `.bin`/`.idx` prefixes of every member dataset (fingerprinted beside the cache
        entry: without weights, the blend depends on the members' lengths)."""
        prefixes: dict[str, None] = {}  # ordered set: a list was quadratic in the sources
        for dataset in self.datasets:
            prefixes.update(dict.fromkeys(getattr(dataset, "data_prefixes", list)()))
        return list(prefixes)

    def _data_check(self) -> str:
        return str(getattr(self.config, "cache_data_check", "rebuild"))

    def _load_cached(self, why: str) -> dict[str, npt.NDArray[Any]]:
        """The cached arrays, loaded without building (deferred mapping, fast_cache_load).

        Raises:
            CacheMissingError: a file of the entry is missing (megatron-core: FileNotFoundError).
            CacheError: a file is unreadable or does not fit.
            StaleCacheError: the data changed since the entry was built.
        """
        assert self._cache is not None
        arrays, problems = self._cache.load(
            self._specs(), check_description=not self.config.fast_cache_load
        )
        if arrays is None:
            message = (
                f"BlendedDataset {self.split.name}: no valid blend cache to load ({why} loads "
                "caches built beforehand, it never builds them): " + "; ".join(problems)
            )
            if not self._cache.all_present():
                raise CacheMissingError(message)
            raise CacheError(message)
        if not getattr(self, "_data_verified", False):
            self._cache.check_deferred(self.data_prefixes(), self._data_check())
            self._data_verified = True
        return arrays

    def _load_deferred(self) -> None:
        arrays = self._load_cached("defer_npy_index_mmap")
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    # -- pickling ----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._cache is not None and self._cache.all_present():
            state["dataset_index"] = state["dataset_sample_index"] = None
        state["_servers"] = {}  # per process (they hold torch and buffer pools)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # -- access ------------------------------------------------------------------------------

    def __len__(self) -> int:
        if self.dataset_index is None and not self.config.defer_npy_index_mmap:
            self._load_deferred()
        if self.dataset_index is None:
            return self._total()
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if self.dataset_index is None:
            self._load_deferred()
        assert self.dataset_index is not None and self.dataset_sample_index is not None
        dataset_id = self.dataset_index[idx]
        dataset_sample_id = self.dataset_sample_index[idx]
        if dataset_id < 0 or dataset_sample_id < 0 or dataset_id >= len(self.datasets):
            self._refuse_ids(np.asarray([idx]), np.asarray([dataset_id]), [dataset_sample_id])
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][dataset_sample_id]}

    def _refuse_ids(self, where: Any, dataset_ids: Any, sample_ids: Any) -> None:
        """IndexError for the first id outside its range. Ranks that trust the builders skip the
        value checks of a cached entry, and Python and numpy indexing would wrap a negative id
        around to another sample: an id from a damaged file must fail, naming the file, instead.
        """
        sample_ids = np.asarray(sample_ids)
        bad = (dataset_ids < 0) | (dataset_ids >= len(self.datasets)) | (sample_ids < 0)
        at = int(np.argmax(bad))
        source = (
            f"{self._cache.array_path('dataset_index')} / dataset_sample_index"
            if self._cache is not None
            else "the blend's index"
        )
        raise IndexError(
            f"{source}: sample {int(where[at])} names dataset {int(dataset_ids[at])} (of "
            f"{len(self.datasets)}) and its sample {int(sample_ids[at])}: a damaged index"
        )

    def __getitems__(self, indices: Sequence[int]) -> SampleBatch | list[Any]:
        """A batch (torch's batched-fetch protocol): see `get_batch` and `SampleBatch`.

        When the members in the batch cannot fill one set of batch buffers (a member without a
        batch layout, e.g. a GPTDataset subclass that overrides `__getitem__`), or a subclass
        overrides `__getitem__`, the batch is `[self[i] for i in indices]`: what torch fetches
        from a dataset without `__getitems__`, so every sample comes from `__getitem__`.
        """
        if type(self).__getitem__ is not BlendedDataset.__getitem__:
            return [self[index] for index in indices]
        tensors = self._gather(indices, pin_memory=False)
        if tensors is None:
            return [self[index] for index in indices]
        return SampleBatch(tensors, int(tensors["dataset_id"].shape[0]))

    def get_batch(
        self, indices: Sequence[int] | npt.NDArray[np.integer], *, pin_memory: bool = False
    ) -> dict[str, torch.Tensor]:
        """Samples `indices` stacked: `dataset_id` `[B]` (int16, or int32 for huge blends), then
        the members' keys with a leading batch dimension (see `GPTDataset.get_batch`).

        Args:
            indices: sample indices (negative counts from the end).
            pin_memory: allocate the outputs in page-locked memory (needs an accelerator).

        Returns:
            One tensor per key, in `__getitem__`'s key order.

        Raises:
            IndexError: an index is outside [-len, len) (the message names it).
            TypeError: the indices are not integers.
        """
        tensors = self._gather(indices, pin_memory=pin_memory)
        if tensors is None:
            index_array, _ = as_index_array(indices)
            tensors = stack_samples([self[index] for index in index_array.tolist()])
            if pin_memory:
                tensors = {key: value.pin_memory() for key, value in tensors.items()}
        return tensors

    def _gather(
        self, indices: Sequence[int] | npt.NDArray[np.integer], *, pin_memory: bool
    ) -> dict[str, torch.Tensor] | None:
        """The batch gathered by the members into one set of buffers, or None when the members
        in it share no batch layout."""
        import torch

        if self.dataset_index is None:
            self._load_deferred()
        assert self.dataset_index is not None and self.dataset_sample_index is not None
        index_array, padding = as_index_array(indices)
        if padding is not None:
            raise TypeError("BlendedDataset indices must be integers, got None")
        total = int(self.dataset_index.shape[0])
        outside = (index_array < -total) | (index_array >= total)
        if outside.any():
            bad = int(index_array[int(np.argmax(outside))])
            raise IndexError(f"sample index {bad} is out of range for a blend of {total} samples")
        dataset_ids = self.dataset_index[index_array]
        sample_ids = np.ascontiguousarray(self.dataset_sample_index[index_array], dtype=np.int64)
        members = np.unique(dataset_ids).tolist()
        if members and (
            members[0] < 0 or members[-1] >= len(self.datasets) or sample_ids.min() < 0
        ):
            self._refuse_ids(index_array, dataset_ids, sample_ids)
        used = [self.datasets[member] for member in members]
        if not used:
            raise ValueError("get_batch needs at least one index")
        layout = _shared_layout(used)
        if layout is None:
            return None
        parts = []
        for member, dataset in zip(members, used):
            rows = np.flatnonzero(dataset_ids == member).astype(np.int64)
            parts.append((dataset, sample_ids[rows], rows))
        tensors = self._server_for(layout).serve(index_array.shape[0], parts, pin_memory=pin_memory)
        dataset_id = torch.from_numpy(np.ascontiguousarray(dataset_ids))
        if pin_memory:
            dataset_id = dataset_id.pin_memory()
        return {"dataset_id": dataset_id, **tensors}

    def _server_for(self, layout: BatchLayout) -> BatchServer:
        """The batch server of `layout` in this process (loader threads share it)."""
        server = self._servers.get(layout)
        if server is None:
            server = self._servers.setdefault(layout, BatchServer(layout))
        return server


def _shared_layout(datasets: Sequence[Any]) -> BatchLayout | None:
    """The batch layout all `datasets` share (`tokenmill.serving.Servable`), or None when one of
    them is not servable or two differ (the batch is then stacked from samples)."""
    layout: BatchLayout | None = None
    for dataset in datasets:
        batch_layout = getattr(dataset, "batch_layout", None)
        found = batch_layout() if batch_layout is not None else None
        if found is None or (layout is not None and found != layout):
            return None
        layout = found
    return layout
