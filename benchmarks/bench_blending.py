"""Blending kernels: tokenmill against megatron-core 0.19, same weights, same process.

Runs megatron-core's compiled ``helpers_cpp`` (loaded straight from its install folder, so torch
is never imported) and tokenmill's kernels on identical inputs, checks that the outputs are
equal element for element, and prints ns/sample and the speed-up for each case. Outputs are
allocated and touched before timing, so page faults are not counted for either side.

    python benchmarks/bench_blending.py               # the full table (a few minutes)
    python benchmarks/bench_blending.py --scale 0.05  # a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import numpy as np
import numpy.typing as npt

from tokenmill import _core

# (datasets, samples): greedy at megatron's weak points (spec §7 item 4), exhaustive comparable.
GREEDY = [(10, 100_000_000), (100, 100_000_000), (1000, 10_000_000)]
EXHAUSTIVE = [(10, 20_000_000), (100, 10_000_000), (1000, 1_000_000)]


def load_megatron_helpers() -> ModuleType:
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("megatron-core is not installed: pip install --no-deps megatron-core==0.19.2")
    folder = Path(next(iter(spec.submodule_search_locations))) / "core" / "datasets"
    library = min(folder.glob("helpers_cpp*.so"))
    module_spec = importlib.util.spec_from_file_location("helpers_cpp", library)
    if module_spec is None or module_spec.loader is None:
        sys.exit(f"cannot load {library}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def make_weights(kind: str, n: int, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    if kind == "uniform":
        raw = rng.random(n)
    elif kind == "equal":
        raw = np.ones(n)
    else:  # lognormal: dataset sizes spread over orders of magnitude, as real corpora are
        raw = rng.lognormal(0.0, 2.0, n)
    result: npt.NDArray[np.float64] = raw / raw.sum()  # as BlendedDataset normalises
    return result


def outputs(size: int) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.int64]]:
    ids = np.empty(size, dtype=np.int16)
    positions = np.empty(size, dtype=np.int64)
    ids.fill(0)  # fault the pages in before timing
    positions.fill(0)
    return ids, positions


Run = Callable[[np.ndarray, np.ndarray], None]


def megatron_greedy(helpers: ModuleType, weights: np.ndarray, size: int) -> Run:
    def run(ids: np.ndarray, positions: np.ndarray) -> None:
        helpers.build_blending_indices(ids, positions, weights, weights.size, size, False)

    return run


def megatron_exhaustive(helpers: ModuleType, sizes: np.ndarray) -> Run:
    def run(ids: np.ndarray, positions: np.ndarray) -> None:
        helpers.build_exhaustive_blending_indices(ids, positions, sizes, sizes.size)

    return run


def compare(
    theirs: Run,
    ours: Run,
    size: int,
) -> tuple[float, float, bool]:
    """Seconds for megatron, seconds for tokenmill, and whether the outputs are identical."""
    seconds = []
    results = []
    for run in (theirs, ours):
        ids, positions = outputs(size)
        start = time.perf_counter()
        run(ids, positions)
        seconds.append(time.perf_counter() - start)
        results.append((ids, positions))
    (their_ids, their_pos), (our_ids, our_pos) = results
    equal = np.array_equal(our_ids, their_ids) and np.array_equal(our_pos, their_pos)
    return seconds[0], seconds[1], equal


def row(label: str, size: int, ours: float, theirs: float, equal: bool) -> str:
    return (
        f"| {label:<28} | {size:>12,} | {theirs * 1e9 / size:>10.1f} | {ours * 1e9 / size:>10.1f} "
        f"| {theirs / ours:>7.1f}x | {'yes' if equal else 'NO':>5} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every sample count")
    parser.add_argument(
        "--weights",
        choices=["lognormal", "uniform", "equal"],
        nargs="+",
        default=["lognormal", "uniform"],
        help="weight distributions for the greedy cases",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    helpers = load_megatron_helpers()
    rng = np.random.default_rng(args.seed)
    print(f"python {platform.python_version()}, numpy {np.__version__}, scale {args.scale}")
    print(
        "| case                         |      samples | megatron ns/sample | tokenmill ns/sample | speed-up | equal |"
    )
    print("|---|---:|---:|---:|---:|:---:|")
    all_equal = True
    for kind in args.weights:
        for n, samples in GREEDY:
            size = max(1, int(samples * args.scale))
            weights = make_weights(kind, n, rng)
            theirs, ours, equal = compare(
                megatron_greedy(helpers, weights, size),
                partial(_core.build_blending_indices, weights),
                size,
            )
            all_equal &= equal
            print(row(f"greedy {n} datasets, {kind}", size, ours, theirs, equal), flush=True)
    for n, samples in EXHAUSTIVE:
        shares = rng.lognormal(0.0, 2.0, n)
        total_wanted = max(n, int(samples * args.scale))
        sizes = np.maximum(1, np.round(shares / shares.sum() * total_wanted)).astype(np.int64)
        size = int(sizes.sum())
        theirs, ours, equal = compare(
            megatron_exhaustive(helpers, sizes),
            partial(_core.build_exhaustive_blending_indices, sizes),
            size,
        )
        all_equal &= equal
        print(row(f"exhaustive {n} datasets", size, ours, theirs, equal), flush=True)
    if not all_equal:
        print("OUTPUTS DIFFER", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from evidence import recorded

    with recorded("blending"):
        status = main()
    sys.exit(status)
