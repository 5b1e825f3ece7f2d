"""tokenmill.tokenize: readers, tokenizers, the parallel restartable pipeline, merge, fingerprints."""

from __future__ import annotations

import base64
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.errors import DataFormatError, TokenizerMismatchError
from tokenmill.formats.dataset_sidecar import check_tokenizer, read_sidecar, sidecar_path
from tokenmill.formats.megatron import IndexedDataset
from tokenmill.tokenize.encode import window_bounds
from tokenmill.tokenize.merge import find_prefixes, merge_datasets
from tokenmill.tokenize.pipeline import (
    TokenizeConfig,
    resolve_rank,
    tokenize,
)
from tokenmill.tokenize.progress import Progress
from tokenmill.tokenize.readers import ReadOptions, expand_inputs, read_documents
from tokenmill.tokenize.tokenizers import ByteTokenizer, TokenizerSpec, load_tokenizer

from conftest import write_megatron_shard
from oracles import import_oracle

DOCUMENTS = [
    "Hello, world.",
    "The Jargon File: a hacker's lexicon ™ — “quoted” ünïcödé 漢字 🙂",
    "",
    "line one\nline two\n\nline four",
    "x" * 700,
    "Another short one.",
]


def write_corpus(path: Path, documents: Sequence[str], key: str = "text") -> Path:
    """Write documents in the format the suffix names."""
    name = path.name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({key: list(documents)}), path, row_group_size=2)
        return path
    if name.endswith(".txt"):
        path.write_text("\n".join(documents) + "\n", encoding="utf-8")
        return path
    payload = "".join(json.dumps({key: text, "id": i}) + "\n" for i, text in enumerate(documents))
    data = payload.encode("utf-8")
    if name.endswith(".gz"):
        data = gzip.compress(data)
    elif name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def run(
    inputs: Sequence[Path | str], prefix: Path, **options: object
) -> tuple[IndexedDataset, TokenizeConfig]:
    config = TokenizeConfig(
        inputs=tuple(str(p) for p in inputs),
        output_prefix=str(prefix),
        progress=False,
        **options,  # type: ignore[arg-type]
    )
    tokenize(config)
    return IndexedDataset(str(prefix)), config


