"""Directories of flat token arrays (KempnerForge's and OLMo-core's layouts): ``.npy`` files or
raw files.

Each file is one 1-D array of token ids; a directory's files, sorted by name, are its shards.

* ``.npy``: numpy's own format; the dtype, shape and byte order come from its header. The array
  must be 1-D with an integer dtype.
* OLMo-core's token files (dolma's output, written by ``olmo_core.data.utils.memmap_to_write``)
  are named ``.npy`` but hold no header: they are raw tokens whose dtype comes from the training
  config. A ``.npy``-named file that does not start with numpy's magic (``\x93NUMPY``) is read as
  raw tokens, with the dtype told as for raw files below (``tokenmill convert --to olmo`` writes
  the sidecar). Without a dtype it is refused, naming both readings.
* raw ``.bin`` (headerless, little-endian): the file is nothing but tokens, so the dtype must be
  *told*: an explicit ``dtype`` argument, else the sidecar ``tokenmill.json`` in the same
  directory (``{"format": "raw-tokens", "version": 1, "dtype": "uint32"}``, written by
  :func:`write_raw_metadata` and ``tokenmill convert``). KempnerForge instead guesses from the
  file size (uint32 when ``size % 4 == 0``, else uint16), which reads a uint16 file with an even
  token count as uint32 garbage; tokenmill applies that guess only with ``guess_dtype=True``.
  Either way a file that starts with a modded-nanogpt header is refused: read it with
  :class:`~tokenmill.formats.nanogpt.NanogptShard`, whose header says where the tokens start.

Every failure raises :class:`~tokenmill.errors.DataFormatError` naming the file. Opening a file
maps it (O(1)); the arrays are read-only zero-copy views. Writers are atomic: ``.npy`` shards are
written through a temporary name (streaming with :class:`NpyShardWriter`, constant memory).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.common.atomic import AtomicFile, AtomicWriter
from tokenmill.common.mapping import map_file
from tokenmill.errors import DataFormatError

__all__ = [
    "RAW_METADATA_NAME",
    "NpyShardWriter",
    "RawTokenWriter",
    "guess_raw_dtype",
    "has_npy_magic",
    "list_token_files",
    "open_token_file",
    "read_raw_metadata",
    "write_npy_shard",
    "write_raw_metadata",
]

RAW_METADATA_NAME = "tokenmill.json"
_RAW_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")


def list_token_files(data_dir: str | os.PathLike[str], file_pattern: str = "*.npy") -> list[Path]:
    """The files of ``data_dir`` matching ``file_pattern``, sorted (KempnerForge's order).

    Raises:
        FileNotFoundError: nothing matches.
    """
    directory = Path(data_dir)
    files = sorted(path for path in directory.glob(file_pattern) if path.is_file())
    if not files:
        raise FileNotFoundError(f"no files matching {file_pattern!r} in {os.fspath(data_dir)}")
    return files


def write_raw_metadata(directory: str | os.PathLike[str], dtype: npt.DTypeLike) -> str:
    """Write the ``tokenmill.json`` sidecar that names the dtype of raw ``.bin`` files.

    Returns:
        The sidecar's path.
    """
    name = np.dtype(dtype).name
    if name not in _RAW_DTYPES:
        raise ValueError(f"raw token files hold integer tokens, got dtype {name}")
    path = os.path.join(os.fspath(directory), RAW_METADATA_NAME)
    target = AtomicFile(path)
    try:
        text = json.dumps({"format": "raw-tokens", "version": 1, "dtype": name}, indent=2)
        target.stream.write((text + "\n").encode())
        target.commit()
    except BaseException:
        target.abort()
        raise
    return path


def read_raw_metadata(directory: str | os.PathLike[str]) -> np.dtype[Any] | None:
    """The dtype named by the directory's ``tokenmill.json``, or None without one.

    Raises:
        DataFormatError: the sidecar is not valid JSON or names no integer dtype.
    """
    path = os.path.join(os.fspath(directory), RAW_METADATA_NAME)
    try:
        with open(path, encoding="utf-8") as stream:
            content = json.load(stream)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataFormatError(f"{path}: not valid JSON ({error})") from error
    name = content.get("dtype") if isinstance(content, dict) else None
    if name not in _RAW_DTYPES:
        raise DataFormatError(
            f"{path}: 'dtype' is {name!r}, expected one of {', '.join(_RAW_DTYPES)}"
        )
    return np.dtype(str(name))


def guess_raw_dtype(path: str | os.PathLike[str]) -> np.dtype[Any]:
    """KempnerForge's guess: uint32 when the file size is a multiple of 4, else uint16.

    Raises:
        DataFormatError: the file starts with a modded-nanogpt header.
    """
    path = os.fspath(path)
    _refuse_nanogpt(path)
    return np.dtype(np.uint32 if os.path.getsize(path) % 4 == 0 else np.uint16)


def _refuse_nanogpt(path: str) -> None:
    from tokenmill.formats.nanogpt import is_nanogpt_shard

    if is_nanogpt_shard(path):
        raise DataFormatError(
            f"{path}: starts with a modded-nanogpt header (256 int32, magic 20240520 or "
            "278895051); reading it as raw tokens would return the header as tokens. Open it "
            "with tokenmill.formats.nanogpt.NanogptShard or NanogptDataset"
        )


def open_token_file(
    path: str | os.PathLike[str],
    dtype: npt.DTypeLike | None = None,
    *,
    guess_dtype: bool = False,
) -> npt.NDArray[Any]:
    """Map one token file read-only.

    Args:
        path: a ``.npy`` file, or a raw headerless file (any other suffix, or a ``.npy`` name
            without numpy's magic: OLMo-core's layout).
        dtype: for raw files, the token dtype; for ``.npy`` files, if given, the header must
            agree.
        guess_dtype: for raw files without ``dtype`` or a sidecar, use KempnerForge's file-size
            guess (:func:`guess_raw_dtype`).

    Returns:
        A 1-D read-only array of the file's tokens (zero-copy).

    Raises:
        FileNotFoundError: no such file.
        DataFormatError: a bad ``.npy``, a raw file of unknown dtype or of a size that is not a
            whole number of tokens, or a raw file with a modded-nanogpt header.
    """
    path = os.fspath(path)
    if path.endswith(".npy") and has_npy_magic(path):
        return _open_npy(path, dtype)
    _refuse_nanogpt(path)
    if dtype is not None:
        resolved = np.dtype(dtype)
    else:
        sidecar = read_raw_metadata(os.path.dirname(os.path.abspath(path)))
        if sidecar is not None:
            resolved = sidecar
        elif guess_dtype:
            resolved = guess_raw_dtype(path)
        else:
            if path.endswith(".npy"):
                raise DataFormatError(
                    f"{path}: not a valid .npy file (it lacks numpy's \\x93NUMPY magic); read "
                    "as an OLMo-core token file (headerless tokens named .npy, dtype in the "
                    "training config), its dtype is ambiguous: pass dtype=... (--dtype), write "
                    f"a {RAW_METADATA_NAME} sidecar (write_raw_metadata), or opt into "
                    "KempnerForge's size guess with guess_dtype=True"
                )
            raise DataFormatError(
                f"{path}: the dtype of a raw token file is ambiguous (the file has no header); "
                f"pass dtype=... (--dtype), write a {RAW_METADATA_NAME} sidecar "
                "(write_raw_metadata), or opt into KempnerForge's size guess with guess_dtype=True"
            )
    if resolved.name not in _RAW_DTYPES:
        raise DataFormatError(f"{path}: raw tokens must be an integer dtype, got {resolved}")
    size = os.path.getsize(path)
    if size % resolved.itemsize:
        raise DataFormatError(
            f"{path}: {size} bytes is not a whole number of {resolved.name} tokens "
            f"({resolved.itemsize} bytes each)"
        )
    if size == 0:
        empty = np.empty(0, dtype=resolved)
        empty.flags.writeable = False
        return empty
    # mapped without keeping a descriptor: a directory of thousands of shards holds none
    tokens: npt.NDArray[Any] = map_file(path, resolved.newbyteorder("<"))
    return tokens


NPY_MAGIC = b"\x93NUMPY"


def has_npy_magic(path: str | os.PathLike[str]) -> bool:
    """Whether a file starts with numpy's ``.npy`` magic (an empty or shorter file does not)."""
    with open(os.fspath(path), "rb") as stream:
        return stream.read(len(NPY_MAGIC)) == NPY_MAGIC


def _open_npy(path: str, dtype: npt.DTypeLike | None) -> npt.NDArray[Any]:
    from tokenmill.formats.npy import load_npy

    array = load_npy(path)
    if array.ndim != 1:
        raise DataFormatError(f"{path}: token arrays must be 1-D, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise DataFormatError(f"{path}: token arrays must be integers, got {array.dtype}")
    if dtype is not None and np.dtype(dtype) != array.dtype.newbyteorder("="):
        raise DataFormatError(
            f"{path}: its header says dtype {array.dtype}, but {np.dtype(dtype)} was requested"
        )
    return array


class NpyShardWriter(AtomicWriter):
    """Streams ``token_count`` tokens into a ``.npy`` file (constant memory, atomic).

    Args:
        path: the ``.npy`` to write.
        dtype: the token dtype.
        token_count: the exact number of tokens that will be written.
    """

    def __init__(
        self, path: str | os.PathLike[str], dtype: npt.DTypeLike, token_count: int
    ) -> None:
        self.path = os.fspath(path)
        self.dtype = np.dtype(dtype)
        if self.dtype.kind not in "iu":
            raise ValueError(f"{self.path}: token dtype must be an integer type, got {self.dtype}")
        self.token_count = int(token_count)
        self.written = 0
        self._file = AtomicFile(self.path)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.token_count,)}  # fmt: skip
        np.lib.format.write_array_header_1_0(self._file.stream, header)

    def write(self, tokens: npt.ArrayLike) -> None:
        """Append tokens (checked to fit the dtype)."""
        array = np.asarray(tokens).reshape(-1)
        if array.shape[0] == 0:
            return
        if self.written + array.shape[0] > self.token_count:
            raise ValueError(
                f"{self.path}: more than the announced {self.token_count} tokens were written"
            )
        if array.dtype.kind not in "iu":
            raise TypeError(f"{self.path}: tokens must be integers, got {array.dtype}")
        if not np.can_cast(array.dtype, self.dtype, casting="safe"):
            info = np.iinfo(self.dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                bad = low if low < info.min else high
                raise OverflowError(f"{self.path}: token {bad} does not fit {self.dtype}")
        data = np.ascontiguousarray(array, dtype=self.dtype)
        self._file.stream.write(data.data.cast("B"))
        self.written += array.shape[0]

    def finalize(self) -> None:
        """Rename the file into place.

        Raises:
            ValueError: fewer tokens were written than announced.
        """
        if self.written != self.token_count:
            self._file.abort()
            raise ValueError(
                f"{self.path}: {self.written} tokens written, {self.token_count} announced"
            )
        self._file.commit()


class RawTokenWriter(AtomicWriter):
    """Streams tokens into a headerless little-endian file: OLMo-core's layout when the name ends
    in ``.npy`` (constant memory, atomic). The dtype is not in the file: write the sidecar
    (:func:`write_raw_metadata`) or name it in OLMo-core's config.

    Args:
        path: the file to write.
        dtype: an integer token dtype (OLMo-core reads uint8, uint16, uint32 and uint64).
    """

    def __init__(self, path: str | os.PathLike[str], dtype: npt.DTypeLike) -> None:
        self.path = os.fspath(path)
        self.dtype = np.dtype(dtype)
        if self.dtype.name not in _RAW_DTYPES:
            raise ValueError(f"{self.path}: token dtype must be an integer type, got {self.dtype}")
        self.written = 0
        self._file = AtomicFile(self.path)

    def write(self, tokens: npt.ArrayLike) -> None:
        """Append tokens (checked to fit the dtype: OverflowError, TypeError)."""
        array = np.asarray(tokens).reshape(-1)
        if array.shape[0] == 0:
            return
        if array.dtype.kind not in "iu":
            raise TypeError(f"{self.path}: tokens must be integers, got {array.dtype}")
        if not np.can_cast(array.dtype, self.dtype, casting="safe"):
            info = np.iinfo(self.dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                bad = low if low < info.min else high
                raise OverflowError(f"{self.path}: token {bad} does not fit {self.dtype}")
        data = np.ascontiguousarray(array, dtype=self.dtype.newbyteorder("<"))
        self._file.stream.write(data.data.cast("B"))
        self.written += array.shape[0]

    def finalize(self) -> None:
        """Rename the file into place."""
        self._file.commit()


def write_npy_shard(path: str | os.PathLike[str], tokens: npt.ArrayLike) -> None:
    """Write a 1-D integer array as a ``.npy`` file atomically."""
    array = np.asarray(tokens).reshape(-1)
    with NpyShardWriter(path, array.dtype, array.shape[0]) as writer:
        writer.write(array)
