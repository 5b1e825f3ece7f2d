"""Two hosts sharing one index-cache directory, as distinct as one machine makes them
(docs/cache-protocol.md, "The two-host test").

* Each host is an agent process started by ``unshare --uts --pid --fork --mount-proc`` under its
  own host name (``hostname``): its pids start at 1 like the other host's, so the two hosts' ranks
  have the same pids, and each host's temporary files carry its own host name and pid namespace.
* Each host sees the shared directory through its own bindfs (FUSE) mount. bindfs does not
  forward locks unless asked to, so the kernel keeps an ``flock`` in the mount's own inode: it
  excludes the processes of that mount only, like NFS ``local_lock=flock`` or Lustre
  ``localflock``. The test checks that first and falls back to patched node-local locks (as in
  tests/test_cache_ranks.py) if it does not hold. Names and attributes go through each mount's
  own kernel caches.
* The agents fork the ranks of one gloo job on 127.0.0.1 (the network namespace is shared), four
  per host, with ``cache_build_scope="node"``: each host's local rank 0 builds. Rounds: both
  builders cold on the same entries, host b's SIGKILLed mid-build; the resume (both build the
  blend entries at once, each under its own host's lock); both cold at once on every entry; a
  warm job.

Checked: every rank of a completed job ends with the samples of a single-process build, every
committed file holds the bytes that build wrote, no committed file is removed (a watcher) or
replaced between jobs (inode, mtime, size and bytes), no rank hangs, and the cleaners of both
hosts remove their own host's dead writers' temporary files and never the other host's, whether
or not its writer's pid exists on the cleaning host.

Needs root, unshare, /dev/fuse and bindfs; otherwise skipped with the reason, or failed when
TOKENMILL_REQUIRE_TWO_HOSTS=1 (.ci/run sets it). Run as a script, this file is a host's agent.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import select
import shutil
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from rank_jobs import (
    FORK,
    HANG,
    build_datasets,
    committed_files,
    finish_ranks,
    make_job,
    rank_main,
    samples_digest,
    watch_committed,
    write_shards,
)
from tokenmill.common.owner import tag as owner_tag_of

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning"),
]

RANKS_PER_HOST = 4
HOST_NAMES = ("node-a", "node-b")
# pids of live writers: one on host b only (no process of host a ever has it), one on both
PID_LIVE_ON_B_ONLY = 20000
PID_LIVE_ON_BOTH = 21000
# a host's own UTS, PID (and, for its /proc, mount) namespaces; --kill-child: when unshare dies,
# so does the host's first process, and with it every process of its pid namespace
HOST_NAMESPACES = ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child", "--"]
ANSWER = "@two-hosts-agent@ "  # marks the agent's answer lines among anything else on stdout
SIDECAR_SUFFIX = "-data.tokenmill.json"  # records inodes and mtimes: differs between builds


def fuse_unavailable() -> str | None:
    """Why a bindfs (FUSE) mount cannot be made here (None: it can); root is checked first."""
    if os.geteuid() != 0:
        return "needs root (FUSE mounts)"
    if shutil.which("bindfs") is None:
        return "bindfs is not installed (apt-get install bindfs)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as error:
        return f"/dev/fuse is not usable: {error}"
    return None


def _missing_environment() -> str | None:
    """Why two hosts cannot be made on this machine (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (UTS and PID namespaces, FUSE mounts)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    missing = fuse_unavailable()
    if missing is not None:
        return missing
    probe = subprocess.run(
        [*HOST_NAMESPACES, "hostname", "tokenmill-probe"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        return f"{' '.join(HOST_NAMESPACES[:-1])} fails: {probe.stderr.strip()}"
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        return "torch is not installed"
    return None


def _mounted(path: Path) -> bool:
    """Whether `path` is a mount point of this mount namespace (a FUSE mount whose server died
    fails every stat, so os.path.ismount cannot tell)."""
    with open("/proc/self/mountinfo") as mounts:
        return any(line.split()[4] == os.fspath(path) for line in mounts)


def _mount(shared: Path, view: Path) -> None:
    view.mkdir()
    subprocess.run(["bindfs", str(shared), str(view)], check=True, capture_output=True, timeout=60)


def _unmount(view: Path) -> None:
    """fusermount -u; a lazy umount when that fails (a process still uses the mount)."""
    for unmount in (["fusermount", "-u"], ["fusermount3", "-u"], ["umount", "-l"]):
        if not _mounted(view):
            return
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([*unmount, str(view)], capture_output=True, timeout=60)


def _flock_is_per_mount(view: Path, other_view: Path) -> bool:
    """Whether an flock held through `view` leaves the same file free through `other_view`."""
    probe = view / ".flock-probe"
    with open(probe, "a") as holder, open(other_view / probe.name) as other:
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            per_mount = False
        else:
            per_mount = True
    probe.unlink()
    return per_mount


class _Host:
    """One host: its agent (this file run as a script) is pid 1 of its own pid namespace, under
    its own host name, and answers one JSON line per command."""

    def __init__(self, name: str, view: Path, ranks: Iterable[int]) -> None:
        self.name = name
        self.cache = view / "cache"
        self.ranks = list(ranks)
        self.process: subprocess.Popen[bytes] | None = None
        self._buffer = b""

    def start(self) -> None:
        agent = {"name": self.name, "cache": str(self.cache), "ranks": self.ranks}
        self.process = subprocess.Popen(
            [*HOST_NAMESPACES, "sh", "-c", 'hostname "$0" && exec "$@"', self.name,
             sys.executable, __file__, json.dumps(agent)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )  # fmt: skip

    def send(self, command: dict[str, Any]) -> None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps(command).encode() + b"\n")
        self.process.stdin.flush()

    def answer(self, timeout: float) -> dict[str, Any]:
        """The agent's next answer; fails when it reports an error, exits or takes too long."""
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(ANSWER):
                    answer: dict[str, Any] = json.loads(text[len(ANSWER) :])
                    assert "error" not in answer, f"host {self.name}: {answer['error']}"
                    return answer
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"host {self.name} did not answer within {timeout} s"
            ready, _, _ = select.select([self.process.stdout], [], [], remaining)
            if ready:
                chunk = os.read(self.process.stdout.fileno(), 1 << 16)
                assert chunk, f"host {self.name} exited with {self.process.wait()}"
                self._buffer += chunk

    def ask(self, command: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        self.send(command)
        return self.answer(timeout)

    def stop(self) -> None:
        """End the agent (stdin closed: it exits; else SIGKILL to unshare, which kills it)."""
        if self.process is None:
            return
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(20)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    return write_shards(tmp_path)


def _hidden(cache: Path) -> set[str]:
    return {name for name in os.listdir(cache) if name.startswith(".")}


def test_two_hosts_share_one_cache(tmp_path: Path, shards: list[str]) -> None:
    missing = _missing_environment()
    if missing is not None:
        if os.environ.get("TOKENMILL_REQUIRE_TWO_HOSTS") == "1":
            pytest.fail(f"TOKENMILL_REQUIRE_TWO_HOSTS=1, but {missing}")
        pytest.skip(missing)
    shared = tmp_path / "shared"
    cache = shared / "cache"  # what both hosts see, each through its own mount
    cache.mkdir(parents=True)
    views = [tmp_path / f"view-{name}" for name in HOST_NAMES]
    a, b = hosts = [
        _Host(name, view, range(i * RANKS_PER_HOST, (i + 1) * RANKS_PER_HOST))
        for i, (name, view) in enumerate(zip(HOST_NAMES, views))
    ]
    stop, report = tmp_path / "stop", tmp_path / "watch.json"
    watcher = None
    try:
        for view in views:
            _mount(shared, view)
        # the real flock when each mount keeps its own (node-local locks); should a bindfs ever
        # share them between mounts, the patched lock that never excludes anyone instead
        lock = "flock" if _flock_is_per_mount(views[0], views[1]) else "node_local"
        for host in hosts:
            host.start()
        # while the agents import torch: what a single process builds (same data paths, so the
        # same entry names), its samples and the bytes of each committed file but the sidecar
        references: dict[int, str] = {}
        reference_files: dict[int, dict[str, str]] = {}
        for seed in (1, 2):
            directory = tmp_path / f"reference{seed}"
            datasets = build_datasets(shards, str(directory), seed, "global")
            references[seed] = samples_digest(datasets)
            reference_files[seed] = {
                name: record[3]
                for name, record in committed_files(directory).items()
                if not name.endswith(SIDECAR_SUFFIX)
            }
        expected_bytes = {**reference_files[1], **reference_files[2]}
        hello = {host.name: host.answer(120) for host in hosts}
        assert [hello[name]["host"] for name in HOST_NAMES] == list(HOST_NAMES)
        assert hello["node-a"]["namespace"] != hello["node-b"]["namespace"]
        assert hello["node-a"]["pid"] == hello["node-b"]["pid"] == 1

        # Temporary files of writers on both hosts, in place before either cleaner looks: a
        # dead writer on each host; live writers on host b, one at a pid that does not exist on
        # host a, one at a pid host a's own live writer has; and a file naming host b's pid
        # namespace and a pid dead on host a under host a's name (a container elsewhere with
        # the same host name).
        planted_a = a.ask(
            {"do": "plant", "dead": "dead-a.npy", "live": [["live-a.npy", PID_LIVE_ON_BOTH]]}
        )
        planted_b = b.ask(
            {
                "do": "plant",
                "dead": "dead-b.npy",
                "live": [["live-b.npy", PID_LIVE_ON_B_ONLY], ["live-b2.npy", PID_LIVE_ON_BOTH]],
                "same_name_elsewhere": ["same-name.npy", a.name, PID_LIVE_ON_B_ONLY],
            }
        )
        dead = {planted_a["dead"], planted_b["dead"]}
        kept = {*planted_a["live"], *planted_b["live"], planted_b["same_name_elsewhere"]}
        assert len(kept) == 4 and dead | kept <= _hidden(cache)
        live_pids = [PID_LIVE_ON_B_ONLY, PID_LIVE_ON_BOTH]
        alive_on = {h.name: h.ask({"do": "alive", "pids": live_pids})["alive"] for h in hosts}
        assert alive_on == {"node-a": [False, True], "node-b": [True, True]}

        watcher = FORK.Process(target=watch_committed, args=(str(cache), str(stop), str(report)))
        watcher.start()
        builder_b = RANKS_PER_HOST  # host b's local rank 0
        rng = random.Random(3)
        rounds: list[dict[str, Any]] = [
            # both builders start cold on the same entries; host b's is SIGKILLed after a
            # random number of array writes (host a's commits the members, then finds the group
            # broken)
            {"name": "kill", "seed": 1, "kill_ranks": [builder_b], "kill_at": rng.randint(1, 8)},
            # the members are hits: both builders build the blend entries at once, each under
            # its own host's lock, and host b's cleaner meets its killed builder's leftovers
            {"name": "resume", "seed": 1},
            {"name": "both-cold", "seed": 2},  # both build every entry at once
            {"name": "warm", "seed": 2},  # every entry a hit: nothing written
        ]
        committed_before: dict[str, tuple[int, int, int, str]] = {}
        killed_leftovers: set[str] = set()
        for number, fields in enumerate(rounds):
            job = make_job(
                tmp_path, shards, fields.pop("name"), world=2 * RANKS_PER_HOST, nodes=2,
                scope="node", lock=lock, cache=None, **fields,
            )  # fmt: skip
            for host in hosts:  # each agent runs the job's ranks on its host, on its own mount
                host.send({"do": "job", "job": job, "first_pid": 1000 * (number + 1)})
            answers = [host.answer(HANG + 60) for host in hosts]
            outcomes = {int(r): o for answer in answers for r, o in answer["outcomes"].items()}
            pids = [set(answer["pids"].values()) for answer in answers]
            assert pids[0] & pids[1], f"{job['out']}: the hosts' pids do not collide: {pids}"
            killed = sorted(rank for rank, outcome in outcomes.items() if outcome is None)
            if job["kill_ranks"]:  # the survivors fail (a broken group), none hangs
                assert killed == job["kill_ranks"]
                assert all(not o["ok"] for o in outcomes.values() if o is not None)
                # each host's cleaner ran (before the kill): its own dead writer's file went,
                # the other host's files stayed, and so did host b's live writer's
                assert not dead & _hidden(cache)
                assert kept <= _hidden(cache)
                killed_pid = answers[1]["pids"][str(builder_b)]
                tag = f".{owner_tag_of(b.name, hello[b.name]['namespace'], killed_pid)}."
                killed_leftovers = {name for name in _hidden(cache) if tag in name}
            else:
                assert not killed
                failures = [o for o in outcomes.values() if o is not None and not o["ok"]]
                assert not failures, failures[:2]
                digests = {o["digest"] for o in outcomes.values() if o is not None}
                assert digests == {references[job["seed"]]}, f"{job['out']}: samples differ"
            committed = committed_files(cache)
            changed = [
                name for name, record in committed_before.items() if committed.get(name) != record
            ]
            assert not changed, f"{job['out']}: committed files removed or replaced: {changed}"
            wrong = [
                name
                for name, record in committed.items()
                if not name.endswith(SIDECAR_SUFFIX) and expected_bytes.get(name) != record[3]
            ]
            assert not wrong, f"{job['out']}: committed files unlike a single process's: {wrong}"
            if not job["kill_ranks"]:
                absent = sorted(set(reference_files[job["seed"]]) - set(committed))
                assert not absent, f"{job['out']}: entries not committed: {absent}"
            committed_before = committed
        # host b's cleaner removed the files its killed builder left (host a's kept them)
        assert not killed_leftovers & _hidden(cache)
        # nothing else is left: no lock file, no temporary file but the live writers'
        assert _hidden(cache) == kept
    finally:
        if watcher is not None:
            stop.touch()
            watcher.join(30)
        for host in hosts:
            host.stop()
        for view in views:
            _unmount(view)
    assert not [view for view in views if _mounted(view)], "a mount survived its unmount"
    watched = json.loads(report.read_text())
    assert watched["seen"], "the watcher saw no committed file"
    assert watched["removed"] == [], "committed files disappeared"


# The agent: this file run as a script, pid 1 of a host's pid namespace.


def _answer(answer: dict[str, Any]) -> None:
    sys.stdout.write(ANSWER + json.dumps(answer) + "\n")
    sys.stdout.flush()  # before the next fork: a child must not inherit unwritten output


def _temporary_name(final: str, tag: str) -> str:
    """A temporary file's name as common.atomic makes it (docs/cache-protocol.md)."""
    return f".{final}.{tag}.0.tmp"


def _leave_temporary(cache: str, final: str) -> None:
    """A writer that dies (exits) with its temporary file left behind."""
    from tokenmill.common.owner import owner_tag

    Path(cache, _temporary_name(final, owner_tag())).write_bytes(b"a killed writer's bytes")
    os._exit(0)


def _hold_temporary(cache: str, final: str, ready: Any) -> None:
    """A live writer: its temporary file stays open until the host ends."""
    from tokenmill.common.owner import owner_tag

    path = os.path.join(cache, _temporary_name(final, owner_tag()))
    os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    ready.set()
    while True:
        time.sleep(3600)


def _start_as_pid(process: Any, pid: int) -> None:
    """Start `process` as pid `pid` of this pid namespace (unless a thread of an earlier child
    takes that pid first: then the next free one)."""
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    process.start()


def _plant(command: dict[str, Any], cache: str, live_writers: list[Any]) -> dict[str, Any]:
    """Temporary files of live writers of this host (at the pids asked for), of a dead one, and
    a file naming a live writer's pid and this host's pid namespace under another host's name.
    Returns their names."""
    from tokenmill.common.owner import pid_namespace, tag

    def named(final: str) -> str:
        [name] = [n for n in os.listdir(cache) if n.startswith(f".{final}.tm-")]
        return name

    planted: dict[str, Any] = {"live": []}
    for final, pid in command["live"]:
        ready = FORK.Event()
        writer = FORK.Process(target=_hold_temporary, args=(cache, final, ready))
        _start_as_pid(writer, pid)
        live_writers.append(writer)
        if writer.pid != pid:
            raise RuntimeError(f"the live writer got pid {writer.pid}, not {pid}")
        if not ready.wait(30):
            raise RuntimeError("the live writer did not create its file")
        planted["live"].append(named(final))
    if "same_name_elsewhere" in command:
        final, host, pid = command["same_name_elsewhere"]
        name = _temporary_name(final, tag(host, pid_namespace(), pid))
        Path(cache, name).write_bytes(b"a live writer's bytes")
        planted["same_name_elsewhere"] = name
    writer = FORK.Process(target=_leave_temporary, args=(cache, command["dead"]))
    writer.start()
    writer.join(30)
    planted["dead"] = named(command["dead"])
    return planted


def _run_ranks(job: dict[str, Any], ranks: list[int], first_pid: int) -> dict[str, Any]:
    """This host's ranks of `job`, its i-th rank at pid first_pid + 100 i (the other host's i-th
    rank has the same pid), until each has finished: their outcomes and pids."""
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    processes = {}
    for number, rank in enumerate(ranks):
        processes[rank] = FORK.Process(target=rank_main, args=(job, rank))
        _start_as_pid(processes[rank], first_pid + 100 * number)
    pids = {rank: process.pid for rank, process in processes.items()}
    return {"outcomes": finish_ranks(job, processes), "pids": pids}


def _serve(agent: dict[str, Any]) -> None:
    """Answer the test's commands (one JSON object a line on stdin) until stdin closes: plant
    temporary files, tell which pids exist here, run this host's ranks of a job."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # this host's name resolves to no address
    import torch.distributed  # noqa: F401 - once here, not in every forked rank

    from tokenmill.common.owner import pid_alive, pid_namespace

    _answer({"host": socket.gethostname(), "namespace": pid_namespace(), "pid": os.getpid()})
    live_writers: list[Any] = []
    try:
        for line in sys.stdin:
            command = json.loads(line)
            try:
                if command["do"] == "plant":
                    answer = _plant(command, agent["cache"], live_writers)
                elif command["do"] == "alive":
                    answer = {"alive": [pid_alive(pid) for pid in command["pids"]]}
                else:
                    job = {**command["job"], "cache": agent["cache"]}
                    answer = _run_ranks(job, agent["ranks"], command["first_pid"])
            except BaseException:
                answer = {"error": traceback.format_exc()}
            _answer(answer)
    finally:
        for writer in live_writers:
            writer.kill()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
