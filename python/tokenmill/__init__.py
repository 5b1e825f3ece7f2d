"""tokenmill: the data engine between a text corpus and an LLM trainer.

The public API is re-exported here and imported lazily, so ``import tokenmill`` stays cheap
(no torch, no numpy, no compiled extension) until a name is first used. Type checkers read the
same names from ``__init__.pyi``; this module imports no other tokenmill module, so the import
graph (``lint-imports``) never runs from a layer through the package root back to another.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # Megatron-compatible API (megatron.core.datasets names)
    "DType": "tokenmill.formats.megatron",
    "IndexedDataset": "tokenmill.formats.megatron",
    "IndexedDatasetBuilder": "tokenmill.formats.megatron",
    "GPTDataset": "tokenmill.datasets.gpt",
    "GPTDatasetConfig": "tokenmill.datasets.gpt",
    "MockGPTDataset": "tokenmill.datasets.gpt",
    "BlendedDataset": "tokenmill.datasets.blended",
    "BlendedMegatronDatasetBuilder": "tokenmill.datasets.builder",
    "BlendedMegatronDatasetConfig": "tokenmill.datasets.config",
    "Split": "tokenmill.datasets.utils",
    "get_blend_from_list": "tokenmill.datasets.utils",
    "parse_and_normalize_split": "tokenmill.datasets.utils",
    "convert_split_vector_to_split_matrix": "tokenmill.datasets.utils",
    "normalize": "tokenmill.datasets.utils",
    "patch_megatron": "tokenmill.megatron",
    # tokenmill's own
    "RawText": "tokenmill.raw_text",
    "PackedDataset": "tokenmill.datasets.packed",
    "PackingConfig": "tokenmill.datasets.packed",
    "document_block_mask": "tokenmill.datasets.packed",
    "NanogptDataset": "tokenmill.datasets.nanogpt",
    "MemoryMappedDataset": "tokenmill.datasets.memory_mapped",
    "NanogptShard": "tokenmill.formats.nanogpt",
    "NanogptShardWriter": "tokenmill.formats.nanogpt",
    "write_nanogpt_shard": "tokenmill.formats.nanogpt",
    "read_bos_index": "tokenmill.formats.bos_index",
    "write_bos_index": "tokenmill.formats.bos_index",
    "open_token_file": "tokenmill.formats.token_dir",
    "find_token_positions": "tokenmill.formats.token_scan",
    "World": "tokenmill.common.world",
    "ThreadedBatchLoader": "tokenmill.loading.threaded",
    "make_data_loader": "tokenmill.loading.batch",
    "collate": "tokenmill.serving.batch",
    # offline cache builds, publishing and downloads
    "load_run_config": "tokenmill.runs.config_file",
    "build_cache": "tokenmill.runs.cache_build",
    "check_cache": "tokenmill.runs.cache_build",
    "publish": "tokenmill.storage.publish",
    "download": "tokenmill.storage.download",
    "start_download": "tokenmill.storage.download",
    "Manifest": "tokenmill.storage.manifest",
    "ChecksumError": "tokenmill.errors",
    "ObjectStorageConfig": "tokenmill.storage.object_storage",
    "ObjectStorageError": "tokenmill.errors",
    "Mixture": "tokenmill.datasets.mixture",
    "MixtureConfig": "tokenmill.datasets.mixture_config",
    "MixtureSource": "tokenmill.datasets.mixture_config",
    "MixturePhase": "tokenmill.datasets.mixture_config",
    "MixtureConfigError": "tokenmill.datasets.mixture_config",
    "MixtureDataset": "tokenmill.loading.mixture",
    "MixtureLoader": "tokenmill.loading.mixture",
    "SourceExhaustedError": "tokenmill.index.mixture_plan",
    "TokenmillError": "tokenmill.errors",
    "DataFormatError": "tokenmill.errors",
    "CacheError": "tokenmill.errors",
    "StaleCacheError": "tokenmill.errors",
    "SharedCacheDirectoryError": "tokenmill.errors",
    "MegatronAssertionError": "tokenmill.errors",
    "PerformanceWarning": "tokenmill.errors",
}

__all__ = [  # noqa: RUF022 - grouped like _EXPORTS
    "__version__",
    "DType",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "GPTDataset",
    "GPTDatasetConfig",
    "MockGPTDataset",
    "BlendedDataset",
    "BlendedMegatronDatasetBuilder",
    "BlendedMegatronDatasetConfig",
    "Split",
    "get_blend_from_list",
    "parse_and_normalize_split",
    "convert_split_vector_to_split_matrix",
    "normalize",
    "patch_megatron",
    "RawText",
    "PackedDataset",
    "PackingConfig",
    "document_block_mask",
    "NanogptDataset",
    "MemoryMappedDataset",
    "NanogptShard",
    "NanogptShardWriter",
    "write_nanogpt_shard",
    "read_bos_index",
    "write_bos_index",
    "open_token_file",
    "find_token_positions",
    "World",
    "ThreadedBatchLoader",
    "make_data_loader",
    "collate",
    "load_run_config",
    "build_cache",
    "check_cache",
    "publish",
    "download",
    "start_download",
    "Manifest",
    "ChecksumError",
    "ObjectStorageConfig",
    "ObjectStorageError",
    "Mixture",
    "MixtureConfig",
    "MixtureSource",
    "MixturePhase",
    "MixtureConfigError",
    "MixtureDataset",
    "MixtureLoader",
    "SourceExhaustedError",
    "PerformanceWarning",
    "TokenmillError",
    "DataFormatError",
    "MegatronAssertionError",
    "CacheError",
    "StaleCacheError",
    "SharedCacheDirectoryError",
]


def __getattr__(name: str) -> object:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
