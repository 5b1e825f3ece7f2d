"""Index caches that megatron-core can read and that never serve a broken file.

Layout (megatron-core's, so caches are interchangeable both ways):
``<dir>/<md5 of description>-<Class>-<split>-description.txt`` plus one ``-<name>.npy`` per
index array, written with ``numpy.save``.

Beyond megatron-core:

* every file is written to a temporary name in the same directory, fsynced and renamed into
  place (`tokenmill.index.cache_writes`, in batches for a blend's members); the description is
  renamed last (the commit point), so a crash leaves no description and the next run sees a
  miss. Committed files are never deleted, and a rebuild renames identical bytes over
  them (the build is deterministic). Temporary files name their writer (host and pid) and are
  removed only when provably abandoned (`tokenmill.common.owner`), by one directory scan per
  process, never one per entry;
* a builder outside a batch takes an exclusive ``fcntl`` lock on ``.<base>.lock`` (removed
  again on release) and re-checks for a hit once it has it, so builders sharing a directory
  usually build once. The
  lock only saves duplicate work: where locks fail (``ENOLCK``) or are node-local, racing
  builders each build and rename the same bytes, and every reader still sees a whole entry;
* a hit requires the description to match byte for byte and each array to have the dtype and
  shape the caller expects; anything else is reported as a problem (the builder rebuilds, other
  ranks raise CacheError) instead of being used. Running out of descriptors or maps raises
  ResourceLimitError (naming the limit) instead: a valid entry is never rebuilt for that;
* a hit also requires the data to be the data the entry was built from: a fingerprint of every
  `.bin`/`.idx` (size, mtime, ctime, inode, the first and last 4 KiB, and the whole `.idx`) is
  written beside the entry as ``<base>-data.tokenmill.json`` before the description, and
  compared when the builder loads (`tokenmill.index.fingerprint`; the ``cache_data_check``
  policy says whether a stale entry is rebuilt or raises StaleCacheError, or whether, as in
  megatron-core, nothing is checked). Ranks that do not build trust the builders' check of an
  entry (:func:`trusting_builder`) only when the copy they read has the digest the builders
  handed over with their collective (:func:`vouching`); such an open costs a constant number of
  filesystem calls per entry, whatever the number and size of its data. Any other copy is
  checked.

The state of one build (deferred commits, trust evidence, vouched digests, the fingerprint memo,
a session) is one `cache_writes.BuildContext` carried by a context variable, never module state.

The protocol (write order, what a reader trusts) is in docs/cache-protocol.md.

Offline tools (``tokenmill build-cache``) watch every cache access through :func:`cache_session`:
a session records each entry that was hit, built or found invalid (or stale), and in
``check_only`` mode never writes: an invalid entry is reported and rebuilt in memory so the walk
over a whole blend can go on and list every problem.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.atomic import FileStatus
from tokenmill.common.cache_directory import check_cache_directory
from tokenmill.common.locks import best_effort_lock
from tokenmill.common.mapping import resource_error
from tokenmill.common.owner import remove_abandoned
from tokenmill.common.whole_read import read_whole, refresh_attributes
from tokenmill.errors import CacheError, DataFormatError, ResourceLimitError, StaleCacheError
from tokenmill.formats.npy import load_npy, load_npy_and_status
from tokenmill.index import cache_checks
from tokenmill.index import fingerprint as data_fingerprint
from tokenmill.index.cache_writes import (
    BuildContext,
    atomic_save_npy,
    batch_active,
    batch_holds,
    build_context,
    current_context,
    deferred_commits,
    entry_digest,
    write_entry,
)
from tokenmill.storage.remote_cache import is_remote_cache, local_cache_directory

logger = logging.getLogger(__name__)

__all__ = [
    "ArraySpec",
    "CacheEvent",
    "CacheSession",
    "EntrySpec",
    "IndexCache",
    "atomic_save_npy",
    "build_context",
    "builders_verified",
    "cache_session",
    "decode_evidence",
    "deferred_commits",
    "encode_evidence",
    "once_per_file",
    "trusting_builder",
    "vouching",
]


@dataclass(frozen=True)
class ArraySpec:
    """What a cached array must look like: allowed dtypes and, where known, its shape."""

    dtypes: tuple[np.dtype[np.generic], ...]
    shape: tuple[int, ...] | None = None
    ndim: int | None = None
    # value-range check implied by the owner (tokenmill.index.cache_checks), run on load and build
    values: cache_checks.ValuesCheck | None = None

    def problem(self, array: npt.NDArray[Any]) -> str | None:
        if array.dtype not in self.dtypes:
            allowed = "/".join(str(d) for d in self.dtypes)
            return f"dtype {array.dtype} (expected {allowed})"
        if self.ndim is not None and array.ndim != self.ndim:
            return f"{array.ndim} dimensions (expected {self.ndim})"
        if self.shape is not None and tuple(array.shape) != self.shape:
            return f"shape {tuple(array.shape)} (expected {self.shape})"
        return None


@dataclass(frozen=True)
class EntrySpec:
    """What a cache entry must hold, and how it is checked (:meth:`IndexCache.load_or_build`).

    Attributes:
        arrays: what each array must look like (None: anything loadable).
        data_prefixes: the `.bin`/`.idx` prefixes the arrays are computed from.
        data_check: "rebuild", "error" or "off" (fingerprint.POLICIES).
        kernel_built: the build returns the output of tokenmill's own index kernels, which the
            test suite holds to the slow references and to megatron-core: its values are not
            checked again before they are saved (dtype and shape still are). Values loaded from
            disk are always checked (or vouched for by the sidecar).
        trust_presence: megatron's fast_cache_load: skip the description comparison.
        data_read: data files the arrays are computed from that were read whole (the `.idx`
            of up to 64 KiB), by path: the ``fstat`` of that open and the bytes. A build takes
            their fingerprint from these very bytes (`fingerprint.fingerprint_read`) instead of
            reading them again.
    """

    arrays: Mapping[str, ArraySpec] | None
    data_prefixes: Sequence[str] = ()
    data_check: str = "off"
    kernel_built: bool = False
    trust_presence: bool = False
    data_read: data_fingerprint.WholeReads | None = None


@dataclass(frozen=True)
class CacheEvent:
    """One access to a cache entry seen by a :class:`CacheSession`.

    Attributes:
        cache: the entry.
        built: whether the arrays were computed (a miss) rather than loaded (a hit).
        saved: whether the computed arrays were written to the cache directory.
        problems: why the entry was not a hit (missing, truncated, foreign files...).
        seconds: time spent loading or building.
    """

    cache: IndexCache
    built: bool
    saved: bool
    problems: tuple[str, ...]
    seconds: float


@dataclass
class CacheSession:
    """Collects the :class:`CacheEvent` of every cache access while it is active.

    Args:
        check_only: never write; report invalid entries and build them in memory only.
        on_event: called after each access (e.g. to draw a progress line).
    """

    check_only: bool = False
    on_event: Callable[[CacheEvent], None] | None = None
    events: list[CacheEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, event: CacheEvent) -> None:
        with self._lock:  # the builder's pool threads record concurrently
            self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)


@contextlib.contextmanager
def trusting_builder(evidence: bytes | Mapping[str, bytes] | None) -> Iterator[None]:
    """Within the block, this build runs as a rank that does not build, after the cache-building
    ranks checked (or rebuilt) their entries and said so through a collective
    (`tokenmill.common.distributed.build_and_vouch`), handing over `evidence`: the digest of
    each entry they checked (:func:`vouching`, :func:`encode_evidence`). An entry whose copy
    here has that digest (its description and data-fingerprint sidecar, one small read) skips
    the data fingerprint and the value checks: the open is a constant number of filesystem
    calls. Any other entry (a node-local copy, a node mirror or an ``s3://`` copy that is not
    the one the builders checked, or no evidence at all) is checked as if nobody had."""
    found = decode_evidence(evidence) if isinstance(evidence, bytes) else evidence
    with build_context() as context:
        previous, context.evidence = context.evidence, dict(found or {})
        try:
            yield
        finally:
            context.evidence = previous


@contextlib.contextmanager
def vouching() -> Iterator[dict[str, bytes]]:
    """Within the block, every entry this build checks or builds records its digest
    (`cache_writes.entry_digest`) in the dict yielded, for a collective to hand to the ranks
    that trust this builder (:func:`trusting_builder`). The digests also reach an enclosing
    block's dict."""
    with build_context() as context:
        previous = context.vouched
        collected: dict[str, bytes] = {}
        context.vouched = collected
        try:
            yield collected
        finally:
            context.vouched = previous
            if previous is not None:
                with context.lock:
                    previous.update(collected)


