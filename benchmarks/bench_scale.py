"""Blends of many sources, tokenmill vs megatron-core 0.19.2: start-up, memory, fds, maps, syscalls.

For each S in --sources, S datasets are written (a real `.idx` of small documents, lengths
uniform in [16, 256), and a sparse `.bin` of the matching size, holes only), then a blend of all
S (equal weights, split "100,0,0", one epoch of samples of --seq-length tokens) is opened in a
fresh process per library, interleaved, each time:

* cold: an empty cache directory: build every index, write the cache, read sample 0;
* warm: the same directory again: open every cached index, read sample 0;
* warm, not building: the same as a rank that does not build caches (see --strace below).

Each run prints the time from the builder's construction to sample 0 (imports excluded), the
peak resident memory (ru_maxrss), and the open file descriptors and memory maps after sample 0.
Each cell is the fastest of --repeat runs, with their median beside it (cold: a fresh directory
each time; warm: the cache of the last cold run); the libraries take turns within each repeat.
Ratios are megatron time / tokenmill time. Each run starts after a `sync` (nothing dirty in
the page cache). Runs over --timeout seconds are stopped and shown as
"timeout"; a run that fails shows its error (e.g. megatron-core out of descriptors).
--ulimit-sources lists the S run under `ulimit -n --low-fd-limit` (1024).

--strace counts system calls (`strace -f -c`) of a rank that does not build opening a warm blend
(tokenmill: `is_cache_builder` False inside `trusting_builder(evidence)`, with the digests the
last builder run recorded, what such a rank does after the builders' collective; megatron-core: its warm path, which is the same on every rank), minus a
run that only imports and configures, per source (one GPTDataset entry per source plus one blend
entry).

    python benchmarks/bench_scale.py                              # 10, 100, 1000, 10000
    python benchmarks/bench_scale.py --sources 10 100 --strace 100
    python benchmarks/bench_scale.py --sources 10000 --strace --repeat 1 --results scale_10000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

CHILD = textwrap.dedent(
    """
    import json, logging, os, resource, sys, time, warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    library, listing, cache, seq_length, samples, role = sys.argv[1:7]
    prefixes = open(listing).read().split()
    import torch  # both libraries return torch tensors; imported before the clock starts

    class Tokenizer:
        vocab_size, eod = 50257, 0
        unique_identifiers = {"class": "Tokenizer"}

    if library == "megatron":
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder)
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    else:
        from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
        from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
        # imports excluded on both sides: megatron-core's dataset modules import their
        # IndexedDataset eagerly, tokenmill's on first use
        import tokenmill.formats.megatron
        import contextlib
        from tokenmill.index.cache import encode_evidence, trusting_builder, vouching
        scope = vouching()  # a builder: the digests its collective would hand the others
        if role == "reader":  # a rank that does not build, after the builders' collective
            import tokenmill.datasets.blended as blended_module
            import tokenmill.datasets.gpt as gpt_module
            gpt_module.is_cache_builder = blended_module.is_cache_builder = lambda scope: False
            # the evidence the last builder run left (what the collective would carry)
            scope = trusting_builder(open(cache + ".evidence", "rb").read())
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=int(seq_length), tokenizer=Tokenizer(),
        blend=(prefixes, [1.0] * len(prefixes)), split="100,0,0",
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, path_to_cache=cache)
    if role == "baseline":
        print(json.dumps({}))
        sys.exit(0)
    started = time.perf_counter()
    if library == "megatron":
        train, _, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [int(samples), 0, 0], lambda: True, config).build()
    else:
        with scope as vouched:
            train, _, _ = BlendedMegatronDatasetBuilder(
                GPTDataset, [int(samples), 0, 0], lambda: True, config).build()
    first = train[0]["tokens"]
    seconds = time.perf_counter() - started
    if library != "megatron" and role == "builder":
        with open(cache + ".evidence", "wb") as evidence:
            evidence.write(encode_evidence(vouched))
    with open("/proc/self/maps") as maps:
        map_count = sum(1 for _ in maps)
    print(json.dumps({
        "seconds": seconds,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "maps": map_count,
        "samples": len(train),
    }))
    """
)

LENGTHS = (16, 256)


def write_sources(directory: Path, count: int, documents: int, seed: int = 0) -> list[str]:
    """`count` datasets of `documents` documents each: real `.idx`, sparse `.bin` (uint16)."""
    from tokenmill.formats.megatron_index import (
        INDEX_COUNTS,
        INDEX_HEADER,
        INDEX_PREAMBLE,
        INDEX_VERSION,
        DType,
    )

    rng = np.random.default_rng(seed)
    code = DType.code_from_dtype(np.uint16)
    prefixes = []
    for number in range(count):
        prefix = str(directory / f"source{number:05d}")
        lengths = rng.integers(*LENGTHS, documents, dtype=np.int32)
        pointers = np.zeros(documents, dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
        boundaries = np.arange(documents + 1, dtype=np.int64)
        with open(prefix + ".idx", "wb") as stream:
            stream.write(INDEX_PREAMBLE.pack(INDEX_HEADER, INDEX_VERSION, code))
            stream.write(INDEX_COUNTS.pack(documents, documents + 1))
            for array in (lengths, pointers, boundaries):
                stream.write(array.tobytes())
        with open(prefix + ".bin", "wb") as stream:
            stream.truncate(int(lengths.sum()) * 2)
        prefixes.append(prefix)
    return prefixes


def run(
    library: str,
    listing: str,
    cache: str,
    seq_length: int,
    samples: int,
    role: str,
    timeout: float,
    fd_limit: int | None,
    strace: str | None = None,
) -> dict[str, Any]:
    command = [sys.executable, "-c", CHILD, library, listing, cache, str(seq_length)]
    command += [str(samples), role]
    if strace:
        command = ["strace", "-f", "-c", "-o", strace, *command]

    def limit() -> None:
        if fd_limit is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, hard))

    # nothing dirty in the page cache when a run starts: neither library's run pays for writing
    # back the harness's files or the other library's cache (tokenmill's durable commit syncs
    # the cache's filesystem, which would otherwise include megatron-core's unsynced cache)
    os.sync()
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=limit,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        # the first OSError names the cause (megatron-core's __del__ noise follows it)
        errnos = [line for line in lines if "[Errno" in line]
        found = errnos[0] if errnos else (lines[-1] if lines else f"exit {done.returncode}")
        return {"error": found.strip()[:160]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def set_aside(cache: str, aside: Path) -> None:
    """Move a previous run's cache out of the way; the caches set aside are deleted after every
    run. Why not delete it here: deleting thousands of files just before a cold run makes this
    machine's ext4 skip the freshly freed inodes when the run creates its own (the allocator's
    `recently_deleted` check, a buffer-cache lookup per candidate inode), which cost both
    libraries seconds in a 1,000-source cold run, a cost no real job's cold build pays."""
    if os.path.isdir(cache):
        aside.mkdir(exist_ok=True)
        os.rename(cache, aside / f"{os.path.basename(cache)}-{len(os.listdir(aside))}")


