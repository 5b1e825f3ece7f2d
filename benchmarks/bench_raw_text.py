"""Time to first batch from raw jsonl on 2 ranks: training on raw text vs tokenizing first.

Rows (each launch is 2 fresh processes joined by a gloo group; a rank's time runs from just
before ``BlendedMegatronDatasetBuilder(...).build()`` to its first DataLoader batch; a launch's
time is the slower rank's; peak RSS is printed per rank, ``ru_maxrss`` of each rank's process):

* ``raw text, cold``: the blend names the jsonl files; the ranks tokenize their shares (one
  gigatoken thread each: 2 cores in all) into an empty raw-text cache, then build;
* (b) ``tokenmill tokenize + build``: ``tokenmill tokenize`` over the same files (2 threads, its
  own process, timed from the call), then a launch over its output with an empty index cache;
* (a) ``Megatron-LM preprocess_data.py + megatron-core build``: Megatron-LM's
  ``tools/preprocess_data.py`` (``--workers 2 --append-eod``, ``--tokenizer-type
  HuggingFaceTokenizer`` over a local GPT-2 tokenizer directory: transformers' AutoTokenizer) on
  each file, its ``tools/merge_datasets.py`` over the outputs (the files in the same, sorted,
  order), then a launch of stock megatron-core's builder (no patch) over the merged prefix with
  an empty cache. The two scripts come from the Megatron-LM mirror (``--megatron-lm-git``, a bare
  git directory; ``git archive`` of ``--megatron-lm-ref`` into the work directory, nothing is
  vendored) and run on this environment's megatron-core. Their time is each process's wall time,
  its imports included. ``--megatron-files K`` runs the script on the first K files only and
  extrapolates its MB/s to the whole corpus (the row says so);
* ``raw text, warm relaunch`` vs ``pre-tokenized, warm open``: both again with every cache warm,
  ``--repeats`` times each, alternating; the median is compared (the issue's target: within 10%).

The two cold launches run ``--cold-repeats`` times, alternating, each into emptied caches (the
raw-text cache; the tokenized prefix and its index cache), and the row shows the best with the
median beside it; the ratio is given for both. Every launch and the tokenize job start after a
``sync``, so none pays for writing back what the one before it wrote (the 1 GB corpus, written
just before the first cold launch, or the previous launch's tokens): on 2026-11-28 a single cold
raw launch right after the corpus was written measured 8.4 s, and the same launch after a
``sync`` 4.4 s.

Every launch checks that its first batch equals the offline launch's ((a)'s only when it ran on
every file).

Corpus: the Jargon File shipped in the package (public domain, 1.3 MB), repeated into
``--files`` jsonl files of ``--mb`` MB in all (the issue's 1 GB: ``--mb 1000``), written under
``--work-dir`` and deleted at the end with every output (``--keep`` keeps them). Tokenizer: the
real GPT-2 BPE (``gpt2.tiktoken`` from the openai-whisper sdist, as ``bench_tokenize.py`` fetches
it; the HuggingFace directory for Megatron is derived from it by ``bench_tokenize.py``).

Usage: ``python benchmarks/bench_raw_text.py [--mb 64] [--files 8] [--work-dir DIR] [--repeats 11]
[--cold-repeats 3]
[--megatron-lm-git DIR] [--megatron-lm-ref core_v0.19.0] [--megatron-files K] [--keep]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SEQUENCE_LENGTH = 1024
SIZES = [2000, 20, 0]
GPT2_EOD = 50256
MEGATRON_LM_GIT = "/work/.mirror/NVIDIA+Megatron-LM/repo"
MEGATRON_LM_REF = "core_v0.19.0"


class EodTokenizer:
    """What megatron-core's GPTDatasetConfig and GPTDataset read of the tokenizer: the EOD id and
    the vocabulary size (GPT-2's 50,257)."""

    def __init__(self, eod: int) -> None:
        self.eod = eod
        self.vocab_size = eod + 1
        self.unique_identifiers = {"class": "EodTokenizer", "eod": eod}


def rank_job(job: dict[str, Any]) -> None:
    """One rank of a launch (run as ``--rank-job JSON``): build, first batch, report."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=job["rendezvous"], rank=job["rank"], world_size=job["world"]
    )
    fields: dict[str, Any] = {}
    if job["mode"] == "megatron":  # stock megatron-core, not patched
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        tokenizer: Any = EodTokenizer(GPT2_EOD)
    else:
        from tokenmill import BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig, RawText
        from tokenmill.tokenize import load_tokenizer

        # a trainer has its tokenizer before it builds data, whichever way it is fed
        tokenizer = load_tokenizer(job["tokenizer"])
        raw = job["mode"] == "raw"
        fields["raw_text"] = RawText(threads=1, progress=False) if raw else None
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=SEQUENCE_LENGTH,
        blend=(job["entries"], None),
        split="99,1,0",
        tokenizer=tokenizer,
        path_to_cache=job["cache"],
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        **fields,
    )
    dist.barrier()
    started = time.perf_counter()
    train = BlendedMegatronDatasetBuilder(GPTDataset, SIZES, lambda: True, config).build()[0]
    loader = torch.utils.data.DataLoader(train, batch_size=8, shuffle=False)
    batch = next(iter(loader))
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT", json.dumps({"seconds": seconds, "rss_mb": rss,
                                "first": batch["tokens"][0, :64].tolist()}), flush=True)  # fmt: skip
    dist.destroy_process_group()


def tokenize_job(job: dict[str, Any]) -> None:
    """``tokenmill tokenize`` in its own process (run as ``--tokenize-job JSON``): its time from
    the call (imports excluded) and its peak RSS."""
    from tokenmill.tokenize import TokenizeConfig, TokenizerSpec, tokenize

    started = time.perf_counter()
    tokenize(
        TokenizeConfig(
            inputs=tuple(job["inputs"]),
            output_prefix=job["prefix"],
            tokenizer=TokenizerSpec.parse(job["tokenizer"]),
            workers=2,
            progress=False,
        )
    )
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT", json.dumps({"seconds": seconds, "rss_mb": rss}), flush=True)


def result_line(output: str) -> dict[str, Any]:
    line = next(line for line in output.splitlines() if line.startswith("RESULT"))
    return json.loads(line.split(" ", 1)[1])  # type: ignore[no-any-return]


def launch(entries: list[str], tokenizer: str, cache: Path, mode: str) -> dict[str, Any]:
    """A 2-rank launch (mode: raw, offline or megatron): the slower rank's time, each rank's
    peak RSS, the first sample's first tokens. Starts after a ``sync`` (nothing of an earlier
    step is still being written back)."""
    os.sync()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = []
    for rank in range(2):
        job = {"rendezvous": f"tcp://127.0.0.1:{port}", "rank": rank, "world": 2,
               "entries": entries, "tokenizer": tokenizer, "cache": str(cache), "mode": mode}  # fmt: skip
        processes.append(
            subprocess.Popen(
                [sys.executable, __file__, "--rank-job", json.dumps(job)],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for process in processes:
        output, _ = process.communicate(timeout=3600)
        if process.returncode != 0:
            sys.exit(f"a rank failed (exit {process.returncode})")
        results.append(result_line(output))
    return {
        "seconds": max(r["seconds"] for r in results),
        "rss_mb": [r["rss_mb"] for r in results],
        "first": results[0]["first"],
    }


# Megatron-LM's scripts run unchanged through this wrapper: on Python 3.11 typing_extensions'
# identical decorator stands in for 3.12's typing.override; it reports the process's wall time
# and the peak RSS of the process and of its (pool worker) children.
SCRIPT_WRAPPER = (
    "import time; started = time.perf_counter(); "
    "import typing, typing_extensions; "
    "typing.override = getattr(typing, 'override', typing_extensions.override); "
    "import json, resource, runpy, sys; "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
    "rss = max(resource.getrusage(who).ru_maxrss "
    "for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)); "
    "print('RESULT', json.dumps({'seconds': time.perf_counter() - started, 'rss_mb': rss / 1024}))"
)


def run_script(script: Path, arguments: list[str]) -> dict[str, Any]:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT_WRAPPER, str(script), *arguments],
        capture_output=True, text=True, env=environment, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        sys.exit(f"{script.name} failed (exit {result.returncode}): {result.stderr[-3000:]}")
    return result_line(result.stdout)


def megatron_lm_offline(
    args: argparse.Namespace, work: Path, entries: list[str], tokenizer_dir: Path
) -> dict[str, Any]:
    """(a): Megatron-LM's preprocess_data.py per file (the first --megatron-files), its
    merge_datasets.py, then a stock megatron-core launch over the merged prefix."""
    scripts = work / "megatron-lm"
    shutil.rmtree(scripts, ignore_errors=True)
    scripts.mkdir()
    archive = subprocess.run(
        ["git", f"--git-dir={args.megatron_lm_git}", "archive", args.megatron_lm_ref, "--",
         "tools/preprocess_data.py", "tools/merge_datasets.py"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(scripts)], input=archive, check=True)
    commit = subprocess.run(
        ["git", f"--git-dir={args.megatron_lm_git}", "rev-parse", "--short=12",
         args.megatron_lm_ref], capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    chosen = entries[: args.megatron_files or len(entries)]
    parts = work / "megatron-lm-out" / "parts"
    parts.mkdir(parents=True)
    preprocess_seconds, preprocess_rss = 0.0, 0.0
    for path in chosen:
        row = run_script(
            scripts / "tools" / "preprocess_data.py",
            ["--input", path, "--output-prefix", str(parts / Path(path).stem),
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir),
             "--append-eod", "--workers", "2"],
        )  # fmt: skip
        preprocess_seconds += row["seconds"]
        preprocess_rss = max(preprocess_rss, row["rss_mb"])
    merged = work / "megatron-lm-out" / "merged"
    merged.mkdir()
    merge = run_script(
        scripts / "tools" / "merge_datasets.py",
        ["--input", str(parts), "--output-prefix", str(merged / "corpus")],
    )
    build = launch([str(merged / "corpus")], "", work / "megatron-cache", "megatron")
    chosen_mb = sum(os.path.getsize(p) for p in chosen) / 1e6
    total_mb = sum(os.path.getsize(p) for p in entries) / 1e6
    return {
        "ref": f"{args.megatron_lm_ref} ({commit})",
        "files": len(chosen),
        "input_mb": chosen_mb,
        "preprocess_seconds": preprocess_seconds,
        "preprocess_mb_per_s": chosen_mb / preprocess_seconds,
        "preprocess_rss_mb": preprocess_rss,
        "merge_seconds": merge["seconds"],
        "build": build,
        "seconds": preprocess_seconds + merge["seconds"] + build["seconds"],
        # the whole corpus at the measured rate (the merge and build as measured)
        "extrapolated_seconds": total_mb / (chosen_mb / preprocess_seconds)
        + merge["seconds"]
        + build["seconds"],
        "complete": len(chosen) == len(entries),
        "rss_mb": build["rss_mb"],
        "first": build["first"],
    }


def build_corpus(work: Path, megabytes: float, files: int) -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from tokenmill.cli.demo import load_corpus

    lines = [json.dumps({"text": entry["text"]}) + "\n" for entry in load_corpus()]
    per_file = int(megabytes * 1e6 / files)
    paths = []
    for stale in (work / "corpus").glob("part*.jsonl"):
        if int(stale.stem[4:]) >= files:
            stale.unlink()
    for number in range(files):
        path = work / "corpus" / f"part{number:02d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or abs(path.stat().st_size - per_file) > 2e6:
            written = 0
            with open(path, "w", encoding="utf-8") as stream:
                while written < per_file:
                    for line in lines[number::3]:
                        stream.write(line)
                        written += len(line)
        paths.append(str(path))
    return paths


def each(runs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{run['seconds']:.3f}" for run in runs)


def rss(row: dict[str, Any]) -> str:
    return " / ".join(f"{value:.0f}" for value in row["rss_mb"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=11, help="warm launches of each kind")
    parser.add_argument("--cold-repeats", type=int, default=3, help="cold launches of each kind")
    parser.add_argument("--megatron-lm-git", default=MEGATRON_LM_GIT)
    parser.add_argument("--megatron-lm-ref", default=MEGATRON_LM_REF)
    parser.add_argument("--megatron-files", type=int, default=0, help="0: every file")
    parser.add_argument("--skip-megatron-lm", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and the outputs")
    parser.add_argument("--rank-job", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokenize-job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job is not None:
        rank_job(json.loads(args.rank_job))
        return 0
    if args.tokenize_job is not None:
        tokenize_job(json.loads(args.tokenize_job))
        return 0
    work = args.work_dir or Path(tempfile.gettempdir()) / "tokenmill-bench-raw-text"
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_tokenize import fetch_gpt2, gpt2_vocab_and_merges, hf_tokenizer_directory

    os.environ.setdefault("TOKENMILL_FSYNC", "1")
    ranks = str(fetch_gpt2(work))
    entries = build_corpus(work, args.mb, args.files)
    total_mb = sum(os.path.getsize(p) for p in entries) / 1e6
    outputs = ["raw-cache", "offline-cache", "offline", "megatron-lm-out", "megatron-cache"]
    for name in outputs:
        shutil.rmtree(work / name, ignore_errors=True)
    try:
        return measure(args, work, ranks, entries, total_mb, hf_tokenizer_directory,
                       gpt2_vocab_and_merges)  # fmt: skip
    finally:
        if not args.keep:
            for name in [*outputs, "corpus", "megatron-lm"]:
                shutil.rmtree(work / name, ignore_errors=True)


def measure(
    args: argparse.Namespace,
    work: Path,
    ranks: str,
    entries: list[str],
    total_mb: float,
    hf_tokenizer_directory: Any,
    gpt2_vocab_and_merges: Any,
) -> int:
    rows: list[tuple[str, dict[str, Any]]] = []
    # one blend entry naming every file, as `tokenmill tokenize` is given them
    raw_entry = [str(work / "corpus" / "part*.jsonl")]
    job = {"inputs": entries, "prefix": str(work / "offline" / "corpus"), "tokenizer": ranks}
    cold_raw_runs: list[dict[str, Any]] = []
    offline_runs: list[dict[str, Any]] = []
    for _ in range(args.cold_repeats):
        for name in ("raw-cache", "offline", "offline-cache"):
            shutil.rmtree(work / name, ignore_errors=True)
        cold_raw_runs.append(launch(raw_entry, ranks, work / "raw-cache", "raw"))
        os.sync()
        tokenized = subprocess.run(
            [sys.executable, __file__, "--tokenize-job", json.dumps(job)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        tokenize_run = result_line(tokenized.stdout)
        build = launch([str(work / "offline" / "corpus")], ranks, work / "offline-cache", "")
        offline_runs.append(
            dict(build, seconds=tokenize_run["seconds"] + build["seconds"],
                 tokenize=tokenize_run, build_seconds=build["seconds"])
        )  # fmt: skip
    cold_raw = min(cold_raw_runs, key=lambda run: run["seconds"])
    offline = min(offline_runs, key=lambda run: run["seconds"])
    raw_median = statistics.median(run["seconds"] for run in cold_raw_runs)
    offline_median = statistics.median(run["seconds"] for run in offline_runs)
    rows.append(
        (f"raw text, cold (2 ranks x 1 thread; best of {args.cold_repeats}: "
         f"{each(cold_raw_runs)}; median {raw_median:.2f})", cold_raw)
    )  # fmt: skip
    rows.append(
        (f"(b) tokenmill tokenize ({offline['tokenize']['seconds']:.2f} s, "
         f"{offline['tokenize']['rss_mb']:.0f} MB) + build ({offline['build_seconds']:.2f} s); "
         f"best of {args.cold_repeats}: {each(offline_runs)}; median {offline_median:.2f}",
         offline)
    )  # fmt: skip
    warm_raw_runs, warm_offline_runs = [], []
    for _ in range(args.repeats):
        warm_raw_runs.append(launch(raw_entry, ranks, work / "raw-cache", "raw"))
        prefix = [str(work / "offline" / "corpus")]
        warm_offline_runs.append(launch(prefix, ranks, work / "offline-cache", ""))
    warm_raw = dict(
        warm_raw_runs[0], seconds=statistics.median(r["seconds"] for r in warm_raw_runs)
    )
    warm_offline = dict(
        warm_offline_runs[0], seconds=statistics.median(r["seconds"] for r in warm_offline_runs)
    )
    megatron: dict[str, Any] | None = None
    if not args.skip_megatron_lm:
        _, _, hf_json = gpt2_vocab_and_merges(Path(ranks), work)
        megatron = megatron_lm_offline(args, work, entries, hf_tokenizer_directory(work, hf_json))
    every_run = [("cold", run) for run in [*cold_raw_runs, *offline_runs]]
    every_run += [("warm", run) for run in [*warm_raw_runs, *warm_offline_runs]]
    for name, row in [*rows, *every_run]:
        if row["first"] != offline["first"]:
            sys.exit(f"{name}: its first batch differs from the offline launch's")
    if megatron is not None and megatron["complete"] and megatron["first"] != offline["first"]:
        sys.exit("(a): its first batch differs from the offline launch's")
    print(f"corpus: {len(entries)} jsonl files, {total_mb:.1f} MB (the Jargon File repeated); "
          f"GPT-2 BPE; 2 ranks; sequence length {SEQUENCE_LENGTH}")  # fmt: skip
    print("| launch | time to first batch (s) | peak RSS per rank, rank 0 / rank 1 (MB) |")
    print("|---|---:|---:|")
    for name, row in rows:
        print(f"| {name} | {row['seconds']:.2f} | {rss(row)} |")
    if megatron is None:
        print("| (a) Megatron-LM preprocess_data.py + megatron-core build | not run | |")
    else:
        label = (
            f"(a) Megatron-LM {megatron['ref']} preprocess_data.py --workers 2 on "
            f"{megatron['files']} file(s), {megatron['input_mb']:.1f} MB "
            f"({megatron['preprocess_seconds']:.1f} s, {megatron['preprocess_mb_per_s']:.2f} MB/s, "
            f"{megatron['preprocess_rss_mb']:.0f} MB) + merge_datasets.py "
            f"({megatron['merge_seconds']:.2f} s) + megatron-core build "
            f"({megatron['build']['seconds']:.2f} s)"
        )
        if megatron["complete"]:
            print(f"| {label} | {megatron['seconds']:.2f} | {rss(megatron)} |")
        else:
            print(f"| {label}; EXTRAPOLATED to {total_mb:.1f} MB at the measured MB/s | "
                  f"{megatron['extrapolated_seconds']:.0f} (extrapolated) | {rss(megatron)} |")  # fmt: skip
    print(f"| raw text, warm relaunch (median of {args.repeats}: {each(warm_raw_runs)}) | "
          f"{warm_raw['seconds']:.3f} | {rss(warm_raw)} |")  # fmt: skip
    print(f"| pre-tokenized, warm open (median of {args.repeats}: {each(warm_offline_runs)}) | "
          f"{warm_offline['seconds']:.3f} | {rss(warm_offline)} |")  # fmt: skip
    print(f"raw cold / (b) tokenize + build: {cold_raw['seconds'] / offline['seconds']:.2f}x "
          f"best, {raw_median / offline_median:.2f}x medians (target <= 1.2)")  # fmt: skip
    if megatron is not None:
        key = "seconds" if megatron["complete"] else "extrapolated_seconds"
        what = "" if megatron["complete"] else " (extrapolated)"
        print(f"(a) Megatron-LM{what} / raw cold: {megatron[key] / cold_raw['seconds']:.1f}x "
              "faster (target >= 20)")  # fmt: skip
    print(f"warm relaunch / warm open of pre-tokenized data (medians): "
          f"{warm_raw['seconds'] / warm_offline['seconds']:.2f}x (target <= 1.10)")  # fmt: skip
    compared = (
        "" if megatron is None or megatron["complete"] else " ((a) ran on a slice: not compared)"
    )
    print(f"first batches identical in every launch: True{compared}")
    return 0


if __name__ == "__main__":
    if "--rank-job" in sys.argv:
        sys.exit(main())
    from evidence import recorded

    with recorded("raw_text"):
        status = main()
    sys.exit(status)
