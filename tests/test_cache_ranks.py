"""Many ranks on one cache directory, on the gloo backend over 127.0.0.1 (CPU only).

* A building rank that raises: every rank raises the same exception type and message (the
  process group's timeout is 10 s, so a rank left waiting in a collective would fail with a
  timeout error of another type instead).
* Rounds of 16 ranks sharing one directory (docs/cache-protocol.md): a building rank SIGKILLed
  in the middle of writing an entry (the survivors fail instead of hanging; the next job
  completes over the leftovers), locks that raise ENOLCK, locks that are silently node-local
  (two "nodes" whose builders both hold "the" lock), and two jobs building the same entries at
  once. Every rank of a completed job ends with the same samples as a single-process build,
  a watcher process checks that no committed file ever disappears, and no file committed
  before a round is rewritten or renamed over by it (inode, mtime, size, sha256).

Ranks are forked from the test process (torch and tokenmill already imported), so a round costs
process creation and a gloo rendezvous, not 16 interpreter start-ups.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rank_jobs import (
    FORK,
    build_datasets,
    committed_files,
    finish_ranks,
    make_job,
    samples_digest,
    start_ranks,
    watch_committed,
    write_shards,
)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning"),
]

torch = pytest.importorskip("torch")


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    return write_shards(tmp_path)


def test_a_builders_error_is_raised_on_every_rank(tmp_path: Path, shards: list[str]) -> None:
    # the group's timeout is a hang guard, not part of the test: a minute for ranks slowed by a
    # loaded machine, and still inside HANG, so an error that is not shared ends in a timeout
    # error on the waiting ranks (a failure below), not in a hang
    job = make_job(tmp_path, shards, "fail", fail=True, timeout=60)
    outcomes = finish_ranks(job, start_ranks(job))
    assert all(outcome is not None for outcome in outcomes.values())
    kinds = {(o["type"], o["message"].splitlines()[0]) for o in outcomes.values() if o}
    assert kinds == {("DataFormatError", "shard0.idx: field 'sequence_count' is -1 (rank 0)")}


def _permute_documents(prefix: str) -> None:
    """Rewrite the shard at `prefix` with two neighbouring documents of different lengths
    swapped: the same token and document counts, so every index array keeps its shape, but the
    sample boundaries between them move."""
    from tokenmill.formats.megatron import IndexedDataset

    from conftest import write_megatron_shard

    old = IndexedDataset(prefix)
    documents = [np.asarray(old[i]).tolist() for i in range(len(old))]
    del old
    at = next(i for i in range(10, len(documents)) if len(documents[i]) != len(documents[i + 1]))
    documents[at], documents[at + 1] = documents[at + 1], documents[at]
    write_megatron_shard(prefix, documents)


def test_a_trusting_rank_never_serves_its_own_stale_copy(tmp_path: Path, shards: list[str]) -> None:
    """Node-local caches (one folder per node) with global scope: rank 0 checks and rebuilds
    its own copy; node 1's copy is older than the data. Node 1's ranks trust the builder, but
    their copy is not the one it vouched for (digest): they check it and refuse it instead of
    serving the old indices (they did on main: samples that match neither build)."""
    job = make_job(tmp_path, shards, "stale-copy", nodes=2, node_caches=True, timeout=15)
    stale_cache = os.path.join(job["cache"], "node1")
    build_datasets(shards, stale_cache, job["seed"], "global")  # node 1's copy, of the old data
    _permute_documents(shards[0])
    fresh = samples_digest(build_datasets(shards, str(tmp_path / "fresh"), job["seed"], "global"))
    outcomes = finish_ranks(job, start_ranks(job))
    for rank, outcome in outcomes.items():
        assert outcome is not None
        if outcome["ok"]:  # whoever serves samples serves the fresh ones
            assert outcome["digest"] == fresh, f"rank {rank} served stale samples"
    # node 1's ranks cannot rebuild: they say why
    for rank in (2, 3):
        outcome = outcomes[rank]
        assert outcome is not None and outcome["type"] == "StaleCacheError", outcome
        assert "node1" in outcome["message"]


def test_sixteen_ranks_kills_broken_and_local_locks_and_two_jobs(
    tmp_path: Path, shards: list[str]
) -> None:
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    stop, report = str(tmp_path / "stop"), str(tmp_path / "watch.json")
    watcher = FORK.Process(target=watch_committed, args=(cache, stop, report))
    watcher.start()
    rng = random.Random(5)
    completed: dict[int, set[str]] = {}  # seed -> digests of completed jobs

    def new_job(name: str, **fields: Any) -> dict[str, Any]:
        return make_job(tmp_path, shards, name, **fields)

    rounds: list[list[dict[str, Any]]] = [
        # the building rank is killed after a random number of array writes; then resumed
        [new_job("kill", world=16, seed=1, kill_ranks=[0], kill_at=rng.randint(1, 8))],
        [new_job("resume", world=16, seed=1)],
        # two "nodes" (local rank 0 builds) on one directory, and locks that raise ENOLCK; one
        # of the two builders is killed, then both nodes build again
        [new_job("enolck-kill", world=16, nodes=2, scope="node", lock="enolck",
                 seed=2, kill_ranks=[8], kill_at=rng.randint(1, 8))],
        [new_job("enolck", world=16, nodes=2, scope="node", lock="enolck", seed=2)],
        # node-local locks: both nodes' builders "hold" the lock at once
        [new_job("node-local", world=16, nodes=2, scope="node", lock="node_local", seed=3)],
        # two jobs of 8 ranks build the same entries at the same time
        [new_job(f"two-jobs-{j}", world=8, seed=4, job=j) for j in range(2)],
    ]  # fmt: skip
    try:
        for jobs in rounds:
            # what was committed before the round is neither removed nor rewritten by it
            committed_before = committed_files(cache)
            running = [(job, start_ranks(job)) for job in jobs]
            for job, processes in running:
                outcomes = finish_ranks(job, processes)
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
            committed = committed_files(cache)
            changed = [
                name for name, record in committed_before.items() if committed.get(name) != record
            ]
            assert not changed, f"{[job['out'] for job in jobs]}: committed files changed"
    finally:
        Path(stop).touch()
        watcher.join(30)
    watched = json.loads(Path(report).read_text())
    assert watched["seen"], "the watcher saw no committed file"
    assert watched["removed"] == [], "committed files disappeared"
    assert not [name for name in os.listdir(cache) if name.endswith(".lock")]
    # every completed job agrees with a single-process build of its own
    for seed, digests in completed.items():
        reference = samples_digest(
            build_datasets(shards, str(tmp_path / f"reference{seed}"), seed, "global")
        )
        assert digests == {reference}, f"seed {seed}"
