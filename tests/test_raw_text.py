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
    resolve_after_rank_0_main,
    samples_digest,
    train_bpe,
    write_corpus,
    write_tiktoken,
)
from tokenmill.raw_text import RawText
from tokenmill.raw_text import resolver as resolver_module
from tokenmill.tokenize import TokenizeConfig, load_tokenizer, tokenize

from oracles import require

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


def _plain_entries(tmp_path: Path) -> list[str]:
    # no special-token text in the documents: HF's encode would read it as the special id
    plain = [text.replace("<|endoftext|>", "eot") for text in documents(5, 80)]
    return [str(write_corpus(tmp_path / "plain.jsonl", plain))]


def test_a_relaunch_reuses_the_megatron_tokenizers_verdict_and_loads_nothing(
    tmp_path: Path, bpe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast backend's load and the sample check (0.4-0.5 s for GPT-2) run on the first
    launch only: a relaunch with every piece cached reads the recorded verdict."""
    megatron_tokenizer = MegatronStyleTokenizer(os.path.dirname(bpe))
    entries = _plain_entries(tmp_path)
    expected = offline_digest(entries, bpe, tmp_path)
    adapts: list[Any] = []
    real_adapt = resolver_module.adapt_tokenizer
    monkeypatch.setattr(
        resolver_module, "adapt_tokenizer", lambda *a: adapts.append(a) or real_adapt(*a)
    )

    def launch() -> str:
        config = gpt_config(
            entries, megatron_tokenizer, str(tmp_path / "cache"), raw_text=RawText(progress=False)
        )
        return samples_digest(build(config))

    assert launch() == expected and len(adapts) == 1
    (record,) = Path(tmp_path / "cache" / "raw_text" / "tokenizers").glob("*.json")
    assert json.loads(record.read_text())["fingerprint"]["backend"] != "megatron"
    assert launch() == expected and len(adapts) == 1  # nothing loaded, nothing sampled
    # a changed file beside the tokenizer's (its config) is a new verdict
    config_file = Path(os.path.dirname(bpe), "tokenizer_config.json")
    config_file.write_text(json.dumps({"model_max_length": 10**9}))
    try:
        assert launch() == expected and len(adapts) == 2
    finally:
        config_file.unlink()


def test_a_recorded_verdict_that_no_longer_holds_is_refused_when_tokenizing(
    tmp_path: Path, bpe: str
) -> None:
    megatron_tokenizer = MegatronStyleTokenizer(os.path.dirname(bpe))
    entries = _plain_entries(tmp_path)
    config = gpt_config(
        entries, megatron_tokenizer, str(tmp_path / "cache"), raw_text=RawText(progress=False)
    )
    build(config)
    (record,) = Path(tmp_path / "cache" / "raw_text" / "tokenizers").glob("*.json")
    fields = json.loads(record.read_text())
    fields["fingerprint"]["vocab_size"] += 1  # keys of pieces nobody has: they are tokenized
    record.write_text(json.dumps(fields))
    with pytest.raises(RuntimeError, match=rf"{record.name}: .* another fingerprint"):
        build(config)


def test_a_megatron_tokenizer_that_encodes_differently_is_not_given_anothers_verdict(
    tmp_path: Path, bpe: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Same identifiers, same files, another behaviour (a BOS added): its own verdict (its own
    tokenize), not the fast backend recorded for the first one."""
    entries = _plain_entries(tmp_path)
    plain = MegatronStyleTokenizer(os.path.dirname(bpe))
    with_bos = MegatronStyleTokenizer(os.path.dirname(bpe), add_bos=True)
    assert plain.unique_identifiers == with_bos.unique_identifiers
    first = build(
        gpt_config(entries, plain, str(tmp_path / "cache"), raw_text=RawText(progress=False))
    )
    with caplog.at_level(logging.INFO, logger="tokenmill.raw_text.resolver"):
        second = build(
            gpt_config(entries, with_bos, str(tmp_path / "cache"), raw_text=RawText(progress=False))
        )
    assert "own tokenize()" in caplog.text
    from tokenmill.formats.megatron import IndexedDataset

    bos = with_bos.tokenize("")[0]
    assert np.asarray(IndexedDataset(second[0].dataset_path)[0])[0] == bos
    assert np.asarray(IndexedDataset(first[0].dataset_path)[0])[0] != bos


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


@pytest.mark.distributed
def test_a_warm_relaunch_waits_for_no_other_rank(
    tmp_path: Path, corpora: dict[str, str], bpe: str
) -> None:
    # every piece is in the cache: rank 0 resolves the entries and goes on while rank 1 has not
    # even started (no barrier among the ranks; it joined one, so rank 0 would wait for rank 1,
    # which waits for rank 0, for 30 s)
    entries = [corpora["jsonl"], corpora["directory"]]
    _finish(_launch(_job(tmp_path, 2, entries, bpe, "first")))
    second = _job(tmp_path, 2, entries, bpe, "second")
    processes = {
        rank: FORK.Process(target=resolve_after_rank_0_main, args=(second, rank))
        for rank in range(2)
    }
    for process in processes.values():
        process.start()
    _finish(processes)
    results = [json.loads(Path(second["out"], f"{r}.json").read_text()) for r in range(2)]
    assert not results[1]["gave_up"], "rank 0 waited for rank 1 before it could go on"
    assert results[0]["prefixes"] == results[1]["prefixes"]


def hf_tokenizer_directory(directory: Path) -> Path:
    """A local HuggingFace tokenizer directory, as transformers saves one (tokenizer.json,
    tokenizer_config.json, ...), over the BPE trained here: what --tokenizer-model names."""
    from transformers import PreTrainedTokenizerFast

    train_bpe(directory / "trained.json")
    saved = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "trained.json"), eos_token="<|endoftext|>"
    )
    saved.save_pretrained(str(directory / "hf"))
    return directory / "hf"


