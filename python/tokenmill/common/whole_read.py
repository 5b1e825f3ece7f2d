"""Small files read whole by one call into the compiled core.

A warm start reads five or so small files per source (the ``.idx``, three cached arrays, the data
fingerprint): each through ``_core.read_small_file``, which opens, ``fstat``s, reads and closes
without the GIL, straight into the ``bytes`` object returned. :func:`read_whole` is its one
Python face: errors raised as ``OSError`` naming the path, the status as a
:class:`~tokenmill.common.atomic.FileStatus`. :func:`refresh_attributes` makes the kernel ask the
filesystem for a file's attributes again, for a reader that suspects its own cached view.

:func:`reading_ahead` reads a blend's data files before they are asked for, on a thread of the
compiled core (``_core.ReadAhead``, csrc/read_ahead.hpp): inside it, :func:`read_whole` and
:func:`sampled_ahead` return what was read ahead for a path (once; after that, or for a path not
named, they read as usual). A cold build of a 1,000-source blend spent ~45 us per source on the
builder's thread opening, reading and fingerprinting each source's small ``.idx`` and ``.bin``,
most of it in the page faults of fresh memory: done on another core while the builder works.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import stat
from collections.abc import Iterator, Sequence
from typing import Any

from tokenmill import _core
from tokenmill.common.atomic import FileStatus

__all__ = [
    "Contents",
    "NotARegularFile",
    "read_whole",
    "reading_ahead",
    "refresh_attributes",
    "sampled_ahead",
]

Contents = bytes | _core.OwnedBuffer
"""A file read whole: bytes, or the read-only buffer of a read ahead (``len``, ``memoryview``)."""


class _Ahead:
    """One :func:`reading_ahead`: the core's reader and the request of each path."""

    def __init__(self, requests: Sequence[tuple[str, bool]], limit: int, sample: int) -> None:
        self.limit, self.sample = limit, sample
        self.whole: dict[str, int] = {}
        self.sampled: dict[str, int] = {}
        for number, (path, whole) in enumerate(requests):
            # a path named twice is read ahead once: the second open reads it as usual
            (self.whole if whole else self.sampled).setdefault(path, number)
        self.reader: _core.ReadAhead | None = _core.ReadAhead(
            [(path, whole, limit, sample) for path, whole in requests],
            _MAX_PENDING,
            _MAX_PENDING_BYTES,
        )

    def take(self, requests: dict[str, int], path: str) -> tuple[Any, ...] | None:
        number = requests.pop(path, None)  # each result is taken once
        reader = self.reader
        if number is None or reader is None:
            return None
        found: tuple[Any, ...] | None = reader.take(number)
        return found

    def close(self) -> None:
        """Stop the reader (its worker finishes the file it reads) and free what was not
        taken; what was taken stays with its takers."""
        self.reader = None


# how far the reader may run ahead of the builder: files and bytes read and not yet asked for
_MAX_PENDING = 64
_MAX_PENDING_BYTES = 64 << 20

_AHEAD: contextvars.ContextVar[_Ahead | None] = contextvars.ContextVar(
    "tokenmill_read_ahead", default=None
)


@contextlib.contextmanager
def reading_ahead(requests: Sequence[tuple[str, bool]], limit: int, sample: int) -> Iterator[None]:
    """Within the block, read the files of `requests`, (path, whole) pairs in the order they
    will be asked for, on a background thread: a whole one (if it has at most `limit` bytes)
    for :func:`read_whole`, the first and last `sample` bytes of the others for
    :func:`sampled_ahead`.

    What a file held when it was read ahead is what it is taken to hold, with the ``fstat``
    of that open: the caller gets contents and status of one open, as from a read of its own,
    only earlier. Errors are not raised ahead: a path whose read failed is read again when asked
    for (and raises then). Nested blocks: the inner one reads its own files."""
    ahead = _Ahead(requests, limit, sample)
    token = _AHEAD.set(ahead)
    try:
        yield
    finally:
        _AHEAD.reset(token)
        ahead.close()


def _taken(path: str, whole: bool, setting: int) -> tuple[Any, int, FileStatus] | None:
    """(contents, head, status) of `path` read ahead whole (`setting`: the size limit it was read
    with) or sampled (`setting`: the sample size), or None: not read ahead so, taken already,
    failed (read it again to raise) or, whole, over the limit (the caller maps it)."""
    ahead = _AHEAD.get()
    if ahead is None or setting != (ahead.limit if whole else ahead.sample):
        return None
    found = ahead.take(ahead.whole if whole else ahead.sampled, path)
    if found is None:
        return None
    error, _, data, head, size, inode, mtime_ns, ctime_ns = found
    if error or data is None:
        return None
    return data, head, FileStatus(size, inode, mtime_ns, ctime_ns, -1)


