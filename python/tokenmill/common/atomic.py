"""Atomic file writing shared by every layer (format writers, caches, manifests, sidecars): a
hidden temporary file beside the target, renamed into place on success and removed on failure, so
a reader never sees a partial file, and durable: the file is fsynced before the rename and its
directory after it, so a committed name survives a lost machine (power, kernel panic), not only
a killed process. ``TOKENMILL_FSYNC=0`` turns the two fsyncs off (scratch disks, benchmarks; the
cost is measured in benchmarks/bench_durability.py).

Why not a library: the well-known one (``atomicwrites``) is archived, and the writers here need
the open binary stream (formats stream gigabytes into it) and an explicit commit/abort, which
is these few lines over ``tempfile.mkstemp`` and ``os.replace``."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, NoReturn, TypeVar

from tokenmill.common.mapping import resource_error
from tokenmill.common.owner import owner_tag

__all__ = [
    "AtomicFile",
    "AtomicWriter",
    "WrittenFile",
    "atomic_write_text",
    "commit_together",
    "default_file_mode",
    "durable_replace",
    "fsync_directory",
    "fsync_enabled",
]


def _read_umask() -> int:
    """The process umask, read without changing it where the kernel allows.

    Linux >= 4.7 reports it in /proc/self/status. Elsewhere the only way is to set it and set it
    back (``os.umask``), which is done once, at import, instead of on every file: two threads
    doing that at once could leave the whole process with umask 0.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


_UMASK = _read_umask()


def default_file_mode() -> int:
    """0o666 minus the process umask at import (what ``open(..., "w")`` would give)."""
    return 0o666 & ~_UMASK


def fsync_enabled() -> bool:
    """Whether commits fsync (``TOKENMILL_FSYNC`` unset or not "0")."""
    return os.environ.get("TOKENMILL_FSYNC", "1") != "0"


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make a rename or creation in `directory` durable (a no-op where directories cannot be
    opened, e.g. on Windows)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError as error:
        # some filesystems refuse fsync on a directory (EINVAL); the data itself is synced
        if error.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(descriptor)


def _fsync_path(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_paths(paths: Sequence[str]) -> None:
    for path in paths:
        _fsync_path(path)


def durable_replace(source: str, target: str, *, sync_source: bool = True) -> None:
    """``os.replace(source, target)``, with the data fsynced first and the directory after.

    For writers that stream into their own temporary file (format builders, downloads).
    """
    if fsync_enabled():
        if sync_source:
            _fsync_path(source)
        os.replace(source, target)
        fsync_directory(os.path.dirname(os.path.abspath(target)))
    else:
        os.replace(source, target)


class AtomicFile:
    """A binary file written under a temporary name and renamed to ``path`` by :meth:`commit`.

    Args:
        path: the final path.

    Raises:
        FileNotFoundError: the directory of ``path`` does not exist.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        directory, name = os.path.split(self.path)
        try:
            descriptor, self.temporary_path = tempfile.mkstemp(
                prefix=f".{name}.{owner_tag()}.", suffix=".tmp", dir=directory or os.curdir
            )
        except FileNotFoundError:
            missing = os.path.dirname(os.path.abspath(self.path))
            raise FileNotFoundError(
                errno.ENOENT, f"directory of {self.path} does not exist: {missing}"
            ) from None
        os.fchmod(descriptor, default_file_mode())
        self.stream: BinaryIO = os.fdopen(descriptor, "w+b")
        self._done = False

    def close_written(self) -> None:
        """Flush and close the temporary file without committing it (see commit_together)."""
        if not self.stream.closed:
            self.stream.flush()
            self.stream.close()

    def commit(self) -> None:
        """Flush, fsync, close and rename the temporary file to its final name (then fsync the
        directory)."""
        if self._done:
            return
        durable = fsync_enabled()
        if not self.stream.closed:
            self.stream.flush()
            if durable:
                os.fsync(self.stream.fileno())
            self.stream.close()
        elif durable:
            _fsync_path(self.temporary_path)
        os.replace(self.temporary_path, self.path)
        if durable:
            fsync_directory(os.path.dirname(os.path.abspath(self.path)))
        self._done = True

    def abort(self) -> None:
        """Close and remove the temporary file (the final path is left untouched)."""
        if self._done:
            return
        self._done = True
        self.stream.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary_path)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abort()


# Numbers that make this process's temporary names unique (the owner tag names the process);
# next() on an itertools.count is atomic under the GIL, so builder threads can share it.
_TEMPORARY_NUMBERS = itertools.count()
_CREATE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NOFOLLOW", 0)
)


def _write_all(descriptor: int, data: memoryview) -> None:
    while data.nbytes:
        written = os.write(descriptor, data)
        data = data[written:]


def _raise_named(error: OSError, path: str, what: str) -> NoReturn:
    """Raise `error`, as a ResourceLimitError naming the limit when it is one (descriptors,
    disk space: `common.mapping.resource_error`)."""
    limit = resource_error(error, path, what)
    if limit is None:
        raise error
    raise limit from error


class WrittenFile:
    """Bytes already written and closed under a temporary name beside ``path``, for
    :func:`commit_together` to commit (or :meth:`abort` to remove).

    The small-file counterpart of :class:`AtomicFile`, for writers that have every byte at
    hand (cache entries: a blend writes thousands of small files): one ``open``, the writes, an
    ``fstat`` and a ``close``, with no Python file object, random name or ``fchmod``. The mode
    is what ``open(path, "wb")`` gives (0o666 minus the umask, applied by the kernel).

    Args:
        path: the final path.
        chunks: the file's contents, in order (anything with the buffer protocol).

    Attributes:
        status: ``os.fstat`` of the written file (size, mtime, inode survive the rename).

    Raises:
        FileNotFoundError: the directory of ``path`` does not exist.
    """

    def __init__(self, path: str | os.PathLike[str], chunks: Iterable[object]) -> None:
        self.path = os.fspath(path)
        self._done = True  # nothing to remove until the temporary file exists
        directory, name = os.path.split(self.path)
        while True:
            temporary = os.path.join(
                directory, f".{name}.{owner_tag()}.{next(_TEMPORARY_NUMBERS)}.tmp"
            )
            try:
                descriptor = os.open(temporary, _CREATE_FLAGS, 0o666)
                break
            except FileExistsError:  # left by an earlier process with this pid: next number
                continue
            except FileNotFoundError:
                missing = os.path.dirname(os.path.abspath(self.path))
                raise FileNotFoundError(
                    errno.ENOENT, f"directory of {self.path} does not exist: {missing}"
                ) from None
            except OSError as error:
                _raise_named(error, temporary, "create")
        self.temporary_path = temporary
        self._done = False
        try:
            try:
                for chunk in chunks:
                    view = memoryview(chunk)  # type: ignore[arg-type]
                    if view.nbytes:  # (an empty multi-dimensional view cannot be cast)
                        _write_all(descriptor, view.cast("B"))
                self.status = os.fstat(descriptor)
            finally:
                os.close(descriptor)
        except OSError as error:
            self.abort()
            _raise_named(error, temporary, "write")
        except BaseException:
            self.abort()
            raise

    def commit(self) -> None:
        """Commit this file alone (:func:`commit_together`); on failure it is removed."""
        try:
            commit_together([self])
        finally:
            self.abort()  # no-op after commit

    def close_written(self) -> None:
        """Nothing to do: the file was closed when written (the interface of AtomicFile)."""

    def abort(self) -> None:
        """Remove the temporary file (the final path is left untouched)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary_path)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abort()