def best_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of repeated runs (the machine is shared: noise only ever adds time); the
    first error if any run failed."""
    for result in results:
        if "error" in result:
            return result
    return min(results, key=lambda result: float(result["seconds"]))


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run (best_of), with the median time of all runs beside it."""
    best = best_of(results)
    if "error" in best:
        return best
    return {**best, "median_seconds": statistics.median(float(r["seconds"]) for r in results)}


def syscalls(path: str) -> dict[str, int]:
    """Calls per system call name from an `strace -c` summary."""
    counts: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and re.fullmatch(r"[\d.]+", fields[0]) and fields[-1] != "total":
            counts[fields[-1]] = int(fields[3])
    return counts


FS_CALLS = (
    "open",
    "openat",
    "stat",
    "lstat",
    "fstat",
    "newfstatat",
    "statx",
    "access",
    "faccessat",
    "faccessat2",
    "readlink",
    "getdents64",
    "read",
    "pread64",
    "preadv",
    "preadv2",
    "readv",
    "lseek",
    "mmap",
    "munmap",
    "close",
    "rename",
    "unlink",
    "flock",
    "fcntl",
    "ioctl",
)


def cell(result: dict[str, Any], key: str, form: str) -> str:
    if "error" in result or key not in result:
        return "-"
    return format(result[key], form)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--documents", type=int, default=2_000_000, help="in all sources")
    parser.add_argument("--min-documents", type=int, default=200, help="per source")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell, the fastest kept")
    parser.add_argument("--ulimit-sources", type=int, nargs="*", default=[10000])
    parser.add_argument("--low-fd-limit", type=int, default=1024)
    parser.add_argument("--strace", type=int, nargs="*", default=[100, 1000])
    parser.add_argument("--libraries", nargs="+", default=["megatron", "tokenmill"])
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    parser.add_argument(
        "--results", default="scale", help="raw results: benchmarks/results/<this>.json"
    )
    args = parser.parse_args()

    from evidence import Evidence  # benchmarks/evidence.py, beside this script

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_scale_"))
    evidence = Evidence(args.results)
    every_run: list[dict[str, Any]] = []
    rows = []
    traces = []
    for count in sorted(set(args.sources) | set(args.strace)):
        data = root / f"data{count}"
        data.mkdir(parents=True, exist_ok=True)
        per_source = max(args.min_documents, args.documents // count)
        prefixes = write_sources(data, count, per_source)
        listing = str(root / f"prefixes{count}.txt")
        Path(listing).write_text("\n".join(prefixes))
        tokens = count * per_source * (LENGTHS[0] + LENGTHS[1] - 1) / 2
        samples = int(tokens // (args.seq_length + 1))
        fd_limit = args.low_fd_limit if count in args.ulimit_sources else None
        measured: dict[str, dict[str, dict[str, Any]]] = {}
        if count in args.sources:
            caches = {library: str(root / f"cache{count}-{library}") for library in args.libraries}

            def once(
                library: str,
                fresh: bool,
                role: str = "builder",
                listing: str = listing,
                samples: int = samples,
                fd_limit: int | None = fd_limit,
                count: int = count,
                caches: dict[str, str] = caches,
            ) -> Any:
                cache = caches[library]
                if fresh:
                    set_aside(cache, root / "set-aside")
                result = run(
                    library, listing, cache, args.seq_length, samples, role, args.timeout,
                    fd_limit,
                )  # fmt: skip
                every_run.append(
                    {
                        "sources": count,
                        "library": library,
                        "phase": "cold" if fresh else role,
                        "fd_limit": fd_limit,
                        **result,
                    }
                )
                return result

            # the libraries take turns within each repeat: a machine that slows down for a
            # while (a shared VM, a disk flushing) slows both, not whichever ran then
            phases = (("cold", True, "builder"), ("warm", False, "builder"),
                      ("warm, not building", False, "reader"))  # fmt: skip
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {
                library: {phase: [] for phase, _, _ in phases} for library in args.libraries
            }
            for phase, fresh, role in phases:
                for _ in range(args.repeat):
                    for library in args.libraries:
                        if phase != "cold" and "error" in best_of(runs[library]["cold"]):
                            continue
                        runs[library][phase].append(once(library, fresh, role))
            for library in args.libraries:
                measured[library] = {
                    phase: summary(runs[library][phase]) if runs[library][phase]
                    else {"error": "no cold cache"}
                    for phase, _, _ in phases
                }  # fmt: skip
                for phase, result in measured[library].items():
                    print(f"S={count} {library} {phase}: {result}", flush=True)
            rows.append((count, per_source, samples, fd_limit, measured))
        if count in args.strace:
            per: dict[str, Any] = {}
            for library in args.libraries:
                cache = str(root / f"cache{count}-{library}")
                if not os.path.isdir(cache) or not os.listdir(cache):
                    run(
                        library,
                        listing,
                        cache,
                        args.seq_length,
                        samples,
                        "builder",
                        args.timeout,
                        None,
                    )
                out = {}
                for role in ("baseline", "reader"):
                    trace = str(root / f"strace{count}-{library}-{role}.txt")
                    result = run(
                        library,
                        listing,
                        cache,
                        args.seq_length,
                        samples,
                        role,
                        args.timeout * 3,
                        None,
                        strace=trace,
                    )
                    if "error" in result:
                        out[role] = result
                        break
                    out[role] = syscalls(trace)
                per[library] = out
                print(f"S={count} {library} strace done", flush=True)
            traces.append((count, per))

    print()
    print(
        f"documents {args.documents:,} in all (at least {args.min_documents} per source), "
        f"lengths {LENGTHS[0]}-{LENGTHS[1] - 1}, sequence length {args.seq_length}; "
        "time = builder to sample 0"
    )
    header = (
        "| S | docs/source | fd limit | phase | megatron s | tokenmill s | ratio | "
        "medians (meg / tm) | ratio of medians | RSS MB (meg / tm) | fds (meg / tm) | "
        "maps (meg / tm) |"
    )
    print(header)
    print("|" + " --- |" * 12)
    for count, per_source, _, fd_limit, measured in rows:
        for phase in ("cold", "warm", "warm, not building"):
            meg = measured.get("megatron", {}).get(phase, {"error": "not run"})
            tm = measured.get("tokenmill", {}).get(phase, {"error": "not run"})
            ratio = (
                f"{meg['seconds'] / tm['seconds']:.1f}x"
                if "error" not in meg and "error" not in tm
                else "-"
            )
            meg_s = meg.get("error", None) or f"{meg['seconds']:.2f}"
            tm_s = tm.get("error", None) or f"{tm['seconds']:.2f}"
            medians = f"{cell(meg, 'median_seconds', '.2f')} / {cell(tm, 'median_seconds', '.2f')}"
            median_ratio = (
                f"{meg['median_seconds'] / tm['median_seconds']:.1f}x"
                if "median_seconds" in meg and "median_seconds" in tm
                else "-"
            )
            print(
                f"| {count:,} | {per_source:,} | {fd_limit or 'default'} | {phase} | {meg_s} | "
                f"{tm_s} | {ratio} | {medians} | {median_ratio} | "
                f"{cell(meg, 'rss_mb', '.0f')} / {cell(tm, 'rss_mb', '.0f')} "
                f"| {cell(meg, 'fds', 'd')} / {cell(tm, 'fds', 'd')} | "
                f"{cell(meg, 'maps', 'd')} / {cell(tm, 'maps', 'd')} |"
            )
    if traces:
        print()
        print("system calls of a non-building rank opening a warm blend, minus imports, per source")
        print("| S | library | all calls | per source | filesystem calls | per source |")
        print("|" + " --- |" * 6)
        for count, per in traces:
            for library, out in per.items():
                if "error" in out.get("reader", {}) or "error" in out.get("baseline", {}):
                    print(f"| {count:,} | {library} | {out} | | | |")
                    continue
                base, reader = out["baseline"], out["reader"]
                total = sum(reader.values()) - sum(base.values())
                fs = sum(reader.get(n, 0) - base.get(n, 0) for n in FS_CALLS)
                print(
                    f"| {count:,} | {library} | {total:,} | {total / count:.1f} | {fs:,} | "
                    f"{fs / count:.1f} |"
                )
    evidence.write(
        runs=every_run,
        summary={
            "time_to_first_sample": [
                {"sources": count, "documents_per_source": per_source, "fd_limit": fd_limit,
                 "best": measured}
                for count, per_source, _, fd_limit, measured in rows
            ],
            "syscalls": [{"sources": count, "per_library": per} for count, per in traces],
        },
        documents=args.documents,
        sequence_length=args.seq_length,
        repeat=args.repeat,
    )  # fmt: skip
    shutil.rmtree(root / "set-aside", ignore_errors=True)
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
