"""Writing the files of index-cache entries: atomically, durably, and in batches.

An entry is its arrays (``numpy.save``, megatron-core's bytes), tokenmill's data fingerprint
sidecar and the description, the commit point. :func:`write_entry` writes all of them under
temporary names and commits them with `tokenmill.common.atomic.commit_together`: the data files
fsynced and renamed first, the description after them, so a committed description always has
whole arrays on disk, after a lost machine as after a killed process.

:func:`deferred_commits` batches that commit across entries and overlaps the writing with the
build: each entry's files are handed to the C++ background writer (`_core.FileWriter`, no GIL)
in one call and written while the builder computes the next entry; its arrays and fingerprint
under their final names (nothing reads them before the description is in place), so only the
descriptions are renamed; and the batch is made durable at its end by one syncfs of the cache's
filesystem (`common.atomic.FilesystemSync`). A blend of 1,000 sources writes 5,000 files:
fsynced one after the other they took tens of seconds on a busy disk, and even fsynced 16 at a
time in the background they cost a quarter of the cold build. The reading side, locks and the
rules of a hit are `tokenmill.index.cache`; the protocol is docs/cache-protocol.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import io
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.atomic import (
    FilesystemSync,
    WrittenFile,
    commit_together,
    fsync_enabled,
    much_else_dirty,
    sync_filesystems,
)
from tokenmill.index import fingerprint as data_fingerprint

__all__ = [
    "atomic_save_npy",
    "batch_active",
    "batch_has_entries",
    "batch_holds",
    "deferred_commits",
    "write_entry",
]


class _Batch:
    """The entries written inside one :func:`deferred_commits`, committed together when it ends,
    with the directories it writes in (held open from before its first file there: the commit
    makes the whole batch durable with one syncfs per filesystem, common.atomic.FilesystemSync).
    """

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.filesystems: dict[str, FilesystemSync] = {}
        self.stopped = False  # stop_batch: an earlier failure ended this build
        self.sealed = 0  # entries[:sealed] have been handed to _Entry.fingerprint_contents
        self.early_writebacks: list[threading.Thread] = []  # _start_early_writeback
        self.lock = threading.Lock()  # the builder's pool threads write entries concurrently


class BuildContext:
    """The state of one build: made by whoever builds (the dataset builder, `build-cache`),
    held in a context variable, and carried into the builder's pool threads by
    ``contextvars.copy_context().run`` per task, so that it is seen by the work of this build
    and by nothing else (another thread of the process, another build) -- there is no
    module-level state in the cache path.

    Attributes:
        batch: the enclosing :func:`deferred_commits` batch, if any.
        evidence: on a rank that trusts the builders, the digest of each entry they checked,
            by entry (:func:`entry_digest`; None: this work trusts no one).
        vouched: where this builder records the digest of each entry it checked or built, for
            its collective to hand to the ranks that trust it (None: nobody asks).
        memo: the fingerprints and stats taken during the build (fingerprint.FileMemo).
        session: the `CacheSession` observing every cache access (build-cache), if any.
    """

    def __init__(self) -> None:
        self.batch: _Batch | None = None
        self.evidence: Mapping[str, bytes] | None = None
        self.vouched: dict[str, bytes] | None = None
        self.memo: data_fingerprint.FileMemo | None = None
        self.session: Any = None
        # the cache directories whose abandoned temporary files this build has removed
        self.swept: set[str] = set()
        # the cache directories this build found no other user can write (one stat each)
        self.directories_checked: set[str] = set()
        # blending indices being computed ahead (blending.compute_ahead), by (weights' bytes,
        # size): the process that started each and its future
        self.ahead: dict[tuple[bytes, int], tuple[int, Future[Any]]] = {}
        self.lock = threading.Lock()

    def record_vouched(self, base: str, digest: bytes) -> None:
        vouched = self.vouched
        if vouched is not None:
            with self.lock:
                vouched[base] = digest


_CONTEXT: contextvars.ContextVar[BuildContext | None] = contextvars.ContextVar(
    "tokenmill_build_context", default=None
)


def current_context() -> BuildContext | None:
    """The build context of this work, if it runs inside one."""
    return _CONTEXT.get()


@contextlib.contextmanager
def build_context() -> Iterator[BuildContext]:
    """The enclosing build context, or a new one for the block."""
    found = _CONTEXT.get()
    if found is not None:
        yield found
        return
    made = BuildContext()
    token = _CONTEXT.set(made)
    try:
        yield made
    finally:
        _CONTEXT.reset(token)


def entry_digest(description: str, sidecar: bytes) -> bytes:
    """What a builder vouches for and a trusting rank compares: 16 bytes of the sha256 of an
    entry's description and the raw bytes of its data-fingerprint sidecar (empty when it has
    none). The sidecar names the data files (size, mtimes, ctime, inode, hash) the builder
    checked and the array files it wrote (size, mtime, inode, generation)."""
    digest = hashlib.sha256(description.encode("utf-8"))
    digest.update(b"\0")
    digest.update(sidecar)
    return digest.digest()[:16]


def _numpy_header(array: npt.NDArray[Any]) -> bytes:
    header = io.BytesIO()
    fields = np.lib.format.header_data_from_array_1_0(array)
    try:
        np.lib.format.write_array_header_1_0(header, fields)
    except ValueError:  # "header does not fit inside 65535 bytes"
        header = io.BytesIO()
        np.lib.format.write_array_header_2_0(header, fields)
    return header.getvalue()


# The .npy format 1.0 (numpy's NEP 1, numpy.lib.format): magic, version, the header's length
# (uint16 little-endian), then the repr of a dict with sorted keys, padded with spaces and a
# newline so that the data starts at a multiple of ARRAY_ALIGN; since numpy 1.23 the dict's
# text is first followed by spaces for the first axis to grow to GROWTH_AXIS_MAX_DIGITS
# digits in place. Both constants are read from numpy (a numpy without them: numpy's writer).
_NPY_ALIGN = getattr(np.lib.format, "ARRAY_ALIGN", None)
_NPY_GROWTH_DIGITS = getattr(np.lib.format, "GROWTH_AXIS_MAX_DIGITS", None)
_NPY_PREFIX_1_0 = b"\x93NUMPY\x01\x00"
_NPY_PLAIN_KINDS = frozenset("biufcmMSUV")  # dtypes whose descr is dtype.str (dtype_to_descr)


def npy_header(array: npt.NDArray[Any]) -> bytes:
    """The header ``numpy.save`` writes before the C-contiguous `array`'s bytes (format 1.0, or
    2.0 when the header does not fit 1.0's 16-bit length), byte for byte.

    Why not numpy's writer alone: it takes ~10 us per array (a dict, its sorted repr, a
    BytesIO), 3,000 arrays in a 1,000-source cold build. Plain dtypes (no fields, subarray or
    metadata, whose ``dtype_to_descr`` is ``dtype.str``) are written here in ~1.5 us; every
    other case is numpy's. tests/test_npy_header.py compares both over dtypes and shapes."""
    dtype = array.dtype
    if (
        _NPY_ALIGN is None
        or _NPY_GROWTH_DIGITS is None
        or dtype.kind not in _NPY_PLAIN_KINDS
        or dtype.names is not None
        or dtype.subdtype is not None
        or dtype.metadata is not None
        or not array.flags.c_contiguous
    ):
        return _numpy_header(array)
    shape = array.shape
    text = f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    if shape:
        text += " " * (_NPY_GROWTH_DIGITS - len(repr(shape[0])))
    encoded = text.encode("latin1")
    length = len(encoded) + 1  # with the final newline
    padding = _NPY_ALIGN - ((len(_NPY_PREFIX_1_0) + 2 + length) % _NPY_ALIGN)
    if length + padding > 0xFFFF:  # numpy writes format 2.0 then
        return _numpy_header(array)
    return b"".join(
        (
            _NPY_PREFIX_1_0,
            (length + padding).to_bytes(2, "little"),
            encoded,
            b" " * padding,
            b"\n",
        )
    )


