"""The tokenizer interface and the reference backends: built-in bytes, HF ``tokenizers`` and
``tiktoken`` (the file formats' own libraries).

The rules every backend follows, and how a backend is chosen, are in
:mod:`tokenmill.tokenize.tokenizers`, which re-exports these names; the gigatoken backend
(:mod:`tokenmill.tokenize.gigatoken_backend`) builds on this module.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy
import numpy.typing as npt

__all__ = [
    "ENDOFTEXT",
    "GPT2_PATTERN",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "TiktokenTokenizer",
    "TokenArray",
    "Tokenizer",
    "file_sha256",
    "package_version",
]

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""The GPT-2 pre-tokenizer regular expression (tiktoken's ``r50k_base`` / ``gpt2``)."""

ENDOFTEXT = "<|endoftext|>"


TokenArray = npt.NDArray[Any]


@functools.cache
def package_version(name: str) -> str:
    """The installed version of a distribution, or "unknown".

    First from the name of the one ``<name>-<version>.dist-info`` directory beside the module of
    that name (a directory listing): ``importlib.metadata`` searches every path entry and parses
    the METADATA file, 10-25 ms in a large environment, which a warm raw-text relaunch (it keys
    its cache on the backend's version) paid on every rank before its first batch.
    """
    listed = _dist_info_version(name)
    if listed is not None:
        return listed
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _dist_info_version(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isabs(spec.origin):
        return None
    module_dir = os.path.dirname(spec.origin)
    site = os.path.dirname(module_dir) if spec.submodule_search_locations else module_dir
    prefix = name.replace("-", "_").replace(".", "_").lower() + "-"
    try:
        found = [
            entry[len(prefix) : -len(".dist-info")]
            for entry in os.listdir(site)
            if entry.lower().startswith(prefix) and entry.endswith(".dist-info")
        ]
    except OSError:
        return None
    return found[0] if len(found) == 1 and "-" not in found[0] else None


def file_sha256(path: str) -> str:
    """The sha256 hex digest of a file."""
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
        version = (
            tokenmill_version() if self.backend == "tokenmill" else package_version(self.backend)
        )
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
        self.sha256 = file_sha256(self.path)
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
        self.sha256 = file_sha256(self.path)
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
