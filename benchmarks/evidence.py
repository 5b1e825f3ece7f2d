"""Raw results of a benchmark run, written beside the markdown that quotes them.

Every figure a README or docs page quotes should link to the JSON its run wrote:
``benchmarks/results/<name>.json`` holds the machine (CPU model, cores this process may use,
memory), the versions (Python, numpy, torch, tokenmill, megatron-core), the load average before
and after the run, the command line, every individual run and the summary printed.

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


class Evidence:
    """Collects one benchmark run's context; :meth:`write` saves it with the results."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.load_before = os.getloadavg()

    def write(self, *, runs: list[Any], summary: dict[str, Any], **extra: Any) -> Path:
        """Write ``benchmarks/results/<name>.json`` and return its path."""
        record = {
            "benchmark": self.name,
            "started": self.started.isoformat(timespec="seconds"),
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "machine": machine(),
            "versions": versions(),
            "load_average_before": self.load_before,
            "load_average_after": os.getloadavg(),
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


@contextlib.contextmanager
def recorded(name: str) -> Iterator[Evidence]:
    """Run a benchmark's main with its output kept; on success write results/<name>.json with
    every printed line (each run and the tables) beside the machine, versions and load."""
    evidence = Evidence(name)
    tee = _Tee(sys.stdout)
    sys.stdout = tee  # type: ignore[assignment]
    try:
        yield evidence
    finally:
        sys.stdout = tee.stream
    evidence.write(runs=[], summary={}, output="".join(tee.text).splitlines())
