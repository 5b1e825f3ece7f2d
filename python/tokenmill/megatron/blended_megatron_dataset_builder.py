"""``megatron.core.datasets.blended_megatron_dataset_builder`` on tokenmill: train/valid/test
construction from blends and splits.

`BlendedMegatronDatasetBuilder` is tokenmill's (`tokenmill.datasets.builder`): megatron-core's
cases, sizes, surplus arithmetic, rank order and checks, and its methods are the same hooks. The
type aliases are megatron's, except that `DistributedDataset` leaves out
``torch.utils.data.Dataset`` (naming it would import torch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Union

from tokenmill.datasets.blended import BlendedDataset
from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
from tokenmill.datasets.config import BlendedMegatronDatasetConfig, GPTDatasetConfig
from tokenmill.datasets.megatron_dataset import MegatronDataset
from tokenmill.datasets.utils import Split, get_size_per_split_per_dataset, normalize
from tokenmill.megatron.megatron_dataset import LowLevelDataset
from tokenmill.megatron.utils import log_single_rank

__all__ = [
    "BlendedDataset",
    "BlendedMegatronDatasetBuilder",
    "BlendedMegatronDatasetConfig",
    "DistributedDataset",
    "GPTDatasetConfig",
    "LowLevelDataset",
    "MegatronDataset",
    "MidLevelDataset",
    "Split",
    "TopLevelDataset",
    "log_single_rank",
    "normalize",
]

logger = logging.getLogger(__name__)

MidLevelDataset = MegatronDataset
TopLevelDataset = Union[BlendedDataset, MidLevelDataset]  # noqa: UP007 - megatron's runtime alias
DistributedDataset = Union[TopLevelDataset, MidLevelDataset, LowLevelDataset]  # noqa: UP007


def _get_size_per_split_per_dataset(
    normalized_weights: Sequence[float],
    target_size_per_split: Sequence[int | None],
    surplus: float = 0.0,
) -> list[list[int]]:
    """Samples to request per dataset per split: ``ceil(ceil(size * w) * (1 + surplus))``.

    Raises:
        ValueError: the weights do not sum to 1, or a size is None.
    """
    return get_size_per_split_per_dataset(normalized_weights, target_size_per_split, surplus)
