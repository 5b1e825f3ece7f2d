"""Input discovery and streamed reading of text corpora, split into ordered work chunks.

Formats, chosen by file name: ``.jsonl`` / ``.json`` (one JSON object per line, the text under
``json_key``), ``.jsonl.gz``, ``.jsonl.zst`` (``.zstd``), ``.parquet`` (a string ``column``) and
``.txt`` (a document per file, or per line with ``txt_mode="line"``). Inputs are files, globs
or directories (searched recursively for known suffixes); the list is sorted, so every process
and machine sees the same order.

A file is read as a sequence of :class:`Chunk` objects (the unit of parallel work): for
line-based formats, blocks of about ``chunk_bytes`` of *decompressed* bytes cut at line ends
(the parent only decompresses and finds newlines; JSON parsing happens in the workers); for
parquet, one row group (the worker reads it itself); for a ``.txt`` file per document, the whole
file. Chunk boundaries depend only on the file, and results are written in chunk order, so the
output does not depend on the number of workers. Memory per chunk is bounded by
``chunk_bytes`` (or a row group).

Parsing rules (each violation raises :class:`~tokenmill.errors.DataFormatError` naming the
file, line or row, field and value): lines that are empty or only whitespace are skipped; every
other line must be a JSON object with a string under ``json_key``; text must be valid UTF-8;
parquet values must be non-null strings. In ``txt_mode="line"`` empty lines are skipped and the
newline (and a trailing ``\\r``) is not part of the document.
"""

from __future__ import annotations

import glob
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from tokenmill.errors import DataFormatError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMATS",
    "GIGATOKEN_CHUNK_BYTES",
    "Chunk",
    "ReadOptions",
    "detect_format",
    "expand_inputs",
    "iter_chunks",
    "parse_chunk",
    "read_documents",
]

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "txt")

_SUFFIXES = (
    (".jsonl.gz", "jsonl.gz"),
    (".json.gz", "jsonl.gz"),
    (".jsonl.zst", "jsonl.zst"),
    (".jsonl.zstd", "jsonl.zst"),
    (".json.zst", "jsonl.zst"),
    (".jsonl", "jsonl"),
    (".json", "jsonl"),
    (".parquet", "parquet"),
    (".txt", "txt"),
)

_READ_BLOCK = 1 << 20

DEFAULT_CHUNK_BYTES = 1 << 20
"""Work chunk size of the worker processes (reference backends)."""

GIGATOKEN_CHUNK_BYTES = 8 << 20
"""Work chunk size of the gigatoken threads."""


DEFAULT_MAX_RECORD_BYTES = 256 << 20
DEFAULT_MAX_DECOMPRESSION_RATIO = 200.0
# the decompression ratio is judged only past this much output (small files compress oddly)
_RATIO_GRACE_BYTES = 256 << 20


@dataclass(frozen=True)
class ReadOptions:
    """How documents are taken out of the files.

    Args:
        json_key: the field of each JSON line that holds the text.
        column: the parquet column that holds the text.
        txt_mode: "file" (a ``.txt`` file is one document) or "line" (each line is one).
        chunk_bytes: the target size of a line-based work chunk (decompressed bytes); None:
            ``DEFAULT_CHUNK_BYTES`` (the tokenize pipeline picks ``GIGATOKEN_CHUNK_BYTES`` for
            gigatoken, whose per-call cost is about a millisecond).
        max_record_bytes: the longest line (JSON record or text line, decompressed) or
            ``.txt`` document accepted; a longer one is a DataFormatError naming the file and
            line, found while streaming, before it is held in memory whole.
        max_decompression_ratio: a ``.gz`` / ``.zst`` input whose output exceeds this many
            times the compressed bytes read so far (once past 256 MiB of output) is refused as a
            decompression bomb (text compresses 3-10x; gzip's ceiling is about 1000x).
    """

    json_key: str = "text"
    column: str = "text"
    txt_mode: str = "file"
    chunk_bytes: int | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_decompression_ratio: float = DEFAULT_MAX_DECOMPRESSION_RATIO

    def __post_init__(self) -> None:
        if self.txt_mode not in ("file", "line"):
            raise ValueError(f"txt_mode must be 'file' or 'line', got {self.txt_mode!r}")
        if self.chunk_bytes is not None and self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.max_record_bytes < 1:
            raise ValueError(f"max_record_bytes must be >= 1, got {self.max_record_bytes}")
        if not self.max_decompression_ratio > 1:
            raise ValueError(
                f"max_decompression_ratio must be > 1, got {self.max_decompression_ratio}"
            )
        if not self.json_key:
            raise ValueError("json_key must be a non-empty string, got ''")
        if not self.column:
            raise ValueError("column must be a non-empty string, got ''")