def _npy_chunks(
    path: str | os.PathLike[str], array: npt.NDArray[Any]
) -> tuple[bytes, npt.NDArray[Any]]:
    """The bytes ``numpy.save`` writes for `array` (megatron-core's format): header, data."""
    array = np.ascontiguousarray(array)
    if array.dtype.hasobject:
        raise ValueError(f"{path}: cannot cache an array of Python objects ({array.dtype})")
    return npy_header(array), array


def _npy_writer(
    path: str | os.PathLike[str], array: npt.NDArray[Any], background: bool = False
) -> WrittenFile:
    """`array` written as ``numpy.save`` writes it (the same bytes, megatron-core's format),
    under the temporary name of `path`, for the caller to commit."""
    return WrittenFile(path, _npy_chunks(path, array), background=background)


def atomic_save_npy(path: Path, array: npt.NDArray[Any]) -> None:
    """numpy.save `array` to `path` (same bytes) through a temporary file and a rename."""
    _npy_writer(path, array).commit()


class _Entry:
    """One entry's files, written in the background: its arrays and description from the start
    and, once the arrays are written (:meth:`seal`), its data fingerprint, which records the
    array files' status when it vouches."""

    def __init__(
        self,
        arrays: Mapping[str, WrittenFile],
        fingerprint_path: str | os.PathLike[str],
        fingerprint: Mapping[str, Any] | None,
        description: WrittenFile,
        vouch: bool,
        fingerprint_made_here: bool,
    ) -> None:
        self.arrays = dict(arrays)
        self.fingerprint_made_here = fingerprint_made_here
        self.fingerprint_path = fingerprint_path
        self.fingerprint = fingerprint
        self.vouch = vouch
        self.data_files: list[WrittenFile] = list(arrays.values())
        self.committing = description
        self.sealed = False
        self._sealing = threading.Lock()  # builder threads may seal the same entry
        self._failure: BaseException | None = None
        # (context, entry, description): whom to tell this entry's digest once committed
        self.vouch_to: tuple[BuildContext, str, str] | None = None
        self.sidecar = b""

    def files(self) -> list[WrittenFile]:
        return [*self.data_files, self.committing]

    def seal(self) -> None:
        """Wait for the arrays; start the data fingerprint (background)."""
        contents = self.fingerprint_contents()
        if contents is not None:
            self.add_fingerprint(WrittenFile.together([contents])[0])

    def fingerprint_contents(self) -> tuple[str | os.PathLike[str], tuple[bytes]] | None:
        """Wait for the arrays; the data fingerprint's path and bytes, for the caller to write
        and hand to :meth:`add_fingerprint` (None: no fingerprint, or sealed already)."""
        with self._sealing:
            if self.sealed:
                return None
            self.sealed = True
        written = {
            name: data_fingerprint.array_status(file.finish()) for name, file in self.arrays.items()
        }
        if self.fingerprint is None:
            return None
        vouched = {**self.fingerprint, "arrays": written} if self.vouch else self.fingerprint
        text = data_fingerprint.fingerprint_bytes(
            self.fingerprint_path, vouched, made_here=self.fingerprint_made_here
        )
        self.sidecar = text
        return self.fingerprint_path, (text,)

    def add_fingerprint(self, file: WrittenFile) -> None:
        self.data_files.append(file)

    def fingerprint_failed(self, error: BaseException) -> None:
        """The fingerprint could not be handed to the writer: :meth:`finish` raises."""
        self._failure = error

    def finish(self) -> None:
        """Wait for every file (raises the first error)."""
        self.seal()
        for file in self.files():
            file.finish()
        if self._failure is not None:
            raise self._failure

    def abort(self) -> None:
        for file in self.files():
            file.abort()

    def report_digest(self) -> None:
        """Record this committed entry's digest in the build context that asked for it."""
        if self.vouch_to is not None:
            context, base, description = self.vouch_to
            context.record_vouched(base, entry_digest(description, self.sidecar))


