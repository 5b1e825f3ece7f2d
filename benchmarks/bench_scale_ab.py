"""A/B of tokenmill variants on bench_scale.py's workload: is an optimisation worth keeping?

Each variant is a directory holding a `tokenmill` package (a copy of python/tokenmill with one
optimisation switched off by a temporary patch, say, beside an unpatched copy). The S sources
of bench_scale.py are written once; then, for each round, every variant opens the blend in a
fresh process (bench_scale.CHILD, tokenmill side only), cold, warm and as a rank that does not
build, the variants taking turns (their order reversed every round, so a machine that slows
down for a while slows both). Each run reports the wall time from the builder's construction
to sample 0 and the CPU time (user + system, every thread) the process spent in it: on a
machine shared with other work the CPU time is the steadier of the two. With --strace, one more
run per variant and phase counts its system calls (`strace -f -c`, whole process).

Cold caches are set aside between runs and deleted at the end. On ext4, creating files soon
after thousands were deleted costs kernel time (benchmarks/SCALE.md): cold runs of an
invocation started right after another one's deletions show it (cold CPU up to 4x).

    python benchmarks/bench_scale_ab.py --variant on=/tmp/ab/on --variant off=/tmp/ab/off \\
        --sources 1000 --rounds 5 --strace
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
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scale import CHILD, FS_CALLS, LENGTHS, syscalls, write_sources

# the child of bench_scale.py, also reporting the CPU time of the timed section (user + system
# of every thread: time.process_time)
TIMED_CHILD = CHILD.replace(
    "started = time.perf_counter()\n",
    "started = time.perf_counter()\ncpu_started = time.process_time()\n",
).replace(
    '    "seconds": seconds,\n',
    '    "seconds": seconds,\n    "cpu_seconds": time.process_time() - cpu_started,\n',
)
if "cpu_started = " not in TIMED_CHILD or "cpu_seconds" not in TIMED_CHILD:
    raise RuntimeError("bench_scale.CHILD changed: update TIMED_CHILD")

PHASES = (("cold", "builder"), ("warm", "builder"), ("not building", "reader"))


def run_child(
    root: str, listing: str, cache: str, samples: int, role: str, strace: str | None = None
) -> dict[str, Any]:
    command = [sys.executable, "-c", TIMED_CHILD, "tokenmill", listing, cache, "1024"]
    command += [str(samples), role]
    if strace:
        command = ["strace", "-f", "-c", "-o", strace, *command]
    os.sync()
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][:200]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME=ROOT")
    parser.add_argument("--sources", type=int, default=1000)
    parser.add_argument("--documents", type=int, default=2_000_000, help="in all sources")
    parser.add_argument("--min-documents", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strace", action="store_true")
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    args = parser.parse_args()

    variants = dict(item.split("=", 1) for item in args.variant)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_scale_ab_"))
    data = root / "data"
    listing = root / "prefixes.txt"
    per_source = max(args.min_documents, args.documents // args.sources)
    if not listing.exists():
        data.mkdir(parents=True, exist_ok=True)
        listing.write_text("\n".join(write_sources(data, args.sources, per_source)))
    tokens = args.sources * per_source * (LENGTHS[0] + LENGTHS[1] - 1) / 2
    samples = int(tokens // 1025)
    aside = root / "set-aside"
    aside.mkdir(exist_ok=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {phase: [] for phase, _ in PHASES} for name in variants
    }
    names = list(variants)
    for number in range(args.rounds):
        order = names if number % 2 == 0 else names[::-1]
        for phase, role in PHASES:
            for name in order:
                cache = str(root / f"cache-{name}")
                if phase == "cold" and os.path.isdir(cache):
                    os.rename(cache, aside / f"{name}-{number}")
                result = run_child(variants[name], str(listing), cache, samples, role)
                runs[name][phase].append(result)
                print(f"round {number} {name} {phase}: {result}", flush=True)
    shutil.rmtree(aside, ignore_errors=True)
    counts: dict[str, dict[str, int]] = {}
    if args.strace:
        for name in names:
            cache = str(root / f"cache-{name}")
            for phase, role in PHASES:
                if phase == "cold":
                    shutil.rmtree(cache, ignore_errors=True)
                trace = str(root / f"strace-{name}-{phase}.txt")
                run_child(variants[name], str(listing), cache, samples, role, strace=trace)
                found = syscalls(trace)
                counts.setdefault(name, {})[phase] = sum(found.get(call, 0) for call in FS_CALLS)
                counts[name][phase + " all"] = sum(found.values())
    print()
    print(f"uptime: {os.getloadavg()}; {args.sources} sources, {args.rounds} rounds")
    print("| variant | phase | wall best | wall median | cpu best | cpu median | fs calls |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary: dict[str, Any] = {}
    for name in names:
        for phase, _ in PHASES:
            good = [r for r in runs[name][phase] if "error" not in r]
            if not good:
                print(f"| {name} | {phase} | error | | | | |")
                continue
            wall = [float(r["seconds"]) for r in good]
            cpu = [float(r["cpu_seconds"]) for r in good]
            cell = {
                "wall_best": min(wall),
                "wall_median": statistics.median(wall),
                "cpu_best": min(cpu),
                "cpu_median": statistics.median(cpu),
                "fs_calls": counts.get(name, {}).get(phase),
            }
            summary.setdefault(name, {})[phase] = cell
            print(
                f"| {name} | {phase} | {cell['wall_best']:.3f} | {cell['wall_median']:.3f} | "
                f"{cell['cpu_best']:.3f} | {cell['cpu_median']:.3f} | {cell['fs_calls']} |"
            )
    (root / "summary.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
