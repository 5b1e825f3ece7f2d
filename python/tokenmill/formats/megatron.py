"""Megatron's indexed token format (``<prefix>.bin`` + ``<prefix>.idx``), byte-compatible with
megatron-core 0.19.x.

This module is the format's public face (megatron-core's ``indexed_dataset`` names): it holds the
reader, ``IndexedDataset``; the ``.idx`` layout, dtype codes and index reader are in
`tokenmill.formats.megatron_index`, the writer ``IndexedDatasetBuilder`` in
`tokenmill.formats.megatron_builder`, and both are importable from here.

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
* ``sequence_lengths`` are >= 0 and ``sequence_pointers`` are their running sum x itemsize (no
  gap, overlap or misalignment), one vectorised pass shared by every reader
  (`tokenmill.formats.validate`);
* the ``.bin`` is exactly ``sequence_pointers[-1] + sequence_lengths[-1] * itemsize`` bytes.

Every access is additionally bounds-checked against the ``.bin`` size before a view is taken, so a
corrupt index raises instead of reading the wrong bytes or crashing.

Cost: opening maps the ``.idx`` and takes zero-copy views (O(1)), plus one vectorised pass over
the index arrays (a few ms per million sequences; skipped with ``fast_cache_load``). With
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
import errno
import os
from collections.abc import Callable
from typing import Any, TypeVar

import numpy
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.mapping import map_readonly, resource_error
from tokenmill.errors import DataFormatError
from tokenmill.formats.megatron_builder import IndexedDatasetBuilder
from tokenmill.formats.megatron_index import (
    HEADER_SIZE,
    INDEX_HEADER,
    INDEX_VERSION,
    OBJECT_STORAGE_SCHEMES,
    DType,
    NumpyScalarType,
    _IndexReader,
    get_bin_path,
    get_idx_path,
)

# The format's public names in one module, like megatron-core's indexed_dataset: the reader is
# here, the index layout and dtype codes in megatron_index.py, the writer in megatron_builder.py.
__all__ = [
    "HEADER_SIZE",
    "INDEX_HEADER",
    "INDEX_VERSION",
    "DType",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "check_path_text",
    "get_bin_path",
    "get_idx_path",
    "shrunk_file_error",
]


_Result = TypeVar("_Result")


def _on_bin(call: Callable[[str], _Result], bin_path: str) -> _Result:
    """`call(bin_path)` (an open or a stat of a ``.bin``): a missing file is named as the data
    file, running out of descriptors as the limit it is (ResourceLimitError)."""
    try:
        return call(bin_path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"data file not found: {bin_path}") from None
    except OSError as error:
        limit = resource_error(error, bin_path)
        if limit is None:
            raise
        raise limit from error


def _open_bin(bin_path: str) -> int:
    return _on_bin(lambda path: os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), bin_path)


def _bin_status(bin_path: str) -> os.stat_result:
    return _on_bin(os.stat, bin_path)


def check_path_text(path: str, what: str) -> None:
    """ValueError naming `path` if no file can have that name here: a NUL byte (Python's own
    error, "embedded null byte", names no file), or a lone surrogate (a name that is not UTF-8,
    which the C++ core cannot be given)."""
    if "\x00" in path:
        raise ValueError(f"{what} {path[:300]!r} contains a NUL byte; no file can have that name")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what} {path[:300]!r} holds a lone surrogate {path[error.start]!r} at position "
            f"{error.start} (a file name that is not UTF-8); rename the file"
        ) from None


def shrunk_file_error(path: str, mapped_size: int, fault: BaseException) -> DataFormatError:
    """The error for a read of the mapped `path` (`mapped_size` bytes when mapped) that faulted
    (tokenmill._core.MappedReadFault, a SIGBUS turned into an exception): the file shrank
    underneath the reader."""
    try:
        now = f"{os.stat(path).st_size} bytes"
    except OSError as error:
        now = f"gone ({error.strerror})"
    return DataFormatError(
        f"{path}: data file is now {now}, but it was {mapped_size} bytes when mapped; it was "
        f"truncated or rewritten in place while a dataset read it ({fault})"
    )


class IndexedDataset:
    """A read-only view of a ``.bin/.idx`` pair: megatron-core's ``IndexedDataset``.

    Item ``i`` is the ``i``-th *sequence* (a document is a run of sequences given by
    ``document_indices``). Map-style, so it plugs into ``torch.utils.data`` without importing torch.

    Args:
        path_prefix: the path of both files without the ``.bin``/``.idx`` suffix.
        multimodal: read the int8 ``sequence_modes`` trailer and return ``(tokens, mode)`` items.
        mmap: map the ``.bin`` (on the first read: opening only checks its size) and return
            zero-copy read-only views; if False, every read is an ``os.preadv`` into a new
            writable array and the ``.bin`` is never mapped.
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
        check_path_text(path_prefix, "path prefix")
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.object_storage_config = object_storage_config
        self.fast_cache_load = fast_cache_load
        self.sequences_per_dataset = sequences_per_dataset
        self.dtype_code = dtype_code
        self._bin_descriptor = -1
        self._token_view: npt.NDArray[Any] | None = None
        self._bin_file: _core.MappedFile | None = None  # the mapped .bin, for guarded probes
        self._entry_probing_bin: Callable[[int], tuple[int, int]] | None = None
        self._map_on_first_read = False
        self.bin_reader: Any = None
        if path_prefix.startswith(OBJECT_STORAGE_SCHEMES):
            self._open_object_storage()
            return

        self.index = _IndexReader(
            get_idx_path(path_prefix), multimodal, sequences_per_dataset, dtype_code
        )
        self.dtype = self.index.dtype
        self._itemsize = self.index.dtype_size
        self._sequence_count = self.index.sequence_count

        bin_path = get_bin_path(path_prefix)
        if mmap:
            # the .bin is mapped on its first read (`_tokens`), not here: a blend of thousands
            # of sources maps only those it reads, and opening one costs a stat
            self._bin_size = _bin_status(bin_path).st_size
            self._check_bin_size(f"{bin_path}: data file", self.index.idx_path)
            if not fast_cache_load:
                self.index.validate(self._bin_size, bin_path)
            if self._bin_size:
                self._map_on_first_read = True
            else:  # an empty file cannot be mapped
                self._token_view = numpy.empty(0, dtype=self.dtype)
                self._token_view.flags.writeable = False
            return
        descriptor = _open_bin(bin_path)
        try:
            self._bin_size = os.fstat(descriptor).st_size
            self._check_bin_size(f"{bin_path}: data file", self.index.idx_path)
            if not fast_cache_load:
                self.index.validate(self._bin_size, bin_path)
            self._bin_descriptor = descriptor
            descriptor = -1
        finally:
            if descriptor >= 0:
                os.close(descriptor)

    @property
    def _tokens(self) -> npt.NDArray[Any] | None:
        """The mapped ``.bin`` as tokens (None when reads are preads or ranged GETs). Mapped on
        first use; the map keeps no descriptor."""
        if self._map_on_first_read:
            self._map_bin()
        return self._token_view

    def _map_bin(self) -> None:
        bin_path = get_bin_path(self.path_prefix)
        descriptor = _open_bin(bin_path)
        try:
            size = os.fstat(descriptor).st_size
            if size != self._bin_size:
                # mapping past the end of a shrunk file would turn reads into SIGBUS
                raise DataFormatError(
                    f"{bin_path}: data file is {size} bytes, but it was {self._bin_size} bytes "
                    "when the dataset was opened; it changed underneath the reader"
                )
            mapping = map_readonly(descriptor, size, bin_path)
        finally:
            os.close(descriptor)
        # two threads may both map on a first read: the map that loses is freed with its array
        self._token_view = numpy.frombuffer(mapping, dtype=self.dtype, count=size // self._itemsize)
        self._bin_file = _core.MappedFile(mapping)
        # ds[i]: the .idx entry read and the .bin probe in one guarded call
        self._entry_probing_bin = self.index.entry_probing(self._bin_file)
        self._map_on_first_read = False

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
        self.dtype = self.index.dtype
        self._itemsize = self.index.dtype_size
        self._sequence_count = self.index.sequence_count
        bin_path = get_bin_path(prefix)
        reader = S3BinReader(bin_path, config, client)
        self._bin_size = reader.size
        self._check_bin_size(
            f"{bin_path}: data object", f"{local_idx} (from {get_idx_path(prefix)})"
        )
        if not self.fast_cache_load:
            self.index.validate(self._bin_size, bin_path)
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

    def _entry(self, sequence: int) -> tuple[int, int]:
        """(byte pointer, length) of `sequence`; read under the SIGBUS guard when the `.idx` is
        mapped, so an index cut underneath the reader raises naming it instead of killing the
        process."""
        try:
            return self.index.entry(sequence)
        except _core.MappedReadFault as fault:
            raise self._index_shrunk(fault) from None

    def _index_shrunk(self, fault: BaseException) -> DataFormatError:
        """The error for a fault of a guarded read of the `.idx` (and, on the fast path, the
        `.bin`): names whichever of them is now shorter than when mapped."""
        index = self.index
        bin_path = get_bin_path(self.path_prefix)
        if self._entry_probing_bin is not None:
            with contextlib.suppress(OSError):
                if os.stat(bin_path).st_size < self._bin_size:
                    return shrunk_file_error(bin_path, self._bin_size, fault)
        return shrunk_file_error(index.idx_path, len(index._mapping), fault)

    def _mapped_lengths(self, start: int, stop: int) -> npt.NDArray[numpy.int32]:
        """``sequence_lengths[start:stop]``, copied out under the SIGBUS guard when the `.idx`
        is mapped."""
        index = self.index
        lengths = index.sequence_lengths[start:stop]
        if not index.mapped or start == stop:
            return lengths
        copied = numpy.empty(stop - start, dtype=lengths.dtype)
        try:
            _core.copy_mapped(copied, index.sequence_lengths, start * lengths.dtype.itemsize)
        except _core.MappedReadFault as fault:
            raise shrunk_file_error(index.idx_path, len(index._mapping), fault) from None
        return copied

    def _read(
        self, byte_offset: int, count: int, sequence: int, probe: bool = True
    ) -> npt.NDArray[Any]:
        """`count` tokens from `byte_offset`: a view of the mapped `.bin` (its end probed under
        the guard unless `probe` is False: the caller's guarded entry read probed it) or a new
        array (preads, ranged reads)."""
        end = byte_offset + count * self._itemsize
        if byte_offset < 0 or count < 0 or end > self._bin_size or byte_offset % self._itemsize:
            raise DataFormatError(
                f"{get_bin_path(self.path_prefix)}: sequence {sequence} points at bytes "
                f"[{byte_offset}, {end}) outside the {self._bin_size}-byte data file or off the "
                f"{self._itemsize}-byte grid; the index is corrupt"
            )
        if self._map_on_first_read:
            self._map_bin()
        tokens_view = self._token_view
        if tokens_view is not None:
            if count and probe and self._bin_file is not None:
                # a view is read by the caller, where a SIGBUS cannot be caught: probe the
                # mapping's end first (a file shrunk below its last page raises here instead)
                try:
                    self._bin_file.probe()
                except _core.MappedReadFault as fault:
                    raise shrunk_file_error(
                        get_bin_path(self.path_prefix), self._bin_size, fault
                    ) from None
            start = byte_offset // self._itemsize
            return tokens_view[start : start + count]
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
            sequence = int(idx)
            if sequence < 0:
                sequence += self._sequence_count
            if not 0 <= sequence < self._sequence_count:
                self._resolve(idx)  # raises the IndexError that names the index
            index = self.index
            fast = self._entry_probing_bin  # the .idx entry and the .bin probe in one call
            try:
                pointer, length = index.entry(sequence) if fast is None else fast(sequence)
            except _core.MappedReadFault as fault:
                raise self._index_shrunk(fault) from None
            view = self._token_view
            itemsize = self._itemsize
            end = pointer + length * itemsize
            bin_file = self._bin_file
            if (
                view is not None
                and bin_file is not None
                and index.sequence_modes is None
                and pointer >= 0
                and length > 0
                and end <= self._bin_size
                and not pointer % itemsize
            ):
                # the common case, `_read`'s mapped path inline: a Python call less per sample
                # (benchmarks/bench_indexed.py: `dataset[i]` below megatron-core's without it);
                # the guarded entry read probed the .bin already when the .idx is mapped
                if fast is None:
                    try:
                        bin_file.probe()
                    except _core.MappedReadFault as fault:
                        raise shrunk_file_error(
                            get_bin_path(self.path_prefix), self._bin_size, fault
                        ) from None
                start = pointer // itemsize
                return view[start : start + length]
            tokens = self._read(pointer, length, sequence, fast is None)
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
            lengths = self._mapped_lengths(start, stop)
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
                        f"{int(lengths[bad - start])}; the index is corrupt"
                    )
                bounds = numpy.cumsum(lengths, dtype=numpy.int64)
                tokens = self._read(self._entry(start)[0], int(bounds[-1]), start)
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
        fast = self._entry_probing_bin  # the .idx entry and the .bin probe in one guarded call
        try:
            pointer, sequence_length = index.entry(sequence) if fast is None else fast(sequence)
        except _core.MappedReadFault as fault:
            raise self._index_shrunk(fault) from None
        offset = int(offset)
        if length is None:
            length = sequence_length - offset
        length = int(length)
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"{self.path_prefix}: tokens [{offset}, {offset + length}) are outside sequence "
                f"{sequence} of length {sequence_length}"
            )
        tokens = self._read(pointer + offset * self._itemsize, length, sequence, fast is None)
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
        if path_prefix.startswith(OBJECT_STORAGE_SCHEMES):
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