@pytest.mark.megatron
@pytest.mark.distributed
def test_pretrain_gpt_data_path_naming_jsonl_gives_the_batches_of_preprocessing_first(
    tmp_path: Path,
) -> None:
    """Under patch_megatron, on 2 gloo ranks (torchrun), Megatron-LM pretrain_gpt.py's data path
    (tests/pretrain_gpt_data_path.py: megatron.training's argument parsing, megatron-core's
    HuggingFaceTokenizer over a local directory through transformers' AutoTokenizer, the builder,
    build_pretraining_data_loader) with --data-path naming jsonl files gives, batch for batch,
    what it gives with --data-path naming `tokenmill tokenize`'s output for the same files."""
    import subprocess
    import sys

    from tokenmill.cli.main import main

    require("transformers")
    tokenizer_dir = hf_tokenizer_directory(tmp_path / "tokenizer")
    # HF's encode reads '<|endoftext|>' inside a document as the special id, tokenmill's
    # backends as text: with it, the sample check sends raw text to the slow path (tested above)
    plain = [text.replace("<|endoftext|>", "eot") for text in documents(8, 120)]
    files = [
        write_corpus(tmp_path / "web.jsonl", plain[:70]),
        write_corpus(tmp_path / "books.jsonl", plain[70:]),
    ]
    prefixes = [str(tmp_path / "preprocessed" / path.stem) for path in files]
    for path, prefix in zip(files, prefixes):
        spec = str(tokenizer_dir / "tokenizer.json")
        assert (
            main(["tokenize", str(path), "-o", prefix, "--tokenizer", spec, "--workers", "0"]) == 0
        )
    out = tmp_path / "out"
    out.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(Path(__file__).with_name("pretrain_gpt_data_path.py")), str(out),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir),
        "--data-path", "30", str(files[0]), "70", str(files[1]),
        "--offline-data-path", "30", prefixes[0], "70", prefixes[1],
        "--data-cache-path", str(tmp_path / "cache"), "--split", "90,10,0",
        "--seq-length", "32", "--max-position-embeddings", "32", "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", "6", "--eval-iters", "2",
        "--eval-interval", "3", "--num-workers", "0",
    ]  # fmt: skip
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, check=False, env=environment
    )
    assert result.returncode == 0, result.stderr[-6000:]
    ranks = [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]
    for rank in ranks:
        # the raw run read tokenmill's raw-text cache, not the preprocessed files
        assert all("raw_text" in path for path in rank["raw"]["dataset_paths"])
        assert rank["offline"]["dataset_paths"] == prefixes
        assert len(rank["raw"]["batches"]) == 12  # 6 train + 2 x 3 valid micro-batches
        assert rank["raw"]["batches"] == rank["offline"]["batches"]
    assert ranks[0]["raw"]["batches"] != ranks[1]["raw"]["batches"]  # each its own share
    # Megatron's HuggingFaceTokenizer ran on tokenmill's fast backend, once checked, said in
    # the log, on each rank
    fast = re.findall(
        r"\[raw text\] \w+: its file (\S+) runs on (.+) \(same ids on a sample", result.stderr
    )
    assert [path for path, _ in fast] == [str(tokenizer_dir / "tokenizer.json")] * 2
    assert "own tokenize()" not in result.stderr


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
    outcomes = [json.loads(Path(job["out"], f"{r}.json").read_text()) for r in range(2)]
    assert all("f2.jsonl" in outcome["error"] for outcome in outcomes), outcomes
    # the failing rank's exception itself, on every rank (through the process group's store,
    # no collective over a Python-made tensor), the other rank told where it came from
    assert [outcome["type"] for outcome in outcomes] == ["DataFormatError"] * 2, outcomes
    assert outcomes[0]["error"] == outcomes[1]["error"]
    told = [note for outcome in outcomes for note in outcome["notes"]]
    assert len(told) == 1 and "which tokenizes raw text" in told[0], outcomes
