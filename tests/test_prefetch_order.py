"""OrderPredictor: predicts the indices a data-parallel rank reads next from those it has read."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenmill.datasets.prefetch import OrderPredictor


def rank_order(rank: int, ranks: int, micro_batch: int, count: int) -> list[int]:
    """megatron's pretraining sampler: rank r reads slices [k*W*m + r*m, k*W*m + (r+1)*m)."""
    order = []
    for base in range(0, count, ranks * micro_batch):
        start = base + rank * micro_batch
        order.extend(i for i in range(start, start + micro_batch) if i < count)
    return order


@given(
    ranks=st.integers(1, 8),
    micro_batch=st.integers(1, 6),
    data=st.data(),
    depth=st.integers(1, 40),
)
def test_predicts_a_ranks_future_indices(
    ranks: int, micro_batch: int, data: st.DataObject, depth: int
) -> None:
    rank = data.draw(st.integers(0, ranks - 1))
    count = 400
    order = rank_order(rank, ranks, micro_batch, count)
    predictor = OrderPredictor()
    # after two whole runs (and a step into the third) the pattern is known
    seen = min(len(order), 2 * micro_batch + 1)
    for index in order[:seen]:
        predictor.observe(index)
    predicted = predictor.predict(depth, count)
    assert predicted == order[seen : seen + depth]


def test_sequential_and_empty() -> None:
    predictor = OrderPredictor()
    assert predictor.predict(5, 100) == []
    for index in (10, 11, 12):
        predictor.observe(index)
    assert predictor.predict(4, 100) == [13, 14, 15, 16]
    assert predictor.predict(4, 15) == [13, 14]


def test_backward_jump_falls_back_to_consecutive() -> None:
    predictor = OrderPredictor()
    for index in (50, 51, 52, 3):  # a new epoch, or random access
        predictor.observe(index)
    assert predictor.predict(3, 100) == [4, 5, 6]


def test_a_run_longer_than_the_learned_period_is_consecutive() -> None:
    predictor = OrderPredictor()
    for index in (0, 1, 10, 11, 12, 13):  # period 2 learned, then a longer run
        predictor.observe(index)
    assert predictor.predict(3, 100) == [14, 15, 16]
