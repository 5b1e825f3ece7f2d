"""Batched sample serving: the `__getitems__` result, a pass-through collate and a loader helper.

`GPTDataset.__getitems__(indices)` and `BlendedDataset.__getitems__(indices)` gather a whole
batch with one C++ call into one tensor per key (`[B, S]` tokens, labels, loss_mask,
position_ids, `[B, 1, S, S]` attention_mask, `[B, S + 1]` cu_seqlens, `[B]` max_seqlen,
`[B]` dataset_id). They return a :class:`SampleBatch`: a sequence of per-sample dicts (so torch's
default collate still works and gives the same result, by stacking per-sample views), that also
carries the stacked tensors. :func:`collate` hands those tensors through untouched, so a
`DataLoader(dataset, batch_size=B, collate_fn=collate)` never builds a per-sample tensor:

* default collate: B x keys views are made and copied into new stacked tensors (one more copy);
* :func:`collate`: zero extra work; the worker hands the batch tensors to the main process.

:func:`make_data_loader` builds such a DataLoader with tokenmill's recommended settings.
torch is imported only when these functions run, never by `import tokenmill`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

    from tokenmill.loading.threaded import ThreadedBatchLoader

__all__ = ["SampleBatch", "collate", "make_data_loader"]


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
        return {key: value[index] for key, value in self.tensors.items()}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for index in range(self.size):
            yield self[index]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{key}: {tuple(value.shape)}" for key, value in self.tensors.items())
        return f"SampleBatch({self.size} samples; {shapes})"


def collate(batch: Any) -> Any:
    """A DataLoader `collate_fn` that passes a :class:`SampleBatch` through as its tensors.

    Anything else (a list of samples from a dataset without `__getitems__`) goes to torch's
    `default_collate`, so the function is safe to use with any map-style dataset.

    Args:
        batch: what the DataLoader fetched.

    Returns:
        A dict of batched tensors.
    """
    if isinstance(batch, SampleBatch):
        return batch.tensors
    from torch.utils.data import default_collate

    return default_collate(batch)


def make_data_loader(
    dataset: Any,
    batch_size: int,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    shuffle: bool = False,
    seed: int | None = None,
    drop_last: bool = False,
    sampler: Any = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    worker_type: str = "process",
    **kwargs: Any,
) -> DataLoader[Any] | ThreadedBatchLoader:
    """A loader that fetches whole batches through `dataset.__getitems__`.

    With `worker_type="process"` (the default) it is a torch DataLoader with worker processes;
    with `worker_type="thread"` it is a :class:`~tokenmill.loading.threaded.ThreadedBatchLoader`
    whose workers are threads. Threads are the faster choice for GPTDataset and BlendedDataset,
    whose batch gather runs in C++ with the GIL released: no per-batch hand-over between
    processes (measured 19-26x megatron-core's 2-worker DataLoader against 0.8-1.5x for worker
    processes, benchmarks/SERVING.md). Keep processes for datasets that hold the GIL.

    Recommended settings: `worker_type="thread"`, `num_workers` 2 per GPU process; keep
    `create_attention_mask=False` and use cu_seqlens (`inter_document_masking=True`) or
    position ids instead of dense masks.

    Args:
        dataset: a map-style dataset, ideally with `__getitems__` (GPTDataset, BlendedDataset).
        batch_size: samples per batch.
        num_workers: worker processes (0: fetch in the calling process).
        pin_memory: copy batches into page-locked memory for fast host-to-device transfers.
        shuffle: draw indices in a random order (megatron datasets are already shuffled).
        seed: seed of the shuffle's generator (for reproducible orders).
        drop_last: drop the final incomplete batch.
        sampler: a sampler of indices (excludes `shuffle`).
        persistent_workers: keep workers between epochs (default: True when num_workers > 0).
        prefetch_factor: batches prefetched per worker (torch's default when None).
        worker_type: "process" (a torch DataLoader) or "thread" (a ThreadedBatchLoader).
        **kwargs: passed to `torch.utils.data.DataLoader` (processes only).

    Returns:
        The loader; it yields dicts of batched tensors.

    Raises:
        ValueError: for a non-positive batch size, a negative worker count, an unknown
            worker type, or DataLoader keyword arguments with thread workers.
    """
    import torch
    from torch.utils.data import DataLoader

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if worker_type not in ("process", "thread"):
        raise ValueError(f"worker_type must be 'process' or 'thread', got {worker_type!r}")
    if worker_type == "thread":
        from tokenmill.loading.threaded import ThreadedBatchLoader

        if kwargs:
            raise ValueError(
                f"thread workers take no DataLoader arguments, got {', '.join(sorted(kwargs))}"
            )
        return ThreadedBatchLoader(
            dataset,
            batch_size,
            num_workers=num_workers,
            prefetch=None if prefetch_factor is None else prefetch_factor * max(num_workers, 1),
            sampler=sampler,
            shuffle=shuffle,
            seed=0 if seed is None else seed,
            drop_last=drop_last,
            pin_memory=pin_memory,
        )
    generator = None
    if shuffle and seed is not None:
        generator = torch.Generator()
        generator.manual_seed(seed)
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    options: dict[str, Any] = dict(kwargs)
    if num_workers > 0 and prefetch_factor is not None:
        options["prefetch_factor"] = prefetch_factor
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=pin_memory,
        drop_last=drop_last,
        generator=generator,
        persistent_workers=persistent_workers,
        **options,
    )


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
