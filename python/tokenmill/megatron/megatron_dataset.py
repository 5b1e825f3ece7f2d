"""``megatron.core.datasets.megatron_dataset`` on tokenmill: the abstract base of mid-level datasets.

`MegatronDataset` is tokenmill's (`tokenmill.datasets.megatron_dataset`): the identity, cache
description and hash, and pad-token rules of megatron-core, with its subclass hooks
(`numel_low_level_dataset`, `build_low_level_dataset`, `_key_config_attributes`, abstract
`__len__` / `__getitem__`). megatron's own subclasses (BERT, T5, SFT) run on it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

from tokenmill.datasets.config import BlendedMegatronDatasetConfig
from tokenmill.datasets.megatron_dataset import PAD_TOKEN_ID as _PAD_TOKEN_ID  # noqa: F401 - megatron's name
from tokenmill.datasets.megatron_dataset import MegatronDataset
from tokenmill.datasets.utils import Split
from tokenmill.formats.megatron import IndexedDataset

__all__ = [
    "BlendedMegatronDatasetConfig",
    "IndexedDataset",
    "LowLevelDataset",
    "MegatronDataset",
    "Split",
]

LowLevelDataset = Union[IndexedDataset, Iterable[Any]]  # noqa: UP007 - megatron's runtime alias
"""What a mid-level dataset wraps: an IndexedDataset or any iterable of samples."""
