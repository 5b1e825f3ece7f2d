"""Megatron ``.bin/.idx``: tokenmill vs megatron-core on the same data, in one run.

Measures, for both libraries:

* ``finalize`` of a builder holding N sequences (default 10 M): writing the ``.idx``. Both builders
  are given the state that N one-sequence ``add_document`` calls would leave (megatron: its Python
  lists; tokenmill: its numpy buffers), so only ``finalize`` is timed. The two ``.idx`` files are
  checked to be byte-identical.
* ``add_index`` merge throughput (GB/s of ``.bin`` appended) of a shard of ``--merge-mb`` MB,
  warm page cache.
* random-access reads: ``dataset[i]`` and ``dataset.get(i, offset, length)`` over a fixed random
  sequence of indices, with ``mmap=True`` and ``mmap=False``.

Prints one table with times and the speed-up (megatron time / tokenmill time). Fixed seeds.

Usage: ``python benchmarks/bench_indexed.py [--sequences 10000000] [--merge-mb 1024]``
"""

from __future__ import annotations

import argparse
import filecmp
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.formats import megatron as tokenmill


def best_of(repeat: int, setup: Callable[[], Any], run: Callable[[Any], None]) -> float:
    """The fastest of ``repeat`` timed runs of ``run(setup())`` (setup is not timed)."""
    best = float("inf")
    for _ in range(repeat):
        state = setup()
        start = time.perf_counter()
        run(state)
        best = min(best, time.perf_counter() - start)
    return best


def bench_finalize(
    megatron: Any, directory: Path, sequences: int, repeat: int
) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4096, size=sequences, dtype=np.int32)
    boundaries = np.arange(sequences + 1, dtype=np.int64)
    lengths_list, boundaries_list = lengths.tolist(), boundaries.tolist()

    def megatron_setup() -> Any:
        builder = megatron.IndexedDatasetBuilder(str(directory / "m.bin"), dtype=np.uint16)
        # the state after `sequences` calls of add_document(tokens, [length])
        builder.sequence_lengths = list(lengths_list)
        builder.document_indices = list(boundaries_list)
        return builder

    def tokenmill_setup() -> Any:
        builder = tokenmill.IndexedDatasetBuilder(str(directory / "t.bin"), dtype=np.uint16)
        builder._sequence_lengths.extend(lengths)
        builder._document_indices.extend(boundaries[1:])
        return builder

    megatron_time = best_of(
        repeat, megatron_setup, lambda builder: builder.finalize(str(directory / "m.idx"))
    )
    tokenmill_time = best_of(
        repeat, tokenmill_setup, lambda builder: builder.finalize(str(directory / "t.idx"))
    )
    if not filecmp.cmp(directory / "m.idx", directory / "t.idx", shallow=False):
        raise SystemExit("finalize: the two .idx files differ")
    return megatron_time, tokenmill_time


