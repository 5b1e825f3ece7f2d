"""Types of tokenmill's public API (``__init__.py`` imports each name lazily on first use;
tests/test_package.py checks that this file and its ``_EXPORTS`` name the same modules)."""

from tokenmill.common.world import World as World
from tokenmill.datasets.blended import BlendedDataset as BlendedDataset
from tokenmill.datasets.builder import (
    BlendedMegatronDatasetBuilder as BlendedMegatronDatasetBuilder,
)
from tokenmill.datasets.config import BlendedMegatronDatasetConfig as BlendedMegatronDatasetConfig
from tokenmill.datasets.gpt import (
    GPTDataset as GPTDataset,
)
from tokenmill.datasets.gpt import (
    GPTDatasetConfig as GPTDatasetConfig,
)
from tokenmill.datasets.gpt import (
    MockGPTDataset as MockGPTDataset,
)
from tokenmill.datasets.memory_mapped import MemoryMappedDataset as MemoryMappedDataset
from tokenmill.datasets.mixture import Mixture as Mixture
from tokenmill.datasets.mixture_config import (
    MixtureConfig as MixtureConfig,
)
from tokenmill.datasets.mixture_config import (
    MixtureConfigError as MixtureConfigError,
)
from tokenmill.datasets.mixture_config import (
    MixturePhase as MixturePhase,
)
from tokenmill.datasets.mixture_config import (
    MixtureSource as MixtureSource,
)
from tokenmill.datasets.nanogpt import NanogptDataset as NanogptDataset
from tokenmill.datasets.packed import (
    PackedDataset as PackedDataset,
)
from tokenmill.datasets.packed import (
    PackingConfig as PackingConfig,
)
from tokenmill.datasets.packed import (
    document_block_mask as document_block_mask,
)
from tokenmill.datasets.utils import (
    Split as Split,
)
from tokenmill.datasets.utils import (
    convert_split_vector_to_split_matrix as convert_split_vector_to_split_matrix,
)
from tokenmill.datasets.utils import (
    get_blend_from_list as get_blend_from_list,
)
from tokenmill.datasets.utils import (
    normalize as normalize,
)
from tokenmill.datasets.utils import (
    parse_and_normalize_split as parse_and_normalize_split,
)
from tokenmill.errors import (
    CacheError as CacheError,
)
from tokenmill.errors import (
    ChecksumError as ChecksumError,
)
from tokenmill.errors import (
    DataFormatError as DataFormatError,
)
from tokenmill.errors import (
    MegatronAssertionError as MegatronAssertionError,
)
from tokenmill.errors import (
    ObjectStorageError as ObjectStorageError,
)
from tokenmill.errors import (
    PerformanceWarning as PerformanceWarning,
)
from tokenmill.errors import (
    SharedCacheDirectoryError as SharedCacheDirectoryError,
)
from tokenmill.errors import (
    StaleCacheError as StaleCacheError,
)
from tokenmill.errors import (
    TokenmillError as TokenmillError,
)
from tokenmill.formats.bos_index import (
    read_bos_index as read_bos_index,
)
from tokenmill.formats.bos_index import (
    write_bos_index as write_bos_index,
)
from tokenmill.formats.megatron import (
    DType as DType,
)
from tokenmill.formats.megatron import (
    IndexedDataset as IndexedDataset,
)
from tokenmill.formats.megatron import (
    IndexedDatasetBuilder as IndexedDatasetBuilder,
)
from tokenmill.formats.nanogpt import (
    NanogptShard as NanogptShard,
)
from tokenmill.formats.nanogpt import (
    NanogptShardWriter as NanogptShardWriter,
)
from tokenmill.formats.nanogpt import (
    write_nanogpt_shard as write_nanogpt_shard,
)
from tokenmill.formats.token_dir import open_token_file as open_token_file
from tokenmill.formats.token_scan import find_token_positions as find_token_positions
from tokenmill.index.mixture_plan import SourceExhaustedError as SourceExhaustedError
from tokenmill.loading.batch import make_data_loader as make_data_loader
from tokenmill.loading.mixture import (
    MixtureDataset as MixtureDataset,
)
from tokenmill.loading.mixture import (
    MixtureLoader as MixtureLoader,
)
from tokenmill.loading.threaded import ThreadedBatchLoader as ThreadedBatchLoader
from tokenmill.megatron import (
    patch_megatron as patch_megatron,
)
from tokenmill.raw_text import RawText as RawText
from tokenmill.runs.cache_build import build_cache as build_cache
from tokenmill.runs.cache_build import check_cache as check_cache
from tokenmill.runs.config_file import load_run_config as load_run_config
from tokenmill.serving.batch import collate as collate
from tokenmill.storage.download import download as download
from tokenmill.storage.download import start_download as start_download
from tokenmill.storage.manifest import Manifest as Manifest
from tokenmill.storage.object_storage import ObjectStorageConfig as ObjectStorageConfig
from tokenmill.storage.publish import publish as publish

__version__: str
__all__ = [
    "BlendedDataset",
    "BlendedMegatronDatasetBuilder",
    "BlendedMegatronDatasetConfig",
    "CacheError",
    "ChecksumError",
    "DType",
    "DataFormatError",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "Manifest",
    "MegatronAssertionError",
    "MemoryMappedDataset",
    "Mixture",
    "MixtureConfig",
    "MixtureConfigError",
    "MixtureDataset",
    "MixtureLoader",
    "MixturePhase",
    "MixtureSource",
    "MockGPTDataset",
    "NanogptDataset",
    "NanogptShard",
    "NanogptShardWriter",
    "ObjectStorageConfig",
    "ObjectStorageError",
    "PackedDataset",
    "PackingConfig",
    "PerformanceWarning",
    "RawText",
    "SharedCacheDirectoryError",
    "SourceExhaustedError",
    "Split",
    "StaleCacheError",
    "ThreadedBatchLoader",
    "TokenmillError",
    "World",
    "__version__",
    "build_cache",
    "check_cache",
    "collate",
    "convert_split_vector_to_split_matrix",
    "document_block_mask",
    "download",
    "find_token_positions",
    "get_blend_from_list",
    "load_run_config",
    "make_data_loader",
    "normalize",
    "open_token_file",
    "parse_and_normalize_split",
    "patch_megatron",
    "publish",
    "read_bos_index",
    "start_download",
    "write_bos_index",
    "write_nanogpt_shard",
]
