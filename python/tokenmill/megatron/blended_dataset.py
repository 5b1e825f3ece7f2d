"""``megatron.core.datasets.blended_dataset`` on tokenmill: the weighted blend of mid-level datasets.

`BlendedDataset` is tokenmill's (`tokenmill.datasets.blended`): megatron-core's constructor,
`dataset_index` / `dataset_sample_index`, cache files and samples, with the indices built by the
C++ blending kernels (its `_build_indices` hook builds and caches them; a subclass may replace it).
"""

from __future__ import annotations

import logging

from tokenmill.datasets.blended import BlendedDataset
from tokenmill.datasets.config import BlendedMegatronDatasetConfig
from tokenmill.datasets.megatron_dataset import MegatronDataset
from tokenmill.datasets.utils import normalize
from tokenmill.megatron.utils import log_single_rank

__all__ = [
    "BlendedDataset",
    "BlendedMegatronDatasetConfig",
    "MegatronDataset",
    "log_single_rank",
    "normalize",
]

logger = logging.getLogger(__name__)

_VERBOSE = False
"""megatron-core's switch for its blending kernel's progress printout (unused by tokenmill)."""
