"""The cost of durable writes: fsync of each file before its rename and of the directory after.

Usage: python benchmarks/bench_durability.py [--directory DIR] [--entries 200] [--shards 20]

Writes, in DIR (default: a temporary directory; pass one on the filesystem you care about,
e.g. the shared cache), the same things twice, with ``TOKENMILL_FSYNC=1`` (the default) and
``TOKENMILL_FSYNC=0``, alternating, best of 3:

* ``--entries`` small files through ``atomic_write_text`` (index-cache descriptions, sidecars,
  manifests: 4 KiB each) and ``--entries`` 256 KiB ``.npy``-sized files through AtomicFile
  (cache arrays);
* ``--shards`` Megatron ``.bin/.idx`` pairs of 2M uint16 tokens (4 MB) through
  IndexedDatasetBuilder (tokenize and convert outputs).

Prints the time of each and the ratio (durable / not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from tokenmill.common.atomic import AtomicFile, atomic_write_text
from tokenmill.formats.megatron import IndexedDatasetBuilder


def write_entries(directory: str, count: int) -> None:
    payload = os.urandom(256 << 10)
    for i in range(count):
        atomic_write_text(os.path.join(directory, f"entry-{i}.txt"), "x" * 4096)
        array = AtomicFile(os.path.join(directory, f"entry-{i}.npy"))
        array.stream.write(payload)
        array.commit()


def write_shards(directory: str, count: int) -> None:
    tokens = np.random.default_rng(0).integers(0, 50000, 2_000_000, dtype=np.uint16)
    for i in range(count):
        prefix = os.path.join(directory, f"shard-{i}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for start in range(0, len(tokens), 2000):
            builder.add_document(tokens[start : start + 2000], lengths=[2000])
        builder.finalize(prefix + ".idx")


def timed(kind: str, directory: str, count: int, durable: bool) -> float:
    os.environ["TOKENMILL_FSYNC"] = "1" if durable else "0"
    work = tempfile.mkdtemp(dir=directory)
    try:
        started = time.perf_counter()
        (write_entries if kind == "entries" else write_shards)(work, count)
        return time.perf_counter() - started
    finally:
        shutil.rmtree(work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", default=None)
    parser.add_argument("--entries", type=int, default=200)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from evidence import Evidence

    evidence = Evidence("durability")
    directory = args.directory or tempfile.gettempdir()
    summary: dict[str, dict[str, float]] = {}
    runs: list[dict[str, object]] = []
    print(f"writing in {directory} ({os.statvfs(directory).f_bsize}-byte blocks)")
    for kind, count in (("entries", args.entries), ("shards", args.shards)):
        best = {True: float("inf"), False: float("inf")}
        for repeat in range(args.repeat):
            for durable in (True, False):
                seconds = timed(kind, directory, count, durable)
                runs.append(
                    {"kind": kind, "count": count, "repeat": repeat, "fsync": durable,
                     "seconds": seconds}
                )  # fmt: skip
                best[durable] = min(best[durable], seconds)
        what = (
            f"{count} cache entries (4 KiB text + 256 KiB array)"
            if kind == "entries"
            else f"{count} shards of 4 MB (.bin + .idx)"
        )
        print(
            f"{what}: fsync {best[True]:.3f} s, no fsync {best[False]:.3f} s, "
            f"{best[True] / best[False]:.2f}x"
        )
        summary[what] = {"fsync_s": best[True], "no_fsync_s": best[False]}
    evidence.write(runs=runs, summary=summary, directory=directory)


if __name__ == "__main__":
    main()
