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
import threading
from collections.abc import Iterable, Sequence
from typing import BinaryIO, NamedTuple, NoReturn, TypeVar

from tokenmill import _core
from tokenmill.common.mapping import resource_error
from tokenmill.common.owner import owner_tag

__all__ = [
    "AtomicFile",
    "AtomicWriter",
    "FileStatus",
    "FilesystemSync",
    "WrittenFile",
    "atomic_write_text",
    "commit_together",
    "default_file_mode",
    "durable_replace",
    "fsync_directory",
    "fsync_enabled",
    "much_else_dirty",
    "sync_filesystems",
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

# The background writers (csrc/file_writer.hpp). "write" creates, writes, fstats and closes
# files: one thread, because a cache's files are created in one directory, whose lock makes a
# second creating thread wait, or spin on the lock (on a 2-core machine, a 1,000-source cold
# build ran ~40 ms faster with one: benchmarks/SCALE.md). "sync" fsyncs them: its jobs wait on
# the disk, and many in flight share the disk's journal commits (on the project's 2-core dev
# VM, ext4: 2,000 small files took 5 s fsynced one after the other and 0.1 s from 16 threads),
# so a slow fsync never holds up a write. Workers start on demand, only while every started one
# is busy, and sleep when idle.
_WRITER_THREADS = {"write": 1, "sync": 16}
_WRITERS: dict[str, _core.FileWriter] = {}
_WRITERS_LOCK = threading.Lock()

# FileWriter steps (the `step` of an outcome)
_CREATE, _OPEN, _FSYNC = 1, 4, 5


# A forked child keeps its parent's writers alive and unused: their threads do not exist in
# the child, and destroying them there must not wait for those threads.
_INHERITED: list[object] = []


def _forget_writers_in_child() -> None:
    global _WRITERS_LOCK
    _INHERITED.append(dict(_WRITERS))
    _WRITERS.clear()
    _WRITERS_LOCK = threading.Lock()  # a parent thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_writers_in_child)


def _writer(kind: str) -> _core.FileWriter:
    """This process's writer of `kind` ("write" or "sync"); a forked child makes its own (the
    at-fork hook above forgets the parent's: no getpid per call, a system call, ~6 per cache
    entry; where os has no register_at_fork there is no fork either)."""
    found = _WRITERS.get(kind)
    if found is not None:
        return found
    with _WRITERS_LOCK:
        found = _WRITERS.get(kind)
        if found is None:
            found = _WRITERS[kind] = _core.FileWriter(_WRITER_THREADS[kind])
        return found


def _raise_named(error: OSError, path: str, what: str) -> NoReturn:
    """Raise `error`, as a ResourceLimitError naming the limit when it is one (descriptors,
    disk space: `common.mapping.resource_error`)."""
    limit = resource_error(error, path, what)
    if limit is None:
        raise error
    raise limit from error


class FileStatus(NamedTuple):
    """What ``os.fstat`` said of a written file (the fields that survive its rename), and its
    inode's generation (``_core.inode_generation``: -1 where the filesystem reports none)."""

    st_size: int
    st_ino: int
    st_mtime_ns: int
    st_ctime_ns: int
    st_gen: int = -1


class WrittenFile:
    """Bytes written and closed under a temporary name beside ``path``, for
    :func:`commit_together` to commit (or :meth:`abort` to remove).

    The small-file counterpart of :class:`AtomicFile`, for writers that have every byte at
    hand (cache entries: a blend writes thousands of small files). The file is created
    (``O_EXCL``), written, ``fstat``-ed and closed by `tokenmill._core.FileWriter` without the
    GIL; the mode is what ``open(path, "wb")`` gives (0o666 minus the umask, applied by the
    kernel).

    Args:
        path: the final path.
        chunks: the file's contents, in order (C-contiguous buffers). They must stay unchanged
            until the file is finished.
        background: return at once and write on a background thread; :meth:`finish` (or
            :func:`commit_together`) waits for it and raises its error. Otherwise the file is
            written when the constructor returns.

    Raises:
        FileNotFoundError: the directory of ``path`` does not exist.
        ResourceLimitError: out of descriptors or disk space (an OSError).
    """

    def __init__(
        self, path: str | os.PathLike[str], chunks: Iterable[object], *, background: bool = False
    ) -> None:
        self._prepare(path, chunks)
        self._start()
        if not background:
            self.finish()

    @classmethod
    def together(
        cls,
        files: Iterable[tuple[str | os.PathLike[str], Iterable[object]]],
        in_place: Sequence[bool] = (),
    ) -> list[WrittenFile]:
        """Background files (as ``WrittenFile(path, chunks, background=True)``) for (path,
        chunks) pairs, handed to the writer in one call: one lock, and a sleeping writer thread
        is woken only once a backlog of files is queued (csrc/file_writer.cpp; a cold build of a
        1,000-source blend writes 5,000 files, and a wake-up per entry cost more than the
        writing: the woken thread preempted the builder on a busy machine).

        `in_place[i]`: file i is created under its final name (``O_EXCL``) rather than a
        temporary one, so committing it is no rename; if the name exists, it falls back to a
        temporary file and a rename. Only for files that nothing reads before a later commit
        point (a cache entry's arrays and fingerprint, read only once its description is in
        place): such a file is visible while being written, and :meth:`abort` leaves it (a
        racing writer may have renamed its committed file over the name since).
        """
        made = []
        for number, (path, chunks) in enumerate(files):
            file = cls.__new__(cls)
            file._prepare(path, chunks)
            if number < len(in_place) and in_place[number]:
                file._in_place = True
                file.temporary_path = file.path
            else:
                file._name()
            made.append(file)
        tickets = _writer("write").submit_writes(
            [(file.temporary_path, file._chunks or []) for file in made]
        )
        for file, ticket in zip(made, tickets):
            file._ticket = ticket
            file._done = False
        return made

    def _prepare(self, path: str | os.PathLike[str], chunks: Iterable[object]) -> None:
        self.path = os.fspath(path)
        self._done = True  # nothing to remove until the temporary file exists
        self._ticket: int | None = None
        self._status: FileStatus | None = None
        self._error: OSError | None = None
        self._chunks: list[object] | None = list(chunks)
        self._in_place = False  # under its final name (together); never removed by abort

    def _name(self) -> None:
        directory, name = os.path.split(self.path)
        self.temporary_path = os.path.join(
            directory, f".{name}.{owner_tag()}.{next(_TEMPORARY_NUMBERS)}.tmp"
        )

    def _start(self) -> None:
        self._name()
        self._ticket = _writer("write").submit_write(self.temporary_path, self._chunks or [])
        self._done = False

    @property
    def status(self) -> FileStatus:
        """The written file's size, inode, mtime and ctime (waits for a background write)."""
        return self.finish()

    def finish(self) -> FileStatus:
        """Wait for the write; raise its error (again on every later call), with nothing left
        behind."""
        status = self._status
        if status is not None:  # waited for already: most calls (a batch's commit asks 4 times)
            return status
        try:
            return self._finish()
        except OSError as error:
            self._error = error
            raise

    def _finish(self) -> FileStatus:
        while self._status is None:
            if self._error is not None:
                raise self._error
            if self._ticket is None:
                raise RuntimeError(f"{self.path}: aborted before it was written")
            error, step, size, inode, mtime_ns, ctime_ns, generation = _writer("write").wait(
                self._ticket
            )
            self._ticket = None
            if not error:
                self._status = FileStatus(size, inode, mtime_ns, ctime_ns, generation)
                self._chunks = None
                break
            if step == _CREATE:
                self._done = True  # nothing was created
                if error == errno.EEXIST:
                    # in place: the name exists (an entry rebuilt, a racing or killed writer),
                    # so write beside it and rename; otherwise a temporary name left by an
                    # earlier process with this pid: the next number
                    self._in_place = False
                    self._start()
                    continue
                self._chunks = None
                if error == errno.ENOENT:
                    missing = os.path.dirname(os.path.abspath(self.path))
                    raise FileNotFoundError(
                        errno.ENOENT, f"directory of {self.path} does not exist: {missing}"
                    )
                _raise_named(
                    OSError(error, os.strerror(error), self.temporary_path),
                    self.temporary_path,
                    "create",
                )
            self.abort()
            _raise_named(
                OSError(error, os.strerror(error), self.temporary_path),
                self.temporary_path,
                "fsync" if step == _FSYNC else "write",
            )
        return self._status

    def commit(self) -> None:
        """Commit this file alone (:func:`commit_together`); on failure it is removed."""
        try:
            commit_together([self])
        finally:
            self.abort()  # no-op after commit

    def close_written(self) -> None:
        """Wait for the write (the interface of AtomicFile: the file is closed after it)."""
        self.finish()

    def abort(self) -> None:
        """Remove the temporary file (the final path is left untouched)."""
        if self._ticket is not None:  # still being written: wait, then remove
            ticket, self._ticket = self._ticket, None
            try:
                error, step, *_ = _writer("write").wait(ticket)
            except ValueError:  # a forked child's copy of its parent's file: not the child's
                error, step = errno.EEXIST, _CREATE
            if error and step == _CREATE:
                self._done = True  # nothing was created (an existing name is someone else's)
        self._chunks = None
        if self._done:
            return
        self._done = True
        if self._in_place:
            # the final name: a racing writer may have renamed its committed file over ours
            # since, and nothing reads it before a commit point that will not come
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary_path)

    def __del__(self) -> None:
        if not getattr(self, "_done", True) or getattr(self, "_ticket", None) is not None:
            self.abort()


