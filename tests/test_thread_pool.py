"""The C++ thread pool (csrc/thread_pool.hpp) every kernel runs on.

Exceptions thrown on a worker reach Python with their type; a pool that cannot start threads
gives the serial result; thread counts honour num_threads, the CPU affinity and the cgroup CPU
quota; a forked child gets a working pool of its own. Checks that change process-wide state
(affinity, forced thread-creation failure, fork) run in a fresh subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tokenmill import _core
from tokenmill._core import _testing

needs_two_cpus = pytest.mark.skipif(
    _testing.usable_threads(2) < 2, reason="needs two CPUs this process may use"
)


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter (no pool started yet); fails the test on a nonzero exit."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


# Kernels that split their work over the pool, each run with many threads and with one; the
# subprocess checks below compare the two (every kernel's output is independent of the threads).
KERNELS = """
import numpy as np
from tokenmill import _core
from tokenmill._core import _testing

def kernel_outputs(threads):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, 3_000_000, dtype=np.uint16)
    positions = _core.find_token_positions(tokens, 7, threads)
    count = _core.count_token(tokens, 7, threads)
    weights = rng.lognormal(0.0, 1.0, 200)
    weights /= weights.sum()
    ids = np.empty(40_000, np.int32)
    samples = np.empty(40_000, np.int64)
    _testing.build_blending_indices(weights, ids, samples, threads=threads)
    lengths = rng.integers(1, 300, 5_000, dtype=np.int32)
    plan = _core.plan_packing(lengths, 128, 0, 8, 64, 32, 700, False, threads)
    sizes = rng.integers(1, 200, 100_000, dtype=np.int32)
    documents = np.empty(100_000, np.int32)
    rows = np.empty((sizes.sum() // 64 + 1, 2), np.int32)
    order = np.empty(rows.shape[0] - 1, np.uint32)
    _core.build_gpt_indices(
        sizes, np.arange(100_000, dtype=np.int32), 5, 1, False, order.shape[0], 64, 0,
        documents, rows, order, threads,
    )
    return [positions, count, ids, samples, *plan[:2], documents, rows, order]

def check_kernels_match_serial(threads):
    for many, one in zip(kernel_outputs(threads), kernel_outputs(1)):
        np.testing.assert_array_equal(many, one)
"""


EXCEPTIONS = {
    "MemoryError": MemoryError,  # std::bad_alloc
    "IndexError": IndexError,  # std::out_of_range
    "ValueError": ValueError,  # std::invalid_argument
    "OverflowError": OverflowError,  # std::overflow_error
    "RuntimeError": RuntimeError,  # std::runtime_error
}


@needs_two_cpus
@pytest.mark.parametrize("kind", sorted(EXCEPTIONS))
def test_an_exception_on_a_worker_reaches_python_with_its_type(kind: str) -> None:
    with pytest.raises(EXCEPTIONS[kind]) as raised:
        _testing.throw_in_worker(kind)
    if kind != "MemoryError":
        assert "thrown on a pool worker" in str(raised.value)
    # The pool survives: the next region runs normally.
    assert set(_testing.run_parts(32, 2)) <= {0, 1}
    with pytest.raises(ValueError, match="kind must be"):
        _testing.throw_in_worker("KeyError")


def test_a_region_runs_every_part_once_on_at_most_the_threads_asked_for() -> None:
    assert _testing.run_parts(0, 4) == []
    assert _testing.run_parts(50, 1) == [0] * 50  # one thread: the caller alone
    for threads in (2, 3, 8):
        ran = _testing.run_parts(200, threads)
        assert len(ran) == 200
        assert set(ran) <= set(range(min(threads, _testing.usable_threads(threads))))
    assert _testing.pool_workers() <= max(0, _testing.available_cpus() - 1)


def test_usable_threads_is_capped_by_the_cpus() -> None:
    cpus = _testing.available_cpus()
    assert 1 <= cpus <= (os.cpu_count() or cpus)
    assert cpus <= len(os.sched_getaffinity(0))
    assert _testing.usable_threads(0) == cpus
    assert _testing.usable_threads(-3) == cpus
    assert _testing.usable_threads(1) == 1
    assert _testing.usable_threads(10_000) == cpus


def test_kernels_give_the_serial_result_when_no_thread_can_start() -> None:
    result = run_python(
        KERNELS
        + """
_testing.fail_thread_creation(True)
assert _testing.run_parts(64, 8) == [0] * 64
check_kernels_match_serial(8)
assert _testing.pool_workers() == 0, _testing.pool_workers()
_testing.fail_thread_creation(False)
if _testing.usable_threads(2) >= 2:
    ran = []
    for _ in range(20):  # a worker may wake after the caller took every part: try a few times
        ran = _testing.run_parts(4000, 2)
        if 1 in ran:
            break
    assert _testing.pool_workers() >= 1
print("ok")
"""
    )
    assert result.stdout.strip() == "ok"


def test_thread_count_honours_the_cpu_affinity() -> None:
    cpu = min(os.sched_getaffinity(0))
    result = run_python(
        KERNELS
        + f"""
import os
os.sched_setaffinity(0, {{{cpu}}})
assert _testing.available_cpus() == 1
assert _testing.usable_threads(8) == 1
assert _testing.run_parts(64, 8) == [0] * 64
check_kernels_match_serial(8)
assert _testing.pool_workers() == 0, _testing.pool_workers()
print("ok")
"""
    )
    assert result.stdout.strip() == "ok"


@needs_two_cpus
def test_spinning_is_opt_in_and_changes_no_result() -> None:
    result = run_python(
        KERNELS
        + """
check_kernels_match_serial(4)
print("ok")
""",
        env={"TOKENMILL_POOL_SPIN_US": "500"},
    )
    assert result.stdout.strip() == "ok"


@needs_two_cpus
def test_a_forked_child_gets_a_working_pool() -> None:
    result = run_python(
        KERNELS
        + """
import os
# Workers started in the parent do not exist in the child; the child must not wait for them.
for _ in range(20):
    if 1 in _testing.run_parts(4000, 2):
        break
assert _testing.pool_workers() >= 1
expected = kernel_outputs(1)
pid = os.fork()
if pid == 0:
    status = 1
    try:
        for many, one in zip(kernel_outputs(4), expected):
            np.testing.assert_array_equal(many, one)
        try:
            _testing.throw_in_worker("OverflowError")
        except OverflowError:
            status = 0 if _testing.pool_workers() >= 1 else 3
    finally:
        os._exit(status)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
check_kernels_match_serial(4)  # the parent's pool still works
print("ok")
"""
    )
    assert result.stdout.strip() == "ok"


def test_a_threaded_gather_reports_a_corrupt_index_from_any_part() -> None:
    # Real kernel: a corrupt document index makes every part throw std::out_of_range.
    documents = np.full(8, 99, np.int32)  # no such sequence
    sample_index = np.array([[0, 0], [2, 0], [4, 0], [6, 0], [7, 0]], np.int32)
    gatherer = _core.Gatherer(
        np.arange(4, dtype=np.int64),
        sample_index,
        documents,
        np.zeros(3, np.int64),
        np.full(3, 10, np.int32),
        np.zeros(30, np.uint16),
        4,
        1,
        0,
        -1,
        False,
        False,
        False,
    )
    out = np.empty((4, 4), np.int64)
    with pytest.raises(IndexError, match="not a sequence id"):
        gatherer.gather(
            np.arange(4, dtype=np.int64), None, out, out.copy(),
            np.empty((4, 4), np.float32), None, None, None, None, num_threads=4,
        )  # fmt: skip


# ---- The cgroup CPU quota ----------------------------------------------------------------------


def fake_system(root: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> str:
    """A directory standing for / with /proc/self/{cgroup,mountinfo} and cgroup files."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw shared:9 - cgroup cgroup rw,cpu,cpuacct\n"
    "32 25 0:28 / /sys/fs/cgroup/memory rw shared:10 - cgroup cgroup rw,memory\n"
)


@pytest.mark.parametrize(
    ("cgroup", "mountinfo", "files", "expected"),
    [
        # v2, the process's own cgroup limited: 1.5 CPUs
        (
            "0::/job/step\n",
            V2_MOUNT,
            {"/sys/fs/cgroup/job/step/cpu.max": "150000 100000\n"},
            1.5,
        ),
        # v2, no limit of its own but a parent's: the smallest along the ancestors wins
        (
            "0::/job/step\n",
            V2_MOUNT,
            {
                "/sys/fs/cgroup/job/step/cpu.max": "max 100000\n",
                "/sys/fs/cgroup/job/cpu.max": "300000 100000\n",
            },
            3.0,
        ),
        (
            "0::/job/step\n",
            V2_MOUNT,
            {
                "/sys/fs/cgroup/job/step/cpu.max": "50000 100000\n",
                "/sys/fs/cgroup/job/cpu.max": "300000 100000\n",
            },
            0.5,
        ),
        # v2 unlimited, and a container whose cgroup namespace shows "/"
        ("0::/job\n", V2_MOUNT, {"/sys/fs/cgroup/job/cpu.max": "max 100000\n"}, None),
        ("0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": "200000 100000\n"}, 2.0),
        # v1: quota / period; -1 is no limit
        (
            "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
            V1_MOUNTS,
            {
                "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
                "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            2.5,
        ),
        (
            "4:cpu,cpuacct:/docker/abc\n",
            V1_MOUNTS,
            {
                "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1\n",
                "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            None,
        ),
        # hybrid: the cpu controller on v1 wins over the v2 line
        (
            "4:cpu,cpuacct:/a\n0::/a\n",
            V1_MOUNTS + V2_MOUNT,
            {
                "/sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_quota_us": "100000\n",
                "/sys/fs/cgroup/cpu,cpuacct/a/cpu.cfs_period_us": "100000\n",
                "/sys/fs/cgroup/a/cpu.max": "400000 100000\n",
            },
            1.0,
        ),
        # no cgroup files at all, and garbage
        ("0::/x\n", V2_MOUNT, {}, None),
        ("0::/x\n", V2_MOUNT, {"/sys/fs/cgroup/x/cpu.max": "lots\n"}, None),
        ("", "", {}, None),
    ],
)
def test_cgroup_cpu_limit(
    tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str], expected: float | None
) -> None:
    root = fake_system(tmp_path, cgroup, mountinfo, files)
    assert _testing.cgroup_cpu_limit(root) == expected


def test_cgroup_cpu_limit_without_proc(tmp_path: Path) -> None:
    assert _testing.cgroup_cpu_limit(str(tmp_path / "missing")) is None


def test_available_cpus_honours_the_real_quota() -> None:
    limit = _testing.cgroup_cpu_limit("")
    cpus = len(os.sched_getaffinity(0))
    if limit is not None:
        cpus = min(cpus, max(1, -int(-limit // 1)))
    assert _testing.available_cpus() == cpus
