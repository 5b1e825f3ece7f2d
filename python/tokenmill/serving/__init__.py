"""Serving: batches of samples gathered straight into their output tensors.

Between the datasets (which say what sample k is) and the loaders (which say who reads which k),
serving owns everything about turning a batch of sample indices into tensors:

* `batch`: the batch type `SampleBatch` that `__getitems__` returns, the pass-through `collate`,
  `stack_samples` (the per-sample fallback) and `as_index_array` (index checking);
* `layout`: a dataset's `BatchLayout` (which arrays a batch fills, their shapes and dtypes, and
  how they become the batch dict). Datasets with equal layouts can fill one shared batch;
* `buffers`: who owns a batch's arrays (a reuse pool in the main process, one shared-memory
  block in a DataLoader worker, page-locked memory when pinning);
* `server`: `Servable`, the small protocol a dataset implements to be served (`batch_layout()`
  and `fill_batch()`), and `BatchServer`, which allocates, lets the datasets fill and collates;
* `gpt`: the Megatron GPT sample layout and the wrapper over the C++ batched gather
  (`_core.Gatherer`) that GPTDataset and BlendedDataset serve through.

torch is imported when a server is first built, never by importing this package.
"""
