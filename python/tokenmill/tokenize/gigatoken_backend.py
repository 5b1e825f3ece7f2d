"""The gigatoken backend: a tokenizer.json or .tiktoken file encoded by gigatoken, to the ids of
the reference backends (HF ``tokenizers``, ``tiktoken``), document by document.

Loading is strictly local: the file is read here and handed to gigatoken as contents
(``Tokenizer.from_json``) or as a path it opens itself (``from_tiktoken``); gigatoken's own
loaders, which resolve Hub repo ids, are never given a name.

How the reference's rules are kept (``tokenmill.tokenize.tokenizers`` lists them):

* special-token text is ordinary text: a tokenizer.json reaches gigatoken without its
  ``special`` added tokens (HF runs with ``encode_special_tokens``, which skips exactly those),
  a rank file without special tokens (tiktoken's ``encode_ordinary``);
* no post-processor: it is removed from the tokenizer.json, and gigatoken's raw ``encode_batch``
  adds nothing;
* documents are handed over packed (``PackedText``: one buffer, 0xFF between documents,
  ``BytesSource``), encoded on the calling thread (``parallel=False``: the pipeline runs one
  encode per thread, so ``--threads`` is the whole parallelism and nothing oversubscribes), and
  the result is read zero-copy: the awkward array's ``offsets`` and ``content`` buffers are
  numpy arrays; empty documents, which gigatoken's splitting drops, are put back as empty rows;
* documents holding a code point new in Unicode 17.0 (``tokenmill.tokenize.unicode17``) are
  encoded by the reference backend, which is loaded once for that (and for the probe below).

On load of a tokenizer.json, when HF ``tokenizers`` is installed, both encode a probe text
(scripts, digits, whitespace runs, contractions, emoji, combining marks, special-token text,
control characters) and must agree, so a tokenizer.json that gigatoken reads differently (an
unsupported normalizer or pre-tokenizer) is refused with the first differing text rather than
tokenized differently. A rank file needs no probe: it carries only ranks, and both backends run
them with the GPT-2 pattern and no special tokens (the test suite checks the agreement); tiktoken
is loaded only if a document needs it.

Vocabulary size and special ids come from the file itself, computed as the reference does
(``get_vocab_size(with_added_tokens=True)``: the distinct token strings of the model vocabulary
and the added tokens; ``token_to_id``: added tokens first), so the fingerprint is the
reference's and shards of both backends blend.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy
import numpy.typing as npt

from tokenmill.tokenize.packed_text import SEPARATOR, PackedText, pack_texts
from tokenmill.tokenize.reference_backends import (
    ENDOFTEXT,
    HuggingFaceTokenizer,
    TiktokenTokenizer,
    TokenArray,
    Tokenizer,
    file_sha256,
    package_version,
)
from tokenmill.tokenize.unicode17 import documents_with_new_code_points

__all__ = ["PROBE_TEXTS", "Encoding", "GigatokenTokenizer"]

PROBE_TEXTS = (
    "Hello, world! It's a test: we'll see, they've gone, I'd say, you're right.",
    "  leading and trailing spaces  \t\ttabs\n\nnewlines\r\nCRLF   \n  x",
    "numbers 0 12 345 6789 3.14159 1e10 -42 +7 ١٢٣ ٤٥ 五六",
    "Ünïcödé façade naïve coöperate Ωmega Ελληνικά русский текст עברית العربية",
    "漢字かな交じり文 한국어 텍스트 ไทย हिन्दी বাংলা",
    "emoji 🙂🎉👩‍👩‍👧 flags 🇫🇷 skin 👍🏽 ZWJ‍joiner e\u0301 a\u0308 combining",
    "special tokens as text: <|endoftext|> <|bos|> <s></s> [CLS] <|im_start|>",
    "code: def f(x):\n    return x ** 2  # comment\n\tif (a && b) { c[i] += 1; }",
    "punctuation ... !!! ??? --- ''' \"\"\" ``` ~~~ @@@ ### $$$ %%% ^^^ &&& *** ((()))",
    "control \x00\x01\x07\x1b[0m\x7f and \u00a0nbsp \u2003emspace \u200bzero-width \ufeffbom",
    "URLs https://example.com/a?b=c&d=e#f and emails a.b@c.d",
    "x" * 300 + " " + "ab " * 50,
)
"""Texts both backends must encode identically before gigatoken is used for a file."""

Encoding = tuple[npt.NDArray[numpy.uint32], npt.NDArray[numpy.int64], int]
"""What :meth:`GigatokenTokenizer.encode_packed` returns: all tokens, per-document offsets
(documents + 1), and how many documents the reference backend encoded."""


_RANK_FILE = re.compile(
    rb"(?:[A-Za-z0-9+/]+={0,2} [0-9]+\r?\n|[ \t\r]*\n)*(?:[A-Za-z0-9+/]+={0,2} [0-9]+)?\s*"
)


def _tiktoken_max_rank(path: str) -> int:
    """The largest rank of a ``.tiktoken`` file (base64 token, space, rank per line, as
    tiktoken's ``load_tiktoken_bpe`` reads it), checked with one regular-expression pass.

    Raises:
        ValueError: a line is not a token and a rank; the file has no ranks.
    """
    data = Path(path).read_bytes()
    match = _RANK_FILE.match(data)
    if match is None or match.end() != len(data):
        offset = match.end() if match else 0
        line = data.count(b"\n", 0, offset) + 1
        text = data[offset : offset + 40].split(b"\n")[0]
        raise ValueError(f"{path}: not a .tiktoken BPE file: line {line}: {text!r}")
    ranks = data.split()[1::2]
    if not ranks:
        raise ValueError(f"{path}: not a .tiktoken BPE file: it has no ranks")
    return max(map(int, ranks))


class GigatokenTokenizer(Tokenizer):
    """A tokenizer.json or .tiktoken file encoded by gigatoken (see the module docstring).

    Args:
        path: the tokenizer file.
        kind: "huggingface" or "tiktoken"; None: from the suffix (.tiktoken or else json).
        bos_token: the BOS token string; None: the EOD token.
        eod_token: the EOD token string; None: ``<|endoftext|>`` (if the vocabulary has it).
        verify: for a tokenizer.json, encode the probe texts with both backends and refuse a
            disagreement (needs HF tokenizers; skipped without it).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a tokenizer, gigatoken cannot load it, a named token is not
            in the vocabulary, or gigatoken disagrees with the reference on a probe text.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        kind: str | None = None,
        bos_token: str | None = None,
        eod_token: str | None = None,
        verify: bool = True,
    ) -> None:
        import gigatoken

        self.path = self._file = os.fspath(path)
        if not os.path.isfile(self._file):
            raise FileNotFoundError(f"tokenizer file not found: {self._file}")
        self.kind = kind or ("tiktoken" if self._file.endswith(".tiktoken") else "huggingface")
        if self.kind not in ("huggingface", "tiktoken"):
            raise ValueError(
                f"gigatoken runs huggingface or tiktoken files, got kind {self.kind!r}"
            )
        self.backend = "gigatoken"
        self.sha256 = file_sha256(self.path)
        self._bos_token = bos_token
        self._eod_token = eod_token
        self._reference: Tokenizer | None = None
        self._reference_lock = threading.Lock()
        try:
            if self.kind == "tiktoken":
                self._tokenizer = self._load_tiktoken(gigatoken, bos_token, eod_token)
            else:
                self._tokenizer = self._load_tokenizer_json(gigatoken, bos_token, eod_token)
        except (OSError, ValueError):
            raise
        except Exception as error:  # gigatoken's loaders raise their own types
            raise ValueError(f"{self.path}: gigatoken cannot load it: {error}") from error
        self.route_unicode17 = self._reference_available()
        if verify and self.route_unicode17 and self.kind == "huggingface":
            self._verify()

    # ------------------------------------------------------------------------- loading

    def _load_tiktoken(self, gigatoken: Any, bos_token: str | None, eod_token: str | None) -> Any:
        largest = _tiktoken_max_rank(self._file)
        special = {ENDOFTEXT: largest + 1}  # as TiktokenTokenizer: the id after the last rank
        for field, token in (("bos_token", bos_token), ("eod_token", eod_token)):
            if token is not None and token not in special:
                raise ValueError(
                    f"{self.path}: {field} {token!r} is not a special token of this encoding "
                    f"(known: {sorted(special)})"
                )
        self.vocab_size = largest + 2
        self.eod_id = special[ENDOFTEXT]
        self.bos_id = special[bos_token] if bos_token is not None else self.eod_id
        # the GPT-2 pattern (tokenmill's TiktokenTokenizer) and no special tokens: ordinary text
        return gigatoken.Tokenizer.from_tiktoken(self._file, pretokenizer="gpt2", special_tokens={})

    def _load_tokenizer_json(
        self, gigatoken: Any, bos_token: str | None, eod_token: str | None
    ) -> Any:
        try:
            config = json.loads(Path(self._file).read_bytes())
        except ValueError as error:
            raise ValueError(f"{self.path}: not a HF tokenizers file: {error}") from error
        model = config.get("model") if isinstance(config, dict) else None
        if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
            raise ValueError(
                f"{self.path}: not a HF tokenizers file gigatoken runs: no model vocabulary "
                f"(model type {model.get('type') if isinstance(model, dict) else None!r})"
            )
        added = [token for token in config.get("added_tokens") or [] if isinstance(token, dict)]
        vocabulary: dict[str, int] = {str(k): int(v) for k, v in model["vocab"].items()}
        added_ids = {str(token["content"]): int(token["id"]) for token in added}
        self.vocab_size = len(vocabulary.keys() | added_ids.keys())

        def lookup(token: str | None, field: str, default: str | None) -> int | None:
            name = token if token is not None else default
            if name is None:
                return None
            found = added_ids.get(name, vocabulary.get(name))
            if found is None and token is not None:
                raise ValueError(f"{self.path}: {field} {token!r} is not in the vocabulary")
            return found

        self.eod_id = lookup(eod_token, "eod_token", ENDOFTEXT)
        self.bos_id = lookup(bos_token, "bos_token", None) if bos_token else None
        if self.bos_id is None:
            self.bos_id = self.eod_id
        # special added tokens are ordinary text, and nothing is added around a document
        config = {
            **config,
            "added_tokens": [token for token in added if not token.get("special")],
            "post_processor": None,
            "padding": None,
            "truncation": None,
        }
        return gigatoken.Tokenizer.from_json(json.dumps(config))

    def _reference_available(self) -> bool:
        package = "tiktoken" if self.kind == "tiktoken" else "tokenizers"
        return importlib.util.find_spec(package) is not None

    @property
    def reference(self) -> Tokenizer:
        """The reference backend of the same file (loaded on first use)."""
        with self._reference_lock:
            if self._reference is None:
                if self.kind == "tiktoken":
                    self._reference = TiktokenTokenizer(
                        self._file, self._bos_token, self._eod_token
                    )
                else:
                    self._reference = HuggingFaceTokenizer(
                        self._file, self._bos_token, self._eod_token
                    )
            return self._reference

    def _verify(self) -> None:
        reference = self.reference
        if reference.identity() != self.identity():
            raise ValueError(
                f"{self.path}: gigatoken's reading of the file differs from "
                f"{reference.backend}'s: {self.identity()} vs {reference.identity()}"
            )
        expected = reference.encode_batch(list(PROBE_TEXTS))
        found = self._encode_gigatoken(pack_texts(PROBE_TEXTS))
        for index, text in enumerate(PROBE_TEXTS):
            got = found[0][found[1][index] : found[1][index + 1]]
            if not numpy.array_equal(got, expected[index]):
                raise ValueError(
                    f"{self.path}: gigatoken {package_version('gigatoken')} and "
                    f"{reference.backend} {package_version(reference.backend)} encode probe "
                    f"text {index} ({text[:40]!r}) differently"
                )

    # ------------------------------------------------------------------------- identity

    @property
    def identity_class(self) -> str:
        return "TiktokenTokenizer" if self.kind == "tiktoken" else "HuggingFaceTokenizer"

    def backend_fields(self) -> dict[str, Any]:
        fields = super().backend_fields()
        fields["unicode17"] = "reference" if self.route_unicode17 else "gigatoken"
        return fields

    # ------------------------------------------------------------------------- encoding

    def _encode_gigatoken(
        self, packed: PackedText
    ) -> tuple[npt.NDArray[numpy.uint32], npt.NDArray[numpy.int64]]:
        """gigatoken's tokens and per-document offsets, empty documents put back."""
        import gigatoken

        nonempty = packed.lengths > 0
        rows = int(numpy.count_nonzero(nonempty))
        offsets = numpy.zeros(packed.documents + 1, dtype=numpy.int64)
        if rows == 0:
            return numpy.zeros(0, dtype=numpy.uint32), offsets
        source = gigatoken.BytesSource(packed.data, separator=SEPARATOR)
        layout = self._tokenizer.encode_batch(source, parallel=False).layout
        row_offsets = numpy.asarray(layout.offsets.data, dtype=numpy.int64)
        content = numpy.asarray(layout.content.data)
        if row_offsets.shape[0] != rows + 1:
            raise RuntimeError(
                f"gigatoken returned {row_offsets.shape[0] - 1} rows for {rows} documents"
            )
        first = int(row_offsets[0])
        if first:
            row_offsets = row_offsets - first
        content = content[first : first + int(row_offsets[-1])]
        # document i ends where the last non-empty document up to i ends
        offsets[1:] = row_offsets[numpy.cumsum(nonempty)]
        return content, offsets

    def encode_packed(self, packed: PackedText) -> Encoding:
        """Tokens of packed documents (see :data:`Encoding`)."""
        content, offsets = self._encode_gigatoken(packed)
        routed = documents_with_new_code_points(packed.data, packed.ends())
        if routed.shape[0] == 0:
            return content, offsets, 0
        if not self.route_unicode17:
            return content, offsets, int(routed.shape[0])
        texts = [packed.text(int(index)) for index in routed]
        replacements = dict(zip(routed.tolist(), self.reference.encode_batch(texts)))
        pieces = []
        for index in range(packed.documents):
            found = replacements.get(index)
            pieces.append(
                content[offsets[index] : offsets[index + 1]]
                if found is None
                else numpy.asarray(found, dtype=numpy.uint32)
            )
        lengths = numpy.fromiter((piece.shape[0] for piece in pieces), numpy.int64, len(pieces))
        new_offsets = numpy.zeros(packed.documents + 1, dtype=numpy.int64)
        numpy.cumsum(lengths, out=new_offsets[1:])
        joined = numpy.concatenate(pieces) if pieces else numpy.zeros(0, dtype=numpy.uint32)
        return joined.astype(numpy.uint32, copy=False), new_offsets, int(routed.shape[0])

    def encode_batch(self, texts: Sequence[str]) -> list[TokenArray]:
        content, offsets, _ = self.encode_packed(pack_texts(texts))
        return [content[offsets[i] : offsets[i + 1]] for i in range(len(texts))]

    def decode(self, ids: Sequence[int] | TokenArray) -> str:
        array = numpy.ascontiguousarray(numpy.asarray(ids).reshape(-1), dtype=numpy.uint32)
        return bytes(self._tokenizer.decode(array)).decode("utf-8", errors="replace")
