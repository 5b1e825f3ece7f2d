"""Packed text: a chunk's documents as one buffer, the form gigatoken encodes without copying.

``PackedText.data`` holds every non-empty document's UTF-8 bytes followed by one ``0xFF`` byte
(no valid UTF-8 text contains it), ``lengths`` each document's byte length (0 for an empty
document, which has no bytes and no separator). gigatoken splits the buffer at the separators
inside its encode (``BytesSource``), so no Python string is made per document; empty pieces
are skipped there, which is why empty documents carry no separator and are put back by
``lengths``.

:func:`pack_chunk` reads a chunk straight into this form with the C++ packers
(``_core.pack_jsonl_field``, ``pack_lines``, ``pack_documents``; about 0.7 GB/s for JSON Lines,
memory speed for the rest), which accept exactly what :func:`~tokenmill.tokenize.readers.
parse_chunk` accepts and extract the same text. When a packer does not accept a line (bad JSON,
a missing key, invalid UTF-8, and the rare inputs only Python's json module reads: NaN, a UTF-8
BOM, a lone surrogate escape), the chunk is read again by ``parse_chunk``, which raises the
reader's error naming the file and line, or returns the documents to pack. So the documents, and
the errors, are those of the Python readers, byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import numpy.typing as npt

from tokenmill import _core
from tokenmill.common.core_call import core_call
from tokenmill.tokenize.readers import Chunk, ReadOptions, parse_chunk

__all__ = ["SEPARATOR", "PackedText", "pack_chunk", "pack_texts"]

SEPARATOR = b"\xff"


@dataclass(frozen=True)
class PackedText:
    """Documents packed for an encoder (see the module docstring)."""

    data: bytes
    lengths: npt.NDArray[numpy.int64]

    @property
    def documents(self) -> int:
        """The number of documents, empty ones included."""
        return int(self.lengths.shape[0])

    @property
    def text_bytes(self) -> int:
        """The UTF-8 bytes of all documents."""
        return int(self.lengths.sum(dtype=numpy.int64))

    def ends(self) -> npt.NDArray[numpy.int64]:
        """Each document's end in ``data`` (after its separator, if it has one)."""
        return numpy.cumsum(self.lengths + (self.lengths > 0), dtype=numpy.int64)

    def text(self, index: int) -> str:
        """Document ``index`` as a string."""
        end = int(self.ends()[index]) - (1 if self.lengths[index] else 0)
        return self.data[end - int(self.lengths[index]) : end].decode("utf-8")


def pack_texts(texts: Sequence[str]) -> PackedText:
    """Pack documents given as strings.

    Raises:
        UnicodeEncodeError: a string holds a lone surrogate (not encodable as UTF-8).
    """
    encoded = [text.encode("utf-8") for text in texts]
    data = b"".join(part + SEPARATOR for part in encoded if part)
    return PackedText(data, numpy.fromiter(map(len, encoded), numpy.int64, len(encoded)))


def _packed(result: tuple[bytes, npt.NDArray[numpy.int64], int]) -> PackedText | None:
    data, lengths, failed = result
    return None if failed >= 0 else PackedText(data, lengths)


def _parquet_strings(chunk: Chunk, options: ReadOptions) -> PackedText | None:
    """A parquet row group's text column, packed from its arrow buffers (no Python strings)."""
    from tokenmill.tokenize.readers import _check_column, _open_parquet

    parquet = _open_parquet(chunk.path)
    _check_column(parquet, chunk.path, options.column)
    table = parquet.read_row_group(chunk.row_group, columns=[options.column])
    column = table.column(0).combine_chunks()
    if column.null_count:
        return None  # parse_chunk names the row
    _, offsets_buffer, data_buffer = column.buffers()
    offset_type = numpy.int64 if column.type.equals(_large_string()) else numpy.int32
    count = len(column)
    offsets: Any = numpy.frombuffer(offsets_buffer, dtype=offset_type)[
        column.offset : column.offset + count + 1
    ].astype(numpy.int64)
    data = numpy.frombuffer(data_buffer, dtype=numpy.uint8) if data_buffer is not None else b""
    return _packed(core_call(_core.pack_documents, data, offsets))


def _large_string() -> Any:
    import pyarrow as pa

    return pa.large_string()


def pack_chunk(chunk: Chunk, options: ReadOptions) -> PackedText:
    """The documents of a chunk, packed (the same documents as ``parse_chunk``).

    Raises:
        DataFormatError: see :func:`~tokenmill.tokenize.readers.parse_chunk`.
    """
    packed: PackedText | None = None
    if chunk.kind == "jsonl":
        packed = _packed(core_call(_core.pack_jsonl_field, chunk.data, options.json_key))
    elif chunk.kind == "lines":
        packed = _packed(core_call(_core.pack_lines, chunk.data))
    elif chunk.kind == "text":
        bounds = numpy.array([0, len(chunk.data)], dtype=numpy.int64)
        packed = _packed(core_call(_core.pack_documents, chunk.data, bounds))
    elif chunk.kind == "parquet":
        packed = _parquet_strings(chunk, options)
    if packed is None:  # the Python reader raises the error, or reads what the packer did not
        packed = pack_texts(parse_chunk(chunk, options))
    return packed