def write_entry(
    array_paths: Mapping[str, str | os.PathLike[str]],
    arrays: Mapping[str, npt.NDArray[Any]],
    fingerprint_path: str | os.PathLike[str],
    fingerprint: Mapping[str, Any] | None,
    description_path: str | os.PathLike[str],
    description: str,
    vouch: bool,
    fingerprint_made_here: bool = False,
) -> None:
    """Write an entry's arrays, data fingerprint (if any) and description under temporary
    names, then commit them (now, or when the enclosing :func:`deferred_commits` ends).

    The files are written on background threads (`tokenmill._core.FileWriter`, without the
    GIL). Outside a batch this returns once the entry is committed. Inside
    :func:`deferred_commits` it returns at once: the arrays and description are written while the
    caller builds the next entries, the fingerprint once the arrays are (when the entry SEAL_LAG
    after it comes, or at the commit), and `arrays` must not change until the batch ends (the builder only reads
    them).

    `vouch`: every value of `arrays` is valid (checked, or built by tokenmill's own kernels);
    the fingerprint then records each array file's size, mtime, inode and generation (a rename
    keeps them all), so later loads of these very files skip the value checks
    (`fingerprint.vouches_for`). `fingerprint_made_here`: see IndexCache.save.
    """
    context = _CONTEXT.get()
    batch = context.batch if context is not None else None
    background = batch is not None
    if batch is not None and batch.stopped:
        raise BuildStoppedError(
            f"{os.fspath(description_path)}: not written, the build stopped at an earlier failure"
        )
    if batch is not None:
        _hold_directory(batch, os.path.dirname(os.path.abspath(description_path)))
    names = list(array_paths)
    # every file of the entry handed to the writer in one call, with the fingerprint of the
    # entry SEAL_LAG before it: its arrays were written while the later ones were built
    contents: list[tuple[str | os.PathLike[str], tuple[object, ...]]] = [
        (array_paths[name], _npy_chunks(array_paths[name], arrays[name])) for name in names
    ]
    contents.append((description_path, (description.encode("utf-8"),)))
    previous = _entry_to_seal(batch) if batch is not None else None
    sealed = None
    if previous is not None:
        with contextlib.suppress(Exception):  # raised when the batch commits (_Entry.finish)
            sealed = previous.fingerprint_contents()
    if sealed is not None:
        contents.insert(0, sealed)
    # In a batch the data files are written under their final names: nothing reads them before
    # the description (renamed last) is in place, and a blend of 1,000 sources saves 4,000
    # renames (each a round trip to the server on NFS or Lustre). The description never is.
    in_place = [background] * (len(contents) - 1) + [False]
    try:
        files = WrittenFile.together(contents, in_place)
    except BaseException as error:
        if previous is not None and sealed is not None:
            previous.fingerprint_failed(error)  # left out of the commit, not committed without
        raise
    if previous is not None and sealed is not None:
        previous.add_fingerprint(files.pop(0))
    try:
        entry = _Entry(
            dict(zip(names, files)),
            fingerprint_path,
            fingerprint,
            files[-1],
            vouch,
            fingerprint_made_here,
        )
    except BaseException:
        for file in files:
            file.abort()
        raise
    if context is not None and context.vouched is not None:
        base = os.path.basename(os.fspath(description_path))[: -len(_DESCRIPTION_SUFFIX)]
        entry.vouch_to = (context, base, description)
    if batch is not None:
        with batch.lock:
            batch.entries.append(entry)
            count = len(batch.entries)
        if count % EARLY_WRITEBACK_ENTRIES == 0:
            _start_early_writeback(batch)
    else:
        _commit_entries([entry])


