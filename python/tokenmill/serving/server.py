"""Serving a batch: allocate the outputs, let datasets fill their rows, collate into tensors.

A dataset is *servable* when it implements :class:`Servable`: it names its `BatchLayout` and
fills rows of a batch in that layout (GPTDataset with one C++ gather call, PackedDataset with
another). :class:`BatchServer` does the rest, the same for every dataset:

1. take the batch's arrays from their owner: the reuse pool (`tokenmill.serving.buffers`), a
   shared-memory block inside a DataLoader worker (`tokenmill.serving.shared`: the batch then
   pickles as that one block, which is reused once the main process is done with it), or
   page-locked memory;
2. ask each dataset to fill its rows (a blend asks each member present in the batch for the rows
   it supplies; all share one layout), with two gather threads for a batch of 1 MiB or more
   outside DataLoader workers (`tokenmill.common.threads`);
3. wrap the arrays as tensors without copying and let the layout build the batch dict;
4. end the pool's loan of the arrays (their tensors now keep them from being reused).

A server belongs to one process (it is rebuilt after pickling: datasets keep it out of their
state) and is thread-safe: loader threads may serve batches from one server at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from tokenmill.common import threads
from tokenmill.serving.buffers import BufferPool, Buffers, allocate
from tokenmill.serving.layout import BatchLayout
from tokenmill.serving.shared import BlockBuffers, SharedBlockPool, batch_in_block

if TYPE_CHECKING:
    import torch

__all__ = ["BatchServer", "Servable"]

# A batch whose outputs reach this size is gathered by _GATHER_THREADS threads.
_PARALLEL_GATHER_BYTES = threads.PARALLEL_GATHER_BYTES
_GATHER_THREADS = threads.default_gather_threads()

# Bumped in every forked child. A server made in a process is inherited by the DataLoader workers
# it forks; what it found out about its process (not a worker) and the buffers it owns must not
# carry over, or a dataset served once in the main process before its loader starts would serve
# its workers' batches from private buffers (torch then copies each tensor into a segment of its
# own and sends each one's descriptor: 0.5x the workers' shared-block rate, benchmarks/SERVING.md).
# A counter rather than comparing os.getpid() on every buffers() call: getpid is a system call
# (glibc >= 2.25 stopped caching it); measured 2026-11-28 with timeit, the check costs 0.08 us
# with the counter and 0.9 us with getpid (load 15), against ~16 us to serve one sample.
_FORK_GENERATION = 0


def _forked() -> None:
    global _FORK_GENERATION
    _FORK_GENERATION += 1


os.register_at_fork(after_in_child=_forked)


@runtime_checkable
class Servable(Protocol):
    """A dataset that `BatchServer` can serve in batches."""

    def batch_layout(self) -> BatchLayout | None:
        """The layout of this dataset's batches, or None when it cannot fill batch buffers
        (its batches are then stacked from `__getitem__` samples)."""
        ...

    def fill_batch(
        self,
        indices: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64] | None,
        buffers: Mapping[str, npt.NDArray[Any]],
        *,
        num_threads: int = 1,
    ) -> None:
        """Write samples `indices` into rows `rows` (None: rows 0..len(indices)-1) of every
        field of `buffers` (arrays of `batch_layout()`'s fields).

        Raises:
            IndexError: an index is out of range (nothing is returned; the rows may be
                partly written).
        """
        ...


class BatchServer:
    """The batches of one layout in this process: their buffers and their tensors.

    Args:
        layout: the layout every dataset this server fills from shares.
    """

    def __init__(self, layout: BatchLayout) -> None:
        import torch

        self.torch = torch
        self.layout = layout
        self.fields = layout.fields()
        self.pool = BufferPool()
        self.shared: SharedBlockPool | None = None
        self.worker: bool | None = None
        self.generation = _FORK_GENERATION

    def in_worker(self) -> bool:
        """Whether this process is a torch DataLoader worker (found out once per process: a
        forked child, a worker among them, starts afresh with buffers of its own)."""
        if self.generation != _FORK_GENERATION:
            self.generation = _FORK_GENERATION
            self.worker = None
            self.pool = BufferPool()
            self.shared = None  # the parent's blocks: never written from here
        worker = self.worker
        if worker is None:
            from torch.utils.data import get_worker_info

            worker = self.worker = get_worker_info() is not None
        return bool(worker)

    def buffers(self, count: int, *, pin_memory: bool = False) -> Buffers:
        """Uninitialised `[count, ...]` arrays of every field, owned by the caller (and then by
        the tensors made from them) until they are freed."""
        if not pin_memory and self.in_worker():
            if self.shared is None:
                self.shared = SharedBlockPool(self.fields, self.torch)
            return self.shared.take(count)
        if not pin_memory:
            return self.pool.lend(self.fields, count)
        return allocate(self.fields, count, pin_memory=True, torch=self.torch)

    def gather_threads(self, samples: int, buffers: Buffers) -> int:
        """Threads for gathering `samples` samples into `buffers`."""
        if samples > 1 and not self.in_worker():
            nbytes = sum(array.nbytes for array in buffers.values())
            if nbytes >= _PARALLEL_GATHER_BYTES:
                return _GATHER_THREADS
        return 1

    def tensors(
        self, buffers: Buffers, padding: npt.NDArray[np.bool_] | None
    ) -> dict[str, torch.Tensor]:
        """The batch dict of filled `buffers` (tensors share the arrays' memory); a
        `tokenmill.serving.shared.SharedBatch` when they are a worker's shared block."""
        from_numpy = self.torch.from_numpy
        tensors = {key: from_numpy(array) for key, array in buffers.items()}
        batch = self.layout.collate(tensors, None if padding is None else from_numpy(padding))
        if isinstance(buffers, BlockBuffers) and self.shared is not None:
            return batch_in_block(batch, buffers, self.shared)
        return batch

    def serve(
        self,
        count: int,
        parts: Iterable[tuple[Servable, npt.NDArray[np.int64], npt.NDArray[np.int64] | None]],
        *,
        padding: npt.NDArray[np.bool_] | None = None,
        pin_memory: bool = False,
    ) -> dict[str, torch.Tensor]:
        """A batch of `count` samples.

        Args:
            count: the batch size.
            parts: (dataset, its sample indices, the batch rows they go to, None: all rows).
            padding: `[count]` bool, True for padding samples (None indices), or None.
            pin_memory: allocate the outputs in page-locked memory.

        Returns:
            The batch dict of `layout.collate`.
        """
        buffers = self.buffers(count, pin_memory=pin_memory)
        for dataset, indices, rows in parts:
            threads_for_part = self.gather_threads(int(indices.shape[0]), buffers)
            dataset.fill_batch(indices, rows, buffers, num_threads=threads_for_part)
        return self.tensors(buffers, padding)
