"""Who is reading: the rank x DataLoader-worker arithmetic, in one place.

A ``World`` is this process's position among all readers: ``rank`` of ``world_size`` ranks
(``torch.distributed``) and ``worker_id`` of ``num_workers`` DataLoader workers per rank
(``torch.utils.data.get_worker_info``; a rank loading in its main process counts as one worker).
Readers are numbered ``global_worker_id = rank * num_workers + worker_id`` out of
``total_workers = world_size * num_workers``, NeMo Automodel's numbering.

Nothing here imports torch: if torch has not been imported, there is no process group and no
DataLoader worker, so the defaults (rank 0 of 1, worker 0 of 1) are the truth.

Tests and custom launchers override the detection by passing a ``World`` explicitly; inside a real
DataLoader worker, :meth:`World.current` keeps the given rank and world size and takes the worker
fields from torch.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["World"]


def _worker_info() -> Any | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return torch.utils.data.get_worker_info()


@dataclass(frozen=True)
class World:
    """A reader's position: rank x DataLoader worker.

    Args:
        rank: global rank, in ``[0, world_size)``.
        world_size: number of ranks.
        worker_id: DataLoader worker of this rank, in ``[0, num_workers)``.
        num_workers: DataLoader workers per rank (1 when loading in the main process).

    Raises:
        ValueError: a field is out of range.
    """

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "worker_id", "num_workers"):
            object.__setattr__(self, name, operator.index(getattr(self, name)))
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.worker_id < self.num_workers:
            raise ValueError(f"worker_id must be in [0, {self.num_workers}), got {self.worker_id}")

    @property
    def total_workers(self) -> int:
        """Readers over all ranks: ``world_size * num_workers``."""
        return self.world_size * self.num_workers

    @property
    def global_worker_id(self) -> int:
        """This reader's number: ``rank * num_workers + worker_id``."""
        return self.rank * self.num_workers + self.worker_id

    def rank_workers(self) -> range:
        """The global ids of this rank's workers."""
        first = self.rank * self.num_workers
        return range(first, first + self.num_workers)

    @classmethod
    def current(cls, base: World | None = None) -> World:
        """The World of the calling process.

        Args:
            base: an override. Its rank and world size are used as given; its worker fields too,
                unless the caller runs inside a DataLoader worker, whose id and count then win.

        Returns:
            Rank and world size from ``torch.distributed`` (or ``base``), worker id and count from
            ``torch.utils.data.get_worker_info()`` (or ``base``, or 0 of 1).
        """
        if base is None:
            from tokenmill.common import distributed

            rank, world_size = distributed.get_rank(), distributed.get_world_size()
            base = cls(rank=rank, world_size=world_size)
        info = _worker_info()
        if info is None:
            return base
        return replace(base, worker_id=int(info.id), num_workers=int(info.num_workers))
