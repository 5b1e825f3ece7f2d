"""Gloo jobs whose ranks share one index-cache directory (tests/test_cache_ranks.py,
tests/test_two_hosts.py): the job description, the rank's body, starting and finishing a job's
ranks with a hang guard, and the records of committed files that must never change.

A job is a plain dict (it crosses into processes of other pid namespaces as JSON): its world size
and number of nodes, the build scope, how `flock` behaves on its ranks ("flock": the real one,
"enolck": fails, "node_local": succeeds without excluding anyone), which building ranks are
SIGKILLed after how many array writes, the seed, the cache directory (with "node_caches", one
folder per node beneath it: a node-local path_to_cache) and the directory where each rank writes
its outcome.
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

from conftest import TinyTokenizer, random_documents, write_megatron_shard

FORK = multiprocessing.get_context("fork")
HANG = 90.0  # seconds after which a rank that has not finished counts as hung


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_shards(directory: Path) -> list[str]:
    """The three Megatron shards every job blends (prefixes)."""
    rng = np.random.default_rng(11)
    return [
        write_megatron_shard(directory / f"shard{i}", random_documents(rng, 80, 150))
        for i in range(3)
    ]


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


def samples_digest(datasets: list[Any]) -> str:
    """One hash over the tokens of every sample of every split."""
    hasher = hashlib.sha256()
    for dataset in datasets:
        if dataset is None:
            continue
        for index in range(len(dataset)):
            hasher.update(np.asarray(dataset[index]["tokens"]).tobytes())
    return hasher.hexdigest()


def build_datasets(shards: list[str], cache: str, seed: int, scope: str) -> list[Any]:
    """The train/valid/test datasets of the blend (in a process group when one is initialized)."""
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset

    config = _config(shards, cache, seed, scope)
    return BlendedMegatronDatasetBuilder(GPTDataset, [300, 30, 0], lambda: True, config).build()


def make_job(tmp_path: Path, shards: list[str], name: str, **fields: Any) -> dict[str, Any]:
    """A job of 4 ranks on one node (cache <tmp_path>/cache), updated by `fields`."""
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
        "port": free_port(),
    }
    job.update(fields)
    return job


def rank_main(job: dict[str, Any], rank: int) -> None:
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
    cache = job["cache"]
    if job.get("node_caches"):  # a node-local path_to_cache: one folder per "node"
        cache = os.path.join(cache, f"node{rank // (world // nodes)}")
    try:
        datasets = build_datasets(job["shards"], cache, job["seed"], job["scope"])
        outcome = {"ok": True, "digest": samples_digest(datasets)}
    except Exception as error:
        outcome = {"ok": False, "type": type(error).__name__, "message": str(error)}
    Path(job["out"], f"{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # no destroy_process_group: peers may be gone


def start_ranks(job: dict[str, Any]) -> dict[int, Any]:
    """Fork every rank of `job`, each running :func:`rank_main`."""
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    processes = {
        rank: FORK.Process(target=rank_main, args=(job, rank)) for rank in range(job["world"])
    }
    for process in processes.values():
        process.start()
    return processes


def finish_ranks(
    job: dict[str, Any], processes: dict[int, Any]
) -> dict[int, dict[str, Any] | None]:
    """Each rank's outcome (None: killed). Fails on a rank that hangs."""
    deadline = time.monotonic() + HANG
    hung = []
    for rank, process in processes.items():
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            hung.append(rank)
            process.kill()
            process.join()
    assert not hung, f"ranks {hung} hung"
    outcomes: dict[int, dict[str, Any] | None] = {}
    for rank, process in processes.items():
        path = Path(job["out"], f"{rank}.json")
        if process.exitcode == -signal.SIGKILL:
            outcomes[rank] = None
        else:
            assert path.is_file(), f"rank {rank} exited with {process.exitcode} and no outcome"
            outcomes[rank] = json.loads(path.read_text())
    return outcomes


def watch_committed(directory: str, stop: str, report: str) -> None:
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


def committed_files(directory: str | Path) -> dict[str, tuple[int, int, int, str]]:
    """(inode, mtime in ns, size, sha256) of every file of every committed entry of the cache
    `directory`: the entries whose description is in place (the commit point). Between jobs none
    of them may change: a committed entry is neither removed nor rewritten, nor renamed over."""
    names = sorted(os.listdir(directory))
    committed = {
        name[: -len("description.txt")] for name in names if name.endswith("-description.txt")
    }
    records = {}
    for name in names:
        if name.startswith(".") or not any(name.startswith(base) for base in committed):
            continue
        path = os.path.join(directory, name)
        status = os.stat(path)
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        # a data-fingerprint sidecar may be re-dated (fingerprint.reseal: its times only, the
        # same bytes and inode; invariant 5), so its mtime is not part of its record
        resealable = name.endswith("data.tokenmill.json")
        mtime = 0 if resealable else status.st_mtime_ns
        records[name] = (status.st_ino, mtime, status.st_size, digest)
    return records
