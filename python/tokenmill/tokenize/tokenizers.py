"""Tokenizers the pipeline can run: built-in bytes, HF ``tokenizers``, ``tiktoken`` and
``gigatoken``, all offline.

* ``bytes``: UTF-8 bytes as ids 0-255, BOS = 256, EOD = 257, vocabulary 258. Needs no file and
  no package; decoding is exact.
* HF ``tokenizers``: a local ``tokenizer.json`` (``Tokenizer.from_file``); padding and
  truncation are switched off. BOS/EOD are looked up by their token strings.
* ``tiktoken``: a local ``.tiktoken`` BPE file (``load_tiktoken_bpe``), with the GPT-2
  pre-tokenizer pattern and ``<|endoftext|>`` as the id after the last rank (50256 for GPT-2).
  Nothing is downloaded.
* ``gigatoken`` (:mod:`tokenmill.tokenize.gigatoken_backend`): either file, encoded by the
  gigatoken library to the same ids as the two *reference* backends above, 5-20x faster.

A tokenizer *file* has a ``kind`` (its format: ``huggingface`` for a tokenizer.json, ``tiktoken``
for a rank file) and is run by a *backend* (``tokenizers``, ``tiktoken`` or ``gigatoken``).
``TokenizerSpec.backend`` chooses it: ``"reference"`` (the file format's own library),
``"gigatoken"``, or ``"auto"`` (the default: gigatoken when it is installed and loads the file
and agrees with the reference on a probe text, else the reference; the loaded tokenizer's
``selection`` says which and why). Loading is strictly local: a path that is not an existing
file is an error, never a Hub lookup.

The encoding rules every backend follows (tested differentially, document by document):

* text is *ordinary*: special-token strings inside a document (``<|endoftext|>``) are encoded
  as text, exactly as tiktoken's ``encode_ordinary`` does, never as control ids, so a document
  cannot inject an EOD (for a tokenizer.json: every added token marked ``special``; added tokens
  that are not special stay whole words, as HF does);
* no BOS/EOS/post-processor tokens are added by the tokenizer; the pipeline appends EOD and
  prepends BOS itself;
* an empty document encodes to no ids (and stays a document of the output).

A :class:`TokenizerSpec` is a small picklable description that worker processes load from; the
loaded tokenizer's :meth:`Tokenizer.fingerprint` (file sha256, kind, vocabulary size, special
ids, plus the backend and its version) is what shards record; mixing checks compare only the
first five (:meth:`Tokenizer.identity`), so data tokenized by gigatoken and by the reference
backend from the same file blends: the ids are the same.

The tokenizer objects also carry the attributes megatron's ``GPTDatasetConfig`` reads
(``vocab_size``, ``eod``, ``unique_identifiers``), so the same object configures the datasets.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from tokenmill.tokenize.gigatoken_backend import GigatokenTokenizer
from tokenmill.tokenize.reference_backends import (
    ENDOFTEXT,
    GPT2_PATTERN,
    ByteTokenizer,
    HuggingFaceTokenizer,
    TiktokenTokenizer,
    TokenArray,
    Tokenizer,
    file_sha256,
    package_version,
)

__all__ = [
    "BACKENDS",
    "ENDOFTEXT",
    "GPT2_PATTERN",
    "ByteTokenizer",
    "GigatokenTokenizer",
    "HuggingFaceTokenizer",
    "TiktokenTokenizer",
    "TokenArray",
    "Tokenizer",
    "TokenizerSpec",
    "file_sha256",
    "load_tokenizer",
    "package_version",
]

_KINDS = ("bytes", "huggingface", "tiktoken")

BACKENDS = ("auto", "gigatoken", "reference")
"""``TokenizerSpec.backend`` values: choose automatically, force gigatoken, force the file
format's own library (HF ``tokenizers`` or ``tiktoken``)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """A picklable description of a tokenizer, loaded once per worker process.

    Args:
        kind: "bytes", "huggingface" (a tokenizer.json) or "tiktoken" (a rank file).
        path: the tokenizer file (None for "bytes").
        bos_token: BOS token string (HF / tiktoken), None for the default.
        eod_token: EOD token string (HF / tiktoken), None for the default.
        backend: "auto", "gigatoken" or "reference" (see the module docstring); ignored by
            "bytes".
    """

    kind: str = "bytes"
    path: str | None = None
    bos_token: str | None = None
    eod_token: str | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(
                f"tokenizer kind must be one of {', '.join(_KINDS)}, got {self.kind!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"tokenizer backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.kind == "bytes" and self.path is not None:
            raise ValueError(f"the bytes tokenizer takes no file, got path={self.path!r}")
        if self.kind != "bytes" and not self.path:
            raise ValueError(f"a {self.kind} tokenizer needs a file path, got {self.path!r}")

    @classmethod
    def parse(
        cls, value: str, bos_token: str | None = None, eod_token: str | None = None
    ) -> TokenizerSpec:
        """A spec from a command-line value: ``bytes``, or ``[BACKEND:]PATH`` with PATH a
        ``*.json`` (HF tokenizer.json) or ``*.tiktoken`` file and BACKEND ``gigatoken`` or
        ``reference`` (none: automatic).

        Raises:
            ValueError: the value is none of these.
        """
        if value in ("bytes", "byte"):
            return cls("bytes")
        backend = "auto"
        path = value
        prefix, separator, rest = value.partition(":")
        if separator and prefix in ("gigatoken", "reference") and rest:
            backend, path = prefix, rest
        if path.endswith(".tiktoken"):
            return cls("tiktoken", path, bos_token, eod_token, backend)
        if path.endswith(".json"):
            return cls("huggingface", path, bos_token, eod_token, backend)
        raise ValueError(
            "tokenizer must be 'bytes', a HF tokenizer.json or a .tiktoken file, optionally "
            f"prefixed by 'gigatoken:' or 'reference:', got {value!r}"
        )

    def load(self) -> Tokenizer:
        """Build the tokenizer (imports its package).

        Raises:
            FileNotFoundError: the tokenizer file does not exist.
            ValueError: the file is not a tokenizer of its kind; ``backend="gigatoken"`` and
                gigatoken is not installed, cannot load the file or disagrees with the reference.
        """
        if self.kind == "bytes":
            return ByteTokenizer()
        assert self.path is not None  # checked in __post_init__
        if not os.path.isfile(self.path):  # never a Hub lookup, whatever the backend
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        if self.backend == "reference":
            return self._load_reference()
        if self.backend == "gigatoken":
            return self._load_gigatoken()
        if importlib.util.find_spec("gigatoken") is None:
            tokenizer = self._load_reference()
            tokenizer.selection = "gigatoken is not installed: pip install 'tokenmill[gigatoken]'"
            return tokenizer
        try:
            return self._load_gigatoken()
        except ValueError as error:
            tokenizer = self._load_reference()
            tokenizer.selection = f"gigatoken cannot run this file: {error}"
            return tokenizer

    def _load_reference(self) -> Tokenizer:
        assert self.path is not None
        if self.kind == "tiktoken":
            return TiktokenTokenizer(self.path, self.bos_token, self.eod_token)
        return HuggingFaceTokenizer(self.path, self.bos_token, self.eod_token)

    def _load_gigatoken(self) -> Tokenizer:
        assert self.path is not None
        if importlib.util.find_spec("gigatoken") is None:
            raise ValueError(
                "backend 'gigatoken' needs the gigatoken package: pip install 'tokenmill[gigatoken]'"
            )
        tokenizer = GigatokenTokenizer(self.path, self.kind, self.bos_token, self.eod_token)
        if self.backend == "auto":
            tokenizer.selection = "chosen automatically: installed, loads the file, probe agrees"
        return tokenizer

    def resolved(self, tokenizer: Tokenizer) -> TokenizerSpec:
        """This spec with ``backend`` fixed to what ``tokenizer`` (its :meth:`load`) runs, so
        worker processes load the same backend without choosing again."""
        if self.kind == "bytes":
            return self
        backend = "gigatoken" if tokenizer.backend == "gigatoken" else "reference"
        return TokenizerSpec(self.kind, self.path, self.bos_token, self.eod_token, backend)


def load_tokenizer(
    value: str | TokenizerSpec, bos_token: str | None = None, eod_token: str | None = None
) -> Tokenizer:
    """Load a tokenizer from ``bytes``, a ``tokenizer.json`` or a ``.tiktoken`` file.

    Args:
        value: a :class:`TokenizerSpec` or a command-line value (see :meth:`TokenizerSpec.parse`).
        bos_token: the BOS token string (HF / tiktoken).
        eod_token: the EOD token string (HF / tiktoken).

    Returns:
        The loaded tokenizer (gigatoken's when installed and able to; see the module docstring).

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
