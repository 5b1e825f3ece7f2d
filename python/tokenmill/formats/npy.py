"""Reading ``.npy`` files (token files, index caches) with one documented failure type.

``numpy.load`` reports a malformed header through whatever its header parser happens to raise:
ValueError, but also ``tokenize.TokenError``, SyntaxError, TypeError, KeyError, OverflowError,
MemoryError or RecursionError (found by fuzzing ``tests/fuzz/harnesses.py``). Callers should not
need to know that list, so :func:`load_npy` turns every failure to parse or map the file into
:class:`~tokenmill.errors.DataFormatError` naming the file, and lets only FileNotFoundError and
PermissionError (problems of the path, not of the contents) through unchanged.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.atomic import FileStatus
from tokenmill.common.mapping import map_readonly, open_readonly, resource_error
from tokenmill.common.whole_read import read_whole
from tokenmill.errors import DataFormatError, ResourceLimitError
from tokenmill.formats.validate import check_npy_extent

__all__ = ["load_npy", "load_npy_and_status"]

READ_BELOW = 1 << 16
"""Arrays of at most this many bytes are read into memory instead of mapped: a map costs a
kernel map slot (vm.max_map_count) for the life of the array, and a blend of thousands of sources
holds thousands of small cached arrays. Larger arrays are mapped (reading them would copy what a
sample may never touch)."""


# The header numpy.save writes for a plain dtype: parsed with one regex, because numpy's
# general parser (ast.literal_eval) costs more than the rest of opening a small cached array.
_PLAIN = re.compile(
    rb"\{'descr': '(?P<descr>[<>|=][a-zA-Z]\d+)', 'fortran_order': (?P<fortran>True|False), "
    rb"'shape': \((?P<shape>|\d+,|\d+(?:, \d+)+)\), \} *\n"
)


def _fast_header(head: bytes) -> tuple[tuple[int, ...], bool, np.dtype[Any], int] | None:
    """The header of a version 1.0 file with a plain dtype, or None for anything else."""
    if len(head) < 10 or head[:8] != b"\x93NUMPY\x01\x00":
        return None
    end = 10 + int.from_bytes(head[8:10], "little")
    match = _PLAIN.fullmatch(head[10:end])
    if match is None:
        return None
    shape = tuple(int(n) for n in match["shape"].split(b",") if n.strip())
    dtype = np.dtype(match["descr"].decode("ascii"))
    if dtype.hasobject:
        return None
    return shape, match["fortran"] == b"True", dtype, end


def _header(stream: Any, path: str) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version in ((2, 0), (3, 0)):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise ValueError(f"unsupported .npy version {version}")
    if dtype.hasobject:
        raise ValueError(f"object dtype {dtype} cannot be loaded without pickle")
    if dtype.subdtype is not None:
        # numpy.save writes a subarray dtype's dimensions into 'shape' and never a descr such
        # as '5u2': a header that has one describes an array whose data does not fit its shape
        raise ValueError(f"descr {dtype.str!r} is a subarray dtype, which numpy.save never writes")
    return tuple(int(n) for n in shape), bool(fortran), dtype, stream.tell()


def load_npy(path: str | os.PathLike[str]) -> npt.NDArray[Any]:
    """A read-only ``.npy`` array; see :func:`load_npy_and_status`."""
    return _load(path, False)[0]


def load_npy_and_status(path: str | os.PathLike[str]) -> tuple[npt.NDArray[Any], FileStatus]:
    """:func:`load_npy`, with the ``fstat`` of the file it read and its inode's generation (one
    ``ioctl``; one more ``fstat`` for arrays that are read, none for mapped ones): size, mtime,
    inode and generation of exactly those bytes."""
    array, status = _load(path, True)
    assert status is not None
    return array, status


# Files up to this size are read whole by one call (`_core.read_small_file`: open, fstat, read,
# close without the GIL); the header of a plain array written by numpy is 128 bytes, so every
# array of up to READ_BELOW data bytes fits. Larger headers take the descriptor path below.
_READ_WHOLE_BELOW = READ_BELOW + 128


def _read_small(
    path: str, want_status: bool
) -> tuple[npt.NDArray[Any], FileStatus | None] | tuple[int, FileStatus] | None:
    """The array at `path` if the file is small and its header plain, read by one call;
    (descriptor, status) for a larger file, left open for the general path to map (no second
    open); None when the general path must open it (an unusual header).

    Raises:
        OSError: from the read (errno and path), for _load to classify.
        DataFormatError: the file is not header + data exactly.
    """
    data, status = read_whole(path, _READ_WHOLE_BELOW, want_status, keep_open=True)
    if isinstance(data, int):
        return data, status
    if not isinstance(data, bytes):  # None: too large (never a read ahead's: not asked for)
        return None
    fast = _fast_header(data)
    if fast is None:
        return None
    shape, fortran, dtype, offset = fast
    count = 1
    for extent in shape:
        count *= extent
    nbytes = count * dtype.itemsize
    if nbytes > READ_BELOW:  # mapped, as every larger array is
        return None
    check_npy_extent(path, data[offset - 1 : offset], offset, nbytes, len(data), shape, dtype)
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    array = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    array.flags.writeable = False
    return array, (status if want_status else None)


def _load_error(error: Exception, path: str) -> Exception:
    """What a failure to read `path` is reported as: running out of descriptors or maps as
    the limit (ResourceLimitError), anything else as a file that is not a valid .npy."""
    if isinstance(error, OSError):
        limit = resource_error(error, path, "read")
        if limit is not None:
            return limit
        return DataFormatError(f"{path}: not a valid .npy file ({error})")
    return DataFormatError(f"{path}: not a valid .npy file ({type(error).__name__}: {error})")


def _load(
    path: str | os.PathLike[str], want_status: bool
) -> tuple[npt.NDArray[Any], FileStatus | None]:
    """A read-only ``.npy`` array (pickled object arrays are refused): memory-mapped when larger
    than :data:`READ_BELOW` bytes, read otherwise. No file descriptor stays open either way (see
    `tokenmill.common.mapping`).

    Raises:
        FileNotFoundError: no such file.
        PermissionError: the file cannot be opened.
        ResourceLimitError: out of descriptors or memory maps (the message names the limit).
        DataFormatError: anything else: bad magic, malformed header, object dtype, a file shorter
            than its header's shape, or a header describing an impossible array.
    """
    path = os.fspath(path)
    try:
        small = _read_small(path, want_status)
    except (FileNotFoundError, PermissionError, ResourceLimitError, DataFormatError):
        raise
    except Exception as error:  # numpy's dtype parser; see the module docstring
        raise _load_error(error, path) from error
    known: FileStatus | None = None  # the status of the descriptor _read_small left open
    if small is None:
        descriptor = open_readonly(path)
    elif isinstance(small[0], int):
        descriptor, known = small
    else:
        return small
    try:
        # raw descriptor calls (open, pread, [fstat, mmap,] close): a Python file object adds
        # four system calls per file, and a blend opens thousands of these
        head = os.pread(descriptor, 256, 0)
        fast = _fast_header(head)
        if fast is None:
            with open(descriptor, "rb", closefd=False) as stream:
                fast = _header(stream, path)
        shape, fortran, dtype, offset = fast
        count = 1
        for extent in shape:
            count *= extent
        nbytes = count * dtype.itemsize
        header_end = head[offset - 1 : offset] if offset <= len(head) else None
        if header_end is None:
            header_end = os.pread(descriptor, 1, offset - 1)
        status: os.stat_result | FileStatus | None = known
        if status is None and (want_status or nbytes > READ_BELOW):
            status = os.fstat(descriptor)
        if nbytes <= READ_BELOW:
            # one byte more than the data: a file longer than header + data is refused too
            data = os.pread(descriptor, nbytes + 1, offset)
            check_npy_extent(path, header_end, offset, nbytes, offset + len(data), shape, dtype)
            flat = np.frombuffer(data, dtype=dtype, count=count)
        else:
            assert status is not None
            check_npy_extent(path, header_end, offset, nbytes, status.st_size, shape, dtype)
            mapping = map_readonly(descriptor, offset + nbytes, path)
            flat = np.frombuffer(mapping, dtype=dtype, count=count, offset=offset)
        file_status = None
        if want_status and known is not None:
            file_status = known
        elif want_status:
            assert isinstance(status, os.stat_result)
            file_status = FileStatus(
                status.st_size,
                status.st_ino,
                status.st_mtime_ns,
                status.st_ctime_ns,
                _core.inode_generation(descriptor),
            )
    except (FileNotFoundError, PermissionError, ResourceLimitError, DataFormatError):
        raise
    except Exception as error:  # numpy's header parser raises many types; see the docstring
        raise _load_error(error, path) from error
    finally:
        os.close(descriptor)
    array = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    array.flags.writeable = False
    result: npt.NDArray[Any] = array
    return result, file_status
