"""Default thread counts of the C++ kernels, in one place.

Each kernel's result never depends on its thread count (the work is cut into chunks whose
results are combined in order), so these numbers only trade speed against the cores a trainer
leaves to its data pipeline:

* index builds and the packing planner: the CPUs this process may run on, at most 4 (the
  builds are a few seconds at 10^8 documents and share the machine with the trainer's ranks);
* token scans (BOS/EOS positions over a whole shard): at most 8, as the scan is memory-bound
  and scales further;
* the batched sample gather: 2 for a batch whose outputs reach 1 MiB (one core writes
  ~18-20 GB/s here, two ~26-28 GB/s: measured at S=8192, 1.8 and 7 MiB batches, 1.4-1.6x;
  benchmarks/SERVING.md), else 1. DataLoader worker processes always gather on one.
"""

from __future__ import annotations

import os

__all__ = [
    "PARALLEL_GATHER_BYTES",
    "available_cpus",
    "default_build_threads",
    "default_gather_threads",
    "default_scan_threads",
]

# A batch whose outputs reach this size is gathered by `default_gather_threads()` threads.
PARALLEL_GATHER_BYTES = 1 << 20


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the CPU count off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_build_threads() -> int:
    """Threads for index builds and packing plans: the CPUs available, at most 4."""
    return max(1, min(4, available_cpus()))


def default_scan_threads() -> int:
    """Threads for token scans when none are given: the CPUs available, at most 8."""
    return max(1, min(8, available_cpus()))


def default_gather_threads() -> int:
    """Threads that gather one large batch (at least `PARALLEL_GATHER_BYTES` of outputs)."""
    return max(1, min(2, os.cpu_count() or 1))
