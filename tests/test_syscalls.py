"""System calls as strace(1) sees them (strace is a test oracle: tests/oracles.py; .ci/run
installs it): the one-call small-file read, and the `strace -c` parser of
benchmarks/bench_scale.py, whose system-call counts benchmarks/SCALE.md reports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import oracles

ROOT = Path(__file__).resolve().parents[1]
READS = 25


def _bench_scale() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_scale", ROOT / "benchmarks" / "bench_scale.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _traced(tmp_path: Path, *strace_options: str) -> tuple[Path, Path]:
    """A child reading one small file READS times through `_core.read_small_file`, under
    strace with `strace_options`; (the file read, strace's output)."""
    oracles.require("strace")
    small = tmp_path / "small.idx"
    small.write_bytes(bytes(range(256)) * 4)
    output = tmp_path / "strace.txt"
    code = (
        "from tokenmill import _core\n"
        f"for _ in range({READS}):\n"
        f"    assert _core.read_small_file({str(small)!r}, 65536)[2] == {small.read_bytes()!r}\n"
    )
    result = subprocess.run(
        ["strace", "-f", *strace_options, "-o", str(output), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return small, output


def test_a_small_file_is_read_with_one_open_and_one_close(tmp_path: Path) -> None:
    small, output = _traced(tmp_path, "-e", "trace=open,openat,close,read,pread64")
    lines = output.read_text().splitlines()
    opens = [line for line in lines if "open" in line and str(small) in line]
    assert len(opens) == READS, opens[:5]
    assert all("O_RDONLY" in line and "O_CLOEXEC" in line for line in opens)
    # each open's descriptor is read by pread and closed (no descriptor left behind)
    descriptors = {line.rsplit("=", 1)[1].strip() for line in opens}
    for descriptor in descriptors:
        assert any(f"pread64({descriptor}," in line for line in lines)
        assert any(f"close({descriptor})" in line for line in lines)


def test_bench_scale_counts_system_calls_from_a_strace_summary(tmp_path: Path) -> None:
    _, output = _traced(tmp_path, "-c")
    counts = _bench_scale().syscalls(str(output))
    assert counts["openat"] >= READS
    assert counts["pread64"] >= READS
    assert counts["close"] >= READS
    assert "total" not in counts
