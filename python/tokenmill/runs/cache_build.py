"""Build a run's index caches offline, and verify them, so training starts with cache hits.

`build_cache(run, sizes)` runs `BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True,
config).build()` in this process, without torch.distributed, so every GPTDataset and
BlendedDataset index (and, when the config asks for packing, every PackedDataset plan) is
written to `path_to_cache` exactly as the trainer would write it: the same file names and the
same bytes, because it is the same code path. A launch with the same config then hits the
cache on every rank. Entries already present and valid are left untouched (no file is
rewritten).

Next to the entries it writes a build record, `tokenmill-build-<md5>.json` (md5 of the config
identity and sizes): the config, the sizes, every entry and its files, and a fingerprint of each
dataset's `.bin`/`.idx` (`tokenmill.index.fingerprint`). `check_cache(run, sizes)` walks the same builder
without writing anything and lists every problem: a missing or truncated file, a wrong dtype
or shape, a description that differs from the config, and data whose fingerprint changed since
the build (a replaced shard), which megatron's cache key cannot see.

Cost: a warm run maps every entry and fingerprints the data (two stats and 256 KiB read per
dataset); a cold run adds the index builds (seconds per 10^8 documents).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tokenmill.common.progress import Progress, format_duration
from tokenmill.errors import CacheError
from tokenmill.index.cache import CacheEvent, CacheSession, IndexCache, cache_session
from tokenmill.runs.config_file import RunConfig

__all__ = [
    "RECORD_PREFIX",
    "CacheReport",
    "SourceSummary",
    "build_cache",
    "check_cache",
    "fingerprint_data",
    "record_path",
]

RECORD_PREFIX = "tokenmill-build-"
_RECORD_FORMAT = "tokenmill.build-cache"
_RECORD_VERSION = 1


def fingerprint_data(prefixes: Sequence[str]) -> dict[str, Any]:
    """The data fingerprint of the run's local datasets (`tokenmill.index.fingerprint`'s scheme,
    the one each cache entry records beside itself: size, times and hashes per file).
    Object-storage prefixes are left out: their reads are pinned to an object version by ETag.

    Raises:
        FileNotFoundError: a data file is missing.
    """
    from tokenmill.index.fingerprint import fingerprint_prefixes

    return fingerprint_prefixes(_local(prefixes))


def _local(prefixes: Sequence[str]) -> list[str]:
    return [prefix for prefix in prefixes if not prefix.startswith(("s3://", "msc://"))]


@dataclass(frozen=True)
class SourceSummary:
    """One mid-level dataset of the run: its prefix, split, size and epochs."""

    dataset_path: str
    split: str
    samples: int
    epochs: int
    documents: int
    drawn: int | None = None
    """Samples the split's blend takes from it (None when the split is not a blend)."""


@dataclass
class CacheReport:
    """What `build_cache` / `check_cache` did.

    Attributes:
        cache_dir: the cache directory.
        record: the build record's path.
        splits: per split, (class name, samples) or None for an empty split.
        sources: every mid-level dataset.
        entries: every cache entry touched, with whether it was built.
        bytes_written: bytes of the files this call wrote.
        seconds: wall time.
        problems: what `check_cache` found (empty after a build).
    """

    cache_dir: str
    record: str
    splits: list[tuple[str, int] | None] = field(default_factory=list)
    sources: list[SourceSummary] = field(default_factory=list)
    entries: list[CacheEvent] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def built(self) -> int:
        return sum(1 for event in self.entries if event.saved)

    @property
    def hits(self) -> int:
        return sum(1 for event in self.entries if not event.built)

    def summary(self) -> str:
        """A human-readable multi-line summary."""
        lines = [f"cache: {self.cache_dir}"]
        for split, value in zip(("train", "valid", "test"), self.splits):
            text = "empty" if value is None else f"{value[0]} with {value[1]:,} samples"
            lines.append(f"  {split}: {text}")
        lines.append("  sources (split, samples, epochs, documents, drawn by the blend):")
        for source in self.sources:
            drawn = "" if source.drawn is None else f", {source.drawn:,} drawn"
            lines.append(
                f"    {source.dataset_path} [{source.split}]: {source.samples:,} samples, "
                f"{source.epochs} epoch(s), {source.documents:,} documents{drawn}"
            )
        lines.append(
            f"  {len(self.entries)} cache entries: {self.hits} hits, {self.built} built; "
            f"{self.bytes_written:,} bytes written in {self.seconds:.2f} s"
        )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "cache_dir": self.cache_dir,
            "record": self.record,
            "splits": self.splits,
            "sources": [vars(source) for source in self.sources],
            "entries": [
                {"base": event.cache.base, "built": event.built, "saved": event.saved}
                for event in self.entries
            ],
            "hits": self.hits,
            "built": self.built,
            "bytes_written": self.bytes_written,
            "seconds": self.seconds,
            "problems": self.problems,
        }


