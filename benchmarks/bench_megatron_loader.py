"""Megatron's own data loader, unchanged, on megatron-core and on tokenmill (`patch_megatron()`).

Usage: python benchmarks/bench_megatron_loader.py [PATH_PREFIX] [--batches 400] [--repeat 3]

Each measurement is a fresh Python process running Megatron-LM's data path exactly as
`pretrain_gpt.py` does: `BlendedMegatronDatasetBuilder(GPTDataset, ...)` from
`megatron.core.datasets`, then `megatron.training.datasets.data_samplers.
build_pretraining_data_loader` (a torch DataLoader over `MegatronPretrainingSampler` batches,
`num_workers` worker processes, `pin_memory=True`, `persistent_workers=True`, torch's default
collate). The "tokenmill" process calls `tokenmill.patch_megatron()` first and changes nothing
else. Both read the same generated corpus (a random uint16 corpus of `--tokens` tokens in
documents of 100-4000 tokens, warm page cache), S=2048, batch 32, 2 workers,
`create_attention_mask=False`, no reset flags, seed 1234; the runs alternate stock / tokenmill.

The consumer copies every tensor of every batch into a preallocated buffer (what a host-to-device
copy reads), so shared memory is really read. Measured over `--batches` batches after 20 warm-up
batches: samples/s (wall clock) and CPU seconds per 1000 samples, summed over the main process
(all its threads) and the worker processes (from /proc/<pid>/stat). Printed: each run, then the
medians side by side with the ratios (samples/s: tokenmill / megatron-core; CPU: megatron-core /
tokenmill).

megatron-core 0.19.2 declares Python >= 3.12; on 3.11 its `megatron.training` package needs
`typing.override`, which the child processes take from typing_extensions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

_VOCAB_SIZE = 50000


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stream:
        fields = stream.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(args: argparse.Namespace) -> None:
    """One measurement (run in a fresh process): prints a JSON line."""
    if args.child == "tokenmill":
        import tokenmill

        tokenmill.patch_megatron()
    warnings.simplefilter("ignore")
    import types
    import typing

    if not hasattr(typing, "override"):  # megatron.training uses 3.12's typing.override
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    import numpy as np
    import torch
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.global_vars import set_args

    torch.set_num_threads(1)

    class Tokenizer:
        vocab_size = _VOCAB_SIZE
        eod = 0
        unique_identifiers: typing.ClassVar[dict[str, Any]] = {
            "class": "BenchTokenizer",
            "vocab_size": _VOCAB_SIZE,
        }

    samples = (args.batches + 40) * args.batch_size
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=args.seq_length,
        blend=([args.prefix], None),
        split="1",
        path_to_cache=os.path.join(args.workdir, f"cache-{args.child}"),
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [samples, None, None], lambda: True, config
    ).build()
    assert type(train).__module__.startswith(
        "tokenmill" if args.child == "tokenmill" else "megatron"
    )
    set_args(
        types.SimpleNamespace(
            dataloader_type="single",
            micro_batch_size=args.batch_size,
            global_batch_size=args.batch_size,
            full_validation=False,
            hybrid_context_parallel=False,
            num_workers=args.workers,
            exit_signal_handler=False,
            data_sharding=True,
        )
    )
    parallel_state.set_data_parallel_rank(0)
    parallel_state._MPU_DATA_PARALLEL_WORLD_SIZE = 1  # no process group in this benchmark
    loader = build_pretraining_data_loader(train, consumed_samples=0)
    iterator = iter(loader)
    first = next(iterator)
    sinks = {key: torch.empty_like(value) for key, value in first.items()}
    for _ in range(19):
        next(iterator)
    workers = [worker.pid for worker in getattr(iterator, "_workers", [])]
    worker_start = [_cpu_seconds(pid) for pid in workers]
    main_start = time.process_time()
    started = time.perf_counter()
    served = 0
    checksum = 0
    for _ in range(args.batches):
        batch = next(iterator)
        for key, value in batch.items():
            sinks[key].copy_(value)  # read every byte, as a host-to-device copy does
        checksum += int(sinks["tokens"][0, 0])
        served += int(batch["tokens"].shape[0])
    wall = time.perf_counter() - started
    main_cpu = time.process_time() - main_start
    worker_cpu = [_cpu_seconds(pid) - start for pid, start in zip(workers, worker_start)]
    print(
        json.dumps(
            {
                "library": args.child,
                "samples_per_second": served / wall,
                "cpu_per_1000": (main_cpu + sum(worker_cpu)) / served * 1000,
                "main_cpu": main_cpu,
                "worker_cpu": worker_cpu,
                "checksum": checksum,
                "dtype": str(np.dtype(np.int64)),
            }
        ),
        flush=True,
    )
    del iterator, loader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("prefix", nargs="?", default=None, help="a .bin/.idx prefix")
    parser.add_argument("--tokens", type=int, default=150_000_000)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", choices=["stock", "tokenmill"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0

    from evidence import Evidence

    evidence = Evidence("megatron_loader")
    created = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="tokenmill-megatron-loader-")
    try:
        return _compare(args, evidence)
    finally:
        if created:  # the generated corpus (300 MB) and both caches
            shutil.rmtree(args.workdir, ignore_errors=True)


def _compare(args: argparse.Namespace, evidence: Any) -> int:
    os.makedirs(args.workdir, exist_ok=True)
    if args.prefix is None:
        from tokenmill.cli.bench import _generate
        from tokenmill.formats.megatron import IndexedDataset

        args.prefix = os.path.join(args.workdir, f"random-{args.tokens}-1234")
        if not IndexedDataset.exists(args.prefix):
            print(f"generating {args.tokens:,} random tokens at {args.prefix}", flush=True)
            _generate(args.prefix, args.tokens, 1234)
    with open(args.prefix + ".bin", "rb") as stream:  # warm the page cache
        while stream.read(64 << 20):
            pass
    results: dict[str, list[dict[str, Any]]] = {"stock": [], "tokenmill": []}
    for _ in range(args.repeat):
        for library in ("stock", "tokenmill"):
            command = [
                sys.executable,
                os.path.abspath(__file__),
                args.prefix,
                "--workdir",
                args.workdir,
                "--seq-length",
                str(args.seq_length),
                "--batch-size",
                str(args.batch_size),
                "--workers",
                str(args.workers),
                "--batches",
                str(args.batches),
                "--child",
                library,
            ]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            result = json.loads(output.strip().splitlines()[-1])
            results[library].append(result)
            print(
                f"{library:>9}: {result['samples_per_second']:>9,.0f} samples/s, "
                f"{result['cpu_per_1000']:.3f} CPU-s per 1000 samples (main "
                f"{result['main_cpu']:.2f} s, workers "
                f"{', '.join(f'{value:.2f}' for value in result['worker_cpu'])} s)",
                flush=True,
            )
    checksums = {library: {run["checksum"] for run in runs} for library, runs in results.items()}
    same = checksums["stock"] == checksums["tokenmill"] and len(checksums["stock"]) == 1
    rate = {k: statistics.median(r["samples_per_second"] for r in v) for k, v in results.items()}
    cpu = {k: statistics.median(r["cpu_per_1000"] for r in v) for k, v in results.items()}
    rows = [
        (
            f"S={args.seq_length} B={args.batch_size} {args.workers} worker processes, "
            "build_pretraining_data_loader, default collate",
            f"{rate['stock']:,.0f}",
            f"{rate['tokenmill']:,.0f}",
            f"{rate['tokenmill'] / rate['stock']:.1f}x",
            f"{cpu['stock']:.3f}",
            f"{cpu['tokenmill']:.3f}",
            f"{cpu['stock'] / cpu['tokenmill']:.1f}x less",
        )
    ]
    header = (
        "case",
        "megatron samples/s",
        "tokenmill samples/s",
        "ratio",
        "megatron CPU-s/1000",
        "tokenmill CPU-s/1000",
        "CPU ratio",
    )
    print()
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        for name, row in zip(header, zip(*rows)):
            print(f"{name:>22}: {row[0]}")
    print(f"(medians of {args.repeat} alternating runs; same first tokens in every run: {same})")
    evidence.write(
        runs=[
            {"library": library, **run}
            for library in ("stock", "tokenmill")
            for run in results[library]
        ],
        summary={
            "samples_per_second": rate,
            "cpu_seconds_per_1000_samples": cpu,
            "speedup": rate["tokenmill"] / rate["stock"],
            "cpu_ratio": cpu["stock"] / cpu["tokenmill"],
            "same_tokens": same,
        },
        parameters={
            "sequence_length": args.seq_length, "batch_size": args.batch_size,
            "workers": args.workers, "batches": args.batches, "repeat": args.repeat,
            "tokens": args.tokens,
        },
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
