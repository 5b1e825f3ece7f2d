"""Rank coordination through torch.distributed, without importing torch.

If torch has not been imported, no process group can exist, so the checks below cost nothing
for single-process users and keep `import tokenmill` free of torch.

Who builds a missing cache: with scope "global" the process of global rank 0 (megatron-core's
rule); with scope "node" the first process of every node (local rank 0), for caches on
node-local disks. The index build is deterministic, so every node writes the same bytes.

Builders and the other ranks meet in :func:`build_then_share` (:func:`build_and_vouch`), not a
bare barrier: it carries each builder's outcome through the process group's store, so when a
builder fails every rank raises its exception (type and message) at once, instead of waiting
out the collective timeout or dying of a broken connection; and it carries the builders'
evidence (digests of the cache entries they checked) to the ranks that trust them.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "Shared",
    "barrier",
    "build_and_vouch",
    "build_then_share",
    "get_rank",
    "get_world_size",
    "is_cache_builder",
    "is_initialized",
    "local_rank",
    "share_outcome",
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
    """`error` if it survives a pickle round trip (it travels through the store), else a
    CacheBuildError with its type and message."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if isinstance(copy, BaseException):
            copy.__traceback__ = None
            return copy
    except Exception:  # any failure to pickle means: send it as text
        pass
    return CacheBuildError(f"{type(error).__module__}.{type(error).__name__}: {error}")


class Shared(NamedTuple):
    """What :func:`build_and_vouch` hands each rank: its own work's result (None on ranks without
    work) and the evidence its builder published (None on builders, and where none was)."""

    result: Any
    evidence: bytes | None


# Every key build_and_vouch writes in the process group's store starts with this.
_STORE_PREFIX = "tokenmill/build_then_share/"


def build_then_share(
    work: Callable[[], _T] | None, role: str = "builds the index caches"
) -> _T | None:
    """Run `work` on the ranks that pass one (the cache builders), then let every rank know
    whether all of them succeeded (:func:`build_and_vouch` without evidence; `role`: what the
    ranks with work do, for the note on the others' exception).

    Returns:
        `work()`'s result, or None on ranks without work.

    Raises:
        A failing rank's exception, on every rank (a rank whose own work failed raises its
        own). A note names the rank it came from.
    """
    result: _T | None = build_and_vouch(work, role=role).result
    return result


def build_and_vouch(
    work: Callable[[], Any] | None,
    evidence: Callable[[], bytes] | None = None,
    scope: str = "global",
    role: str = "builds the index caches",
) -> Shared:
    """Run `work` on the ranks that pass one (the cache builders), then let every rank know
    whether all of them succeeded, and hand the other ranks their builder's `evidence` (what a
    builder checked, published after its work succeeded). Every rank must call it, in the same
    order. Without a process group, `work` just runs.

    The ranks meet in the process group's store and one ``barrier``, never in a collective over
    a tensor made in Python: gloo's worker thread frees such a tensor after the call returns,
    possibly while the interpreter finalizes, which aborts the process at exit (SIGABRT,
    pytorch#190489; a build-then-exit script without ``destroy_process_group`` died in about 1
    of 10 runs). A failing builder writes its exception (pickled) to the store before the
    barrier; after it, every rank looks for one. A builder writes its evidence under its own
    rank; a rank without work reads its builder's (rank 0, or with `scope` "node" its node's
    local rank 0, ``rank - local_rank()``). Rank 0, whose process may host the store, returns
    only once every rank has read. `role` says what the ranks with work do, in the note the
    other ranks' exception carries.

    Returns:
        `Shared(result, evidence)`.

    Raises:
        A failing rank's exception, on every rank (a rank whose own work failed raises its
        own). A note names the rank it came from.
    """
    dist = _dist()
    if dist is None:
        return Shared(None if work is None else work(), None)
    result: Any = None
    error: BaseException | None = None
    published: bytes | None = None
    if work is not None:
        try:
            result = work()
            published = evidence() if evidence is not None else None
        except Exception as caught:  # every rank must reach the barrier below
            error = caught
    store = dist.distributed_c10d._get_default_store()
    rank = int(dist.get_rank())
    # the n-th call of this rank: every rank calls in the same order, so the same n everywhere
    call = int(store.add(f"{_STORE_PREFIX}calls/{rank}", 1))
    key = f"{_STORE_PREFIX}{call}/"
    if error is not None and int(store.add(key + "failures", 1)) == 1:
        store.set(key + "error", pickle.dumps((rank, _portable(error))))
    if published is not None:
        store.set(key + f"evidence/{rank}", published)
    dist.barrier()
    failed = store.get(key + "error") if store.check([key + "failures"]) else None
    found: bytes | None = None
    if failed is None and work is None and evidence is not None:
        source = key + f"evidence/{0 if scope == 'global' else rank - local_rank()}"
        found = bytes(store.get(source)) if store.check([source]) else None
    # the store may live in rank 0's process (init_method tcp://): rank 0 leaves only once
    # every rank has read what it needs from it
    world = int(dist.get_world_size())
    if int(store.add(key + "read", 1)) == world:
        store.set(key + "all_read", b"")
    if rank == 0:
        store.wait([key + "all_read"])
    if error is not None:
        raise error
    if failed is not None:
        raise _shared_error(failed, rank, role)
    return Shared(result, found)


