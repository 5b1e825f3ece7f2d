"""Who owns a batch's output arrays, and when they may be written again.

A batched gather writes straight into the arrays its tensors will wrap (`torch.from_numpy`, no
copy), so the arrays belong to the batch until its consumer lets go. Three owners:

* the main process, not pinned: a :class:`BufferPool` of recently used memory per batch size. A
  fresh multi-MB allocation costs its page faults on every batch (more than the gather at
  S=2048), so memory is reused, but only once it is provably free;
* a DataLoader worker process: `tokenmill.serving.shared` carves every array from one
  shared-memory block, sent to the main process as one segment and reused once it is done;
* pinned (page-locked) memory: :func:`allocate` asks torch for it, fresh per batch (torch's
  caching host allocator recycles it).

The pool's rule is ownership, not reference counting: the pool keeps only the *backing* memory of
a free set. A loan hands out new array objects that view it, each with a ``weakref.finalize``;
the memory returns to the free list when the last of them is freed. Every tensor made from them
(``torch.from_numpy``), every slice or view of such a tensor and every ``tensor.numpy()`` keeps
its array object alive through the tensor's storage, so memory a live tensor can reach is never
lent again, whatever the interpreter's reference counts look like (CPython 3.14's borrowed
references and free-threaded builds report different counts; the earlier ``sys.getrefcount``
rule depended on them).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.serving.layout import Field

__all__ = ["BufferPool", "Buffers", "allocate"]

Buffers = dict[str, npt.NDArray[Any]]


class BufferPool:
    """Recently used batch memory, lent as fresh arrays and returned when they are freed.

    Thread-safe. A set handed out by :meth:`lend` is never handed out again while any of its
    arrays (or a tensor or view made from one) is alive; the finalizers that return it may run on
    any thread (wherever the last reference is dropped), so the free lists are guarded by a lock
    that a finalizer may take while the same thread is inside :meth:`lend` (an RLock).
    """

    # A few free sets per batch size: the batch being consumed, the ones being prefetched, spares.
    _PER_SIZE = 6

    def __init__(self) -> None:
        self._free: dict[tuple[int, tuple[Field, ...]], list[Buffers]] = {}
        self._loans: set[_Loan] = set()  # lent sets, kept alive until returned
        self._lock = threading.RLock()
        self.allocations = 0  # sets allocated (not reused): for tests and benchmarks

    def lend(self, fields: tuple[Field, ...], count: int) -> Buffers:
        """Uninitialised `[count, *shape]` arrays of `fields`, reusing free memory if any."""
        key = (count, fields)
        with self._lock:
            free = self._free.get(key)
            backing = free.pop() if free else None
        if backing is None:
            backing = {field.key: np.empty((count, *field.shape), field.dtype) for field in fields}
            self.allocations += 1
        # New array objects over the backing memory: these (not the backing) are what tensors
        # made from the batch keep alive.
        buffers: Buffers = {key_: array.view() for key_, array in backing.items()}
        _Loan(self, key, backing, buffers)
        return buffers

    def _give_back(self, loan: _Loan) -> None:
        with self._lock:
            self._loans.discard(loan)
            free = self._free.setdefault(loan.key, [])
            if len(free) < self._PER_SIZE:
                free.append(loan.backing)

    def free_sets(self, count: int) -> int:
        """Free sets held for batches of `count` samples (all layouts)."""
        with self._lock:
            return sum(len(sets) for (size, _), sets in self._free.items() if size == count)


class _Loan:
    """One lent set: its backing returns to the pool when every lent array has been freed.

    Weak references with callbacks (cheaper than ``weakref.finalize``, which also registers an
    exit hook); the pool holds the loan, and the loan its weak references, until it is returned.
    """

    __slots__ = ("__weakref__", "backing", "key", "lock", "pool", "refs", "remaining")

    def __init__(
        self,
        pool: BufferPool,
        key: tuple[int, tuple[Field, ...]],
        backing: Buffers,
        lent: Buffers,
    ) -> None:
        self.pool = pool
        self.key = key
        self.backing = backing
        self.remaining = len(lent)
        self.lock = threading.Lock()
        with pool._lock:
            pool._loans.add(self)
        self.refs = [weakref.ref(array, self._returned_one) for array in lent.values()]

    def _returned_one(self, _ref: object) -> None:
        with self.lock:
            self.remaining -= 1
            done = self.remaining == 0
        if done:
            self.pool._give_back(self)


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
