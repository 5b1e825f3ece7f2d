"""Packing waste and planning speed: tokenmill's planners beside nanochat's BOS best-fit rule.

Documents have lognormal lengths (mean ~1000 tokens, sigma 1.2: a heavy tail up to ~100k),
rows are 2048 tokens. For each packer the table shows the share of row tokens that hold no
data (padding, inserted BOS tokens) and the share of document tokens thrown away:

* nanochat's rule (reimplemented here from its documented algorithm, on the same documents):
  every row starts with BOS; from a buffer of 1000 documents take the largest that fits, and
  when none fits crop the shortest to fill the row exactly and discard the rest;
* tokenmill best-fit decreasing (PackedDataset's default): whole documents, long ones cut into
  2048-token windows, padding at the end of rows;
* tokenmill BOS-aligned: full rows like nanochat's, but the cropped remainder starts a later row
  behind one inserted BOS instead of being thrown away.

    python benchmarks/bench_packing.py                    # 200k documents; planning 10M
    python benchmarks/bench_packing.py --documents 50000 --planning-documents 1000000
"""

from __future__ import annotations

import argparse
import bisect
import time

import numpy as np

from tokenmill.index.packing import plan_packing


def lognormal_lengths(count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sigma = 1.2
    values = rng.lognormal(np.log(1000) - sigma**2 / 2, sigma, count)
    return np.maximum(1, values).astype(np.int32)


def nanochat_best_fit(lengths: np.ndarray, row_length: int, buffer_size: int = 1000) -> dict:
    """nanochat's BOS best-fit: every row full, cropped tails discarded."""
    stream = iter((int(length) + 1) for length in lengths)  # +1: the BOS nanochat prepends
    buffer: list[int] = []

    def refill() -> None:
        while len(buffer) < buffer_size:
            nxt = next(stream, None)
            if nxt is None:
                return
            bisect.insort(buffer, nxt)

    kept = dropped = rows = 0
    refill()
    while buffer:
        room = row_length
        while room > 0 and buffer:
            position = bisect.bisect_right(buffer, room)
            if position > 0:
                length = buffer.pop(position - 1)
                kept += length
                room -= length
                refill()
            else:
                length = buffer.pop(0)  # the shortest document, cropped to fill the row
                kept += room
                dropped += length - room
                room = 0
                refill()
        rows += 1
        if room:
            break  # the data ran out: a last partial row is not emitted
    total = int(lengths.sum()) + len(lengths)
    return {"rows": rows, "waste": 0.0, "dropped": dropped / total}


def tokenmill_plan(lengths: np.ndarray, row_length: int, bos_aligned: bool) -> dict:
    plan = plan_packing(lengths, row_length, bos_aligned=bos_aligned, num_threads=2)
    row_tokens = plan.num_rows * row_length
    return {
        "rows": plan.num_rows,
        "waste": (plan.padding + plan.inserted_bos) / row_tokens,
        "dropped": 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--planning-documents", type=int, default=10_000_000)
    parser.add_argument("--row-length", type=int, default=2048)
    args = parser.parse_args()
    lengths = lognormal_lengths(args.documents)
    print(
        f"{args.documents:,} documents, mean {lengths.mean():.0f} tokens, max {lengths.max():,}, "
        f"rows of {args.row_length}"
    )
    rows = [
        ("nanochat BOS best-fit", nanochat_best_fit(lengths, args.row_length)),
        ("tokenmill best-fit decreasing", tokenmill_plan(lengths, args.row_length, False)),
        ("tokenmill BOS-aligned", tokenmill_plan(lengths, args.row_length, True)),
    ]
    print("| packer | rows | padding + inserted BOS (of row tokens) | dropped (of data tokens) |")
    print("|---|---|---|---|")
    for name, result in rows:
        print(
            f"| {name} | {result['rows']:,} | {100 * result['waste']:.2f} % "
            f"| {100 * result['dropped']:.2f} % |"
        )
    big = lognormal_lengths(args.planning_documents, seed=1)
    for bos_aligned in (False, True):
        started = time.perf_counter()
        plan = plan_packing(big, args.row_length, bos_aligned=bos_aligned, num_threads=2)
        seconds = time.perf_counter() - started
        mode = "BOS-aligned" if bos_aligned else "best-fit decreasing"
        print(
            f"planning {args.planning_documents:,} documents ({mode}, 2 threads): {seconds:.2f} s, "
            f"{plan.num_rows:,} rows"
        )


if __name__ == "__main__":
    from evidence import recorded

    with recorded("packing"):
        main()