_OUTCOME_PREFIX = "tokenmill/share_outcome/"


def share_outcome(
    error: BaseException | None, waited_for: Any, role: str = "tokenizes raw text"
) -> None:
    """Publish this rank's outcome, then wait only for the outcomes of the ranks in
    `waited_for` (an iterable of ranks; this rank is skipped) and raise the first failure
    among them. Not a collective: nothing here waits for a rank outside `waited_for`, so a rank
    that needs nothing from the others (a warm relaunch: every piece already in the cache)
    goes on at once, and ranks that wait on different sets cannot deadlock. Every rank must
    call it the same number of times, in the same order (the n-th calls share a key space).

    Through the process group's store only (as :func:`build_and_vouch`: no tensor a
    communication library's thread could free at exit). The store may live in rank 0's
    process; callers go on to a collective (the index build's), so rank 0 outlives the
    readers. A rank in `waited_for` that dies before publishing leaves the waiter in the
    store's timeout (the launcher, torchrun or Slurm, ends the job first).

    Raises:
        `error` (this rank's own), else the first failure published by a rank in
        `waited_for`, with a note naming that rank and `role`.
    """
    dist = _dist()
    if dist is None:
        if error is not None:
            raise error
        return
    store = dist.distributed_c10d._get_default_store()
    rank = int(dist.get_rank())
    call = int(store.add(f"{_OUTCOME_PREFIX}calls/{rank}", 1))
    key = f"{_OUTCOME_PREFIX}{call}/"
    outcome = None if error is None else _portable(error)
    store.set(key + str(rank), pickle.dumps((rank, outcome)))
    if error is not None:
        raise error
    others = sorted({int(other) for other in waited_for} - {rank})
    if not others:
        return
    store.wait([key + str(other) for other in others])
    for other in others:
        payload = bytes(store.get(key + str(other)))
        if pickle.loads(payload)[1] is not None:
            raise _shared_error(payload, rank, role)


def _shared_error(payload: bytes, rank: int, role: str) -> BaseException:
    """The exception a failing rank wrote to the store, with a note naming that rank."""
    try:
        failed, shared = pickle.loads(payload)
    except Exception:  # defensive: the protocol always writes one
        failed, shared = "?", None
    if not isinstance(shared, BaseException):
        shared = CacheBuildError(f"rank {failed} failed to build the index caches")
    error: BaseException = shared
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(
            f"(raised on rank {failed}, which {role}; rank {rank} stops with the same error)"
        )
    return error
