"""Who owns a batch's output arrays, and when they may be written again.

A batched gather writes straight into the arrays its tensors will wrap (`torch.from_numpy`, no
copy), so the arrays belong to the batch until its consumer lets go. Three owners:

* the main process, not pinned: a :class:`BufferPool` of recently used sets per batch size. A
  fresh multi-MB allocation costs its page faults on every batch (more than the gather at
  S=2048); a pooled set is reused once nothing but the pool references its arrays;
* a DataLoader worker process: :func:`allocate_shared` carves every array from ONE shared-memory
  block, so the worker hands the batch to the main process as one segment (torch sends one
  descriptor per storage, each a socket round trip) and nothing is copied;
* pinned (page-locked) memory: :func:`allocate` asks torch for it, fresh per batch (torch's
  caching host allocator recycles it).

The pool's reuse rule lives in one method, :meth:`BufferPool._unreferenced`: a CPython reference
count test (every tensor, view or shared-memory copy of an array adds a reference). It is the
seam where an explicit release (the consumer returning the batch) can replace the heuristic.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tokenmill.serving.layout import Field

if TYPE_CHECKING:
    import torch

__all__ = ["BufferPool", "Buffers", "SharedBuffers", "allocate", "allocate_shared"]

Buffers = dict[str, npt.NDArray[Any]]


class SharedBuffers(Buffers):
    """Arrays carved from one shared-memory block, with the torch views of the same memory (the
    batch's tensors must be these views, not `from_numpy` copies, to stay in the block)."""

    views: dict[str, torch.Tensor]


class BufferPool:
    """Recently used batch buffers, reused once only the pool still references them.

    Thread-safe: a set handed out by `take` is lent (never handed out again) until `release`,
    which the caller runs once its tensors reference the arrays (or the fill failed), so two
    loader threads never fill the same buffers.
    """

    # A few sets per batch size: the batch being consumed, the ones being prefetched, spares.
    _PER_SIZE = 6

    def __init__(self) -> None:
        self._sets: dict[int, list[Buffers]] = {}
        self._lent: set[int] = set()
        self._lock = threading.Lock()

    @staticmethod
    def _unreferenced(buffers: Buffers) -> bool:
        """Whether nothing outside the pool references any array of `buffers`."""
        # 3 = the pool's dict + the loop variable `values` + getrefcount's argument; any tensor
        # (torch.from_numpy) or view of the array adds to this.
        return all(sys.getrefcount(values) <= 3 for values in buffers.values())

    def take(self, count: int) -> Buffers | None:
        """A free set for `count` samples, lent to the caller, or None."""
        with self._lock:
            for buffers in self._sets.get(count, ()):
                if id(buffers) in self._lent:
                    continue
                if self._unreferenced(buffers):
                    self._lent.add(id(buffers))
                    return buffers
            return None

    def add(self, count: int, buffers: Buffers) -> None:
        """Keeps a new set (lent to the caller, like `take`'s) if there is room."""
        with self._lock:
            sets = self._sets.setdefault(count, [])
            if len(sets) < self._PER_SIZE:
                sets.append(buffers)
                self._lent.add(id(buffers))

    def release(self, buffers: Buffers) -> None:
        """Ends the loan of `buffers` (a no-op for buffers the pool does not hold)."""
        with self._lock:
            self._lent.discard(id(buffers))


def allocate(
    fields: tuple[Field, ...], count: int, *, pin_memory: bool, torch: Any = None
) -> Buffers:
    """Uninitialised `[count, *shape]` arrays, page-locked (through `torch`) when pinning
    (scratch fields never are)."""
    buffers: Buffers = {}
    for field in fields:
        shape = (count, *field.shape)
        if pin_memory and not field.scratch:
            torch_dtype = torch.from_numpy(np.empty(0, field.dtype)).dtype
            tensor = torch.empty(shape, dtype=torch_dtype, pin_memory=True)
            buffers[field.key] = tensor.numpy()
        else:
            buffers[field.key] = np.empty(shape, dtype=field.dtype)
    return buffers


def allocate_shared(fields: tuple[Field, ...], count: int, torch: Any) -> SharedBuffers:
    """`[count, *shape]` arrays carved from one shared-memory block (64-byte aligned)."""
    offsets = []
    total = 0
    for field in fields:
        total = -(-total // 64) * 64
        offsets.append(total)
        total += int(np.prod(field.shape)) * count * field.dtype.itemsize
    storage = torch.UntypedStorage._new_shared(max(total, 1))
    block = torch.empty(0, dtype=torch.uint8).set_(storage)
    raw = block.numpy()
    buffers = SharedBuffers()
    buffers.views = {}
    for field, offset in zip(fields, offsets):
        shape = (count, *field.shape)
        size = int(np.prod(shape)) * field.dtype.itemsize
        buffers[field.key] = raw[offset : offset + size].view(field.dtype).reshape(shape)
        torch_dtype = torch.from_numpy(np.empty(0, field.dtype)).dtype
        buffers.views[field.key] = block[offset : offset + size].view(torch_dtype).view(shape)
    return buffers