def _sync_error(error: int, step: int, path: str) -> OSError:
    what = "open" if step == _OPEN else "fsync"
    return OSError(error, f"cannot {what} {path}: {os.strerror(error)}", path)


def _fsync_all(paths: Sequence[str]) -> None:
    """fsync every path, many in flight at once (the writer's threads)."""
    if not paths:
        return
    for path, (error, step) in zip(paths, _writer("sync").sync_all(list(paths))):
        if error:
            raise _sync_error(error, step, path)


# A commit of at least this many files syncs their filesystem once (FilesystemSync) instead of
# each file: a fsync of a new file waits for a journal commit of its own (ext4, xfs) or a round
# trip (NFS, Lustre), and 5,000 of them (a 1,000-source blend's cache) cost more than the build,
# while one syncfs writes the batch back in one pass. Below it, per-file fsyncs are cheaper.
WHOLE_FILESYSTEM_SYNC_FILES = 64
# ... unless the syncfs would also have to write back much else: more than this many bytes of
# other dirty data in the page cache (/proc/meminfo, every filesystem counted) and the batch
# fsyncs its files one by one instead of waiting for a stranger's checkpoint.
WHOLE_FILESYSTEM_SYNC_OTHER_BYTES = 128 << 20


def _dirty_bytes() -> int | None:
    """Dirty and under-writeback bytes in the page cache (Linux), None where unknown."""
    found = 0
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith((b"Dirty:", b"Writeback:")):
                    found += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return found


