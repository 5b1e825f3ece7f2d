"""BlendedMegatronDatasetBuilder: megatron-core's train/valid/test construction, exactly.

For each split the builder returns None (empty split), a mid-level dataset (one prefix without
weights), a BlendedDataset (several prefixes), or, for `multiple_validation_sets`, a list of
validation datasets. Weighted blends ask every member for
`ceil(ceil(size * w) * (1 + mid_level_dataset_surplus))` samples and blend
`sum_d ceil(size * w_d)`; unweighted blends build one epoch of each member and blend
`min(size, total)` samples, or all of them when the size is None.

Ranks: under torch.distributed the cache-building ranks (global rank 0, or every node's first
rank with `cache_build_scope="node"`) construct each dataset first, then a collective that
carries their outcome (`distributed.build_then_share`: a builder's exception is raised on every
rank at once), then the other ranks construct it, trusting the builders' data check, and hit the
cache. Ranks where `is_built_on_rank()` is False get None but join every collective, so no rank
hangs.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenmill.common import distributed
from tokenmill.common.mapping import READ_BELOW
from tokenmill.common.megatron_log import log, megatron_logger
from tokenmill.common.whole_read import reading_ahead
from tokenmill.datasets.blended import BlendedDataset
from tokenmill.datasets.config import BlendedMegatronDatasetConfig, GPTDatasetConfig
from tokenmill.datasets.raw_text import resolve_raw_text
from tokenmill.datasets.utils import (
    Split,
    SplitMatrix,
    get_size_per_split_per_dataset,
    normalize,
    split_bounds,
    split_document_ids,
)
from tokenmill.errors import MegatronAssertionError, ResourceLimitError
from tokenmill.index.blending import compute_ahead, discard_ahead
from tokenmill.index.cache import encode_evidence, once_per_file, trusting_builder, vouching
from tokenmill.index.cache_writes import (
    BuildStoppedError,
    batch_has_entries,
    deferred_commits,
    stop_batch,
)
from tokenmill.index.fingerprint import SAMPLE_BYTES

__all__ = ["BlendedMegatronDatasetBuilder"]

# what a read ahead reads: an .idx whole up to the size its reader reads whole (a larger one is
# mapped), the first and last bytes of a .bin its data fingerprint hashes
_AHEAD = (READ_BELOW, SAMPLE_BYTES)

logger = logging.getLogger(__name__)
_MEGATRON_LOG = megatron_logger("blended_megatron_dataset_builder")


@contextlib.contextmanager
def _older_objects_not_traversed() -> Iterator[None]:
    """Within the block, the cyclic garbage collector skips the objects that existed before it
    (``gc.freeze``): opening thousands of sources allocates enough objects to trigger full
    collections, and each traversed every object of the process (hundreds of thousands once
    torch is imported). Unlike the ``gc.disable()`` this replaces, no collection is paused, for
    this thread or any other. Skipped when the process has frozen objects itself (a DataLoader
    set-up that avoids copy-on-write): unfreezing would undo that. Worth keeping (A/B at 1,000
    sources, benchmarks/SCALE.md): without it the CPU time of a cold build is 14 % higher, of a
    warm open 16-44 %, of a rank that does not build 27-48 %."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _in_order_stopping_at_failure(
    build_one: Callable[[int], list[Any]], prefixes: Sequence[str], threads: int
) -> Iterator[list[Any]]:
    """build_one(0), build_one(1), ... on a pool of `threads`, each task in a copy of this
    build's context (contextvars: the build context, its batch, trust and memo), results in
    order. At the first failure no further member starts, and the enclosing batch takes no entry
    written after it (`cache_writes.stop_batch`): nothing is built or committed after the
    first failure; the error is raised once the members already running have returned."""
    stopped = threading.Event()
    failures: list[BaseException] = []  # in the order they happened; the first is the cause

    def guarded(number: int) -> list[Any]:
        if stopped.is_set():
            raise _Skipped
        try:
            return build_one(number)
        except BaseException as error:
            if not isinstance(error, BuildStoppedError):
                failures.append(error)
            stopped.set()
            stop_batch()
            raise

    with ThreadPoolExecutor(max_workers=threads) as executor:
        futures: list[Future[list[Any]]] = [
            executor.submit(contextvars.copy_context().run, guarded, number)
            for number in range(len(prefixes))
        ]
        try:
            for future in futures:
                try:
                    result = future.result()
                except _Skipped:
                    continue  # a later member skipped after an earlier one failed
                except BuildStoppedError:
                    # an earlier member, still running when a later one failed, was refused its
                    # commit: the later member's error is the cause, raised instead
                    if failures:
                        raise failures[0] from None
                    raise
                yield result
        except BaseException:
            stopped.set()
            for future in futures:
                future.cancel()
            raise
        finally:
            stopped.set()


