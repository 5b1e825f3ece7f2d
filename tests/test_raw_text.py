"""Raw-text blend entries (tokenmill.raw_text, tokenmill.datasets.raw_text): the samples equal
those of `tokenmill tokenize` + GPTDataset over its output, for every input kind, tokenizer and
backend, on 1, 2 and 4 gloo ranks; a second launch tokenizes nothing; a SIGKILLed launch resumes
the remaining pieces; a changed file re-tokenizes only itself; Megatron's `--data-path` under
patch_megatron."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raw_text_support import (
    FORK,
    build,
    documents,
    free_port,
    gpt_config,
    make_corpora,
    rank_main,
    samples_digest,
    train_bpe,
    write_corpus,
    write_tiktoken,
)
from tokenmill.raw_text import RawText
from tokenmill.raw_text import resolver as resolver_module
from tokenmill.tokenize import TokenizeConfig, load_tokenizer, tokenize

ENTRY_KINDS = ["jsonl", "zst", "parquet", "directory", "glob"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_corpora(tmp_path_factory.mktemp("corpora"))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiktoken(tmp_path_factory.mktemp("tiktoken") / "tiny.tiktoken"))


def offline_digest(entries: list[str], spec: str, root: Path, **options: Any) -> str:
    """`tokenmill tokenize` of each entry, then the same blend over its outputs."""
    prefixes = []
    for number, entry in enumerate(entries):
        prefix = root / f"offline{number}"
        tokenize(
            TokenizeConfig(
                inputs=(entry,),
                output_prefix=str(prefix),
                tokenizer=_spec(spec),
                progress=False,
                **options,
            )
        )
        prefixes.append(str(prefix))
    config = gpt_config(prefixes, load_tokenizer(spec), str(root / "offline-cache"))
    return samples_digest(build(config))


def _spec(value: str) -> Any:
    from tokenmill.tokenize import TokenizerSpec

    return TokenizerSpec.parse(value)


def counting_tokenize(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The inputs each pipeline run is given (in one list), as the resolver runs it."""
    tokenized: list[str] = []

    def counting(config: TokenizeConfig) -> Any:
        tokenized.extend(config.inputs)
        return tokenize(config)

    monkeypatch.setattr(resolver_module, "tokenize", counting)
    return tokenized


