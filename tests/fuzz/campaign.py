"""Run fuzz campaigns whose logs name the code they ran on: docs/fuzz/<harness>.log.

    python tests/fuzz/campaign.py megatron_idx npy_tokens          # 10^6 executions each
    python tests/fuzz/campaign.py --runs 200000 --nice 19 bos_idx

Each harness runs under atheris (tests/fuzz/run_fuzz.py) with the documented flags
(``-runs -max_len=4096 -timeout=10 -rss_limit_mb=4096 -print_final_stats=1``), one after
the other, in a fresh scratch directory (where a ``crash-*`` file would land). The log's header
records the commit (``# commit: <sha>``, what ``docs/fuzz/stale_campaigns.py`` compares the
harness's targets against), the date, Python and atheris versions and the command; libFuzzer's
output follows (numpy's SyntaxWarning lines for fuzzed ``.npy`` headers removed), and the last
line is the exit status and the wall time. The campaign refuses to start when the checkout has
uncommitted changes under ``python/`` or ``csrc/``: the commit would not name the code fuzzed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "docs" / "fuzz"


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("harnesses", nargs="+")
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--max-total-time", type=int, default=0, help="seconds; 0: no limit")
    parser.add_argument("--nice", type=int, default=19)
    parser.add_argument("--note", default="", help="appended to the log's header")
    args = parser.parse_args()
    dirty = git("status", "--porcelain", "--", "python", "csrc")
    if dirty:
        raise SystemExit(f"uncommitted changes under python/ or csrc/:\n{dirty}")
    commit = git("rev-parse", "HEAD")
    for name in args.harnesses:
        scratch = Path(tempfile.mkdtemp(prefix=f"fuzz-{name}-"))
        flags = [
            f"-runs={args.runs}",
            "-max_len=4096",
            "-timeout=10",
            "-rss_limit_mb=4096",
            "-print_final_stats=1",
        ]
        if args.max_total_time:
            flags.append(f"-max_total_time={args.max_total_time}")
        command = [
            "nice", "-n", str(args.nice),
            sys.executable, str(ROOT / "tests" / "fuzz" / "run_fuzz.py"), name, *flags,
        ]  # fmt: skip
        started = datetime.datetime.now(datetime.timezone.utc)
        clock = time.monotonic()
        result = subprocess.run(
            command,
            cwd=scratch,
            env={**os.environ, "TOKENMILL_FUZZ_DIR": str(scratch / "dir")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            check=False,
        )
        wall = round(time.monotonic() - clock)
        finished = datetime.datetime.now(datetime.timezone.utc)
        lines = [line for line in result.stdout.splitlines() if not _numpy_warning(line)]
        shown = " ".join(["tests/fuzz/run_fuzz.py", name, *(shlex.quote(f) for f in flags)])
        header = [
            f"# atheris campaign: harness {name}, {started:%Y-%m-%d %H:%M}-{finished:%H:%M} UTC, "
            f"Python {platform.python_version()}, atheris {version('atheris')}, "
            f"{os.cpu_count()} CPUs shared with other work (nice {args.nice})"
            + (f"; {args.note}" if args.note else ""),
            f"# commit: {commit}",
            f"# command (from a scratch directory, where a crash-* file would land): "
            f"TOKENMILL_FUZZ_DIR=<scratch>/dir nice -n {args.nice} python {shown}",
            "# libFuzzer's output follows (numpy's SyntaxWarning lines for fuzzed .npy headers "
            "removed); the last line is the exit status and wall time",
        ]
        log = LOGS / f"{name}.log"
        log.write_text("\n".join([*header, *lines, f"exit={result.returncode} wall={wall}"]) + "\n")
        crashes = sorted(path.name for path in scratch.glob("crash-*"))
        print(f"{name}: exit {result.returncode}, {wall} s, log {log}", *crashes, flush=True)


def _numpy_warning(line: str) -> bool:
    return "SyntaxWarning" in line or (line.startswith("  ") and "literal_eval" in line)


if __name__ == "__main__":
    main()
