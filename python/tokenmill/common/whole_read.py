"""Small files read whole by one call into the compiled core.

A warm start reads five or so small files per source (the ``.idx``, three cached arrays, the data
fingerprint): each through ``_core.read_small_file``, which opens, ``fstat``s, reads and closes
without the GIL, straight into the ``bytes`` object returned. :func:`read_whole` is its one
Python face: errors raised as ``OSError`` naming the path, the status as a
:class:`~tokenmill.common.atomic.FileStatus`. :func:`refresh_attributes` makes the kernel ask the
filesystem for a file's attributes again, for a reader that suspects its own cached view.
"""

from __future__ import annotations

import ctypes
import functools
import os
import stat
from typing import Any

from tokenmill import _core
from tokenmill.common.atomic import FileStatus

__all__ = ["NotARegularFile", "read_whole", "refresh_attributes"]


def read_whole(
    path: str, limit: int, want_generation: bool = False, keep_open: bool = False
) -> tuple[bytes | int | None, FileStatus]:
    """(contents, status) of the file at `path`, read whole by one call if it has at most
    `limit` bytes.

    The contents are the file's bytes, or for a larger file None, or with `keep_open` its open
    read-only descriptor, for the caller to map and close (no second open or ``fstat``). The
    read asks for one byte more than ``fstat`` reported, so a file that grew since shows as
    longer than its status says. The status carries the inode's generation only with
    `want_generation` (-1 otherwise, or where the filesystem reports none).

    Raises:
        OSError: the open, ``fstat`` or read failed (errno and `path`; FileNotFoundError for a
            missing file), or `path` is not a regular file (a FIFO, planted where a data or
            cache file is expected, is opened without blocking and refused).
    """
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
