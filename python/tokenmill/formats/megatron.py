"""Megatron's indexed token format (``<prefix>.bin`` + ``<prefix>.idx``), byte-compatible with
megatron-core 0.19.x.

Layout (all integers little-endian; the byte-level spec with a worked example is in
``formats/README.md`` beside this file):

* ``.bin``: the tokens of every sequence concatenated, no header, in the dtype named by the index.
* ``.idx``: a 34-byte header (magic ``MMIDIDX\\0\\0``, version 1 as uint64, dtype code as uint8,
  sequence count S and document-boundary count D as uint64), then ``sequence_lengths`` (S int32),
  ``sequence_pointers`` (S int64, byte offsets into the ``.bin``), ``document_indices`` (D int64)
  and, for multimodal datasets only, ``sequence_modes`` (S int8). The header carries no multimodal
  flag: the reader is told.

Invariants checked when a dataset is opened (each failure raises
:class:`~tokenmill.errors.DataFormatError` naming the file and the value):

* the magic, version and dtype code are known, and the ``.idx`` is exactly as long as its header
  says (an extra multimodal trailer is tolerated when reading with ``multimodal=False``);
* ``document_indices`` starts at 0, ends at S and never decreases;
* the ``.bin`` is exactly ``sequence_pointers[-1] + sequence_lengths[-1] * itemsize`` bytes.

Every access is additionally bounds-checked against the ``.bin`` size before a view is taken, so a
corrupt index raises instead of reading the wrong bytes or crashing.

Cost: opening maps the ``.idx`` and takes zero-copy views (O(1)), plus one vectorised pass over
``document_indices`` (about 1 ms per million documents; skipped with ``fast_cache_load``). With
``mmap=True`` an item is a zero-copy read-only view of the mapped ``.bin`` (~1 µs of Python
overhead); with ``mmap=False`` it is one ``os.preadv`` into a fresh array. The builder keeps lengths
and boundaries in growable numpy buffers, computes pointers with one cumulative sum at finalize
(10 M sequences in well under a second) and merges other shards with ``os.copy_file_range``.

Object storage: an ``s3://`` prefix (with ``object_storage_config``) opens the ``.idx`` from a
local cache (downloaded once per node and object version) and reads the ``.bin`` with ranged
GETs through an LRU of aligned chunks (``tokenmill.storage``); an item then costs a copy out of
cached chunks, or one request per run of missing chunks.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import mmap as mmap_module
import os
import struct
import tempfile
from collections.abc import Iterable
from typing import Any

import numpy
import numpy.typing as npt

from tokenmill.common.atomic import default_file_mode
from tokenmill.errors import DataFormatError

__all__ = [
    "INDEX_HEADER",
    "INDEX_VERSION",
    "DType",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "get_bin_path",
    "get_idx_path",
]

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""The 9 magic bytes every ``.idx`` starts with."""

INDEX_VERSION = 1
"""The only index version megatron-core has ever written."""

# magic (9) + version (uint64) + dtype code (uint8)
_PREAMBLE = struct.Struct("<9sQB")
# sequence count, document-boundary count
_COUNTS = struct.Struct("<QQ")
HEADER_SIZE = _PREAMBLE.size + _COUNTS.size  # 34, hard-coded by megatron's fast_cache_load path

_OBJECT_STORAGE_SCHEMES = ("s3://", "msc://")

# Chunk for the non-decreasing check on document_indices, so it never allocates more than a few MB.
_MONOTONIC_CHECK_CHUNK = 1 << 20

# Buffer for the portable fallback of the .bin merge.
_COPY_BUFFER_SIZE = 16 << 20

NumpyScalarType = type[numpy.generic]
DTypeLike = npt.DTypeLike | NumpyScalarType


