"""The sdist holds exactly what a build needs: the tracked files of the build, and nothing else.

`.ci/run` then builds its wheels from this sdist, which proves nothing needed is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# what a build reads: CMake, the C++ sources, the package, the metadata (README is the long
# description, LICENSE goes into the sdist and the wheel metadata)
BUILD_INPUTS = (
    "CMakeLists.txt",
    "cmake/",
    "csrc/",
    "python/",
    "pyproject.toml",
    "README.md",
    "LICENSE",
)


def tracked_build_inputs() -> set[str]:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {f for f in files if f.startswith(BUILD_INPUTS) and (ROOT / f).exists()}


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"
)
def test_sdist_members_are_the_build_inputs(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (sdist,) = tmp_path.glob("tokenmill-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {m.name.split("/", 1)[1] for m in archive.getmembers() if m.isfile()}
    assert names - {"PKG-INFO"} == tracked_build_inputs()
    assert "python/tokenmill/data/jargon.jsonl.gz" in names  # the demo corpus ships
