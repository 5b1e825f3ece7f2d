"""Loading a mixture: global steps cut into rank slices, resumable under any topology.

A *step* is ``global_batch_size`` samples of ``sequence_length`` tokens, the next
``global_batch_size * sequence_length`` tokens of the mixture's stream. Sample ``j`` of a step is
tokens ``[j * S, (j + 1) * S)`` of it; rank ``r`` of ``W`` gets samples
``[r * B / W, (r + 1) * B / W)`` as one ``[B / W, S]`` batch per step (split it into micro-batches
for gradient accumulation). A sample is plain tokens: ``input_ids = tokens[:, :-1]``,
``labels = tokens[:, 1:]`` (or ask for ``sequence_length + 1``).

DataLoader workers take steps round-robin (worker ``w`` of ``n`` yields steps ``w, w + n, ...``),
which torch's DataLoader hands back in step order. Every worker walks every step's chunk draws
(cheap arithmetic) but reads only its own tokens.

The state after a step is the mixture cursor: ``(position, segment_start, ledger)``. Nothing in it
depends on world size, workers, batch size or sequence length, so a run can resume with all four
changed and still read every token of every source exactly once per epoch, in its shuffled order.
:class:`MixtureLoader` speaks torchdata's ``StatefulDataLoader`` protocol (``state_dict()`` after
the last batch it yielded, ``load_state_dict()`` before iterating). :class:`MixtureDataset` may
also sit inside a ``torchdata.stateful_dataloader.StatefulDataLoader`` itself (same topology on
resume, as that loader requires); its batches carry ``batch["mixture_state"]``, the global state
after the step, which :meth:`MixtureLoader.load_state_dict` accepts under any topology.

A source that runs dry under the halt policy raises SourceExhaustedError on every rank at the
same step, before that step is delivered, so ``state_dict()`` is consistent when it is raised (the
error raised by MixtureLoader also carries it as ``error.state``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from tokenmill.common import distributed
from tokenmill.common.world import World
from tokenmill.datasets.mixture import Mixture
from tokenmill.index.mixture_plan import SourceExhaustedError, iter_pieces

__all__ = ["MixtureDataset", "MixtureLoader"]

_LOADER_FORMAT = "tokenmill.MixtureLoader"
_DATASET_FORMAT = "tokenmill.MixtureDataset"


def _positive(value: int, name: str) -> int:
    value = operator.index(value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


class MixtureDataset(IterableDataset):  # type: ignore[misc]
    """One rank's steps of a mixture, as an IterableDataset (use ``batch_size=None``).

    Each item is ``{"tokens": int64 [B / W, S], "source_ids": int16 [B / W, S],
    "mixture_state": dict}`` (``source_ids`` only with ``return_source_ids``).

    Args:
        mixture: the mixture (or anything Mixture accepts).
        sequence_length: tokens per sample (S).
        global_batch_size: samples per step over all ranks (B), a multiple of the world size.
        world: rank and world size (default: torch.distributed when the dataset is built, so
            build it after init_process_group); DataLoader worker fields come from torch.
        return_source_ids: also return the source of every token (per-source losses).

    Raises:
        ValueError: a size is < 1 or B is not a multiple of the world size.
    """

    def __init__(
        self,
        mixture: Mixture | Any,
        sequence_length: int,
        global_batch_size: int,
        *,
        world: World | None = None,
        return_source_ids: bool = True,
    ) -> None:
        super().__init__()
        self.mixture = mixture if isinstance(mixture, Mixture) else Mixture(mixture)
        self.sequence_length = _positive(sequence_length, "sequence_length")
        self.global_batch_size = _positive(global_batch_size, "global_batch_size")
        if return_source_ids and len(self.mixture.sources) > np.iinfo(np.int16).max:
            raise ValueError(
                f"source_ids are int16: {len(self.mixture.sources)} sources do not fit "
                "(pass return_source_ids=False)"
            )
        if world is None and distributed.is_initialized():
            # fixed now: DataLoader workers started by spawn have no process group to ask
            world = World(rank=distributed.get_rank(), world_size=distributed.get_world_size())
        self.world = world
        self.return_source_ids = return_source_ids
        self._state: dict[str, Any] = self.mixture.state_of(self.mixture.cursor())
        self._skip: int | None = None  # steps to pass before the next yield; None: worker id

    @property
    def step_tokens(self) -> int:
        """Tokens per global step: B * S."""
        return self.global_batch_size * self.sequence_length

    def _world(self) -> World:
        world = World.current(self.world)
        if self.global_batch_size % world.world_size:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of the world size "
                f"{world.world_size}"
            )
        return world

    def state_dict(self) -> dict[str, Any]:
        """The global mixture state after the last step this instance yielded."""
        return {"format": _DATASET_FORMAT, "mixture": dict(self._state), "skip": self._skip}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a dataset state, a loader state or a bare mixture state.

        A bare mixture state (any topology) restarts the round-robin at worker 0; a dataset state
        (from a StatefulDataLoader worker of the same topology) keeps its worker's turn.
        """
        skip = None
        if state.get("format") == _DATASET_FORMAT:
            skip = state.get("skip")
            state = state["mixture"]
        elif state.get("format") == _LOADER_FORMAT:
            state = state["mixture"]
        cursor = self.mixture.cursor(state)  # checks it
        self._state = self.mixture.state_of(cursor)
        self._skip = None if skip is None else operator.index(skip)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        world = self._world()
        per_rank = self.global_batch_size // world.world_size
        rank_tokens = per_rank * self.sequence_length
        first = world.rank * rank_tokens
        cursor = self.mixture.cursor(self._state)
        skip = world.worker_id if self._skip is None else self._skip
        while cursor.remaining >= self.step_tokens:
            pieces = cursor.advance(self.step_tokens)  # raises at the same step on every rank
            if skip > 0:
                skip -= 1
                continue
            skip = world.num_workers - 1
            tokens = np.empty(rank_tokens, dtype=np.int64)
            sources = np.empty(rank_tokens, dtype=np.int16) if self.return_source_ids else None
            self.mixture.read(
                list(iter_pieces(pieces, first, first + rank_tokens)), tokens, sources
            )
            state = self.mixture.state_of(cursor)
            self._state, self._skip = state, skip
            item: dict[str, Any] = {
                "tokens": torch.from_numpy(tokens.reshape(per_rank, self.sequence_length)),
                "mixture_state": state,
            }
            if sources is not None:
                item["source_ids"] = torch.from_numpy(
                    sources.reshape(per_rank, self.sequence_length)
                )
            yield item


