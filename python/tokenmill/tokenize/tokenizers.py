"""Tokenizers the pipeline can run: built-in bytes, HF ``tokenizers`` and ``tiktoken``, all offline.

* ``bytes``: UTF-8 bytes as ids 0-255, BOS = 256, EOD = 257, vocabulary 258. Needs no file and
  no package; decoding is exact.
* HF ``tokenizers``: a local ``tokenizer.json`` (``Tokenizer.from_file``); padding and
  truncation are switched off. BOS/EOD are looked up by their token strings.
* ``tiktoken``: a local ``.tiktoken`` BPE file (``load_tiktoken_bpe``), with the GPT-2
  pre-tokenizer pattern and ``<|endoftext|>`` as the id after the last rank (50256 for GPT-2).
  Nothing is downloaded.

Every tokenizer encodes *ordinary* text: special-token strings that occur inside a document are
tokenized as text, never turned into control ids (so a document cannot inject an EOD).
A :class:`TokenizerSpec` is a small picklable description that worker processes load from; the
loaded tokenizer's :meth:`Tokenizer.fingerprint` (file sha256, kind, vocabulary size, special
ids) is what shards record and what mixing checks compare.

The tokenizer objects also carry the attributes megatron's ``GPTDatasetConfig`` reads
(``vocab_size``, ``eod``, ``unique_identifiers``), so the same object configures the datasets.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import numpy.typing as npt

__all__ = [
    "GPT2_PATTERN",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerSpec",
    "load_tokenizer",
]

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""The GPT-2 pre-tokenizer regular expression (tiktoken's ``r50k_base`` / ``gpt2``)."""

ENDOFTEXT = "<|endoftext|>"

_KINDS = ("bytes", "huggingface", "tiktoken")

TokenArray = npt.NDArray[Any]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer:
    """The interface of the pipeline's tokenizers.

    Attributes:
        kind: "bytes", "huggingface" or "tiktoken".
        vocab_size: the number of ids (all ids are below it).
        bos_id: the beginning-of-document id, or None if the tokenizer has none.
        eod_id: the end-of-document id, or None if the tokenizer has none.
        sha256: the sha256 of the tokenizer file (of a fixed description for ``bytes``).
        path: the tokenizer file, or None.
    """

    kind: str
    vocab_size: int
    bos_id: int | None
    eod_id: int | None
    sha256: str
    path: str | None

    def encode_batch(self, texts: Sequence[str]) -> list[TokenArray]:
        """Token ids of each text (ordinary text: no special tokens), as 1-D integer arrays."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | TokenArray) -> str:
        """The text of a sequence of ids."""
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the tokenizer's output: kind, file sha256, vocabulary, special ids."""
        return {
            "kind": self.kind,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eod_id": self.eod_id,
        }

    # The attributes megatron's datasets read from a tokenizer.
    @property
    def eod(self) -> int:
        """The end-of-document id (megatron's ``tokenizer.eod``).

        Raises:
            ValueError: the tokenizer has no end-of-document token.
        """
        if self.eod_id is None:
            raise ValueError(f"tokenizer {self.describe()} has no end-of-document token")
        return self.eod_id

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """Megatron's cache-key description of the tokenizer."""
        return {"class": type(self).__name__, **self.fingerprint()}

    def describe(self) -> str:
        """A short human-readable name: kind and file."""
        return self.kind if self.path is None else f"{self.kind} ({self.path})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, BOS = 256, EOD = 257 (vocabulary 258). Exact round trip."""

    BOS = 256
    EOD = 257

    def __init__(self) -> None:
        self.kind = "bytes"
        self.vocab_size = 258
        self.bos_id = self.BOS
        self.eod_id = self.EOD
        self.sha256 = hashlib.sha256(
            b"tokenmill bytes tokenizer v1: utf-8 0-255, 256, 257"
        ).hexdigest()
        self.path = None

    def encode_batch(self, texts: Sequence[str]) -> list[TokenArray]:
        return [numpy.frombuffer(text.encode("utf-8"), dtype=numpy.uint8) for text in texts]

    def decode(self, ids: Sequence[int] | TokenArray) -> str:
        array = numpy.asarray(ids)
        return bytes(array[array < 256].astype(numpy.uint8)).decode("utf-8", errors="replace")


