"""``megatron.core.datasets.indexed_dataset`` on tokenmill: the ``.bin/.idx`` reader and writer.

`IndexedDataset`, `IndexedDatasetBuilder`, `DType` and `_IndexReader` are tokenmill's
(`tokenmill.formats.megatron`): byte-identical files, the same items, and errors that name the
file instead of asserts. The rest of megatron's module is here with its signatures:

* `_IndexWriter` writes a ``.idx`` from lengths, modes and document boundaries (atomically);
* the ``.bin`` readers `_MMapBinReader`, `_FileBinReader` and `_S3BinReader` read
  ``count`` tokens at a byte ``offset`` (`read(dtype, count, offset)`), over a memory map,
  positioned reads (retried with megatron's back-off) and tokenmill's chunk-cached S3 reads;
  `_MultiStorageClientBinReader` refuses ``msc://`` (not supported by tokenmill).

tokenmill's `IndexedDataset` keeps its ``.bin`` map itself (`bin_reader` is set only for object
storage), so these reader classes are for code that constructs them directly.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import numpy

from tokenmill import _core
from tokenmill.common.atomic import AtomicFile
from tokenmill.common.mapping import map_readonly, open_readonly
from tokenmill.formats.megatron import (
    INDEX_HEADER,
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    shrunk_file_error,
)
from tokenmill.formats.megatron_index import (  # megatron's private name, imported by its tools
    _IndexReader as _IndexReader,
)
from tokenmill.formats.megatron_index import write_index
from tokenmill.megatron.object_storage_utils import (
    ObjectStorageConfig,
    S3Config,
    cache_index_file,
    dataset_exists,
    get_index_cache_path,
    get_object_storage_access,
    is_object_storage_path,
    parse_s3_path,
)
from tokenmill.megatron.utils import log_single_rank

__all__ = [
    "HAVE_AWKWARD",
    "OBJECT_STORAGE_BIN_READERS",
    "DType",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "ObjectStorageConfig",
    "S3Config",
    "cache_index_file",
    "dataset_exists",
    "get_bin_path",
    "get_idx_path",
    "get_index_cache_path",
    "get_object_storage_access",
    "is_object_storage_path",
    "log_single_rank",
    "parse_s3_path",
]

logger = logging.getLogger(__name__)

HAVE_AWKWARD = importlib.util.find_spec("awkward") is not None
"""Megatron-LM main's flag: whether awkward arrays (its `add_documents` input) are importable."""

_INDEX_HEADER = INDEX_HEADER


class _IndexWriter:
    """Writes a ``.idx`` (megatron's layout), as a context manager: the file appears, complete,
    when the block exits without an exception.

    Args:
        idx_path: the ``.idx`` to write.
        dtype: the token dtype of the ``.bin`` it describes.
    """

    def __init__(self, idx_path: str, dtype: Any) -> None:
        self.idx_path = idx_path
        self.dtype = dtype
        self._file: AtomicFile | None = None

    def __enter__(self) -> _IndexWriter:
        self._file = AtomicFile(self.idx_path)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: types.TracebackType | None,
    ) -> bool | None:
        target, self._file = self._file, None
        if target is not None:
            if exc_type is None:
                target.commit()
            target.abort()  # a no-op after commit
        return None

    def write(
        self,
        sequence_lengths: Iterable[int | numpy.integer[Any]],
        sequence_modes: Iterable[int | numpy.integer[Any]] | None,
        document_indices: Iterable[int | numpy.integer[Any]],
    ) -> None:
        """Write the header, lengths, pointers, document boundaries and (if given) modes.

        Raises:
            ValueError: called outside the ``with`` block.
        """
        if self._file is None:
            raise ValueError(f"{self.idx_path}: _IndexWriter.write needs the `with` block")
        write_index(
            self._file.stream,
            self.dtype,
            numpy.fromiter(sequence_lengths, dtype="<i4"),
            numpy.fromiter(document_indices, dtype="<i8"),
            None if sequence_modes is None else numpy.fromiter(sequence_modes, dtype=numpy.int8),
        )

    def _sequence_pointers(self, sequence_lengths: Iterable[int | numpy.integer[Any]]) -> list[int]:
        """The byte offset of each sequence (megatron's helper, kept for code that calls it;
        ``write`` computes the same offsets in ``write_index``)."""
        lengths = numpy.fromiter(sequence_lengths, dtype=numpy.int64)
        pointers = numpy.zeros(lengths.shape[0], dtype=numpy.int64)
        if lengths.shape[0] > 1:
            numpy.cumsum(lengths[:-1], out=pointers[1:])
        itemsize = numpy.dtype(self.dtype).itemsize
        return [int(value) * itemsize for value in pointers]


class _BinReader(ABC):
    """Reads tokens of a ``.bin``."""

    @abstractmethod
    def read(self, dtype: Any, count: int, offset: int) -> numpy.ndarray[Any, Any]:
        """`count` tokens of `dtype` starting at byte `offset`."""