def write_shard(prefix: Path, megabytes: int, sequence_tokens: int) -> tuple[int, int]:
    """A uint16 shard of about ``megabytes`` MB of random tokens; returns (bytes, sequences)."""
    rng = np.random.default_rng(1)
    builder = tokenmill.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    tokens_left = megabytes * (1 << 20) // 2
    sequences = 0
    chunk_tokens = 1 << 24
    while tokens_left > 0:
        count = min(chunk_tokens, tokens_left)
        count -= count % sequence_tokens
        count = max(count, sequence_tokens)
        tokens = rng.integers(0, 50257, size=count, dtype=np.uint16)
        builder.add_document(tokens, [sequence_tokens] * (count // sequence_tokens))
        sequences += count // sequence_tokens
        tokens_left -= count
    builder.finalize(f"{prefix}.idx")
    return os.path.getsize(f"{prefix}.bin"), sequences


def bench_merge(megatron: Any, directory: Path, shard: Path, repeat: int) -> tuple[float, float]:
    def run(module: Any, name: str) -> float:
        def setup() -> Any:
            # start every run with no dirty pages, so neither side pays the other's writeback
            os.sync()
            return module.IndexedDatasetBuilder(str(directory / f"{name}.bin"), dtype=np.uint16)

        return best_of(repeat, setup, lambda builder: builder.add_index(str(shard)))

    megatron_time = run(megatron, "merged-m")
    tokenmill_time = run(tokenmill, "merged-t")
    return megatron_time, tokenmill_time


def bench_reads(
    megatron: Any, shard: Path, reads: int, repeat: int, mmap: bool
) -> list[tuple[str, float, float]]:
    ours = tokenmill.IndexedDataset(str(shard), mmap=mmap)
    theirs = megatron.IndexedDataset(str(shard), mmap=mmap)
    rng = np.random.default_rng(2)
    indices = rng.integers(0, len(ours), size=reads).tolist()
    lengths = ours.sequence_lengths
    offsets = [int(rng.integers(0, int(lengths[i]))) for i in indices]
    spans = [int(lengths[i]) - offset for i, offset in zip(indices, offsets, strict=True)]
    triples = list(zip(indices, offsets, spans, strict=True))

    def getitem(dataset: Any) -> None:
        for i in indices:
            dataset[i]

    def get(dataset: Any) -> None:
        for i, offset, length in triples:
            dataset.get(i, offset=offset, length=length)

    results = []
    mode = "mmap" if mmap else "pread"
    for label, function in ((f"dataset[i] ({mode})", getitem), (f"get(i, off, len) ({mode})", get)):
        megatron_time = best_of(repeat, lambda: theirs, function)
        tokenmill_time = best_of(repeat, lambda: ours, function)
        results.append((label, megatron_time, tokenmill_time))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=10_000_000, help="finalize size")
    parser.add_argument("--merge-mb", type=int, default=1024, help="size of the merged shard")
    parser.add_argument("--sequence-tokens", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--reads", type=int, default=200_000, help="random reads per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best kept)")
    parser.add_argument("--directory", type=Path, default=None, help="scratch directory")
    arguments = parser.parse_args()

    import_start = time.perf_counter()
    from megatron.core.datasets import indexed_dataset as megatron

    import_seconds = time.perf_counter() - import_start

    with tempfile.TemporaryDirectory(dir=arguments.directory) as scratch:
        directory = Path(scratch)
        rows: list[tuple[str, str, str, str]] = []

        megatron_time, tokenmill_time = bench_finalize(
            megatron, directory, arguments.sequences, arguments.repeat
        )
        rows.append(
            (
                f"finalize, {arguments.sequences:,} sequences",
                f"{megatron_time:.3f} s",
                f"{tokenmill_time:.3f} s",
                f"{megatron_time / tokenmill_time:.1f}x",
            )
        )

        shard = directory / "shard"
        size, sequences = write_shard(shard, arguments.merge_mb, arguments.sequence_tokens)
        megatron_time, tokenmill_time = bench_merge(megatron, directory, shard, arguments.repeat)
        gigabytes = size / 1e9
        rows.append(
            (
                f"add_index, {size / (1 << 20):,.0f} MiB / {sequences:,} sequences",
                f"{gigabytes / megatron_time:.2f} GB/s",
                f"{gigabytes / tokenmill_time:.2f} GB/s",
                f"{megatron_time / tokenmill_time:.1f}x",
            )
        )

        for mmap in (True, False):
            for label, megatron_time, tokenmill_time in bench_reads(
                megatron, shard, arguments.reads, arguments.repeat, mmap
            ):
                rows.append(
                    (
                        label,
                        f"{arguments.reads / megatron_time / 1e3:,.0f} k/s",
                        f"{arguments.reads / tokenmill_time / 1e3:,.0f} k/s",
                        f"{megatron_time / tokenmill_time:.1f}x",
                    )
                )

    print(f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    print(f"megatron-core import: {import_seconds:.1f} s")
    header = ("benchmark", "megatron-core 0.19.2", "tokenmill", "speed-up")
    widths = [max(len(row[k]) for row in [header, *rows]) for k in range(4)]
    lines = [header, tuple("-" * width for width in widths), *rows]
    for line in lines:
        print(
            "| "
            + " | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
            + " |"
        )


if __name__ == "__main__":
    from evidence import recorded

    with recorded("indexed"):
        main()
