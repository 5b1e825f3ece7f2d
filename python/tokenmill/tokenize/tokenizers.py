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

import hashlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import numpy.typing as npt

__all__ = [
    "BACKENDS",
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

BACKENDS = ("auto", "gigatoken", "reference")
"""``TokenizerSpec.backend`` values: choose automatically, force gigatoken, force the file
format's own library (HF ``tokenizers`` or ``tiktoken``)."""

_IDENTITY_FIELDS = ("kind", "sha256", "vocab_size", "bos_id", "eod_id")

TokenArray = npt.NDArray[Any]


def package_version(name: str) -> str:
    """The installed version of a distribution, or "unknown"."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


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
        backend: the library that encodes: "tokenmill" (bytes), "tokenizers", "tiktoken" or
            "gigatoken".
        selection: why this backend runs (for ``TokenizerSpec(backend="auto")``), or "".
    """

    kind: str
    vocab_size: int
    bos_id: int | None
    eod_id: int | None
    sha256: str
    path: str | None
    backend: str = "tokenmill"
    selection: str = ""

    def encode_batch(self, texts: Sequence[str]) -> list[TokenArray]:
        """Token ids of each text (ordinary text: no special tokens), as 1-D integer arrays."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | TokenArray) -> str:
        """The text of a sequence of ids."""
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        """What identifies the tokenizer's ids: kind, file sha256, vocabulary, special ids (the
        fields that mixing checks compare)."""
        return {
            "kind": self.kind,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eod_id": self.eod_id,
        }

    def backend_fields(self) -> dict[str, Any]:
        """Which library encoded, and its version (recorded in sidecars, never compared)."""
        version = tokenmill_version() if self.backend == "tokenmill" else package_version(self.backend)
        return {"backend": self.backend, "backend_version": version}

    def fingerprint(self) -> dict[str, Any]:
        """The sidecar's ``tokenizer`` object: :meth:`identity` plus :meth:`backend_fields`."""
        return {**self.identity(), **self.backend_fields()}

    def describe_backend(self) -> str:
        """``"<backend> <version>"`` and, when chosen automatically, why."""
        fields = self.backend_fields()
        text = f"{fields['backend']} {fields['backend_version']}"
        return f"{text} ({self.selection})" if self.selection else text

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
        """Megatron's cache-key description of the tokenizer (its ids' identity: index caches are
        shared by every backend of one tokenizer file)."""
        return {"class": self.identity_class, **self.identity()}

    @property
    def identity_class(self) -> str:
        """The class name in :attr:`unique_identifiers` (the reference class for gigatoken)."""
        return type(self).__name__

    def describe(self) -> str:
        """A short human-readable name: kind and file."""
        return self.kind if self.path is None else f"{self.kind} ({self.path})"


def tokenmill_version() -> str:
    """tokenmill's own version (the backend of the bytes tokenizer)."""
    from tokenmill import __version__

    return str(__version__)


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
        # special-token text in a document is ordinary text (the module's rules); added tokens
        # that are not special still match as words, as in every HF encode
        tokenizer.encode_special_tokens = True
        self.backend = "tokenizers"
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
        self.backend = "tiktoken"
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
        from tokenmill.tokenize.gigatoken_backend import GigatokenTokenizer

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