def encode_evidence(digests: Mapping[str, bytes]) -> bytes:
    """The digests of :func:`vouching` as bytes for a collective."""
    return json.dumps({base: digest.hex() for base, digest in digests.items()}).encode("ascii")


def decode_evidence(evidence: bytes) -> dict[str, bytes]:
    """:func:`encode_evidence`'s bytes back as digests (nothing, if they are not valid)."""
    try:
        found = json.loads(evidence.decode("ascii"))
        return {str(base): bytes.fromhex(digest) for base, digest in found.items()}
    except (ValueError, AttributeError, TypeError):  # trust nothing that does not parse
        return {}


def builders_verified() -> bool:
    """Whether this work runs inside :func:`trusting_builder` (a rank that does not build, after
    the builders reported success)."""
    context = current_context()
    return context is not None and context.evidence is not None


@contextlib.contextmanager
def once_per_file() -> Iterator[None]:
    """Within the block (one dataset build), fingerprint and ``stat`` each data file at most
    once (fingerprint.FileMemo, held by the build context)."""
    with build_context() as context:
        if context.memo is not None:
            yield
            return
        context.memo = data_fingerprint.FileMemo()
        try:
            yield
        finally:
            context.memo = None


def _memo() -> data_fingerprint.FileMemo | None:
    context = current_context()
    return context.memo if context is not None else None


