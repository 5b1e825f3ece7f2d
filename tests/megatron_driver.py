"""Megatron's own data code, run unchanged: on stock megatron-core, or on tokenmill.

Run by test_megatron_patch.py in a fresh process (patching is process-global)::

    python tests/megatron_driver.py stock   WORKDIR OUT   # megatron-core
    python tests/megatron_driver.py patched WORKDIR OUT   # tokenmill.patch_megatron() first
    python -m tokenmill.megatron tests/megatron_driver.py runner WORKDIR OUT   # the runner

Everything below imports megatron's modules by megatron's names, so the patched runs execute
megatron-core's and Megatron-LM's code (the builder's callers, MockGPTDataset and its multimodal
subclass, Megatron-LM's FIM dataset, BERT, the pretraining data loader, the offline cache build
of tools/prepare_cache.py) on tokenmill's classes. Results (samples, batches, cache file hashes,
lengths) are saved with torch.save for the test to compare across runs.
"""

from __future__ import annotations

import sys
import typing
from typing import Any

if not hasattr(typing, "override"):  # megatron.training needs Python 3.12's typing.override
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]


class Tokenizer:
    """Bytes 0-255 and five FIM tokens (256-260); EOD 0. What GPT, FIM and BERT read."""

    def __init__(self) -> None:
        self.vocab_size = 300
        self.eod = 0
        self.unique_identifiers = {"class": "DriverTokenizer", "vocab_size": 300}
        self._tokenizer = self
        self.specials = {"<p>": 256, "<m>": 257, "<s>": 258, "<pad>": 259, "<eod>": 0}
        # BERT's attributes
        self.inv_vocab = {i: f"t{i}" for i in range(300)}
        self.cls, self.sep, self.mask, self.pad = 260, 261, 262, 263

    def tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self.specials[tokens]
        return [self.specials[token] for token in tokens]

    def ids_to_text(self, ids: Any, remove_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("latin-1")

    def text_to_ids(self, text: str) -> list[int]:
        return list(text.encode("latin-1"))


def main() -> None:
    """Everything runs here, under a `__main__` guard: a spawned DataLoader worker imports this
    file as its main module and must not run it again."""
    mode = sys.argv[1]
    if mode == "patched":
        import tokenmill

        tokenmill.patch_megatron()
    elif mode == "runner":
        import tokenmill.megatron

        assert tokenmill.megatron.is_patched(), "python -m tokenmill.megatron did not patch"
    run(mode)


def run(MODE: str) -> None:
    import hashlib
    import json
    import os
    import types
    import warnings
    from pathlib import Path

    warnings.simplefilter("ignore")

    import torch

    WORKDIR = Path(sys.argv[2])
    OUT = Path(sys.argv[3])
    PREFIXES = json.loads((WORKDIR / "prefixes.json").read_text())
    results: dict[str, Any] = {}

    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import (
        GPTDataset,
        GPTDatasetConfig,
        MockGPTDataset,
    )
    from megatron.core.datasets.utils import compile_helpers

    results["gpt_dataset_class"] = f"{GPTDataset.__module__}.{GPTDataset.__qualname__}"

    TOKENIZER = Tokenizer()
    FLAGS = {
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": True,
        "create_attention_mask": False,
    }

    def no_mask_cache(dataset: Any) -> Any:
        """Turn megatron-core's loss-mask cache off (its leak is the one documented difference;
        test_megatron_compat.py shows it); harmless on tokenmill's datasets."""
        if isinstance(dataset, list):
            for item in dataset:
                no_mask_cache(item)
        elif dataset is not None:
            if hasattr(dataset, "masks_and_position_ids_are_cacheable"):
                dataset.masks_and_position_ids_are_cacheable = False
            for member in getattr(dataset, "datasets", []) or []:
                no_mask_cache(member)
        return dataset

    def fetch(dataset: Any, indices: list[int]) -> Any:
        """What torch's map-style fetcher does for a batch, then torch's default collate."""
        getitems = getattr(dataset, "__getitems__", None)
        data = getitems(indices) if getitems is not None else [dataset[i] for i in indices]
        return torch.utils.data.default_collate(data)

    def samples(dataset: Any, count: int) -> list[dict[str, Any]]:
        return [dataset[i] for i in range(min(count, len(dataset)))]

    def files_digest(directory: Path) -> dict[str, str]:
        return {
            path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.iterdir())
            if not path.name.startswith(".") and not path.name.endswith(".tokenmill.json")
        }

    # 1. megatron-core's MockGPTDataset through the builder (its mock path)
    if MODE != "stock":
        # Megatron-LM's start-up and tools/prepare_cache.py call it: a no-op on tokenmill
        # (megatron-core's runs `make`, which fails from a wheel: there is no Makefile)
        compile_helpers()
    mock = BlendedMegatronDatasetBuilder(
        MockGPTDataset,
        [40, 12, None],
        lambda: True,
        GPTDatasetConfig(random_seed=3, sequence_length=128, tokenizer=TOKENIZER, **FLAGS),
    ).build()
    no_mask_cache(mock)
    results["mock"] = [samples(split, 12) for split in mock[:2]]
    results["mock_lengths"] = [len(split) for split in mock]

    # 2. megatron-core's multimodal mock dataset: a MockGPTDataset subclass overriding __getitem__
    from megatron.core.datasets.multimodal_dataset import (
        MockMultimodalDataset,
        MultimodalDatasetConfig,
    )

    multimodal = BlendedMegatronDatasetBuilder(
        MockMultimodalDataset,
        [20, None, None],
        lambda: True,
        MultimodalDatasetConfig(
            random_seed=5, sequence_length=64, tokenizer=TOKENIZER, image_h=4, image_w=6, **FLAGS
        ),
    ).build()[0]
    no_mask_cache(multimodal)
    results["multimodal_mro"] = [
        f"{c.__module__}.{c.__qualname__}" for c in type(multimodal).__mro__
    ]
    results["multimodal"] = samples(multimodal, 20)
    results["multimodal_batch"] = fetch(multimodal, list(range(8)))

    # 3. Megatron-LM's FIM dataset (megatron/training/datasets/fim_dataset.py): overrides
    #    _query_document_sample_shuffle_indices and draws from its own RandomState per sample
    from megatron.training.datasets.fim_dataset import (
        GPTFIMDataset,
        GPTFIMDatasetConfig,
    )

    fim_config = GPTFIMDatasetConfig(
        random_seed=11,
        sequence_length=48,
        tokenizer=TOKENIZER,
        blend=([PREFIXES["text"]], None),
        split="90,10,0",
        path_to_cache=str(WORKDIR / f"fim-cache-{MODE}"),
        fim_rate=0.7,
        fim_spm_rate=0.5,
        fim_extra_tokens={
            "prefix": "<p>",
            "middle": "<m>",
            "suffix": "<s>",
            "pad": "<pad>",
            "eod": "<eod>",
        },
        **FLAGS,
    )
    fim = BlendedMegatronDatasetBuilder(
        GPTFIMDataset, [30, 6, None], lambda: True, fim_config
    ).build()
    no_mask_cache(fim)
    results["fim_mro"] = [f"{c.__module__}.{c.__qualname__}" for c in type(fim[0]).__mro__]
    results["fim"] = [samples(split, 30) for split in fim[:2]]
    results["fim_batch"] = fetch(fim[0], [3, 4, 5])

    # 3b. the FIM dataset (a class of megatron.training) in a DataLoader worker started with
    #     "spawn": the child imports the main module before unpickling the dataset, so it works
    #     only if the patch travels with it. Stock megatron-core computes the same batches
    #     in-process from a pickled copy (the worker's copy has the same RNG state).
    if MODE == "stock":
        import pickle

        copy = pickle.loads(pickle.dumps(fim[0]))
        results["spawn_batches"] = [fetch(copy, [0, 1, 2, 3]), fetch(copy, [4, 5, 6, 7])]
    else:
        spawn_loader = torch.utils.data.DataLoader(
            fim[0], batch_size=4, num_workers=1, multiprocessing_context="spawn"
        )
        results["spawn_batches"] = [batch for _, batch in zip(range(2), spawn_loader)]
        del spawn_loader

    # 4. an in-house subclass, written as users write them against megatron-core
    class ReversedDataset(GPTDataset):
        """Serves every sample's tokens in reverse."""

        def _query_document_sample_shuffle_indices(self, idx: int) -> Any:
            text, document_ids, lengths = super()._query_document_sample_shuffle_indices(idx)
            return text[::-1].copy(), document_ids, lengths

    gpt_fields = {
        "random_seed": 1234,
        "sequence_length": 32,
        "tokenizer": TOKENIZER,
        "blend": ([PREFIXES["a"], PREFIXES["b"]], [0.3, 0.7]),
        "split": "98,2,0",
        **FLAGS,
    }
    reversed_splits = BlendedMegatronDatasetBuilder(
        ReversedDataset,
        [200, 20, 0],
        lambda: True,
        GPTDatasetConfig(path_to_cache=str(WORKDIR / f"rev-cache-{MODE}"), **gpt_fields),
    ).build()
    no_mask_cache(reversed_splits)
    results["reversed"] = samples(reversed_splits[0], 40)

    # 5. Megatron-LM's data loader (2 worker processes, default collate, pin_memory=True)
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.global_vars import set_args

    set_args(
        types.SimpleNamespace(
            dataloader_type="single",
            micro_batch_size=8,
            global_batch_size=8,
            full_validation=False,
            hybrid_context_parallel=False,
            num_workers=2,
            exit_signal_handler=False,
            data_sharding=True,
        )
    )
    parallel_state.set_data_parallel_rank(0)
    parallel_state._MPU_DATA_PARALLEL_WORLD_SIZE = 1
    train = BlendedMegatronDatasetBuilder(
        GPTDataset,
        [400, 20, 0],
        lambda: True,
        GPTDatasetConfig(path_to_cache=str(WORKDIR / f"loader-cache-{MODE}"), **gpt_fields),
    ).build()[0]
    no_mask_cache(train)
    loader = build_pretraining_data_loader(train, consumed_samples=16)
    results["loader"] = [batch for _, batch in zip(range(12), loader)]
    reversed_loader = build_pretraining_data_loader(reversed_splits[0], consumed_samples=0)
    results["reversed_loader"] = [batch for _, batch in zip(range(4), reversed_loader)]
    del loader, reversed_loader

    # 6. BERT (megatron's masked datasets stay megatron-core's; on tokenmill they subclass
    #    tokenmill's MegatronDataset, and their sample mapping is megatron's compiled helper)
    from megatron.core.datasets.bert_dataset import (
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )

    # megatron's masked datasets ask torch.distributed for the rank without checking that a
    # process group exists: give them one (one process)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{WORKDIR}/process-group-{MODE}", rank=0, world_size=1
    )
    bert = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset,
        [30, None, None],
        lambda: True,
        BERTMaskedWordPieceDatasetConfig(
            random_seed=2,
            sequence_length=40,
            tokenizer=TOKENIZER,
            blend=([PREFIXES["sentences"]], None),
            split="1",
            path_to_cache=str(WORKDIR / f"bert-cache-{MODE}"),
            masking_probability=0.15,
            short_sequence_probability=0.1,
            masking_max_ngram=3,
            masking_do_full_word=False,
            masking_do_permutation=False,
            masking_use_longer_ngrams=False,
            masking_use_geometric_distribution=False,
            classification_head=True,
        ),
    ).build()[0]
    results["bert_mro"] = [f"{c.__module__}.{c.__qualname__}" for c in type(bert).__mro__]
    results["bert"] = samples(bert, 30)

    # 7. tools/prepare_cache.py's offline build, then a training run with the fast-startup flags
    #    and the sequences-per-dataset file of tools/build_sequences_per_dataset.py
    from megatron.core.datasets.indexed_dataset import _IndexReader

    cache = WORKDIR / f"prepared-{MODE}"
    per_split = [([PREFIXES["a"], PREFIXES["b"]], [0.5, 0.5]), ([PREFIXES["text"]], None), None]
    prepared_fields = {
        "random_seed": 77,
        "sequence_length": 24,
        "tokenizer": TOKENIZER,
        "blend_per_split": per_split,
        "path_to_cache": str(cache),
        **FLAGS,
    }
    if MODE != "stock":
        compile_helpers()
    built = BlendedMegatronDatasetBuilder(
        GPTDataset, [150, None, None], lambda: True, GPTDatasetConfig(**prepared_fields)
    ).build()
    results["prepared_lengths"] = [None if d is None else len(d) for d in built]
    results["prepared_files"] = files_digest(cache)
    counts = {}
    for split in per_split:
        for prefix in split[0] if split else []:
            reader = _IndexReader(prefix + ".idx", False)
            counts[prefix] = (reader.sequence_count, reader.document_count)
    (WORKDIR / f"sequences-{MODE}.json").write_text(json.dumps(counts))
    sequences = json.loads((WORKDIR / f"sequences-{MODE}.json").read_text())
    fast = BlendedMegatronDatasetBuilder(
        GPTDataset,
        [150, None, None],
        lambda: True,
        GPTDatasetConfig(
            **prepared_fields,
            fast_cache_load=True,
            defer_npy_index_mmap=True,
            sequences_per_dataset=sequences,
        ),
    ).build()
    no_mask_cache(fast)
    results["fast_lengths"] = [None if d is None else len(d) for d in fast]
    results["fast"] = [samples(d, 25) for d in fast if d is not None]
    results["fast_files"] = files_digest(cache)  # nothing written by the fast run

    if MODE != "stock":
        results["patched"] = __import__("tokenmill.megatron").megatron.is_patched()

    torch.save(results, OUT)
    os._exit(0)  # skip interpreter teardown of megatron (several seconds); everything is saved


if __name__ == "__main__":
    main()
