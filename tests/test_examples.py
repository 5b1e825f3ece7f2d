"""The examples run at a small size, and each checks what it claims."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from oracles import import_oracle

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_train_tiny_gpt_resumes_on_another_topology_with_an_identical_loss_curve() -> None:
    # The script exits non-zero when any resumed loss differs from the uninterrupted run's.
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "train_tiny_gpt.py"),
            "--steps",
            "24",
            "--stop-at",
            "9",
            "--documents",
            "200",
            "--sequence-length",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 24 losses identical to the uninterrupted run" in result.stdout


def run_example(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-W", "ignore", *args], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.megatron
def test_megatron_switch_serves_megatron_cores_batches_through_megatrons_loader() -> None:
    import_oracle("megatron.core")
    output = run_example(
        str(EXAMPLES / "megatron_switch.py"),
        "--tokens",
        "300000",
        "--batches",
        "6",
        "--workers",
        "1",
        "--batch-size",
        "4",
        "--sequence-length",
        "256",
    )
    assert "all 24 samples identical to megatron-core's" in output
    assert "tokenmill.datasets.gpt" in output and "megatron.core.datasets.gpt_dataset" in output


def test_mixture_curriculum_resumes_on_another_topology_with_the_same_stream() -> None:
    pytest.importorskip("torchdata")
    output = run_example(
        str(EXAMPLES / "mixture_curriculum.py"),
        "--main-tokens",
        "60000",
        "--anneal-tokens",
        "30000",
        "--stop-at",
        "6",
        "--documents",
        "300",
    )
    assert "equals the uninterrupted stream token for token" in output
    assert "main: prose" in output and "anneal: prose" in output


def test_stream_from_s3_trains_on_batches_equal_to_the_local_read() -> None:
    import_oracle("moto")
    import_oracle("boto3")
    output = run_example(
        str(EXAMPLES / "stream_from_s3.py"),
        "--steps",
        "4",
        "--documents",
        "150",
        "--sequence-length",
        "64",
    )
    assert "every batch identical to the same samples read from a local copy" in output