def files_of(prefix: Path) -> dict[str, bytes]:
    return {
        suffix: Path(str(prefix) + suffix).read_bytes()
        for suffix in (".bin", ".idx", ".tokenmill.json")
    }


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 400-token byte-level BPE trained on the spot (hermetic, well under a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(DOCUMENTS * 20, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def tiktoken_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny .tiktoken file: the 256 bytes plus a few merges."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" the", b"in", b"ng"]
    path = tmp_path_factory.mktemp("tiktoken") / "tiny.tiktoken"
    path.write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    )
    return path


# ----------------------------------------------------------------------------- readers


@pytest.mark.parametrize(
    "name", ["c.jsonl", "c.jsonl.gz", "c.jsonl.zst", "c.parquet", "c.json"], ids=str
)
def test_byte_tokenizer_round_trip_in_every_format(tmp_path: Path, name: str) -> None:
    corpus = write_corpus(tmp_path / name, DOCUMENTS)
    dataset, _ = run([corpus], tmp_path / "out")
    boundaries = dataset.document_indices
    assert len(boundaries) == len(DOCUMENTS) + 1
    tokenizer = ByteTokenizer()
    for number, text in enumerate(DOCUMENTS):
        sequences = [dataset[i] for i in range(boundaries[number], boundaries[number + 1])]
        if not text:  # megatron: an empty document has no sequence and no EOD
            assert sequences == []
            continue
        (tokens,) = sequences
        assert tokens[-1] == ByteTokenizer.EOD
        assert tokenizer.decode(tokens) == text
        assert bytes(tokens[:-1].astype(np.uint8)) == text.encode("utf-8")
    assert dataset.dtype == np.uint16


def test_txt_file_and_line_modes(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first file\nsecond line\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("other\r\n\r\nlast", encoding="utf-8")
    per_file, _ = run([tmp_path / "*.txt"], tmp_path / "files")
    decode = ByteTokenizer().decode
    assert [decode(per_file[i]) for i in range(len(per_file))] == [
        "first file\nsecond line\n",
        "other\r\n\r\nlast",
    ]
    per_line, _ = run([tmp_path], tmp_path / "lines", read=ReadOptions(txt_mode="line"))
    assert [decode(per_line[i]) for i in range(len(per_line))] == [
        "first file",
        "second line",
        "other",
        "last",
    ]


def test_expand_inputs_sorts_globs_and_directories(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("b.jsonl", "a.jsonl.gz", "sub/c.parquet", "notes.md", ".hidden.jsonl"):
        (tmp_path / name).write_bytes(b"")
    found = expand_inputs([str(tmp_path)])
    assert [Path(p).name for p in found] == ["a.jsonl.gz", "b.jsonl", "c.parquet"]
    assert expand_inputs([str(tmp_path / "*.jsonl"), str(tmp_path / "b.jsonl")]) == [
        str(tmp_path / "b.jsonl")
    ]
    with pytest.raises(FileNotFoundError, match="glob matches no input"):
        expand_inputs([str(tmp_path / "*.zst")])
    with pytest.raises(FileNotFoundError, match=r"input not found: .*missing.jsonl"):
        expand_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match=r"notes.md: unknown input format"):
        expand_inputs([str(tmp_path / "notes.md")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: directory holds no input files"):
        expand_inputs([str(tmp_path / "empty")])


@pytest.mark.parametrize(
    ("content", "options", "message"),
    [
        (b'{"text": "a"}\n{"text": \n', {}, r"bad.jsonl: line 2: invalid JSON"),
        (b'{"text": "a"}\n\n{"body": "b"}\n', {}, r"line 3: no key 'text'; keys are \['body'\]"),
        (b'{"text": 3}\n', {}, r"line 1: 'text' must be a string, got int '3'"),
        (b'["text"]\n', {}, r"line 1: expected a JSON object, got list"),
        (b'{"text": "\xff"}\n', {}, r"bad.jsonl: line 1: invalid UTF-8"),
        (b'{"content": 1}\n', {"json_key": "content"}, r"'content' must be a string"),
    ],
    ids=["json", "key", "type", "object", "utf8", "custom-key"],
)
def test_bad_jsonl_lines_name_file_line_and_field(
    tmp_path: Path, content: bytes, options: dict[str, str], message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    for chunk_bytes in (5, 1 << 20):  # line numbers survive chunking
        read = ReadOptions(chunk_bytes=chunk_bytes, **options)
        with pytest.raises(DataFormatError, match=message):
            list(read_documents(path, read))
    with pytest.raises(DataFormatError, match=message):  # the pipeline reports the same
        run([path], tmp_path / "out", read=ReadOptions(**options))  # type: ignore[arg-type]
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()


def test_bad_parquet_and_compressed_inputs(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "nocol.parquet")
    with pytest.raises(DataFormatError, match=r"nocol.parquet: no column 'text'; columns are"):
        list(read_documents(tmp_path / "nocol.parquet"))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DataFormatError, match=r"column 'text' has type int64, expected string"):
        list(read_documents(tmp_path / "ints.parquet"))
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    with pytest.raises(DataFormatError, match=r"null.parquet: row 1: column 'text' is null"):
        list(read_documents(tmp_path / "null.parquet"))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataFormatError, match=r"junk.parquet: not a parquet file"):
        list(read_documents(tmp_path / "junk.parquet"))
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n')[:-12])
    with pytest.raises(DataFormatError, match=r"bad.jsonl.gz: cannot decompress \(jsonl.gz\)"):
        list(read_documents(tmp_path / "bad.jsonl.gz"))
    (tmp_path / "bad.txt").write_bytes(b"ok\xfe")
    with pytest.raises(DataFormatError, match=r"bad.txt: file: invalid UTF-8 at byte 2"):
        list(read_documents(tmp_path / "bad.txt"))


def test_read_options_are_checked() -> None:
    with pytest.raises(ValueError, match="txt_mode must be 'file' or 'line', got 'page'"):
        ReadOptions(txt_mode="page")
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        ReadOptions(chunk_bytes=0)
    with pytest.raises(ValueError, match="json_key must be a non-empty string"):
        ReadOptions(json_key="")


# ----------------------------------------------------------------------------- tokenizers


def test_bpe_and_tiktoken_decode_back_to_the_input(
    tmp_path: Path, bpe_path: Path, tiktoken_path: Path
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", DOCUMENTS)
    for spec in (
        TokenizerSpec.parse(str(bpe_path)),
        TokenizerSpec.parse(str(tiktoken_path)),
    ):
        tokenizer = spec.load()
        dataset, _ = run([corpus], tmp_path / spec.kind, tokenizer=spec, prepend_bos=True)
        texts = [text for text in DOCUMENTS if text]
        assert len(dataset) == len(texts)
        for index, text in enumerate(texts):
            tokens = dataset[index]
            assert tokens[0] == tokenizer.bos_id and tokens[-1] == tokenizer.eod_id
            assert tokenizer.decode(tokens[1:-1]) == text
        sidecar = read_sidecar(str(tmp_path / spec.kind))
        assert sidecar["tokenizer"] == tokenizer.fingerprint()
        assert sidecar["tokenizer"]["kind"] == spec.kind
    bpe = load_tokenizer(str(bpe_path))
    assert bpe.eod_id == 0 and bpe.bos_id == 0  # <|endoftext|>; BOS defaults to it
    assert load_tokenizer(str(bpe_path), bos_token="<|bos|>").bos_id == 1
    tiny = load_tokenizer(str(tiktoken_path))
    assert tiny.vocab_size == 263 and tiny.eod_id == 262
    # special-token text inside a document is ordinary text, never a control id
    assert 262 not in tiny.encode_batch(["a <|endoftext|> b"])[0].tolist()


def test_tokenizer_errors_name_the_file_and_value(tmp_path: Path, bpe_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer file not found: .*nope.json"):
        load_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match=r"tokenizer must be 'bytes', a HF tokenizer.json or a "):
        TokenizerSpec.parse("gpt2")
    with pytest.raises(ValueError, match=r"eod_token '<eos>' is not in the vocabulary"):
        load_tokenizer(str(bpe_path), eod_token="<eos>")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"bad.json: not a HF tokenizers file"):
        load_tokenizer(str(tmp_path / "bad.json"))
    (tmp_path / "bad.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(ValueError, match=r"bad.tiktoken: not a .tiktoken BPE file"):
        load_tokenizer(str(tmp_path / "bad.tiktoken"))
    with pytest.raises(ValueError, match="tokenizer kind must be one of"):
        TokenizerSpec("sentencepiece", "x.model")
    with pytest.raises(ValueError, match="the bytes tokenizer takes no file"):
        TokenizerSpec("bytes", "x.json")


# ----------------------------------------------------------------------------- pipeline


def test_output_is_what_megatron_preprocess_data_writes(tmp_path: Path) -> None:
    """One sequence per document with EOD appended: the same bytes as an independent writer."""
    texts = [text for text in DOCUMENTS if text]
    corpus = write_corpus(tmp_path / "c.jsonl", texts)
    run([corpus], tmp_path / "out")
    expected = [[*text.encode("utf-8"), ByteTokenizer.EOD] for text in texts]
    write_megatron_shard(tmp_path / "reference", expected, dtype=np.uint16)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"out{suffix}").read_bytes() == (
            tmp_path / f"reference{suffix}"
        ).read_bytes()


@pytest.mark.megatron
def test_output_equals_megatron_core_builder_calls(tmp_path: Path) -> None:
    """preprocess_data.py's calls (add_document per document, empty ones included)."""
    megatron = import_oracle("megatron.core.datasets.indexed_dataset")
    corpus = write_corpus(tmp_path / "c.jsonl", DOCUMENTS)
    run([corpus], tmp_path / "out")
    builder = megatron.IndexedDatasetBuilder(
        str(tmp_path / "ref.bin"), dtype=megatron.DType.optimal_dtype(258)
    )
    for text in DOCUMENTS:
        ids = list(text.encode("utf-8"))
        lengths = [len(ids)] if ids else []
        if ids:
            ids.append(ByteTokenizer.EOD)
            lengths[-1] += 1
        builder.add_document(ids, lengths)
    builder.finalize(str(tmp_path / "ref.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"out{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()


def test_identical_for_0_1_2_4_workers(tmp_path: Path, bpe_path: Path) -> None:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "ünï", "漢字", "\n", "the", "hacker"]
    corpora = []
    for number, suffix in enumerate(["jsonl", "jsonl.gz", "parquet", "jsonl.zst"]):
        texts = [" ".join(rng.choice(words, int(rng.integers(0, 200)))) for _ in range(60)]
        corpora.append(write_corpus(tmp_path / f"in{number}.{suffix}", texts))
    outputs = []
    for workers in (0, 1, 2, 4):
        prefix = tmp_path / f"w{workers}"
        run(
            corpora,
            prefix,
            workers=workers,
            tokenizer=TokenizerSpec.parse(str(bpe_path)),
            prepend_bos=True,
            window=64,
            overlap=8,
            read=ReadOptions(chunk_bytes=512),  # many chunks per file
        )
        outputs.append(files_of(prefix))
        assert not Path(str(prefix) + ".parts").exists()
    assert all(output == outputs[0] for output in outputs[1:])


def test_windowing_splits_long_documents_into_overlapping_sequences(tmp_path: Path) -> None:
    texts = ["a" * 25, "b" * 5, "c" * 9]
    corpus = write_corpus(tmp_path / "c.jsonl", texts)
    dataset, _ = run([corpus], tmp_path / "out", window=10, overlap=3)
    # "a"*25 + EOD = 26 tokens -> [0,10) [7,17) [14,24) [21,26); "b"*5 + EOD fits; "c"*9+EOD = 10
    assert dataset.sequence_lengths.tolist() == [10, 10, 10, 5, 6, 10]
    assert dataset.document_indices.tolist() == [0, 4, 5, 6]
    first = np.concatenate([dataset[0], dataset[1][3:], dataset[2][3:], dataset[3][3:]])
    assert ByteTokenizer().decode(first) == texts[0]
    with pytest.raises(ValueError, match=r"overlap must be in \[0, window // 2 = 5\], got 6"):
        TokenizeConfig(inputs=("x",), output_prefix="y", window=10, overlap=6)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        TokenizeConfig(inputs=("x",), output_prefix="y", window=0)
    with pytest.raises(ValueError, match="overlap=2 needs a window"):
        TokenizeConfig(inputs=("x",), output_prefix="y", overlap=2)


@given(st.integers(0, 300), st.integers(1, 40), st.data())
def test_window_bounds_invariants(length: int, window: int, data: st.DataObject) -> None:
    overlap = data.draw(st.integers(0, window // 2))
    bounds = window_bounds(length, window, overlap)
    if length == 0:
        assert bounds == []
        return
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(0 < end - begin <= window for begin, end in bounds)
    for (_, end), (begin, _) in zip(bounds, bounds[1:]):
        assert end - begin == overlap  # consecutive windows share exactly `overlap` tokens


def test_nanogpt_output_is_the_megatron_tokens_with_a_bos_index(tmp_path: Path) -> None:
    from tokenmill.formats.bos_index import bos_index_path, read_bos_index
    from tokenmill.formats.nanogpt import NanogptShard

    corpus = write_corpus(tmp_path / "c.jsonl", DOCUMENTS)
    megatron, _ = run([corpus], tmp_path / "m", prepend_bos=True, workers=0)
    config = TokenizeConfig(
        inputs=(str(corpus),),
        output_prefix=str(tmp_path / "n"),
        progress=False,
        prepend_bos=True,
        workers=2,
        output_format="nanogpt",
    )
    tokenize(config)
    shard = NanogptShard(str(tmp_path / "n.bin"))
    np.testing.assert_array_equal(shard.tokens, megatron._tokens)
    positions = read_bos_index(bos_index_path(str(tmp_path / "n.bin")), len(shard)).positions
    starts = np.concatenate([[0], np.cumsum(megatron.sequence_lengths)[:-1]])
    np.testing.assert_array_equal(positions, starts)
    assert read_sidecar(str(tmp_path / "n")) == read_sidecar(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="needs prepend_bos"):
        run([corpus], tmp_path / "x", output_format="nanogpt")


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="output_format must be one of megatron, nanogpt"):
        TokenizeConfig(inputs=("x",), output_prefix="y", output_format="hdf5")
    with pytest.raises(ValueError, match="workers must be >= 0, got -1"):
        TokenizeConfig(inputs=("x",), output_prefix="y", workers=-1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        TokenizeConfig(inputs=("x",), output_prefix="y", rank=2, world_size=2)
    with pytest.raises(TypeError, match="inputs must be a sequence of paths, got the string"):
        TokenizeConfig(inputs="x.jsonl", output_prefix="y")  # type: ignore[arg-type]


def test_resolve_rank_from_arguments_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_rank(None, None) == (0, 1)
    assert resolve_rank(1, 3) == (1, 3)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    assert resolve_rank(None, None) == (1, 4)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert resolve_rank(None, None) == (2, 3)  # RANK/WORLD_SIZE win over SLURM
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer, got 'two'"):
        resolve_rank(None, None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2 \(from RANK/WORLD_SIZE"):
        resolve_rank(None, None)


def test_ranks_then_merge_equal_a_single_run(tmp_path: Path) -> None:
    from tokenmill.cli.main import main

    corpora = [
        write_corpus(tmp_path / f"in{i}.jsonl", [f"document {i}.{j} " * (j + 1) for j in range(7)])
        for i in range(5)
    ]
    single = tmp_path / "single"
    run(corpora, single)
    sharded = tmp_path / "sharded"
    for rank in (1, 0):
        result = tokenize(
            TokenizeConfig(
                inputs=(str(tmp_path / "in*.jsonl"),),
                output_prefix=str(sharded),
                rank=rank,
                world_size=2,
                progress=False,
            )
        )
        assert result.output_prefix is None
        assert len(result.parts) == (3 if rank == 0 else 2)
    parts = Path(str(sharded) + ".parts")
    assert [Path(p).name for p in find_prefixes(str(parts))] == [
        f"part-{i:06d}-of-000005" for i in range(5)
    ]
    assert main(["merge", str(parts), "--output", str(sharded), "--quiet"]) == 0
    expected, found = files_of(single), files_of(sharded)
    assert found[".bin"] == expected[".bin"] and found[".idx"] == expected[".idx"]
    assert json.loads(found[".tokenmill.json"]) == json.loads(expected[".tokenmill.json"])


def test_merge_refuses_missing_parts_and_mixed_tokenizers(
    tmp_path: Path, bpe_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenmill.cli.main import main

    corpora = [write_corpus(tmp_path / f"in{i}.jsonl", ["some text"]) for i in range(3)]
    tokenize(
        TokenizeConfig(
            inputs=tuple(map(str, corpora)),
            output_prefix=str(tmp_path / "half"),
            rank=0,
            world_size=2,
            progress=False,
        )
    )
    with pytest.raises(DataFormatError, match=r"1 of 3 parts are missing \(inputs 1\)"):
        find_prefixes(str(tmp_path / "half.parts"))

    run(corpora[:1], tmp_path / "bytes")
    run(corpora[1:2], tmp_path / "bpe", tokenizer=TokenizerSpec.parse(str(bpe_path)))
    with pytest.raises(TokenizerMismatchError, match=r"has kind='huggingface' but .* kind='bytes'"):
        merge_datasets([str(tmp_path / "bytes"), str(tmp_path / "bpe")], str(tmp_path / "mixed"))
    assert not (tmp_path / "mixed.bin").exists() and not (tmp_path / "mixed.idx").exists()
    assert main(["merge", str(tmp_path / "bytes"), str(tmp_path / "bpe"), "-o", "m"]) == 1
    assert "tokenizer mismatch" in capsys.readouterr().err

    write_megatron_shard(tmp_path / "foreign", [[1, 2, 257]])
    with pytest.raises(DataFormatError, match=r"foreign.tokenmill.json: no tokenizer fingerprint"):
        merge_datasets([str(tmp_path / "bytes"), str(tmp_path / "foreign")], str(tmp_path / "m"))
    merge_datasets(
        [str(tmp_path / "bytes"), str(tmp_path / "foreign")],
        str(tmp_path / "m"),
        allow_missing_fingerprint=True,
    )
    assert len(IndexedDataset(str(tmp_path / "m"))) == 2
    assert not os.path.exists(sidecar_path(str(tmp_path / "m")))  # cannot vouch for "foreign"
    with pytest.raises(ValueError, match="is also an input"):
        merge_datasets([str(tmp_path / "bytes")], str(tmp_path / "bytes"))


def test_check_tokenizer(tmp_path: Path, bpe_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", ["text"])
    run([corpus], tmp_path / "out")
    assert check_tokenizer(str(tmp_path / "out"), ByteTokenizer())["documents"] == 1
    with pytest.raises(
        TokenizerMismatchError, match=r"dataset '.*out' has kind='bytes' but huggingface"
    ):
        check_tokenizer(str(tmp_path / "out"), load_tokenizer(str(bpe_path)))
    Path(sidecar_path(str(tmp_path / "out"))).write_text('{"format": "other"}')
    with pytest.raises(DataFormatError, match=r"out.tokenmill.json: format is 'other'"):
        check_tokenizer(str(tmp_path / "out"), ByteTokenizer())
    Path(sidecar_path(str(tmp_path / "out"))).write_text("{")
    with pytest.raises(DataFormatError, match=r"out.tokenmill.json: not valid JSON"):
        check_tokenizer(str(tmp_path / "out"), ByteTokenizer())


def test_completed_parts_are_reused_and_stale_ones_redone(tmp_path: Path) -> None:
    corpora = [write_corpus(tmp_path / f"in{i}.jsonl", [f"doc {i}"]) for i in range(3)]
    config = TokenizeConfig(
        inputs=tuple(map(str, corpora)),
        output_prefix=str(tmp_path / "out"),
        keep_parts=True,
        progress=False,
    )
    assert tokenize(config).skipped == []
    assert tokenize(config).skipped == [str(p) for p in corpora]  # nothing to redo
    write_corpus(corpora[1], ["changed document"])
    os.utime(corpora[1], ns=(1, 1))  # a different mtime even on coarse clocks
    again = tokenize(config)
    assert again.skipped == [str(corpora[0]), str(corpora[2])]
    decode = ByteTokenizer().decode
    dataset = IndexedDataset(str(tmp_path / "out"))
    assert [decode(dataset[i]) for i in range(3)] == ["doc 0", "changed document", "doc 2"]
    # another option is another job: every part is redone
    assert tokenize(TokenizeConfig(**{**config.__dict__, "prepend_bos": True})).skipped == []


def test_killed_run_resumes_to_identical_output(tmp_path: Path) -> None:
    corpora = [
        write_corpus(tmp_path / f"in{i}.jsonl", [f"document {i}.{j} " * 20 for j in range(40)])
        for i in range(4)
    ]
    reference = tmp_path / "reference"
    run(corpora, reference)
    prefix = tmp_path / "out"
    command = [
        sys.executable, "-m", "tokenmill.cli.main", "tokenize", str(tmp_path / "in*.jsonl"),
        "--output", str(prefix), "--workers", "2", "--chunk-mb", "0.001", "--quiet",
    ]  # fmt: skip
    # the run stops after its second finished part (a test hook) and is killed there: no race
    # between the run and this process on a loaded machine
    environment = {**os.environ, "TOKENMILL_TEST_PAUSE_AFTER_PARTS": "2"}
    process = subprocess.Popen(command, env=environment)
    parts = Path(str(prefix) + ".parts")
    try:
        deadline = time.monotonic() + 600
        while len(list(parts.glob("*.tokenmill.json"))) < 2:
            assert process.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no part was finished in time"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    # nothing a reader could take: no output, partial work only under temporary names
    assert not any(Path(str(prefix) + s).exists() for s in (".bin", ".idx", ".tokenmill.json"))
    assert {p.name for p in parts.iterdir() if not p.name.startswith(".")} >= {
        "part-000000-of-000004.bin",
        "part-000001-of-000004.idx",
    }
    resumed = subprocess.run(
        [*command[:-1]], capture_output=True, text=True, check=False, timeout=120
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "skipped 2 completed input(s) of 4" in resumed.stderr
    assert files_of(prefix) == files_of(reference) | {
        ".tokenmill.json": files_of(prefix)[".tokenmill.json"]
    }
    assert read_sidecar(str(prefix))["tokenizer"] == read_sidecar(str(reference))["tokenizer"]
    assert not parts.exists()


def test_cli_tokenize_reports_errors_and_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenmill.cli.main import main

    corpus = write_corpus(tmp_path / "c.jsonl", DOCUMENTS)
    assert main(["tokenize", str(corpus), "-o", str(tmp_path / "out"), "--workers", "0"]) == 0
    err = capsys.readouterr().err
    assert "docs/s" in err and "tok/s" in err and "MB/s" in err and "ETA" in err
    assert "done: 6 documents" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "a"}\n')
    assert main(["tokenize", str(bad), "-o", str(tmp_path / "x"), "--workers", "0"]) == 1
    assert "bad.jsonl: line 1: no key 'text'" in capsys.readouterr().err
    assert main(["tokenize", str(corpus), "-o", "x", "--format", "nanogpt"]) == 1
    assert "needs prepend_bos (--prepend-bos)" in capsys.readouterr().err


def test_progress_line_shows_rates_and_eta() -> None:
    import io

    stream = io.StringIO()
    progress = Progress(total_bytes=1000, stream=stream, log_interval=0.0)
    progress.update(10, 2000, 4000, 250)
    line = progress.line()
    assert "25.0%" in line and "10 docs" in line and "tok/s" in line and "MB/s" in line
    assert "ETA 0:00:" in line
    assert stream.getvalue().count("\n") == 1


def test_remaining_bad_inputs_name_the_value(tmp_path: Path) -> None:
    """Errors not covered above: each names the file, field or value."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator(DOCUMENTS, trainers.BpeTrainer(vocab_size=280, show_progress=False))
    plain.save(str(tmp_path / "plain.json"))
    corpus = write_corpus(tmp_path / "c.jsonl", ["text"])
    spec = TokenizerSpec.parse(str(tmp_path / "plain.json"))
    with pytest.raises(ValueError, match=r"plain.json\) has no EOD \(append_eod\) token"):
        run([corpus], tmp_path / "out", tokenizer=spec)
    with pytest.raises(ValueError, match=r"has no BOS \(prepend_bos\) token"):
        run([corpus], tmp_path / "out", tokenizer=spec, prepend_bos=True, append_eod=False)
    with pytest.raises(ValueError, match="has no end-of-document token"):
        _ = spec.load().eod
    with pytest.raises(ValueError, match="a tiktoken tokenizer needs a file path, got None"):
        TokenizerSpec("tiktoken")
    (tmp_path / "t.tiktoken").write_text("YQ== 0\n")  # the one token "a"
    with pytest.raises(ValueError, match=r"bos_token '<s>' is not a special token"):
        TokenizerSpec("tiktoken", str(tmp_path / "t.tiktoken"), bos_token="<s>").load()
    with pytest.raises(ValueError, match="no inputs given"):
        expand_inputs([])
    (tmp_path / "bad.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage")
    with pytest.raises(DataFormatError, match=r"bad.jsonl.zst: cannot decompress \(jsonl.zst\)"):
        list(read_documents(tmp_path / "bad.jsonl.zst"))

    run([corpus], tmp_path / "ds")
    sidecar = Path(sidecar_path(str(tmp_path / "ds")))
    payload = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**payload, "version": 2}))
    with pytest.raises(DataFormatError, match=r"unsupported sidecar version 2, expected 1"):
        read_sidecar(str(tmp_path / "ds"))
    sidecar.write_text(json.dumps({**payload, "tokenizer": {"kind": "bytes"}}))
    with pytest.raises(DataFormatError, match=r"'tokenizer' must hold \['kind', 'sha256'"):
        read_sidecar(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match="merge needs at least one dataset"):
        merge_datasets([], str(tmp_path / "m"))

    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "a.idx").write_bytes(b"")
    with pytest.raises(DataFormatError, match=r"a.idx: has no .*a.bin"):
        find_prefixes(str(lonely))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name in ("part-000000-of-000001", "part-000000-of-000002", "part-000001-of-000002"):
        write_megatron_shard(mixed / name, [[1]])
    with pytest.raises(DataFormatError, match=r"parts of different runs \(part counts \[1, 2\]\)"):
        find_prefixes(str(mixed))
    (tmp_path / "none").mkdir()
    with pytest.raises(FileNotFoundError, match=r"none: no .bin/.idx datasets found"):
        find_prefixes(str(tmp_path / "none"))


def test_builder_add_documents_equals_add_document_per_document(tmp_path: Path) -> None:
    from tokenmill.formats.megatron import IndexedDatasetBuilder

    documents = [([1, 2, 3], [3]), ([], []), ([4, 5, 6, 7], [2, 2]), ([8], [1])]
    one = IndexedDatasetBuilder(str(tmp_path / "one.bin"), dtype=np.uint16)
    for tokens, lengths in documents:
        one.add_document(tokens, lengths)
    one.finalize(str(tmp_path / "one.idx"))
    bulk = IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), dtype=np.uint16)
    bulk.add_documents(np.array([1, 2, 3]), [3], [1, 0])
    bulk.add_documents(np.array([4, 5, 6, 7, 8]), [2, 2, 1], [2, 1])
    bulk.finalize(str(tmp_path / "bulk.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"bulk{suffix}").read_bytes()
    bad = IndexedDatasetBuilder(str(tmp_path / "bad.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="sequence_lengths sum to 3 but 2 tokens were given"):
        bad.add_documents([1, 2], [3], [1])
    with pytest.raises(ValueError, match="sequences_per_document sum to 2 but 1 sequence lengths"):
        bad.add_documents([1, 2], [2], [2])
    with pytest.raises(ValueError, match="sequences_per_document must be >= 0, got -1"):
        bad.add_documents([1, 2], [2], [2, -1])
    with pytest.raises(OverflowError, match="token 70000 does not fit"):
        bad.add_documents([70000], [1], [1])


def test_builder_refuses_to_blend_shards_of_different_tokenizers(
    tmp_path: Path, bpe_path: Path
) -> None:
    from tokenmill import BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig

    from conftest import TinyTokenizer

    corpus = write_corpus(tmp_path / "c.jsonl", DOCUMENTS * 20)
    run([corpus], tmp_path / "bytes", workers=0, append_eod=True)
    run([corpus], tmp_path / "bpe", workers=0, append_eod=True,
        tokenizer=TokenizerSpec(kind="huggingface", path=str(bpe_path)))  # fmt: skip

    def builder(prefixes: list[str], tokenizer: object) -> BlendedMegatronDatasetBuilder:
        config = GPTDatasetConfig(
            random_seed=1, sequence_length=8, tokenizer=tokenizer, blend=(prefixes, [1.0] * len(prefixes)),
            split="1", reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            create_attention_mask=False, path_to_cache=str(tmp_path / "cache"),
        )  # fmt: skip
        return BlendedMegatronDatasetBuilder(GPTDataset, [20, 0, 0], lambda: True, config)

    with pytest.raises(TokenizerMismatchError, match="shards tokenized with different"):
        builder([str(tmp_path / "bytes"), str(tmp_path / "bpe")], TinyTokenizer()).build()
    bytes_tokenizer = load_tokenizer(TokenizerSpec(kind="bytes"))
    with pytest.raises(TokenizerMismatchError):
        builder([str(tmp_path / "bpe")], bytes_tokenizer).build()
    train, _, _ = builder([str(tmp_path / "bytes")] * 2, bytes_tokenizer).build()
    assert len(train) == 20


def test_cli_prepend_bos_turns_eod_off_and_says_which_markers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the byte tokenizer (BOS 256, EOD 257): EOD after each document by default; with
    --prepend-bos, BOS only unless --append-eod asks for both; the markers line says which."""
    from tokenmill.cli.main import main

    corpus = write_corpus(tmp_path / "c.jsonl", ["ab", "c"])
    cases = [([], [97, 98, 257, 99, 257], "no BOS, EOD 257 after each document"),
             (["--prepend-bos"], [256, 97, 98, 256, 99], "BOS 256 before each document, no EOD"),
             (["--prepend-bos", "--append-eod"], [256, 97, 98, 257, 256, 99, 257],
              "BOS 256 before each document, EOD 257 after each document"),
             (["--no-append-eod"], [97, 98, 99], "no BOS, no EOD")]  # fmt: skip
    for number, (flags, tokens, markers) in enumerate(cases):
        prefix = tmp_path / f"out{number}"
        assert main(["tokenize", str(corpus), "-o", str(prefix), "--workers", "0", *flags]) == 0
        assert f"[tokenize] markers: {markers}" in capsys.readouterr().err
        assert IndexedDataset(str(prefix))._tokens.tolist() == tokens
    # nanogpt output: one BOS per document, so .bos.idx lists each document once
    out = tmp_path / "n"
    args = ["tokenize", str(corpus), "-o", str(out), "--workers", "0", "--prepend-bos"]
    assert main([*args, "--format", "nanogpt"]) == 0
    assert np.fromfile(tmp_path / "n.bos.idx", "<i4").tolist() == [0, 3]


def test_nanogpt_output_is_split_at_the_shard_cap(tmp_path: Path) -> None:
    from tokenmill.formats.nanogpt import NanogptShard

    corpus = write_corpus(tmp_path / "c.jsonl", DOCUMENTS)
    megatron, _ = run([corpus], tmp_path / "m", prepend_bos=True, workers=0)
    config = TokenizeConfig(
        inputs=(str(corpus),), output_prefix=str(tmp_path / "n"), progress=False,
        prepend_bos=True, workers=0, output_format="nanogpt", nanogpt_shard_tokens=10,
    )  # fmt: skip
    tokenize(config)
    shards = sorted(tmp_path.glob("n_*.bin"))
    total = int(megatron._tokens.shape[0])
    assert len(shards) == -(-total // 10) > 1
    tokens = np.concatenate([NanogptShard(str(path)).tokens for path in shards])
    np.testing.assert_array_equal(tokens, megatron._tokens)
    assert all(len(NanogptShard(str(path))) == 10 for path in shards[:-1])


def test_package_version_reads_what_importlib_metadata_reads() -> None:
    """The backends' versions (in every tokenized output's sidecar and raw-text cache key) come
    from the .dist-info directory's name when there is one: the same as importlib.metadata's."""
    import importlib.metadata

    from tokenmill.tokenize.reference_backends import _dist_info_version, package_version

    for name in ("gigatoken", "tiktoken", "tokenizers", "numpy", "megatron-core"):
        assert package_version(name) == importlib.metadata.version(name)
    assert _dist_info_version("gigatoken") == importlib.metadata.version("gigatoken")
    assert package_version("no-such-distribution-here") == "unknown"