def _read_prefix(path: str | os.PathLike[str], size: int) -> str:
    """The first `size` bytes of `path` as UTF-8, in three system calls (open, pread, close)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return os.pread(descriptor, size, 0).decode("utf-8")
    finally:
        os.close(descriptor)


def _load_array(path: str, want_status: bool) -> tuple[npt.NDArray[Any], FileStatus | None]:
    """The array at `path` (with `want_status`, the status of the file read), read once more
    after this machine's kernel fetched its attributes afresh (`whole_read.refresh_attributes`)
    when it looks damaged: the kernel may still hold the size it saw while another host was
    writing the file under its final name (a racing or killed builder of this host created or
    looked it up), after that host committed it whole. Without this the builder took a
    committed entry for a broken one and rebuilt it over the other host's files.

    Raises:
        FileNotFoundError, ResourceLimitError: as load_npy does (not retried).
        OSError, DataFormatError: the file is unreadable or truncated, read afresh.
    """
    try:
        return load_npy_and_status(path) if want_status else (load_npy(path), None)
    except (FileNotFoundError, ResourceLimitError):
        raise
    except (OSError, DataFormatError):
        if not refresh_attributes(path):
            raise
    return load_npy_and_status(path) if want_status else (load_npy(path), None)


def _sweep_abandoned(directory: Path, context: BuildContext) -> None:
    """Remove the temporary files in `directory` that provably have no live writer, once per
    build and directory (a directory scan per entry made cold starts quadratic)."""
    key = os.fspath(directory)  # a Path hashes through its parsed parts: slower
    with context.lock:
        if key in context.swept:
            return
        context.swept.add(key)
    try:
        remove_abandoned(directory, lambda name: name.startswith(".") and name.endswith(".tmp"))
    except OSError as error:  # best effort: leftovers are hidden and harmless
        logger.debug("cannot sweep %s for abandoned temporary files: %s", directory, error)


def _check_directory_once(directory: str) -> None:
    """Refuse a cache directory every user can write (`common.cache_directory`), with one
    ``stat`` per build and directory: a blend's entries share it (outside a build: per call)."""
    context = current_context()
    if context is not None and directory in context.directories_checked:
        return
    check_cache_directory(directory)
    if context is not None:
        with context.lock:
            context.directories_checked.add(directory)


@contextlib.contextmanager
def cache_session(session: CacheSession) -> Iterator[CacheSession]:
    """Make `session` observe (and, with check_only, prevent) every cache write in the block.

    Raises:
        RuntimeError: another session is already active in this build.
    """
    with build_context() as context:
        if context.session is not None:
            raise RuntimeError("a cache session is already active in this build")
        context.session = session
        try:
            yield session
        finally:
            context.session = None


