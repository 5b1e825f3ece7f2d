"""The modded-nanogpt output of `tokenmill tokenize --output-format nanogpt`: the finished
Megatron parts streamed into `.bin` shards with `.bos.idx` sidecars (no merged copy first)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy

__all__ = ["write_nanogpt_output"]


def write_nanogpt_output(
    megatron_prefixes: str | Sequence[str],
    output_prefix: str,
    bos_id: int,
    shard_tokens: int | None = None,
) -> list[str]:
    """modded-nanogpt shard(s) `<output_prefix>.bin` (+ `.bos.idx`) from Megatron datasets.

    Streams the tokens of each dataset in order (constant memory, no merged copy first) into
    NanogptShardWriter, which records the BOS positions for the `.bos.idx` sidecar; data beyond
    one shard's `shard_tokens` (default 10^8, fineweb's shards; at most what modded-nanogpt's
    loader reads in one `readinto`) goes to `<output_prefix>_000000.bin`, `_000001.bin`, ...

    Returns:
        The shard paths written.
    """
    from tokenmill.formats.megatron import IndexedDataset
    from tokenmill.formats.nanogpt import NanogptShardWriter, shard_token_cap

    prefixes = [megatron_prefixes] if isinstance(megatron_prefixes, str) else megatron_prefixes
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    arrays = [
        dataset._tokens if dataset._tokens is not None else numpy.zeros(0, dataset.dtype)
        for dataset in datasets  # an empty .bin is not mapped
    ]
    count = sum(int(array.shape[0]) for array in arrays)
    widest = max((array.dtype.itemsize for array in arrays), default=2)
    dtype = numpy.dtype(numpy.uint16) if widest <= 2 else numpy.dtype(numpy.uint32)
    cap = shard_token_cap(dtype, shard_tokens)
    shards = max(1, -(-count // cap))
    paths = []
    pieces = iter(
        (array, start, min(int(array.shape[0]), start + (1 << 24)))
        for array in arrays
        for start in range(0, int(array.shape[0]), 1 << 24)
    )
    pending: tuple[Any, int, int] | None = next(pieces, None)
    for number in range(shards):
        path = output_prefix + (".bin" if shards == 1 else f"_{number:06d}.bin")
        writer = NanogptShardWriter(path, dtype, bos_token=bos_id)
        room = cap
        try:
            while pending is not None and room > 0:
                array, start, stop = pending
                take = min(stop - start, room)
                writer.write(array[start : start + take])
                room -= take
                pending = (array, start + take, stop) if start + take < stop else next(pieces, None)
            writer.finalize()
        except BaseException:
            writer.abort()
            raise
        paths.append(path)
    return paths
