"""Blend entries that name raw text instead of a tokenized prefix: the datasets layer's side.

Where raw-text resolution lives, given the layer rules. The data layers (this one included) may
not import ``tokenmill.tokenize``, so they cannot tokenize. They only *recognise* an entry that
is not a Megatron prefix (a ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` or ``.parquet`` file, a
directory of them, or a glob) and hand every such entry of a config to a *resolver the caller
provides*, which returns one Megatron prefix per entry. The builder then runs its ordinary
GPTDataset/BlendedDataset path on the resolved config. The caller provides the resolver in one
of two places, never through a module-level registry:

* on the config: ``GPTDatasetConfig(raw_text=tokenmill.RawText(...))`` (tokenmill's own API);
* on the entry itself: a :class:`RawTextEntry` (a ``str`` that carries its resolver), which is
  what ``megatron.core.datasets.utils.get_blend_from_list`` returns under ``patch_megatron``
  for a ``--data-path`` entry naming raw text, so Megatron-LM's unchanged code gets it.

The tokenize-backed resolver lives in ``tokenmill.raw_text``, a layer of its own between
``megatron`` and ``loading`` (the one place where ``tokenize`` meets ``datasets``), so both the
megatron layer and everything above it (``runs``, ``cli``) can wire it.

Resolution happens at ``BlendedMegatronDatasetBuilder.build()``, on every rank (it is a
collective when torch.distributed is initialised: the ranks tokenize together), before the
tokenizer check and any index is built.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "RAW_TEXT_SUFFIXES",
    "RawTextEntry",
    "RawTextResolution",
    "RawTextResolver",
    "is_raw_text",
    "resolve_raw_text",
]

RAW_TEXT_SUFFIXES = (
    ".jsonl",
    ".jsonl.gz",
    ".jsonl.zst",
    ".jsonl.zstd",
    ".json",
    ".json.gz",
    ".json.zst",
    ".parquet",
)
"""File names a blend entry may end with to name raw text (``tokenmill tokenize``'s formats
without ``.txt``, which a Megatron prefix could plausibly be named after)."""


def is_raw_text(entry: str) -> bool:
    """Whether a blend entry names raw text rather than a Megatron ``.bin/.idx`` prefix: it ends
    with a raw-text suffix (and is not itself a prefix: no ``<entry>.idx``), holds a glob
    character, or is a directory that is not a prefix."""
    if isinstance(entry, RawTextEntry):
        return True
    if entry.startswith(("s3://", "msc://")):
        return entry.endswith(RAW_TEXT_SUFFIXES) or glob.has_magic(entry)
    # an ordinary prefix costs one stat of its own name (not of its .idx/.bin, whose stats the
    # warm path counts); `<entry>.idx` is looked at only for names that could be either
    if entry.endswith(RAW_TEXT_SUFFIXES) or glob.has_magic(entry) or os.path.isdir(entry):
        return not os.path.exists(entry + ".idx")
    return False


@dataclass(frozen=True)
class RawTextResolution:
    """What a resolver returns.

    Args:
        prefixes: the Megatron prefix of each raw-text entry it was given.
        tokenizer: the tokenizer object the datasets should use instead of the config's (when
            the config named a tokenizer by a spec string, which has no ``eod``), or None.
    """

    prefixes: dict[str, str]
    tokenizer: Any = None


class RawTextResolver(Protocol):
    """Turns the raw-text entries of a config into Megatron prefixes. Called on every rank with
    the same arguments; may be collective (all ranks tokenize together)."""

    def resolve(self, entries: Sequence[str], config: Any) -> RawTextResolution: ...


class RawTextEntry(str):
    """A blend entry naming raw text that carries the resolver to use when the config has none
    (an ordinary ``str`` everywhere else: equal to, and hashing as, its text)."""

    resolver: RawTextResolver

    def __new__(cls, text: str, resolver: RawTextResolver) -> RawTextEntry:
        entry = super().__new__(cls, text)
        entry.resolver = resolver
        return entry

    def __reduce__(self) -> tuple[Any, ...]:
        return (RawTextEntry, (str(self), self.resolver))


def _blends(config: Any) -> list[Any]:
    if config.blend is not None:
        return [config.blend]
    return list(config.blend_per_split or [])


def resolve_raw_text(config: Any) -> Any:
    """``config`` with every raw-text blend entry replaced by the prefix its resolver made (the
    same object when there is none).

    Raises:
        ValueError: an entry names raw text and neither the config (``raw_text``) nor the entry
            provides a resolver.
    """
    if getattr(config, "mock", False):
        return config
    entries: dict[str, None] = {}
    for blend in _blends(config):
        if blend is not None:
            entries.update(dict.fromkeys(e for e in blend[0] if is_raw_text(e)))
    if not entries:
        return config
    resolver = getattr(config, "raw_text", None)
    if resolver is None:
        resolver = next((e.resolver for e in entries if isinstance(e, RawTextEntry)), None)
    if resolver is None:
        first = next(iter(entries))
        raise ValueError(
            f"blend entry {first!r} names raw text, not a Megatron prefix: pass "
            "GPTDatasetConfig(raw_text=tokenmill.RawText(...)) to tokenize it at build time, "
            "or tokenize it first with `tokenmill tokenize`"
        )
    resolution = resolver.resolve([str(e) for e in entries], config)

    def resolved(blend: Any) -> Any:
        if blend is None:
            return None
        prefixes, weights = blend
        return (
            [resolution.prefixes[str(e)] if e in entries else e for e in prefixes],
            weights,
        )

    changes: dict[str, Any] = {"raw_text": None} if hasattr(config, "raw_text") else {}
    if config.blend is not None:
        changes["blend"] = resolved(config.blend)
    else:
        changes["blend_per_split"] = [resolved(b) for b in config.blend_per_split]
    if resolution.tokenizer is not None:
        changes["tokenizer"] = resolution.tokenizer
    return dataclasses.replace(config, **changes)