def sampled_ahead(path: str, sample: int) -> tuple[FileStatus, memoryview, memoryview] | None:
    """(status, head, tail) of `path` as read ahead by the enclosing :func:`reading_ahead`: the
    first `sample` bytes and the last `sample` after them (read-only views), with the ``fstat``
    of that open (the generation is not asked for: -1). None when it was not read ahead (not
    named, taken already, another sample size, or its read failed: read it again to see why)."""
    taken = _taken(path, False, sample)
    if taken is None:
        return None
    data, head, status = taken
    view = memoryview(data)
    return status, view[:head], view[head:]


def read_whole(
    path: str,
    limit: int,
    want_generation: bool = False,
    keep_open: bool = False,
    ahead: bool = False,
) -> tuple[Contents | int | None, FileStatus]:
    """(contents, status) of the file at `path`, read whole by one call if it has at most
    `limit` bytes.

    The contents are the file's bytes, or for a larger file None, or with `keep_open` its open
    read-only descriptor, for the caller to map and close (no second open or ``fstat``). The
    read asks for one byte more than ``fstat`` reported, so a file that grew since shows as
    longer than its status says. The status carries the inode's generation only with
    `want_generation` (-1 otherwise, or where the filesystem reports none). With `ahead`,
    inside :func:`reading_ahead`, a file read ahead is not read again: its contents are then a
    read-only buffer (``_core.OwnedBuffer``: ``len``, ``memoryview``, ``numpy.frombuffer``);
    without it, they are bytes.

    Raises:
        OSError: the open, ``fstat`` or read failed (errno and `path`; FileNotFoundError for a
            missing file), or `path` is not a regular file (a FIFO, planted where a data or
            cache file is expected, is opened without blocking and refused).
    """
    if ahead and not want_generation:
        taken = _taken(path, True, limit)
        if taken is not None:
            return taken[0], taken[2]
    error, step, data, size, inode, mtime_ns, ctime_ns, generation = _core.read_small_file(
        path, limit, want_generation, keep_open
    )
    if error:
        if step == _NOT_REGULAR:
            raise NotARegularFile(error, path, _kind(path))
        raise OSError(error, os.strerror(error), path)
    return data, FileStatus(size, inode, mtime_ns, ctime_ns, generation)


_NOT_REGULAR = 6  # read_small_file's step for a file that is not a regular file


class NotARegularFile(OSError):
    """A FIFO, device, socket or directory where a data or cache file is expected; `kind` says
    which ("is a FIFO", ...)."""

    def __init__(self, error: int, path: str, kind: str) -> None:
        super().__init__(error, f"{kind}, not a regular file; refusing it", path)
        self.kind = kind


def _kind(path: str) -> str:
    """What the non-regular file at `path` is, for the refusal's message."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "is a special file"
    if stat.S_ISFIFO(mode):
        return "is a FIFO"
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISSOCK(mode):
        return "is a socket"
    return "is a device or special file"


# statx(2): AT_FDCWD, AT_STATX_FORCE_SYNC, STATX_BASIC_STATS, and the size of struct statx
_AT_FDCWD = -100
_AT_STATX_FORCE_SYNC = 0x2000
_STATX_BASIC_STATS = 0x7FF
_STATX_BYTES = 256


@functools.cache
def _statx() -> Any:
    """libc's statx (glibc >= 2.28), None where there is none (found among the symbols the
    interpreter already has: no ldconfig run, as ctypes.util.find_library would start)."""
    if os.uname().sysname != "Linux":
        return None
    try:
        found = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None
    found.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    found.restype = ctypes.c_int
    return found


def refresh_attributes(path: str) -> bool:
    """Make this machine's kernel fetch the attributes (size, times, inode) of `path` from its
    filesystem, not its attribute cache: ``statx`` with ``AT_STATX_FORCE_SYNC``, which FUSE
    and NFS honour and local filesystems ignore. Returns whether it was asked (False where
    there is no statx, or the call failed).

    Why: a FUSE mount (or NFS without close-to-open consistency) serves a name's attributes
    from its cache until a timeout (bindfs 1 s, gcsfuse's stat cache a minute), and a read of
    the file stops at the cached size. A host that looked at a cache file under its final name
    while another host was still writing it there (a racing builder's ``O_EXCL`` create, its
    own builder killed after creating it) can see that file empty or short after the other
    host committed the entry whole. Readers call this when a committed file looks damaged,
    then read it once more."""
    statx = _statx()
    if statx is None:
        return False
    status = ctypes.create_string_buffer(_STATX_BYTES)
    done = statx(_AT_FDCWD, os.fsencode(path), _AT_STATX_FORCE_SYNC, _STATX_BASIC_STATS, status)
    return bool(done == 0)
