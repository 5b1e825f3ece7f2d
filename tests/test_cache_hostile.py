"""The index cache's lock files are not followed through a planted symlink and do not block
on a planted FIFO (issue #37, "Links and special files")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill.common.locks import best_effort_lock


def test_symlink_at_lock_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    lock = tmp_path / "entry.lock"
    lock.symlink_to(target)
    with (
        pytest.raises(OSError, match="symbolic link") as caught,
        best_effort_lock(str(lock), "building", remove_on_release=True),
    ):
        pass
    assert str(lock) in str(caught.value)
    assert target.read_bytes() == b"keep"
    assert lock.is_symlink()


def test_fifo_at_lock_does_not_block(tmp_path):
    lock = tmp_path / "entry.lock"
    os.mkfifo(lock)
    code = (
        "import sys\n"
        "from tokenmill.common.locks import best_effort_lock\n"
        "try:\n"
        "    with best_effort_lock(sys.argv[1], 'building'):\n"
        "        pass\n"
        "except OSError as error:\n"
        "    print('refused:', error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(lock)], capture_output=True, text=True, timeout=60
    )
    assert "refused:" in result.stdout and str(lock) in result.stdout, result
