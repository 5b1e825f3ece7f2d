"""`ds[i]` on megatron's defaults (`create_attention_mask=True`), megatron-core against tokenmill.

Usage: python benchmarks/bench_attention_mask.py [--samples 300] [--keep 1000] [--repeat 3]

Each measurement is a fresh Python process that builds a GPTDataset at S=2048 with megatron's
defaults (dense attention mask, no reset flags, no EOD loss mask) over the same generated uint16
corpus, warm page cache, once with `megatron.core.datasets` (stock) and once after
`tokenmill.patch_megatron()`. Measured: time per `ds[i]` over `--samples` random indices after
20 warm-up samples, and memory per sample while a list keeps `--keep` samples (what a prefetch
queue or a list of samples costs): resident memory (RSS after minus before, divided by the
count) and glibc's heap in use (`mallinfo2().uordblks`, the same difference: exact, where RSS
moves by whole pages). The runs alternate stock / tokenmill; medians and ratios are printed and
written to benchmarks/results/attention_mask.json.

Both libraries hand every sample one cached `[1, S, S]` causal mask object (megatron-core caches
it on the dataset; tokenmill caches it per process and length), so neither builds a 4 MiB mask
per sample, and both return a sample's tokens and labels as the two overlapping views of one
S + 1 token tensor (one 16 KiB buffer per kept sample at S=2048, not two).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

_SEQUENCE_LENGTH = 2048
_VOCAB_SIZE = 50000


def _rss_bytes() -> int:
    with open("/proc/self/statm") as stream:
        return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _heap_in_use() -> int:
    """glibc's allocated heap bytes (`mallinfo2().uordblks`)."""
    import ctypes

    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in names.split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return int(libc.mallinfo2().uordblks)


def child(args: argparse.Namespace) -> None:
    """One measurement (a fresh process): prints a JSON line."""
    if args.child == "tokenmill":
        import tokenmill

        tokenmill.patch_megatron()
    warnings.simplefilter("ignore")
    import numpy as np
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    class Tokenizer:
        vocab_size = _VOCAB_SIZE
        eod = 0

        def __init__(self) -> None:
            self.unique_identifiers = {"class": "BenchTokenizer", "vocab_size": _VOCAB_SIZE}

    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=_SEQUENCE_LENGTH,
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=os.path.join(args.workdir, f"cache-{args.child}"),
    )
    low = IndexedDataset(args.prefix)
    documents = np.arange(len(low.sequence_lengths), dtype=np.int32)
    dataset = GPTDataset(low, args.prefix, documents, None, Split.train, config)
    rng = np.random.default_rng(7)
    order = rng.integers(0, len(dataset), size=args.samples + 20).tolist()
    for idx in order[:20]:
        dataset[idx]
    started = time.perf_counter()
    for idx in order[20:]:
        dataset[idx]
    seconds = (time.perf_counter() - started) / args.samples
    chosen = rng.integers(0, len(dataset), size=args.keep).tolist()
    before, heap_before = _rss_bytes(), _heap_in_use()
    kept = [dataset[idx] for idx in chosen]
    after, heap_after = _rss_bytes(), _heap_in_use()
    assert len(kept) == args.keep
    print(
        json.dumps(
            {
                "library": args.child,
                "ms_per_sample": seconds * 1e3,
                "kib_per_kept_sample": (after - before) / args.keep / 1024,
                "heap_kib_per_kept_sample": (heap_after - heap_before) / args.keep / 1024,
            }
        )
    )


def _corpus(workdir: str, tokens: int) -> str:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
    import numpy as np

    from tokenmill.formats.megatron import IndexedDatasetBuilder

    prefix = os.path.join(workdir, "corpus")
    rng = np.random.default_rng(1)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < tokens:
        length = int(rng.integers(100, 4000))
        document = rng.integers(1, _VOCAB_SIZE, size=length, dtype=np.uint16)
        document[-1] = 0
        builder.add_document(document, [length])
        written += length
    builder.finalize(prefix + ".idx")
    return prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--keep", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4_000_000)
    parser.add_argument("--child", choices=("megatron-core", "tokenmill"))
    parser.add_argument("--prefix")
    parser.add_argument("--workdir")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from evidence import Evidence

    evidence = Evidence("attention_mask")
    runs: dict[str, list[dict[str, Any]]] = {"megatron-core": [], "tokenmill": []}
    with tempfile.TemporaryDirectory() as workdir:
        prefix = _corpus(workdir, args.tokens)
        for repeat in range(args.repeat):
            for library in ("megatron-core", "tokenmill"):
                output = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        library,
                        "--prefix",
                        prefix,
                        "--workdir",
                        workdir,
                        "--samples",
                        str(args.samples),
                        "--keep",
                        str(args.keep),
                    ],
                    capture_output=True,
                    text=True,
                )
                if output.returncode:
                    raise SystemExit(f"{library} run failed:\n{output.stderr}")
                run = json.loads(output.stdout.strip().splitlines()[-1])
                runs[library].append(run)
                print(f"run {repeat} {library}: {run}")
    medians = {
        library: {
            key: statistics.median(run[key] for run in values)
            for key in ("ms_per_sample", "kib_per_kept_sample", "heap_kib_per_kept_sample")
        }
        for library, values in runs.items()
    }
    theirs, ours = medians["megatron-core"], medians["tokenmill"]
    ratio = theirs["ms_per_sample"] / ours["ms_per_sample"]
    print(json.dumps(medians, indent=1))
    print(f"time per sample, megatron-core / tokenmill: {ratio:.2f}x")
    evidence.write(
        runs=[run for values in runs.values() for run in values],
        summary={"median": medians, "time_ratio_megatron_over_tokenmill": ratio},
        parameters={
            "sequence_length": _SEQUENCE_LENGTH,
            "create_attention_mask": True,
            "samples": args.samples,
            "keep": args.keep,
            "repeat": args.repeat,
        },
    )


if __name__ == "__main__":
    main()
