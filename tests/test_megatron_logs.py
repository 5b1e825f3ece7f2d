"""tokenmill logs megatron-core's dataset lines: the same logger names
(``megatron.core.datasets.*``), lines and levels, in the same order, on the same config, for a
build and for a cache hit. Timings are measured, so they are normalised before comparing."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenmill.common import megatron_version
from tokenmill.megatron import MODULES

from conftest import TinyTokenizer, random_documents, write_megatron_shard
from megatron_compare import one_rank_process_group, stock_needs_a_process_group

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning"),
]

with warnings.catch_warnings():  # megatron-core's imports warn about torch deprecations
    warnings.simplefilter("ignore")
    THEIRS = {name: importlib.import_module(f"megatron.core.datasets.{name}") for name in MODULES}
OURS = {name: importlib.import_module(f"tokenmill.megatron.{name}") for name in MODULES}
INSTALLED = tuple(int(part) for part in importlib.metadata.version("megatron-core").split(".")[:2])

_TIMING = re.compile(r"time elapsed: \d+\.\d+ seconds")
_ADDRESS = re.compile(r" object at 0x[0-9a-f]+>")


def _normalised(message: str) -> str:
    """`message` with its measured durations and object addresses replaced."""
    return _ADDRESS.sub(" object>", _TIMING.sub("time elapsed: T seconds", message))


def _records(
    caplog: pytest.LogCaptureFixture, modules: dict[str, Any], cache: Path, **fields: Any
) -> list[tuple[str, int, str]]:
    """The records of megatron's dataset loggers while `modules` build train/valid/test."""
    gpt = modules["gpt_dataset"]
    builder = modules["blended_megatron_dataset_builder"]
    tokenizer = fields.pop("tokenizer")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="megatron.core.datasets"):
        config = gpt.GPTDatasetConfig(
            random_seed=7, sequence_length=48, tokenizer=tokenizer, reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(cache), **fields,
        )  # fmt: skip
        builder.BlendedMegatronDatasetBuilder(
            gpt.MockGPTDataset if config.mock else gpt.GPTDataset,
            [300, 40, 20],
            lambda: True,
            config,
        ).build()
    records = []
    for record in caplog.records:
        if not record.name.startswith("megatron.core.datasets"):
            continue
        message = _TIMING.sub("time elapsed: T seconds", record.getMessage())
        records.append((record.name, record.levelno, message.replace(str(cache), "CACHE")))
    return records


@pytest.fixture(autouse=True)
def _follow_installed() -> Iterator[None]:
    """What `patch_megatron()` does at patch time (the patch itself would make megatron's own
    modules, the oracle here, import tokenmill's)."""
    megatron_version.follow_installed()
    yield
    megatron_version._followed = None


@pytest.mark.parametrize(
    "blend",
    [
        {"blend": (["A", "B"], [0.3, 0.7]), "split": "90,6,4"},
        {"blend_per_split": [(["A"], None), (["B"], None), None]},
        {"blend": (["A"], None), "split": "1"},
    ],
    ids=["weighted", "per-split", "single"],
)
def test_megatron_log_lines_under_tokenmill(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, blend: dict[str, Any]
) -> None:
    rng = np.random.default_rng(3)
    prefixes = {
        name: write_megatron_shard(tmp_path / name, random_documents(rng, 80, 200))
        for name in ("A", "B")
    }

    def resolve(value: Any) -> Any:
        if isinstance(value, str) and value in prefixes:
            return prefixes[value]
        if isinstance(value, (list, tuple)):
            return type(value)(resolve(item) for item in value)
        return value

    fields = {key: resolve(value) for key, value in blend.items()}
    tokenizer = TinyTokenizer()
    # megatron-core 0.16 and 0.17 build a BlendedDataset only in a process group (one rank here,
    # as in a Megatron-LM job); a group changes no line
    group = tmp_path / "group"
    group.mkdir()
    with contextlib.ExitStack() as stack:
        if stock_needs_a_process_group(INSTALLED):
            stack.enter_context(one_rank_process_group(group))
        for attempt in ("miss", "hit"):
            theirs = _records(caplog, THEIRS, tmp_path / "theirs", tokenizer=tokenizer, **fields)
            ours = _records(caplog, OURS, tmp_path / "ours", tokenizer=tokenizer, **fields)
            assert any("Let split_matrix" in m or "blend not provided" in m for _, _, m in theirs)
            assert any("Load the _IndexReader from" in message for _, _, message in theirs)
            loads = [m for _, _, m in theirs if m.startswith("\tLoad the")]
            assert bool(loads) == (attempt == "hit"), attempt
            assert ours == theirs, attempt


