"""Megatron GPT samples served by the C++ batched gather (`_core.Gatherer`).

`GptBatchLayout` is the shape of a GPTDataset batch: tokens and labels (`[B, S]`, the configured
token dtype), loss_mask, position_ids, then either cu_seqlens `[B, S + 1]` and max_seqlen `[B]`
(inter-document masking) or, with a dense attention mask that resets at documents, the scratch
document starts the mask is built from. Its `collate` gives megatron-core's keys in its order.

`GptSampleServer` owns one dataset's gatherer over its index arrays and token mmap. One call
(GIL released) resolves shuffle -> sample -> document positions, reads the tokens in their
storage dtype, widens them once into the output rows and computes labels, loss_mask,
position_ids (and their reset variants) and cu_seqlens in the same pass: 9-12 µs for one
2048-token sample, 3-5 µs per sample in a batch on the 2-core dev VM (benchmarks/SERVING.md).
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tokenmill.formats.megatron import shrunk_file_error
from tokenmill.serving.layout import BatchLayout, Field
from tokenmill.serving.server import BatchServer

if TYPE_CHECKING:
    import torch

__all__ = ["GptBatchLayout", "GptSampleServer", "shared_causal_mask"]

_SHARED: OrderedDict[tuple[str, int], tuple[torch.Tensor, int]] = OrderedDict()
_SHARED_KEPT = 12  # tensors kept (a [1, 8192, 8192] mask is 64 MiB)
_SHARED_LOCK = threading.Lock()


def _shared(kind: str, length: int) -> torch.Tensor:
    """The process's shared tensor `kind` of `length`, rebuilt if a caller wrote it in place
    (seen through the tensor's version counter): a write never reaches a later sample."""
    with _SHARED_LOCK:
        cached = _SHARED.get((kind, length))
        if cached is not None and cached[0]._version == cached[1]:
            _SHARED.move_to_end((kind, length))
            return cached[0]
        import torch

        if kind == "causal_mask":
            tensor = torch.ones(length, length, dtype=torch.bool).triu_(1).unsqueeze(0)
        elif kind == "position_ids":
            tensor = torch.arange(length, dtype=torch.int64)
        else:
            tensor = torch.ones(length, dtype=torch.float32)
        _SHARED[(kind, length)] = (tensor, tensor._version)
        while len(_SHARED) > _SHARED_KEPT:
            _SHARED.popitem(last=False)
        return tensor


def shared_causal_mask(length: int) -> torch.Tensor:
    """megatron-core's causal mask `[1, length, length]` (bool, True = masked), one object per
    length and process, handed to every sample as megatron hands out its cached mask.

    Neither library writes a sample's mask. Should a caller write it in place, the next sample
    gets a fresh mask, so the change never leaks into later samples, as it does with
    megatron-core's cached mask.
    """
    return _shared("causal_mask", length)


@dataclass(frozen=True)
class GptBatchLayout(BatchLayout):
    """Everything that decides the keys, shapes and dtypes of a served GPT batch.

    Attributes:
        sequence_length: S.
        token_dtype: the dtype of tokens and labels.
        attention_mask: return megatron's dense `[B, 1, S, S]` attention_mask.
        reset_attention_mask: the mask also separates documents.
        inter_document: return cu_seqlens and max_seqlen (no dense mask).
    """

    sequence_length: int
    token_dtype: np.dtype[Any]
    attention_mask: bool
    reset_attention_mask: bool
    inter_document: bool

    def fields(self) -> tuple[Field, ...]:
        length = self.sequence_length
        fields = [
            Field("tokens", (length,), self.token_dtype),
            Field("labels", (length,), self.token_dtype),
            Field("loss_mask", (length,), np.dtype(np.float32)),
            Field("position_ids", (length,), np.dtype(np.int64)),
        ]
        if self.inter_document:
            fields.append(Field("cu_seqlens", (length + 1,), np.dtype(np.int32)))
            fields.append(Field("max_seqlen", (), np.dtype(np.int32)))
        elif self.reset_attention_mask:
            fields.append(Field("document_starts", (length,), np.dtype(np.int64), scratch=True))
        return tuple(fields)

    def collate(
        self, tensors: Mapping[str, torch.Tensor], padding: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """megatron-core's sample dict with a batch dimension; padding samples get a zero loss
        mask."""
        loss_mask = tensors["loss_mask"]
        if padding is not None:
            loss_mask[padding] = 0.0
        result = {"tokens": tensors["tokens"], "labels": tensors["labels"]}
        if self.inter_document:
            result["loss_mask"] = loss_mask
            result["position_ids"] = tensors["position_ids"]
            result["cu_seqlens"] = tensors["cu_seqlens"]
            result["max_seqlen"] = tensors["max_seqlen"]
            return result
        if self.attention_mask:
            count = int(tensors["tokens"].shape[0])
            result["attention_mask"] = self.mask(tensors.get("document_starts"), (count,))
        result["loss_mask"] = loss_mask
        result["position_ids"] = tensors["position_ids"]
        return result

    def mask(self, starts: torch.Tensor | None, lead: tuple[int, ...]) -> torch.Tensor:
        """megatron-core's dense mask (True = masked), `[*lead, 1, S, S]`."""
        import torch

        length = self.sequence_length
        allowed = torch.ones(length, length, dtype=torch.bool).tril_()
        if starts is not None:
            allowed = allowed & (starts.unsqueeze(-1) == starts.unsqueeze(-2))
            result: torch.Tensor = (~allowed).unsqueeze(-3)
            return result
        return (~allowed).expand(*lead, 1, length, length).clone()


class GptSampleServer(BatchServer):
    """One GPT dataset's C++ gatherer and its batches.

    Args:
        shuffle_index, sample_index, document_index: the dataset's index arrays.
        sequence_pointers, sequence_lengths: byte offset and length of every document.
        tokens: the token array (the `.bin` mmap) in its storage dtype.
        layout: the batch layout.
        extra_token: tokens per sample beyond S (megatron's add_extra_token_to_sequence).
        eod, pad: the end-of-document and padding ids.
        eod_mask_loss, reset_position_ids: megatron-core's flags.
        data_path: the mapped file `tokens` views, named when a read faults because it shrank
            underneath (a SIGBUS turned into DataFormatError by the C++ guard).
    """

    def __init__(
        self,
        shuffle_index: npt.NDArray[Any],
        sample_index: npt.NDArray[Any],
        document_index: npt.NDArray[Any],
        sequence_pointers: npt.NDArray[Any],
        sequence_lengths: npt.NDArray[Any],
        tokens: npt.NDArray[Any],
        *,
        layout: GptBatchLayout,
        extra_token: int,
        eod: int,
        pad: int,
        eod_mask_loss: bool,
        reset_position_ids: bool,
        data_path: str = "<tokens>",
    ) -> None:
        from tokenmill import _core

        self.data_path = data_path
        self.mapped_size = int(tokens.nbytes)
        self._fault_type = _core.MappedReadFault

        super().__init__(layout)
        self.layout: GptBatchLayout = layout
        self.plain_position_ids = not reset_position_ids
        # with the extra token, a single sample's tokens and labels are the two overlapping
        # views of its S + 1 tokens, as megatron-core returns them (text[:-1], text[1:]): one
        # buffer per kept sample, not two
        self.labels_view_the_text = extra_token == 1
        self.gatherer = _core.Gatherer(
            np.ascontiguousarray(shuffle_index),
            np.ascontiguousarray(sample_index),
            np.ascontiguousarray(document_index),
            np.ascontiguousarray(sequence_pointers, dtype=np.int64),
            np.ascontiguousarray(sequence_lengths, dtype=np.int32),
            tokens,
            sequence_length=layout.sequence_length,
            extra_token=extra_token,
            eod=eod,
            pad=pad,
            eod_mask_loss=eod_mask_loss,
            reset_position_ids=reset_position_ids,
            inter_document_masking=layout.inter_document,
        )

    def one(self, idx: int | None) -> dict[str, torch.Tensor]:
        """Sample `idx` with megatron-core's keys (the single-sample fast path)."""
        index = 0 if idx is None else operator.index(idx)
        layout = self.layout
        length = layout.sequence_length
        empty = np.empty
        text = None
        if self.labels_view_the_text:
            text = empty(length + 1, layout.token_dtype)
            tokens, labels = text[:-1], text[1:]
        else:
            tokens = empty(length, layout.token_dtype)
            labels = empty(length, layout.token_dtype)
        loss_mask = empty(length, np.float32)
        position_ids = empty(length, np.int64)
        cu_seqlens = max_seqlen = starts = None
        if layout.inter_document:
            cu_seqlens = empty(length + 1, np.int32)
            max_seqlen = empty((), np.int32)
        elif layout.reset_attention_mask:
            starts = empty(length, np.int64)
        try:
            self.gatherer.gather_one(
                index, tokens, labels, loss_mask, position_ids, starts, cu_seqlens, max_seqlen
            )
        except self._fault_type as fault:
            raise shrunk_file_error(self.data_path, self.mapped_size, fault) from None
        except TypeError:
            if not -(1 << 63) <= index < (1 << 63):  # pybind's "incompatible arguments"
                raise IndexError(
                    f"sample index {index} is out of range for a dataset of "
                    f"{len(self.gatherer)} samples"
                ) from None
            raise
        from_numpy = self.torch.from_numpy
        if idx is None:
            loss_mask[:] = 0.0
        if text is None:
            result = {"tokens": from_numpy(tokens), "labels": from_numpy(labels)}
        else:
            whole = from_numpy(text)
            result = {"tokens": whole[:-1], "labels": whole[1:]}
        if cu_seqlens is not None and max_seqlen is not None:
            result["loss_mask"] = from_numpy(loss_mask)
            result["position_ids"] = from_numpy(position_ids)
            result["cu_seqlens"] = from_numpy(cu_seqlens)
            result["max_seqlen"] = from_numpy(max_seqlen)
            return result
        if layout.attention_mask:
            result["attention_mask"] = (
                shared_causal_mask(length)
                if starts is None
                else layout.mask(from_numpy(starts), ())
            )
        # megatron-core hands every sample its cached loss mask and position ids when no flag
        # changes them; so does tokenmill, where this sample's are the plain ones (fresh
        # tensors otherwise, e.g. a loss mask with pad or EOD zeros)
        result["loss_mask"] = (
            _shared("loss_mask", length) if loss_mask.all() else from_numpy(loss_mask)
        )
        result["position_ids"] = (
            _shared("position_ids", length) if self.plain_position_ids else from_numpy(position_ids)
        )
        return result

    def gather(
        self,
        indices: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64] | None,
        buffers: Mapping[str, npt.NDArray[Any]],
        *,
        num_threads: int = 1,
    ) -> None:
        """Gather samples `indices` into rows `rows` (None: 0..B-1) of `buffers`."""
        try:
            self.gatherer.gather(
                indices,
                rows,
                buffers["tokens"],
                buffers["labels"],
                buffers["loss_mask"],
                buffers["position_ids"],
                buffers.get("document_starts"),
                buffers.get("cu_seqlens"),
                buffers.get("max_seqlen"),
                num_threads=num_threads,
            )
        except self._fault_type as fault:
            raise shrunk_file_error(self.data_path, self.mapped_size, fault) from None
