"""Many ranks on one cache directory, on the gloo backend over 127.0.0.1 (CPU only).

* A building rank that raises: every rank raises the same exception type and message (the
  process group's timeout is 10 s, so a rank left waiting in a collective would fail with a
  timeout error of another type instead).
* Rounds of 16 ranks sharing one directory (docs/cache-protocol.md): a building rank SIGKILLed
  in the middle of writing an entry (the survivors fail instead of hanging; the next job
  completes over the leftovers), locks that raise ENOLCK, locks that are silently node-local
  (two "nodes" whose builders both hold "the" lock), and two jobs building the same entries at
  once. Every rank of a completed job ends with the same samples as a single-process build,
  and a watcher process checks that no committed file ever disappears.

Ranks are forked from the test process (torch and tokenmill already imported), so a round costs
process creation and a gloo rendezvous, not 16 interpreter start-ups.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import random
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import TinyTokenizer, random_documents, write_megatron_shard

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning"),
]

torch = pytest.importorskip("torch")

FORK = multiprocessing.get_context("fork")
HANG = 90.0  # seconds after which a rank that has not finished counts as hung


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _config(shards: list[str], cache: str, seed: int, scope: str) -> Any:
    from tokenmill.datasets.gpt import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=32,
        tokenizer=TinyTokenizer(),
        blend=(shards, [0.5, 0.3, 0.2]),
        split="90,10,0",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=cache,
        cache_build_scope=scope,
        num_dataset_builder_threads=1,
    )


def _digest(datasets: list[Any]) -> str:
    hasher = hashlib.sha256()
    for dataset in datasets:
        if dataset is None:
            continue
        for index in range(len(dataset)):
            hasher.update(np.asarray(dataset[index]["tokens"]).tobytes())
    return hasher.hexdigest()


def _build(shards: list[str], cache: str, seed: int, scope: str) -> list[Any]:
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset

    config = _config(shards, cache, seed, scope)
    return BlendedMegatronDatasetBuilder(GPTDataset, [300, 30, 0], lambda: True, config).build()


def _rank_main(job: dict[str, Any], rank: int) -> None:
    """One rank: build the datasets, write the outcome to <out>/<rank>.json, exit."""
    os.environ["OMP_NUM_THREADS"] = "1"
    world, nodes = job["world"], job["nodes"]
    os.environ["LOCAL_RANK"] = str(rank % (world // nodes))
    import fcntl

    import torch.distributed as dist

    import tokenmill.datasets.gpt as gpt_module
    import tokenmill.index.cache_writes as writes_module
    from tokenmill.common import distributed

    rng = random.Random(job["seed"] * 1000 + rank + 7 * job["job"])
    if job["lock"] == "enolck":

        def no_lock(descriptor: int, operation: int) -> None:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        fcntl.flock = no_lock  # type: ignore[assignment]
    elif job["lock"] == "node_local":
        fcntl.flock = lambda descriptor, operation: None  # type: ignore[assignment]
    builder = distributed.local_rank() == 0 if job["scope"] == "node" else rank == 0
    real_save = writes_module._npy_chunks
    saves = [0]
    kill_at = job["kill_at"] if builder and rank in job["kill_ranks"] else None

    def slow_save(path: Path, array: np.ndarray) -> Any:
        # each array of an entry, before the entry's files are handed to the writer together
        time.sleep(rng.random() * 0.02)  # widen the windows in which builders interleave
        saves[0] += 1
        if kill_at is not None and saves[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(path, array)

    writes_module._npy_chunks = slow_save
    if job.get("fail") and builder:

        def broken(*args: Any, **kwargs: Any) -> Any:
            from tokenmill.errors import DataFormatError

            raise DataFormatError(f"shard0.idx: field 'sequence_count' is -1 (rank {rank})")

        gpt_module.build_gpt_indices = broken
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=job["timeout"]),
    )
    try:
        datasets = _build(job["shards"], job["cache"], job["seed"], job["scope"])
        outcome = {"ok": True, "digest": _digest(datasets)}
    except Exception as error:
        outcome = {"ok": False, "type": type(error).__name__, "message": str(error)}
    Path(job["out"], f"{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # no destroy_process_group: peers may be gone


def _start(job: dict[str, Any]) -> list[Any]:
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    processes = [FORK.Process(target=_rank_main, args=(job, rank)) for rank in range(job["world"])]
    for process in processes:
        process.start()
    return processes


def _finish(job: dict[str, Any], processes: list[Any]) -> dict[int, dict[str, Any] | None]:
    """Each rank's outcome (None: killed). Fails on a rank that hangs."""
    deadline = time.monotonic() + HANG
    hung = []
    for rank, process in enumerate(processes):
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            hung.append(rank)
            process.kill()
            process.join()
    assert not hung, f"ranks {hung} hung"
    outcomes: dict[int, dict[str, Any] | None] = {}
    for rank, process in enumerate(processes):
        path = Path(job["out"], f"{rank}.json")
        if process.exitcode == -signal.SIGKILL:
            outcomes[rank] = None
        else:
            assert path.is_file(), f"rank {rank} exited with {process.exitcode} and no outcome"
            outcomes[rank] = json.loads(path.read_text())
    return outcomes