@dataclass
class _Access:
    """One IndexCache.load_or_build: its inputs, and what each step found for the next."""

    context: BuildContext
    spec: EntrySpec
    may_build: bool
    started: float
    trusted: bool = False  # probe: this copy has the digest the builders handed over
    checking: bool = False  # the data is checked (a policy, data files, not trusted)
    later: bool = False  # values checked after the data check, unless the sidecar vouches
    statuses: dict[str, dict[str, int]] | None = None  # each array file's status (later)
    described: bool | None = None  # whether the description exists (None: not looked at)
    recorded: dict[str, Any] = field(default_factory=dict)  # the sidecar's payload, if valid
    sidecar: list[data_fingerprint.Sidecar] = field(default_factory=list)

    @property
    def session(self) -> CacheSession | None:
        session: CacheSession | None = self.context.session
        return session

    @property
    def check_only(self) -> bool:
        return self.session is not None and self.session.check_only

    def record(self, cache: IndexCache, built: bool, saved: bool, problems: Sequence[str]) -> None:
        session = self.session
        if session is not None:
            seconds = time.perf_counter() - self.started
            session.record(CacheEvent(cache, built, saved, tuple(problems), seconds))


@dataclass(frozen=True)
class IndexCache:
    """The files of one cached dataset: `<directory>/<hash>-<class>-<split>-*`."""

    directory: Path
    base: str
    description: str
    array_names: tuple[str, ...]

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        description_hash: str,
        class_name: str,
        split_name: str,
        description: str,
        array_names: Sequence[str],
    ) -> IndexCache:
        base = f"{description_hash}-{class_name}-{split_name}"
        location = os.fspath(directory)
        remote = is_remote_cache(location)
        # before anything is fetched into (or read from) it: the node mirror of a remote cache
        _check_directory_once(local_cache_directory(location) if remote else location)
        if remote:
            # a manifest or s3:// cache: fetch this entry once per node, then use it locally
            # (an s3:// entry already complete on the node costs no request)
            from tokenmill.storage.remote_cache import fetch_cache_entry

            location = fetch_cache_entry(location, base, array_names)
        return cls(Path(location), base, description, tuple(array_names))

    def path(self, suffix: str) -> Path:
        return self.directory / f"{self.base}-{suffix}"

    def _file(self, suffix: str) -> str:
        """path() as a string (the loads of a warm open take strings)."""
        return os.path.join(self.directory, f"{self.base}-{suffix}")

    @property
    def description_path(self) -> Path:
        return self.path("description.txt")

    def array_path(self, name: str) -> Path:
        return self.path(f"{name}.npy")

    @property
    def fingerprint_path(self) -> Path:
        """The tokenmill-only data fingerprint sidecar of this entry."""
        return self.path(data_fingerprint.FINGERPRINT_SUFFIX)

    def stale_reasons(
        self,
        data_prefixes: Sequence[str],
        recorded_out: dict[str, Any] | None = None,
        sidecar_out: list[data_fingerprint.Sidecar] | None = None,
    ) -> tuple[list[str], dict[str, Any]]:
        """Why this entry does not match the current data (see fingerprint.stale_reasons)."""
        return data_fingerprint.stale_reasons(
            data_prefixes,
            self._file(data_fingerprint.FINGERPRINT_SUFFIX),
            self._file("description.txt"),
            recorded_out,
            _memo(),
            sidecar_out,
        )

    def _digest_here(self) -> bytes:
        """entry_digest of this copy: the description as configured (load compares the file
        with it) and the sidecar's bytes (one read; empty when there is none)."""
        try:
            raw, _ = read_whole(self._file(data_fingerprint.FINGERPRINT_SUFFIX), 1 << 24)
        except FileNotFoundError:
            raw = b""
        return entry_digest(self.description, raw if isinstance(raw, bytes) else b"")

    def all_present(self) -> bool:
        """megatron-core's notion of a hit: every file exists."""
        return self.description_path.is_file() and all(
            self.array_path(name).is_file() for name in self.array_names
        )

    def load(
        self,
        specs: Mapping[str, ArraySpec] | None = None,
        check_description: bool = True,
        check_values: bool = True,
        statuses: dict[str, dict[str, int]] | None = None,
    ) -> tuple[dict[str, npt.NDArray[Any]] | None, list[str]]:
        """Memory-map every array and check it: description, dtype, shape and extent always;
        the values (`cache_checks`) unless `check_values` is False (a rank that trusts the
        builders' verdict: they checked the values when they built or loaded the entry, and a
        committed entry is never rewritten). `statuses`, if given, receives each array file's size,
        mtime, inode and generation (`fingerprint.array_status`).

        Returns:
            (arrays, []) on a valid hit, or (None, problems) naming each missing or bad file.

        Raises:
            ResourceLimitError: out of descriptors or memory maps (the files may be valid).
        """
        context = current_context()
        full = context is not None and context.session is not None
        arrays, problems, _ = self._load(specs, check_description, check_values, statuses, full)
        return arrays, problems

    def _load(
        self,
        specs: Mapping[str, ArraySpec] | None,
        check_description: bool,
        check_values: bool,
        statuses: dict[str, dict[str, int]] | None,
        full: bool = False,
    ) -> tuple[dict[str, npt.NDArray[Any]] | None, list[str], bool | None]:
        """load(), and whether the description exists (None: not looked at). `full`: every
        value is checked (a build-cache session)."""
        problems: list[str] = []
        described: bool | None = None
        if check_description:
            description = self._file("description.txt")  # str(self.description_path)
            try:
                found = _read_prefix(description, len(self.description.encode()) + 1)
                described = True
                if found != self.description:
                    problems.append(f"{description}: description differs from config")
            except FileNotFoundError:
                # not committed (or never written): the arrays cannot make it a hit, and a cold
                # start should not pay three more failing opens per entry to say so
                return None, [f"{description}: missing"], False
            except OSError as error:
                limit = resource_error(error, str(self.description_path))
                if limit is not None:
                    raise limit from error
                problems.append(f"{self.description_path}: unreadable ({error})")
            except UnicodeDecodeError as error:
                problems.append(f"{self.description_path}: unreadable ({error})")
        arrays: dict[str, npt.NDArray[Any]] = {}
        for name in self.array_names:
            path = self._file(f"{name}.npy")
            try:
                array, status = _load_array(path, statuses is not None)
                if statuses is not None and status is not None:
                    statuses[name] = {
                        **data_fingerprint.array_status(status),
                        "ctime_ns": int(status.st_ctime_ns),
                    }
            except FileNotFoundError:
                problems.append(f"{path}: missing")
                continue
            except ResourceLimitError:
                raise  # the file may be fine: never a reason to rebuild
            except (OSError, DataFormatError) as error:
                problems.append(f"{path}: unreadable or truncated ({error})")
                continue
            spec = specs.get(name) if specs else None
            problem = spec.problem(array) if spec else None
            if problem:
                problems.append(f"{path}: {problem}")
            arrays[name] = array
        if not problems and specs and (check_values or full):
            problems = self._value_problems(arrays, specs, full=full)
        return (None, problems, described) if problems else (arrays, [], described)

    def _shape_problems(
        self, arrays: Mapping[str, npt.NDArray[Any]], specs: Mapping[str, ArraySpec]
    ) -> list[str]:
        """Each array's dtype, dimensions and shape against its spec (no values)."""
        problems = []
        for name, spec in specs.items():
            problem = spec.problem(arrays[name]) if name in arrays else "missing"
            if problem:
                problems.append(f"{self.array_path(name)}: {problem}")
        return problems

    def _value_problems(
        self, arrays: Mapping[str, npt.NDArray[Any]], specs: Mapping[str, ArraySpec], full: bool
    ) -> list[str]:
        """`cache_checks`: every value at build and under build-cache (full), a stride on load."""
        checks = {name: spec.values for name, spec in specs.items()}
        return cache_checks.value_problems(arrays, checks, full, self.array_path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold an exclusive lock on this cache entry if the filesystem gives one (blocks while
        another writer holds it). Best effort: the protocol is correct without it, so a lock
        that fails (ENOLCK, EOPNOTSUPP, ...) means possibly duplicate work, never an error. The
        lock file is removed on release (a waiter then holds a lock on a removed file, and may
        build a second time: harmless), so entries leave no lock files behind."""
        self.directory.mkdir(parents=True, exist_ok=True)
        lock_path = os.path.join(self.directory, f".{self.base}.lock")
        with best_effort_lock(lock_path, f"building {self.base}", remove_on_release=True):
            yield

    def save(
        self,
        arrays: Mapping[str, npt.NDArray[Any]],
        fingerprint: Mapping[str, Any] | None = None,
        vouch: bool = False,
        fingerprint_made_here: bool = False,
    ) -> None:
        """Write every array, the data fingerprint and the description, each under a temporary
        name, then commit them: the arrays and fingerprint fsynced and renamed first, the
        description (the commit point) after them (`cache_writes.write_entry`; inside
        `deferred_commits()` when that block ends). Nothing committed is deleted first: a
        concurrent builder renames the same bytes, and a reader that opened a file keeps it.

        `vouch`: every value of `arrays` is valid (checked, or kernel-built); the fingerprint
        sidecar then records each array file (size, mtime, inode, generation) so later loads of
        these very files skip the value checks. `fingerprint_made_here`: `fingerprint` comes from
        `fingerprint.fingerprint_prefixes` (its structure is not checked again).
        """
        if not batch_holds(self.directory):  # a batch's later entries: made by its first
            self.directory.mkdir(parents=True, exist_ok=True)
        write_entry(
            {name: self._file(f"{name}.npy") for name in self.array_names},
            arrays,
            self._file(data_fingerprint.FINGERPRINT_SUFFIX),
            fingerprint,
            self._file("description.txt"),
            self.description,
            vouch,
            fingerprint_made_here,
        )

    def load_or_build(
        self,
        spec: EntrySpec,
        build: Callable[[], Mapping[str, npt.NDArray[Any]]],
        *,
        may_build: bool,
    ) -> tuple[dict[str, npt.NDArray[Any]], bool]:
        """Return the cached arrays, building and saving them first if this process may.

        Args:
            spec: what the entry must hold and how its data is checked (:class:`EntrySpec`).
            build: computes the arrays (called at most once, under the lock).
            may_build: whether this process writes missing caches (rank rule).

        Returns:
            (arrays, built) where built says whether this call computed them.

        Raises:
            CacheError: when the cache is missing or invalid and this process may not build it.
            StaleCacheError: the data changed since the entry was built and it may not be
                rebuilt here (data_check "error", or a rank that does not build caches).
            ValueError: data_check is not one of fingerprint.POLICIES.
        """
        if spec.data_check not in data_fingerprint.POLICIES:
            raise ValueError(
                f"cache_data_check must be one of {list(data_fingerprint.POLICIES)}, "
                f"got {spec.data_check!r}"
            )
        with build_context() as context:
            access = _Access(context, spec, may_build, time.perf_counter())
            arrays, problems = self._probe(access)
            arrays, problems = self._verify(access, arrays, problems)
            if arrays is not None:
                return self._hit(access, arrays), False
            return self._build(access, build, problems), True

    # The steps of load_or_build: probe -> verify -> (hit | build -> stage -> commit). Staging
    # and committing are `save` (cache_writes.write_entry: now, or when the enclosing batch
    # ends); each optimisation sits inside one step (docs/cache-protocol.md).

    def _probe(self, access: _Access) -> tuple[dict[str, npt.NDArray[Any]] | None, list[str]]:
        """Whether this rank trusts the builders' check of this copy (its digest is the one
        they handed over), then the entry as on disk: description, arrays with their dtypes and
        shapes, and their values unless they are checked after the data (`access.later`) or
        trusted. Sweeps the directory's abandoned temporaries first (a builder, once per build).
        """
        context, spec = access.context, access.spec
        # A rank that does not build trusts the builders' check of an entry when the copy it
        # reads is the one they checked: their digest of it (evidence) equals this copy's.
        if not access.may_build and context.evidence is not None:
            expected = context.evidence.get(self.base)
            access.trusted = expected is not None and expected == self._digest_here()
        access.checking = (
            spec.data_check != "off" and len(spec.data_prefixes) > 0 and not access.trusted
        )
        if access.may_build and not access.check_only:
            # a killed writer's temporaries go on the next build's first visit (hit or miss)
            _sweep_abandoned(self.directory, context)
        # With a data check, the values are checked after it, unless the entry's fingerprint
        # sidecar vouches for these very files (fingerprint.vouches_for); a session (build-cache)
        # always checks them.
        access.later = access.checking and bool(spec.arrays) and access.session is None
        access.statuses = {} if access.later else None
        arrays, problems, access.described = self._load(
            spec.arrays,
            check_description=not spec.trust_presence,
            check_values=not access.trusted and not access.later,
            statuses=access.statuses,
            full=access.session is not None,
        )
        return arrays, problems

    def _verify(
        self,
        access: _Access,
        arrays: dict[str, npt.NDArray[Any]] | None,
        problems: list[str],
    ) -> tuple[dict[str, npt.NDArray[Any]] | None, list[str]]:
        """The probed entry against the data (fingerprint sidecar; may raise StaleCacheError),
        then its values unless the sidecar vouches for these very array files."""
        spec = access.spec
        # An existing entry is checked against the data even when its arrays no longer fit the
        # config (new data usually changes their shapes): "error" must never rebuild silently.
        if access.described is None and access.checking:
            access.described = os.path.isfile(self._file("description.txt"))
        if access.checking and access.described:
            arrays, problems = self._check_data(
                arrays, problems, spec.data_prefixes, spec.data_check, access.may_build,
                access.check_only, access.recorded, access.sidecar,
            )  # fmt: skip
        vouched = False
        if access.later and arrays is not None and spec.arrays:
            vouched = data_fingerprint.vouches_for(
                access.recorded,
                access.statuses or {},
                access.sidecar[0].changed_ns if access.sidecar else None,
            )
            if not vouched:
                problems = self._value_problems(arrays, spec.arrays, full=False)
                if problems:
                    arrays = None
        if arrays is not None and vouched and access.may_build and not access.check_only:
            # data fingerprinted within the margin of its last change is hashed on every
            # check until its sidecar is dated after the margin (fingerprint.reseal)
            data_fingerprint.reseal(
                self._file(data_fingerprint.FINGERPRINT_SUFFIX),
                access.sidecar[0],
                spec.data_prefixes,
                _memo(),
            )
        return arrays, problems

    def _hit(
        self, access: _Access, arrays: dict[str, npt.NDArray[Any]]
    ) -> dict[str, npt.NDArray[Any]]:
        """A verified entry: its digest for the ranks that trust this builder, the event."""
        context = access.context
        if context.vouched is not None and access.may_build and not access.check_only:
            raw = access.sidecar[0].raw if access.sidecar else None
            digest = entry_digest(self.description, raw) if raw else self._digest_here()
            context.record_vouched(self.base, digest)
        access.record(self, False, False, ())
        return arrays

    def _build(
        self,
        access: _Access,
        build: Callable[[], Mapping[str, npt.NDArray[Any]]],
        problems: list[str],
    ) -> dict[str, npt.NDArray[Any]]:
        """A miss: built in memory only (check_only), refused (a rank that does not build), or
        built and saved (staged, and committed now or with the enclosing batch)."""
        spec, context = access.spec, access.context
        if access.check_only:
            built = dict(build())
            access.record(self, True, False, problems)
            return built
        if not access.may_build:
            raise CacheError(
                "index cache is missing or invalid and this rank does not build caches "
                "(the building rank should have written it before the barrier; is "
                "path_to_cache on a filesystem every rank sees? cache_build_scope='node' builds "
                "one copy per node): " + "; ".join(problems)
            )
        # Inside deferred_commits() an entry becomes visible only when the whole batch commits,
        # so a lock held while building it could not spare another builder any work: skip it,
        # and the second look that only a wait for the lock makes worth taking.
        batch = batch_active()
        with contextlib.nullcontext() if batch else self.locked():
            if not batch:
                # another writer may have built it while this process waited for the lock
                arrays, problems = self.load(spec.arrays, check_description=not spec.trust_presence)
                if arrays is not None and not (
                    access.checking and self.stale_reasons(spec.data_prefixes)[0]
                ):
                    context.record_vouched(self.base, self._digest_here())
                    access.record(self, False, False, ())
                    return arrays
            built = self._build_and_save(
                context, build, spec.data_prefixes if access.checking else (), spec.arrays,
                check_values=not spec.kernel_built, data_read=spec.data_read,
            )  # fmt: skip
        access.record(self, True, True, problems)
        return built

    def _check_data(
        self,
        arrays: dict[str, npt.NDArray[Any]] | None,
        problems: list[str],
        data_prefixes: Sequence[str],
        data_check: str,
        may_build: bool,
        check_only: bool,
        recorded_out: dict[str, Any] | None = None,
        sidecar_out: list[data_fingerprint.Sidecar] | None = None,
    ) -> tuple[dict[str, npt.NDArray[Any]] | None, list[str]]:
        """An existing entry against the current data: (arrays, problems) to go on with (arrays
        None when the entry must be rebuilt), after adopting an unfingerprinted valid entry.
        `recorded_out` receives the entry's sidecar payload, if it has a valid one, and
        `sidecar_out` the sidecar itself.

        Raises:
            StaleCacheError: the data changed and the entry may not be rebuilt here.
        """
        stale, _ = self.stale_reasons(data_prefixes, recorded_out, sidecar_out)
        if stale and check_only:
            built_from = (f"{self.description_path}: built from other data: {r}" for r in stale)
            return None, [*problems, *built_from]
        if stale and (data_check == "error" or not may_build):
            raise StaleCacheError(
                f"index cache {self.description_path} was built from different data "
                f"(cache_data_check={data_check!r}; delete the entry, rebuild it on the "
                "cache-building rank, or set cache_data_check='off' for megatron-core's "
                "path-only behaviour): " + "; ".join(stale)
            )
        if stale:
            logger.warning(
                "rebuilding stale index cache %s: %s", self.description_path, "; ".join(stale)
            )
            return None, stale
        if (
            arrays is not None
            and may_build
            and not check_only
            and data_check == "error"  # the user asked for strict data checks of this cache
            and not recorded_out  # a valid sidecar was read: there is one
            and not self.fingerprint_path.is_file()
        ):
            # adopt an entry megatron-core (or an older tokenmill) wrote over this data: later
            # checks compare fingerprints, not only mtimes. Only where asked: a read of a
            # megatron cache otherwise adds nothing to its folder (which may be read-only).
            # Best effort: a concurrent builder may clean our temporary file away.
            with contextlib.suppress(OSError):
                data_fingerprint.write_fingerprint(
                    self.fingerprint_path,
                    data_fingerprint.fingerprint_prefixes(data_prefixes, _memo()),
                )
        return arrays, problems

    def _build_and_save(
        self,
        context: BuildContext,
        build: Callable[[], Mapping[str, npt.NDArray[Any]]],
        data_prefixes: Sequence[str],
        specs: Mapping[str, ArraySpec] | None = None,
        check_values: bool = True,
        data_read: data_fingerprint.WholeReads | None = None,
    ) -> dict[str, npt.NDArray[Any]]:
        """Build the arrays and write the entry (call under the lock), fingerprinting
        `data_prefixes` first: data that changes during the build is then seen as stale (files
        in `data_read`, already read whole, from the bytes the arrays are computed from).
        `check_values` False checks only dtypes and shapes (see load_or_build's kernel_built)."""
        _sweep_abandoned(self.directory, context)
        fingerprint = (
            data_fingerprint.fingerprint_prefixes(data_prefixes, context.memo, data_read)
            if data_prefixes
            else None
        )
        built = dict(build())
        problems: list[str] = []
        if specs and check_values:
            problems = self._value_problems(built, specs, full=True)
        elif specs:
            problems = self._shape_problems(built, specs)
        if problems:  # never commit an entry that would be refused on load
            raise CacheError("built index arrays are invalid: " + "; ".join(problems))
        self.save(built, fingerprint, vouch=bool(specs), fingerprint_made_here=True)
        return built

    def check_deferred(self, data_prefixes: Sequence[str], data_check: str) -> None:
        """The data check of a deferred (defer_npy_index_mmap) load, which never rebuilds.

        Raises:
            StaleCacheError: the data changed since the entry was built.
        """
        if data_check == "off" or not data_prefixes:
            return
        stale, _ = self.stale_reasons(data_prefixes)
        if stale:
            raise StaleCacheError(
                f"index cache {self.description_path} was built from different data "
                "(a deferred load cannot rebuild it): " + "; ".join(stale)
            )
