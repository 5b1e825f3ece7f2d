"""Mixture costs: chunk draws, exact demand (validate), and the loader's tokens per second.

Three sources of lognormal documents (mean ~1000 tokens) in uint16 Megatron shards under a
temporary directory, two phases. Reported:

* draws: ``_core.draw_chunk_sources`` (Philox4x64-10 + a binary search), ns per chunk;
* demand: ``Mixture.report()`` over the whole budget (what ``tokenmill validate`` runs);
* loader: steps of ``--global-batch`` x ``--sequence-length`` tokens, in this process, as rank 0
  of 1 and as rank 0 of 8 (every rank walks every step's draws but reads only its slice);
* resume: ``load_state_dict`` + first batch from a state in the middle of the budget.

    python benchmarks/bench_mixture.py
    python benchmarks/bench_mixture.py --documents 200000 --budget 2000000000 --steps 200
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill import IndexedDatasetBuilder, Mixture, MixtureLoader, World, _core
from tokenmill.index.mixture_plan import weight_thresholds


def write_source(prefix: str, documents: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sigma = 1.2
    lengths = np.maximum(1, rng.lognormal(np.log(1000) - sigma**2 / 2, sigma, documents))
    lengths = lengths.astype(np.int64)
    tokens = rng.integers(0, 50_000, int(lengths.sum()), dtype=np.uint16)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_documents(tokens, lengths)
    builder.finalize(prefix + ".idx")


def main(evidence: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=20_000, help="per source")
    parser.add_argument("--budget", type=int, default=40_000_000, help="tokens over both phases")
    parser.add_argument("--chunk-tokens", type=int, default=4096)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    out = np.empty(1 << 22, dtype=np.int32)
    thresholds = weight_thresholds([0.5, 0.3, 0.2])
    start = time.perf_counter()
    _core.draw_chunk_sources(thresholds, (1, 0), 0, 0, 0, out)
    draw_ns = (time.perf_counter() - start) / out.size * 1e9

    with tempfile.TemporaryDirectory() as root:
        names = ["web", "code", "math"]
        for seed, name in enumerate(names):
            write_source(str(Path(root, name)), args.documents, seed)
        half = args.budget // 2
        config = {
            "chunk_tokens": args.chunk_tokens,
            "exhaustion": "drop",
            "sources": {name: str(Path(root, name)) for name in names},
            "phases": [
                {"name": "main", "tokens": half, "weights": {"web": 0.6, "code": 0.3, "math": 0.1}},
                {"name": "anneal", "tokens": args.budget - half,
                 "weights": {"web": 0.2, "code": 0.4, "math": 0.4}},
            ],
        }  # fmt: skip
        start = time.perf_counter()
        mixture = Mixture(config)
        open_s = time.perf_counter() - start
        start = time.perf_counter()
        mixture.report()
        demand_s = time.perf_counter() - start
        chunks = args.budget // args.chunk_tokens

        rows = []
        for world_size in (1, 8):
            loader = MixtureLoader(
                mixture, args.sequence_length, args.global_batch,
                world=World(rank=0, world_size=world_size),
            )  # fmt: skip
            start = time.perf_counter()
            taken = 0
            for _, batch in zip(range(args.steps), loader):
                taken += batch["tokens"].numel()
            elapsed = time.perf_counter() - start
            rows.append((world_size, taken / elapsed, args.steps / elapsed))

        state = {**loader.state_dict()}
        state["mixture"] = {**state["mixture"]}
        resumed = MixtureLoader(mixture, args.sequence_length, args.global_batch)
        start = time.perf_counter()
        resumed.load_state_dict(state)
        next(iter(resumed))
        resume_ms = (time.perf_counter() - start) * 1e3

    print(f"draws: {draw_ns:.0f} ns/chunk")
    print(f"open 3 sources x {args.documents} documents: {open_s:.2f} s")
    print(f"demand over {args.budget:,} tokens ({chunks:,} chunks): {demand_s:.3f} s")
    for world_size, tokens_per_s, steps_per_s in rows:
        print(
            f"loader rank 0 of {world_size}: {tokens_per_s / 1e6:.1f} M tokens/s read, "
            f"{steps_per_s:.1f} global steps/s"
        )
    print(f"resume (load_state_dict + first batch): {resume_ms:.1f} ms")
    if evidence is not None:
        evidence.runs.extend(
            {"world_size": world, "tokens_per_second": tokens, "steps_per_second": steps}
            for world, tokens, steps in rows
        )
        evidence.summary.update(
            parameters=vars(args),
            draw_ns_per_chunk=draw_ns,
            open_seconds=open_s,
            demand_seconds=demand_s,
            demand_chunks=chunks,
            resume_ms=resume_ms,
        )


if __name__ == "__main__":
    from evidence import recorded

    with recorded("mixture") as evidence:
        main(evidence)
