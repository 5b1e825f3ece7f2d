"""`make_data_loader`: a loader that fetches whole batches through `__getitems__`.

`GPTDataset`, `BlendedDataset` and `PackedDataset` gather a whole batch into one tensor per key
(`tokenmill.serving`); their `__getitems__` returns a `SampleBatch`, which
`tokenmill.serving.batch.collate` hands through untouched, so a
`DataLoader(dataset, batch_size=B, collate_fn=collate)` never builds a per-sample tensor:

* default collate: B x keys views are made and copied into new stacked tensors (one more copy);
* `collate`: zero extra work; the worker hands the batch tensors to the main process.

:func:`make_data_loader` builds such a loader with tokenmill's recommended settings: a torch
DataLoader with worker processes, or a `ThreadedBatchLoader` with worker threads. torch is
imported only when it runs, never by `import tokenmill`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.serving.batch import collate

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from tokenmill.loading.threaded import ThreadedBatchLoader

__all__ = ["make_data_loader"]


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
    processes (measured 22-61x megatron-core's 2-worker DataLoader against 3.8-7.0x for worker
    processes, benchmarks/SERVING.md and benchmarks/results/serving.json). Keep processes for
    datasets that hold the GIL.

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
