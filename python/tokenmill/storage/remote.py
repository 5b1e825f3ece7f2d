"""Random-access reads of one S3 object through a :class:`~tokenmill.storage.chunk_cache.ChunkCache`.

:class:`S3BinReader` is what an ``IndexedDataset`` on ``s3://`` reads its ``.bin`` with. Opening
it costs one HEAD request (size and ETag); every ranged GET afterwards carries ``If-Match`` with
that ETag, so a dataset never mixes bytes of two versions of an object: a replaced object raises
:class:`~tokenmill.errors.ObjectChangedError` instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.storage.chunk_cache import CacheStats, ChunkCache
from tokenmill.storage.object_storage import ObjectStorageConfig
from tokenmill.storage.s3 import S3Client, client_for

__all__ = ["RemoteArray", "S3BinReader"]


class S3BinReader:
    """Ranged, cached reads of ``url``.

    Args:
        url: the ``s3://`` object.
        config: chunk size, cache budget, prefetch threads and retry policy.
        client: the S3 client (default: the process-wide one for ``config.retry``).

    Raises:
        FileNotFoundError: the object does not exist.
        ObjectStorageError: the retry budget was spent.
    """

    def __init__(
        self, url: str, config: ObjectStorageConfig, client: S3Client | None = None
    ) -> None:
        self.url = url
        self.config = config
        self.client = client if client is not None else client_for(config.retry)
        info = self.client.stat(url)
        self.size = info.size
        self.etag = info.etag
        self.cache = ChunkCache(
            self._fetch,
            info.size,
            chunk_bytes=config.bin_chunk_nbytes,
            capacity_bytes=config.bin_cache_nbytes,
            prefetch_threads=config.prefetch_threads,
            name=url,
        )

    def _fetch(self, start: int, stop: int) -> bytes:
        return self.client.get_range(self.url, start, stop, if_match=self.etag)

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of the object."""
        self.cache.read_into(offset, out)

    def read(self, dtype: type[np.generic] | np.dtype[Any], count: int, offset: int) -> Any:
        """``count`` items of ``dtype`` starting at byte ``offset`` (megatron-core's
        ``_BinReader.read`` signature)."""
        array: npt.NDArray[Any] = np.empty(count, dtype=dtype)
        self.cache.read_into(offset, array.data.cast("B"))
        return array

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Fetch the chunks of ``(byte_offset, byte_length)`` ranges in the background."""
        return self.cache.prefetch(ranges)

    @property
    def stats(self) -> CacheStats:
        """Requests, bytes, chunk hits and misses of this reader."""
        return self.cache.stats

    def close(self) -> None:
        """Stop prefetching and drop the cached chunks."""
        self.cache.close()

    def __repr__(self) -> str:
        return f"S3BinReader({self.url!r}, size={self.size}, etag={self.etag})"


class RemoteArray:
    """A read-only 1-D token array stored in an S3 object from byte ``offset`` on.

    Supports ``len()``, ``.dtype``, ``.shape`` and indexing by an integer or a step-1 slice, which
    return numpy values read through the reader's chunk cache. Each slice read also announces the
    next ``readahead_bytes`` to the prefetcher, for sequential consumers (nanogpt shards).

    Args:
        reader: the object's reader.
        dtype: the token dtype (little-endian).
        count: the number of tokens.
        offset: the byte offset of token 0 (e.g. a 1 KiB header).
        readahead_bytes: bytes after each slice to prefetch (0: none).

    Raises:
        ValueError: the tokens would extend past the object.
    """

    def __init__(
        self,
        reader: S3BinReader,
        dtype: np.dtype[Any],
        count: int,
        offset: int,
        readahead_bytes: int = 0,
    ) -> None:
        self.reader = reader
        self.dtype = np.dtype(dtype)
        self.count = count
        self.offset = offset
        self.readahead_bytes = readahead_bytes
        end = offset + count * self.dtype.itemsize
        if end > reader.size:
            raise ValueError(
                f"{reader.url}: {count} tokens of {self.dtype} from byte {offset} need {end} "
                f"bytes, the object has {reader.size}"
            )

    @property
    def shape(self) -> tuple[int]:
        return (self.count,)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.count)
            if step != 1:
                raise ValueError(f"{self.reader.url}: only step-1 slices are supported, got {step}")
            stop = max(start, stop)
            itemsize = self.dtype.itemsize
            first = self.offset + start * itemsize
            array: npt.NDArray[Any] = np.empty(stop - start, dtype=self.dtype)
            self.reader.read_into(first, array.data.cast("B"))
            if self.readahead_bytes:
                after = self.offset + stop * itemsize
                ahead = min(self.readahead_bytes, self.reader.size - after)
                if ahead > 0:
                    self.reader.prefetch([(after, ahead)])
            return array
        index = int(key)
        if index < 0:
            index += self.count
        if not 0 <= index < self.count:
            raise IndexError(
                f"{self.reader.url}: token {int(key)} out of range for {self.count} tokens"
            )
        return self[index : index + 1][0]
