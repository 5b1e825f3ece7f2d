"""The batch type of `__getitems__`, the pass-through collate, and index checking.

`GPTDataset.__getitems__(indices)` and `BlendedDataset.__getitems__(indices)` gather a whole
batch into one tensor per key (`[B, S]` tokens, labels, loss_mask, position_ids, `[B, 1, S, S]`
attention_mask, `[B, S + 1]` cu_seqlens, `[B]` max_seqlen, `[B]` dataset_id) and return a
:class:`SampleBatch`: a sequence of per-sample dicts (so torch's `default_collate` and any
code that iterates a fetched batch keep working) that also carries the stacked tensors.

* torch's `default_collate` (what Megatron's and most trainers' DataLoaders use): gives the
  batch tensors as they are, copying nothing. The per-sample dicts are `BatchRow`s, a type
  registered in torch's `default_collate_fn_map` (the extension point torch documents for
  `default_collate`) when the first batch is made in a process: collating the rows of one whole
  batch in order returns its tensors (inside a DataLoader worker, the `SharedBatch` that pickles
  as one block); any other list of rows is collated key by key, as torch would;
* :func:`collate`: the same, without going through torch.

torch is imported only when these functions run, never by `import tokenmill`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = ["BatchRow", "SampleBatch", "as_index_array", "collate", "stack_samples"]


class SampleBatch(Sequence[dict[str, Any]]):
    """A batch from `__getitems__`: stacked tensors, viewable as a sequence of samples.

    Args:
        tensors: one tensor per key with the batch as its first dimension.
        size: the number of samples.
    """

    __slots__ = ("size", "tensors")

    def __init__(self, tensors: dict[str, torch.Tensor], size: int) -> None:
        self.tensors = tensors
        self.size = size
        if not _COLLATE_REGISTERED:
            _register_collate()

    def collated(self) -> dict[str, Any]:
        """The batch dict (a shallow copy of `tensors`, of the same type)."""
        return self.tensors.copy()

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        """Sample `index` as the per-sample dict `__getitem__` returns (views into the batch)."""
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if not -self.size <= index < self.size:
            raise IndexError(f"sample {index} is out of range for a batch of {self.size}")
        row = BatchRow({key: value[index] for key, value in self.tensors.items()})
        row.batch = self
        row.position = index % self.size
        return row

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for index in range(self.size):
            yield self[index]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{key}: {tuple(value.shape)}" for key, value in self.tensors.items())
        return f"SampleBatch({self.size} samples; {shapes})"


class BatchRow(dict[str, Any]):
    """Sample `position` of a `SampleBatch` (views into its tensors), remembering its batch."""

    batch: SampleBatch
    position: int


_COLLATE_REGISTERED = False


def _register_collate() -> None:
    """Teach torch's `default_collate` to pass whole batches through (see the module docstring)."""
    global _COLLATE_REGISTERED
    from torch.utils.data._utils.collate import default_collate_fn_map

    default_collate_fn_map[BatchRow] = _collate_rows
    _COLLATE_REGISTERED = True


def _collate_rows(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """`default_collate` of `BatchRow`s: the batch's own tensors when `batch` is one whole
    `SampleBatch` (or all its rows, in order); otherwise torch's Mapping rule, key by key."""
    if isinstance(batch, SampleBatch):
        return batch.collated()
    rows = list(batch)
    first = rows[0]
    source = getattr(first, "batch", None)
    if (
        isinstance(source, SampleBatch)
        and len(rows) == source.size
        and all(
            isinstance(row, BatchRow) and row.batch is source and row.position == number
            for number, row in enumerate(rows)
        )
    ):
        return source.collated()
    from torch.utils.data._utils.collate import collate as torch_collate

    return {
        key: torch_collate([row[key] for row in rows], collate_fn_map=collate_fn_map)
        for key in first
    }


def collate(batch: Any) -> Any:
    """A DataLoader `collate_fn` that passes a :class:`SampleBatch` through as its tensors.

    A mapping is already a batch (PackedDataset's `__getitems__` returns a dict of batched
    tensors) and is returned as it is. Anything else (a list of samples from a dataset without
    `__getitems__`) goes to torch's `default_collate`, so the function is safe to use with any
    map-style dataset.

    Args:
        batch: what the DataLoader fetched.

    Returns:
        A dict of batched tensors.
    """
    if isinstance(batch, SampleBatch):
        return batch.collated()
    if isinstance(batch, Mapping):
        return batch
    from torch.utils.data import default_collate

    return default_collate(batch)


def stack_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts into batched tensors (the fallback of `__getitems__`).

    Args:
        samples: dicts with the same keys; values are tensors or numpy scalars.

    Returns:
        One tensor per key, stacked along a new first dimension.
    """
    import torch

    if not samples:
        return {}
    return {
        key: torch.stack([torch.as_tensor(sample[key]) for sample in samples]) for key in samples[0]
    }


def as_index_array(
    indices: Sequence[int | None] | npt.NDArray[np.integer] | Any,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_] | None]:
    """Sample indices as int64, and which of them were None (padding samples) if any.

    Raises:
        TypeError: an index is neither an integer nor None.
        ValueError: the indices are not one-dimensional.
    """
    padding: npt.NDArray[np.bool_] | None = None
    if isinstance(indices, (list, tuple)):
        if any(index is None for index in indices):
            padding = np.array([index is None for index in indices], dtype=bool)
            indices = [0 if index is None else index for index in indices]
        array = np.asarray(indices) if len(indices) else np.empty(0, dtype=np.int64)
    else:
        array = np.asarray(indices)
    if array.ndim != 1:
        raise ValueError(f"sample indices must be one-dimensional, got shape {array.shape}")
    if array.dtype.kind not in "iu" and array.ndim == 1:
        # Python ints beyond 64 bits become objects or floats in numpy: name the index
        given = array.tolist() if array.dtype == object else list(indices)
        bad = next(
            (
                index
                for index in given
                if isinstance(index, int) and not -(1 << 63) <= index < (1 << 63)
            ),
            None,
        )
        if bad is not None:
            raise IndexError(f"sample index {bad} is out of range")
    if array.dtype.kind not in "iu":
        raise TypeError(f"sample indices must be integers, got {array.dtype}")
    if array.dtype == np.uint64 and array.shape[0] and int(array.max()) > np.iinfo(np.int64).max:
        raise IndexError(f"sample index {int(array.max())} is out of range")
    return np.ascontiguousarray(array, dtype=np.int64), padding
