"""Stream parquet text into fixed ``B x T`` token batches (nanochat's loader), with exact resume.

Algorithm (nanochat's ``tokenizing_distributed_data_loader``, made exactly resumable):

* The readers are the ``world_size x num_workers`` (rank, DataLoader worker) pairs; reader
  ``slot = rank * num_workers + worker`` reads row groups ``slot, slot + S, slot + 2S, ...``
  of every file in order (``S`` = number of readers), so readers never share a row group.
* Each reader splits its row groups into batches of ``tokenizer_batch_size`` documents and
  tokenizes them on ``threads`` background threads (up to ``2 * threads`` batches ahead;
  HF tokenizers and tiktoken release the GIL), prepending BOS to every document.
* Tokens go into a buffer; every ``B * T + 1`` tokens become one batch:
  ``inputs = tokens[:-1].view(B, T)``, ``targets = tokens[1:].view(B, T)`` (int64), and all
  ``B * T + 1`` tokens are consumed, as in nanochat. With ``loop=True`` (the default) a reader
  starts over at the first file when it reaches the end, counting epochs; otherwise it stops and
  drops its last partial batch.
* The position of a reader is the first token not yet in a delivered batch:
  ``(epoch, file, row_group, document, token)``. :class:`ParquetTokenLoader` records the
  position of every reader as batches reach the caller, plus which reader comes next in the
  DataLoader's round robin; ``load_state_dict`` restarts every reader at its position (re-reading
  the row group, re-tokenizing the document and skipping ``token`` tokens) and rotates the
  worker-to-reader assignment so the round robin continues with the right reader. The batches
  after a resume are therefore exactly those the uninterrupted run would have produced: no
  document is skipped or repeated. Resuming needs the same files, ``B``, ``T``, world size and
  worker count (checked).

Batches land in pinned memory when CUDA is available (the DataLoader's ``pin_memory``), plain
memory otherwise. Memory per reader: one row group's text plus ``2 * threads`` tokenized batches.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy
import numpy.typing as npt
import torch

from tokenmill.errors import DataFormatError
from tokenmill.tokenize.tokenizers import Tokenizer, TokenizerSpec

__all__ = ["ParquetTokenLoader", "ParquetTokenStream"]

Position = tuple[int, int, int, int, int]  # epoch, file, row group, document, token
_POSITION_KEYS = ("epoch", "file", "row_group", "document", "token")


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        from tokenmill.tokenize.pipeline import resolve_rank

        return resolve_rank(rank, world_size)
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_rank()), int(distributed.get_world_size())
    from tokenmill.tokenize.pipeline import resolve_rank

    return resolve_rank(rank, world_size)


class ParquetTokenStream(torch.utils.data.IterableDataset):  # type: ignore[misc]
    """The per-reader token streams behind :class:`ParquetTokenLoader`.

    Yields ``(inputs, targets, reader, position)``: two ``[B, T]`` int64 tensors, the reader's
    index within this rank, and its position after the batch (a dict). Use it directly only
    through the loader, which turns positions into a ``state_dict``.

    Args:
        files: parquet files, read in this order.
        batch_size: B.
        sequence_length: T.
        tokenizer: the tokenizer spec (loaded once per process).
        column: the text column.
        tokenizer_batch_size: documents per encode call.
        threads: background tokenizer threads per reader.
        num_workers: the DataLoader workers this stream will run in (0: the main process).
        rank: this rank; None: from torch.distributed, else RANK, else 0.
        world_size: the number of ranks; None: likewise.
        loop: start over at the end (epochs); False: stop after one pass.

    Raises:
        FileNotFoundError: a file is missing.
        DataFormatError: a file is not parquet or lacks the column.
        ValueError: a size is not positive, the tokenizer has no BOS, or some reader would get
            no row group at all.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]],
        batch_size: int,
        sequence_length: int,
        tokenizer: TokenizerSpec,
        column: str = "text",
        tokenizer_batch_size: int = 128,
        threads: int = 4,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        loop: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch_size", batch_size),
            ("sequence_length", sequence_length),
            ("tokenizer_batch_size", tokenizer_batch_size),
            ("threads", threads),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not files:
            raise ValueError("files must name at least one parquet file")
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.files = [os.path.abspath(os.fspath(path)) for path in files]
        self.row_groups: list[int] = []
        for path in self.files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"parquet file not found: {path}")
            try:
                parquet = pq.ParquetFile(path)
            except Exception as error:
                raise DataFormatError(f"{path}: not a parquet file: {error}") from error
            schema = parquet.schema_arrow
            if column not in schema.names:
                raise DataFormatError(f"{path}: no column {column!r}; columns are {schema.names}")
            kind = schema.field(column).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise DataFormatError(f"{path}: column {column!r} has type {kind}, expected string")
            self.row_groups.append(parquet.metadata.num_row_groups)
        self.batch_size = batch_size
        self.sequence_length = sequence_length
        self.tokenizer = tokenizer
        self.column = column
        self.tokenizer_batch_size = tokenizer_batch_size
        self.threads = threads
        self.num_workers = num_workers
        self.rank, self.world_size = _world(rank, world_size)
        self.loop = loop
        self.readers_per_rank = max(1, num_workers)
        self.readers = self.world_size * self.readers_per_rank
        if max(self.row_groups) < self.readers:
            raise ValueError(
                f"{self.readers} readers ({self.world_size} ranks x {self.readers_per_rank} "
                f"workers) but the largest file has {max(self.row_groups)} row groups; every "
                "reader needs at least one (write smaller row groups or use fewer workers)"
            )
        self.start_positions: dict[int, Position] = {}
        self.shift = 0

    def identity(self) -> dict[str, Any]:
        """What a saved state must match to be resumed here."""
        files = hashlib.sha256(json.dumps(self.files).encode()).hexdigest()[:16]
        return {
            "files": files,
            "row_groups": list(self.row_groups),
            "batch_size": self.batch_size,
            "sequence_length": self.sequence_length,
            "world_size": self.world_size,
            "readers_per_rank": self.readers_per_rank,
            "column": self.column,
        }

    def _document_batches(
        self, slot: int, start: Position | None
    ) -> Iterator[tuple[Position, list[str]]]:
        import pyarrow.parquet as pq

        epoch, first_file, first_group, first_document, _ = start or (0, 0, slot, 0, 0)
        resuming = start is not None
        while True:
            documents = 0
            for file in range(first_file if resuming else 0, len(self.files)):
                parquet: Any = None
                for group in range(slot, self.row_groups[file], self.readers):
                    document = 0
                    if resuming:
                        if (file, group) < (first_file, first_group):
                            continue
                        document = (
                            first_document if (file, group) == (first_file, first_group) else 0
                        )
                        resuming = False
                    if parquet is None:
                        parquet = pq.ParquetFile(self.files[file])
                    table = parquet.read_row_group(group, columns=[self.column])
                    texts: list[str | None] = table.column(0).to_pylist()
                    for row, text in enumerate(texts):
                        if text is None:
                            raise DataFormatError(
                                f"{self.files[file]}: row group {group}, row {row}: column "
                                f"{self.column!r} is null"
                            )
                    documents += len(texts)
                    step = self.tokenizer_batch_size
                    for begin in range(document, len(texts), step):
                        batch = [str(text) for text in texts[begin : begin + step]]
                        yield (epoch, file, group, begin, 0), batch
            resuming = False
            if not self.loop:
                return
            if documents == 0:
                raise ValueError(f"reader {slot} found no documents in a whole epoch")
            epoch += 1

    def _encode(self, tokenizer: Tokenizer, texts: list[str]) -> list[npt.NDArray[numpy.int64]]:
        bos = tokenizer.bos_id
        encoded = tokenizer.encode_batch(texts)
        out = []
        for array in encoded:
            tokens = numpy.empty(array.shape[0] + 1, dtype=numpy.int64)
            tokens[0] = bos
            tokens[1:] = array
            out.append(tokens)
        return out

    def reader_batches(
        self, slot: int, start: Position | None
    ) -> Iterator[tuple[npt.NDArray[numpy.int64], Position]]:
        """The flat ``B * T + 1`` token batches of one reader and its position after each.

        Args:
            slot: the global reader index (``rank * readers_per_rank + worker``).
            start: the position to start from (None: the beginning).
        """
        tokenizer = self.tokenizer.load()
        if tokenizer.bos_id is None:
            raise ValueError(f"tokenizer {tokenizer.describe()} has no BOS token to prepend")
        need = self.batch_size * self.sequence_length + 1
        skip_tokens = start[4] if start is not None else 0
        source = self._document_batches(slot, start)
        pending: deque[tuple[Position, Future[list[npt.NDArray[numpy.int64]]]]] = deque()
        # the buffer: [position of the document, its tokens, tokens already consumed]
        pieces: deque[list[Any]] = deque()
        buffered = 0
        exhausted = False
        with ThreadPoolExecutor(self.threads, thread_name_prefix="tokenmill-tokenize") as pool:
            try:
                while True:
                    while buffered < need:
                        while not exhausted and len(pending) < 2 * self.threads:
                            try:
                                position, texts = next(source)
                            except StopIteration:
                                exhausted = True
                                break
                            pending.append((position, pool.submit(self._encode, tokenizer, texts)))
                        if not pending:
                            return
                        (epoch, file, group, begin, _), future = pending.popleft()
                        for index, tokens in enumerate(future.result()):
                            offset = skip_tokens if skip_tokens else 0
                            skip_tokens = 0
                            pieces.append([(epoch, file, group, begin + index, 0), tokens, offset])
                            buffered += tokens.shape[0] - offset
                    out = numpy.empty(need, dtype=numpy.int64)
                    filled = 0
                    last: Position = (0, 0, 0, 0, 0)
                    while filled < need:
                        piece = pieces[0]
                        tokens, offset = piece[1], piece[2]
                        take = min(need - filled, tokens.shape[0] - offset)
                        out[filled : filled + take] = tokens[offset : offset + take]
                        filled += take
                        piece[2] = offset + take
                        last = piece[0]
                        if piece[2] == tokens.shape[0]:
                            pieces.popleft()
                    buffered -= need
                    if pieces:
                        epoch, file, group, document, _ = pieces[0][0]
                        after: Position = (epoch, file, group, document, int(pieces[0][2]))
                    else:
                        epoch, file, group, document, _ = last
                        after = (epoch, file, group, document + 1, 0)
                    yield out, after
            finally:
                for _, future in pending:
                    future.cancel()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, dict[str, int]]]:
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else int(info.id)
        if info is not None and int(info.num_workers) != self.readers_per_rank:
            raise ValueError(
                f"the stream was built for num_workers={self.num_workers} but runs in a "
                f"DataLoader with {info.num_workers} workers"
            )
        local = (worker + self.shift) % self.readers_per_rank
        slot = self.rank * self.readers_per_rank + local
        shape = (self.batch_size, self.sequence_length)
        for tokens, after in self.reader_batches(slot, self.start_positions.get(local)):
            flat = torch.from_numpy(tokens)
            position = dict(zip(_POSITION_KEYS, after))
            yield flat[:-1].view(shape), flat[1:].view(shape), local, position