_DESCRIPTION_SUFFIX = "-description.txt"


# How many entries behind the newest one an entry's fingerprint is made: it records its array
# files' status, so it waits for them to be written, and the writer (woken for a backlog, see
# csrc/file_writer.cpp) has by then written them beside the build instead of in its way.
SEAL_LAG = 8


def _entry_to_seal(batch: _Batch) -> _Entry | None:
    """The oldest entry not yet sealed, once SEAL_LAG newer ones follow it (the rest are sealed
    at the commit)."""
    with batch.lock:
        if len(batch.entries) - batch.sealed <= SEAL_LAG:
            return None
        batch.sealed += 1
        return batch.entries[batch.sealed - 1]


# Every this many entries, a batch starts writing its files back in the background (one
# syncfs on a thread of its own), so that the syncfs of its commit, which makes it durable,
# finds little left to write: at 1,000 sources it took ~55 ms at the end of the build, ~10 ms
# after these.
EARLY_WRITEBACK_ENTRIES = 100


def _start_early_writeback(batch: _Batch) -> None:
    """syncfs the batch's filesystems on a background thread, through descriptors of their own:
    only a head start for the commit's syncfs (the durability step, which still runs). Its
    result is ignored, and it must not take a writeback error from the commit's syncfs, which
    reports the errors since its own descriptor was opened (Linux >= 5.8)."""
    if not fsync_enabled():
        return
    directories = list(batch.filesystems)

    def writeback() -> None:
        if much_else_dirty():  # a stranger's writeback: the commit fsyncs each file instead
            return
        for directory in directories:
            with contextlib.suppress(OSError):
                FilesystemSync(directory).sync_and_close(check=False)

    thread = threading.Thread(target=writeback, name="tokenmill-early-writeback", daemon=True)
    thread.start()
    with batch.lock:
        batch.early_writebacks.append(thread)


