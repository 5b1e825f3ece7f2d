"""The C++ text packers (``_core.pack_jsonl_field``, ``pack_lines``, ``pack_documents``) and the
code-point scan: they read exactly what the Python readers read, byte for byte, and errors fall
back to the readers' messages. No tokenizer needed (the sanitizer stage of .ci/run runs these).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill import _core
from tokenmill.errors import DataFormatError
from tokenmill.tokenize.packed_text import pack_chunk, pack_texts
from tokenmill.tokenize.readers import Chunk, ReadOptions, parse_chunk
from tokenmill.tokenize.unicode17 import (
    UNICODE_17_RANGES,
    documents_with_new_code_points,
    texts_with_new_code_points,
)

JSON_LINES = [
    b'{"text": "a"}',
    b'{"text": "a\\n\\u00e9\\ud83d\\ude00\\"q\\"\\/\\b\\f\\r\\t\\\\"}',
    b'{"text": "a", "text": "last wins"}',
    b'{"text": 1, "text": "string last"}',
    b'{"text": "string first", "text": 1}',
    b'{"meta": {"text": "nested"}, "text": "top"}',
    b'{"te\\u0078t": "escaped key"}',
    b'  {"text" :"spaces" , "n": [1, -2.5e-3, 0, true, false, null, {"a": []}] }  ',
    b'{"text": "crlf"}\r',
    b'{"text": ""}',
    b"",
    b"   \t",
    b"\x0b\x0c",
    b'{"text": "a", "x": ]',
    b'{"text": "a"} tail',
    b'{"text": "a",}',
    b'{"text": "bad \\x escape"}',
    b'{"text": "lone \\ud800 surrogate"}',
    b'{"text": "lone \\udc00 low"}',
    b'{"text": NaN, "text": "after nan"}',
    b'\xef\xbb\xbf{"text": "bom"}',
    b'{"text": "raw \xff byte"}',
    b'{"text": "raw \xed\xa0\x80 surrogate"}',
    b'{"text": "control \x01 char"}',
    b'{"text": 01}',
    b'{"text": "big", "n": 123456789012345678901234567890}',
    b'["text"]',
    b'{"body": "no key"}',
    b'"text"',
    b"{}",
]


def _python_pack(chunk: Chunk, options: ReadOptions) -> tuple[object, object]:
    try:
        texts = parse_chunk(chunk, options)
    except DataFormatError as error:
        return "error", str(error)
    try:
        packed = pack_texts(texts)
    except UnicodeEncodeError:
        return "unencodable", None
    return packed.data, packed.lengths.tolist()


def _fast_pack(chunk: Chunk, options: ReadOptions) -> tuple[object, object]:
    try:
        packed = pack_chunk(chunk, options)
    except DataFormatError as error:
        return "error", str(error)
    except UnicodeEncodeError:
        return "unencodable", None
    return packed.data, packed.lengths.tolist()


@given(st.lists(st.sampled_from(JSON_LINES), max_size=8), st.booleans())
def test_jsonl_packer_reads_exactly_what_the_python_reader_reads(
    lines: list[bytes], final_newline: bool
) -> None:
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    chunk = Chunk("in.jsonl", "jsonl", data, first_line=7)
    options = ReadOptions()
    assert _fast_pack(chunk, options) == _python_pack(chunk, options)


@given(st.lists(st.text(max_size=30), max_size=6), st.sampled_from(["text", "t\u00e9xt", "k"]))
def test_jsonl_packer_on_generated_records(texts: list[str], key: str) -> None:
    records = [{key: text, "other": [text, 1.5, None]} for text in texts]
    for ensure_ascii in (True, False):
        data = "\n".join(json.dumps(r, ensure_ascii=ensure_ascii) for r in records).encode(
            "utf-8", "surrogatepass"
        )
        chunk = Chunk("in.jsonl", "jsonl", data)
        options = ReadOptions(json_key=key)
        assert _fast_pack(chunk, options) == _python_pack(chunk, options)


@given(st.binary(max_size=80))
def test_line_and_text_packers_read_what_the_python_reader_reads(data: bytes) -> None:
    for kind in ("lines", "text"):
        chunk = Chunk("in.txt", kind, data)
        assert _fast_pack(chunk, ReadOptions()) == _python_pack(chunk, ReadOptions())


def test_packer_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, 3\], got \[0, 4\]"):
        _core.pack_documents(b"abc", np.array([0, 4], dtype=np.int64))
    with pytest.raises(ValueError, match="offsets must be non-decreasing, got 2 then 1 at 2"):
        _core.pack_documents(b"abc", np.array([0, 2, 1], dtype=np.int64))
    with pytest.raises(TypeError, match="offsets must have dtype int64"):
        _core.pack_documents(b"abc", np.array([0, 3], dtype=np.int32))
    with pytest.raises(ValueError, match=r"ranges must be sorted, disjoint and >= U\+0800"):
        _core.find_code_points(b"abc", np.array([5, 9], dtype=np.uint32))


_ALPHABET = st.sampled_from(
    ["a", " ", "\n", "é", "漢", "🙂", "\u088f", "\u0890", "\U000323b0", "\U0003347a", "\u1acf"]
)


@given(st.lists(st.text(_ALPHABET, max_size=12), max_size=10))
def test_code_point_scan_equals_the_python_search(texts: list[str]) -> None:
    packed = pack_texts(texts)
    found = documents_with_new_code_points(packed.data, packed.ends()).tolist()
    assert found == texts_with_new_code_points(texts)
    table = {c for first, last in UNICODE_17_RANGES for c in range(first, last + 1)}
    assert found == [i for i, text in enumerate(texts) if any(ord(c) in table for c in text)]
