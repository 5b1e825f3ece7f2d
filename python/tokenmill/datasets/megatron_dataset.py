"""The base of Megatron-style mid-level datasets: identity, cache key and pad-token rules.

A dataset's identity is megatron-core's ordered dict {class, dataset_path, num_samples,
index_split, random_seed, sequence_length, split, split_matrix, tokenizer}; its JSON text
(`indent=4`, objects serialised through their own `unique_identifiers`) is the cache
description and its md5 the cache key, so caches are interchangeable with megatron-core.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenmill.datasets.config import BlendedMegatronDatasetConfig
from tokenmill.datasets.utils import Split

__all__ = ["PAD_TOKEN_ID", "MegatronDataset", "describe", "describe_compact", "described_text"]

PAD_TOKEN_ID = -1
"""megatron-core's pad id when the tokenizer has none (never a real token)."""


def _identifiers_of(obj: Any) -> Any:
    return obj.unique_identifiers


# The indented JSON of the identifiers after the first scalar ones (the config's fields, the
# same for every source of a blend), keyed by their compact JSON. Why: json.dumps with indent
# runs the pure-Python encoder (the C one only writes compact JSON), and the config part is
# most of the text: 30 us per dataset, 10% of a warm start at 1,000 sources. The compact and
# the indented text differ only in whitespace, so one determines the other.
_INDENTED_TAILS: dict[str, str] = {}
_MAX_CACHED_TAIL = 1 << 16  # a blend's own tail (every member's identity) is not worth keeping
_MAX_CACHED_TAILS = 256
_SCALARS = (str, int, float, bool, type(None))


def described_text(dataset: Any) -> str | None:
    """The description `dataset` computed at construction, if its ``unique_identifiers`` still
    hold what was described then (the same entries: a subclass may change them afterwards);
    else None."""
    recorded = getattr(dataset, "_described", None)
    if recorded is None:
        return None
    compact, text = recorded
    try:
        current = _compact(dataset.unique_identifiers)
    except (AttributeError, TypeError, ValueError):
        return None
    return str(text) if current == compact else None


def _compact(identifiers: Any) -> str:
    """The compact JSON of `identifiers` (the C encoder): equal compact texts have equal
    indented ones."""
    return json.dumps(identifiers, default=_identifiers_of, separators=(",", ":"))


def describe(
    identifiers: dict[str, Any], known: Mapping[str, Sequence[str | None]] | None = None
) -> tuple[str, str]:
    """(description JSON, md5 hex digest) exactly as megatron-core computes them:
    ``json.dumps(identifiers, indent=4)``, objects through their ``unique_identifiers``.

    `known`: for a list-valued entry, the descriptions already computed for its items (a
    blend's member datasets, `described_text`): their text, indented two levels deeper, is
    their place in this one, so the 1,000 members of a blend are not encoded again. Used only
    when every item's text is known.
    """
    if known and all(isinstance(name, str) for name in identifiers):
        usable = {
            name: texts
            for name, texts in known.items()
            if name in identifiers
            and isinstance(identifiers[name], list)
            and len(texts) == len(identifiers[name])
            and all(text is not None for text in texts)
        }
        if usable:
            return _describe_with_known(identifiers, usable)
    description, digest, _ = describe_compact(identifiers)
    return description, digest


def describe_compact(identifiers: dict[str, Any]) -> tuple[str, str, str]:
    """:func:`describe` (without `known`), and the compact JSON of `identifiers` (`_compact`),
    which a dataset keeps to see later whether its identifiers still hold (`described_text`):
    made from the compact text of the config's part that describe() encodes anyway, not by a
    third encoding."""
    items = list(identifiers.items())
    head = 0  # the leading entries with scalar values (class, path, samples, split)
    while (
        head < min(len(items), 4)
        and isinstance(items[head][0], str)  # (json.dumps writes other keys unquoted)
        and isinstance(items[head][1], _SCALARS)
    ):
        head += 1
    if head == len(items):
        description = json.dumps(identifiers, indent=4, default=_identifiers_of)
        compact = _compact(identifiers)
    else:
        tail = dict(items[head:])
        key = _compact(tail)
        indented = _INDENTED_TAILS.get(key)
        if indented is None:
            # "{\n" + the entries, indented one level as inside the whole object + "\n}"
            indented = json.dumps(tail, indent=4, default=_identifiers_of)[2:-2]
            if len(key) <= _MAX_CACHED_TAIL:
                if len(_INDENTED_TAILS) >= _MAX_CACHED_TAILS:  # many configs in one process
                    _INDENTED_TAILS.clear()
                _INDENTED_TAILS[key] = indented
        encoded = [(_scalar_json(name), _scalar_json(value)) for name, value in items[:head]]
        lines = [f"    {name}: {value}" for name, value in encoded]
        description = "{\n" + ",\n".join([*lines, indented]) + "\n}"
        # a scalar's JSON has no separators to compact: the head's entries, then the tail's
        compact = "{" + "".join(f"{name}:{value}," for name, value in encoded) + key[1:]
    digest = hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()
    return description, digest, compact