# Concurrent fsyncs share the filesystem's journal commits (ext4, XFS) or round trips (NFS): on
# the project's 2-core dev VM (ext4), 2,000 small files took 5 s fsynced one after the other and
# 0.1 s from 16 threads.
_FSYNC_THREADS = 16


def commit_together(files: Sequence[AtomicFile | WrittenFile]) -> None:
    """Commit many written files as one group: every temporary file fsynced (in parallel), then
    each renamed in the order given, then each directory fsynced once.

    Durable as committing them one by one (no name is renamed before its data is on disk, and
    the renames are on disk when this returns), at about the cost of one fsync instead of two
    per file. Callers put commit points (a cache entry's description) after the files they vouch
    for. Without threads (a process that cannot start them) the fsyncs run one after another.
    """
    pending = [file for file in files if not file._done]
    for file in pending:
        file.close_written()
    durable = fsync_enabled()
    if durable and pending:
        paths = [file.temporary_path for file in pending]
        # one task per thread, each a slice of the paths: a future per file cost more in
        # hand-overs between threads than the fsyncs themselves on a fast disk
        threads = min(_FSYNC_THREADS, len(paths))
        slices = [paths[number::threads] for number in range(threads)]
        try:
            pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
        except RuntimeError:
            pool = None
        if pool is None:
            _fsync_paths(paths)
        else:
            try:
                with pool:
                    list(pool.map(_fsync_paths, slices))
            except RuntimeError:  # "can't start new thread": the same work, serially
                _fsync_paths(paths)
    directories: dict[str, None] = {}
    for file in pending:
        os.replace(file.temporary_path, file.path)
        file._done = True
        directories[os.path.dirname(os.path.abspath(file.path))] = None
    if durable:
        for directory in directories:
            fsync_directory(directory)


_Writer = TypeVar("_Writer", bound="AtomicWriter")


class AtomicWriter:
    """Context-manager behaviour of a writer over an AtomicFile `_file`: `finalize()` on a clean
    exit, `abort()` (nothing left behind) on an exception."""

    _file: AtomicFile

    def finalize(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Discard everything written."""
        self._file.abort()

    def __enter__(self: _Writer) -> _Writer:
        return self

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        if kind is None:
            self.finalize()
        else:
            self.abort()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file and a rename."""
    target = AtomicFile(path)
    try:
        target.stream.write(text.encode("utf-8"))
        target.commit()
    finally:
        target.abort()  # no-op after commit
