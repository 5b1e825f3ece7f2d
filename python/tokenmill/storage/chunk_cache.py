"""A bounded LRU cache of aligned chunks of one remote object, with background prefetch.

The object is cut into chunks ``[k * C, min((k + 1) * C, size))`` for a chunk size C. A read of
``[offset, offset + n)`` needs chunks ``offset // C`` to ``(offset + n - 1) // C``; cached chunks
are copied out, chunks another thread is already fetching are waited for, and each run of
consecutive missing chunks is fetched with ONE ranged request. At most ``capacity // C`` chunks
(at least one) are kept; the least recently used goes first.

Prefetch: :meth:`ChunkCache.prefetch` takes byte ranges a caller knows it will read next (a
GPTDataset knows its shuffle order) and fetches their missing chunks on a small thread pool, at
most half the capacity ahead so prefetched chunks do not evict each other before use. A read that
needs a chunk being prefetched waits for that request instead of issuing a second one.

Compared with megatron-core's S3 reader (one 256 MiB chunk per reader, replaced on every miss):
random reads over a file larger than one chunk keep their working set, and one read never
downloads more than the chunks it touches. With ``capacity_bytes=0`` the cache is off: every read
is one ranged request for exactly its bytes (the baseline of ``benchmarks/bench_s3.py``).

Invariants (tests/test_s3_storage.py checks them against a local reference over random reads):
every read returns exactly the object's bytes; the cache never holds more than its chunk budget;
no two requests for the same chunk are in flight at once.

Thread-safe; after a fork the child starts with a fresh lock and thread pool (the chunks already
cached are kept, they are immutable ``bytes``).

Why not a library: fsspec's block caches (what s3fs files use) fetch missing blocks one request
each and cannot be told which ranges come next; here a run of missing chunks is one request and
the dataset's shuffle order drives the prefetch. It is ~300 lines over tokenmill's S3 client.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["CacheStats", "ChunkCache"]

Fetch = Callable[[int, int], bytes]
"""``fetch(start, stop)`` returns the object's bytes ``[start, stop)``."""


@dataclass
class CacheStats:
    """Counters of one cache (updated under its lock)."""

    requests: int = 0
    """Ranged requests issued (demand and prefetch)."""
    bytes_fetched: int = 0
    chunk_hits: int = 0
    """Chunks a read found cached (or in flight from a prefetch)."""
    chunk_misses: int = 0
    """Chunks a read had to fetch itself."""
    prefetched_chunks: int = 0
    evictions: int = 0