def _resolve_sizes(run: RunConfig, sizes: Sequence[int | None] | None) -> list[int | None]:
    if sizes is not None:
        return list(sizes)
    if run.sizes is not None:
        return list(run.sizes)
    raise ValueError(f"{run.path}: no sizes: give --sizes TRAIN VALID TEST or 'sizes' in the file")


def _cache_dir(run: RunConfig) -> str:
    if not run.config.path_to_cache:
        raise ValueError(
            f"{run.path}: path_to_cache must be set (without it megatron keeps BlendedDataset "
            "indices in memory and rebuilds them at every launch)"
        )
    from tokenmill.storage.remote_cache import is_remote_cache

    if is_remote_cache(run.config.path_to_cache):
        raise ValueError(
            f"{run.path}: path_to_cache {run.config.path_to_cache!r} is remote; build-cache "
            "writes a local directory (then `tokenmill publish` it)"
        )
    return run.config.path_to_cache


def record_path(run: RunConfig, sizes: Sequence[int | None]) -> str:
    """The build record of this config and sizes inside the cache directory."""
    key = json.dumps({"config": run.identity, "sizes": list(sizes)}, sort_keys=True)
    digest = hashlib.md5(key.encode("utf-8"), usedforsecurity=False).hexdigest()
    return os.path.join(_cache_dir(run), f"{RECORD_PREFIX}{digest}.json")


class _EntryProgress:
    """build-cache's progress: one count per cache entry, with the entry last seen::

    [build-cache] 12 entries (3 built) elapsed 0:00:04: built <md5>-GPTDataset-train (0.52 s)
    """

    def __init__(self, enabled: bool, stream: TextIO | None) -> None:
        self.built = 0
        self.last = ""
        self.lock = threading.Lock()  # the builder constructs a blend's members on threads
        # in a log: the first entry at once, then a line every few seconds, and the last
        self.display = Progress(
            "build-cache",
            unit="entry",
            status=self.status,
            postfix=lambda: self.last,
            enabled=enabled,
            stream=stream,
            log_interval=5.0,
            first_line_now=True,
        )

    def status(self) -> str:
        display = self.display
        return (
            f"{int(display.count)} entries ({self.built} built) elapsed "
            f"{format_duration(display.elapsed)}: {self.last}"
        )

    def __call__(self, event: CacheEvent) -> None:
        what = "built" if event.built else "hit"
        with self.lock:
            self.built += int(event.built)
            self.last = f"{what} {event.cache.base} ({event.seconds:.2f} s)"
            self.display.update()

    def close(self) -> None:
        self.display.close(final_line=bool(self.last))


def _walk(run: RunConfig, sizes: list[int | None], session: CacheSession) -> CacheReport:
    from tokenmill.common import distributed
    from tokenmill.datasets.blended import BlendedDataset
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset

    if distributed.is_initialized():
        raise RuntimeError(
            "build-cache runs in one process; call it without torch.distributed initialised"
        )
    report = CacheReport(_cache_dir(run), record_path(run, sizes))
    started = time.perf_counter()
    with cache_session(session):
        # The fast-startup flags only make sense when consuming a built cache (they never
        # build one): off here, as Megatron-LM's tools/prepare_cache.py turns them off.
        config = dataclasses.replace(run.config, fast_cache_load=False, defer_npy_index_mmap=False)
        datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        if run.packing is not None:
            from tokenmill.datasets.packed import PackedDataset
            from tokenmill.formats.megatron import IndexedDataset

            for prefix in run.prefixes():
                PackedDataset(IndexedDataset(prefix), run.packing)

    def describe_gpt(dataset: Any, drawn: int | None) -> SourceSummary:
        plan = dataset._plan()
        return SourceSummary(
            str(dataset.dataset_path),
            dataset.index_split.name,
            len(dataset),
            int(plan.num_epochs),
            int(plan.num_documents),
            drawn,
        )

    for split in datasets:
        items = split if isinstance(split, list) else [split]
        if split is None:
            report.splits.append(None)
            continue
        report.splits.append(
            (type(split).__name__, sum(len(item) for item in items if item is not None))
        )
        for item in items:
            if isinstance(item, BlendedDataset):
                import numpy as np

                assert item.dataset_index is not None
                counts = np.bincount(item.dataset_index, minlength=len(item.datasets))
                for member, count in zip(item.datasets, counts.tolist()):
                    report.sources.append(describe_gpt(member, int(count)))
            elif item is not None:
                report.sources.append(describe_gpt(item, None))
    report.entries = list(session.events)
    report.seconds = time.perf_counter() - started
    return report


