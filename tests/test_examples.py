"""The examples run at a small size, and each checks what it claims."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
