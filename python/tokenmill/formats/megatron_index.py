"""The ``.idx`` file of Megatron's indexed token format: header, dtype codes, reader.

The byte layout is in ``formats/README.md`` (and `tokenmill.formats.megatron`'s docstring): a
34-byte header (magic ``MMIDIDX\\0\\0``, version 1, dtype code, sequence and document counts),
then ``sequence_lengths``, ``sequence_pointers``, ``document_indices`` and, for multimodal data,
``sequence_modes``. :class:`DType` holds megatron's one-byte dtype codes; :class:`_IndexReader`
(megatron's name and attributes) maps a ``.idx`` and checks it. The dataset reader
(`tokenmill.formats.megatron`) and the builder (`tokenmill.formats.megatron_builder`) share
this module.
"""

from __future__ import annotations

import enum
import errno
import functools
import logging
import os
import struct
from collections.abc import Callable
from typing import IO, Any

import numpy
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.atomic import FileStatus
from tokenmill.common.mapping import READ_BELOW, read_or_map, resource_error
from tokenmill.common.megatron_log import elapsed, log, megatron_logger
from tokenmill.common.whole_read import Contents, NotARegularFile, read_whole
from tokenmill.errors import DataFormatError

__all__ = [
    "HEADER_SIZE",
    "INDEX_COUNTS",
    "INDEX_HEADER",
    "INDEX_PREAMBLE",
    "INDEX_VERSION",
    "OBJECT_STORAGE_SCHEMES",
    "DType",
    "get_bin_path",
    "get_idx_path",
    "write_index",
]

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""The 9 magic bytes every ``.idx`` starts with."""

INDEX_VERSION = 1
"""The only index version megatron-core has ever written."""

# magic (9) + version (uint64) + dtype code (uint8)
INDEX_PREAMBLE = struct.Struct("<9sQB")
# sequence count, document-boundary count
INDEX_COUNTS = struct.Struct("<QQ")
HEADER_SIZE = (
    INDEX_PREAMBLE.size + INDEX_COUNTS.size
)  # 34, hard-coded by megatron's fast_cache_load path

NumpyScalarType = type[numpy.generic]
DTypeLike = npt.DTypeLike | NumpyScalarType

# The prefixes of object-storage paths (read through tokenmill.storage, never mapped).
OBJECT_STORAGE_SCHEMES = ("s3://", "msc://")

_MEGATRON_LOG = megatron_logger("indexed_dataset")


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


def write_index(
    stream: IO[bytes],
    dtype: DTypeLike,
    sequence_lengths: npt.ArrayLike,
    document_indices: npt.ArrayLike,
    sequence_modes: npt.ArrayLike | None = None,
) -> None:
    """Write a whole ``.idx`` to ``stream``: header, lengths, pointers, boundaries, modes.

    The one serializer of the format (the builder's ``finalize``, megatron's ``_IndexWriter``
    under the patch and the raw-text join all call it), so the bytes megatron-core writes are
    produced in one place. Pointers are the exclusive prefix sum of ``length x itemsize`` in
    int64, as megatron computes them.

    Args:
        stream: a binary file opened for writing, positioned where the ``.idx`` starts.
        dtype: the token dtype of the ``.bin`` (its code goes in the header).
        sequence_lengths: tokens per sequence (written as little-endian int32).
        document_indices: document boundaries in sequences, starting at 0 (int64).
        sequence_modes: per-sequence modes (int8) for multimodal data, or None.
    """
    lengths = numpy.ascontiguousarray(sequence_lengths, dtype="<i4")
    boundaries = numpy.ascontiguousarray(document_indices, dtype="<i8")
    pointers = numpy.zeros(lengths.shape[0], dtype="<i8")
    if lengths.shape[0] > 1:
        numpy.cumsum(lengths[:-1], dtype=numpy.int64, out=pointers[1:])
        pointers *= numpy.dtype(dtype).itemsize
    stream.write(INDEX_PREAMBLE.pack(INDEX_HEADER, INDEX_VERSION, DType.code_from_dtype(dtype)))
    stream.write(INDEX_COUNTS.pack(lengths.shape[0], boundaries.shape[0]))
    parts: list[npt.NDArray[Any]] = [lengths, pointers, boundaries]
    if sequence_modes is not None:
        parts.append(numpy.ascontiguousarray(sequence_modes, dtype=numpy.int8))
    for part in parts:
        if part.shape[0]:
            stream.write(part.data.cast("B"))


def get_idx_path(path_prefix: str) -> str:
    """The index file of a prefix: ``path_prefix + ".idx"``."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """The data file of a prefix: ``path_prefix + ".bin"``."""
    return path_prefix + ".bin"


class _RawFile:
    """A read-only descriptor with the two calls the index reader needs (`fileno`, `read` of
    the header) and nothing else: open, fstat, pread, mmap and close are the whole open."""

    def __init__(self, path: str, descriptor: int = -1) -> None:
        """Open `path`, or take over `descriptor` (already open on it)."""
        if descriptor < 0:
            descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.descriptor = descriptor

    def fileno(self) -> int:
        return self.descriptor

    def read(self, size: int) -> bytes:
        return os.pread(self.descriptor, size, 0)

    def __enter__(self) -> _RawFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.descriptor)


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
        # (status, bytes) of the file when it was read whole by one call (None: mapped)
        self.whole_read: tuple[FileStatus, Contents] | None = None
        # megatron-core's lines and timings, made only when its logger keeps them (its default
        # level drops them all: a blend of 1,000 sources made ~8,000 for nothing)
        verbose = _MEGATRON_LOG.isEnabledFor(logging.INFO)
        if verbose:
            log(_MEGATRON_LOG, logging.INFO, f"Load the {type(self).__name__} from {idx_path}")
        try:
            # an index of up to READ_BELOW bytes: one call (open, fstat, read, close without the
            # GIL); a larger one is left open by that call, to be mapped; a blend opens one per
            # source
            data, status = read_whole(idx_path, READ_BELOW, keep_open=True, ahead=True)
            size = status.st_size
            # bytes, or the buffer of a read ahead (common.whole_read.reading_ahead)
            if isinstance(data, (bytes, _core.OwnedBuffer)) and len(data) == size:
                whole = memoryview(data)
                self._check_layout(
                    idx_path,
                    size,
                    whole[:HEADER_SIZE],
                    multimodal,
                    sequences_per_dataset,
                    dtype_code,
                )
                self._mapping = whole
                # what the index arrays are computed from, with the fstat of the same open: the
                # cache's data fingerprint is taken from it instead of reading the file again
                self.whole_read = (status, data)
            else:
                # larger (its descriptor left open by the call) or changing under the read
                # (opened again): the file mapped, raw descriptor calls
                kept = data if isinstance(data, int) else -1
                with _RawFile(idx_path, kept) as stream:
                    if kept < 0:
                        size = os.fstat(stream.fileno()).st_size
                    header = b"" if sequences_per_dataset else stream.read(HEADER_SIZE)
                    self._check_layout(
                        idx_path, size, header, multimodal, sequences_per_dataset, dtype_code
                    )
                    # mapped (or, if it shrank to 64 KiB or less, read): no descriptor kept
                    self._mapping = read_or_map(stream.fileno(), size, idx_path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"index file not found: {idx_path}") from None
        except NotARegularFile as error:
            raise DataFormatError(
                f"{idx_path}: index file {error.kind}, not a regular file; refusing it"
            ) from None
        except OSError as error:
            limit = resource_error(error, idx_path)
            if limit is None:
                raise
            raise limit from error

        sequence_count = self.sequence_count
        offset = HEADER_SIZE
        # entry(sequence): a mapped index's pointer and length are read under the SIGBUS
        # guard, by one C++ call (a partial, not a method: no Python frame on the hot path)
        self._entry_layout = (offset, offset + 4 * sequence_count, sequence_count)
        self._mapped_file = _core.MappedFile(self._mapping) if self.mapped else None
        self.entry: Callable[[int], tuple[int, int]] = (
            functools.partial(self._mapped_file.entry, *self._entry_layout)
            if self._mapped_file is not None
            else self._unmapped_entry
        )
        lengths_at, pointers_at = offset, offset + 4 * sequence_count
        documents_at = pointers_at + 8 * sequence_count
        if verbose:  # megatron-core's lines, levels and timings (tokenmill.common.megatron_log)
            self._extract_logged(lengths_at, pointers_at, documents_at, multimodal)
        else:
            self._extract(lengths_at, pointers_at, documents_at, multimodal)

    def _extract(
        self, lengths_at: int, pointers_at: int, documents_at: int, multimodal: bool
    ) -> None:
        """The index's arrays, views of its bytes."""
        self.sequence_lengths = self._lengths(lengths_at)
        self.sequence_pointers = self._pointers(pointers_at)
        self.document_indices = self._documents(documents_at)
        self.sequence_modes = self._modes(documents_at) if multimodal else None

    def _extract_logged(
        self, lengths_at: int, pointers_at: int, documents_at: int, multimodal: bool
    ) -> None:
        """:meth:`_extract`, with megatron-core's lines and timings."""
        log(_MEGATRON_LOG, logging.INFO, "\tExtract the sequence lengths")
        with elapsed(_MEGATRON_LOG):
            self.sequence_lengths = self._lengths(lengths_at)
        log(_MEGATRON_LOG, logging.INFO, "\tExtract the sequence pointers")
        with elapsed(_MEGATRON_LOG):
            self.sequence_pointers = self._pointers(pointers_at)
        log(_MEGATRON_LOG, logging.INFO, "\tExtract the document indices")
        with elapsed(_MEGATRON_LOG):
            self.document_indices = self._documents(documents_at)
        self.sequence_modes = None
        if multimodal:
            log(_MEGATRON_LOG, logging.INFO, "\tExtract the sequence modes")
            with elapsed(_MEGATRON_LOG):
                self.sequence_modes = self._modes(documents_at)
        log(_MEGATRON_LOG, logging.INFO, f"> total number of sequences: {self.sequence_count}")
        log(
            _MEGATRON_LOG,
            logging.INFO,
            f"> total number of documents: {self.document_indices.shape[0] - 1}",
        )

    def _lengths(self, offset: int) -> npt.NDArray[numpy.int32]:
        return numpy.frombuffer(
            self._mapping, dtype="<i4", count=self.sequence_count, offset=offset
        )

    def _pointers(self, offset: int) -> npt.NDArray[numpy.int64]:
        return numpy.frombuffer(
            self._mapping, dtype="<i8", count=self.sequence_count, offset=offset
        )

    def _documents(self, offset: int) -> npt.NDArray[numpy.int64]:
        return numpy.frombuffer(
            self._mapping, dtype="<i8", count=self.document_count, offset=offset
        )

    def _modes(self, documents_at: int) -> npt.NDArray[numpy.int8]:
        offset = documents_at + 8 * self.document_count
        return numpy.frombuffer(
            self._mapping, dtype=numpy.int8, count=self.sequence_count, offset=offset
        )

    def _check_layout(
        self,
        idx_path: str,
        file_size: int,
        header: bytes | memoryview,
        multimodal: bool,
        sequences_per_dataset: tuple[int, int] | None,
        dtype_code: int | None,
    ) -> None:
        """Read the header (or take the counts the caller knows) and check that the file is
        exactly the size it implies."""
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
            code = self._read_header(bytes(header), idx_path)
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
        if file_size != expected and not (not multimodal and file_size == expected + trailer):
            raise DataFormatError(
                f"{idx_path}: index is {file_size} bytes but its header ({sequence_count} "
                f"sequences, {document_count} document boundaries) needs {expected}"
                f"{'' if multimodal else f' (or {expected + trailer} with modes)'}"
            )

    def _read_header(self, header: bytes, idx_path: str) -> int:
        if len(header) < HEADER_SIZE:
            raise DataFormatError(
                f"{idx_path}: index is {len(header)} bytes, shorter than the {HEADER_SIZE}-byte "
                "header"
            )
        magic, version, code = INDEX_PREAMBLE.unpack_from(header)
        if magic != INDEX_HEADER:
            raise DataFormatError(
                f"{idx_path}: bad magic {magic!r}, expected {INDEX_HEADER!r}; not a megatron index"
            )
        if version != INDEX_VERSION:
            raise DataFormatError(
                f"{idx_path}: unsupported index version {version}, expected {INDEX_VERSION}"
            )
        self.sequence_count, self.document_count = INDEX_COUNTS.unpack_from(
            header, INDEX_PREAMBLE.size
        )
        return int(code)

    @staticmethod
    def _check_code(code: object, idx_path: str) -> None:
        if not (isinstance(code, (int, numpy.integer)) and 1 <= int(code) <= len(DType)):
            raise DataFormatError(
                f"{idx_path}: unknown dtype code {code!r}; known codes are 1..{len(DType)}"
            )

    def validate(self, bin_size: int | None = None, bin_path: str | None = None) -> None:
        """The structural check every reader runs on open (`tokenmill.formats.validate`):
        lengths >= 0, pointers the running sum of length x item size (no gap, overlap or
        misalignment), the last sequence ending at the ``.bin`` size, document boundaries from 0
        to the sequence count and never decreasing. One vectorised pass over the index arrays.

        Args:
            bin_size: the ``.bin`` size in bytes (not checked if None).
            bin_path: the ``.bin`` path, for messages.

        Raises:
            DataFormatError: the first violated invariant, naming the field, index and value.
        """
        from tokenmill.formats.validate import check_megatron_index

        check_megatron_index(
            self.idx_path,
            self.sequence_lengths,
            self.sequence_pointers,
            self.document_indices,
            self.dtype_size,
            bin_size,
            bin_path,
        )

    @property
    def mapped(self) -> bool:
        """Whether the arrays are views of a shared map of the file (an index above READ_BELOW
        bytes), which a SIGBUS reaches if the file shrinks (a smaller one was read whole)."""
        return not isinstance(self._mapping.obj, (bytes, bytearray))

    def entry_probing(self, data: _core.MappedFile) -> Callable[[int], tuple[int, int]] | None:
        """`entry` that also probes the end of `data` (the mapped ``.bin``) in the same guarded
        call; None for an index read whole (nothing of it to guard)."""
        if self._mapped_file is None:
            return None
        return functools.partial(self._mapped_file.entry_probing, data, *self._entry_layout)

    def _unmapped_entry(self, sequence: int) -> tuple[int, int]:
        """`entry` of an index read whole: (byte pointer, length) of `sequence`. A mapped
        index's `entry` reads them under the SIGBUS guard, with the mapping's end probed, and
        raises tokenmill._core.MappedReadFault if the file shrank underneath."""
        return int(self.sequence_pointers[sequence]), int(self.sequence_lengths[sequence])

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
