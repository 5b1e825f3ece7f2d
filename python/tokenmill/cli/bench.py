"""``tokenmill bench``: sample-serving throughput of tokenmill against megatron-core.

Both libraries serve the same `.bin/.idx` prefix (generated on the spot when none is given: a
random uint16 corpus of `--tokens` tokens in documents of 100-4000 tokens) with the same config
(`create_attention_mask=False`, no reset flags) in one process run, from a warm page cache, at
random sample indices drawn with a fixed seed. For every sequence length it measures:

* `getitem`: a Python loop of `dataset[i]`;
* `batch B`: tokenmill `collate(dataset.__getitems__(batch))`; megatron-core has no
  `__getitems__`, so its row is `default_collate([dataset[i] for i in batch])`, what its
  DataLoader does per batch;
* `loader B/wK`: a torch DataLoader with K workers at batch size B (tokenmill via
  `make_data_loader`, megatron-core with `DataLoader(..., batch_size=B)`), after one warm-up batch;
* `loader B/wK threads`: tokenmill's `ThreadedBatchLoader` with K worker threads (the gather
  releases the GIL), against the same megatron-core DataLoader with K worker processes;

and prints samples/s, tokens/s and the ratio tokenmill / megatron-core, the import time of each
dataset module (fresh subprocess), and the fraction of this machine's memcpy bandwidth that
tokenmill's batched fetch reaches (bytes of output tensors written per second over bytes copied
per second by a large `numpy.copyto`). All heavy imports happen inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

__all__ = ["add_arguments", "register", "run"]

_VOCAB_SIZE = 50000
_EOD = 0


class _Tokenizer:
    """The attributes megatron-core's datasets read from a tokenizer."""

    vocab_size = _VOCAB_SIZE
    eod = _EOD
    unique_identifiers: ClassVar[dict[str, Any]] = {
        "class": "BenchTokenizer",
        "vocab_size": _VOCAB_SIZE,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options shared by `tokenmill bench` and benchmarks/bench_serving.py."""
    parser.add_argument(
        "path_prefix",
        nargs="?",
        default=None,
        help="a megatron .bin/.idx prefix (default: generate a random corpus in --workdir)",
    )
    parser.add_argument(
        "--seq-length",
        type=int,
        action="append",
        dest="seq_lengths",
        help="sequence length (repeatable; default 2048 and 8192)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--seconds", type=float, default=1.0, help="minimum time per measurement")
    parser.add_argument(
        "--tokens", type=int, default=150_000_000, help="size of a generated corpus (uint16)"
    )
    parser.add_argument("--workdir", default=None, help="where generated data and caches go")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-megatron", action="store_true", help="measure tokenmill only")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure sample-serving throughput against megatron-core"
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)


def _generate(prefix: str, tokens: int, seed: int) -> None:
    import numpy as np

    from tokenmill.formats.megatron import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 4000, size=tokens // 2000 + 1, dtype=np.int64)
    ends = np.cumsum(lengths)
    lengths = lengths[: int(np.searchsorted(ends, tokens)) + 1]
    total = int(lengths.sum())
    data = rng.integers(1, _VOCAB_SIZE, size=total, dtype=np.uint16)
    data[np.cumsum(lengths) - 1] = _EOD
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document(data, lengths)
    builder.finalize(prefix + ".idx")


def _warm(prefix: str) -> None:
    with open(prefix + ".bin", "rb") as stream:
        while stream.read(64 << 20):
            pass


def _rate(step: Callable[[], int], seconds: float) -> float:
    """Items per second of `step` (which returns how many items it served), best of 3 runs."""
    step()
    best = 0.0
    for _ in range(3):
        served = 0
        started = time.perf_counter()
        while True:
            served += step()
            elapsed = time.perf_counter() - started
            if elapsed >= seconds / 3:
                break
        best = max(best, served / elapsed)
    return best


def _cycle(values: list[Any]) -> Iterator[Any]:
    while True:
        yield from values


def _loader_rate(loader: Any, batch_size: int, seconds: float) -> float:
    iterator = iter(loader)
    next(iterator)  # worker start-up and the first batch are not counted
    served = 0
    started = time.perf_counter()
    for batch in iterator:
        served += int(batch["tokens"].shape[0])
        if time.perf_counter() - started >= seconds:
            break
    return served / (time.perf_counter() - started)


def _import_time(statement: str) -> float | None:
    script = (
        "import time, warnings\nwarnings.simplefilter('ignore')\n"
        f"t = time.perf_counter()\n{statement}\nprint(time.perf_counter() - t)"
    )
    best: float | None = None
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            return None
        value = float(result.stdout.strip().splitlines()[-1])
        best = value if best is None else min(best, value)
    return best


def _memcpy_bandwidth(nbytes: int) -> float:
    """Bytes per second of `numpy.copyto` between two warm buffers of `nbytes` (best of many)."""
    import numpy as np

    source = np.ones(max(nbytes // 8, 1), dtype=np.int64)
    target = np.empty_like(source)
    repeats = max(3, (256 << 20) // max(nbytes, 1))
    best = 0.0
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            np.copyto(target, source)
        best = max(best, repeats * source.nbytes / (time.perf_counter() - started))
    return best


def _megatron() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return tuple(
                importlib.import_module(f"megatron.core.datasets.{name}")
                for name in ("gpt_dataset", "indexed_dataset", "utils")
            )
        except Exception:  # megatron-core is optional; any import failure means "absent"
            return None


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the table. A working directory it creates (no --workdir)
    is removed at the end, with the corpus it generated there."""
    created = args.workdir is None
    workdir = args.workdir or tempfile.mkdtemp(prefix="tokenmill-bench-")
    try:
        return _run(args, workdir)
    finally:
        if created:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(args: argparse.Namespace, workdir: str) -> int:
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, default_collate

    from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
    from tokenmill.datasets.utils import Split
    from tokenmill.formats.megatron import IndexedDataset
    from tokenmill.loading.batch import make_data_loader
    from tokenmill.loading.threaded import ThreadedBatchLoader
    from tokenmill.serving.batch import collate

    torch.set_num_threads(1)
    os.makedirs(workdir, exist_ok=True)
    prefix = args.path_prefix
    if prefix is None:
        prefix = os.path.join(workdir, f"random-{args.tokens}-{args.seed}")
        if not IndexedDataset.exists(prefix):
            print(f"generating {args.tokens:,} random tokens at {prefix}", flush=True)
            _generate(prefix, args.tokens, args.seed)
    _warm(prefix)
    megatron = None if args.no_megatron else _megatron()
    if megatron is None and not args.no_megatron:
        print("megatron-core is not installed: measuring tokenmill only", flush=True)

    rows: list[tuple[str, float | None, float, int]] = []
    best_batch_bytes = 0.0
    best_batch_size = 0
    for sequence_length in args.seq_lengths or [2048, 8192]:
        common: dict[str, Any] = {
            "random_seed": args.seed,
            "sequence_length": sequence_length,
            "tokenizer": _Tokenizer(),
            "blend": ([prefix], None),
            "split": "1",
            "reset_position_ids": False,
            "reset_attention_mask": False,
            "eod_mask_loss": False,
            "create_attention_mask": False,
        }
        low_level = IndexedDataset(prefix)
        indices = np.arange(len(low_level), dtype=np.int32)
        ours = GPTDataset(
            low_level,
            prefix,
            indices,
            None,
            Split.train,
            GPTDatasetConfig(path_to_cache=os.path.join(workdir, "cache-tokenmill"), **common),
        )
        theirs = None
        if megatron is not None:
            gpt_dataset, indexed_dataset, utils = megatron
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = gpt_dataset.GPTDataset(
                    indexed_dataset.IndexedDataset(prefix),
                    prefix,
                    indices,
                    None,
                    utils.Split.train,
                    gpt_dataset.GPTDatasetConfig(
                        path_to_cache=os.path.join(workdir, "cache-megatron"), **common
                    ),
                )
        rng = np.random.default_rng(args.seed)
        order = rng.integers(0, len(ours), size=1 << 16).tolist()
        label = f"S={sequence_length}"

        def single(dataset: Any, order: list[int] = order) -> Callable[[], int]:
            stream = _cycle(order)

            def step() -> int:
                for _ in range(64):
                    dataset[next(stream)]
                return 64

            return step

        def batched(
            dataset: Any, size: int, fast: bool, order: list[int] = order
        ) -> Callable[[], int]:
            stream = _cycle([order[k : k + size] for k in range(0, len(order) - size, size)])

            def step() -> int:
                batch = next(stream)
                if fast:
                    collate(dataset.__getitems__(batch))
                else:
                    default_collate([dataset[i] for i in batch])
                return size

            return step

        theirs_rate = _rate(single(theirs), args.seconds) if theirs is not None else None
        rows.append((f"{label} getitem", theirs_rate, _rate(single(ours), args.seconds), 0))
        for size in args.batch_sizes:
            theirs_rate = (
                _rate(batched(theirs, size, False), args.seconds) if theirs is not None else None
            )
            ours_rate = _rate(batched(ours, size, True), args.seconds)
            sample = ours.get_batch(order[:1])
            per_sample = sum(value.nbytes for value in sample.values())
            if ours_rate * per_sample > best_batch_bytes:
                best_batch_bytes = ours_rate * per_sample
                best_batch_size = size * per_sample
            rows.append((f"{label} batch {size}", theirs_rate, ours_rate, per_sample))
        for workers in args.workers:
            for size in args.batch_sizes:
                sampler = order[: max(size * 400, 4096)]
                ours_loader = make_data_loader(
                    ours, size, num_workers=workers, sampler=sampler, persistent_workers=False
                )
                ours_rate = _loader_rate(ours_loader, size, args.seconds)
                theirs_rate = None
                if theirs is not None:
                    their_loader = DataLoader(
                        theirs, batch_size=size, num_workers=workers, sampler=sampler
                    )
                    theirs_rate = _loader_rate(their_loader, size, args.seconds)
                rows.append((f"{label} loader B={size} w={workers}", theirs_rate, ours_rate, 0))
                if workers > 0:
                    # tokenmill's thread workers against the same megatron-core DataLoader row:
                    # each library's way of fetching with `workers` parallel workers.
                    threaded = ThreadedBatchLoader(
                        ours, size, num_workers=workers, sampler=order[: max(size * 2000, 16384)]
                    )
                    rows.append(
                        (
                            f"{label} loader B={size} w={workers} threads",
                            theirs_rate,
                            _loader_rate(threaded, size, args.seconds),
                            0,
                        )
                    )

    bandwidth = {
        "batch": _memcpy_bandwidth(best_batch_size),
        "dram": _memcpy_bandwidth(256 << 20),
    }
    _print_table(rows, args, bandwidth, best_batch_bytes, best_batch_size, megatron is not None)
    return 0


def _print_table(
    rows: list[tuple[str, float | None, float, int]],
    args: argparse.Namespace,
    bandwidth: dict[str, float],
    best_batch_bytes: float,
    best_batch_size: int,
    with_megatron: bool,
) -> None:
    def sequence(name: str) -> int:
        return int(name.split()[0].removeprefix("S="))

    header = ("case", "megatron samples/s", "tokenmill samples/s", "tokenmill tokens/s", "ratio")
    lines = []
    for name, theirs, ours, _ in rows:
        ratio = f"{ours / theirs:.1f}x" if theirs else "-"
        lines.append(
            (
                name,
                f"{theirs:,.0f}" if theirs else "-",
                f"{ours:,.0f}",
                f"{ours * sequence(name) / 1e6:,.0f} M",
                ratio,
            )
        )
    imports = [("import tokenmill", _import_time("import tokenmill"))]
    imports.append(
        (
            "import tokenmill GPTDataset",
            _import_time("from tokenmill.datasets.gpt import GPTDataset"),
        )
    )
    if with_megatron:
        imports.append(
            (
                "import megatron GPTDataset",
                _import_time("from megatron.core.datasets.gpt_dataset import GPTDataset"),
            )
        )
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(str(x[i])) for x in [header, *lines]) for i in range(len(header))]
        for line in [header, *lines]:
            print("  ".join(str(cell).rjust(width) for cell, width in zip(line, widths)))
    print()
    for name, seconds in imports:
        print(f"{name}: " + (f"{seconds:.3f} s" if seconds is not None else "failed"))
    print(
        f"memcpy bandwidth (numpy.copyto): {bandwidth['batch'] / 1e9:.1f} GB/s at the batch size "
        f"({best_batch_size / 2**20:.1f} MiB), {bandwidth['dram'] / 1e9:.1f} GB/s at 256 MiB"
    )
    print(
        f"tokenmill batched fetch writes {best_batch_bytes / 1e9:.1f} GB/s of output tensors = "
        f"{best_batch_bytes / bandwidth['batch']:.0%} of memcpy at the same size"
    )