class DType(enum.Enum):
    """The token dtypes of a ``.bin`` file, with megatron's one-byte codes."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: DTypeLike) -> int:
        """The code of a dtype.

        Args:
            value: a numpy scalar type such as ``numpy.uint16`` (megatron's convention), or
                anything ``numpy.dtype`` accepts.

        Returns:
            The one-byte code stored in the ``.idx`` header.

        Raises:
            ValueError: the dtype has no code.
        """
        try:
            name = numpy.dtype(value).name
        except TypeError as error:
            raise ValueError(f"not a numpy dtype: {value!r}") from error
        if name not in cls.__members__:
            supported = ", ".join(cls.__members__)
            raise ValueError(f"dtype {name} has no megatron code; supported: {supported}")
        return cls[name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> NumpyScalarType:
        """The numpy scalar type of a code.

        Args:
            value: a code from 1 to 8.

        Returns:
            The numpy scalar type, for example ``numpy.uint16`` for 8.

        Raises:
            ValueError: the code is unknown.
        """
        try:
            member = cls(value)
        except ValueError as error:
            raise ValueError(f"unknown megatron dtype code {value!r}; known codes are 1..8") from (
                error
            )
        scalar_type: NumpyScalarType = getattr(numpy, member.name)
        return scalar_type

    @staticmethod
    def size(key: int | DTypeLike) -> int:
        """The size in bytes of a code or dtype.

        Args:
            key: a code (int) or a numpy dtype.

        Returns:
            The item size in bytes.

        Raises:
            ValueError: the key is neither a known code nor a supported dtype.
        """
        code = int(key) if isinstance(key, (int, numpy.integer)) else DType.code_from_dtype(key)
        return numpy.dtype(DType.dtype_from_code(code)).itemsize

    @staticmethod
    def optimal_dtype(cardinality: int | None) -> NumpyScalarType:
        """The dtype megatron uses for token ids from a vocabulary of a given size.

        Matches megatron: ``uint16`` when ``cardinality < 65500``, otherwise (and for ``None``)
        ``int32``. Note that ``GPTDatasetConfig.token_dtype_code`` uses a different threshold.

        Args:
            cardinality: the number of distinct token ids, or None if unknown.

        Returns:
            ``numpy.uint16`` or ``numpy.int32``.
        """
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    """The index file of a prefix: ``path_prefix + ".idx"``."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """The data file of a prefix: ``path_prefix + ".bin"``."""
    return path_prefix + ".bin"


def _refuse_object_storage(path_prefix: str) -> None:
    if path_prefix.startswith(_OBJECT_STORAGE_SCHEMES):
        raise NotImplementedError(
            f"merging from object storage is not supported: {path_prefix!r}; download the "
            ".bin/.idx files first (or convert to a local prefix)"
        )


def _check_non_decreasing(values: npt.NDArray[numpy.int64], path: str, field: str) -> None:
    for start in range(0, values.shape[0] - 1, _MONOTONIC_CHECK_CHUNK):
        chunk = values[start : start + _MONOTONIC_CHECK_CHUNK + 1]
        # neighbour comparison, not numpy.diff: an int64 difference can wrap around
        decreasing = chunk[1:] < chunk[:-1]
        if decreasing.any():
            position = start + int(numpy.argmax(decreasing))
            raise DataFormatError(
                f"{path}: {field} must be non-decreasing, but {field}[{position}] = "
                f"{int(values[position])} > {field}[{position + 1}] = {int(values[position + 1])}"
            )


class _IndexReader:
    """The parsed ``.idx`` file: zero-copy views of its arrays over a read-only mapping.

    Attribute names follow megatron's ``_IndexReader`` so code written against it keeps working.
    """

    dtype: NumpyScalarType
    dtype_size: int
    sequence_count: int
    document_count: int
    sequence_lengths: npt.NDArray[numpy.int32]
    sequence_pointers: npt.NDArray[numpy.int64]
    document_indices: npt.NDArray[numpy.int64]
    sequence_modes: npt.NDArray[numpy.int8] | None

    def __init__(
        self,
        idx_path: str,
        multimodal: bool,
        sequences_per_dataset: tuple[int, int] | None = None,
        dtype_code: int | None = None,
    ) -> None:
        self.idx_path = idx_path
        try:
            with open(idx_path, "rb") as stream:
                file_size = os.fstat(stream.fileno()).st_size
                if sequences_per_dataset:
                    # fast_cache_load: the caller already knows the counts, skip reading the header
                    if dtype_code is None:
                        raise ValueError(
                            f"{idx_path}: sequences_per_dataset={sequences_per_dataset!r} needs a "
                            "dtype_code, got None"
                        )
                    code = dtype_code
                    self.sequence_count = int(sequences_per_dataset[0])
                    self.document_count = int(sequences_per_dataset[1])
                else:
                    code = self._read_header(stream.read(HEADER_SIZE), idx_path)
                self._check_code(code, idx_path)
                self.dtype = DType.dtype_from_code(code)
                self.dtype_size = numpy.dtype(self.dtype).itemsize

                sequence_count, document_count = self.sequence_count, self.document_count
                expected = HEADER_SIZE + 12 * sequence_count + 8 * document_count
                trailer = sequence_count  # one int8 mode per sequence
                if multimodal:
                    expected += trailer
                if file_size < expected:
                    raise DataFormatError(
                        f"{idx_path}: index is {file_size} bytes but its header ({sequence_count} "
                        f"sequences, {document_count} document boundaries"
                        f"{', multimodal' if multimodal else ''}) needs {expected}; the file is "
                        "truncated"
                        + (
                            " or was not written with multimodal=True"
                            if multimodal
                            else " or not a megatron index"
                        )
                    )
                if file_size != expected and not (
                    not multimodal and file_size == expected + trailer
                ):
                    raise DataFormatError(
                        f"{idx_path}: index is {file_size} bytes but its header ({sequence_count} "
                        f"sequences, {document_count} document boundaries) needs {expected}"
                        f"{'' if multimodal else f' (or {expected + trailer} with modes)'}"
                    )
                # mmap duplicates the descriptor, so the file object can be closed right away
                self._mapping = mmap_module.mmap(stream.fileno(), 0, access=mmap_module.ACCESS_READ)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"index file not found: {idx_path}") from None

        offset = HEADER_SIZE
        self.sequence_lengths = numpy.frombuffer(
            self._mapping, dtype="<i4", count=sequence_count, offset=offset
        )
        offset += 4 * sequence_count
        self.sequence_pointers = numpy.frombuffer(
            self._mapping, dtype="<i8", count=sequence_count, offset=offset
        )
        offset += 8 * sequence_count
        self.document_indices = numpy.frombuffer(
            self._mapping, dtype="<i8", count=document_count, offset=offset
        )
        offset += 8 * document_count
        self.sequence_modes = None
        if multimodal:
            self.sequence_modes = numpy.frombuffer(
                self._mapping, dtype=numpy.int8, count=sequence_count, offset=offset
            )

    def _read_header(self, header: bytes, idx_path: str) -> int:
        if len(header) < HEADER_SIZE:
            raise DataFormatError(
                f"{idx_path}: index is {len(header)} bytes, shorter than the {HEADER_SIZE}-byte "
                "header"
            )
        magic, version, code = _PREAMBLE.unpack_from(header)
        if magic != INDEX_HEADER:
            raise DataFormatError(
                f"{idx_path}: bad magic {magic!r}, expected {INDEX_HEADER!r}; not a megatron index"
            )
        if version != INDEX_VERSION:
            raise DataFormatError(
                f"{idx_path}: unsupported index version {version}, expected {INDEX_VERSION}"
            )
        self.sequence_count, self.document_count = _COUNTS.unpack_from(header, _PREAMBLE.size)
        return int(code)

    @staticmethod
    def _check_code(code: object, idx_path: str) -> None:
        if not (isinstance(code, (int, numpy.integer)) and 1 <= int(code) <= len(DType)):
            raise DataFormatError(
                f"{idx_path}: unknown dtype code {code!r}; known codes are 1..{len(DType)}"
            )

    def validate(self) -> None:
        """Check that document boundaries start at 0, end at the sequence count and never decrease.

        Raises:
            DataFormatError: a boundary is inconsistent.
        """
        path, boundaries = self.idx_path, self.document_indices
        if boundaries.shape[0] == 0:
            raise DataFormatError(f"{path}: document_indices is empty, expected at least [0]")
        if int(boundaries[0]) != 0:
            raise DataFormatError(
                f"{path}: document_indices must start at 0, got {int(boundaries[0])}"
            )
        if int(boundaries[-1]) != self.sequence_count:
            raise DataFormatError(
                f"{path}: document_indices must end at the sequence count {self.sequence_count}, "
                f"got {int(boundaries[-1])}"
            )
        _check_non_decreasing(boundaries, path, "document_indices")

    def expected_bin_size(self) -> int:
        """The ``.bin`` size implied by the last pointer and length (0 when there are no
        sequences)."""
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype_size

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, idx: int) -> tuple[numpy.int64, numpy.int32, numpy.int8 | None]:
        """The (pointer, length, mode) of a sequence, as megatron's reader returns them."""
        return (
            self.sequence_pointers[idx],
            self.sequence_lengths[idx],
            self.sequence_modes[idx] if self.sequence_modes is not None else None,
        )


def _open_bin(bin_path: str) -> int:
    try:
        return os.open(bin_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"data file not found: {bin_path}") from None


class IndexedDataset:
    """A read-only view of a ``.bin/.idx`` pair: megatron-core's ``IndexedDataset``.

    Item ``i`` is the ``i``-th *sequence* (a document is a run of sequences given by
    ``document_indices``). Map-style, so it plugs into ``torch.utils.data`` without importing torch.

    Args:
        path_prefix: the path of both files without the ``.bin``/``.idx`` suffix.
        multimodal: read the int8 ``sequence_modes`` trailer and return ``(tokens, mode)`` items.
        mmap: map the ``.bin`` and return zero-copy read-only views; if False, every read is an
            ``os.preadv`` into a new writable array and the ``.bin`` is never mapped.
        object_storage_config: required for ``s3://`` prefixes: an
            :class:`~tokenmill.storage.object_storage.ObjectStorageConfig` (or megatron-core's).
            The ``.idx`` is cached locally under ``path_to_idx_cache`` (once per node and object
            version) and the ``.bin`` is read with ranged GETs through an LRU of aligned chunks;
            ``mmap`` is ignored there. See ``tokenmill.storage``.
        s3_config: megatron's deprecated alias of ``object_storage_config``.
        fast_cache_load: skip the consistency checks that scan arrays, as megatron does (the
            O(1) size checks that keep reads in bounds always run).
        sequences_per_dataset: ``(sequence_count, document_count)``; with ``dtype_code`` it lets
            the reader skip the header, as megatron's fast cache load does.
        dtype_code: the token dtype code, used only together with ``sequences_per_dataset``.

    Raises:
        FileNotFoundError: the ``.idx`` or ``.bin`` file is missing.
        DataFormatError: the files are not a consistent megatron dataset.
        ValueError: an ``s3://`` prefix without ``object_storage_config``.
        NotImplementedError: the prefix is an ``msc://`` path.
        ObjectStorageError: object storage failed after its retries.
    """

    path_prefix: str
    multimodal: bool
    mmap: bool
    object_storage_config: object | None
    fast_cache_load: bool
    sequences_per_dataset: tuple[int, int] | None
    dtype_code: int | None
    index: _IndexReader
    dtype: NumpyScalarType

    def __init__(
        self,
        path_prefix: str,
        multimodal: bool = False,
        mmap: bool = True,
        object_storage_config: object | None = None,
        s3_config: object | None = None,
        fast_cache_load: bool = False,
        sequences_per_dataset: tuple[int, int] | None = None,
        dtype_code: int | None = None,
    ) -> None:
        self.initialize(
            path_prefix,
            multimodal,
            mmap,
            object_storage_config or s3_config,
            fast_cache_load,
            sequences_per_dataset,
            dtype_code,
        )

    def initialize(
        self,
        path_prefix: str,
        multimodal: bool,
        mmap: bool,
        object_storage_config: object | None,
        fast_cache_load: bool = False,
        sequences_per_dataset: tuple[int, int] | None = None,
        dtype_code: int | None = None,
    ) -> None:
        """Open the files; called by the constructor and again when unpickling.

        Args:
            path_prefix: see the class docstring.
            multimodal: see the class docstring.
            mmap: see the class docstring.
            object_storage_config: see the class docstring.
            fast_cache_load: see the class docstring.
            sequences_per_dataset: see the class docstring.
            dtype_code: see the class docstring.
        """
        path_prefix = os.fspath(path_prefix)
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.object_storage_config = object_storage_config
        self.fast_cache_load = fast_cache_load
        self.sequences_per_dataset = sequences_per_dataset
        self.dtype_code = dtype_code
        self._bin_descriptor = -1
        self._tokens: npt.NDArray[Any] | None = None
        self.bin_reader: Any = None
        if path_prefix.startswith(_OBJECT_STORAGE_SCHEMES):
            self._open_object_storage()
            return

        self.index = _IndexReader(
            get_idx_path(path_prefix), multimodal, sequences_per_dataset, dtype_code
        )
        if not fast_cache_load:
            self.index.validate()
        self.dtype = self.index.dtype
        self._itemsize = self.index.dtype_size
        self._sequence_count = self.index.sequence_count

        bin_path = get_bin_path(path_prefix)
        descriptor = _open_bin(bin_path)
        try:
            self._bin_size = os.fstat(descriptor).st_size
            self._check_bin_size(f"{bin_path}: data file", self.index.idx_path)
            if mmap:
                if self._bin_size:
                    mapping = mmap_module.mmap(descriptor, 0, access=mmap_module.ACCESS_READ)
                    self._tokens = numpy.frombuffer(
                        mapping, dtype=self.dtype, count=self._bin_size // self._itemsize
                    )
                else:  # an empty file cannot be mapped
                    self._tokens = numpy.empty(0, dtype=self.dtype)
                    self._tokens.flags.writeable = False
            else:
                self._bin_descriptor = descriptor
                descriptor = -1
        finally:
            if descriptor >= 0:
                os.close(descriptor)

    def _open_object_storage(self) -> None:
        """Open an ``s3://`` prefix: the ``.idx`` through the local cache (downloaded once per
        node and version), the ``.bin`` through ranged, chunk-cached reads (never mapped, whatever
        ``mmap`` says; megatron-core asserts ``mmap=False`` instead)."""
        from tokenmill.storage.local_cache import cache_object
        from tokenmill.storage.object_storage import ObjectStorageConfig, require_s3
        from tokenmill.storage.remote import S3BinReader
        from tokenmill.storage.s3 import client_for

        prefix = self.path_prefix
        require_s3(prefix)
        if self.object_storage_config is None:
            raise ValueError(
                f"{prefix} is an object-storage path: pass object_storage_config="
                "ObjectStorageConfig(path_to_idx_cache=<local directory>) (GPTDatasetConfig: "
                "object_storage_cache_path)"
            )
        config = ObjectStorageConfig.coerce(self.object_storage_config)
        client = client_for(config.retry)
        local_idx = cache_object(get_idx_path(prefix), config.path_to_idx_cache, client)
        self.index = _IndexReader(
            local_idx, self.multimodal, self.sequences_per_dataset, self.dtype_code
        )
        if not self.fast_cache_load:
            self.index.validate()
        self.dtype = self.index.dtype
        self._itemsize = self.index.dtype_size
        self._sequence_count = self.index.sequence_count
        bin_path = get_bin_path(prefix)
        reader = S3BinReader(bin_path, config, client)
        self._bin_size = reader.size
        self._check_bin_size(
            f"{bin_path}: data object", f"{local_idx} (from {get_idx_path(prefix)})"
        )
        self.bin_reader = reader

    def _check_bin_size(self, data: str, index: str) -> None:
        """DataFormatError unless the `.bin` (`data`, of `self._bin_size` bytes) ends where the
        `.idx` (`index`) says it does."""
        expected = self.index.expected_bin_size()
        if self._bin_size != expected:
            raise DataFormatError(
                f"{data} is {self._bin_size} bytes but its index {index} ends at byte "
                f"{expected} (last pointer + last length × {self._itemsize}); the files do not "
                "belong together or one is truncated"
            )

    def __getstate__(self) -> tuple[Any, ...]:
        """The constructor arguments only (megatron's 7-tuple); the files are re-opened on load."""
        return (
            self.path_prefix,
            self.multimodal,
            self.mmap,
            self.object_storage_config,
            self.fast_cache_load,
            self.sequences_per_dataset,
            self.dtype_code,
        )

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        """Re-open the files from the state of :meth:`__getstate__`."""
        self.initialize(*state)

    def __del__(self) -> None:
        descriptor = getattr(self, "_bin_descriptor", -1)
        if descriptor >= 0:
            os.close(descriptor)
            self._bin_descriptor = -1

    def __len__(self) -> int:
        """The number of sequences."""
        return self._sequence_count

    def _resolve(self, idx: int | numpy.integer[Any]) -> int:
        index = int(idx)
        count = self._sequence_count
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(
                f"{self.path_prefix}: sequence index {int(idx)} out of range for {count} sequences"
            )
        return index

    def _read(self, byte_offset: int, count: int, sequence: int) -> npt.NDArray[Any]:
        end = byte_offset + count * self._itemsize
        if byte_offset < 0 or count < 0 or end > self._bin_size or byte_offset % self._itemsize:
            raise DataFormatError(
                f"{get_bin_path(self.path_prefix)}: sequence {sequence} points at bytes "
                f"[{byte_offset}, {end}) outside the {self._bin_size}-byte data file or off the "
                f"{self._itemsize}-byte grid; the index is corrupt"
            )
        if self._tokens is not None:
            start = byte_offset // self._itemsize
            return self._tokens[start : start + count]
        tokens = numpy.empty(count, dtype=self.dtype)
        target = tokens.data.cast("B")
        if self.bin_reader is not None:
            self.bin_reader.read_into(byte_offset, target)
            return tokens
        done = 0
        while done < target.nbytes:
            read = os.preadv(self._bin_descriptor, [target[done:]], byte_offset + done)
            if read == 0:
                raise DataFormatError(
                    f"{get_bin_path(self.path_prefix)}: data file ended at byte "
                    f"{byte_offset + done} while reading sequence {sequence}; it was truncated"
                )
            done += read
        return tokens

    def __getitem__(self, idx: int | numpy.integer[Any] | slice) -> Any:
        """One sequence, or a list of consecutive sequences.

        Args:
            idx: a sequence index (negative counts from the end) or a slice with step 1.

        Returns:
            The token array (zero-copy and read-only when ``mmap=True``), or ``(tokens, mode)``
            when multimodal; for a slice a list of arrays, or ``(list, modes)`` when multimodal.

        Raises:
            IndexError: the index is out of range.
            ValueError: the slice step is not 1.
            TypeError: the index is neither an integer nor a slice.
        """
        if isinstance(idx, (int, numpy.integer)):
            sequence = self._resolve(idx)
            index = self.index
            tokens = self._read(
                int(index.sequence_pointers[sequence]),
                int(index.sequence_lengths[sequence]),
                sequence,
            )
            if index.sequence_modes is not None:
                return tokens, index.sequence_modes[sequence]
            return tokens
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self._sequence_count)
            if step != 1:
                raise ValueError(
                    f"slices into an IndexedDataset must be contiguous (step 1), got step {step}"
                )
            stop = max(start, stop)
            lengths = self.index.sequence_lengths[start:stop]
            modes = (
                self.index.sequence_modes[start:stop]
                if self.index.sequence_modes is not None
                else None
            )
            if start == stop:
                sequences: list[npt.NDArray[Any]] = []
            else:
                if int(lengths.min()) < 0:
                    bad = start + int(numpy.argmax(lengths < 0))
                    raise DataFormatError(
                        f"{get_idx_path(self.path_prefix)}: sequence {bad} has length "
                        f"{int(self.index.sequence_lengths[bad])}; the index is corrupt"
                    )
                bounds = numpy.cumsum(lengths, dtype=numpy.int64)
                tokens = self._read(
                    int(self.index.sequence_pointers[start]), int(bounds[-1]), start
                )
                sequences = numpy.split(tokens, bounds[:-1])
            return (sequences, modes) if modes is not None else sequences
        raise TypeError(f"IndexedDataset indices must be integers or slices, not {type(idx)}")

    def get(self, idx: int | numpy.integer[Any], offset: int = 0, length: int | None = None) -> Any:
        """Part of one sequence.

        Args:
            idx: the sequence index (negative counts from the end).
            offset: the first token to return, within the sequence.
            length: the number of tokens; None means up to the end of the sequence.

        Returns:
            The token array, or ``(tokens, mode)`` when multimodal.

        Raises:
            IndexError: the index is out of range, or ``[offset, offset + length)`` is not inside
                the sequence.
        """
        sequence = self._resolve(idx)
        index = self.index
        sequence_length = int(index.sequence_lengths[sequence])
        offset = int(offset)
        if length is None:
            length = sequence_length - offset
        length = int(length)
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"{self.path_prefix}: tokens [{offset}, {offset + length}) are outside sequence "
                f"{sequence} of length {sequence_length}"
            )
        tokens = self._read(
            int(index.sequence_pointers[sequence]) + offset * self._itemsize, length, sequence
        )
        if index.sequence_modes is not None:
            return tokens, index.sequence_modes[sequence]
        return tokens

    @property
    def sequence_lengths(self) -> npt.NDArray[numpy.int32]:
        """The number of tokens in each sequence (int32, a read-only view of the index)."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> npt.NDArray[numpy.int64]:
        """The byte offset of each sequence in the ``.bin`` (int64, read-only view)."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> npt.NDArray[numpy.int64]:
        """The sequence index where each document starts, then the sequence count (int64)."""
        return self.index.document_indices

    def get_document_indices(self) -> npt.NDArray[numpy.int64]:
        """The document indices (megatron's accessor, slated for deprecation there)."""
        return self.index.document_indices

    def set_document_indices(self, document_indices: npt.NDArray[numpy.int64]) -> None:
        """Replace the document indices in memory (megatron's setter; the file is unchanged)."""
        self.index.document_indices = document_indices

    @property
    def sequence_modes(self) -> npt.NDArray[numpy.int8]:
        """The int8 mode of each sequence.

        Megatron 0.19.2 guards this with ``assert self.index.sequence_modes``, which fails for any
        multimodal dataset of more than one sequence; here it simply returns the modes.

        Raises:
            ValueError: the dataset was opened with ``multimodal=False``.
        """
        if self.index.sequence_modes is None:
            raise ValueError(
                f"{self.path_prefix}: sequence_modes needs the dataset opened with multimodal=True"
            )
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both ``path_prefix.idx`` and ``path_prefix.bin`` exist.

        For ``s3://`` prefixes this is two HEAD requests, and a missing object gives False
        (megatron-core 0.19.2 cannot report a missing object there).

        Raises:
            NotImplementedError: the prefix is an ``msc://`` path.
            PermissionError: the bucket refuses the HEAD request (existence cannot be told).
        """
        path_prefix = os.fspath(path_prefix)
        if path_prefix.startswith(_OBJECT_STORAGE_SCHEMES):
            from tokenmill.storage.object_storage import require_s3
            from tokenmill.storage.s3 import get_client

            require_s3(path_prefix)
            client = get_client()
            return client.exists(get_idx_path(path_prefix)) and client.exists(
                get_bin_path(path_prefix)
            )
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(
            get_bin_path(path_prefix)
        )


class _GrowableArray:
    """An append-only numpy buffer that doubles its capacity, so n appends cost O(n) amortised."""

    def __init__(self, dtype: npt.DTypeLike, capacity: int = 1024) -> None:
        self._data = numpy.empty(capacity, dtype=dtype)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _reserve(self, extra: int) -> None:
        needed = self._size + extra
        if needed > self._data.shape[0]:
            grown = numpy.empty(max(needed, 2 * self._data.shape[0]), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown

    def append(self, value: int) -> None:
        if self._size == self._data.shape[0]:
            self._reserve(1)
        self._data[self._size] = value
        self._size += 1

    def extend(self, values: npt.ArrayLike) -> None:
        values = numpy.asarray(values)
        self._reserve(values.shape[0])
        self._data[self._size : self._size + values.shape[0]] = values
        self._size += values.shape[0]

    def view(self) -> npt.NDArray[Any]:
        return self._data[: self._size]


def _as_flat_array(values: Any) -> npt.NDArray[Any]:
    # generators become lists first; numpy would otherwise wrap them in a 0-d object array
    if not hasattr(values, "__len__") and not hasattr(values, "__array__"):
        values = list(values)
    return _to_numpy(values).reshape(-1)


def _to_numpy(tensor: Any) -> npt.NDArray[Any]:
    # torch tensors (and anything else with .numpy()) without importing torch
    if not isinstance(tensor, numpy.ndarray) and callable(getattr(tensor, "numpy", None)):
        tensor = tensor.numpy()
    return numpy.asarray(tensor)


class IndexedDatasetBuilder:
    """Writes a ``.bin/.idx`` pair byte-identical to megatron-core's ``IndexedDatasetBuilder``.

    Tokens go to a temporary file beside ``bin_path``; :meth:`finalize` renames it into place and
    then writes the index the same way, so a reader never sees a partial shard. Unlike megatron,
    tokens that do not fit the dtype raise instead of wrapping around.

    Args:
        bin_path: where the ``.bin`` will be.
        dtype: the token dtype, one of the :class:`DType` names (``numpy.int32`` by default, as
            in megatron; ``DType.optimal_dtype(vocab_size)`` is what megatron's tools pass).
        multimodal: also record an int8 mode per sequence.

    Raises:
        ValueError: the dtype has no megatron code.
    """

    def __init__(
        self, bin_path: str, dtype: DTypeLike = numpy.int32, multimodal: bool = False
    ) -> None:
        self.bin_path = os.fspath(bin_path)
        DType.code_from_dtype(dtype)  # fail now, not at finalize
        self.dtype: NumpyScalarType = numpy.dtype(dtype).type
        self.multimodal = multimodal
        self._numpy_dtype = numpy.dtype(self.dtype)
        self._sequence_lengths = _GrowableArray(numpy.int32)
        self._document_indices = _GrowableArray(numpy.int64)
        self._document_indices.append(0)
        self._sequence_modes = _GrowableArray(numpy.int8) if multimodal else None
        directory, name = os.path.split(os.path.abspath(self.bin_path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                errno.ENOENT, f"directory of {self.bin_path} does not exist: {directory}"
            )
        descriptor, self._temporary_bin_path = tempfile.mkstemp(
            prefix=f".{name}.", suffix=".tmp", dir=directory
        )
        os.fchmod(descriptor, default_file_mode())
        self._data_file = os.fdopen(descriptor, "wb")
        self._owner_process = os.getpid()
        self._finalized = False

    # --- properties mirroring megatron's public attributes -------------------------------------

    @property
    def sequence_lengths(self) -> npt.NDArray[numpy.int32]:
        """The lengths added so far (a view; do not modify)."""
        return self._sequence_lengths.view()

    @property
    def document_indices(self) -> npt.NDArray[numpy.int64]:
        """The document boundaries so far, starting with 0 (a view; do not modify)."""
        return self._document_indices.view()

    @property
    def sequence_modes(self) -> npt.NDArray[numpy.int8] | None:
        """The modes added so far, or None when not multimodal (a view; do not modify)."""
        return None if self._sequence_modes is None else self._sequence_modes.view()

    # --- writing ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._finalized:
            raise ValueError(f"{self.bin_path}: the builder was already finalized")

    def _convert(self, tensor: Any) -> npt.NDArray[Any]:
        """Flatten ``tensor`` to the builder dtype, refusing values the dtype cannot hold."""
        array = _to_numpy(tensor).reshape(-1)
        target = self._numpy_dtype
        source = array.dtype
        if source == target:
            return numpy.ascontiguousarray(array)
        if array.shape[0] == 0:
            return numpy.empty(0, dtype=target)
        if source.kind not in "biuf":
            raise TypeError(
                f"{self.bin_path}: tokens of dtype {source} cannot be written as {target}"
            )
        if target.kind in "iu" and source.kind == "f":
            raise TypeError(
                f"{self.bin_path}: floating-point tokens ({source}) cannot be written as {target}; "
                "convert them to integers first"
            )
        if not numpy.can_cast(source, target, casting="safe"):
            self._check_range(array, target)
        return array.astype(target)

    def _check_range(self, array: npt.NDArray[Any], target: numpy.dtype[Any]) -> None:
        if target.kind in "iu":
            info = numpy.iinfo(target)
            outside = (array < info.min) | (array > info.max)
            if outside.any():
                value = array[int(numpy.argmax(outside))]
                raise OverflowError(
                    f"{self.bin_path}: token {value.item()!r} does not fit {target} "
                    f"[{info.min}, {info.max}]"
                )
        elif array.dtype.kind in "biu":
            # integers into floats must survive the round trip exactly
            converted = array.astype(target)
            lost = converted.astype(array.dtype) != array
            if lost.any():
                value = array[int(numpy.argmax(lost))]
                raise OverflowError(
                    f"{self.bin_path}: token {value.item()!r} cannot be stored exactly as {target}"
                )
        else:
            with numpy.errstate(over="ignore"):
                converted = array.astype(target)
            lost = numpy.isinf(converted) & numpy.isfinite(array)
            if lost.any():
                value = array[int(numpy.argmax(lost))]
                raise OverflowError(f"{self.bin_path}: token {value.item()!r} overflows {target}")

    def _write(self, array: npt.NDArray[Any]) -> None:
        if array.shape[0]:
            self._data_file.write(array.data.cast("B"))

    @staticmethod
    def _check_mode(mode: Any, bin_path: str) -> int:
        value = int(mode)
        if not -128 <= value <= 127:
            raise OverflowError(f"{bin_path}: mode {value} does not fit int8 [-128, 127]")
        return value

    def add_item(self, tensor: Any, mode: int = 0) -> None:
        """Append one sequence (not yet a document; see :meth:`end_document`).

        Args:
            tensor: the tokens: a torch tensor, numpy array or list (flattened in C order).
            mode: the sequence's int8 mode, recorded only when multimodal.

        Raises:
            OverflowError: a token or the mode does not fit its dtype.
            TypeError: the tokens are floats and the dtype is an integer type, or not numeric.
        """
        self._check_open()
        array = self._convert(tensor)
        if array.shape[0] > numpy.iinfo(numpy.int32).max:
            raise OverflowError(
                f"{self.bin_path}: a sequence of {array.shape[0]} tokens exceeds the int32 length "
                "field of the index"
            )
        if self._sequence_modes is not None:
            mode = self._check_mode(mode, self.bin_path)
        self._write(array)
        self._sequence_lengths.append(array.shape[0])
        if self._sequence_modes is not None:
            self._sequence_modes.append(mode)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last boundary form it."""
        self._check_open()
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(
        self, tensor: Any, lengths: Iterable[int] | npt.ArrayLike, modes: Any = None
    ) -> None:
        """Append one document made of consecutive sequences.

        Args:
            tensor: all tokens of the document.
            lengths: the number of tokens of each sequence; they must sum to the token count.
            modes: the int8 mode of each sequence (multimodal only); None means all 0. (Megatron
                0.19.2 raises TypeError for None with a list of lengths; this is the fixed form.)

        Raises:
            ValueError: the lengths are negative, do not sum to the token count, or the number of
                modes differs from the number of lengths.
            OverflowError: a token, length or mode does not fit its dtype.
            TypeError: the tokens are floats and the dtype is an integer type, or not numeric.
        """
        self._check_open()
        array = self._convert(tensor)
        lengths_array = _as_flat_array(lengths)
        if lengths_array.shape[0] and lengths_array.dtype.kind not in "iu":
            raise TypeError(f"{self.bin_path}: lengths must be integers, got {lengths_array.dtype}")
        lengths_array = lengths_array.astype(numpy.int64)
        if lengths_array.shape[0]:
            if int(lengths_array.min()) < 0:
                raise ValueError(f"{self.bin_path}: lengths must be >= 0, got {lengths_array}")
            if int(lengths_array.max()) > numpy.iinfo(numpy.int32).max:
                raise OverflowError(
                    f"{self.bin_path}: length {int(lengths_array.max())} exceeds the int32 length "
                    "field of the index"
                )
        total = int(lengths_array.sum())
        if total != array.shape[0]:
            raise ValueError(
                f"{self.bin_path}: lengths sum to {total} but the document has {array.shape[0]} "
                "tokens"
            )
        modes_array: npt.NDArray[Any] | None = None
        if self._sequence_modes is not None:
            if modes is None:
                modes_array = numpy.zeros(lengths_array.shape[0], dtype=numpy.int8)
            else:
                raw = numpy.asarray(_to_numpy(modes)).reshape(-1)
                if raw.shape[0] != lengths_array.shape[0]:
                    raise ValueError(
                        f"{self.bin_path}: {raw.shape[0]} modes for {lengths_array.shape[0]} "
                        "sequences"
                    )
                for value in raw[(raw < -128) | (raw > 127)][:1]:
                    self._check_mode(value, self.bin_path)
                modes_array = raw.astype(numpy.int8)
        self._write(array)
        self._sequence_lengths.extend(lengths_array)
        self._document_indices.append(len(self._sequence_lengths))
        if self._sequence_modes is not None and modes_array is not None:
            self._sequence_modes.extend(modes_array)

    def add_documents(
        self,
        tokens: Any,
        sequence_lengths: npt.ArrayLike,
        sequences_per_document: npt.ArrayLike | None = None,
    ) -> None:
        """Append many documents at once (tokenmill's bulk form of :meth:`add_document`).

        The result is byte-identical to calling ``add_document`` once per document; documents
        with zero sequences add a repeated boundary, as ``add_document(x, lengths=[])`` does.

        Args:
            tokens: the tokens of all documents, concatenated.
            sequence_lengths: the length of each sequence, in order.
            sequences_per_document: how many of those sequences each document has (None: one
                sequence per document, the common case of ``tokenmill convert``).

        Raises:
            ValueError: a count is negative, or the counts do not add up to the tokens and
                sequences given.
            OverflowError: a token or length does not fit its dtype.
            TypeError: the tokens are floats and the dtype is an integer type, or not numeric.
        """
        self._check_open()
        array = self._convert(tokens)
        lengths = numpy.asarray(sequence_lengths).reshape(-1)
        counts = (
            numpy.ones(lengths.shape[0], dtype=numpy.int64)
            if sequences_per_document is None
            else numpy.asarray(sequences_per_document).reshape(-1)
        )
        for name, values in (("sequence_lengths", lengths), ("sequences_per_document", counts)):
            if values.shape[0] and values.dtype.kind not in "iu":
                raise TypeError(f"{self.bin_path}: {name} must be integers, got {values.dtype}")
            if values.shape[0] and int(values.min()) < 0:
                raise ValueError(f"{self.bin_path}: {name} must be >= 0, got {int(values.min())}")
        if lengths.shape[0] and int(lengths.max()) > numpy.iinfo(numpy.int32).max:
            raise OverflowError(
                f"{self.bin_path}: length {int(lengths.max())} exceeds the int32 length field of "
                "the index"
            )
        total = int(lengths.sum(dtype=numpy.int64))
        if total != array.shape[0]:
            raise ValueError(
                f"{self.bin_path}: sequence_lengths sum to {total} but {array.shape[0]} tokens "
                "were given"
            )
        sequences = int(counts.sum(dtype=numpy.int64))
        if sequences != lengths.shape[0]:
            raise ValueError(
                f"{self.bin_path}: sequences_per_document sum to {sequences} but "
                f"{lengths.shape[0]} sequence lengths were given"
            )
        if self._sequence_modes is not None:
            raise ValueError(f"{self.bin_path}: add_documents does not take multimodal modes")
        self._write(array)
        offset = len(self._sequence_lengths)
        self._sequence_lengths.extend(lengths.astype(numpy.int64, copy=False))
        self._document_indices.extend(numpy.cumsum(counts, dtype=numpy.int64) + offset)

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset: its sequences, documents, modes and tokens.

        The other ``.bin`` is copied in the kernel (``os.copy_file_range``) where possible.

        Args:
            path_prefix: the other dataset's prefix; it must have this builder's dtype.

        Raises:
            FileNotFoundError: a file of the other dataset is missing.
            DataFormatError: the other dataset is corrupt or has a different dtype.
        """
        self._check_open()
        path_prefix = os.fspath(path_prefix)
        _refuse_object_storage(path_prefix)
        index = _IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        index.validate()
        if numpy.dtype(index.dtype) != self._numpy_dtype:
            raise DataFormatError(
                f"{get_idx_path(path_prefix)}: dtype {numpy.dtype(index.dtype)} does not match the "
                f"builder's dtype {self._numpy_dtype} ({self.bin_path}); cannot merge"
            )
        bin_path = get_bin_path(path_prefix)
        expected = index.expected_bin_size()
        with open(bin_path, "rb") as source:
            size = os.fstat(source.fileno()).st_size
            if size != expected:
                raise DataFormatError(
                    f"{bin_path}: data file is {size} bytes but its index ends at byte {expected}"
                )
            self._data_file.flush()
            destination = self._data_file.fileno()
            start = self._data_file.tell()
            try:
                _copy_file(source.fileno(), destination, size, start)
            except BaseException:
                # leave the shard as it was before this call, so the builder stays consistent
                os.ftruncate(destination, start)
                self._data_file.seek(start)
                raise
            self._data_file.seek(0, os.SEEK_END)

        offset = len(self._sequence_lengths)
        self._sequence_lengths.extend(index.sequence_lengths)
        self._document_indices.extend(index.document_indices[1:] + offset)
        if self._sequence_modes is not None and index.sequence_modes is not None:
            self._sequence_modes.extend(index.sequence_modes)

    def finalize(self, idx_path: str) -> None:
        """Write the ``.idx`` to a temporary file, then move the ``.bin`` and the ``.idx`` into
        place (an existing ``.idx`` is removed first, so a crash never pairs old and new files).

        Args:
            idx_path: where the ``.idx`` goes (megatron's tools use ``prefix + ".idx"``).

        Raises:
            ValueError: sequences were added after the last document boundary (megatron would
                write an index that its own reader rejects).
        """
        self._check_open()
        idx_path = os.fspath(idx_path)
        lengths = self._sequence_lengths.view()
        boundaries = self._document_indices.view()
        if int(boundaries[-1]) != lengths.shape[0]:
            raise ValueError(
                f"{self.bin_path}: {lengths.shape[0] - int(boundaries[-1])} sequences were added "
                "after the last document boundary; call end_document() before finalize()"
            )
        self._data_file.close()
        self._finalized = True

        pointers = numpy.empty(lengths.shape[0], dtype="<i8")
        if lengths.shape[0]:
            pointers[0] = 0
            numpy.cumsum(lengths[:-1], dtype=numpy.int64, out=pointers[1:])
            pointers *= self._numpy_dtype.itemsize
        header = _PREAMBLE.pack(
            INDEX_HEADER, INDEX_VERSION, DType.code_from_dtype(self.dtype)
        ) + _COUNTS.pack(lengths.shape[0], boundaries.shape[0])
        parts: list[npt.NDArray[Any]] = [
            lengths.astype("<i4", copy=False),
            pointers,
            boundaries.astype("<i8", copy=False),
        ]
        if self._sequence_modes is not None:
            parts.append(self._sequence_modes.view())
        directory, name = os.path.split(os.path.abspath(idx_path))
        descriptor, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(descriptor, "wb") as stream:
                stream.write(header)
                for part in parts:
                    if part.shape[0]:
                        stream.write(numpy.ascontiguousarray(part).data.cast("B"))
            os.chmod(temporary, default_file_mode())
            # Both files are complete under temporary names. A stale .idx must never pair with
            # the new .bin: remove it, then rename the .bin, then the .idx. A crash in between
            # leaves a prefix without .idx (FileNotFoundError), never a mismatched pair.
            _remove_quietly(idx_path)
            os.replace(self._temporary_bin_path, self.bin_path)
            os.replace(temporary, idx_path)
        except BaseException:
            _remove_quietly(temporary)
            _remove_quietly(self._temporary_bin_path)
            raise

    def __del__(self) -> None:
        # an abandoned builder leaves no partial shard behind
        # only in the creating process: a forked child must not delete its parent's shard
        if not getattr(self, "_finalized", True) and self._owner_process == os.getpid():
            self._data_file.close()
            _remove_quietly(self._temporary_bin_path)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _copy_file(source: int, destination: int, size: int, destination_offset: int) -> None:
    """Copy ``size`` bytes from the start of ``source`` to ``destination_offset``, in the kernel
    when the platform allows (copy_file_range, then sendfile), else through a large buffer."""
    copied = 0
    if hasattr(os, "copy_file_range"):
        try:
            while copied < size:
                step = os.copy_file_range(
                    source, destination, size - copied, copied, destination_offset + copied
                )
                if step == 0:
                    break
                copied += step
        except OSError:
            pass  # e.g. EXDEV on older kernels or unsupported filesystems: fall back
    if copied < size and hasattr(os, "sendfile"):
        try:
            os.lseek(destination, destination_offset + copied, os.SEEK_SET)
            while copied < size:
                step = os.sendfile(destination, source, copied, size - copied)
                if step == 0:
                    break
                copied += step
        except OSError:
            pass
    if copied < size:
        buffer = bytearray(min(_COPY_BUFFER_SIZE, size - copied))
        view = memoryview(buffer)
        while copied < size:
            step = os.preadv(source, [view[: size - copied]], copied)
            if step == 0:
                break
            written = os.pwritev(destination, [view[:step]], destination_offset + copied)
            if written != step:
                raise OSError(f"short write while merging: {written} of {step} bytes")
            copied += step
    if copied != size:
        raise DataFormatError(f"merge copied {copied} of {size} bytes; the source shrank")