def _watch(directory: str, stop: str, report: str) -> None:
    """Until `stop` exists: every committed (non-hidden) file, once seen, must stay."""
    seen: set[str] = set()
    removed: set[str] = set()
    while not os.path.exists(stop):
        try:
            now = {name for name in os.listdir(directory) if not name.startswith(".")}
        except FileNotFoundError:
            now = set()
        removed |= seen - now
        seen |= now
        time.sleep(0.005)
    Path(report).write_text(json.dumps({"seen": sorted(seen), "removed": sorted(removed)}))
    os._exit(0)


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    rng = np.random.default_rng(11)
    return [
        write_megatron_shard(tmp_path / f"shard{i}", random_documents(rng, 80, 150))
        for i in range(3)
    ]


def _job(tmp_path: Path, shards: list[str], name: str, **fields: Any) -> dict[str, Any]:
    job = {
        "world": 4,
        "nodes": 1,
        "scope": "global",
        "lock": "flock",
        "kill_ranks": [],
        "kill_at": None,
        "seed": 1,
        "job": 0,
        "timeout": 30,
        "shards": shards,
        "cache": str(tmp_path / "cache"),
        "out": str(tmp_path / "out" / name),
        "port": _port(),
    }
    job.update(fields)
    return job


def test_a_builders_error_is_raised_on_every_rank(tmp_path: Path, shards: list[str]) -> None:
    # the group's timeout is a hang guard, not part of the test: a minute for ranks slowed by a
    # loaded machine, and still inside HANG, so an error that is not shared ends in a timeout
    # error on the waiting ranks (a failure below), not in a hang
    job = _job(tmp_path, shards, "fail", fail=True, timeout=60)
    outcomes = _finish(job, _start(job))
    assert all(outcome is not None for outcome in outcomes.values())
    kinds = {(o["type"], o["message"].splitlines()[0]) for o in outcomes.values() if o}
    assert kinds == {("DataFormatError", "shard0.idx: field 'sequence_count' is -1 (rank 0)")}


def test_sixteen_ranks_kills_broken_and_local_locks_and_two_jobs(
    tmp_path: Path, shards: list[str]
) -> None:
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    stop, report = str(tmp_path / "stop"), str(tmp_path / "watch.json")
    watcher = FORK.Process(target=_watch, args=(cache, stop, report))
    watcher.start()
    rng = random.Random(5)
    completed: dict[int, set[str]] = {}  # seed -> digests of completed jobs
    rounds: list[list[dict[str, Any]]] = [
        # the building rank is killed after a random number of array writes; then resumed
        [_job(tmp_path, shards, "kill", world=16, seed=1, kill_ranks=[0], kill_at=rng.randint(1, 8))],
        [_job(tmp_path, shards, "resume", world=16, seed=1)],
        # two "nodes" (local rank 0 builds) on one directory, and locks that raise ENOLCK; one
        # of the two builders is killed, then both nodes build again
        [_job(tmp_path, shards, "enolck-kill", world=16, nodes=2, scope="node", lock="enolck",
              seed=2, kill_ranks=[8], kill_at=rng.randint(1, 8))],
        [_job(tmp_path, shards, "enolck", world=16, nodes=2, scope="node", lock="enolck", seed=2)],
        # node-local locks: both nodes' builders "hold" the lock at once
        [_job(tmp_path, shards, "node-local", world=16, nodes=2, scope="node",
              lock="node_local", seed=3)],
        # two jobs of 8 ranks build the same entries at the same time
        [_job(tmp_path, shards, f"two-jobs-{j}", world=8, seed=4, job=j) for j in range(2)],
    ]  # fmt: skip
    try:
        for jobs in rounds:
            running = [(job, _start(job)) for job in jobs]
            for job, processes in running:
                outcomes = _finish(job, processes)
                killed = [rank for rank, outcome in outcomes.items() if outcome is None]
                if job["kill_ranks"]:  # the survivors fail (a broken group), none hangs
                    assert killed == job["kill_ranks"]
                    assert all(not o["ok"] for o in outcomes.values() if o is not None)
                    continue
                assert not killed
                failures = [o for o in outcomes.values() if o is not None and not o["ok"]]
                assert not failures, failures[:2]
                digests = {o["digest"] for o in outcomes.values() if o is not None}
                assert len(digests) == 1, f"{job['out']}: ranks disagree"
                completed.setdefault(job["seed"], set()).update(digests)
    finally:
        Path(stop).touch()
        watcher.join(30)
    watched = json.loads(Path(report).read_text())
    assert watched["seen"], "the watcher saw no committed file"
    assert watched["removed"] == [], "committed files disappeared"
    assert not [name for name in os.listdir(cache) if name.endswith(".lock")]
    # every completed job agrees with a single-process build of its own
    for seed, digests in completed.items():
        reference = _digest(_build(shards, str(tmp_path / f"reference{seed}"), seed, "global"))
        assert digests == {reference}, f"seed {seed}"
