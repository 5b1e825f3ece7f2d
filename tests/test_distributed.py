"""Real multi-process runs on the gloo backend over 127.0.0.1 (CPU only).

Each rank runs the builder exactly as a Megatron trainer would. The tests check that only the
cache-building ranks ever build an index, that every rank sees identical samples, and that a
rank whose `is_built_on_rank()` is False gets None without hanging the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import TinyTokenizer, random_documents, write_megatron_shard

pytestmark = pytest.mark.distributed

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")


def _digest(dataset: Any) -> str | None:
    if dataset is None:
        return None
    hasher = hashlib.sha256()
    for idx in range(0, len(dataset), max(1, len(dataset) // 40)):
        hasher.update(dataset[idx]["tokens"].numpy().tobytes())
    return hasher.hexdigest()


def _rank_main(
    rank: int,
    world_size: int,
    rendezvous: str,
    shards: list[str],
    cache_root: str,
    scope: str,
    out_dir: str,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    if scope == "node":  # two "nodes" of two ranks, each with its own local cache disk
        os.environ["LOCAL_RANK"] = str(rank % 2)
        cache = os.path.join(cache_root, f"node{rank // 2}")
    else:
        cache = cache_root
    import torch.distributed as dist

    import tokenmill.datasets.blended as blended_module
    import tokenmill.datasets.gpt as gpt_module
    from tokenmill.datasets.builder import BlendedMegatronDatasetBuilder
    from tokenmill.datasets.gpt import GPTDataset, GPTDatasetConfig

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    builds = {"gpt": 0, "blend": 0}
    build_gpt, build_blend = gpt_module.build_gpt_indices, blended_module.build_blending_indices

    def counting_gpt(*args: Any, **kwargs: Any) -> Any:
        builds["gpt"] += 1
        return build_gpt(*args, **kwargs)

    def counting_blend(*args: Any, **kwargs: Any) -> Any:
        builds["blend"] += 1
        return build_blend(*args, **kwargs)

    gpt_module.build_gpt_indices = counting_gpt
    blended_module.build_blending_indices = counting_blend
    config = GPTDatasetConfig(
        random_seed=77,
        sequence_length=32,
        tokenizer=TinyTokenizer(),
        blend=(shards, [0.5, 0.3, 0.2]),
        split="90,5,5",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=cache,
        cache_build_scope=scope,
        num_dataset_builder_threads=2,
    )
    # The last rank plays a pipeline stage that needs no data.
    datasets = BlendedMegatronDatasetBuilder(
        GPTDataset, [400, 40, 20], lambda: rank != world_size - 1, config
    ).build()
    dist.barrier()
    result = {"builds": builds, "digests": [_digest(d) for d in datasets]}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run(tmp_path: Path, world_size: int, scope: str) -> list[dict[str, Any]]:
    rng = np.random.default_rng(11)
    shards = [
        write_megatron_shard(tmp_path / f"shard{i}", random_documents(rng, 120, 150))
        for i in range(3)
    ]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with socket.socket() as probe:  # a free port on the loopback interface
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(
        _rank_main,
        args=(
            world_size,
            f"tcp://127.0.0.1:{port}",
            shards,
            str(tmp_path / "cache"),
            scope,
            str(out_dir),
        ),
        nprocs=world_size,
        join=True,
    )
    return [json.loads((out_dir / f"{rank}.json").read_text()) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_zero_builds_and_every_rank_sees_the_same_samples(
    tmp_path: Path, world_size: int
) -> None:
    results = _run(tmp_path, world_size, "global")
    # 3 datasets x 3 splits of GPT indices and 3 blends, all on rank 0.
    assert results[0]["builds"] == {"gpt": 9, "blend": 3}
    for rank, result in enumerate(results[1:], start=1):
        assert result["builds"] == {"gpt": 0, "blend": 0}, f"rank {rank} built an index"
    last = results[-1]
    assert last["digests"] == [None, None, None]
    for result in results[:-1]:
        assert result["digests"] == results[0]["digests"]
        assert all(digest is not None for digest in result["digests"])


def test_node_scope_builds_once_per_node(tmp_path: Path) -> None:
    results = _run(tmp_path, 4, "node")
    assert [r["builds"]["gpt"] for r in results] == [9, 0, 9, 0]
    assert results[0]["digests"] == results[1]["digests"] == results[2]["digests"]
    for node in ("node0", "node1"):
        assert any((tmp_path / "cache" / node).glob("*-GPTDataset-train-sample_index.npy"))
    node0 = sorted(p.name for p in (tmp_path / "cache" / "node0").iterdir())
    for name in node0:
        ours, theirs = (tmp_path / "cache" / node / name for node in ("node0", "node1"))
        if name.endswith("-data.tokenmill.json"):
            # identical but for the record of each node's own array files (inode, mtime)
            first, second = json.loads(ours.read_text()), json.loads(theirs.read_text())
            assert set(first.pop("arrays")) == set(second.pop("arrays"))
            assert first == second
        else:
            assert ours.read_bytes() == theirs.read_bytes()


def _packing_rank_main(
    rank: int, world_size: int, rendezvous: str, shard: str, cache: str, out_dir: str
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    import tokenmill.datasets.packed as packed_module
    from tokenmill import IndexedDataset
    from tokenmill.datasets.packed import PackedDataset, PackingConfig

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    plans = {"count": 0}
    real_plan = packed_module.plan_packing

    def counting_plan(*args: Any, **kwargs: Any) -> Any:
        plans["count"] += 1
        return real_plan(*args, **kwargs)

    packed_module.plan_packing = counting_plan
    config = PackingConfig(sequence_length=64, path_to_cache=cache, num_threads=1 + rank)
    dataset = PackedDataset(IndexedDataset(shard), config)
    hasher = hashlib.sha256(np.ascontiguousarray(dataset.entries).tobytes())
    hasher.update(np.ascontiguousarray(dataset.row_order).tobytes())
    for idx in range(0, len(dataset), 7):
        hasher.update(dataset[idx]["input_ids"].numpy().tobytes())
    result = {"plans": plans["count"], "digest": hasher.hexdigest()}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_packing_plan_is_built_once_and_identical_on_every_rank(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    shard = write_megatron_shard(tmp_path / "docs", random_documents(rng, 300, 200))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(
        _packing_rank_main,
        args=(3, f"tcp://127.0.0.1:{port}", shard, str(tmp_path / "cache"), str(out_dir)),
        nprocs=3,
        join=True,
    )
    results = [json.loads((out_dir / f"{rank}.json").read_text()) for rank in range(3)]
    assert [r["plans"] for r in results] == [1, 0, 0]
    assert len({r["digest"] for r in results}) == 1
