"""GPTDataset index build, tokenmill vs megatron-core 0.19.2: time and peak memory.

Both libraries build the document, sample and shuffle indices of one epoch over N documents
(lengths uniform in [1, 2000), 2048-token samples, seed 1234) exactly as GPTDataset does, with
no cache. Each build runs in a fresh subprocess so its peak resident memory can be read
(`ru_maxrss` after the build minus the resident size before it); "peak / output" is that peak
divided by the bytes of the three arrays produced. The arrays of both libraries are compared
(sha256) to prove the builds are identical.

    python benchmarks/bench_gpt_index.py                 # 10M and 100M documents
    python benchmarks/bench_gpt_index.py --documents 1000000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from typing import Any

CHILD = textwrap.dedent(
    """
    import hashlib, json, resource, sys, time, warnings
    import numpy as np
    warnings.filterwarnings("ignore")
    library, documents = sys.argv[1], int(sys.argv[2])

    class Tokenizer:
        vocab_size, eod = 50257, 0
        unique_identifiers = {"class": "Tokenizer"}

    class LowLevel:  # what GPTDataset reads from an IndexedDataset while building
        path_prefix = "/nonexistent"
        def __init__(self, lengths):
            self.sequence_lengths = lengths

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, documents, dtype=np.int32)
    indices = np.arange(documents, dtype=np.int32)
    fields = dict(random_seed=1234, sequence_length=2048, tokenizer=Tokenizer(),
                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    if library == "megatron":
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.utils import Split
    else:
        from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig
        from tokenmill.datasets.utils import Split
    config = GPTDatasetConfig(**fields)  # no blend: mock mode, so nothing is cached
    low_level = LowLevel(lengths)

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    before = resident()
    started = time.perf_counter()
    dataset = GPTDataset(low_level, None, indices, None, Split.train, config)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    arrays = [np.ascontiguousarray(getattr(dataset, n))
              for n in ("document_index", "sample_index", "shuffle_index")]
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(str(array.dtype).encode() + str(array.shape).encode() + array.tobytes())
    print(json.dumps({"seconds": seconds, "peak": peak,
                      "output": sum(a.nbytes for a in arrays), "digest": digest.hexdigest()}))
    """
)


def measure(library: str, documents: int) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, library, str(documents)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(evidence: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, nargs="+", default=[10_000_000, 100_000_000])
    parser.add_argument("--repeats", type=int, default=1, help="best of N builds per library")
    args = parser.parse_args()
    rows = []
    for documents in args.documents:
        results = {}
        for library in ("megatron", "tokenmill"):
            runs = [measure(library, documents) for _ in range(args.repeats)]
            if evidence is not None:
                evidence.runs.extend(
                    {"library": library, "documents": documents, **run} for run in runs
                )
            results[library] = min(runs, key=lambda run: run["seconds"])
        megatron, tokenmill = results["megatron"], results["tokenmill"]
        rows.append(
            (
                f"{documents:,}",
                f"{megatron['seconds']:.2f} s",
                f"{tokenmill['seconds']:.2f} s",
                f"{megatron['seconds'] / tokenmill['seconds']:.1f}x",
                f"{megatron['peak'] / megatron['output']:.2f}x",
                f"{tokenmill['peak'] / tokenmill['output']:.2f}x",
                f"{tokenmill['output'] / 2**30:.2f} GiB",
                "yes" if megatron["digest"] == tokenmill["digest"] else "NO",
            )
        )
    header = (
        "documents",
        "megatron",
        "tokenmill",
        "speed-up",
        "megatron peak/output",
        "tokenmill peak/output",
        "output",
        "identical",
    )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


if __name__ == "__main__":
    from evidence import recorded

    with recorded("gpt_index") as evidence:
        main(evidence)