class ParquetTokenLoader:
    """Fixed ``[B, T]`` (inputs, targets) batches from parquet text, exactly resumable.

    See the module docstring for the algorithm. Iterate it for batches; ``state_dict()`` after
    any batch and ``load_state_dict()`` on a fresh loader continue with exactly the next batch.

    Args:
        files: parquet files.
        batch_size: B.
        sequence_length: T.
        tokenizer: a :class:`TokenizerSpec` (or ``"bytes"``, a ``tokenizer.json``, a
            ``.tiktoken`` path).
        column: the text column.
        tokenizer_batch_size: documents per encode call.
        threads: tokenizer threads per reader.
        num_workers: DataLoader worker processes (each one reader).
        rank: this rank; None: torch.distributed, else ``RANK``, else 0.
        world_size: the number of ranks; None: likewise.
        loop: run epochs forever (nanochat); False: one pass.
        pin_memory: pin batches; None: when CUDA is available.
        multiprocessing_context: passed to the DataLoader when ``num_workers > 0``.
        device: move each batch there (``non_blocking`` from pinned memory), e.g. "cuda";
            None: leave it in host memory.

    Raises:
        See :class:`ParquetTokenStream`.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]],
        batch_size: int,
        sequence_length: int,
        tokenizer: TokenizerSpec | str = "bytes",
        column: str = "text",
        tokenizer_batch_size: int = 128,
        threads: int = 4,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        loop: bool = True,
        pin_memory: bool | None = None,
        multiprocessing_context: str | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        spec = tokenizer if isinstance(tokenizer, TokenizerSpec) else TokenizerSpec.parse(tokenizer)
        self.stream = ParquetTokenStream(
            files,
            batch_size,
            sequence_length,
            spec,
            column=column,
            tokenizer_batch_size=tokenizer_batch_size,
            threads=threads,
            num_workers=num_workers,
            rank=rank,
            world_size=world_size,
            loop=loop,
        )
        self.num_workers = num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.multiprocessing_context = multiprocessing_context
        self.device = None if device is None else torch.device(device)
        self._positions: dict[int, dict[str, int]] = {}
        self._next_reader = 0
        self._batches = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        stream = self.stream
        stream.start_positions = {
            reader: tuple(position[key] for key in _POSITION_KEYS)  # type: ignore[misc]
            for reader, position in self._positions.items()
        }
        stream.shift = self._next_reader
        loader = torch.utils.data.DataLoader(
            stream,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            multiprocessing_context=self.multiprocessing_context if self.num_workers else None,
        )
        for inputs, targets, reader, position in loader:
            self._positions[int(reader)] = {key: int(position[key]) for key in _POSITION_KEYS}
            self._next_reader = (int(reader) + 1) % stream.readers_per_rank
            self._batches += 1
            if self.device is not None:
                inputs = inputs.to(self.device, non_blocking=self.pin_memory)
                targets = targets.to(self.device, non_blocking=self.pin_memory)
            yield inputs, targets

    def state_dict(self) -> dict[str, Any]:
        """The position of every reader of this rank after the last batch delivered."""
        return {
            "version": 1,
            "identity": self.stream.identity(),
            "rank": self.stream.rank,
            "batches": self._batches,
            "next_reader": self._next_reader,
            "positions": {str(reader): dict(p) for reader, p in sorted(self._positions.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``: the next batch is the one that would have followed.

        Raises:
            ValueError: the state is from another version, rank, file list, batch shape or
                reader layout (names the field and both values).
        """
        if state.get("version") != 1:
            raise ValueError(f"state_dict version must be 1, got {state.get('version')!r}")
        identity = self.stream.identity()
        saved = state.get("identity", {})
        for key, value in identity.items():
            if saved.get(key) != value:
                raise ValueError(
                    f"cannot resume: state_dict has {key}={saved.get(key)!r} but this loader has "
                    f"{key}={value!r}"
                )
        if state.get("rank") != self.stream.rank:
            raise ValueError(
                f"cannot resume: state_dict is rank {state.get('rank')!r}'s, this is rank "
                f"{self.stream.rank}"
            )
        positions: dict[int, dict[str, int]] = {}
        for reader, position in state.get("positions", {}).items():
            if set(position) != set(_POSITION_KEYS):
                raise ValueError(f"state_dict position of reader {reader} is malformed: {position}")
            positions[int(reader)] = {key: int(position[key]) for key in _POSITION_KEYS}
        self._positions = positions
        self._next_reader = int(state.get("next_reader", 0))
        self._batches = int(state.get("batches", 0))
