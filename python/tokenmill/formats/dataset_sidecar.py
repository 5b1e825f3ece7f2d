"""The tokenizer fingerprint sidecar written next to every tokenized dataset.

``<prefix>.tokenmill.json`` (a name HF's ``tokenizer.json`` cannot collide with) holds::

    {"format": "tokenmill.dataset", "version": 1,
     "tokenizer": {"kind": "tiktoken", "sha256": "306c...", "vocab_size": 50257,
                   "bos_id": 50256, "eod_id": 50256,
                   "backend": "gigatoken", "backend_version": "0.10.0", "unicode17": "reference"},
     "options": {"prepend_bos": false, "append_eod": true, "window": null, "overlap": 0},
     "dtype": "uint16", "documents": 8854, "sequences": 8854, "tokens": 18161046,
     "inputs": [...]}

Two datasets may be mixed (merged, blended) only if their ``tokenizer`` objects are equal on the
identity fields (``IDENTITY_FIELDS``: kind, file sha256, vocabulary size, BOS and EOD ids; the
backend that encoded and its version are recorded but not compared, since every backend of a
file gives the same ids): :func:`check_tokenizer` and :func:`check_compatible` raise
:class:`~tokenmill.errors.TokenizerMismatchError` naming both sides and the differing field.
The sidecar is written to a temporary name and renamed, after the ``.bin`` and ``.idx``.

It is a format of its own, read by the data layers (the builder and mixtures refuse to blend
datasets of different tokenizers) and written by ``tokenmill.tokenize``; it knows a tokenizer
only through :class:`FingerprintedTokenizer` (``fingerprint()`` and ``describe()``), which
``tokenmill.tokenize.Tokenizer`` implements, so no data layer imports the tokenizers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from tokenmill.common.atomic import AtomicFile
from tokenmill.common.sidecar import check_header
from tokenmill.errors import DataFormatError, TokenizerMismatchError

__all__ = [
    "IDENTITY_FIELDS",
    "SIDECAR_SUFFIX",
    "FingerprintedTokenizer",
    "check_compatible",
    "check_tokenizer",
    "read_sidecar",
    "sidecar_path",
    "write_json_atomic",
    "write_sidecar",
]

SIDECAR_SUFFIX = ".tokenmill.json"
FORMAT = "tokenmill.dataset"
VERSION = 1
IDENTITY_FIELDS = ("kind", "sha256", "vocab_size", "bos_id", "eod_id")
_FIELDS = IDENTITY_FIELDS


@runtime_checkable
class FingerprintedTokenizer(Protocol):
    """A tokenizer that says what identifies its output (``tokenmill.tokenize.Tokenizer``)."""

    def fingerprint(self) -> dict[str, Any]:
        """kind, sha256, vocab_size, bos_id and eod_id (and optional backend fields)."""
        ...

    def describe(self) -> str:
        """A short human-readable name, for messages."""
        ...


def sidecar_path(prefix: str) -> str:
    """``<prefix>.tokenmill.json``."""
    return os.fspath(prefix) + SIDECAR_SUFFIX


def write_json_atomic(path: str, payload: Mapping[str, Any]) -> None:
    """Write JSON to a temporary file beside ``path``, fsync it, and rename it into place."""
    target = AtomicFile(path)
    try:
        text = json.dumps(payload, indent=1, sort_keys=True) + "\n"
        target.stream.write(text.encode("utf-8"))
        target.stream.flush()
        os.fsync(target.stream.fileno())
        target.commit()
    finally:
        target.abort()  # no-op after commit


def write_sidecar(prefix: str, tokenizer: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    """Write ``<prefix>.tokenmill.json`` with a tokenizer fingerprint and other fields.

    Returns:
        The payload written.
    """
    payload = {"format": FORMAT, "version": VERSION, "tokenizer": dict(tokenizer), **fields}
    write_json_atomic(sidecar_path(prefix), payload)
    return payload


def read_sidecar(prefix: str) -> dict[str, Any]:
    """The sidecar of a dataset prefix.

    Raises:
        DataFormatError: the sidecar is missing, not JSON, or not a tokenmill sidecar.
    """
    path = sidecar_path(prefix)
    try:
        with open(path, encoding="utf-8") as stream:
            payload = json.load(stream)
    except FileNotFoundError:
        raise DataFormatError(
            f"{path}: no tokenizer fingerprint for dataset {prefix!r}; it was not written by "
            "tokenmill tokenize (pass --allow-missing-fingerprint to merge it anyway)"
        ) from None
    except ValueError as error:
        raise DataFormatError(f"{path}: not valid JSON: {error}") from error
    payload = check_header(payload, path, FORMAT, VERSION, "sidecar", DataFormatError)
    tokenizer = payload.get("tokenizer")
    if not isinstance(tokenizer, dict) or any(field not in tokenizer for field in _FIELDS):
        raise DataFormatError(f"{path}: 'tokenizer' must hold {list(_FIELDS)}, got {tokenizer!r}")
    return payload


def _compare(
    expected: Mapping[str, Any], found: Mapping[str, Any], expected_name: str, found_name: str
) -> None:
    for field in _FIELDS:
        if expected.get(field) != found.get(field):
            raise TokenizerMismatchError(
                f"tokenizer mismatch: {found_name} has {field}={found.get(field)!r} but "
                f"{expected_name} has {field}={expected.get(field)!r} "
                f"(kinds {found.get('kind')!r} / {expected.get('kind')!r}); shards tokenized "
                "with different tokenizers cannot be mixed"
            )


def check_tokenizer(
    prefix: str, tokenizer: FingerprintedTokenizer | Mapping[str, Any]
) -> dict[str, Any]:
    """Check that a dataset was tokenized with ``tokenizer``.

    Args:
        prefix: the dataset prefix (``<prefix>.bin``, ``.idx``, ``.tokenmill.json``).
        tokenizer: a loaded tokenizer or a fingerprint dict.

    Returns:
        The dataset's sidecar.

    Raises:
        DataFormatError: the sidecar is missing or malformed.
        TokenizerMismatchError: the fingerprints differ (names the field and both values).
    """
    payload = read_sidecar(prefix)
    if isinstance(tokenizer, Mapping):
        expected, name = tokenizer, "the given tokenizer"
    else:
        expected, name = tokenizer.fingerprint(), tokenizer.describe()
    _compare(expected, payload["tokenizer"], name, f"dataset {prefix!r}")
    return payload


def check_compatible(prefixes: list[str]) -> dict[str, Any]:
    """Check that datasets share one tokenizer fingerprint and return it.

    Raises:
        DataFormatError: a sidecar is missing or malformed.
        TokenizerMismatchError: two datasets differ (names both and the field).
        ValueError: no prefixes.
    """
    if not prefixes:
        raise ValueError("no datasets given")
    first = read_sidecar(prefixes[0])["tokenizer"]
    for prefix in prefixes[1:]:
        _compare(
            first,
            read_sidecar(prefix)["tokenizer"],
            f"dataset {prefixes[0]!r}",
            f"dataset {prefix!r}",
        )
    return dict(first)
