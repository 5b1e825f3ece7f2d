"""``megatron.core.datasets.blended_megatron_dataset_config`` on tokenmill: the config dataclass and
the split helpers (tokenmill's, with megatron's fields, defaults and arithmetic)."""

from __future__ import annotations

import logging

from tokenmill.datasets.config import BlendedMegatronDatasetConfig
from tokenmill.datasets.utils import (
    Split,
    convert_split_vector_to_split_matrix,
    normalize,
    parse_and_normalize_split,
)
from tokenmill.megatron.utils import log_single_rank

__all__ = [
    "BlendedMegatronDatasetConfig",
    "Split",
    "convert_split_vector_to_split_matrix",
    "log_single_rank",
    "normalize",
    "parse_and_normalize_split",
]

logger = logging.getLogger(__name__)