class ChunkCache:
    """LRU of aligned chunks over ``fetch``; see the module docstring.

    Args:
        fetch: returns bytes ``[start, stop)`` of the object (retries are its business).
        object_size: the object's size in bytes.
        chunk_bytes: the chunk size C (> 0).
        capacity_bytes: the total size of cached chunks (0: no cache, every read is one request).
        prefetch_threads: threads of the prefetch pool (0: prefetch is a no-op).
        name: the object's name, for error messages.

    Raises:
        ValueError: a size is out of range.
    """

    def __init__(
        self,
        fetch: Fetch,
        object_size: int,
        *,
        chunk_bytes: int,
        capacity_bytes: int,
        prefetch_threads: int = 4,
        name: str = "object",
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"{name}: chunk_bytes must be > 0, got {chunk_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"{name}: capacity_bytes must be >= 0, got {capacity_bytes}")
        if prefetch_threads < 0:
            raise ValueError(f"{name}: prefetch_threads must be >= 0, got {prefetch_threads}")
        if object_size < 0:
            raise ValueError(f"{name}: object_size must be >= 0, got {object_size}")
        self.fetch = fetch
        self.object_size = object_size
        self.chunk_bytes = chunk_bytes
        self.capacity_bytes = capacity_bytes
        self.max_chunks = max(1, capacity_bytes // chunk_bytes) if capacity_bytes else 0
        self.prefetch_threads = prefetch_threads
        self.name = name
        self.stats = CacheStats()
        self._chunks: OrderedDict[int, bytes] = OrderedDict()
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[bytes]] = {}
        self._executor: ThreadPoolExecutor | None = None

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            # forked: the parent's threads and any lock they held do not exist here
            self._reset_process_state()

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        for name in ("_lock", "_pending", "_executor", "_pid"):
            state.pop(name, None)
        state["_chunks"] = OrderedDict()
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    # -- geometry ---------------------------------------------------------------------------

    def _chunk_span(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.object_size)

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.object_size:
            raise ValueError(
                f"{self.name}: byte range [{offset}, {offset + length}) is outside the "
                f"{self.object_size}-byte object"
            )

    # -- the LRU (callers hold the lock) ----------------------------------------------------

    def _store(self, index: int, data: bytes) -> None:
        chunks = self._chunks
        chunks[index] = data
        chunks.move_to_end(index)
        while len(chunks) > self.max_chunks:
            chunks.popitem(last=False)
            self.stats.evictions += 1

    def _finish(self, index: int, future: Future[bytes], data: bytes | None) -> None:
        with self._lock:
            if self._pending.get(index) is future:
                del self._pending[index]
            if data is not None:
                self._store(index, data)

    # -- reading ----------------------------------------------------------------------------

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` (a writable byte buffer) with bytes ``[offset, offset + len(out))``.

        Raises:
            ValueError: the range is outside the object.
            Exception: whatever ``fetch`` raises once its retries are spent.
        """
        length = out.nbytes
        self._check_range(offset, length)
        if length == 0:
            return
        self._check_process()
        if not self.max_chunks:
            data = self.fetch(offset, offset + length)
            with self._lock:
                self.stats.requests += 1
                self.stats.bytes_fetched += len(data)
            out[:] = data
            return
        first = offset // self.chunk_bytes
        last = (offset + length - 1) // self.chunk_bytes
        have: dict[int, bytes] = {}
        waiting: dict[int, Future[bytes]] = {}
        owned: dict[int, Future[bytes]] = {}
        with self._lock:
            for index in range(first, last + 1):
                cached = self._chunks.get(index)
                if cached is not None:
                    self._chunks.move_to_end(index)
                    have[index] = cached
                    self.stats.chunk_hits += 1
                elif index in self._pending:
                    waiting[index] = self._pending[index]
                    self.stats.chunk_hits += 1
                else:
                    future: Future[bytes] = Future()
                    self._pending[index] = future
                    owned[index] = future
                    self.stats.chunk_misses += 1
        if owned:
            self._fetch_runs(owned, have)
        for index, pending in waiting.items():
            have[index] = pending.result()
        position = 0
        for index in range(first, last + 1):
            chunk_start, _ = self._chunk_span(index)
            data = have[index]
            begin = max(offset, chunk_start) - chunk_start
            end = min(offset + length - chunk_start, len(data))
            out[position : position + end - begin] = data[begin:end]
            position += end - begin

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` (see :meth:`read_into`)."""
        buffer = bytearray(length)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def _fetch_runs(self, owned: dict[int, Future[bytes]], have: dict[int, bytes]) -> None:
        """Fetch the chunks this thread registered as pending, one request per consecutive run,
        resolving their futures (with the error, if any) so waiters never hang."""
        runs: list[list[int]] = []
        for index in owned:
            if runs and runs[-1][-1] + 1 == index:
                runs[-1].append(index)
            else:
                runs.append([index])
        failure: BaseException | None = None
        for run in runs:
            futures = [owned[index] for index in run]
            if failure is None:
                try:
                    start, _ = self._chunk_span(run[0])
                    _, stop = self._chunk_span(run[-1])
                    data = self.fetch(start, stop)
                    with self._lock:
                        self.stats.requests += 1
                        self.stats.bytes_fetched += len(data)
                    for index, future in zip(run, futures):
                        chunk_start, chunk_stop = self._chunk_span(index)
                        piece = data[chunk_start - start : chunk_stop - start]
                        have[index] = piece
                        future.set_result(piece)
                        self._finish(index, future, piece)
                    continue
                except BaseException as error:
                    failure = error
            for index, future in zip(run, futures):
                future.set_exception(failure)
                self._finish(index, future, None)
        if failure is not None:
            raise failure

    # -- prefetch ---------------------------------------------------------------------------

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Start fetching the chunks of ``(offset, length)`` ranges in the background.

        Chunks already cached or in flight are skipped; at most half the cache is requested
        ahead. Errors are not raised here: a later read of the same bytes fetches (and raises)
        on its own.

        Returns:
            The number of chunk requests started.
        """
        if not self.max_chunks or not self.prefetch_threads:
            return 0
        self._check_process()
        budget = max(1, self.max_chunks // 2)
        wanted: list[int] = []
        seen: set[int] = set()
        for offset, length in ranges:
            if length <= 0 or offset < 0 or offset + length > self.object_size:
                continue
            for index in range(
                offset // self.chunk_bytes, (offset + length - 1) // self.chunk_bytes + 1
            ):
                if index not in seen:
                    seen.add(index)
                    wanted.append(index)
            if len(wanted) >= budget:
                break
        started: list[tuple[int, Future[bytes]]] = []
        with self._lock:
            in_flight = len(self._pending)
            for index in wanted[:budget]:
                if in_flight >= budget:
                    break
                if index in self._chunks or index in self._pending:
                    continue
                future: Future[bytes] = Future()
                self._pending[index] = future
                started.append((index, future))
                in_flight += 1
            self.stats.prefetched_chunks += len(started)
            if started and self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.prefetch_threads, thread_name_prefix="tokenmill-prefetch"
                )
            executor = self._executor
        for index, future in started:
            assert executor is not None
            executor.submit(self._prefetch_one, index, future)
        return len(started)

    def _prefetch_one(self, index: int, future: Future[bytes]) -> None:
        start, stop = self._chunk_span(index)
        try:
            data = self.fetch(start, stop)
        except BaseException as error:
            future.set_exception(error)
            self._finish(index, future, None)
            return
        with self._lock:
            self.stats.requests += 1
            self.stats.bytes_fetched += len(data)
        future.set_result(data)
        self._finish(index, future, data)

    # -- housekeeping -----------------------------------------------------------------------

    def cached_chunks(self) -> list[int]:
        """Indices of the cached chunks, least recently used first."""
        with self._lock:
            return list(self._chunks)

    def wait_idle(self) -> None:
        """Block until no prefetch is in flight (tests and benchmarks use it)."""
        while True:
            with self._lock:
                pending = list(self._pending.values())
            if not pending:
                return
            for future in pending:
                future.exception()

    def close(self) -> None:
        """Stop the prefetch pool (requests in flight finish in the background) and drop the
        chunks."""
        self._check_process()
        with self._lock:
            executor, self._executor = self._executor, None
            self._chunks.clear()
        if executor is not None:
            executor.shutdown(wait=False)