class MixtureLoader:
    """A resumable loader of a mixture's steps for this rank (StatefulDataLoader protocol).

    Args:
        mixture: the mixture (or anything Mixture accepts: config, dict, path).
        sequence_length: tokens per sample.
        global_batch_size: samples per step over all ranks (a multiple of the world size).
        num_workers: DataLoader worker processes (0: load in this process).
        world: rank and world size (default: torch.distributed at iteration time).
        return_source_ids: also return each token's source index (``batch["source_ids"]``).
        **loader_options: passed to torch.utils.data.DataLoader (pin_memory, prefetch_factor,
            multiprocessing_context, ...).

    Iterating yields ``{"tokens": [B / W, S] int64, "source_ids": [B / W, S] int16}`` per step;
    a second ``iter()`` continues where the last batch left off.
    """

    def __init__(
        self,
        mixture: Mixture | Any,
        sequence_length: int,
        global_batch_size: int,
        *,
        num_workers: int = 0,
        world: World | None = None,
        return_source_ids: bool = True,
        **loader_options: Any,
    ) -> None:
        self.num_workers = operator.index(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        self.dataset = MixtureDataset(
            mixture,
            sequence_length,
            global_batch_size,
            world=world,
            return_source_ids=return_source_ids,
        )
        self.world = world
        self.loader_options = loader_options
        self._state = self.dataset.state_dict()["mixture"]

    @property
    def mixture(self) -> Mixture:
        return self.dataset.mixture

    def __iter__(self) -> Iterator[dict[str, Any]]:
        base = self.world if self.world is not None else World.current()
        dataset = MixtureDataset(
            self.dataset.mixture,
            self.dataset.sequence_length,
            self.dataset.global_batch_size,
            world=World(rank=base.rank, world_size=base.world_size),
            return_source_ids=self.dataset.return_source_ids,
        )
        dataset.load_state_dict(self._state)
        loader = DataLoader(
            dataset, batch_size=None, num_workers=self.num_workers, **self.loader_options
        )
        try:
            for batch in loader:
                self._state = batch.pop("mixture_state")
                yield batch
        except SourceExhaustedError as error:
            # what a trainer saves before stopping: the state after the last batch delivered
            error.state = self.state_dict()
            raise

    def state_dict(self) -> dict[str, Any]:
        """The state after the last batch yielded: topology-free (position, segment, ledger)."""
        return {
            "format": _LOADER_FORMAT,
            "mixture": dict(self._state),
            # for the record only: a resume may change any of these
            "sequence_length": self.dataset.sequence_length,
            "global_batch_size": self.dataset.global_batch_size,
            "num_workers": self.num_workers,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a loader state, a dataset state or a bare mixture state.

        Raises:
            ValueError: the state is not a mixture state or does not fit this mixture.
        """
        if state.get("format") in (_LOADER_FORMAT, _DATASET_FORMAT):
            state = state["mixture"]
        cursor = self.mixture.cursor(state)
        self._state = self.mixture.state_of(cursor)

    @property
    def ledger(self) -> dict[str, int]:
        """Tokens consumed per source after the last batch yielded."""
        return dict(self._state["ledger"])

    @property
    def position(self) -> int:
        """Tokens of the stream consumed after the last batch yielded."""
        return int(self._state["position"])