def much_else_dirty(ours: int = 0) -> bool:
    """Whether the page cache holds more than WHOLE_FILESYSTEM_SYNC_OTHER_BYTES of dirty data
    besides `ours` bytes (or cannot tell): a syncfs would write back a stranger's data too."""
    dirty = _dirty_bytes()
    return dirty is None or dirty - ours > WHOLE_FILESYSTEM_SYNC_OTHER_BYTES


class FilesystemSync:
    """A directory held open so that the files written in it afterwards can be made durable by
    one ``syncfs`` of its filesystem (Linux; :meth:`sync` returns False elsewhere).

    Open it before writing the files it is to cover: from Linux 5.8, syncfs reports a writeback
    error of the filesystem since the descriptor was opened, so a failure to write back one of
    those files raises, as its own fsync would. Holds one descriptor until :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.path.abspath(directory)
        self._descriptor: int | None = None
        self.device = -1
        with contextlib.suppress(OSError):  # cannot open it (no descriptors): fsync per file
            self._descriptor = os.open(
                self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC
            )
            self.device = os.fstat(self._descriptor).st_dev

    def sync(self) -> bool:
        """syncfs: every file written on this filesystem is on disk; False where that cannot be
        done (no syncfs, or the directory could not be opened)."""
        if self._descriptor is None:
            return False
        error = _core.sync_filesystem(self._descriptor, self.directory)
        if error == errno.ENOSYS:
            return False
        if error:
            raise OSError(
                error,
                f"cannot sync the filesystem of {self.directory}: {os.strerror(error)}",
                self.directory,
            )
        return True

    def sync_and_close(self, check: bool = True) -> None:
        """:meth:`sync` (errors raised only with `check`), then :meth:`close`."""
        try:
            if self._descriptor is not None:
                error = _core.sync_filesystem(self._descriptor, "early:" + self.directory)
                if error and check:
                    raise OSError(error, os.strerror(error), self.directory)
        finally:
            self.close()

    def close(self) -> None:
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            os.close(descriptor)


def sync_filesystems(
    files: Sequence[AtomicFile | WrittenFile], filesystems: Iterable[FilesystemSync]
) -> bool:
    """Make `files` (written, not yet committed) durable with one syncfs per filesystem, when
    they are at least WHOLE_FILESYSTEM_SYNC_FILES, every one lies in a directory of
    `filesystems` (opened before they were written), and the page cache holds at most
    WHOLE_FILESYSTEM_SYNC_OTHER_BYTES of other dirty data. False: nothing was done, fsync each
    file (:func:`commit_together` does, unless told they are synced)."""
    pending = [file for file in files if not file._done]
    if not fsync_enabled() or len(pending) < WHOLE_FILESYSTEM_SYNC_FILES:
        return False
    by_directory = {sync.directory: sync for sync in filesystems}
    needed = _directories(file.path for file in pending)
    if not needed <= by_directory.keys():
        return False
    ours = 0
    for file in pending:  # every file written (and closed) before the syncfs
        if isinstance(file, WrittenFile):
            ours += file.finish().st_size
        else:
            file.close_written()
    if much_else_dirty(ours):
        return False
    synced_devices: set[int] = set()
    for directory in sorted(needed):
        sync = by_directory[directory]
        if sync.device in synced_devices:
            continue
        if not sync.sync():
            return False
        synced_devices.add(sync.device)
    return True


def commit_together(files: Sequence[AtomicFile | WrittenFile], *, synced: bool = False) -> None:
    """Commit many written files as one group: every file finished and fsynced (many in flight
    at once), then each renamed in the order given, then each directory fsynced once.

    Durable as committing them one by one (no name is renamed before its data is on disk, and
    the renames are on disk when this returns), at about the cost of one fsync instead of two
    per file. Callers put commit points (a cache entry's description) after the files they vouch
    for. `synced`: the files' data is already on disk (:func:`sync_filesystems`); only the
    directories are fsynced.
    """
    pending = [file for file in files if not file._done]
    for file in pending:
        file.close_written()
    durable = fsync_enabled()
    if durable and pending and not synced:
        _fsync_all([file.temporary_path for file in pending])
    for file in pending:
        if not (isinstance(file, WrittenFile) and file._in_place):
            os.replace(file.temporary_path, file.path)
        file._done = True
    if durable:
        for directory in _directories(file.path for file in pending):
            fsync_directory(directory)


def _directories(paths: Iterable[str]) -> set[str]:
    """The absolute directories of `paths` (``os.path.dirname``'s), each made absolute once: a
    batch commits thousands of files of one directory, and ``dirname`` per file was a fifth of
    its commit's Python."""
    if os.altsep:  # two separators (Windows): dirname per path
        heads = {os.path.dirname(path) + os.sep for path in paths}
    else:  # each path up to its last separator: dirname of that is dirname of the path
        heads = {path[: path.rfind(os.sep) + 1] for path in paths}
    return {os.path.abspath(os.path.dirname(head) or os.curdir) for head in heads}


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