def _entry_files(cache: IndexCache) -> list[str]:
    names = [cache.description_path.name]
    names.extend(cache.array_path(name).name for name in cache.array_names)
    if cache.fingerprint_path.is_file():
        names.append(cache.fingerprint_path.name)
    return names


def _record(run: RunConfig, sizes: list[int | None], report: CacheReport) -> dict[str, Any]:
    entries = []
    seen: set[str] = set()
    for event in report.entries:
        if event.cache.base in seen:
            continue
        seen.add(event.cache.base)
        entries.append({"base": event.cache.base, "files": _entry_files(event.cache)})
    return {
        "format": _RECORD_FORMAT,
        "version": _RECORD_VERSION,
        "config": run.identity,
        "sizes": sizes,
        "entries": entries,
        "data": fingerprint_data(run.prefixes()),
    }


def _read_record(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as stream:
        payload = json.load(stream)
    if not isinstance(payload, dict) or payload.get("format") != _RECORD_FORMAT:
        raise ValueError(f"{path}: not a tokenmill build record")
    if payload.get("version") != _RECORD_VERSION:
        raise ValueError(f"{path}: unsupported build record version {payload.get('version')!r}")
    return payload


def _data_changes(run: RunConfig, recorded: dict[str, Any], record: str) -> list[str]:
    from tokenmill.index.fingerprint import differences, fingerprint_as_recorded

    try:
        current = fingerprint_as_recorded(_local(run.prefixes()), recorded.get("data", {}))
    except FileNotFoundError as error:
        return [f"{error.filename}: data file missing"]
    return [
        f"{record}: data changed since the cache was built: {change}"
        for change in differences(recorded.get("data", {}), current)
    ]


def build_cache(
    run: RunConfig,
    sizes: Sequence[int | None] | None = None,
    *,
    progress: bool = True,
    stream: TextIO | None = None,
) -> CacheReport:
    """Build every index cache the run needs (a no-op for entries already valid).

    Args:
        run: the config (see `tokenmill.runs.config_file.load_run_config`).
        sizes: samples per split (default: the file's `sizes`).
        progress: draw a progress line on `stream` (stderr).

    Returns:
        The report: splits, sources, entries built and hit, bytes written, time.

    Entries built from data that changed since (a replaced `.bin`/`.idx`) follow the config's
    `cache_data_check`: rebuilt (the default), StaleCacheError ("error"), or kept ("off", as
    megatron-core does).

    Raises:
        ValueError: no sizes or no path_to_cache.
        StaleCacheError: stale entries under cache_data_check="error".
    """
    resolved = _resolve_sizes(run, sizes)
    record = record_path(run, resolved)
    line = _EntryProgress(progress, stream)
    session = CacheSession(on_event=line)
    try:
        report = _walk(run, resolved, session)
    finally:
        line.close()
    written = 0
    for event in report.entries:
        if event.saved:
            written += sum(
                os.path.getsize(os.path.join(report.cache_dir, name))
                for name in _entry_files(event.cache)
            )
    payload = _record(run, resolved, report)
    text = json.dumps(payload, indent=1, sort_keys=True) + "\n"
    if not os.path.exists(record) or Path(record).read_text(encoding="utf-8") != text:
        from tokenmill.common.atomic import atomic_write_text

        atomic_write_text(Path(record), text)
        written += len(text.encode("utf-8"))
    report.bytes_written = written
    return report


def check_cache(run: RunConfig, sizes: Sequence[int | None] | None = None) -> CacheReport:
    """Verify a built cache against its config and data without writing anything.

    Checks every entry's files (present, readable, dtype and shape the config implies,
    description identical) and the data fingerprints in the build record.

    Returns:
        The report; `report.problems` lists each problem (empty when the cache is good).

    Raises:
        ValueError: no sizes or no path_to_cache.
    """
    resolved = _resolve_sizes(run, sizes)
    record = record_path(run, resolved)
    problems: list[str] = []
    try:
        problems.extend(_data_changes(run, _read_record(record), record))
    except FileNotFoundError:
        problems.append(f"{record}: missing (no build-cache record for this config and sizes)")
    except ValueError as error:
        problems.append(str(error))
    session = CacheSession(check_only=True)
    try:
        report = _walk(run, resolved, session)
    except (OSError, ValueError, IndexError, CacheError) as error:
        report = CacheReport(_cache_dir(run), record)
        problems.append(f"cannot open the datasets of {run.path}: {error}")
    for event in report.entries:
        problems.extend(event.problems)
    report.problems = problems
    return report
