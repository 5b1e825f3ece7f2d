"""tokenmill: the data engine between a text corpus and an LLM trainer.

The public API is re-exported here and imported lazily, so ``import tokenmill`` stays cheap
(no torch, no compiled extension) until a name is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "DType": "tokenmill.formats.megatron",
    "IndexedDataset": "tokenmill.formats.megatron",
    "IndexedDatasetBuilder": "tokenmill.formats.megatron",
    "TokenmillError": "tokenmill.errors",
    "DataFormatError": "tokenmill.errors",
    "CacheError": "tokenmill.errors",
    "PerformanceWarning": "tokenmill.errors",
}

__all__ = [
    "CacheError",
    "DType",
    "DataFormatError",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "PerformanceWarning",
    "TokenmillError",
    "__version__",
]

if TYPE_CHECKING:
    from tokenmill.errors import CacheError, DataFormatError, PerformanceWarning, TokenmillError
    from tokenmill.formats.megatron import DType, IndexedDataset, IndexedDatasetBuilder


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