def _current_batch() -> _Batch | None:
    context = _CONTEXT.get()
    return context.batch if context is not None else None


def _hold_directory(batch: _Batch, key: str) -> None:
    """Open the directory `key` for the batch's syncfs, before the batch writes its first file
    there."""
    if key in batch.filesystems:
        return
    held = FilesystemSync(key)
    with batch.lock:
        if key in batch.filesystems:
            held.close()
        else:
            batch.filesystems[key] = held


def batch_holds(directory: str | os.PathLike[str]) -> bool:
    """Whether the enclosing :func:`deferred_commits` batch has written in `directory` (which
    therefore exists: the batch holds it open)."""
    batch = _current_batch()
    return batch is not None and os.path.abspath(directory) in batch.filesystems


def batch_has_entries() -> bool:
    """Whether the enclosing :func:`deferred_commits` batch has an entry to commit: a cache
    entry was missing and has been built (the cache is cold)."""
    batch = _current_batch()
    return batch is not None and bool(batch.entries)


class BuildStoppedError(RuntimeError):
    """An entry written after :func:`stop_batch`: the build failed before it."""


def stop_batch() -> None:
    """After a failure: the enclosing batch takes no further entry (write_entry raises
    BuildStoppedError); the entries it holds are still committed when it ends."""
    batch = _current_batch()
    if batch is not None:
        with batch.lock:
            batch.stopped = True


def batch_active() -> bool:
    """Whether entries written now are committed only when a :func:`deferred_commits` ends."""
    return _current_batch() is not None


@contextlib.contextmanager
def deferred_commits() -> Iterator[None]:
    """Within the block, :func:`write_entry` writes each entry's files and every entry is
    committed at the end, together: one syncfs of the cache's filesystem (or, for fewer than
    `common.atomic.WHOLE_FILESYSTEM_SYNC_FILES` files, one parallel round of fsyncs) instead of
    fsyncs per entry. Every entry's data files are renamed before any description (the commit
    point), and the directory is fsynced once per round.

    The batch belongs to the block's build context (:class:`BuildContext`): the work of this
    build (its pool threads run in a copy of the context) writes into it; another thread of
    the process, outside the context, commits its entries at once as if no batch were open.
    Entries written in the block are used from memory by this build and become visible to
    others when it ends: the builder wraps its whole batch in it, before its collective reports
    success. Entries completed before an exception are still committed (each is complete and
    checked). Nested blocks join the outermost one.
    """
    with build_context() as context:
        if context.batch is not None:
            yield
            return
        batch = context.batch = _Batch()
        try:
            yield
        finally:
            context.batch = None
            try:
                for thread in batch.early_writebacks:  # done by now, or nearly
                    thread.join()
                if batch.entries:
                    _commit_entries(batch.entries, list(batch.filesystems.values()))
            finally:
                for held in batch.filesystems.values():
                    held.close()


def _commit_entries(entries: Sequence[_Entry], filesystems: Sequence[FilesystemSync] = ()) -> None:
    """Data files of every entry, then every description; on failure nothing uncommitted is left
    behind (temporary files are removed). An entry whose files could not be written is left
    out, the others are committed, and the first error is raised after."""
    failure: BaseException | None = None
    complete: list[_Entry] = []
    try:
        for entry in entries:  # fingerprints start while earlier entries' files are waited for
            with contextlib.suppress(Exception):
                entry.seal()
        for entry in entries:
            try:
                entry.finish()
            except Exception as error:
                failure = failure or error
                entry.abort()
            else:
                complete.append(entry)
        data_files = [file for entry in complete for file in entry.data_files]
        descriptions = [entry.committing for entry in complete]
        # the descriptions are written by now: one syncfs covers them too
        synced = sync_filesystems([*data_files, *descriptions], filesystems)
        commit_together(data_files, synced=synced)
        commit_together(descriptions, synced=synced)
        for entry in complete:
            entry.report_digest()
    finally:
        for entry in entries:
            entry.abort()  # no-op after commit
    if failure is not None:
        raise failure