@dataclass(frozen=True)
class Chunk:
    """One unit of work: a run of consecutive documents of one file.

    Attributes:
        path: the input file.
        kind: "jsonl" or "lines" (``data`` holds whole lines), "text" (``data`` is one document),
            "parquet" (the worker reads ``row_group`` itself).
        data: the raw bytes, for every kind but "parquet".
        first_line: the 1-based line (or 0-based parquet row) number of the first document.
        row_group: the parquet row group.
        source_bytes: how many bytes of the file on disk this chunk accounts for (progress/ETA).
    """

    path: str
    kind: str
    data: bytes = b""
    first_line: int = 1
    row_group: int = -1
    source_bytes: int = 0


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of a file from its name.

    Raises:
        ValueError: the suffix is not one of the known formats.
    """
    name = os.fspath(path).lower()
    for suffix, fmt in _SUFFIXES:
        if name.endswith(suffix):
            return fmt
    known = ", ".join(suffix for suffix, _ in _SUFFIXES)
    raise ValueError(f"{os.fspath(path)}: unknown input format; known suffixes: {known}")


def _is_known(path: str, walking: bool = False) -> bool:
    name = os.path.basename(path).lower()
    if name.endswith(".tokenmill.json") or (walking and name.endswith(".json")):
        return False  # tokenmill's sidecars; plain .json in a directory is likely not a corpus
    try:
        detect_format(path)
    except ValueError:
        return False
    return True


def expand_inputs(patterns: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The sorted, de-duplicated input files named by files, globs and directories.

    Args:
        patterns: file paths, glob patterns (``**`` recurses) or directories (searched
            recursively for files with a known suffix, except plain ``.json``, which is only
            taken when named or globbed). ``*.tokenmill.json`` sidecars are never inputs.

    Returns:
        Absolute paths, sorted.

    Raises:
        FileNotFoundError: a path does not exist, or a glob or directory matches no input file.
        ValueError: an explicitly named file has an unknown suffix; no patterns were given.
    """
    if not patterns:
        raise ValueError("no inputs given")
    found: set[str] = set()
    for pattern in patterns:
        text = os.fspath(pattern)
        if os.path.isdir(text):
            matches = [
                os.path.join(root, name)
                for root, _, names in os.walk(text)
                for name in names
                if _is_known(name, walking=True)
                and not name.startswith(".")
                and os.path.isfile(os.path.join(root, name))  # no FIFO, socket or device
            ]
            if not matches:
                raise FileNotFoundError(f"{text}: directory holds no input files ({FORMATS})")
        elif os.path.isfile(text):
            detect_format(text)
            matches = [text]
        elif glob.has_magic(text):
            matches = [path for path in glob.glob(text, recursive=True) if os.path.isfile(path)]
            matches = [path for path in matches if _is_known(path)]
            if not matches:
                raise FileNotFoundError(f"{text}: glob matches no input files ({FORMATS})")
        else:
            raise FileNotFoundError(f"input not found: {text}")
        found.update(os.path.abspath(path) for path in matches)
    return _each_file_once(sorted(found))


