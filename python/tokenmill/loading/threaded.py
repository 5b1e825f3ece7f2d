"""A batch loader whose workers are threads: no worker processes, no shared-memory hand-over.

A torch DataLoader with worker processes pays, per batch, a queue round trip, a fresh
shared-memory segment and the page faults of both processes touching it: on a 2-core machine that
costs more than gathering the batch (benchmarks/SERVING.md). tokenmill's batched fetch
(`__getitems__`) spends its time in C++ with the GIL released, so threads run it in parallel, and
each batch arrives in the calling process with nothing left to copy.

`ThreadedBatchLoader` keeps the DataLoader habits: batches of `batch_size` indices from a sampler
(or `range(len(dataset))`, optionally shuffled per epoch), yielded in order as dicts of batched
tensors, `len()`, `set_epoch()`, and `state_dict()` / `load_state_dict()` for exact resume
within an epoch. Datasets without `__getitems__` work too (their samples are fetched one by one
and stacked by torch's default collate, under the GIL).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenmill.serving.batch import collate

__all__ = ["ThreadedBatchLoader"]


class ThreadedBatchLoader:
    """Batches of a map-style dataset, fetched ahead by `num_workers` threads, in order.

    Args:
        dataset: a map-style dataset, ideally with `__getitems__` (GPTDataset, BlendedDataset).
        batch_size: samples per batch.
        num_workers: fetching threads (0: fetch in the iterating thread, no prefetch).
        prefetch: batches in flight ahead of the consumer (default: 2 per worker).
        sampler: the sample indices of one epoch, in order (default: every index).
        shuffle: permute the indices every epoch (seeded by `seed` and the epoch).
        seed: the shuffle's seed.
        drop_last: drop the final incomplete batch.
        pin_memory: copy batches into page-locked memory (needs an accelerator).

    Raises:
        ValueError: a non-positive batch size, negative worker or prefetch counts, or both a
            sampler and `shuffle`.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        num_workers: int = 2,
        prefetch: int | None = None,
        sampler: Iterable[int] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        pin_memory: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if prefetch is not None and prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if sampler is not None and shuffle:
            raise ValueError("sampler and shuffle=True exclude each other")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.prefetch = prefetch if prefetch is not None else max(1, 2 * num_workers)
        self.sampler = sampler
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pin_memory = pin_memory
        self.epoch = 0
        self._yielded = 0  # batches yielded in the current epoch
        self._skip = 0  # batches to skip at the next iteration (a loaded state)

    def __len__(self) -> int:
        # The number of indices, without drawing a shuffle or walking a sized sampler.
        sampler = self.sampler
        if sampler is None:
            count = len(self.dataset)
        elif isinstance(sampler, Sized):
            count = len(sampler)
        else:
            count = sum(1 for _ in sampler)
        if self.drop_last:
            return count // self.batch_size
        return -(-count // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose shuffle the next iteration uses (like DistributedSampler)."""
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """The position: the epoch and the batches of it already yielded."""
        return {"epoch": self.epoch, "batches_yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resumes at `state`: the next iteration starts with the first batch not yet yielded.

        Raises:
            ValueError: the state is not a mapping, a field is missing, negative or not an int
                (a bool is not), or more batches were yielded than the epoch has (a state from
                another dataset or batch size would resume at the end, yielding nothing).
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"a loader state must be a mapping, got {type(state).__name__}")
        for key in ("epoch", "batches_yielded"):
            value = state.get(key)
            if type(value) is not int or value < 0:
                raise ValueError(
                    f"loader state field {key!r} must be an int >= 0, got {str(value)[:80]!r}"
                )
        # (a sampler without a length is not walked here: it may be endless)
        batches = len(self) if self.sampler is None or isinstance(self.sampler, Sized) else None
        if batches is not None and state["batches_yielded"] > batches:
            raise ValueError(
                f"loader state field 'batches_yielded' = {state['batches_yielded']} is more than "
                f"the {batches} batches of an epoch: the state belongs to another dataset or "
                "batch size"
            )
        self.epoch = state["epoch"]
        self._skip = state["batches_yielded"]
        self._yielded = self._skip

    def _indices(self) -> Sequence[int]:
        if self.sampler is not None:
            return list(self.sampler)
        if not self.shuffle:
            return range(len(self.dataset))
        import numpy as np

        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))
        indices: list[int] = order.tolist()
        return indices

    def _batches(self) -> Iterator[list[int]]:
        indices = self._indices()
        size = self.batch_size
        for start in range(0, len(indices), size):
            batch = list(indices[start : start + size])
            if len(batch) < size and self.drop_last:
                return
            yield batch

    def _fetch(self, batch: list[int]) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        fetched = getitems(batch) if getitems is not None else [self.dataset[i] for i in batch]
        result = collate(fetched)
        if self.pin_memory:
            result = _pinned(result)
        return result

    def __iter__(self) -> Iterator[Any]:
        batches = self._batches()
        skip, self._skip = self._skip, 0
        self._yielded = skip
        if skip:
            batches = itertools.islice(batches, skip, None)
        if self.num_workers == 0:
            for batch in batches:
                result = self._fetch(batch)
                self._yielded += 1
                yield result
            return
        pending: deque[Future[Any]] = deque()
        with ThreadPoolExecutor(self.num_workers, thread_name_prefix="tokenmill-loader") as pool:
            try:
                for batch in itertools.islice(batches, self.prefetch):
                    pending.append(pool.submit(self._fetch, batch))
                while pending:
                    result = pending.popleft().result()
                    following = next(batches, None)
                    if following is not None:
                        pending.append(pool.submit(self._fetch, following))
                    self._yielded += 1
                    yield result
            finally:
                for future in pending:
                    future.cancel()


def _pinned(value: Any) -> Any:
    """`value` with every tensor in page-locked memory (dicts and lists walked)."""
    if isinstance(value, dict):
        return {key: _pinned(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_pinned(item) for item in value)
    pin = getattr(value, "pin_memory", None)
    return pin() if pin is not None else value
