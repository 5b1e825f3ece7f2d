"""Rank coordination through torch.distributed, without importing torch.

If torch has not been imported, no process group can exist, so the checks below cost nothing
for single-process users and keep `import tokenmill` free of torch.

Who builds a missing cache: with scope "global" the process of global rank 0 (megatron-core's
rule); with scope "node" the first process of every node (local rank 0), for caches on
node-local disks. The index build is deterministic, so every node writes the same bytes.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = [
    "barrier",
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
