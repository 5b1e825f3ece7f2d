"""Text to tokens: readers (jsonl/gz/zst/parquet/txt), tokenizers (bytes, HF, tiktoken, and
gigatoken with the same ids), the parallel restartable pipeline, merging, fingerprints and a
streaming parquet loader.

Nothing heavy is imported here; each submodule imports numpy, pyarrow, tokenizers, tiktoken or
torch only when it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "ByteTokenizer": "tokenmill.tokenize.tokenizers",
    "GigatokenTokenizer": "tokenmill.tokenize.tokenizers",
    "HuggingFaceTokenizer": "tokenmill.tokenize.tokenizers",
    "TiktokenTokenizer": "tokenmill.tokenize.tokenizers",
    "Tokenizer": "tokenmill.tokenize.tokenizers",
    "TokenizerSpec": "tokenmill.tokenize.tokenizers",
    "load_tokenizer": "tokenmill.tokenize.tokenizers",
    "ReadOptions": "tokenmill.tokenize.readers",
    "expand_inputs": "tokenmill.tokenize.readers",
    "read_documents": "tokenmill.tokenize.readers",
    "TokenizeConfig": "tokenmill.tokenize.pipeline",
    "TokenizeResult": "tokenmill.tokenize.pipeline",
    "tokenize": "tokenmill.tokenize.pipeline",
    "window_bounds": "tokenmill.tokenize.encode",
    "merge_datasets": "tokenmill.tokenize.merge",
    "check_tokenizer": "tokenmill.formats.dataset_sidecar",
    "check_compatible": "tokenmill.formats.dataset_sidecar",
    "read_sidecar": "tokenmill.formats.dataset_sidecar",
    "ParquetTokenStream": "tokenmill.tokenize.streaming",
    "ParquetTokenLoader": "tokenmill.tokenize.streaming",
}

__all__ = [
    "ByteTokenizer",
    "GigatokenTokenizer",
    "HuggingFaceTokenizer",
    "ParquetTokenLoader",
    "ParquetTokenStream",
    "ReadOptions",
    "TiktokenTokenizer",
    "TokenizeConfig",
    "TokenizeResult",
    "Tokenizer",
    "TokenizerSpec",
    "check_compatible",
    "check_tokenizer",
    "expand_inputs",
    "load_tokenizer",
    "merge_datasets",
    "read_documents",
    "read_sidecar",
    "tokenize",
    "window_bounds",
]

if TYPE_CHECKING:
    from tokenmill.formats.dataset_sidecar import check_compatible, check_tokenizer, read_sidecar
    from tokenmill.tokenize.encode import window_bounds
    from tokenmill.tokenize.merge import merge_datasets
    from tokenmill.tokenize.pipeline import TokenizeConfig, TokenizeResult, tokenize
    from tokenmill.tokenize.readers import ReadOptions, expand_inputs, read_documents
    from tokenmill.tokenize.streaming import ParquetTokenLoader, ParquetTokenStream
    from tokenmill.tokenize.tokenizers import (
        ByteTokenizer,
        GigatokenTokenizer,
        HuggingFaceTokenizer,
        TiktokenTokenizer,
        Tokenizer,
        TokenizerSpec,
        load_tokenizer,
    )


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tokenmill.tokenize' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
