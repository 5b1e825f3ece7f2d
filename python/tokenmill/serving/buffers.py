"""Who owns a batch's output arrays, and when they may be written again.

A batched gather writes straight into the arrays its tensors will wrap (`torch.from_numpy`, no
copy), so the arrays belong to the batch until its consumer lets go. Three owners:

* the main process, not pinned: a :class:`BufferPool` of recently used sets per batch size. A
  fresh multi-MB allocation costs its page faults on every batch (more than the gather at
  S=2048); a pooled set is reused once nothing but the pool references its arrays;
* a DataLoader worker process: `tokenmill.serving.shared` carves every array from one
  shared-memory block, sent to the main process as one segment and reused once it is done;
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
    pass

__all__ = ["BufferPool", "Buffers", "allocate"]

Buffers = dict[str, npt.NDArray[Any]]


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
