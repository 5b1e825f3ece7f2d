"""Which source feeds each token of a mixture's stream: chunk draws, ledger, exhaustion.

The stream is one global sequence of tokens, the same for every rank, worker, batch size and
sequence length. It is cut into *chunks* of ``chunk_tokens`` tokens, counted from the start of
each phase (or of the current *segment*, below); a phase's last chunk may be shorter. Chunk ``k``
of phase ``i`` is drawn from one source::

    u = Philox4x64-10(key=(seed, i), counter=(k, segment_start, draw, 0))[0] >> 11   # 53 bits
    source = first s with u < threshold[s]        # thresholds: cumulative weights * 2^53

so the source of any position is computable without replaying the stream (O(1) per chunk, about
0.1 µs in C++; `_core.draw_chunk_sources`). Within a source the tokens follow that source's
shuffled document order (see `tokenmill.datasets.mixture`): the stream only says *how many*
tokens each chunk takes from which source, and the **ledger** (tokens consumed so far, per source)
says where in the source they start. A position's state is therefore just
``(position, segment_start, ledger)``.

Segments. A run that resumes with the same mixture continues the same segment, so the stream is
identical to an uninterrupted one. A run that resumes with other weights or phases starts a new
segment at the resume position: chunks are counted from there and drawn with the new weights, and
every source continues from its ledger, so no token of any source is repeated or skipped.

Worked example: ``chunk_tokens = 4``, phases of 10 and 6 tokens. Phase 0's chunks are tokens
[0, 4), [4, 8), [8, 10) (chunks 0, 1, 2) and phase 1's are [10, 14), [14, 16). If chunk 1 of
phase 0 is drawn from source A and A's ledger is 37 when the stream reaches token 4, tokens 4..7
of the stream are A's tokens 37..40. A resume at token 13 with new weights starts a segment
there: phase 1's chunks become [13, 16) (chunk 0 of the new segment), drawn with counter
(0, 13, 0, 0), while tokens 10..12 keep the draws of the old segment.

Exhaustion. A source holds ``tokens x epochs`` tokens. Under ``"halt"`` a chunk that needs more
than its source has left raises :class:`SourceExhaustedError` before any of it is consumed.
Under ``"drop"`` the source gives what it has left, then leaves: the rest of that chunk and later
chunks are drawn among the sources that still have tokens, with the weights renormalised and a
fresh draw (``draw`` = number of exhausted sources), so the choice still depends only on
``(position, segment_start, ledger)``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.errors import TokenmillError

__all__ = [
    "THRESHOLD_ONE",
    "MixtureCursor",
    "MixturePlan",
    "Piece",
    "SourceExhaustedError",
    "weight_thresholds",
]

THRESHOLD_ONE = 1 << 53
_DRAW_BLOCK = 4096  # chunks drawn per kernel call


class SourceExhaustedError(TokenmillError, RuntimeError):
    """A source ran dry under the ``halt`` policy (or every source of a phase did).

    The stream stops *before* the step that needed the missing tokens, so the loader's
    ``state_dict()`` still describes the last step delivered: save it, then resume with more
    data, other weights or ``exhaustion = "drop"``. Raised by MixtureLoader, ``state`` holds that
    state.
    """

    state: dict[str, Any] | None = None


def weight_thresholds(weights: Sequence[float]) -> npt.NDArray[np.uint64]:
    """Cumulative weight shares as integers in [0, 2^53]: ``ceil(2^53 * cumsum / total)``.

    Computed in exact rational arithmetic, so ``u53 < threshold[s]`` holds exactly when
    ``u53 / 2^53 < cumsum[s] / total``; the last threshold is 2^53 and a source of weight 0
    repeats the threshold before it, so no draw picks it.

    Raises:
        ValueError: no weight is > 0, or a weight is negative or not finite.
    """
    values = [float(w) for w in weights]
    if not values or any(not math.isfinite(w) or w < 0 for w in values):
        raise ValueError(f"weights must be finite and >= 0, got {values}")
    total = sum(Fraction(w) for w in values)
    if total <= 0:
        raise ValueError(f"weights need one value > 0, got {values}")
    thresholds, cumulative = [], Fraction(0)
    for w in values:
        cumulative += Fraction(w)
        share = cumulative * THRESHOLD_ONE / total
        thresholds.append(-(-share.numerator // share.denominator))  # ceil
    return np.asarray(thresholds, dtype=np.uint64)


@dataclass(frozen=True)
class Piece:
    """``length`` tokens of source ``source`` from its stream offset ``offset`` (the ledger)."""

    source: int
    offset: int
    length: int


class MixturePlan:
    """The arithmetic of a mixture: phase boundaries, token weights, inventories, draws.

    Args:
        source_names: the sources, in config order.
        inventories: tokens each source may give (its tokens x epochs).
        phase_names, phase_tokens: the phases and their token budgets.
        phase_weights: per phase, one token weight per source (0: not in the phase).
        seed: Philox key word 0.
        chunk_tokens: tokens per chunk.
        exhaustion: ``"halt"`` or ``"drop"``.
    """

    def __init__(
        self,
        source_names: Sequence[str],
        inventories: Sequence[int],
        phase_names: Sequence[str],
        phase_tokens: Sequence[int],
        phase_weights: Sequence[Sequence[float]],
        seed: int,
        chunk_tokens: int,
        exhaustion: str,
    ) -> None:
        self.source_names = tuple(source_names)
        self.inventories = tuple(int(v) for v in inventories)
        self.phase_names = tuple(phase_names)
        self.phase_weights = tuple(tuple(float(w) for w in row) for row in phase_weights)
        self.seed = int(seed)
        self.chunk_tokens = int(chunk_tokens)
        self.exhaustion = exhaustion
        self.phase_ends: list[int] = []
        total = 0
        for tokens in phase_tokens:
            total += int(tokens)
            self.phase_ends.append(total)
        self.total_tokens = total
        self._thresholds: dict[tuple[int, frozenset[int]], npt.NDArray[np.uint64]] = {}
        self._draws: dict[tuple[int, int, int, frozenset[int], int], npt.NDArray[np.int32]] = {}

    def phase_start(self, phase: int) -> int:
        return 0 if phase == 0 else self.phase_ends[phase - 1]

    def phase_at(self, position: int) -> int:
        """The phase holding token ``position`` (< total_tokens)."""
        return bisect.bisect_right(self.phase_ends, position)

    def thresholds(self, phase: int, excluded: frozenset[int]) -> npt.NDArray[np.uint64] | None:
        """The draw thresholds of ``phase`` without the ``excluded`` sources (None: nothing left)."""
        key = (phase, excluded)
        if key not in self._thresholds:
            weights = [0.0 if s in excluded else w for s, w in enumerate(self.phase_weights[phase])]
            if not any(w > 0 for w in weights):
                return None
            self._thresholds[key] = weight_thresholds(weights)
        return self._thresholds[key]

    def draw_chunks(
        self, phase: int, segment_start: int, excluded: frozenset[int], first: int, count: int
    ) -> npt.NDArray[np.int32]:
        """Sources of chunks ``first .. first + count - 1`` of ``phase`` in a segment."""
        from tokenmill import _core
        from tokenmill.common.core_call import core_call

        thresholds = self.thresholds(phase, excluded)
        if thresholds is None:
            raise ValueError(f"phase {self.phase_names[phase]!r} has no source left")
        out = np.empty(count, dtype=np.int32)
        core_call(
            _core.draw_chunk_sources,
            thresholds,
            (self.seed, phase),
            segment_start,
            len(excluded),
            first,
            out,
        )
        return out

    def chunk_source(
        self, phase: int, segment_start: int, excluded: frozenset[int], chunk: int
    ) -> int:
        """The source of one chunk (cached in blocks of draws)."""
        block, within = divmod(chunk, _DRAW_BLOCK)
        key = (phase, segment_start, len(excluded), excluded, block)
        draws = self._draws.get(key)
        if draws is None:
            if len(self._draws) > 64:
                self._draws.clear()
            draws = self.draw_chunks(
                phase, segment_start, excluded, block * _DRAW_BLOCK, _DRAW_BLOCK
            )
            self._draws[key] = draws
        return int(draws[within])

    def chunk_bounds(self, position: int, segment_start: int) -> tuple[int, int, int, int]:
        """(phase, chunk number, chunk start, chunk end) of the chunk holding ``position``."""
        phase = self.phase_at(position)
        start = max(segment_start, self.phase_start(phase))
        chunk = (position - start) // self.chunk_tokens
        first = start + chunk * self.chunk_tokens
        return phase, chunk, first, min(first + self.chunk_tokens, self.phase_ends[phase])

    def demand(self, cursor: MixtureCursor) -> npt.NDArray[np.int64]:
        """Tokens per phase and source the rest of the stream asks for, ignoring exhaustion.

        Exact under the halt policy: the chunks are drawn exactly as the loader draws them.
        Returns an int64 array [phases, sources]; phases before ``cursor`` are zero. Cost: one
        draw per chunk left (about 0.1 µs each).
        """
        demand = np.zeros((len(self.phase_names), len(self.source_names)), dtype=np.int64)
        position = cursor.position
        chunks = -(-max(self.total_tokens - position, 0) // self.chunk_tokens) + len(
            self.phase_names
        )
        if chunks > MAX_DEMAND_CHUNKS:
            # config-driven work: refuse it up front instead of running for hours without output
            raise ValueError(
                f"planning the demand of {self.total_tokens - position:,} tokens in chunks of "
                f"{self.chunk_tokens:,} draws {chunks:,} chunks, more than {MAX_DEMAND_CHUNKS:,} "
                "(minutes of work); raise chunk_tokens or lower the phases' tokens"
            )
        nothing: frozenset[int] = frozenset()
        while position < self.total_tokens:
            phase, chunk, _, end = self.chunk_bounds(position, cursor.segment_start)
            # the (partial) chunk holding the position
            demand[phase, self.chunk_source(phase, cursor.segment_start, nothing, chunk)] += (
                end - position
            )
            position = end
            phase_end = self.phase_ends[phase]
            if position >= phase_end:
                continue
            full, tail = divmod(phase_end - position, self.chunk_tokens)
            first = chunk + 1
            block = 1 << 20
            for offset in range(0, full, block):
                count = min(block, full - offset)
                sources = self.draw_chunks(
                    phase, cursor.segment_start, nothing, first + offset, count
                )
                demand[phase] += (
                    np.bincount(sources, minlength=len(self.source_names)) * self.chunk_tokens
                )
            if tail:
                last = self.chunk_source(phase, cursor.segment_start, nothing, first + full)
                demand[phase, last] += tail
            position = phase_end
        return demand


MAX_DEMAND_CHUNKS = 1 << 31
"""The most chunks :meth:`MixturePlan.demand` draws (about 3 minutes at 0.1 µs each)."""


class MixtureCursor:
    """A position in a mixture's stream: ``(position, segment_start, ledger)``.

    ``advance(n)`` returns the pieces of the next ``n`` tokens and moves the cursor past them.
    """

    def __init__(
        self,
        plan: MixturePlan,
        position: int = 0,
        segment_start: int = 0,
        ledger: Sequence[int] | None = None,
    ) -> None:
        self.plan = plan
        self.position = int(position)
        self.segment_start = int(segment_start)
        self.ledger = [0] * len(plan.source_names) if ledger is None else [int(v) for v in ledger]
        if len(self.ledger) != len(plan.source_names):
            raise ValueError(
                f"ledger has {len(self.ledger)} entries for {len(plan.source_names)} sources"
            )
        if not 0 <= self.segment_start <= self.position <= plan.total_tokens:
            raise ValueError(
                f"position {self.position} (segment start {self.segment_start}) is outside the "
                f"mixture's budget of {plan.total_tokens} tokens"
            )

    def copy(self) -> MixtureCursor:
        return MixtureCursor(self.plan, self.position, self.segment_start, self.ledger)

    @property
    def remaining(self) -> int:
        """Tokens left in the budget."""
        return self.plan.total_tokens - self.position

    def _excluded(self) -> frozenset[int]:
        if self.plan.exhaustion != "drop":
            return frozenset()
        return frozenset(
            s
            for s, (used, held) in enumerate(zip(self.ledger, self.plan.inventories))
            if used >= held
        )

    def advance(self, tokens: int) -> list[Piece]:
        """The pieces of the next ``tokens`` tokens, in stream order; moves the cursor.

        Raises:
            ValueError: fewer than ``tokens`` tokens are left in the budget.
            SourceExhaustedError: a source ran dry (halt policy) or a phase has no source left;
                the cursor is left unchanged.
        """
        plan = self.plan
        if tokens < 0 or tokens > self.remaining:
            raise ValueError(
                f"cannot take {tokens} tokens at position {self.position}: the mixture's budget "
                f"of {plan.total_tokens} tokens has {self.remaining} left"
            )
        position, ledger = self.position, list(self.ledger)
        excluded = self._excluded()
        pieces: list[Piece] = []
        left = tokens
        while left > 0:
            phase, chunk, _, end = plan.chunk_bounds(position, self.segment_start)
            take = min(left, end - position)
            while take > 0:
                if plan.thresholds(phase, excluded) is None:
                    raise SourceExhaustedError(
                        f"every source of phase {plan.phase_names[phase]!r} is exhausted at "
                        f"token {position} of the stream (ledger: {self._ledger_text(ledger)})"
                    )
                source = plan.chunk_source(phase, self.segment_start, excluded, chunk)
                available = plan.inventories[source] - ledger[source]
                if available < take and plan.exhaustion == "halt":
                    raise SourceExhaustedError(
                        f"source {plan.source_names[source]!r} is exhausted: phase "
                        f"{plan.phase_names[phase]!r} needs {take} tokens of it at token "
                        f"{position} of the stream but only {available} of its "
                        f"{plan.inventories[source]} are left (ledger: "
                        f"{self._ledger_text(ledger)}). The loader state still describes the "
                        "last step delivered: save it, then resume with more data, other "
                        "weights or exhaustion = 'drop'"
                    )
                given = min(available, take)
                if given > 0:
                    if (
                        pieces
                        and pieces[-1].source == source
                        and (pieces[-1].offset + pieces[-1].length == ledger[source])
                    ):
                        last = pieces.pop()
                        pieces.append(Piece(source, last.offset, last.length + given))
                    else:
                        pieces.append(Piece(source, ledger[source], given))
                    ledger[source] += given
                    position += given
                    take -= given
                    left -= given
                if plan.exhaustion == "drop" and ledger[source] >= plan.inventories[source]:
                    # dry now (inside this chunk or exactly at its end): later draws leave it out,
                    # as a cursor restarted here would (the exclusions follow from the ledger)
                    excluded = excluded | {source}
        self.position, self.ledger = position, ledger
        return pieces

    def _ledger_text(self, ledger: Sequence[int]) -> str:
        return ", ".join(
            f"{name}={used}/{held}"
            for name, used, held in zip(self.plan.source_names, ledger, self.plan.inventories)
        )

    def state(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "segment_start": self.segment_start,
            "ledger": dict(zip(self.plan.source_names, self.ledger)),
        }


def iter_pieces(pieces: Sequence[Piece], start: int, stop: int) -> Iterator[Piece]:
    """The parts of ``pieces`` (laid end to end from 0) that fall in ``[start, stop)``."""
    at = 0
    for piece in pieces:
        lo, hi = max(start, at), min(stop, at + piece.length)
        if lo < hi:
            yield Piece(piece.source, piece.offset + (lo - at), hi - lo)
        at += piece.length
        if at >= stop:
            return
