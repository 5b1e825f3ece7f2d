"""Which sample indices a map-style dataset will be asked for next, from the ones it was asked for.

Samplers walk a dataset's index space in a regular pattern: a single process reads 0, 1, 2, ...;
under data parallelism megatron's pretraining sampler gives rank r of W the micro-batch slices
``[k*W*m + r*m, k*W*m + (r+1)*m)``, i.e. runs of m consecutive indices that jump by ``W*m``.
:class:`OrderPredictor` learns the run length and the jump from the indices it observes and
extrapolates them, so an object-storage dataset prefetches the samples this rank will read, not
its neighbours' (which would waste ``(W-1)/W`` of the prefetched bytes).

Rules: consecutive indices extend the current run. An index that is not the next one starts a new
run; the jump is the distance between the starts of the last two runs, and the run length is the
length of the run that just ended. With no jump known yet, the prediction is "consecutive".
Predictions never repeat an index and stay in ``[0, count)``. Cost: O(1) per observation, O(n)
per prediction of n indices.
"""

from __future__ import annotations

__all__ = ["OrderPredictor"]


class OrderPredictor:
    """Learns ``runs of m consecutive indices, jumping by J`` and predicts the next indices."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.run_start: int | None = None
        self.run_length = 0
        self.jump: int | None = None
        self.period: int | None = None

    def observe(self, index: int) -> None:
        """Record that ``index`` was just read."""
        if self.last is not None and index == self.last + 1 and self.run_start is not None:
            self.run_length += 1
        else:
            if self.run_start is not None:
                jump = index - self.run_start
                # a new run: learn the jump and the length of the run that ended
                self.jump = jump if jump > self.run_length else None
                self.period = self.run_length
            self.run_start = index
            self.run_length = 1
        self.last = index

    def predict(self, count: int, limit: int) -> list[int]:
        """The next ``count`` indices (fewer near ``limit``), in the order they will be read."""
        if self.last is None or self.run_start is None:
            return []
        if self.jump is None or not self.period or self.run_length > self.period:
            return list(range(self.last + 1, min(limit, self.last + 1 + count)))
        result: list[int] = []
        start, position = self.run_start, self.last + 1
        while len(result) < count:
            if position >= start + self.period:
                start += self.jump
                position = start
            if position >= limit:
                break
            result.append(position)
            position += 1
        return result