def _scalar_json(value: Any) -> str:
    """``json.dumps(value)`` of a scalar: strings and ints by the encoder's C function and
    ``int.__repr__`` (json.dumps goes through JSONEncoder.encode: 2 us for an int, the head of
    a description is 8 such calls per dataset), anything else by json.dumps."""
    kind = type(value)
    if kind is str:
        return encode_basestring_ascii(value)
    if kind is int:
        return int.__repr__(value)
    return json.dumps(value)


def _describe_with_known(
    identifiers: dict[str, Any], known: Mapping[str, Sequence[str | None]]
) -> tuple[str, str]:
    parts = []
    for name, value in identifiers.items():
        texts = known.get(name)
        if texts is None:
            # a value at depth 1: its own indented text, continuation lines 4 spaces deeper
            encoded = json.dumps(value, indent=4, default=_identifiers_of).replace("\n", "\n    ")
        elif not texts:
            encoded = "[]"
        else:
            items = ",\n".join("        " + str(text).replace("\n", "\n        ") for text in texts)
            encoded = "[\n" + items + "\n    ]"
        parts.append(f"    {json.dumps(name)}: {encoded}")
    description = "{\n" + ",\n".join(parts) + "\n}" if parts else "{}"
    digest = hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()
    return description, digest


def resolve_pad_token_id(config: BlendedMegatronDatasetConfig) -> int:
    """The tokenizer's pad id, reset to -1 (with a warning) if it collides with a special token."""
    tokenizer = config.tokenizer
    try:
        pad = int(tokenizer.pad)
    except Exception:  # megatron-core treats any failure to read `pad` as "no pad id"
        return PAD_TOKEN_ID
    special: list[Any] = []
    try:
        special = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
    except (AttributeError, IndexError, ValueError):
        special = []
    if not special:
        for name in ("eos", "eod"):
            with contextlib.suppress(AttributeError, NotImplementedError):
                special.append(getattr(tokenizer, name))
    if pad in special:
        if config.allow_ambiguous_pad_tokens:
            warnings.warn(
                f"The tokenizer's pad id {pad} collides with another special token id; pad "
                "tokens in the data will be masked from the loss (allow_ambiguous_pad_tokens).",
                stacklevel=3,
            )
        else:
            warnings.warn(
                f"The tokenizer's pad id {pad} collides with another special token id; using "
                f"{PAD_TOKEN_ID} as the pad id so no real token is masked.",
                stacklevel=3,
            )
            return PAD_TOKEN_ID
    return pad


class MegatronDataset(ABC):
    """Common state of GPTDataset and its relatives (megatron-core's MegatronDataset).

    Subclass hooks (megatron-core's): `numel_low_level_dataset` and `build_low_level_dataset`
    (static, used by the builder), `_key_config_attributes` (static: the config fields of the
    cache description and hash), `__len__` and `__getitem__` (abstract).
    """

    def __init__(
        self,
        dataset: Any,
        dataset_path: str | None,
        indices: npt.NDArray[np.integer] | None,
        num_samples: int | None,
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

        self.unique_identifiers: OrderedDict[str, Any] = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attribute in self._key_config_attributes():
            self.unique_identifiers[attribute] = getattr(self.config, attribute)
        self._extend_identifiers(self.unique_identifiers)
        self.unique_description, self.unique_description_hash, compact = describe_compact(
            self.unique_identifiers
        )
        # what was described, for a blend of this dataset (`described_text`)
        self._described = (compact, self.unique_description)
        self._pad_token_id = resolve_pad_token_id(config)

    def _extend_identifiers(self, identifiers: OrderedDict[str, Any]) -> None:  # noqa: B027
        """Hook for options that change the index but are absent from megatron's key (none by
        default; optional, hence not abstract)."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        """Number of elements the splits divide (overridden by subclasses)."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: Any) -> Any:
        """Open the low-level dataset at `dataset_path` (overridden by subclasses)."""
        raise NotImplementedError

    @staticmethod
    def _files_read_ahead(dataset_path: str, config: Any) -> list[tuple[str, bool]]:
        """tokenmill's hook: the files the builder may read ahead for `dataset_path`, as
        (path, whole) pairs in the order they are read (common.whole_read.reading_ahead); none
        by default."""
        return []

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int:
        """The number of samples."""

    @abstractmethod
    def __getitem__(self, idx: int) -> Any:
        """Sample `idx`."""

    def __add__(self, other: Any) -> Any:
        """`torch.utils.data.ConcatDataset([self, other])`, as torch's Dataset base class does."""
        from torch.utils.data import ConcatDataset

        return ConcatDataset([self, other])
