"""Batch layouts: which arrays a batched gather fills, and how they become the batch's tensors.

A layout is a value (a frozen dataclass): datasets whose layouts are equal fill the same arrays
in the same way, so one set of batch buffers can take rows from several of them (a blend
gathers each member's rows straight into one batch). Every field is `[B, *shape]` for a batch of
B samples; a *scratch* field is filled for `collate` to read (GPT's document starts, from which
the dense attention mask is built) but is not itself returned, and is never page-locked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["BatchLayout", "Field", "PlainLayout"]


@dataclass(frozen=True)
class Field:
    """One array of a batch.

    Attributes:
        key: its name (a key of the batch dict unless `scratch`).
        shape: its shape for one sample.
        dtype: its dtype.
        scratch: read by `collate`, not returned.
    """

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    scratch: bool = False


class BatchLayout:
    """What a servable dataset's batches look like (subclasses are frozen dataclasses)."""

    def fields(self) -> tuple[Field, ...]:
        """The arrays a batch fill writes."""
        raise NotImplementedError

    def collate(
        self, tensors: Mapping[str, torch.Tensor], padding: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The batch dict from the filled fields (as tensors sharing their memory).

        Args:
            tensors: every field, `[B, *shape]`.
            padding: `[B]` bool, True for padding samples (None indices), or None.

        Raises:
            TypeError: `padding` is given but this layout has no padding samples.
        """
        if padding is not None:
            raise TypeError("sample indices must be integers, got None")
        return {field.key: tensors[field.key] for field in self.fields() if not field.scratch}


@dataclass(frozen=True)
class PlainLayout(BatchLayout):
    """A layout whose batch dict is its fields, in order (no padding samples)."""

    field_list: tuple[Field, ...]

    def fields(self) -> tuple[Field, ...]:
        return self.field_list
