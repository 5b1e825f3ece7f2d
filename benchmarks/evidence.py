"""Raw results of a benchmark run, written beside the markdown that quotes them.

Every figure a README or docs page quotes should link to the JSON its run wrote:
``benchmarks/results/<name>.json`` holds the machine (CPU model, cores this process may use,
memory), the versions (Python, numpy, torch, tokenmill, megatron-core), the load average, the
kernel's pressure stall figures and a Python-loop calibration before and after the run, the command line and ``TOKENMILL_*`` environment, every individual run and the
summary printed (under ``recorded``: every printed line and the markdown tables among them).
``scripts/plot_benchmarks.py`` draws the docs' plots from these files.

Usage from a benchmark, structured::

    from evidence import Evidence
    evidence = Evidence("megatron_loader")      # reads the load average now
    ...
    evidence.write(runs=[...], summary={...})  # benchmarks/results/megatron_loader.json

or, for a script that prints every run and its table, the printed lines as the record::

    with recorded("blending"):
        status = main()
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

RESULTS = Path(__file__).resolve().parent / "results"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = None
    with contextlib.suppress(ValueError, OSError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "memory_bytes": memory,
    }


def versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        **{name: _version(name) for name in ("tokenmill", "numpy", "torch", "megatron-core")},
    }


def pressure() -> dict[str, str]:
    """Linux's pressure stall information (``/proc/pressure/{cpu,io,memory}``): how much of the
    last 10, 60 and 300 s tasks waited for CPU, I/O or memory. A shared VM's busy disk or CPU
    shows here when the load average does not. Empty where the kernel has none."""
    found = {}
    for resource in ("cpu", "io", "memory"):
        with (
            contextlib.suppress(OSError),
            open(f"/proc/pressure/{resource}", encoding="ascii") as stream,
        ):
            found[resource] = " | ".join(line.strip() for line in stream)
    return found


def calibration() -> float:
    """Seconds for a fixed pure-Python loop (10^6 additions), best of 3: how fast this machine
    runs Python right now, to compare runs made on different days."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        total = 0
        for number in range(1_000_000):
            total += number
        best = min(best, time.perf_counter() - started)
    return best


class Evidence:
    """Collects one benchmark run's context; :meth:`write` saves it with the results."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.load_before = os.getloadavg()
        self.pressure_before = pressure()
        self.calibration_before = calibration()
        # filled by a benchmark run under recorded(): each measurement, and the figures it quotes
        self.runs: list[Any] = []
        self.summary: dict[str, Any] = {}

    def write(self, *, runs: list[Any], summary: dict[str, Any], **extra: Any) -> Path:
        """Write ``benchmarks/results/<name>.json`` and return its path."""
        record = {
            "benchmark": self.name,
            "started": self.started.isoformat(timespec="seconds"),
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            # settings that change what is measured (TOKENMILL_FSYNC=0, thread counts, ...)
            "environment": {k: v for k, v in os.environ.items() if k.startswith("TOKENMILL_")},
            "machine": machine(),
            "versions": versions(),
            "load_average_before": self.load_before,
            "load_average_after": os.getloadavg(),
            "pressure_before": self.pressure_before,
            "pressure_after": pressure(),
            # seconds for 10^6 pure-Python additions (best of 3), before and after the run
            "python_loop_seconds": [self.calibration_before, calibration()],
            **extra,
            "summary": summary,
            "runs": runs,
        }
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"{self.name}.json"
        path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"raw results: {path}")
        return path


class _Tee:
    """stdout that also keeps every line written (the benchmark's printed runs and tables)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.text: list[str] = []

    def write(self, text: str) -> int:
        self.text.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def markdown_tables(lines: list[str]) -> list[dict[str, Any]]:
    """The markdown tables among printed lines: ``{"header": [...], "rows": [[...], ...]}`` each
    (cells as printed), so the figures a page quotes can be read back without re-parsing."""
    tables: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None

    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in line.strip().strip("|").split("|")]

    for line in lines:
        stripped = line.strip()
        if not (stripped.startswith("|") and stripped.endswith("|")):
            current = None
            continue
        row = cells(stripped)
        if current is None:
            current = {"header": row, "rows": []}
            tables.append(current)
        elif all(set(cell) <= set("-: ") for cell in row):
            continue
        else:
            current["rows"].append(row)
    return tables


def table_runs(tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row of the printed tables as a run: ``{"table": i, header cell: row cell, ...}``."""
    runs: list[dict[str, Any]] = []
    for number, table in enumerate(tables):
        for row in table["rows"]:
            runs.append({"table": number, **dict(zip(table["header"], row))})
    return runs


@contextlib.contextmanager
def recorded(name: str) -> Iterator[Evidence]:
    """Run a benchmark's main with its output kept; if it returns without raising, write
    results/<name>.json with every printed line (each run and the tables), the tables parsed,
    and whatever runs the benchmark appended to ``evidence.runs``, beside the machine, versions
    and load."""
    evidence = Evidence(name)
    tee = _Tee(sys.stdout)
    sys.stdout = tee  # type: ignore[assignment]
    try:
        yield evidence
    finally:
        sys.stdout = tee.stream
    output = "".join(tee.text).splitlines()
    tables = markdown_tables(output)
    evidence.write(
        # the runs the benchmark appended; else each measured row of its printed tables (one
        # run of both libraries per row), so no result file has an empty list of runs
        runs=evidence.runs or table_runs(tables),
        summary=evidence.summary,
        output=output,
        tables=tables,
    )