class _MMapBinReader(_BinReader):
    """Zero-copy reads from a read-only memory map of the ``.bin``. The map keeps no descriptor
    (`common.mapping.map_readonly`; megatron-core's ``numpy.memmap`` keeps one per reader). An
    empty file raises ValueError, as megatron-core's does."""

    def __init__(self, bin_path: str) -> None:
        descriptor = open_readonly(bin_path)
        try:
            size = os.fstat(descriptor).st_size
            mapping = map_readonly(descriptor, size, bin_path)
        finally:
            os.close(descriptor)
        self._bin_path = bin_path
        # the bytes as megatron-core's reader holds them (a uint8 array over the map)
        self._bin_buffer_mmap = numpy.frombuffer(mapping, dtype=numpy.uint8)
        self._bin_buffer = self._bin_buffer_mmap.data
        self._bin_file = _core.MappedFile(self._bin_buffer_mmap)  # guarded probes of its end

    def read(self, dtype: Any, count: int, offset: int) -> numpy.ndarray[Any, Any]:
        """A read-only view of `count` tokens at byte `offset`.

        Raises:
            DataFormatError: the ``.bin`` shrank below the view since it was mapped (probed
                under the SIGBUS guard before the view is handed out).
        """
        tokens = numpy.frombuffer(self._bin_buffer, dtype=dtype, count=count, offset=offset)
        if tokens.nbytes:
            try:
                self._bin_file.probe()
            except _core.MappedReadFault as fault:
                raise shrunk_file_error(self._bin_path, len(self._bin_buffer), fault) from None
        return tokens

    def __del__(self) -> None:
        buffer = getattr(self, "_bin_buffer", None)
        if buffer is not None:
            buffer.release()


class _FileBinReader(_BinReader):
    """Positioned reads (``os.pread``) of the ``.bin``, retried `num_max_retries` times with a
    doubling sleep starting at `sleep_duration_start` seconds (megatron's back-off for flaky
    network filesystems)."""

    def __init__(
        self, bin_path: str, num_max_retries: int = 3, sleep_duration_start: int = 10
    ) -> None:
        self._bin_path = bin_path
        self._num_max_retries = num_max_retries
        self._sleep_duration_start = sleep_duration_start

    def read(self, dtype: Any, count: int, offset: int) -> numpy.ndarray[Any, Any]:
        """`count` tokens at byte `offset`, in a new array.

        Raises:
            OSError: every attempt failed (the last error).
            EOFError: the file ends before the requested bytes.
        """
        array = numpy.empty(count, dtype=dtype)
        target = memoryview(array.data).cast("B")
        sleep = float(self._sleep_duration_start)
        for attempt in range(self._num_max_retries + 1):
            try:
                descriptor = os.open(self._bin_path, os.O_RDONLY)
                try:
                    done = 0
                    while done < target.nbytes:
                        read = os.preadv(descriptor, [target[done:]], offset + done)
                        if read == 0:
                            raise EOFError(
                                f"{self._bin_path}: ends at byte {offset + done}, before the "
                                f"{target.nbytes} bytes requested at {offset}"
                            )
                        done += read
                finally:
                    os.close(descriptor)
                return array
            except OSError as error:
                if attempt == self._num_max_retries:
                    raise
                logger.warning(
                    "reading %s failed (%s); retrying in %.0f s", self._bin_path, error, sleep
                )
                time.sleep(sleep)
                sleep *= 2
        raise AssertionError("unreachable")  # pragma: no cover


class _S3BinReader(_BinReader):
    """Ranged, chunk-cached reads of an ``s3://`` ``.bin`` (`tokenmill.storage.remote`)."""

    def __init__(self, bin_path: str, object_storage_config: ObjectStorageConfig) -> None:
        from tokenmill.storage.remote import S3BinReader

        self._reader = S3BinReader(bin_path, ObjectStorageConfig.coerce(object_storage_config))

    def _extract_from_cache(self, offset: int, size: int) -> bytes:
        """`size` bytes at byte `offset` (from the chunk cache, fetching what is missing)."""
        data = bytearray(size)
        self._reader.read_into(offset, memoryview(data))
        return bytes(data)

    def read(self, dtype: Any, count: int, offset: int) -> numpy.ndarray[Any, Any]:
        """`count` tokens at byte `offset`, in a new array."""
        array = numpy.empty(count, dtype=dtype)
        self._reader.read_into(offset, memoryview(array.data).cast("B"))
        return array

    def __del__(self) -> None:
        self.__dict__.pop("_reader", None)


class _MultiStorageClientBinReader(_BinReader):
    """megatron's ``msc://`` reader: not supported by tokenmill (construction raises)."""

    def __init__(self, bin_path: str, object_storage_config: ObjectStorageConfig) -> None:
        raise NotImplementedError(
            f"msc:// paths (NVIDIA multi-storage client) are not supported: {bin_path}; use an "
            "s3:// URL (any S3-compatible service through AWS_ENDPOINT_URL)"
        )

    def read(self, dtype: Any, count: int, offset: int) -> numpy.ndarray[Any, Any]:
        """Never reached: construction raises."""
        raise NotImplementedError("msc:// reads are not supported")


OBJECT_STORAGE_BIN_READERS: dict[str, type[_BinReader]] = {
    "s3": _S3BinReader,
    "msc": _MultiStorageClientBinReader,
}
