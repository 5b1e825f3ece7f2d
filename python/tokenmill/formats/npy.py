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
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.errors import DataFormatError

__all__ = ["load_npy"]

_SMALL_FILE = 4096


def load_npy(path: str | os.PathLike[str]) -> npt.NDArray[Any]:
    """Memory-map a ``.npy`` file read-only (pickled object arrays are refused).

    Files numpy cannot map (an empty array) are read instead, if they are small.

    Raises:
        FileNotFoundError: no such file.
        PermissionError: the file cannot be opened.
        DataFormatError: anything else: bad magic, malformed header, object dtype, a file shorter
            than its header's shape, or a header describing an impossible array.
    """
    path = os.fspath(path)
    array: Any  # np.load returns an NpzFile for a zip archive
    try:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError:
            # numpy cannot map an empty array; such files are tiny, so read them instead.
            if os.path.getsize(path) > _SMALL_FILE:
                raise
            array = np.load(path, allow_pickle=False)
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as error:  # numpy's header parser raises many types; see the docstring
        raise DataFormatError(
            f"{path}: not a valid .npy file ({type(error).__name__}: {error})"
        ) from error
    if not isinstance(array, np.ndarray):
        close = getattr(array, "close", None)  # an .npz archive holds an open file
        if close is not None:
            close()
        raise DataFormatError(f"{path}: not a .npy array file (got {type(array).__name__})")
    from tokenmill.formats.validate import check_npy_extent

    check_npy_extent(path, array)
    result: npt.NDArray[Any] = array
    return result
