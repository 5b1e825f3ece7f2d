"""Rank coordination through torch.distributed, without importing torch.

If torch has not been imported, no process group can exist, so the checks below cost nothing
for single-process users and keep `import tokenmill` free of torch.

Who builds a missing cache: with scope "global" the process of global rank 0 (megatron-core's
rule); with scope "node" the first process of every node (local rank 0), for caches on
node-local disks. The index build is deterministic, so every node writes the same bytes.

Builders and the other ranks meet in :func:`build_then_share`, not a bare barrier: it carries
each builder's outcome, so when a builder fails every rank raises its exception (type and
message) at once, instead of waiting out the collective timeout or dying of a broken connection.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "barrier",
    "build_then_share",
    "get_rank",
    "get_world_size",
    "is_cache_builder",
    "is_initialized",
    "local_rank",
]


def _dist() -> Any | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def is_initialized() -> bool:
    """True when a torch.distributed process group is running in this process."""
    return _dist() is not None


def get_rank() -> int:
    """Global rank, 0 without a process group."""
    dist = _dist()
    return 0 if dist is None else int(dist.get_rank())


def get_world_size() -> int:
    """Number of ranks, 1 without a process group."""
    dist = _dist()
    return 1 if dist is None else int(dist.get_world_size())


def barrier() -> None:
    """torch.distributed.barrier() when a process group exists, else nothing."""
    dist = _dist()
    if dist is not None:
        dist.barrier()


def local_rank() -> int:
    """Rank within the node: LOCAL_RANK (torchrun), SLURM_LOCALID, else derived from the group."""
    for variable in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        value = os.environ.get(variable)
        if value is not None and value.strip().isdigit():
            return int(value)
    dist = _dist()
    if dist is None:
        return 0
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if local_world and local_world.isdigit() and int(local_world) > 0:
        return int(dist.get_rank()) % int(local_world)
    return int(dist.get_rank())


def is_cache_builder(scope: str = "global") -> bool:
    """Whether this process builds and writes missing index caches."""
    if not is_initialized():
        return True
    return get_rank() == 0 if scope == "global" else local_rank() == 0


_T = TypeVar("_T")


class CacheBuildError(RuntimeError):
    """A builder's exception that could not travel to the other ranks as itself (it does not
    survive pickling): its type and message, as text."""


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives a pickle round trip (what broadcast_object_list does), else a
    CacheBuildError with its type and message."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if isinstance(copy, BaseException):
            copy.__traceback__ = None
            return copy
    except Exception:  # any failure to pickle means: send it as text
        pass
    return CacheBuildError(f"{type(error).__module__}.{type(error).__name__}: {error}")


def build_then_share(work: Callable[[], _T] | None) -> _T | None:
    """Run `work` on the ranks that pass one (the cache builders), then let every rank know
    whether all of them succeeded. Every rank must call it, in the same order.

    Two small collectives: an all-reduce of the lowest failing rank, then, only on failure, a
    broadcast of that rank's exception. Without a process group, `work` just runs.

    Returns:
        `work()`'s result, or None on ranks without work.

    Raises:
        The first failing rank's exception, on every rank (a rank whose own work failed raises
        its own). A note names the rank it came from.
    """
    dist = _dist()
    if dist is None:
        return None if work is None else work()
    result: _T | None = None
    error: BaseException | None = None
    if work is not None:
        try:
            result = work()
        except Exception as caught:  # every rank must reach the collective below
            error = caught
    torch = sys.modules["torch"]
    rank, world = int(dist.get_rank()), int(dist.get_world_size())
    device = torch.device("cpu")
    if str(dist.get_backend()) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    first = torch.tensor([rank if error is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    failed = int(first.item())
    if failed == world:
        return result
    payload: list[Any] = [_portable(error) if rank == failed and error is not None else None]
    dist.broadcast_object_list(payload, src=failed)
    if error is not None:
        raise error
    shared = payload[0]
    if not isinstance(shared, BaseException):  # defensive: the protocol always sends one
        shared = CacheBuildError(f"rank {failed} failed to build the index caches")
    if hasattr(shared, "add_note"):  # Python 3.11+
        shared.add_note(
            f"(raised on rank {failed}, which builds the index caches; rank {rank} stops with "
            "the same error)"
        )
    raise shared
