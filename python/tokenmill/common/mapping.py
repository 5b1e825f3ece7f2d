"""Read-only memory maps that keep no file descriptor, and resource exhaustion named as such.

Why not ``mmap.mmap`` or ``numpy.memmap``: before Python 3.13 (``trackfd=False``) the ``mmap``
module duplicates the descriptor it maps and keeps the duplicate open for the life of the map, so
every mapped file costs a descriptor until its arrays die. A blend of 10,000 sources then needs
tens of thousands of descriptors and fails under the common ``ulimit -n 1024``. A map does not need
its descriptor once it exists, so :func:`map_readonly` maps with ``mmap(2)`` in the compiled core
(``_core.map_readonly``: a call there costs a fraction of a ctypes call and its finalizer, and a
blend maps one ``.idx`` and up to three cached arrays per source) and lets the caller close the
descriptor at once; the map is unmapped when the last array viewing it is freed.

:func:`resource_error` turns the ``OSError`` of an ``open``/``mmap`` that failed for lack of
descriptors or map slots into :class:`~tokenmill.errors.ResourceLimitError`, whose message names
the limit to raise, so callers never mistake it for a missing or corrupt file.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from tokenmill import _core
from tokenmill.errors import ResourceLimitError

__all__ = [
    "READ_BELOW",
    "map_file",
    "map_readonly",
    "open_readonly",
    "read_or_map",
    "resource_error",
]

_LIMITS = {
    errno.EMFILE: "too many open files in this process: raise the descriptor limit (ulimit -n)",
    errno.ENFILE: "too many open files on this machine: raise fs.file-max (sysctl)",
    errno.ENOMEM: (
        "no memory map available: raise vm.max_map_count (sysctl; the default 65530 caps a "
        "process near 65,000 maps) or the address-space limit (ulimit -v)"
    ),
    errno.EAGAIN: "the kernel refused to lock or map more memory (ulimit -l / ulimit -v)",
    errno.ENOSPC: "the filesystem is full: free space there or write elsewhere",
    errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota",
}


def resource_error(error: OSError, path: str, what: str = "open") -> ResourceLimitError | None:
    """The ResourceLimitError that `error` (from opening or mapping `path`) stands for, or None
    when it is not a resource limit (a missing or unreadable file is the caller's business).

    EPERM from ``mmap`` (a filesystem that refuses shared maps, e.g. WekaFS in some setups) is
    reported too, as a refusal to map rather than a damaged file.
    """
    code = error.errno
    if code in _LIMITS:
        reason = _LIMITS[code]
    elif code == errno.EPERM and what == "map":
        reason = (
            "the filesystem refused a shared read-only memory map (EPERM): copy the data to a "
            "filesystem that supports mmap, or read without maps (mmap_bin_files=False)"
        )
    else:
        return None
    limit = ResourceLimitError(code, f"cannot {what} {path}: {reason} ({os.strerror(code)})")
    limit.filename = path
    return limit


def map_readonly(descriptor: int, length: int, path: str = "") -> memoryview:
    """A read-only map of the first `length` bytes of the open file `descriptor`.

    The descriptor may be closed as soon as this returns; the map lives as long as the returned
    view or any array made from it (``numpy.frombuffer``).

    Raises:
        ResourceLimitError: the process or machine is out of maps or address space (the message
            names the limit to raise), or the filesystem refuses maps (EPERM).
        OSError: any other failure of ``mmap``.
        ValueError: `length` is not positive (an empty file cannot be mapped).
    """
    if length <= 0:
        raise ValueError(f"cannot map {length} bytes of {path or descriptor}")
    try:
        region = _core.map_readonly(descriptor, length)
    except OSError as error:
        limit = resource_error(error, path or f"descriptor {descriptor}", "map")
        if limit is not None:
            raise limit from error
        raise
    return memoryview(region)  # read-only bytes; the map lives while any view does


# Files up to this size are read into memory rather than mapped: the read is one system call,
# where a map costs the mmap, a page fault per page touched and an munmap, and one of the
# process's vm.max_map_count maps. A blend of thousands of small sources opens thousands of
# such files (and a cold build touches every page of each).
READ_BELOW = 1 << 16


def read_or_map(descriptor: int, length: int, path: str = "") -> memoryview:
    """The first `length` bytes of the open file `descriptor`, read-only: read into memory up
    to READ_BELOW bytes, mapped above (:func:`map_readonly`). Either way the descriptor may be
    closed when this returns.

    Raises:
        OSError: EIO naming the file if it is shorter than `length`; as map_readonly otherwise.
        ResourceLimitError, ValueError: as map_readonly.
    """
    if length > READ_BELOW:
        return map_readonly(descriptor, length, path)
    if length <= 0:
        raise ValueError(f"cannot map {length} bytes of {path or descriptor}")
    buffer = bytearray(length)
    view = memoryview(buffer)
    done = 0
    while done < length:
        got = os.preadv(descriptor, [view[done:]], done)
        if got == 0:
            raise OSError(
                errno.EIO, f"{path or descriptor}: file ended after {done} of {length} bytes"
            )
        done += got
    return view.toreadonly()


def open_readonly(path: str) -> int:
    """A read-only descriptor of `path` (raw ``os.open``: a Python file object costs four more
    system calls, and a blend opens thousands of files).

    Raises:
        FileNotFoundError: no such file.
        ResourceLimitError: out of descriptors (the message names the limit).
        OSError: any other failure to open it.
    """
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        limit = resource_error(error, path)
        if limit is not None:
            raise limit from error
        raise


def map_file(path: str, dtype: Any, offset: int = 0) -> Any:
    """The file at `path` from byte `offset` on, as a read-only numpy array of `dtype`, mapped
    without keeping a descriptor (:func:`map_readonly`); an empty remainder gives an empty array.
    The caller checks that the size is a whole number of items (a remainder is not mapped).

    Raises:
        FileNotFoundError: no such file.
        ResourceLimitError: out of descriptors or maps (the message names the limit).
        OSError: any other failure to open or map the file.
    """
    import numpy as np

    item = np.dtype(dtype)
    descriptor = open_readonly(path)
    try:
        count = max(0, os.fstat(descriptor).st_size - offset) // item.itemsize
        if count == 0:
            empty = np.empty(0, dtype=item)
            empty.flags.writeable = False
            return empty
        mapping = map_readonly(descriptor, offset + count * item.itemsize, path)
    finally:
        os.close(descriptor)
    return np.frombuffer(mapping, dtype=item, count=count, offset=offset)