class _Skipped(Exception):
    """A member not started because an earlier one failed."""


def _sum_or_zero(values: Sequence[Any]) -> int:
    return int(sum(values))


class BlendedMegatronDatasetBuilder:
    """Build the [train, valid, test] datasets of a config (megatron-core's builder).

    Args:
        cls: the mid-level dataset class (GPTDataset, MockGPTDataset, ...).
        sizes: samples per split, each an int or None.
        is_built_on_rank: returns whether this rank needs the datasets.
        config: the dataset config.
    """

    def __init__(
        self,
        cls: type[Any],
        sizes: Sequence[int | None],
        is_built_on_rank: Callable[[], bool],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if len(sizes) != len(Split):
            raise ValueError(f"sizes must have {len(Split)} entries, got {list(sizes)}")
        self.cls = cls
        self.sizes = sizes  # the caller's object, kept and logged as megatron does (a tuple too)
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        shown = getattr(config, "megatron_repr", config.__repr__)()
        log(
            _MEGATRON_LOG,
            logging.INFO,
            f"Building {cls.__name__} splits with sizes={self.sizes} and config={shown}",
        )
        if not config.mock:
            for split in Split:
                if self.sizes[split.value] is not None:
                    continue
                if config.blend_per_split is None:
                    assert config.blend is not None
                    weights = config.blend[1]
                else:
                    blend = config.blend_per_split[split.value]
                    if blend is None:
                        continue
                    weights = blend[1]
                if weights is not None:
                    raise MegatronAssertionError(
                        f"the {split.name} split has weights but no size: weighted blends need a "
                        "size (with multiple_validation_sets, give validation blends no weights)"
                    )

    # -- rank coordination -------------------------------------------------------------------

    def _scope(self) -> str:
        return str(getattr(self.config, "cache_build_scope", "global"))

    def _fast_cache_load(self) -> bool:
        return isinstance(self.config, GPTDatasetConfig) and self.config.fast_cache_load

    @staticmethod
    def build_generic_dataset(
        cls: Callable[..., Any],
        is_built_on_rank: Callable[[], bool],
        synchronize_ranks: bool,
        *args: Any,
        scope: str = "global",
    ) -> Any:
        """Construct `cls(*args)`: builders first, a barrier, then the other ranks.

        Returns None on ranks where `is_built_on_rank()` is False (under torch.distributed).
        """
        if not distributed.is_initialized():
            return cls(*args)
        builder = distributed.is_cache_builder(scope)
        dataset = None

        def build() -> Any:
            try:
                return cls(*args)
            except OSError as error:
                if isinstance(error, ResourceLimitError):
                    raise
                raise RuntimeError(
                    "failed to write dataset indices to the cache directory: set path_to_cache "
                    f"to a directory this job can write ({error})"
                ) from error

        work = build if builder and is_built_on_rank() else None
        evidence = None
        if synchronize_ranks:
            with vouching() as vouched:
                shared = distributed.build_and_vouch(
                    work, lambda: encode_evidence(vouched), scope=scope
                )
            dataset, evidence = shared.result, shared.evidence
        elif work is not None:
            dataset = work()
        if not builder and is_built_on_rank():
            # the builders' verdict is known only after the collective (or an enclosing one),
            # with the digest of each entry they checked
            with trusting_builder(evidence) if synchronize_ranks else contextlib.nullcontext():
                dataset = cls(*args)
        return dataset

    # -- public ------------------------------------------------------------------------------

    def build(self) -> list[Any]:
        """Build every split; see the module docstring for the cases.

        Must be called on every rank when torch.distributed is initialised.
        """
        # blend entries naming raw text become cached prefixes (all ranks tokenize together)
        self.config = resolve_raw_text(self.config)
        self._check_tokenizer_fingerprints()
        with once_per_file(), _older_objects_not_traversed():
            datasets = self._build_blended_dataset_splits()
        for split, dataset in zip(Split, datasets):
            if dataset is None or isinstance(dataset, list) or len(dataset) == 0:
                continue
            if isinstance(dataset, BlendedDataset):
                if dataset.size is not None and dataset.size != len(dataset):
                    raise RuntimeError(
                        f"{split.name} blend has {len(dataset)} samples, expected {dataset.size}"
                    )
            elif getattr(dataset, "num_samples", None) is not None and dataset.num_samples > len(
                dataset
            ):
                raise RuntimeError(
                    f"{split.name} dataset has {len(dataset)} samples, fewer than the "
                    f"{dataset.num_samples} requested"
                )
        return datasets

    def _prefixes(self) -> list[str]:
        blends = [self.config.blend] if self.config.blend else (self.config.blend_per_split or [])
        prefixes: dict[str, None] = {}  # ordered set: blends of 10,000 prefixes
        for blend in blends:
            if blend is not None:
                prefixes.update(dict.fromkeys(blend[0]))
        return list(prefixes)

    def _check_tokenizer_fingerprints(self) -> None:
        """Refuse to blend shards written by different tokenizers (tokenmill's sidecars).

        Datasets written by `tokenmill tokenize` carry `<prefix>.tokenmill.json`; those that have
        one must agree with each other, and with the config's tokenizer when it is one of
        tokenmill's. Datasets without a sidecar (e.g. megatron's preprocess_data.py) are not
        checked.

        Raises:
            TokenizerMismatchError: two datasets, or a dataset and the tokenizer, differ.
        """
        if self.config.mock:
            return
        from tokenmill.formats.dataset_sidecar import (
            FingerprintedTokenizer,
            check_compatible,
            check_tokenizer,
            sidecar_path,
        )

        described = [
            local
            for local in (self._described_prefix(p, sidecar_path) for p in self._prefixes())
            if local is not None
        ]
        if len(described) >= 2:
            check_compatible(described)
        if described and isinstance(self.config.tokenizer, FingerprintedTokenizer):
            check_tokenizer(described[0], self.config.tokenizer)

    def _described_prefix(self, prefix: str, sidecar_path: Any) -> str | None:
        """A local prefix whose sidecar describes `prefix`, or None if it has none. For `s3://`
        prefixes the sidecar is fetched into the object-storage cache (once per version)."""
        if not prefix.startswith("s3://"):
            return prefix if os.path.exists(sidecar_path(prefix)) else None
        storage = getattr(self.config, "object_storage_cache_path", None)
        if storage is None:
            return None  # build_low_level_dataset reports the missing cache path
        from tokenmill.storage.local_cache import cache_object_if_exists
        from tokenmill.storage.object_storage import ObjectStorageConfig
        from tokenmill.storage.s3 import client_for

        config = ObjectStorageConfig.coerce(storage) if not isinstance(storage, str) else None
        root = config.path_to_idx_cache if config is not None else storage
        sidecar = sidecar_path(prefix)
        local = cache_object_if_exists(
            sidecar, root, client_for(config.retry if config is not None else None)
        )
        return None if local is None else local[: len(local) - (len(sidecar) - len(prefix))]

    # -- splits ------------------------------------------------------------------------------

    def _build_blended_dataset_splits(self) -> list[Any]:
        config = self.config
        if config.mock:
            assert config.split_matrix is not None
            try:
                return self._build_megatron_dataset_splits(None, config.split_matrix, self.sizes)
            except Exception as error:
                raise RuntimeError(
                    f"{self.cls.__name__} failed to build as a mock data generator"
                ) from error
        if config.blend:
            prefixes, weights = config.blend
            assert config.split_matrix is not None
            return self._build_blend(list(prefixes), weights, config.split_matrix, self.sizes)

        assert config.blend_per_split is not None
        results: list[Any] = [None] * len(Split)
        for i in range(len(Split)):
            blend = config.blend_per_split[i]
            if blend is None:
                continue
            spoof_split: SplitMatrix = [None] * len(Split)
            spoof_split[i] = (0.0, 1.0)
            spoof_sizes: list[int | None] = [0] * len(Split)
            spoof_sizes[i] = self.sizes[i]
            prefixes, weights = list(blend[0]), blend[1]
            if len(prefixes) == 1:
                results[i] = self._build_megatron_dataset_splits(
                    prefixes[0], spoof_split, spoof_sizes
                )[i]
                continue
            if config.multiple_validation_sets and i == Split.valid.value:
                if config.full_validation and spoof_sizes[i] is not None:
                    raise MegatronAssertionError(
                        "full_validation needs the validation size to be None"
                    )
                results[i] = [
                    self._build_megatron_dataset_splits(prefix, spoof_split, spoof_sizes)[i]
                    for prefix in prefixes
                ]
                continue
            results[i] = self._build_blend(prefixes, weights, spoof_split, spoof_sizes)[i]
        return results

    def _build_blend(
        self,
        prefixes: list[str],
        weights: Sequence[float] | None,
        split: SplitMatrix,
        sizes: Sequence[int | None],
    ) -> list[Any]:
        """Mid-level datasets for every prefix, then one BlendedDataset per split."""
        normalized = normalize(weights) if weights is not None else None
        if len(prefixes) == 1 and normalized is None:
            return self._build_megatron_dataset_splits(prefixes[0], split, sizes)
        if normalized is None:
            per_dataset: list[list[int | None]] = [[None] * len(Split) for _ in prefixes]
            targets: list[list[int]] | None = None
        else:
            targets = get_size_per_split_per_dataset(normalized, sizes)
            buffered = get_size_per_split_per_dataset(
                normalized, sizes, surplus=self.config.mid_level_dataset_surplus
            )
            per_dataset = [list(row) for row in buffered]

        def blending_ahead() -> None:
            # the members were not cached, so the blend (whose description holds theirs) most
            # likely is not either: its greedy indices are computed on another core while the
            # members are built
            if self.config.defer_npy_index_mmap or self.config.fast_cache_load:
                return
            for i in range(len(Split)):
                if split[i] is not None and normalized is not None and sizes[i] is not None:
                    assert targets is not None
                    # what BlendedDataset passes: it normalises the weights it is given
                    compute_ahead(
                        normalize(list(normalized)), _sum_or_zero([r[i] for r in targets])
                    )

        # Alone (no process group), the members' entries and the blends' are committed together:
        # one syncfs for all, where the blend's few files would be fsynced apart after the
        # members' syncfs. Under torch.distributed each collective follows its own commit.
        together = contextlib.nullcontext() if distributed.is_initialized() else deferred_commits()
        try:
            with together:
                members = self._build_megatron_datasets_parallel(
                    prefixes, split, per_dataset, blending_ahead
                )
                return self._blend_members(members, prefixes, normalized, targets, split, sizes)
        finally:
            discard_ahead()

    def _blend_members(
        self,
        members: list[list[Any]],
        prefixes: list[str],
        normalized: list[float] | None,
        targets: list[list[int]] | None,
        split: SplitMatrix,
        sizes: Sequence[int | None],
    ) -> list[Any]:
        """One BlendedDataset per split of the built members."""
        blended: list[Any] = [None] * len(Split)
        for i in range(len(Split)):
            if split[i] is None:
                continue
            blend_weights: list[Any]
            size: int | None
            if normalized is not None and sizes[i] is not None:
                assert targets is not None
                blend_weights = list(normalized)
                size = _sum_or_zero([row[i] for row in targets])
            elif normalized is None:
                try:
                    blend_weights = [len(member) for member in members[i]]
                except TypeError:  # members are None on ranks that do not build
                    blend_weights = [0 for _ in prefixes]
                size = None if sizes[i] is None else min(int(sizes[i]), sum(blend_weights))  # type: ignore[arg-type]
            else:
                raise ValueError("weighted blends need a size for every non-empty split")
            blended[i] = self.build_generic_dataset(
                BlendedDataset,
                self.is_built_on_rank,
                not self._fast_cache_load(),
                members[i],
                blend_weights,
                size,
                self.config,
                scope=self._scope(),
            )
        return blended

    def _build_megatron_datasets_parallel(
        self,
        prefixes: list[str],
        split: SplitMatrix,
        sizes_per_dataset: list[list[int | None]],
        on_cold_cache: Callable[[], None] | None = None,
    ) -> list[list[Any]]:
        """Mid-level datasets of every prefix, per split: in this thread, or on a pool of
        `num_dataset_builder_threads` threads. `on_cold_cache` is called once, after the first
        member, if building it wrote a cache entry."""

        def build_all(threads: int) -> list[list[Any]]:
            def build_one(number: int) -> list[Any]:
                return self._build_megatron_dataset_splits(
                    prefixes[number], split, sizes_per_dataset[number], False
                )

            def after_each(results: Iterator[list[Any]]) -> list[list[Any]]:
                built = []
                for result in results:
                    built.append(result)
                    if len(built) == 1 and on_cold_cache is not None and batch_has_entries():
                        on_cold_cache()
                return built

            # every entry of the batch committed together: one syncfs, not fsyncs per file; each
            # source's small files read on a thread of the core before the builder needs them
            with deferred_commits(), reading_ahead(self._files_read_ahead(prefixes), *_AHEAD):
                if threads == 1:  # here, not on a pool thread: no hand-over per source
                    built = after_each(build_one(number) for number in range(len(prefixes)))
                else:
                    built = after_each(_in_order_stopping_at_failure(build_one, prefixes, threads))
            by_split: list[list[Any]] = [[] for _ in Split]
            for datasets in built:
                for i, dataset in enumerate(datasets):
                    by_split[i].append(dataset)
            return by_split

        threads = self.config.num_dataset_builder_threads
        if distributed.is_initialized() and not self._fast_cache_load():
            builder = distributed.is_cache_builder(self._scope())
            with vouching() as vouched:
                shared = distributed.build_and_vouch(
                    (lambda: build_all(threads)) if builder else None,
                    lambda: encode_evidence(vouched),
                    scope=self._scope(),
                )
            if builder:
                result: list[list[Any]] = shared.result
                return result
            with trusting_builder(shared.evidence):
                return build_all(threads)
        return build_all(threads)

    def _files_read_ahead(self, prefixes: Sequence[str | None]) -> list[tuple[str, bool]]:
        """What the class reads of each prefix (its `_files_read_ahead`), if this rank builds."""
        hook = getattr(self.cls, "_files_read_ahead", None)
        if hook is None or (distributed.is_initialized() and not self.is_built_on_rank()):
            return []
        return [file for prefix in prefixes if prefix for file in hook(prefix, self.config)]

    def _build_megatron_dataset_splits(
        self,
        dataset_path: str | None,
        split: SplitMatrix,
        sizes: Sequence[int | None],
        synchronize_ranks: bool = True,
    ) -> list[Any]:
        """Every split of one low-level dataset."""
        if self._fast_cache_load():
            synchronize_ranks = False
        if distributed.is_initialized() and not self.is_built_on_rank():
            for bookends in split:
                if bookends is not None and synchronize_ranks:
                    distributed.build_then_share(None)
            return [None] * len(Split)

        return self._build_splits_of(dataset_path, split, sizes, synchronize_ranks)

    def _build_splits_of(
        self,
        dataset_path: str | None,
        split: SplitMatrix,
        sizes: Sequence[int | None],
        synchronize_ranks: bool,
    ) -> list[Any]:
        low_level = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level)
        datasets: list[Any] = []
        for i, split_name in enumerate(Split):
            bookends = split[i]
            if bookends is None:
                datasets.append(None)
                continue
            indices = None
            if not self._fast_cache_load():
                begin, end = split_bounds(bookends, num_elements)
                indices = split_document_ids(begin, end)
            datasets.append(
                self.build_generic_dataset(
                    self.cls,
                    self.is_built_on_rank,
                    synchronize_ranks,
                    low_level,
                    dataset_path,
                    indices,
                    sizes[i],
                    split_name,
                    self.config,
                    scope=self._scope(),
                )
            )
        return datasets
