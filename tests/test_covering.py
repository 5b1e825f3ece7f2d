"""The covering-design generator the differential suites draw their cases from."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from covering import SuiteCoverage, all_pairs, pairs_of, pairwise_cases, product_size


@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=9),
    st.integers(0, 2**16),
)
def test_every_pair_meets_in_some_case(sizes: list[int], seed: int) -> None:
    dimensions = {f"d{i}": list(range(size)) for i, size in enumerate(sizes)}
    cases = pairwise_cases(dimensions, seed)
    covered = set().union(*(pairs_of(case, dimensions) for case in cases))
    assert covered == all_pairs(dimensions)
    for case in cases:  # every case sets every dimension to one of its values
        assert list(case) == list(dimensions)
        assert all(case[name] in values for name, values in dimensions.items())
    assert len(cases) <= product_size(dimensions)


def test_seven_flags_and_categories_need_far_fewer_cases_than_the_product() -> None:
    dimensions: dict[str, list[object]] = {f"flag{i}": [False, True] for i in range(7)}
    dimensions |= {"corpus": list("abcde"), "split": [0, 1, 2], "kind": list("xyz")}
    cases = pairwise_cases(dimensions)
    assert set().union(*(pairs_of(c, dimensions) for c in cases)) == all_pairs(dimensions)
    assert 15 <= len(cases) <= 30  # at least 5 x 3; the product is 5,760
    assert pairwise_cases(dimensions) == cases  # deterministic for a seed


def test_repeat_meets_every_pair_that_many_times() -> None:
    dimensions = {"a": [1, 2, 3], "b": [True, False], "c": ["x", "y"]}
    cases = pairwise_cases(dimensions, repeat=3)
    for pair in all_pairs(dimensions):
        assert sum(pair in pairs_of(case, dimensions) for case in cases) >= 3


def test_bad_dimensions_are_refused() -> None:
    with pytest.raises(ValueError, match="'a' has no values"):
        pairwise_cases({"a": [], "b": [1]})
    with pytest.raises(ValueError, match="'a' repeats a value"):
        pairwise_cases({"a": [1, 1], "b": [1]})


def test_report_counts_refusals_and_empty_datasets_apart() -> None:
    dimensions = {"a": [1, 2], "b": ["x", "y"]}
    coverage = SuiteCoverage(dimensions)
    cases = list(itertools.product([1, 2], ["x", "y"]))
    for number, (a, b) in enumerate(cases):
        outcome = "compared" if number < 2 else "refused" if number == 2 else "empty"
        coverage.record(number, {"a": a, "b": b}, outcome)
    lines = coverage.lines("toy")
    assert lines[0].startswith(
        "toy: 2/4 pairs compared (50.0%), 4 draws of 4 cases: 2 compared, 1 refused"
    )
    assert "1 zero-length" in lines[0]
    assert "pairs no compared case reached (2)" in lines[2]
    with pytest.raises(ValueError, match="unknown outcome"):
        coverage.record(9, {"a": 1, "b": "x"}, "skipped")
