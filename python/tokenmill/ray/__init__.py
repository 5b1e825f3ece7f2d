"""Tokenize on a Ray cluster: the same bytes as ``tokenmill tokenize``, any cluster size.

Two entry points (``pip install 'tokenmill[ray]'``):

* :func:`tokenize_on_ray` (``tokenmill tokenize ... --engine ray``): files in (local, on a
  file system every node sees, or ``s3://``), one Megatron ``.bin/.idx`` (or nanogpt) out. The
  inputs are cut into *ranges* (byte ranges of plain JSON Lines / line text, groups of parquet
  row groups, whole compressed files); an actor pool (one tokenizer per actor) writes each
  range's part under a name derived from the range, atomically and idempotently; the driver
  merges the parts in input order.
* :func:`tokenize_dataset`: a ``ray.data.Dataset`` of text records in, the same output: a
  ``map_batches`` stage on an actor pool encodes, the driver writes the encoded batches in the
  dataset's order (the commit).

Nothing here imports Ray until a function runs; ``import tokenmill`` never imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "InputRange": "tokenmill.ray.engine",
    "plan_ranges": "tokenmill.ray.engine",
    "tokenize_on_ray": "tokenmill.ray.engine",
    "tokenize_dataset": "tokenmill.ray.dataset",
}

__all__ = ["InputRange", "plan_ranges", "tokenize_dataset", "tokenize_on_ray"]

if TYPE_CHECKING:
    from tokenmill.ray.dataset import tokenize_dataset
    from tokenmill.ray.engine import InputRange, plan_ranges, tokenize_on_ray


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tokenmill.ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
