"""``megatron.core.datasets.gpt_dataset`` on tokenmill: the GPT dataset, its config and mock data.

`GPTDataset`, `GPTDatasetConfig`, `MockGPTDataset` and `MockGPTLowLevelDataset` are tokenmill's
(`tokenmill.datasets.gpt`): megatron-core's constructors, attributes, subclass hooks and samples,
with the indices built in C++ and samples gathered in C++ wherever a subclass does not override
the method that path replaces.

The module-level helpers megatron-core defines are here with its signatures, for code that calls
them directly (tokenmill's dataset does not use them):

* `_build_document_index` and `_build_shuffle_index` shuffle with the `numpy.random.RandomState`
  they are given, advancing it exactly as megatron-core does (numpy's own shuffle, O(n) each);
* `_get_ltor_masks_and_position_ids` computes the dense mask, loss mask and position ids of one
  sequence in a few vectorised torch operations (megatron-core loops over EOD tokens in Python).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy
import numpy.typing as npt

from tokenmill.datasets.config import BlendedMegatronDatasetConfig
from tokenmill.datasets.gpt import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from tokenmill.datasets.megatron_dataset import MegatronDataset
from tokenmill.datasets.utils import Split
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.megatron.object_storage_utils import ObjectStorageConfig, is_object_storage_path
from tokenmill.megatron.utils import log_single_rank

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlendedMegatronDatasetConfig",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "MegatronDataset",
    "MockGPTDataset",
    "MockGPTLowLevelDataset",
    "ObjectStorageConfig",
    "Split",
    "is_object_storage_path",
    "log_single_rank",
]

logger = logging.getLogger(__name__)


def _build_document_index(
    documents: npt.NDArray[Any],
    num_epochs: int,
    numpy_random_state: numpy.random.RandomState,
    separate_final_epoch: bool,
) -> npt.NDArray[numpy.int32]:
    """`documents` repeated `num_epochs` times as int32 and shuffled with `numpy_random_state`;
    with `separate_final_epoch` (and more than one epoch) the first `num_epochs - 1` epochs and
    the last one are shuffled separately, in that order."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        numpy_random_state.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, numpy_random_state, False)
    last = _build_document_index(documents, 1, numpy_random_state, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(
    num_samples: int, total_size: int, numpy_random_state: numpy.random.RandomState
) -> npt.NDArray[Any]:
    """[0, num_samples) shuffled, then [num_samples, total_size) shuffled after it when
    `total_size` is larger; uint32, or int64 from 2^32 - 2 entries on (megatron's switch)."""
    dtype: type[numpy.integer[Any]] = numpy.uint32
    if total_size >= numpy.iinfo(numpy.uint32).max - 1:
        dtype = numpy.int64
    first = numpy.arange(num_samples, dtype=dtype)
    numpy_random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    numpy_random_state.shuffle(last)
    return numpy.concatenate((first, last))


def _get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(attention_mask, loss_mask, position_ids) of the 1-D token tensor `data`, on its device.

    attention_mask is `[1, S, S]` bool with True where attention is masked (causal, and across
    EOD tokens with `reset_attention_mask`), or None without `create_attention_mask`; loss_mask
    is float32, 0 at EOD tokens with `eod_mask_loss`; position_ids are int64, restarting after
    every EOD token with `reset_position_ids`.
    """
    import torch

    length = data.numel()
    device = data.device
    is_eod = data.reshape(-1) == eod_token
    loss_mask = torch.ones(length, dtype=torch.float, device=device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = torch.arange(length, dtype=torch.long, device=device)
    document_starts = None
    if reset_position_ids or reset_attention_mask:
        # every token after an EOD starts a document; a running max carries the latest start
        marks = torch.zeros(length, dtype=torch.long, device=device)
        after_eod = torch.nonzero(is_eod[:-1]).reshape(-1) + 1
        marks[after_eod] = after_eod
        document_starts = torch.cummax(marks, dim=0).values if length else marks
    position_ids = positions
    if reset_position_ids and document_starts is not None:
        position_ids = positions - document_starts
    attention_mask = None
    if create_attention_mask:
        allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
        if reset_attention_mask and document_starts is not None:
            allowed &= document_starts.unsqueeze(1) == document_starts.unsqueeze(0)
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, position_ids
