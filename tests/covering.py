"""Covering designs for the differential suites, and the coverage report each run prints.

`pairwise_cases` draws test cases so that every pair of (dimension, value) settings meets in at
least one case (a strength-2 covering array), by the greedy one-case-at-a-time construction:
each new case starts from a pair no case covers yet and fills the other dimensions with the
value that covers the most uncovered pairs (ties broken by a seeded generator). It is small,
deterministic for a seed, and tested (tests/test_covering.py); a suite's cases are the design's
rows in order, so `range(len(design))` parametrizes the test.

A suite records every case's outcome through `record`: "compared" (both libraries built and
every output was compared), "refused" (both refused, the refusals compared), or "empty" (a
zero-length dataset: arrays compared, no sample). `pytest_terminal_summary` (conftest.py) prints,
per suite, the pairs the compared cases reached out of the pairs possible, with refusals and
empty datasets counted apart: they never count as comparisons.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Pair = tuple[tuple[str, Any], tuple[str, Any]]

#: "ci" (the default) or "nightly": the larger differential run started by hand
#: (TOKENMILL_DIFFERENTIAL=nightly; its report is committed under tests/reports/).
DIFFERENTIAL_RUN = os.environ.get("TOKENMILL_DIFFERENTIAL", "ci")
NIGHTLY = DIFFERENTIAL_RUN == "nightly"


def all_pairs(dimensions: Mapping[str, Sequence[Any]]) -> set[Pair]:
    """Every pair of settings of two different dimensions."""
    names = list(dimensions)
    return {
        ((a, x), (b, y))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        for x in dimensions[a]
        for y in dimensions[b]
    }


def pairs_of(case: Mapping[str, Any], dimensions: Mapping[str, Sequence[Any]]) -> set[Pair]:
    """The pairs one case covers (its settings of the design's dimensions)."""
    names = list(dimensions)
    return {((a, case[a]), (b, case[b])) for i, a in enumerate(names) for b in names[i + 1 :]}


def pairwise_cases(
    dimensions: Mapping[str, Sequence[Any]], seed: int = 0, repeat: int = 1
) -> list[dict[str, Any]]:
    """Cases covering every pair of settings of `dimensions` (`repeat` > 1: that many designs
    from consecutive seeds, concatenated, so every pair meets at least `repeat` times)."""
    for name, values in dimensions.items():
        if not values:
            raise ValueError(f"dimension {name!r} has no values")
        if len(set(map(repr, values))) != len(values):
            raise ValueError(f"dimension {name!r} repeats a value: {list(values)!r}")
    cases: list[dict[str, Any]] = []
    for round_ in range(repeat):
        cases += _one_design(dimensions, random.Random(seed + round_))
    return cases


def _one_design(
    dimensions: Mapping[str, Sequence[Any]], rng: random.Random
) -> list[dict[str, Any]]:
    names = list(dimensions)
    if len(names) == 1:
        return [{names[0]: value} for value in dimensions[names[0]]]
    uncovered = all_pairs(dimensions)
    cases: list[dict[str, Any]] = []
    while uncovered:
        (first, x), (second, y) = min(uncovered, key=repr)  # deterministic start
        case: dict[str, Any] = {first: x, second: y}
        rest = [name for name in names if name not in case]
        rng.shuffle(rest)
        for name in rest:
            best_gain, best = -1, []
            for value in dimensions[name]:
                gain = sum(
                    1
                    for other, chosen in case.items()
                    if _ordered((name, value), (other, chosen), names) in uncovered
                )
                if gain > best_gain:
                    best_gain, best = gain, [value]
                elif gain == best_gain:
                    best.append(value)
            case[name] = rng.choice(best)
        ordered = {name: case[name] for name in names}
        uncovered -= pairs_of(ordered, dimensions)
        cases.append(ordered)
    return cases


def _ordered(a: tuple[str, Any], b: tuple[str, Any], names: list[str]) -> Pair:
    return (a, b) if names.index(a[0]) < names.index(b[0]) else (b, a)


@dataclass
class SuiteCoverage:
    """What one differential suite's cases reached in this run."""

    dimensions: Mapping[str, Sequence[Any]]
    outcomes: dict[str, dict[tuple[int, int], str]] = field(default_factory=dict)
    settings: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)

    def record(self, number: int, case: Mapping[str, Any], outcome: str, draw: int = 0) -> None:
        """Case `number`'s outcome; `draw` > 0: a case whose incidental draws (corpora,
        weights) were redrawn, with the design's settings kept, after a refusal."""
        if outcome not in ("compared", "refused", "empty"):
            raise ValueError(f"unknown outcome {outcome!r}")
        self.settings[(number, draw)] = {name: case[name] for name in self.dimensions}
        self.outcomes.setdefault(outcome, {})[(number, draw)] = outcome

    def lines(self, name: str) -> list[str]:
        possible = all_pairs(self.dimensions)
        reached: dict[str, set[Pair]] = {}
        counts: dict[str, int] = {}
        for outcome, numbers in self.outcomes.items():
            counts[outcome] = len(numbers)
            reached[outcome] = set().union(
                *(pairs_of(self.settings[n], self.dimensions) for n in numbers)
            )
        compared = reached.get("compared", set())
        run = len(self.settings)
        dims = ", ".join(f"{k}:{len(v)}" for k, v in self.dimensions.items())
        share = 100.0 * len(compared) / len(possible) if possible else 100.0
        text = [
            f"{name}: {len(compared)}/{len(possible)} pairs compared ({share:.1f}%), "
            f"{run} draws of {len({key[0] for key in self.settings})} cases: "
            f"{counts.get('compared', 0)} compared, "
            f"{counts.get('refused', 0)} refused by both (refusals compared), "
            f"{counts.get('empty', 0)} zero-length (arrays only)",
            f"  dimensions ({DIFFERENTIAL_RUN} run): {dims}",
        ]
        missing = sorted(possible - compared, key=repr)
        if missing:
            shown = "; ".join(f"{a[0]}={a[1]!r} & {b[0]}={b[1]!r}" for a, b in missing[:8])
            text.append(f"  pairs no compared case reached ({len(missing)}): {shown}")
        return text


#: suite name -> its coverage in this process (filled by the suites, printed by conftest.py)
SUITES: dict[str, SuiteCoverage] = {}
#: samples where megatron-core failed on cu_seqlens and the sample it would return was compared
#: instead (megatron_compare.expected_cu_seqlens_sample: the one documented difference)
DOCUMENTED_DIFFERENCES: list[str] = []


def suite(name: str, dimensions: Mapping[str, Sequence[Any]]) -> SuiteCoverage:
    if name not in SUITES:
        SUITES[name] = SuiteCoverage(dimensions)
    return SUITES[name]


def report_lines() -> list[str]:
    lines: list[str] = []
    for name in sorted(SUITES):
        if SUITES[name].settings:
            lines += SUITES[name].lines(name)
    if lines:
        lines.append(
            f"samples compared through the documented difference (megatron-core cannot pad "
            f"cu_seqlens with more empty document parts than tokens; tokenmill drops the empty "
            f"parts): {len(DOCUMENTED_DIFFERENCES)}"
        )
    return lines


def product_size(dimensions: Mapping[str, Sequence[Any]]) -> int:
    size = 1
    for values in dimensions.values():
        size *= len(values)
    return size


__all__ = [
    "DIFFERENTIAL_RUN",
    "NIGHTLY",
    "SUITES",
    "all_pairs",
    "pairs_of",
    "pairwise_cases",
    "product_size",
    "report_lines",
    "suite",
]