class HuggingFaceTokenizer(Tokenizer):
    """An HF ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``.

    Args:
        path: the ``tokenizer.json`` file.
        bos_token: the BOS token string; None: the EOD token.
        eod_token: the EOD token string; None: ``<|endoftext|>`` if the vocabulary has it.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a tokenizer, or a named token is not in the vocabulary.
    """

    def __init__(self, path: str, bos_token: str | None = None, eod_token: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        self.kind = "huggingface"
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        try:
            tokenizer = HFTokenizer.from_file(self.path)
        except Exception as error:
            raise ValueError(f"{self.path}: not a HF tokenizers file: {error}") from error
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.sha256 = _sha256(self.path)
        self.eod_id = self._lookup(eod_token, "eod_token", default=ENDOFTEXT)
        self.bos_id = self._lookup(bos_token, "bos_token", default=None) if bos_token else None
        if self.bos_id is None:
            self.bos_id = self.eod_id

    def _lookup(self, token: str | None, field: str, default: str | None) -> int | None:
        name = token if token is not None else default
        if name is None:
            return None
        found = self._tokenizer.token_to_id(name)
        if found is None:
            if token is None:
                return None  # the default is optional
            raise ValueError(f"{self.path}: {field} {token!r} is not in the vocabulary")
        return int(found)

    def encode_batch(self, texts: Sequence[str]) -> list[TokenArray]:
        # encode_batch_fast (tokenizers >= 0.21) skips computing offsets
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        encodings = encode(list(texts), add_special_tokens=False)
        return [numpy.array(encoding.ids, dtype=numpy.int64) for encoding in encodings]

    def decode(self, ids: Sequence[int] | TokenArray) -> str:
        values = [int(value) for value in numpy.asarray(ids).reshape(-1)]
        return str(self._tokenizer.decode(values, skip_special_tokens=False))


class TiktokenTokenizer(Tokenizer):
    """A ``tiktoken`` BPE built from a local ``.tiktoken`` file with the GPT-2 pattern.

    ``<|endoftext|>`` gets the id after the last rank (50256 for GPT-2's 50256 ranks) and serves
    as EOD and, unless another is named, BOS (GPT-2's convention).

    Args:
        path: the ``.tiktoken`` file (base64 token, rank per line).
        bos_token: a special token string for BOS; only ``<|endoftext|>`` exists.
        eod_token: a special token string for EOD; only ``<|endoftext|>`` exists.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a tiktoken BPE file, or a named token is unknown.
    """

    def __init__(self, path: str, bos_token: str | None = None, eod_token: str | None = None):
        import tiktoken
        import tiktoken.load

        self.kind = "tiktoken"
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        try:
            ranks = tiktoken.load.load_tiktoken_bpe(self.path)
        except Exception as error:
            raise ValueError(f"{self.path}: not a .tiktoken BPE file: {error}") from error
        if not ranks:
            raise ValueError(f"{self.path}: not a .tiktoken BPE file: it has no ranks")
        special = {ENDOFTEXT: max(ranks.values()) + 1}
        for field, token in (("bos_token", bos_token), ("eod_token", eod_token)):
            if token is not None and token not in special:
                raise ValueError(
                    f"{self.path}: {field} {token!r} is not a special token of this encoding "
                    f"(known: {sorted(special)})"
                )
        self._encoding = tiktoken.Encoding(
            name=Path(self.path).stem,
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=special,
        )
        self.vocab_size = int(self._encoding.n_vocab)
        self.sha256 = _sha256(self.path)
        self.eod_id = special[ENDOFTEXT]
        self.bos_id = special[bos_token] if bos_token is not None else self.eod_id

    def encode_batch(self, texts: Sequence[str]) -> list[TokenArray]:
        # encode_to_numpy with no allowed special tokens equals encode_ordinary, without building
        # a list of Python ints first
        encode = self._encoding.encode_to_numpy
        return [encode(text, allowed_special=set(), disallowed_special=()) for text in texts]

    def encode_ordinary_batch(self, texts: Sequence[str], num_threads: int) -> list[list[int]]:
        """tiktoken's own threaded batch encoder (the benchmark's baseline)."""
        return self._encoding.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int] | TokenArray) -> str:
        return self._encoding.decode([int(value) for value in numpy.asarray(ids).reshape(-1)])


@dataclass(frozen=True)
class TokenizerSpec:
    """A picklable description of a tokenizer, loaded once per worker process.

    Args:
        kind: "bytes", "huggingface" or "tiktoken".
        path: the tokenizer file (None for "bytes").
        bos_token: BOS token string (HF / tiktoken), None for the default.
        eod_token: EOD token string (HF / tiktoken), None for the default.
    """

    kind: str = "bytes"
    path: str | None = None
    bos_token: str | None = None
    eod_token: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(
                f"tokenizer kind must be one of {', '.join(_KINDS)}, got {self.kind!r}"
            )
        if self.kind == "bytes" and self.path is not None:
            raise ValueError(f"the bytes tokenizer takes no file, got path={self.path!r}")
        if self.kind != "bytes" and not self.path:
            raise ValueError(f"a {self.kind} tokenizer needs a file path, got {self.path!r}")

    @classmethod
    def parse(
        cls, value: str, bos_token: str | None = None, eod_token: str | None = None
    ) -> TokenizerSpec:
        """A spec from a command-line value: ``bytes``, ``*.json`` (HF) or ``*.tiktoken``.

        Raises:
            ValueError: the value is none of these.
        """
        if value in ("bytes", "byte"):
            return cls("bytes")
        if value.endswith(".tiktoken"):
            return cls("tiktoken", value, bos_token, eod_token)
        if value.endswith(".json"):
            return cls("huggingface", value, bos_token, eod_token)
        raise ValueError(
            f"tokenizer must be 'bytes', a HF tokenizer.json or a .tiktoken file, got {value!r}"
        )

    def load(self) -> Tokenizer:
        """Build the tokenizer (imports its package)."""
        if self.kind == "bytes":
            return ByteTokenizer()
        assert self.path is not None  # checked in __post_init__
        if self.kind == "tiktoken":
            return TiktokenTokenizer(self.path, self.bos_token, self.eod_token)
        return HuggingFaceTokenizer(self.path, self.bos_token, self.eod_token)


def load_tokenizer(
    value: str | TokenizerSpec, bos_token: str | None = None, eod_token: str | None = None
) -> Tokenizer:
    """Load a tokenizer from ``bytes``, a ``tokenizer.json`` or a ``.tiktoken`` file.

    Args:
        value: a :class:`TokenizerSpec` or a command-line value (see :meth:`TokenizerSpec.parse`).
        bos_token: the BOS token string (HF / tiktoken).
        eod_token: the EOD token string (HF / tiktoken).

    Returns:
        The loaded tokenizer.

    Raises:
        FileNotFoundError: the tokenizer file is missing.
        ValueError: the value or the file is not a tokenizer this module knows.
    """
    spec = (
        value
        if isinstance(value, TokenizerSpec)
        else TokenizerSpec.parse(value, bos_token, eod_token)
    )
    return spec.load()
