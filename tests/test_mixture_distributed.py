"""Mixtures on real multi-process gloo runs: stop at random steps, resume with another world size,
number of DataLoader workers, global batch size and sequence length, and compare the tokens with
an uninterrupted run (per source as a multiset and in order, and as one global stream)."""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from test_mixture import SOURCE_BASE, config_dict, per_source, write_sources

pytestmark = pytest.mark.distributed

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")


def _rank_main(
    rank: int,
    world_size: int,
    rendezvous: str,
    config: dict[str, Any],
    leg: dict[str, Any],
    out_dir: str,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    from tokenmill.datasets.mixture import Mixture
    from tokenmill.index.mixture_plan import SourceExhaustedError
    from tokenmill.loading.mixture import MixtureLoader

    if world_size > 1:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    # Processes started by mp.spawn make spawn their default start method; forking the
    # DataLoader workers saves each of them a fresh interpreter and torch import (seconds).
    options = {"multiprocessing_context": "fork"} if leg["num_workers"] else {}
    loader = MixtureLoader(
        Mixture(config),
        leg["sequence_length"],
        leg["global_batch_size"],
        num_workers=leg["num_workers"],
        **options,
    )
    if leg["state"] is not None:
        loader.load_state_dict(leg["state"])
    batches: list[list[int]] = []
    error = None
    try:
        for batch in loader:
            batches.append(batch["tokens"].reshape(-1).tolist())
            if len(batches) == leg["steps"]:
                break
    except SourceExhaustedError as exhausted:
        error = str(exhausted)
    states: list[Any] = [loader.state_dict()] * world_size
    if world_size > 1:
        dist.all_gather_object(states, loader.state_dict())
        dist.destroy_process_group()
    result = {
        "batches": batches,
        "state": loader.state_dict(),
        "error": error,
        "all_states_equal": all(s == states[0] for s in states),
    }
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def _run_leg(tmp_path: Path, config: dict[str, Any], world_size: int, **leg: Any) -> list[Any]:
    out_dir = tmp_path / f"leg{len(list(tmp_path.glob('leg*')))}"
    out_dir.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(
        _rank_main,
        args=(world_size, f"tcp://127.0.0.1:{port}", config, leg, str(out_dir)),
        nprocs=world_size,
        join=True,
    )
    return [json.loads((out_dir / f"{r}.json").read_text()) for r in range(world_size)]


def _global_stream(results: list[Any]) -> list[int]:
    assert len({len(r["batches"]) for r in results}) == 1
    assert all(r["all_states_equal"] for r in results)
    stream: list[int] = []
    for step in range(len(results[0]["batches"])):
        for result in results:  # ranks in order
            stream.extend(result["batches"][step])
    return stream


def _uninterrupted(config: dict[str, Any], tokens: int) -> list[int]:
    from tokenmill.datasets.mixture import Mixture

    mixture = Mixture(config)
    pieces = mixture.cursor().advance(tokens)
    out = np.empty(tokens, dtype=np.int64)
    mixture.read(pieces, out)
    return out.tolist()


@pytest.mark.slow
def test_resume_across_world_size_workers_batch_and_sequence_length(tmp_path: Path) -> None:
    prefixes, _ = write_sources(tmp_path, [120, 120, 120])
    config = config_dict(prefixes, [(1800, [0.5, 0.3, 0.2]), (1600, [0.1, 0.3, 0.6])])
    rng = np.random.default_rng(2024)
    legs = [  # (world size, workers, global batch, sequence length): each stops at a random step
        (2, 1, 4, 16, int(rng.integers(3, 12))),
        (3, 2, 6, 10, int(rng.integers(3, 12))),
        (1, 0, 5, 13, None),  # to the end of the budget, in this process
    ]
    stream: list[int] = []
    state = None
    for world_size, workers, batch, length, steps in legs:
        leg = {
            "num_workers": workers,
            "global_batch_size": batch,
            "sequence_length": length,
            "steps": steps,
            "state": state,
        }
        if world_size == 1:
            out_dir = tmp_path / "single"
            out_dir.mkdir()
            _rank_main(0, 1, "", config, leg, str(out_dir))
            results = [json.loads((out_dir / "0.json").read_text())]
        else:
            results = _run_leg(tmp_path, config, world_size, **leg)
        assert all(r["error"] is None for r in results)
        part = _global_stream(results)
        if steps is not None:
            assert len(part) == steps * batch * length
        stream.extend(part)
        state = results[0]["state"]
        assert state["mixture"]["position"] == len(stream)
    expected = _uninterrupted(config, len(stream))
    assert len(stream) > 3000
    for source, (got, want) in enumerate(zip(per_source(stream, 3), per_source(expected, 3))):
        assert Counter(got) == Counter(want), f"source {source}: different tokens"
        assert got == want, f"source {source}: same tokens in another order"
        assert len(set(got)) == len(got), f"source {source}: a token was read twice"
    assert stream == expected
    assert state is not None
    assert state["mixture"]["ledger"] == {
        f"s{s}": len(tokens) for s, tokens in enumerate(per_source(stream, 3))
    }


def test_halt_is_raised_on_every_rank_at_the_same_step(tmp_path: Path) -> None:
    prefixes, _ = write_sources(tmp_path, [80, 4, 80])
    config = config_dict(prefixes, [(2000, [0.45, 0.1, 0.45])])
    results = _run_leg(
        tmp_path,
        config,
        2,
        num_workers=0,
        global_batch_size=4,
        sequence_length=12,
        steps=None,
        state=None,
    )
    assert all(r["error"] and "source 's1' is exhausted" in r["error"] for r in results)
    stream = _global_stream(results)  # every rank delivered the same steps before halting
    state = results[0]["state"]["mixture"]
    assert state["position"] == len(stream) > 0
    assert all(token // SOURCE_BASE in (0, 1, 2) for token in stream)
    assert stream == _uninterrupted(config, len(stream))