def _each_file_once(paths: list[str]) -> list[str]:
    """`paths` without a second name of one file (the first in sorted order is kept): a
    recursive glob through a symlink loop, or a link beside its target, names one file many
    times, and it would be tokenized each time."""
    seen: set[tuple[int, int]] = set()
    unique = []
    for path in paths:
        status = os.stat(path)
        key = (status.st_dev, status.st_ino)
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def open_regular_file(path: str) -> IO[bytes]:
    """`path` opened for reading, refusing without blocking anything but a regular file (a FIFO
    planted where an input belongs would block `open` forever): the open is non-blocking, then
    `fstat` decides, then reads block again.

    Raises:
        DataFormatError: not a regular file (named, with its kind).
    """
    import fcntl
    import stat

    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a directory"
                if stat.S_ISDIR(mode)
                else ("a socket" if stat.S_ISSOCK(mode) else "a device or other special file")
            )
            raise DataFormatError(f"{path}: is {kind}, not a regular file; refusing to read it")
        flags = fcntl.fcntl(descriptor, fcntl.F_GETFL)
        fcntl.fcntl(descriptor, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        stream = os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise
    return stream


class _CountingReader(io.RawIOBase):
    """Counts the bytes read from the file on disk (for progress over compressed files)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._raw.read(len(view))
        view[: len(data)] = data
        self.count += len(data)
        return len(data)


_ZSTD_PIECE = 2048


class _ZstdFrames(io.RawIOBase):
    """Decompresses concatenated zstd frames and raises on a stream that ends inside a frame.

    ``zstandard``'s ``stream_reader`` reads a truncated file as a shorter valid one (the
    documents of the unfinished frame vanish without an error), so frames are decoded here with
    one ``decompressobj`` each, whose ``eof`` says whether the frame ended properly.
    """

    def __init__(self, path: str, raw: IO[bytes]) -> None:
        import zstandard

        self._path = path
        self._raw = raw
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._frame = self._new()
        self._frame_start = 0  # byte offset (in the compressed file) of the current frame
        self._consumed = 0  # compressed bytes read so far
        self._in_frame = False  # some bytes of the current frame were fed
        self._output = bytearray()
        self._position = 0  # start of the unread output
        self._input = b""  # compressed bytes read, fed from _input_at on
        self._input_at = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def _fill(self, wanted: int) -> None:
        if self._position:
            del self._output[: self._position]
            self._position = 0
        while len(self._output) < wanted and not self._done:
            if self._input_at >= len(self._input):
                self._input, self._input_at = self._raw.read(_READ_BLOCK), 0
                if not self._input:
                    if self._in_frame:
                        raise DataFormatError(
                            f"{self._path}: cannot decompress (jsonl.zst): the stream ends at "
                            f"byte {self._consumed} inside the frame that starts at byte "
                            f"{self._frame_start}; the file is truncated"
                        )
                    self._done = True
                    return
            # small pieces: one decompress call expands at most _ZSTD_PIECE bytes (zstd's worst
            # case is about 32,000x), so a bomb is seen by the caller's checks between calls
            piece = self._input[self._input_at : self._input_at + _ZSTD_PIECE]
            self._input_at += len(piece)
            fed = len(piece)
            self._in_frame = True
            try:
                self._output += self._frame.decompress(piece)
            except Exception as error:  # zstandard.ZstdError
                raise DataFormatError(
                    f"{self._path}: cannot decompress (jsonl.zst): corrupt frame starting at "
                    f"byte {self._frame_start} (read up to byte {self._consumed + fed}): "
                    f"{error}"
                ) from error
            if not self._frame.eof:
                self._consumed += fed
                continue
            rest = self._frame.unused_data
            self._consumed += fed - len(rest)
            self._frame_start = self._consumed
            self._frame = self._new()
            self._in_frame = False
            self._input, self._input_at = rest + self._input[self._input_at :], 0

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if len(self._output) - self._position < len(view):
            self._fill(len(view))
        count = min(len(view), len(self._output) - self._position)
        view[:count] = self._output[self._position : self._position + count]
        self._position += count
        return count


def _open_decompressed(path: str, fmt: str, raw: IO[bytes]) -> IO[bytes]:
    if fmt == "jsonl.gz":
        import gzip

        return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    if fmt == "jsonl.zst":
        return cast(IO[bytes], io.BufferedReader(_ZstdFrames(path, raw), _READ_BLOCK))
    return raw


def _line_chunks(path: str, fmt: str, kind: str, options: ReadOptions) -> Iterator[Chunk]:
    """Blocks of whole lines of about ``chunk_bytes`` (a longer line is one chunk of its own,
    up to ``max_record_bytes``)."""
    chunk_bytes = options.chunk_bytes or DEFAULT_CHUNK_BYTES
    max_record = options.max_record_bytes
    compressed = fmt != "jsonl" and fmt != "txt"
    with open_regular_file(path) as file:
        counter = _CountingReader(file)
        stream = _open_decompressed(path, fmt, io.BufferedReader(counter, _READ_BLOCK))
        pending = bytearray()
        searched = 0  # pending[:searched] holds no line end of the current line
        line = 1
        reported = 0
        decompressed = 0
        ended = False
        try:
            while not ended:
                try:
                    block = stream.read(max(chunk_bytes, _READ_BLOCK))
                except DataFormatError:
                    raise
                except Exception as error:  # gzip.BadGzipFile, zstd errors, EOFError
                    raise DataFormatError(
                        f"{path}: cannot decompress ({fmt}) at byte {counter.count} of the "
                        f"file, after line {line}: {error}"
                    ) from error
                ended = not block
                if compressed:
                    decompressed += len(block)
                    _check_ratio(path, fmt, decompressed, counter.count, options)
                pending += block  # a bytearray: a long line grows in place, not quadratically
                start = 0
                while len(pending) - start >= chunk_bytes or (ended and start < len(pending)):
                    cut = pending.rfind(b"\n", start, start + chunk_bytes) + 1
                    if cut == 0:  # no line end within a chunk: take the whole (long) line
                        # (searched from where the last block's search ended, not again)
                        cut = pending.find(b"\n", max(start + chunk_bytes, searched)) + 1
                    if cut == 0:
                        searched = len(pending)
                        if len(pending) - start > max_record:
                            raise _record_too_long(path, line, max_record)
                        if not ended:
                            break  # the line continues in the next block
                        cut = len(pending)  # the last line has no newline
                    elif cut - start > max_record + 1:
                        raise _record_too_long(path, line, max_record)
                    searched = 0
                    data = bytes(pending[start:cut])
                    source, reported = counter.count - reported, counter.count
                    yield Chunk(path, kind, data, first_line=line, source_bytes=source)
                    line += data.count(b"\n")
                    start = cut
                del pending[:start]
                searched = max(searched - start, 0)
        finally:
            stream.close()
        if counter.count > reported:
            yield Chunk(path, kind, b"", first_line=line, source_bytes=counter.count - reported)


def iter_chunks(path: str, options: ReadOptions) -> Iterator[Chunk]:
    """The work chunks of one input file, in document order.

    Raises:
        ValueError: the file's format is unknown.
        DataFormatError: a compressed file is corrupt, or a parquet file has no such column.
    """
    fmt = detect_format(path)
    if fmt == "parquet":
        parquet = _open_parquet(path)
        _check_column(parquet, path, options.column)
        metadata = parquet.metadata
        for group in range(metadata.num_row_groups):
            row_group = metadata.row_group(group)
            yield Chunk(
                path,
                "parquet",
                first_line=sum(metadata.row_group(g).num_rows for g in range(group)),
                row_group=group,
                source_bytes=sum(
                    int(row_group.column(column).total_compressed_size)
                    for column in range(row_group.num_columns)
                ),
            )
    elif fmt == "txt" and options.txt_mode == "file":
        with open_regular_file(path) as stream:
            data = stream.read(options.max_record_bytes + 1)
        if len(data) > options.max_record_bytes:
            raise _record_too_long(path, 1, options.max_record_bytes)
        yield Chunk(path, "text", data, source_bytes=len(data))
    else:
        kind = "lines" if fmt == "txt" else "jsonl"
        yield from _line_chunks(path, fmt, kind, options)


def _record_too_long(path: str, line: int, limit: int) -> DataFormatError:
    return DataFormatError(
        f"{path}: line {line} is longer than {limit} bytes (max_record_bytes); a record that "
        "large is refused before it is held in memory (raise ReadOptions.max_record_bytes if "
        "it is meant)"
    )


def _check_ratio(path: str, fmt: str, output: int, read: int, options: ReadOptions) -> None:
    """DataFormatError for a decompression bomb: more than `max_decompression_ratio` times
    the compressed bytes read, once the output passes the grace size."""
    if output > _RATIO_GRACE_BYTES and output > options.max_decompression_ratio * max(read, 1):
        raise DataFormatError(
            f"{path}: {fmt} decompresses to more than {options.max_decompression_ratio:g} times "
            f"its size ({output} bytes out of {read}); refusing it as a decompression bomb "
            "(raise ReadOptions.max_decompression_ratio if it is meant)"
        )


def _open_parquet(path: str) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as error:
        raise DataFormatError(f"{path}: not a parquet file: {error}") from error


def _check_column(parquet: Any, path: str, column: str) -> None:
    import pyarrow as pa

    schema = parquet.schema_arrow
    if schema.names.count(column) > 1:
        raise DataFormatError(
            f"{path}: {schema.names.count(column)} columns are named {column!r}; which one holds "
            "the text is ambiguous"
        )
    if column not in schema.names:
        raise DataFormatError(
            f"{path}: no column {column!r}; columns are {schema.names} (choose one with --column)"
        )
    field_type = schema.field(column).type
    if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):
        raise DataFormatError(f"{path}: column {column!r} has type {field_type}, expected string")


def _decode(data: bytes, path: str, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataFormatError(
            f"{path}: {where}: invalid UTF-8 at byte {error.start}: {data[error.start : error.start + 8]!r}"
        ) from error


def _refuse_repeated_key(raw: bytes, key: str, path: str, number: int) -> None:
    """DataFormatError if the JSON object `raw` holds the member `key` more than once at its
    top level (json.loads keeps the last, silently; which text was meant is ambiguous)."""
    top: list[list[tuple[str, Any]]] = []

    def record_pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        top[:] = [items]  # objects are built inside out: the last one is the top level
        return dict(items)

    json.loads(raw, object_pairs_hook=record_pairs)
    if top and sum(1 for name, _ in top[0] if name == key) > 1:
        raise DataFormatError(
            f"{path}: line {number}: the key {key!r} appears more than once in the record; "
            "which text is meant is ambiguous"
        )


def parse_chunk(chunk: Chunk, options: ReadOptions) -> list[str]:
    """The documents of a chunk.

    Raises:
        DataFormatError: a line is not a JSON object, lacks the key, holds a non-string, or the
            text is not UTF-8; a parquet value is null.
    """
    path = chunk.path
    if chunk.kind == "text":
        return [_decode(chunk.data, path, "file")]
    if chunk.kind == "parquet":
        parquet = _open_parquet(path)
        _check_column(parquet, path, options.column)
        values = parquet.read_row_group(chunk.row_group, columns=[options.column]).column(0)
        if values.null_count:
            first = next(i for i, value in enumerate(values.is_null().to_pylist()) if value)
            raise DataFormatError(
                f"{path}: row {chunk.first_line + first}: column {options.column!r} is null"
            )
        texts: list[str] = values.to_pylist()
        return texts
    documents: list[str] = []
    key = options.json_key
    for number, raw in enumerate(chunk.data.split(b"\n"), start=chunk.first_line):
        if chunk.kind == "lines":
            if raw.endswith(b"\r"):
                raw = raw[:-1]
            if raw:
                documents.append(_decode(raw, path, f"line {number}"))
            continue
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except UnicodeDecodeError as error:
            raise DataFormatError(f"{path}: line {number}: invalid UTF-8: {error}") from error
        except ValueError as error:
            raise DataFormatError(
                f"{path}: line {number}: invalid JSON ({error}): {raw[:60]!r}"
            ) from error
        if not isinstance(record, dict):
            raise DataFormatError(
                f"{path}: line {number}: expected a JSON object, got {type(record).__name__}"
            )
        if raw.count(json.dumps(key).encode()) > 1:
            _refuse_repeated_key(raw, key, path, number)
        if key not in record:
            raise DataFormatError(
                f"{path}: line {number}: no key {key!r}; keys are {sorted(record)[:10]} "
                "(choose one with --json-key)"
            )
        text = record[key]
        if not isinstance(text, str):
            raise DataFormatError(
                f"{path}: line {number}: {key!r} must be a string, got "
                f"{type(text).__name__} {str(text)[:40]!r}"
            )
        if b"\\ud" in raw.lower():  # a \uD800-\uDFFF escape: maybe a lone surrogate
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise DataFormatError(
                    f"{path}: line {number}: {key!r} holds a lone surrogate "
                    f"{text[error.start]!r} at character {error.start} (not encodable as "
                    "UTF-8; an unpaired \\uD8xx-\\uDFxx escape)"
                ) from None
        documents.append(text)
    return documents


def read_documents(
    path: str | os.PathLike[str], options: ReadOptions | None = None
) -> Iterator[str]:
    """Stream the documents of one input file (any known format).

    Raises:
        DataFormatError: see :func:`parse_chunk`.
    """
    options = options or ReadOptions()
    for chunk in iter_chunks(os.fspath(path), options):
        yield from parse_chunk(chunk, options)


def file_identity(path: str) -> dict[str, Any]:
    """Size and modification time of a file: what marks a completed part as stale."""
    status = Path(path).stat()
    return {"path": path, "size": status.st_size, "mtime_ns": status.st_mtime_ns}
