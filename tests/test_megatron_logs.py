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


def test_timings_are_measured(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """tokenmill's timing lines carry real durations, not a constant."""
    rng = np.random.default_rng(5)
    prefix = write_megatron_shard(tmp_path / "big", random_documents(rng, 4000, 400))
    with caplog.at_level(logging.DEBUG, logger="megatron.core.datasets"):
        gpt = OURS["gpt_dataset"]
        config = gpt.GPTDatasetConfig(
            random_seed=7, sequence_length=48, tokenizer=TinyTokenizer(), blend=([prefix], None),
            split="1", reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            path_to_cache=str(tmp_path / "cache"),
        )  # fmt: skip
        OURS["blended_megatron_dataset_builder"].BlendedMegatronDatasetBuilder(
            gpt.GPTDataset, [20000, None, None], lambda: True, config
        ).build()
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
    gpt = OURS["gpt_dataset"]
    config = gpt.GPTDatasetConfig(
        random_seed=7, sequence_length=48, tokenizer=TinyTokenizer(), blend=([prefix], None),
        split="1", reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        path_to_cache=str(tmp_path / "cache"),
    )  # fmt: skip
    train, _, _ = (
        OURS["blended_megatron_dataset_builder"]
        .BlendedMegatronDatasetBuilder(gpt.GPTDataset, [300, None, None], lambda: True, config)
        .build()
    )
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
