"""Which megatron-core release tokenmill's megatron-compatible classes follow.

`tokenmill.patch_megatron` detects the installed megatron-core (its distribution version) and
records it here; without megatron-core, or without the patch, tokenmill follows 0.19. What
depends on it (see docs/megatron.md, "Versions"):

* ``GPTDataset._query_document_sample_shuffle_indices`` returns ``(text, document_ids)`` before
  0.19 and ``(text, document_ids, document_lengths)`` from 0.19 on (``inter_document_masking``
  came in 0.19), so a subclass written against the installed release sees its contract.
"""

from __future__ import annotations

import importlib.metadata
import re

__all__ = ["DEFAULT", "follow_installed", "followed", "query_returns_lengths"]

DEFAULT: tuple[int, int] = (0, 19)
"""The release followed without megatron-core (or without the patch)."""

_followed: tuple[int, int] | None = None


def _parse(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def follow_installed() -> tuple[int, int]:
    """Detect the installed megatron-core (Megatron-LM main reports its next release, e.g.
    0.20) and follow it from now on; `DEFAULT` when none is installed."""
    global _followed
    try:
        detected = _parse(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        detected = None
    _followed = detected or DEFAULT
    return _followed


def followed() -> tuple[int, int]:
    """The (major, minor) release followed."""
    return _followed or DEFAULT


def query_returns_lengths() -> bool:
    """Whether ``_query_document_sample_shuffle_indices`` returns the document lengths (0.19+)."""
    return followed() >= (0, 19)