def test_mock_log_lines_under_tokenmill(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Mock data (no blend): megatron's "Let mock = True" lines, and its warning that the mock
    indices are not saved."""
    tokenizer = TinyTokenizer()
    theirs = _records(caplog, THEIRS, tmp_path / "theirs", tokenizer=tokenizer)
    ours = _records(caplog, OURS, tmp_path / "ours", tokenizer=tokenizer)
    assert any("Let mock = True" in message for _, _, message in theirs)
    assert ours == theirs


def _build_ours(prefix: str, cache: Path, samples: int) -> Any:
    """tokenmill's (patched-in) training split of ``samples`` 48-token samples of ``prefix``."""
    gpt = OURS["gpt_dataset"]
    config = gpt.GPTDatasetConfig(
        random_seed=7, sequence_length=48, tokenizer=TinyTokenizer(), blend=([prefix], None),
        split="1", reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        path_to_cache=str(cache),
    )  # fmt: skip
    train, _, _ = (
        OURS["blended_megatron_dataset_builder"]
        .BlendedMegatronDatasetBuilder(gpt.GPTDataset, [samples, None, None], lambda: True, config)
        .build()
    )
    return train


def test_timings_are_measured(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """tokenmill's timing lines carry real durations, not a constant."""
    rng = np.random.default_rng(5)
    prefix = write_megatron_shard(tmp_path / "big", random_documents(rng, 4000, 400))
    with caplog.at_level(logging.DEBUG, logger="megatron.core.datasets"):
        _build_ours(prefix, tmp_path / "cache", 20000)
    seconds = [
        float(match.group(1))
        for record in caplog.records
        if (match := re.search(r"time elapsed: (\d+\.\d+) seconds", record.getMessage()))
    ]
    assert seconds and max(seconds) > 0.0


def test_no_line_is_formatted_when_megatron_logger_drops_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At megatron's default level (WARNING) a cache hit formats none of its ~10 INFO/DEBUG
    lines per dataset (a warm blend of 1,000 sources spent ~10 % of its open time on them);
    the WARNING a build without a cache logs still reaches the logger."""
    rng = np.random.default_rng(9)
    prefix = write_megatron_shard(tmp_path / "data", random_documents(rng, 80, 200))
    train = _build_ours(prefix, tmp_path / "cache", 300)
    import tokenmill.datasets.gpt as ours_gpt

    calls: list[tuple[int, str]] = []
    monkeypatch.setattr(
        ours_gpt, "log", lambda logger, level, message: calls.append((level, message))
    )
    monkeypatch.setattr(ours_gpt, "log_elapsed", lambda logger, seconds: calls.append((0, "")))
    arrays = {
        "document_index": train.document_index,
        "sample_index": train.sample_index,
        "shuffle_index": train.shuffle_index,
    }
    megatron = logging.getLogger("megatron.core.datasets")
    monkeypatch.setattr(megatron, "level", megatron.level)  # restored (and its cache) after
    megatron.setLevel(logging.WARNING)
    train._log_indices(arrays, False, 0.0)
    train._log_indices(arrays, True, 0.0)
    assert calls == []
    monkeypatch.setattr(train, "_cache", None)
    train._log_indices(arrays, True, 0.0)
    assert [level for level, _ in calls] == [logging.WARNING]
    megatron.setLevel(logging.DEBUG)
    calls.clear()
    train._log_indices(arrays, True, 0.0)
    assert len(calls) > 1
    megatron.manager._clear_cache()


@pytest.mark.distributed
@pytest.mark.skipif(
    INSTALLED < (0, 19),
    reason="Megatron-LM 0.19's pretrain_gpt.py data path: megatron.core.tokenizers.utils "
    "(build_tokenizer) is 0.19's; earlier releases' pretrain_gpt builds tokenizers elsewhere",
)
def test_pretrain_gpt_data_path_logs_megatrons_lines_and_warns_nothing_more(
    tmp_path: Path,
) -> None:
    """Megatron-LM pretrain_gpt.py's data path (tests/pretrain_gpt_data_path.py: megatron
    .training's argument parsing on default flags, so create_attention_mask=True, a weighted
    blend, build_train_valid_test_datasets, build_pretraining_data_loader), run stock and under
    patch_megatron: the same batches, the same lines from megatron's dataset loggers, for the
    build and for a cache hit, and no warning stock does not give."""
    import json
    import os
    import subprocess
    import sys

    from raw_text_support import free_port

    rng = np.random.default_rng(31)
    prefixes = [
        write_megatron_shard(tmp_path / name, random_documents(rng, 150, 120, vocab_size=500))
        for name in ("web", "books")
    ]
    script = Path(__file__).with_name("pretrain_gpt_data_path.py")

    def run(name: str, stock: bool) -> dict[str, Any]:
        out = tmp_path / name
        out.mkdir()
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
            str(out), "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--data-path", "30", prefixes[0], "70", prefixes[1],
            # the second run of the one process is a cache hit
            "--offline-data-path", "30", prefixes[0], "70", prefixes[1],
            "--data-cache-path", str(tmp_path / f"cache-{name}"), "--split", "90,10,0",
            "--seq-length", "64", "--max-position-embeddings", "64", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--train-iters", "6", "--eval-iters", "2",
            "--eval-interval", "3", "--num-workers", "0",
        ]  # fmt: skip
        environment = dict(os.environ, OMP_NUM_THREADS="1", TOKENMILL_STOCK=str(int(stock)))
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=600, check=False, env=environment
        )
        assert result.returncode == 0, result.stderr[-6000:]
        runs: dict[str, Any] = json.loads((out / "0.json").read_text())
        cache = str(tmp_path / f"cache-{name}")
        for outcome in runs.values():
            outcome["log"] = [
                (logger, level, _normalised(message).replace(cache, "C"))
                for logger, level, message in outcome["log"]
            ]
        return runs

    stock, patched = run("stock", True), run("patched", False)
    for phase in ("raw", "offline"):  # a build, then a cache hit
        assert patched[phase]["batches"] == stock[phase]["batches"]
        assert len(stock[phase]["batches"]) == 12
        assert stock[phase]["log"], phase  # megatron's lines reached its loggers
        assert patched[phase]["log"] == stock[phase]["log"], phase
        assert patched[phase]["warnings"] == stock[phase]["warnings"], phase
    assert any("Build and save" in line[2] for line in stock["raw"]["log"])
    assert any("Load the" in line[2] for line in stock["offline"]["log"])
