"""Encoding one chunk of documents: tokenizer ids to flat arrays, in the tokenize workers.

A worker (a process for the reference backends, a thread for gigatoken, or the parent with
``workers=0``) reads a chunk of an input file, encodes its documents in one call, adds BOS/EOD,
splits documents longer than ``window`` tokens into overlapping windows and returns one flat
token array with per-sequence and per-document counts, ready for
``IndexedDatasetBuilder.add_documents``. The pipeline (:mod:`tokenmill.tokenize.pipeline`)
decides which chunks go where and writes the results in order.

Two routes, the same output:

* reference backends: the chunk is parsed into strings (:func:`~tokenmill.tokenize.readers.
  parse_chunk`) and encoded with ``encode_batch`` (one array per document);
* gigatoken (a tokenizer with ``encode_packed``): the chunk is packed by the C++ readers
  (:mod:`tokenmill.tokenize.packed_text`) and encoded at once into one token buffer plus
  offsets, which :func:`shape_documents` turns into the output with a few vectorised passes
  (no per-document Python work unless windows are asked for).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy
import numpy.typing as npt

from tokenmill.tokenize.readers import Chunk, ReadOptions, parse_chunk
from tokenmill.tokenize.tokenizers import Tokenizer, TokenizerSpec

__all__ = [
    "EncodeOptions",
    "Encoded",
    "Encoder",
    "InlineExecutor",
    "encode_documents",
    "encode_in_worker",
    "initialize_worker",
    "process_context",
    "shape_documents",
    "window_bounds",
]


def window_bounds(length: int, window: int, overlap: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` windows of a sequence of ``length`` tokens.

    Windows hold at most ``window`` tokens; each starts ``overlap`` tokens before the previous
    one ended (GPT-Simple's rule), the last one ends at ``length``. A sequence that fits is one
    window; an empty one has none.

    Raises:
        ValueError: ``window < 1``, ``overlap < 0`` or ``overlap > window // 2``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not 0 <= overlap <= window // 2:
        raise ValueError(f"overlap must be in [0, window // 2 = {window // 2}], got {overlap}")
    bounds: list[tuple[int, int]] = []
    start = 0
    while start < length:
        end = min(start + window, length)
        bounds.append((start, end))
        if end == length:
            break
        start = end - overlap
    return bounds


@dataclass(frozen=True)
class EncodeOptions:
    """What a worker needs besides the tokenizer: how to read and how to shape documents."""

    read: ReadOptions
    dtype: str
    vocab_size: int
    bos_id: int | None
    eod_id: int | None
    prepend_bos: bool = False
    append_eod: bool = True
    window: int | None = None
    overlap: int = 0


@dataclass
class Encoded:
    """The encoded documents of one chunk, ready for ``IndexedDatasetBuilder.add_documents``."""

    tokens: npt.NDArray[Any]
    sequence_lengths: npt.NDArray[numpy.int64]
    sequences_per_document: npt.NDArray[numpy.int64]
    text_bytes: int
    source_bytes: int = 0
    unicode17_documents: int = 0

    @property
    def documents(self) -> int:
        """The number of documents."""
        return int(self.sequences_per_document.shape[0])


def encode_documents(
    texts: list[str], tokenizer: Tokenizer, options: EncodeOptions, where: str = "input"
) -> Encoded:
    """Encode documents into flat tokens with per-sequence and per-document counts.

    Raises:
        ValueError: the tokenizer produced an id outside its vocabulary.
    """
    arrays = tokenizer.encode_batch(texts) if texts else []
    for array in arrays:
        if array.shape[0] and (int(array.max()) >= options.vocab_size or int(array.min()) < 0):
            raise ValueError(
                f"{where}: tokenizer {tokenizer.describe()} produced id {int(array.max())}, "
                f"outside its vocabulary of {options.vocab_size}"
            )
    tokens, lengths, per_document = _shape_arrays(arrays, options, numpy.dtype(options.dtype))
    return Encoded(
        tokens=tokens,
        sequence_lengths=lengths,
        sequences_per_document=per_document,
        text_bytes=sum(len(text.encode("utf-8")) for text in texts),
    )


def _shape_arrays(
    arrays: list[npt.NDArray[Any]], options: EncodeOptions, dtype: numpy.dtype[Any]
) -> tuple[npt.NDArray[Any], npt.NDArray[numpy.int64], npt.NDArray[numpy.int64]]:
    """BOS/EOD and windows over one id array per document (ids already checked)."""
    bos = [options.bos_id] if options.prepend_bos else []
    eod = [options.eod_id] if options.append_eod else []
    extra = len(bos) + len(eod)
    # first pass: the sequence lengths, so the output is allocated once
    lengths: list[int] = []
    per_document: list[int] = []
    layouts: list[list[tuple[int, int]] | None] = []
    for array in arrays:
        size = int(array.shape[0])
        if size == 0:  # megatron's preprocess_data.py: no tokens, no EOD, no sequence
            per_document.append(0)
            layouts.append(None)
            continue
        count = size + extra
        if options.window is None or count <= options.window:
            lengths.append(count)
            per_document.append(1)
            layouts.append(None)
        else:
            windows = window_bounds(count, options.window, options.overlap)
            lengths.extend(end - begin for begin, end in windows)
            per_document.append(len(windows))
            layouts.append(windows)
    tokens = numpy.empty(sum(lengths), dtype=dtype)
    position = 0
    for array, bounds in zip(arrays, layouts):
        size = int(array.shape[0])
        if size == 0:
            continue
        if bounds is None:
            if bos:
                tokens[position] = bos[0]
            tokens[position + len(bos) : position + len(bos) + size] = array
            if eod:
                tokens[position + len(bos) + size] = eod[0]
            position += size + extra
            continue
        document = numpy.concatenate(
            [numpy.asarray(bos, dtype=dtype), array.astype(dtype), numpy.asarray(eod, dtype=dtype)]
        )
        for begin, end in bounds:
            tokens[position : position + end - begin] = document[begin:end]
            position += end - begin
    return (
        tokens,
        numpy.asarray(lengths, dtype=numpy.int64),
        numpy.asarray(per_document, dtype=numpy.int64),
    )


def shape_documents(
    content: npt.NDArray[Any],
    offsets: npt.NDArray[numpy.int64],
    options: EncodeOptions,
    where: str = "input",
    name: str = "tokenizer",
) -> tuple[npt.NDArray[Any], npt.NDArray[numpy.int64], npt.NDArray[numpy.int64]]:
    """:func:`encode_documents`'s shaping for ids given as one buffer plus offsets.

    Document ``i`` has ids ``content[offsets[i]:offsets[i + 1]]``. Returns the flat tokens (with
    BOS/EOD, in the options' dtype), the sequence lengths and the sequences per document, equal
    to what :func:`encode_documents` makes of the same ids. Without windows (or when no
    document needs one) it is a few vectorised passes over the tokens.

    Raises:
        ValueError: an id is outside the vocabulary.
    """
    dtype = numpy.dtype(options.dtype)
    if content.shape[0] and int(content.max()) >= options.vocab_size:
        raise ValueError(
            f"{where}: tokenizer {name} produced id {int(content.max())}, outside its "
            f"vocabulary of {options.vocab_size}"
        )
    lengths = numpy.diff(offsets)
    nonempty = lengths > 0
    has_bos = options.prepend_bos and options.bos_id is not None
    has_eod = options.append_eod and options.eod_id is not None
    extra = int(has_bos) + int(has_eod)
    sequence_lengths = lengths[nonempty] + extra
    if (
        options.window is not None
        and sequence_lengths.shape[0]
        and int(sequence_lengths.max()) > options.window
    ):
        arrays = [content[offsets[i] : offsets[i + 1]] for i in range(lengths.shape[0])]
        return _shape_arrays(arrays, options, dtype)
    per_document = nonempty.astype(numpy.int64)
    if extra == 0:
        return content.astype(dtype), sequence_lengths, per_document
    total = int(content.shape[0]) + extra * int(sequence_lengths.shape[0])
    tokens = numpy.empty(total, dtype=dtype)
    starts = numpy.cumsum(sequence_lengths) - sequence_lengths
    keep = numpy.ones(total, dtype=bool)
    if has_bos:
        keep[starts] = False
    if has_eod:
        keep[starts + sequence_lengths - 1] = False
    tokens[keep] = content
    if has_bos:
        tokens[starts] = options.bos_id
    if has_eod:
        tokens[starts + sequence_lengths - 1] = options.eod_id
    return tokens, sequence_lengths, per_document


class Encoder:
    """A loaded tokenizer plus options: turns a chunk into an :class:`Encoded`.

    Thread-safe when the tokenizer is (gigatoken's encodes run on the calling thread and share
    nothing mutable), so the pipeline shares one between its threads.
    """

    def __init__(
        self, spec: TokenizerSpec, options: EncodeOptions, tokenizer: Tokenizer | None = None
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else spec.load()
        self.options = options
        self._encode_packed = getattr(self.tokenizer, "encode_packed", None)

    def __call__(self, chunk: Chunk) -> Encoded:
        if self._encode_packed is not None:
            encoded = self._encode_fast(chunk)
        else:
            texts = parse_chunk(chunk, self.options.read)
            encoded = encode_documents(texts, self.tokenizer, self.options, chunk.path)
        encoded.source_bytes = chunk.source_bytes
        return encoded

    def _encode_fast(self, chunk: Chunk) -> Encoded:
        from tokenmill.tokenize.packed_text import pack_chunk

        assert self._encode_packed is not None
        packed = pack_chunk(chunk, self.options.read)
        content, offsets, unicode17 = self._encode_packed(packed)
        tokens, lengths, per_document = shape_documents(
            content, offsets, self.options, chunk.path, self.tokenizer.describe()
        )
        return Encoded(
            tokens=tokens,
            sequence_lengths=lengths,
            sequences_per_document=per_document,
            text_bytes=packed.text_bytes,
            unicode17_documents=unicode17,
        )


_WORKER_ENCODER: Encoder | None = None


def initialize_worker(
    spec: TokenizerSpec, options: EncodeOptions, parent: int | None = None
) -> None:
    """The initializer of a worker process: exit with the job (`parent`'s pid), load the
    tokenizer once."""
    from tokenmill.common.ownership import die_with_parent

    die_with_parent(parent)
    # one process per core: the tokenizers' own thread pools would only oversubscribe
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    global _WORKER_ENCODER
    _WORKER_ENCODER = Encoder(spec, options)


def encode_in_worker(chunk: Chunk) -> Encoded:
    """The task of a worker process: encode one chunk with the worker's tokenizer."""
    if _WORKER_ENCODER is None:  # pragma: no cover - the initializer always runs first
        raise RuntimeError("worker was not initialized")
    return _WORKER_ENCODER(chunk)


class InlineExecutor:
    """The executor interface, running each task at once in this process (``workers=0``)."""

    def __init__(self, encoder: Encoder) -> None:
        self._encoder = encoder

    def submit(self, function: Callable[[Chunk], Encoded], chunk: Chunk) -> Future[Encoded]:
        del function
        future: Future[Encoded] = Future()
        try:
            future.set_result(self._encoder(chunk))
        except BaseException as error:
            future.set_exception(error)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        del wait, cancel_futures


def process_context() -> Any:
    """The start method of the worker processes.

    fork while no other Python thread runs, on Python < 3.12: fast, and it works from any
    ``__main__`` (stdin, notebooks). Otherwise forkserver (Python 3.12 warns about forking a
    process with threads, and numpy's BLAS pool counts): its workers import what they need, so
    a script that starts a run must guard it with ``if __name__ == "__main__":``.
    """
    import multiprocessing
    import sys
    import threading

    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and sys.version_info < (3, 12) and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