@pytest.mark.parametrize(
    "backend", ["hf", "gigatoken:hf", "reference:hf", "gigatoken:tiktoken", "reference:tiktoken"]
)
def test_raw_text_blend_equals_offline_tokenize_then_gpt_dataset(
    tmp_path: Path,
    corpora: dict[str, str],
    bpe: str,
    tiktoken_file: str,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix, _, kind = backend.rpartition(":")
    path = bpe if kind == "hf" else tiktoken_file
    spec = f"{prefix}:{path}" if prefix else path
    entries = [corpora[kind] for kind in ENTRY_KINDS]
    expected = offline_digest(entries, spec, tmp_path)
    tokenized = counting_tokenize(monkeypatch)
    config = gpt_config(
        entries, spec, str(tmp_path / "cache"), raw_text=RawText(threads=1, progress=False)
    )
    assert samples_digest(build(config)) == expected
    files = 3 + 4 + 3  # three single files, a directory of four, a glob of three
    assert len(tokenized) == len(set(tokenized)) == files
    # a second launch tokenizes nothing and gives the same samples
    assert samples_digest(build(config)) == expected
    assert len(tokenized) == files


def test_a_changed_file_re_tokenizes_only_itself(
    tmp_path: Path, bpe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data"
    for number in range(3):
        write_corpus(root / f"f{number}.jsonl", documents(40 + number, 20))
    entry = str(root)
    tokenized = counting_tokenize(monkeypatch)
    config = gpt_config(
        [entry], bpe, str(tmp_path / "cache"), raw_text=RawText(threads=1, progress=False)
    )
    build(config)
    assert len(tokenized) == 3
    time.sleep(0.01)
    write_corpus(root / "f1.jsonl", documents(99, 23))
    digest = samples_digest(build(config))
    assert tokenized[3:] == [str(root / "f1.jsonl")]
    assert digest == offline_digest([entry], bpe, tmp_path / "offline")


def test_options_reach_the_tokenizer_like_tokenize_s(
    tmp_path: Path, bpe: str, caplog: pytest.LogCaptureFixture
) -> None:
    entry = str(write_corpus(tmp_path / "k.jsonl", documents(7, 40), key="content"))
    expected = offline_digest(
        [entry],
        bpe,
        tmp_path,
        prepend_bos=True,
        append_eod=False,
        read=__import__("tokenmill.tokenize", fromlist=["ReadOptions"]).ReadOptions(
            json_key="content"
        ),
    )
    options = RawText(json_key="content", prepend_bos=True, append_eod=False, progress=False)
    config = gpt_config([entry], bpe, str(tmp_path / "cache"), raw_text=options)
    with caplog.at_level(logging.INFO, logger="tokenmill.raw_text.resolver"):
        assert samples_digest(build(config)) == expected
    # one summary line per rank in the logs
    assert re.search(
        r"\[raw text\] rank 0/1: tokenized 1 of 1 piece\(s\) .* 0 already cached", caplog.text
    )


def test_a_raw_text_entry_without_a_resolver_is_refused(tmp_path: Path, bpe: str) -> None:
    entry = str(write_corpus(tmp_path / "x.jsonl", documents(1, 5)))
    config = gpt_config([entry], load_tokenizer(bpe), str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"x.jsonl' names raw text.*raw_text=tokenmill.RawText"):
        build(config)


class MegatronStyleTokenizer:
    """What Megatron-LM's HuggingFaceTokenizer exposes: tokenize(), vocab_size, eod, and the
    directory it was loaded from."""

    def __init__(self, directory: str, add_bos: bool = False) -> None:
        from tokenizers import Tokenizer

        self.tokenizer_model = directory
        self._tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        self.add_bos = add_bos
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.eod = self._tokenizer.token_to_id("<|endoftext|>")
        self.unique_identifiers = {"class": "MegatronStyleTokenizer", "path": directory}

    def tokenize(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self._tokenizer.token_to_id("<|bos|>"), *ids] if self.add_bos else ids


def test_megatron_tokenizer_runs_on_the_fast_backend_when_ids_agree(
    tmp_path: Path, corpora: dict[str, str], bpe: str, caplog: pytest.LogCaptureFixture
) -> None:
    megatron_tokenizer = MegatronStyleTokenizer(os.path.dirname(bpe))
    # no special-token text in the documents: HF's encode would read it as the special id
    plain = [text.replace("<|endoftext|>", "eot") for text in documents(5, 80)]
    entries = [
        str(write_corpus(tmp_path / "plain.jsonl", plain)),
        str(write_corpus(tmp_path / "plain" / "p.parquet", plain[:30])),
    ]
    expected = offline_digest(entries, bpe, tmp_path)
    config = gpt_config(
        entries, megatron_tokenizer, str(tmp_path / "cache"), raw_text=RawText(progress=False)
    )
    with caplog.at_level(logging.INFO, logger="tokenmill.raw_text.resolver"):
        assert samples_digest(build(config)) == expected
    assert "same ids on a sample" in caplog.text
    assert "own tokenize()" not in caplog.text


def test_megatron_tokenizer_reading_special_text_as_special_is_not_replaced(
    tmp_path: Path, corpora: dict[str, str], bpe: str, caplog: pytest.LogCaptureFixture
) -> None:
    """HF's encode turns '<|endoftext|>' inside a document into the special id, tokenmill's
    backends keep it text: the sample check sees the difference and keeps the object's ids."""
    megatron_tokenizer = MegatronStyleTokenizer(os.path.dirname(bpe))
    config = gpt_config(
        [corpora["jsonl"]],
        megatron_tokenizer,
        str(tmp_path / "cache"),
        raw_text=RawText(progress=False),
    )
    with caplog.at_level(logging.INFO, logger="tokenmill.raw_text.resolver"):
        build(config)
    assert "encodes differently" in caplog.text


def test_megatron_tokenizer_that_disagrees_tokenizes_with_its_own_tokenize(
    tmp_path: Path, corpora: dict[str, str], bpe: str, caplog: pytest.LogCaptureFixture
) -> None:
    megatron_tokenizer = MegatronStyleTokenizer(os.path.dirname(bpe), add_bos=True)
    config = gpt_config(
        [corpora["jsonl"]],
        megatron_tokenizer,
        str(tmp_path / "cache"),
        raw_text=RawText(progress=False),
    )
    with caplog.at_level(logging.INFO, logger="tokenmill.raw_text.resolver"):
        datasets = build(config)
    assert caplog.text.count("own tokenize()") == 1
    from tokenmill.formats.megatron import IndexedDataset

    prefix = datasets[0].dataset_path
    first = np.asarray(IndexedDataset(prefix)[0])
    bos = megatron_tokenizer.tokenize("")[0]
    assert first[0] == bos and first[-1] == megatron_tokenizer.eod


def _launch(job: dict[str, Any]) -> dict[int, Any]:
    processes = {
        rank: FORK.Process(target=rank_main, args=(job, rank)) for rank in range(job["world"])
    }
    for process in processes.values():
        process.start()
    return processes


def _finish(processes: dict[int, Any]) -> None:
    for process in processes.values():
        process.join(120)
        assert process.exitcode == 0, f"a rank exited with {process.exitcode}"


def _job(tmp_path: Path, world: int, entries: list[str], spec: str, run: str) -> dict[str, Any]:
    out = tmp_path / run
    out.mkdir()
    return {
        "world": world,
        "rendezvous": f"tcp://127.0.0.1:{free_port()}",
        "entries": entries,
        "tokenizer": spec,
        "cache": str(tmp_path / f"cache-{run}"),
        "raw_cache": str(tmp_path / "raw"),
        "out": str(out),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_tokenize_together_and_see_the_offline_samples(
    tmp_path: Path, corpora: dict[str, str], bpe: str, world: int
) -> None:
    entries = [corpora["zst"], corpora["parquet"], corpora["directory"]]
    expected = offline_digest(entries, bpe, tmp_path)
    job = _job(tmp_path, world, entries, bpe, "run")
    _finish(_launch(job))
    results = [json.loads(Path(job["out"], f"{r}.json").read_text()) for r in range(world)]
    assert [r["digest"] for r in results] == [expected] * world
    tokenized = [path for r in results for path in r["tokenized"]]
    assert sorted(tokenized) == sorted(set(tokenized)) and len(tokenized) == 6  # each once
    # each rank tokenizes its whole share in one pipeline run (one set-up per rank, not per file)
    assert all(r["pipeline_runs"] == 1 for r in results)
    # the directory's pieces, concatenated by all ranks in parallel, are byte for byte the
    # offline run's output for that entry (offline_digest wrote it as offline2)
    (merged,) = Path(job["raw_cache"], "merged").glob("*.idx")
    for suffix in (".bin", ".idx"):
        assert (
            merged.with_suffix(suffix).read_bytes()
            == (tmp_path / "offline2").with_suffix(suffix).read_bytes()
        )
    if world > 1:
        assert all(r["tokenized"] for r in results), "a rank tokenized nothing"


@pytest.mark.distributed
def test_a_killed_launch_resumes_the_remaining_pieces(
    tmp_path: Path, corpora: dict[str, str], bpe: str
) -> None:
    entries = [corpora["jsonl"], corpora["directory"], corpora["glob"]]  # 8 pieces
    expected = offline_digest(entries, bpe, tmp_path)
    job = _job(tmp_path, 2, entries, bpe, "first") | {"pause_rank": 1, "pause_after": 1}
    processes = _launch(job)
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(job["out"], "paused")):
        assert time.monotonic() < deadline, "rank 1 never paused"
        assert all(p.is_alive() for p in processes.values()), "a rank died before the kill"
        time.sleep(0.05)
    for process in processes.values():  # the launcher tears the whole job down
        os.kill(process.pid, signal.SIGKILL)
        process.join()
    pieces = Path(job["raw_cache"], "pieces")
    committed = {p.name for p in pieces.glob("*.tokenmill.json")}
    assert 1 <= len(committed) < 8
    second = _job(tmp_path, 2, entries, bpe, "second")
    _finish(_launch(second))
    results = [json.loads(Path(second["out"], f"{r}.json").read_text()) for r in range(2)]
    assert [r["digest"] for r in results] == [expected] * 2
    tokenized = [path for r in results for path in r["tokenized"]]
    assert len(tokenized) == len(set(tokenized)) == 8 - len(committed)
    assert len(list(pieces.glob("*.tokenmill.json"))) == 8
    assert not any(Path(job["raw_cache"], "tmp").iterdir()), "a killed launch's leftovers stay"


MEGATRON_SCRIPT = r'''
import hashlib, json, os, sys

import tokenmill

tokenmill.patch_megatron()
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list
from tokenizers import Tokenizer

from tokenmill.tokenize import TokenizeConfig, TokenizerSpec, tokenize


class _HFTokenizerModel:
    """transformers' tokenizer as Megatron-LM's _HuggingFaceTokenizer holds it (`_tokenizer`):
    name_or_path, __call__(text).input_ids, eos_token_id (transformers is not installed here)."""

    def __init__(self, directory):
        self.name_or_path = directory
        self.backend = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        self.eos_token_id = self.backend.token_to_id("<|endoftext|>")

    def __call__(self, text):
        class Encoding:
            input_ids = self.backend.encode(text).ids
        return Encoding()


class HuggingFaceTokenizer:
    """The attributes of Megatron-LM's --tokenizer-type HuggingFaceTokenizer."""

    def __init__(self, tokenizer_model):
        self._tokenizer = _HFTokenizerModel(tokenizer_model)
        self.vocab_size = self._tokenizer.backend.get_vocab_size()
        self.eod = self._tokenizer.eos_token_id
        self.unique_identifiers = {"class": "HuggingFaceTokenizer", "model": tokenizer_model}

    def tokenize(self, text):
        return self._tokenizer(text).input_ids


def batches(data_path, tokenizer, cache):
    # what pretrain_gpt.py does: get_blend_and_blend_per_split -> core_gpt_dataset_config_from_args
    blend = get_blend_from_list(data_path)
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=32, blend=blend, split="90,10,0",
        path_to_cache=cache, tokenizer=tokenizer, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=True,
        mmap_bin_files=True,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [64, 16, 0], lambda: True, config
    ).build()
    digest = hashlib.sha256()
    for dataset in (train, valid):
        for batch in torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False):
            for name in sorted(batch):
                digest.update(batch[name].numpy().tobytes())
    return type(blend[0][1]).__name__, digest.hexdigest()


files, tokenizer_dir, root = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
tokenizer = HuggingFaceTokenizer(tokenizer_dir)
prefixes = []
for number, path in enumerate(files):  # preprocessing with tokenmill first
    prefix = os.path.join(root, f"pre{number}")
    tokenize(TokenizeConfig(inputs=(path,), output_prefix=prefix, progress=False,
             tokenizer=TokenizerSpec.parse(os.path.join(tokenizer_dir, "tokenizer.json"))))
    prefixes.append(prefix)
offline = batches(["30", prefixes[0], "70", prefixes[1]], tokenizer, os.path.join(root, "c1"))
raw = batches(["30", files[0], "70", files[1]], tokenizer, os.path.join(root, "c2"))
again = batches(["30", files[0], "70", files[1]], tokenizer, os.path.join(root, "c2"))
print(json.dumps({"offline": offline, "raw": raw, "again": again}))
'''


def test_megatron_data_path_naming_jsonl_gives_the_batches_of_preprocessing_first(
    tmp_path: Path, bpe: str
) -> None:
    """Under patch_megatron, pretrain_gpt.py's data path (get_blend_from_list over --data-path,
    GPTDatasetConfig, the builder, a DataLoader) with --data-path naming jsonl files and a
    HuggingFaceTokenizer over a local tokenizer.json directory."""
    import subprocess
    import sys

    plain = [text.replace("<|endoftext|>", "eot") for text in documents(8, 120)]
    first = write_corpus(tmp_path / "web.jsonl", plain[:70])
    second = write_corpus(tmp_path / "books.jsonl", plain[70:])
    script = tmp_path / "pretrain_data.py"
    script.write_text(MEGATRON_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), f"{first},{second}", os.path.dirname(bpe), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["raw"][0] == "RawTextEntry"  # --data-path's jsonl entries were recognised
    assert outcome["raw"][1] == outcome["offline"][1] == outcome["again"][1]
    assert "same ids on a sample" in result.stderr or "own tokenize" not in result.stderr


def test_a_run_config_file_names_raw_text(
    tmp_path: Path, corpora: dict[str, str], bpe: str
) -> None:
    """Mixture/run config files: raw-text entries get RawText's defaults, or the file's
    `raw_text` options; an unknown option is named."""
    from tokenmill.runs.config_file import load_run_config

    entries = [corpora["jsonl"], corpora["directory"]]
    values = {
        "random_seed": 1234, "sequence_length": 24, "split": "80,15,5",
        "blend": [entries, [1.0, 2.0]], "path_to_cache": str(tmp_path / "cache"),
        "reset_position_ids": True, "reset_attention_mask": False, "eod_mask_loss": True,
        "create_attention_mask": False, "tokenizer": {"kind": "huggingface", "path": bpe},
    }  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(values))
    config = load_run_config(path).config
    assert isinstance(config.raw_text, RawText)
    assert samples_digest(build(config)) == offline_digest(entries, bpe, tmp_path / "offline")
    path.write_text(json.dumps(values | {"raw_text": {"json_key": "content", "colour": 1}}))
    with pytest.raises(ValueError, match=r"run.json: raw_text: unknown option 'colour'"):
        load_run_config(path)


def test_what_counts_as_raw_text(tmp_path: Path) -> None:
    from tokenmill.datasets.raw_text import is_raw_text

    (tmp_path / "texts").mkdir()
    (tmp_path / "both").mkdir()  # a directory that is also a prefix: the prefix wins
    for name in ("both.idx", "named.jsonl.idx", "plain.idx"):
        (tmp_path / name).write_bytes(b"")
    assert is_raw_text(str(tmp_path / "a.jsonl")) and is_raw_text(str(tmp_path / "b.parquet"))
    assert is_raw_text(str(tmp_path / "texts")) and is_raw_text(str(tmp_path / "x" / "*.zst"))
    assert not is_raw_text(str(tmp_path / "both"))
    assert not is_raw_text(str(tmp_path / "named.jsonl"))  # a prefix named like a file
    assert not is_raw_text(str(tmp_path / "plain"))
    assert is_raw_text("s3://bucket/web.jsonl.zst") and not is_raw_text("s3://bucket/web")


@pytest.mark.distributed
def test_a_malformed_file_on_one_rank_fails_every_rank(tmp_path: Path, bpe: str) -> None:
    root = tmp_path / "data"
    for number in range(4):
        write_corpus(root / f"f{number}.jsonl", documents(60 + number, 15))
    with open(root / "f2.jsonl", "a") as stream:
        stream.write('{"text": 17}\n')
    job = _job(tmp_path, 2, [str(root)], bpe, "run")
    _finish(_launch(job))
    errors = [json.loads(Path(job["out"], f"{r}.json").read_text())["error"] for r in range(2)]
    assert all("f2.jsonl" in error for error in errors), errors
