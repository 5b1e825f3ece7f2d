"""Batches that leave a DataLoader worker process: one shared-memory block each, reused once the
receiving process has let go of it.

A torch DataLoader worker hands every batch to the main process through shared memory. Left to
torch, each tensor of a batch is copied into a fresh shared-memory segment (allocated, then
zero-filled page by page as it is written) and each segment's descriptor is sent separately (a
socket round trip each). For a 32 x 2048-token batch that is ~2 ms of worker time per batch on
the 2-core dev VM, against 0.15 ms for the C++ gather itself (benchmarks/SERVING.md). Here:

* a worker's batch arrays are carved from one block of shared memory (`SharedBlockPool`): a
  64-byte header, then every field, 64-byte aligned; the gather writes straight into it;
* the collated batch is a :class:`SharedBatch` (a dict of tensors over the block), which pickles
  as the block (one descriptor) plus where each tensor lies in it; the receiving process
  rebuilds a plain dict of tensors over the same memory (`rebuild_shared_batch`), copying
  nothing;
* blocks are reused instead of reallocated. A block is *lent* when its batch is pickled (its
  header word goes from FREE to LENT) and comes back when the receiving process has dropped every
  tensor of the batch and every view of one: the receiver builds each tensor with
  `torch.from_numpy` over its own numpy array, whose lifetime is exactly that of the tensor's
  storage (views share it), and a `weakref.finalize` on the last of those arrays writes FREE into
  the header. The worker takes a block again only when its header says FREE and no array it handed out
  in this process (a new array object per take, counted by weak reference callbacks) is alive.

Ordering: the receiver's last reads of a batch happen before its tensors' storages are released
(torch's reference counts are atomic read-modify-writes with acquire-release order) and the FREE
store comes after that release; the worker reads FREE under the GIL and writes the new batch in
a C++ call entered through a GIL hand-off (a full barrier). The header therefore needs no fence
of its own.

A batch that is never rebuilt here (a custom `collate_fn` that unpacks it, a batch dropped at
shutdown) leaves its block lent: the pool keeps at most `SharedBlockPool.PER_SIZE` blocks per
batch size, stops waiting for a loan after `SharedBlockPool.STALE_TAKES` further batches (the
block is then left to the receiver, never written again), and allocates beyond that, so memory
stays bounded and no block is ever written while another process may read it. The receiver
keeps the mappings of its last few returned blocks (`_RECENT_MAPPINGS`), so a reused block
arrives as torch's cached mapping: no new map and no page faults per batch.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tokenmill.serving.layout import Field

if TYPE_CHECKING:
    import torch

__all__ = ["BlockBuffers", "SharedBatch", "SharedBlockPool", "rebuild_shared_batch"]

FREE = 0
"""Header word: the block is not read by any other process (the worker may write it)."""
LENT = 1
"""Header word: a batch in the block was sent; the receiver sets FREE when done with it."""

_HEADER_BYTES = 64
_ALIGNMENT = 64
# Receiving side: how many returned blocks keep their mapping (a reused block is then torch's
# cached mapping). Their pages are the worker's pool pages: shared, not extra memory.
_RECENT_MAPPINGS = 16


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGNMENT) * _ALIGNMENT


@dataclass(eq=False)
class SharedBlock:
    """One block of shared memory: header word, then every field's `[count, *shape]` array.

    Attributes:
        block: a uint8 tensor over the whole shared storage (what is sent).
        header: the header word (int64 view of the first 8 bytes).
        arrays: the field arrays the gather fills (numpy views of the block).
        count: samples per batch.
        lent_at: the pool's take counter when the block was last lent (-1: not lent).
        local_outstanding: arrays handed out in this process by the last `take` that are still
            alive (each `take` hands out new array objects over `arrays`; a weak reference
            callback counts each one's end, so no reference count is consulted).
    """

    block: torch.Tensor
    header: npt.NDArray[np.int64]
    arrays: dict[str, npt.NDArray[Any]]
    count: int
    lent_at: int = -1
    local_outstanding: int = 0
    _refs: list[Any] = field(default_factory=list)
    _lock: Any = field(default_factory=threading.Lock)

    def locally_unreferenced(self) -> bool:
        """Whether no tensor or view in this process uses the arrays of the last `take` (a
        tensor made with `torch.from_numpy` keeps its array alive until its storage is freed)."""
        return self.local_outstanding == 0

    def lend_locally(self) -> dict[str, npt.NDArray[Any]]:
        """New array objects over the field arrays, counted until each is freed."""
        views = {key: array.view() for key, array in self.arrays.items()}
        with self._lock:
            self.local_outstanding = len(views)
        self._refs = [weakref.ref(view, self._local_end) for view in views.values()]
        return views

    def _local_end(self, _ref: object) -> None:
        with self._lock:
            self.local_outstanding -= 1


class BlockBuffers(dict[str, npt.NDArray[Any]]):
    """A batch's field arrays in a `SharedBlock` (what `BatchServer.buffers` gives a worker)."""

    block: SharedBlock


class SharedBlockPool:
    """The shared-memory blocks of one layout in one worker process (thread-safe).

    Args:
        fields: the layout's fields.
        torch: the torch module.
    """

    PER_SIZE = 6
    """Blocks kept per batch size: the batch being consumed, the prefetched ones, spares."""
    STALE_TAKES = 256
    """Batches after which a block still lent is given up on (left to its receiver)."""

    def __init__(self, fields: tuple[Field, ...], torch: Any) -> None:
        self.fields = fields
        self.torch = torch
        self._blocks: dict[int, list[SharedBlock]] = {}
        self._takes = 0
        self._lock = threading.Lock()

    def take(self, count: int) -> BlockBuffers:
        """The arrays of a block for `count` samples that no other process reads."""
        with self._lock:
            self._takes += 1
            blocks = self._blocks.setdefault(count, [])
            # give up on loans that never came back (the receiver keeps what it maps)
            blocks[:] = [
                block
                for block in blocks
                if not (
                    int(block.header[0]) == LENT and self._takes - block.lent_at > self.STALE_TAKES
                )
            ]
            chosen = None
            for block in blocks:
                if int(block.header[0]) == FREE and block.locally_unreferenced():
                    chosen = block
                    break
            if chosen is None:
                chosen = self._allocate(count)
                if len(blocks) < self.PER_SIZE:
                    blocks.append(chosen)
        buffers = BlockBuffers(chosen.lend_locally())
        buffers.block = chosen
        return buffers

    def mark_lent(self, block: SharedBlock) -> None:
        """Record that `block`'s batch is being sent to another process."""
        block.header[0] = LENT
        block.lent_at = self._takes

    def _allocate(self, count: int) -> SharedBlock:
        torch = self.torch
        offsets = []
        total = _HEADER_BYTES
        for spec in self.fields:
            total = _aligned(total)
            offsets.append(total)
            total += int(np.prod(spec.shape, dtype=np.int64)) * count * spec.dtype.itemsize
        storage = torch.UntypedStorage._new_shared(total)
        block = torch.empty(0, dtype=torch.uint8).set_(storage)
        raw = block.numpy()
        header = raw[:8].view(np.int64)
        header[0] = FREE
        arrays = {}
        for spec, offset in zip(self.fields, offsets):
            shape = (count, *spec.shape)
            size = int(np.prod(shape, dtype=np.int64)) * spec.dtype.itemsize
            arrays[spec.key] = raw[offset : offset + size].view(spec.dtype).reshape(shape)
        return SharedBlock(block, header, arrays, count)


class SharedBatch(dict[str, Any]):
    """A batch dict built in a worker over one `SharedBlock`: pickles as the block.

    Tensors that lie in the block travel as (offset, dtype, shape); any other value (a dense
    attention mask built by the layout) is pickled as usual.
    """

    block: SharedBlock | None
    pool: SharedBlockPool | None

    def copy(self) -> SharedBatch:
        """A shallow copy that still pickles as the block."""
        other = SharedBatch(self)
        other.block = getattr(self, "block", None)
        other.pool = getattr(self, "pool", None)
        return other

    def __reduce__(self) -> Any:
        block = getattr(self, "block", None)
        pool = getattr(self, "pool", None)
        if block is None or pool is None:
            return (dict, (dict(self),))
        base = block.block.data_ptr()
        end = base + block.block.numel()
        spec: list[tuple[str, Any]] = []
        in_block = False
        for key, value in self.items():
            located = None
            if getattr(value, "is_contiguous", None) is not None and value.is_contiguous():
                start = value.data_ptr()
                nbytes = value.numel() * value.element_size()
                if base <= start and start + nbytes <= end and nbytes > 0:
                    dtype = value.detach().numpy().dtype
                    located = (start - base, dtype.str, tuple(value.shape))
            if located is None:
                spec.append((key, ("value", value)))
            else:
                spec.append((key, ("block", located)))
                in_block = True
        if not in_block:
            return (dict, (dict(self),))
        pool.mark_lent(block)
        return (rebuild_shared_batch, (block.block, tuple(spec)))


_RELEASE_LOCK = threading.Lock()


class _Loan:
    """The receiving side of one lent block: FREE once every tensor of the batch is gone."""

    __slots__ = ("block", "outstanding")

    def __init__(self, block: torch.Tensor, outstanding: int) -> None:
        self.block = block
        self.outstanding = outstanding

    def release_one(self) -> None:
        # finalizers run in whichever thread drops a batch's last tensor (main, pin thread)
        with _RELEASE_LOCK:
            self.outstanding -= 1
            done = self.outstanding == 0
        if done:
            self.block.numpy()[:8].view(np.int64)[0] = FREE
            _remember_mapping(self.block)


_RECENT: OrderedDict[int, Any] = OrderedDict()
_RECENT_LOCK = threading.Lock()


def _remember_mapping(block: torch.Tensor) -> None:
    """Keep the mapping of a returned block so its next batch maps nothing new."""
    storage = block.untyped_storage()
    with _RECENT_LOCK:
        _RECENT[storage.data_ptr()] = storage
        _RECENT.move_to_end(storage.data_ptr())
        while len(_RECENT) > _RECENT_MAPPINGS:
            _RECENT.popitem(last=False)


def rebuild_shared_batch(
    block: torch.Tensor, spec: tuple[tuple[str, tuple[str, Any]], ...]
) -> dict[str, Any]:
    """The batch dict of a `SharedBatch` in the receiving process: tensors over the block.

    Each tensor is `torch.from_numpy` of an array of its own; when all of them (and every view)
    are gone, the block's header is set FREE for the worker to reuse it.
    """
    import torch

    raw = block.numpy()
    result: dict[str, Any] = {}
    arrays = []
    for key, (kind, value) in spec:
        if kind == "block":
            offset, dtype_name, shape = value
            dtype = np.dtype(dtype_name)
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            array = raw[offset : offset + size].view(dtype).reshape(shape)
            arrays.append(array)
            result[key] = torch.from_numpy(array)
        else:
            result[key] = value
    loan = _Loan(block, len(arrays))
    for array in arrays:
        weakref.finalize(array, loan.release_one).atexit = False
    return result


def batch_in_block(
    tensors: Mapping[str, Any], buffers: BlockBuffers, pool: SharedBlockPool
) -> SharedBatch:
    """`tensors` (the collated batch over `buffers`) as a `SharedBatch` of their block."""
    batch = SharedBatch(tensors)
    batch.block = buffers.block
    batch.pool = pool
    return batch
