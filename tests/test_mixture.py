"""Mixtures: the stream against a token-by-token reference, exact resume under changed topology,
weight changes against the ledger, exhaustion (halt and drop), configs and their errors."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenmill import World
from tokenmill.datasets.mixture import Mixture
from tokenmill.datasets.mixture_config import MixtureConfig, MixtureConfigError
from tokenmill.index.mixture_plan import SourceExhaustedError

from conftest import write_megatron_shard
from reference import mixture_stream_reference, source_stream_reference

torch = pytest.importorskip("torch")
from tokenmill.loading.mixture import MixtureDataset, MixtureLoader

SOURCE_BASE = 1_000_000  # token value = source * SOURCE_BASE + its ordinal in the source's files


def source_documents(rng: np.random.Generator, source: int, count: int, longest: int = 30):
    documents, next_token = [], source * SOURCE_BASE
    for _ in range(count):
        length = int(rng.integers(1, longest + 1))
        documents.append(list(range(next_token, next_token + length)))
        next_token += length
    return documents


def write_sources(
    root: Path, counts: Sequence[int], seed: int = 0, longest: int = 30
) -> tuple[list[str], list[list[list[int]]]]:
    """One int32 Megatron shard per source; returns (prefixes, documents per source)."""
    rng = np.random.default_rng(seed)
    prefixes, documents = [], []
    for source, count in enumerate(counts):
        docs = source_documents(rng, source, count, longest)
        prefixes.append(write_megatron_shard(root / f"s{source}", docs, np.int32))
        documents.append(docs)
    return prefixes, documents


def config_dict(
    prefixes: Sequence[str],
    phases: Sequence[tuple[int, Sequence[float]]],
    *,
    seed: int = 7,
    chunk_tokens: int = 16,
    exhaustion: str = "halt",
    epochs: Sequence[int] | None = None,
) -> dict[str, Any]:
    names = [f"s{i}" for i in range(len(prefixes))]
    return {
        "seed": seed,
        "chunk_tokens": chunk_tokens,
        "exhaustion": exhaustion,
        "sources": {
            name: {"paths": [prefix], "epochs": 1 if epochs is None else epochs[i]}
            for i, (name, prefix) in enumerate(zip(names, prefixes))
        },
        "phases": [
            {"name": f"p{i}", "tokens": tokens, "weights": dict(zip(names, weights))}
            for i, (tokens, weights) in enumerate(phases)
        ],
    }


def streams_of(documents: Sequence[Sequence[Sequence[int]]], seed: int, epochs=None):
    return [
        source_stream_reference(docs, seed, f"s{i}", 1 if epochs is None else epochs[i])
        for i, docs in enumerate(documents)
    ]


def run_loader(
    mixture: Mixture,
    world_size: int,
    batch: int,
    length: int,
    steps: int | None,
    state: dict[str, Any] | None = None,
    num_workers: int = 0,
) -> tuple[list[int], dict[str, Any]]:
    """The global stream read by all ranks of a (simulated) world for `steps` steps, and the state."""
    per_rank: list[list[np.ndarray]] = []
    states = []
    for rank in range(world_size):
        loader = MixtureLoader(
            mixture,
            length,
            batch,
            num_workers=num_workers,
            world=World(rank=rank, world_size=world_size),
        )
        if state is not None:
            loader.load_state_dict(state)
        batches = []
        for number, item in enumerate(loader):
            assert item["tokens"].shape == (batch // world_size, length)
            assert torch.equal(item["source_ids"].long(), item["tokens"] // SOURCE_BASE)
            batches.append(item["tokens"].numpy())
            if steps is not None and number + 1 == steps:
                break
        per_rank.append(batches)
        states.append(loader.state_dict())
    assert all(s["mixture"] == states[0]["mixture"] for s in states), "ranks disagree"
    stream: list[int] = []
    for step in range(len(per_rank[0])):
        for rank in range(world_size):
            stream.extend(per_rank[rank][step].reshape(-1).tolist())
    return stream, states[0]


def per_source(tokens: Sequence[int], sources: int) -> list[list[int]]:
    result: list[list[int]] = [[] for _ in range(sources)]
    for token in tokens:
        result[token // SOURCE_BASE].append(token)
    return result


# ---- the stream ------------------------------------------------------------------------------


WEIGHT_ROWS = st.lists(
    st.lists(st.sampled_from([0.0, 0.2, 1.0, 2.5]), min_size=3, max_size=3).filter(
        lambda w: sum(w) > 0
    ),
    min_size=3,
    max_size=3,
)


@settings(max_examples=60)
@example(  # a source that runs dry exactly at a chunk's end must leave later draws (drop)
    seed=25251,
    chunk=27,
    weights=[[0.2, 0.2, 0.0], [0.0, 0.2, 0.2], [0.0, 0.0, 0.2]],
    new_weights=[[0.0, 0.0, 0.2], [0.0, 0.0, 0.2], [0.0, 0.0, 0.2]],
    budgets=[216, 28, 1],
    steps=[1, 1, 48, 97, 97],
    switch=5,
    exhaustion="drop",
)
@given(
    seed=st.integers(0, 2**64 - 1),
    chunk=st.integers(1, 40),
    weights=WEIGHT_ROWS,
    new_weights=WEIGHT_ROWS,
    budgets=st.lists(st.integers(1, 300), min_size=3, max_size=3),
    steps=st.lists(st.integers(1, 97), min_size=1, max_size=30),
    switch=st.integers(0, 30),
    exhaustion=st.sampled_from(["halt", "drop"]),
)
def test_cursor_matches_token_by_token_reference(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    chunk: int,
    weights: list[list[float]],
    new_weights: list[list[float]],
    budgets: list[int],
    steps: list[int],
    switch: int,
    exhaustion: str,
) -> None:
    """The stream, step by step, equals the reference; at step `switch` the run resumes from its
    state under new weights (a new segment, every source continuing from its ledger)."""
    root = tmp_path_factory.mktemp("cursor")
    prefixes, documents = write_sources(root, [10, 25, 4], seed=seed % 1000)
    phases = list(zip(budgets, weights))
    mixture = Mixture(
        config_dict(prefixes, phases, seed=seed, chunk_tokens=chunk, exhaustion=exhaustion)
    )
    streams = streams_of(documents, seed)
    cursor = mixture.cursor()
    for number, step in enumerate(steps):
        if number == switch:
            state = mixture.state_of(cursor)
            phases = list(zip(budgets, new_weights))
            mixture = Mixture(
                config_dict(prefixes, phases, seed=seed, chunk_tokens=chunk, exhaustion=exhaustion)
            )
            cursor = mixture.cursor(json.loads(json.dumps(state)))
            assert cursor.ledger == list(state["ledger"].values())
            assert cursor.position == state["position"]
            expected_start = state["segment_start"] if weights == new_weights else state["position"]
            assert cursor.segment_start == expected_start
        step = min(step, cursor.remaining)
        before = cursor.position
        try:
            expected, expected_sources, ledger = mixture_stream_reference(
                streams, phases, seed, chunk, exhaustion, step, before, cursor.segment_start,
                cursor.ledger,
            )  # fmt: skip
        except RuntimeError:
            with pytest.raises(SourceExhaustedError):
                cursor.advance(step)
            assert cursor.position == before
            return
        pieces = cursor.advance(step)
        tokens = np.empty(step, dtype=np.int64)
        mixture.read(pieces, tokens)
        assert tokens.tolist() == expected
        assert [p.source for p in pieces for _ in range(p.length)] == expected_sources
        assert cursor.ledger == ledger


def test_sources_follow_their_shuffled_document_order(tmp_path: Path) -> None:
    prefixes, documents = write_sources(tmp_path, [100, 100])
    mixture = Mixture(config_dict(prefixes, [(1200, [1.0, 1.0])]))
    stream, state = run_loader(mixture, 1, 4, 25, None)
    streams = streams_of(documents, 7)
    for source, consumed in enumerate(per_source(stream, 2)):
        assert consumed == streams[source][: len(consumed)]
        assert state["mixture"]["ledger"][f"s{source}"] == len(consumed)
    # the documents really are shuffled, and every ordering is a permutation of the files
    assert streams[0] != sorted(streams[0])
    assert sorted(streams[0]) == [t for d in documents[0] for t in d]


def test_ranks_and_workers_split_the_same_stream(tmp_path: Path) -> None:
    prefixes, documents = write_sources(tmp_path, [60, 60, 60])
    mixture = Mixture(config_dict(prefixes, [(900, [0.5, 0.3, 0.2]), (700, [0.1, 0.1, 0.8])]))
    single, state = run_loader(mixture, 1, 6, 20, None)
    expected, _, _ = mixture_stream_reference(
        streams_of(documents, 7),
        [(900, [0.5, 0.3, 0.2]), (700, [0.1, 0.1, 0.8])],
        7,
        16,
        "halt",
        len(single),
    )
    assert single == expected
    assert state["mixture"]["position"] == len(single) == 1560  # 13 steps of 120 tokens
    split, _ = run_loader(mixture, 3, 6, 20, None)
    assert split == single
    workers, worker_state = run_loader(mixture, 2, 6, 20, None, num_workers=2)
    assert workers == single
    assert worker_state["mixture"] == state["mixture"]


# ---- resume ----------------------------------------------------------------------------------


@settings(max_examples=16)
@given(data=st.data(), exhaustion=st.sampled_from(["halt", "drop"]))
def test_resume_with_changed_topology_equals_an_uninterrupted_run(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject, exhaustion: str
) -> None:
    root = tmp_path_factory.mktemp("resume")
    # under drop, s1 (8 short documents) runs dry mid-run and the others renormalise
    prefixes, _ = write_sources(root, [50, 50, 50] if exhaustion == "halt" else [60, 8, 60])
    phases = [(700, [0.6, 0.3, 0.1]), (600, [0.2, 0.2, 0.6])]
    mixture = Mixture(config_dict(prefixes, phases, exhaustion=exhaustion))
    stream: list[int] = []
    state = None
    for _ in range(data.draw(st.integers(1, 3), label="resumes")):
        world = data.draw(st.sampled_from([1, 2, 3, 4]), label="world")
        batch = world * data.draw(st.integers(1, 3), label="per rank")
        length = data.draw(st.integers(1, 33), label="sequence length")
        steps = data.draw(st.integers(1, 6), label="steps")
        part, state = run_loader(mixture, world, batch, length, steps, state)
        stream.extend(part)
        assert state["mixture"]["position"] == len(stream)
    uninterrupted, _ = run_loader(mixture, 1, 1, len(stream), 1)
    assert stream == uninterrupted
    assert state is not None
    assert state["mixture"]["ledger"] == {
        f"s{s}": len(tokens) for s, tokens in enumerate(per_source(stream, 3))
    }


def test_weight_and_phase_change_at_resume_continue_every_source_from_its_ledger(
    tmp_path: Path,
) -> None:
    prefixes, documents = write_sources(tmp_path, [60, 60, 60])
    first = config_dict(prefixes, [(800, [0.7, 0.3, 0.0]), (800, [0.3, 0.3, 0.4])])
    before, state = run_loader(Mixture(first), 2, 4, 25, 5)  # 500 tokens, mid phase 0
    ledger = state["mixture"]["ledger"]
    assert ledger["s2"] == 0
    changed = config_dict(prefixes, [(600, [0.1, 0.1, 0.8]), (400, [1.0, 0.0, 0.0])])
    mixture = Mixture(changed)
    after, new_state = run_loader(mixture, 3, 6, 10, None, state)
    assert new_state["mixture"]["segment_start"] == 500
    assert new_state["mixture"]["fingerprint"] == mixture.fingerprint()
    streams = streams_of(documents, 7)
    for source, (old, new) in enumerate(zip(per_source(before, 3), per_source(after, 3))):
        # no token of any source repeated or skipped: the new run starts at the ledger
        start = ledger[f"s{source}"]
        assert new == streams[source][start : start + len(new)]
        assert old + new == streams[source][: len(old) + len(new)]
    # the new segment draws with the new weights, chunks counted from the resume position
    expected, _, _ = mixture_stream_reference(
        streams,
        [(600, [0.1, 0.1, 0.8]), (400, [1.0, 0.0, 0.0])],
        7,
        16,
        "halt",
        len(after),
        position=500,
        segment_start=500,
        ledger=[ledger[f"s{s}"] for s in range(3)],
    )
    assert after == expected
    # a second resume under the new mixture continues its segment exactly
    head, mid_state = run_loader(mixture, 1, 2, 15, 3, state)
    tail, _ = run_loader(mixture, 2, 2, 15, None, mid_state)
    assert head + tail == after[: len(head) + len(tail)]


# ---- exhaustion ------------------------------------------------------------------------------


def test_halt_stops_every_rank_at_the_same_step_with_a_consistent_state(tmp_path: Path) -> None:
    prefixes, documents = write_sources(tmp_path, [60, 5, 60])
    config = config_dict(prefixes, [(1500, [0.4, 0.3, 0.3])])
    mixture = Mixture(config)
    inventory = mixture.sources[1].tokens
    delivered, states = [], []
    for rank in range(2):
        loader = MixtureLoader(mixture, 10, 4, world=World(rank=rank, world_size=2))
        batches: list[Any] = []
        with pytest.raises(SourceExhaustedError, match="source 's1' is exhausted"):
            batches.extend(item["tokens"] for item in loader)
        delivered.append(len(batches))
        states.append(loader.state_dict())
    assert delivered[0] == delivered[1] > 0
    # through a DataLoader worker the error keeps its type and carries the consistent state
    loader = MixtureLoader(mixture, 10, 4, num_workers=1, world=World(rank=0, world_size=2))
    with pytest.raises(SourceExhaustedError, match="source 's1' is exhausted") as caught:
        for _ in loader:
            pass
    assert caught.value.state == loader.state_dict()
    assert loader.state_dict()["mixture"] == states[0]["mixture"]
    assert states[0]["mixture"] == states[1]["mixture"]
    consistent = states[0]["mixture"]
    assert consistent["position"] == delivered[0] * 40
    assert consistent["ledger"]["s1"] <= inventory
    # the saved state resumes under the drop policy: s1 gives what it has left, then leaves
    dropped = Mixture({**config, "exhaustion": "drop"})
    resumed, final = run_loader(dropped, 1, 4, 10, None, states[0])
    assert final["mixture"]["segment_start"] == 0  # the policy is not part of the fingerprint
    before, _ = run_loader(mixture, 1, 4, 10, delivered[0])
    streams = streams_of(documents, 7)
    s1 = per_source(before + resumed, 3)[1]
    assert s1 == streams[1] and final["mixture"]["ledger"]["s1"] == inventory
    expected, _, _ = mixture_stream_reference(
        streams,
        [(1500, [0.4, 0.3, 0.3])],
        7,
        16,
        "drop",
        len(resumed),
        position=consistent["position"],
        ledger=[consistent["ledger"][f"s{s}"] for s in range(3)],
    )
    assert resumed == expected


def test_drop_renormalises_the_remaining_sources(tmp_path: Path) -> None:
    prefixes, documents = write_sources(tmp_path, [80, 6, 80])
    phases = [(2000, [0.2, 0.6, 0.2])]
    mixture = Mixture(config_dict(prefixes, phases, exhaustion="drop"))
    stream, _ = run_loader(mixture, 2, 4, 25, None)
    streams = streams_of(documents, 7)
    assert stream == mixture_stream_reference(streams, phases, 7, 16, "drop", len(stream))[0]
    sources = [token // SOURCE_BASE for token in stream]
    last_s1 = max(i for i, s in enumerate(sources) if s == 1)
    assert per_source(stream, 3)[1] == streams[1]  # every s1 token exactly once, in order
    # after s1 left, the other two share its weight: 0.2 : 0.2 renormalised to 1/2 each
    rest = np.bincount(sources[last_s1 + 1 :], minlength=3)
    assert rest[1] == 0 and abs(rest[0] / rest.sum() - 0.5) < 0.12


def test_every_source_of_a_phase_exhausted(tmp_path: Path) -> None:
    prefixes, _ = write_sources(tmp_path, [3, 3])
    mixture = Mixture(config_dict(prefixes, [(5000, [1.0, 1.0])], exhaustion="drop"))
    with pytest.raises(SourceExhaustedError, match="every source of phase 'p0' is exhausted"):
        run_loader(mixture, 1, 2, 50, None)


def test_epochs_reshuffle_and_extend_the_inventory(tmp_path: Path) -> None:
    prefixes, documents = write_sources(tmp_path, [8, 50])
    config = config_dict(prefixes, [(600, [0.3, 0.7])], epochs=[5, 1])
    mixture = Mixture(config)
    assert mixture.sources[0].inventory == 5 * mixture.sources[0].tokens
    stream, _ = run_loader(mixture, 1, 2, 30, None)
    streams = streams_of(documents, 7, epochs=[5, 1])
    consumed = per_source(stream, 2)[0]
    tokens = mixture.sources[0].tokens
    assert len(consumed) > tokens  # into the second epoch
    assert consumed == streams[0][: len(consumed)]
    assert consumed[:tokens] != consumed[tokens : 2 * tokens][: len(consumed[:tokens])]


def test_document_weighting_converts_to_token_weights(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    short = [list(range(i * 2, i * 2 + 2)) for i in range(500)]
    long_docs = source_documents(rng, 1, 100, 30)
    long_docs = [d + [d[-1]] * (20 - len(d)) if len(d) < 20 else d[:20] for d in long_docs]
    a = write_megatron_shard(tmp_path / "a", short, np.int32)
    b = write_megatron_shard(tmp_path / "b", long_docs, np.int32)
    config = config_dict([a, b], [(10_000, [1.0, 1.0])])
    by_tokens = Mixture(config)
    by_documents = Mixture({**config, "weighting": "documents"})
    assert by_tokens.plan.phase_weights == ((1.0, 1.0),)
    assert by_documents.plan.phase_weights == ((2.0, 20.0),)  # weight x mean document length
    assert by_tokens.fingerprint() != by_documents.fingerprint()
    demand = by_documents.report().demand[0]
    assert abs(demand[0] / sum(demand) - 2 / 22) < 0.03


# ---- state checks ----------------------------------------------------------------------------


def test_state_errors(tmp_path: Path) -> None:
    prefixes, _ = write_sources(tmp_path, [20, 20])
    mixture = Mixture(config_dict(prefixes, [(400, [1.0, 1.0])]))
    _, state = run_loader(mixture, 1, 2, 10, 2)
    good = state["mixture"]
    with pytest.raises(ValueError, match="not a mixture state"):
        mixture.cursor({"position": 3})
    with pytest.raises(ValueError, match="version must be 1, got 9"):
        mixture.cursor({**good, "version": 9})
    with pytest.raises(ValueError, match="missing or bad field"):
        mixture.cursor({k: v for k, v in good.items() if k != "ledger"})
    with pytest.raises(ValueError, match="position 401 is beyond this mixture's budget of 400"):
        mixture.cursor({**good, "position": 401})
    with pytest.raises(ValueError, match="source 'web' has consumed 5 tokens but is not in"):
        mixture.cursor({**good, "ledger": {**good["ledger"], "web": 5}})
    with pytest.raises(ValueError, match="ledger of source 's0' is -1"):
        mixture.cursor({**good, "ledger": {**good["ledger"], "s0": -1}})
    with pytest.raises(ValueError, match="segment_start 50 must be in \\[0, 40\\]"):
        mixture.cursor({**good, "segment_start": 50})
    changed = {**good["sources"], "s1": {**good["sources"]["s1"], "tokens": 1}}
    with pytest.raises(ValueError, match="source 's1' changed since the state was saved: tokens"):
        mixture.cursor({**good, "sources": changed})
    loader = MixtureLoader(mixture, 10, 2)
    with pytest.raises(ValueError, match="not a mixture state"):
        loader.load_state_dict({"format": "something else"})
    with pytest.raises(ValueError, match="global_batch_size 3 is not a multiple of the world"):
        next(iter(MixtureLoader(mixture, 10, 3, world=World(rank=0, world_size=2))))
    with pytest.raises(ValueError, match="sequence_length must be >= 1, got 0"):
        MixtureLoader(mixture, 0, 2)
    with pytest.raises(ValueError, match="num_workers must be >= 0, got -1"):
        MixtureLoader(mixture, 1, 2, num_workers=-1)
    crowded = Mixture(config_dict(prefixes, [(400, [1.0, 1.0])]))
    crowded.sources = crowded.sources * 16384  # 32768 references: more than int16 holds
    with pytest.raises(ValueError, match="source_ids are int16: 32768 sources do not fit"):
        MixtureDataset(crowded, 10, 2)
    assert MixtureDataset(crowded, 10, 2, return_source_ids=False).sequence_length == 10
    with pytest.raises(ValueError, match="cannot take 500 tokens at position 0"):
        mixture.cursor().advance(500)


def test_loader_continues_across_iterations_and_ends_at_the_budget(tmp_path: Path) -> None:
    prefixes, _ = write_sources(tmp_path, [30, 30])
    mixture = Mixture(config_dict(prefixes, [(250, [1.0, 1.0])]))
    loader = MixtureLoader(mixture, 10, 3, return_source_ids=False)
    first = next(iter(loader))
    assert set(first) == {"tokens"}
    rest = list(loader)
    assert len(rest) == 7  # 8 steps of 30 tokens fit in 250; the last 10 tokens are never read
    assert loader.position == 240 and sum(loader.ledger.values()) == 240
    assert list(loader) == []


# ---- torchdata's StatefulDataLoader ----------------------------------------------------------


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_inside_torchdata_stateful_dataloader(tmp_path: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    prefixes, _ = write_sources(tmp_path, [100, 100])
    mixture = Mixture(config_dict(prefixes, [(1500, [0.6, 0.4])]))
    uninterrupted, _ = run_loader(mixture, 1, 4, 12, None)

    # both speak the protocol StatefulDataLoader checks for (state_dict / load_state_dict)
    assert isinstance(MixtureLoader(mixture, 12, 4), stateful.Stateful)
    assert isinstance(MixtureDataset(mixture, 12, 4), stateful.Stateful)

    def loader(dataset: MixtureDataset) -> Any:
        return stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=2)

    first = loader(MixtureDataset(mixture, 12, 4))
    head, last_state = [], None
    for number, item in enumerate(first):
        head.extend(item["tokens"].reshape(-1).tolist())
        last_state = item["mixture_state"]
        if number == 4:
            break
    snapshot = first.state_dict()
    second = loader(MixtureDataset(mixture, 12, 4))
    second.load_state_dict(snapshot)
    tail = [t for item in second for t in item["tokens"].reshape(-1).tolist()]
    assert head + tail == uninterrupted
    # the global state a batch carries resumes under any other topology
    assert last_state is not None
    other, _ = run_loader(mixture, 2, 2, 7, None, last_state)
    assert head + other == run_loader(mixture, 1, 1, len(head) + len(other), 1)[0]


# ---- configs ---------------------------------------------------------------------------------


def test_toml_yaml_and_dict_configs_agree(tmp_path: Path) -> None:
    prefixes, _ = write_sources(tmp_path, [5, 5])
    (tmp_path / "mix.toml").write_text(
        "seed = 3\nchunk_tokens = 8\n[sources.s0]\npaths = ['s0']\n[sources]\ns1 = 's1'\n"
        "[[phases]]\nname = 'a'\ntokens = 1_000\nweights = { s0 = 1, s1 = 0.5 }\n"
    )
    yaml = pytest.importorskip("yaml")
    (tmp_path / "mix.yaml").write_text(
        yaml.safe_dump(
            {
                "seed": 3,
                "chunk_tokens": 8,
                "sources": {"s0": {"paths": ["s0"]}, "s1": "s1"},
                "phases": [{"name": "a", "tokens": 1000, "weights": {"s0": 1, "s1": 0.5}}],
            }
        )
    )
    from_toml = MixtureConfig.from_file(tmp_path / "mix.toml")
    from_yaml = MixtureConfig.from_file(tmp_path / "mix.yaml")
    from_dict = MixtureConfig.from_dict(
        {
            "seed": 3,
            "chunk_tokens": 8,
            "sources": {"s0": prefixes[0], "s1": [prefixes[1]]},
            "phases": [{"name": "a", "tokens": 1000, "weights": {"s0": 1, "s1": 0.5}}],
        }
    )
    assert from_toml == from_yaml == from_dict
    assert MixtureConfig.from_dict(from_toml.to_dict()) == from_toml
    assert Mixture(tmp_path / "mix.toml").fingerprint() == Mixture(from_dict).fingerprint()


def _bad(data: dict[str, Any], message: str) -> None:
    with pytest.raises(MixtureConfigError, match=message):
        MixtureConfig.from_dict(data, origin="mix.toml")


def test_config_errors_name_the_field_and_value(tmp_path: Path) -> None:
    base = {"sources": {"web": "w"}, "phases": [{"tokens": 10, "weights": {"web": 1}}]}
    _bad({**base, "colour": 1}, "mix.toml: colour: unknown field")
    _bad({**base, "seed": -1}, "mix.toml: seed must be >= 0, got -1")
    _bad({**base, "seed": 2**64}, "seed must be < 2\\^64")
    _bad({**base, "seed": "x"}, "seed must be an integer, got 'x'")
    _bad({**base, "chunk_tokens": 0}, "chunk_tokens must be >= 1, got 0")
    _bad({**base, "exhaustion": "stop"}, "exhaustion must be one of .*, got 'stop'")
    _bad({**base, "weighting": "bytes"}, "weighting must be one of .*, got 'bytes'")
    _bad({**base, "sources": []}, "sources must be a table of named sources")
    _bad({**base, "sources": {}}, "sources: no sources")
    _bad({**base, "sources": {"web": 3}}, "sources.web must be a path, a list of paths")
    _bad({**base, "sources": {"web": []}}, "sources.web.paths must be a non-empty list")
    _bad({**base, "sources": {"web": {"paths": [3]}}}, "sources.web.paths: not a path: 3")
    _bad({**base, "sources": {"web": {"path": "a", "paths": ["b"]}}}, "not both")
    _bad({**base, "sources": {"web": {"paths": "a", "size": 1}}}, "sources.web.size: unknown")
    _bad(
        {**base, "sources": {"web": {"paths": "a", "epochs": 0}}},
        "sources.web.epochs must be >= 1, got 0",
    )
    _bad(
        {**base, "sources": {"web": {"paths": "a", "bos_token": -2}}},
        "sources.web.bos_token must be >= 0, got -2",
    )
    _bad({**base, "sources": {"web": {"paths": "a", "dtype": 5}}}, "sources.web.dtype must be")
    _bad({**base, "phases": {}}, "phases must be a list of phases")
    _bad({**base, "phases": []}, "phases: no phases")
    _bad({**base, "phases": [3]}, "phases\\[0\\] must be a table, got 3")
    _bad({**base, "phases": [{"weights": {"web": 1}}]}, "phases\\[0\\].tokens is missing")
    _bad({**base, "phases": [{"tokens": 5}]}, "phases\\[0\\].weights is missing")
    _bad(
        {**base, "phases": [{"tokens": 5, "weights": {"web": 1}, "x": 1}]},
        "phases\\[0\\].x: unknown field",
    )
    _bad(
        {**base, "phases": [{"tokens": 0, "weights": {"web": 1}}]},
        "phases.phase0.tokens must be >= 1, got 0",
    )
    _bad({**base, "phases": [{"tokens": 5, "weights": [1]}]}, "weights must be a table")
    _bad(
        {**base, "phases": [{"tokens": 5, "weights": {"web": "a"}}]},
        "phases.phase0.weights.web must be a number, got 'a'",
    )
    _bad(
        {**base, "phases": [{"tokens": 5, "weights": {"web": -1}}]},
        "phases.phase0.weights.web must be finite and >= 0, got -1",
    )
    _bad(
        {**base, "phases": [{"tokens": 5, "weights": {"web": float("inf")}}]},
        "must be finite and >= 0, got inf",
    )
    _bad({**base, "phases": [{"tokens": 5, "weights": {"web": 0}}]}, "needs a weight > 0")
    _bad(
        {**base, "phases": [{"tokens": 5, "weights": {"code": 1}}]},
        "phases.phase0.weights.code: no source named 'code' \\(sources: web\\)",
    )
    (tmp_path / "mix.json").write_text("{}")
    with pytest.raises(MixtureConfigError, match=r"mix.json: a mixture config must end in"):
        MixtureConfig.from_file(tmp_path / "mix.json")
    (tmp_path / "bad.toml").write_text("seed = = 1")
    with pytest.raises(MixtureConfigError, match=r"bad.toml: not valid TOML"):
        MixtureConfig.from_file(tmp_path / "bad.toml")
    (tmp_path / "latin1.toml").write_bytes(b"seed = 1 # caf\xe9\n")
    with pytest.raises(MixtureConfigError, match=r"latin1.toml: not UTF-8 text \(byte 14"):
        MixtureConfig.from_file(tmp_path / "latin1.toml")
    with pytest.raises(FileNotFoundError):
        Mixture({**base, "sources": {"web": str(tmp_path / "nothing")}})
    pytest.importorskip("yaml")
    (tmp_path / "bad.yaml").write_text("seed: [1")
    with pytest.raises(MixtureConfigError, match=r"bad.yaml: not valid YAML"):
        MixtureConfig.from_file(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(MixtureConfigError, match=r"list.yaml: must be a table/mapping, got list"):
        MixtureConfig.from_file(tmp_path / "list.yaml")


def test_sources_in_every_format(tmp_path: Path) -> None:
    from tokenmill.formats.nanogpt import write_nanogpt_shard

    rng = np.random.default_rng(5)
    documents = [[1, *rng.integers(2, 500, int(rng.integers(1, 20))).tolist()] for _ in range(30)]
    flat = [t for d in documents for t in d]
    (tmp_path / "megatron").mkdir()
    write_megatron_shard(tmp_path / "megatron" / "a", documents[:10])
    write_megatron_shard(tmp_path / "megatron" / "b", documents[10:])
    (tmp_path / "nanogpt").mkdir()
    write_nanogpt_shard(str(tmp_path / "nanogpt" / "x.bin"), np.asarray(flat, np.uint16))
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "x.npy", np.asarray(flat, np.uint16))
    mixture = Mixture(
        {
            "sources": {
                "megatron": str(tmp_path / "megatron"),
                "nanogpt": {"paths": str(tmp_path / "nanogpt"), "bos_token": 1},
                "npy": {"path": str(tmp_path / "npy"), "bos_token": 1},
            },
            "phases": [{"tokens": 100, "weights": {"megatron": 1, "nanogpt": 1, "npy": 1}}],
        }
    )
    for source in mixture.sources:
        assert source.documents == 30 and source.tokens == len(flat), source.name
        stream = source.read_array(0, source.tokens)
        assert sorted(stream.tolist()) == sorted(flat)
        assert stream.tolist() == source_stream_reference(documents, 1234, source.name, 1)
    with pytest.raises(IndexError, match="source 'npy': tokens \\[5, "):
        mixture.sources[2].read_array(5, len(flat))


# ---- tokenmill validate ----------------------------------------------------------------------


def write_config(path: Path, prefixes: Sequence[str], phases, exhaustion: str = "halt") -> Path:
    lines = [f'seed = 7\nchunk_tokens = 16\nexhaustion = "{exhaustion}"']
    for i, prefix in enumerate(prefixes):
        lines.append(f"[sources.s{i}]\npaths = [{json.dumps(prefix)}]")
    for i, (tokens, weights) in enumerate(phases):
        table = ", ".join(f"s{s} = {w}" for s, w in enumerate(weights))
        lines.append(f'[[phases]]\nname = "p{i}"\ntokens = {tokens}\nweights = {{ {table} }}')
    path.write_text("\n".join(lines) + "\n")
    return path


def test_validate_catches_a_planted_shortfall(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenmill.cli.main import main

    prefixes, _ = write_sources(tmp_path, [50, 50])
    ok = write_config(tmp_path / "ok.toml", prefixes, [(300, [0.5, 0.5]), (200, [0.9, 0.1])])
    assert main(["validate", str(ok)]) == 0
    out = capsys.readouterr().out
    assert "s0" in out and "shortfall" in out
    mixture = Mixture(ok)
    report = mixture.report()
    stream, _ = run_loader(mixture, 1, 1, 500, 1)
    assert list(report.planned) == [len(t) for t in per_source(stream, 2)]  # exact, not estimated
    # plant a shortfall: source s1 holds far fewer tokens than phase p1 asks of it
    (tmp_path / "small").mkdir()
    small, _ = write_sources(tmp_path / "small", [50, 3], seed=1)
    short = write_config(tmp_path / "short.toml", small, [(300, [0.5, 0.5]), (2000, [0.1, 0.9])])
    assert main(["validate", str(short)]) == 1
    captured = capsys.readouterr()
    assert "error: source 's1' is short by" in captured.err
    assert main(["validate", str(short), "--json"]) == 1
    report_json = json.loads(capsys.readouterr().out)
    assert report_json["ok"] is False and report_json["sources"]["s1"]["shortfall"] > 0
    assert report_json["sources"]["s0"]["shortfall"] == 0
    with pytest.raises(SourceExhaustedError):  # the runtime agrees with the prediction
        run_loader(Mixture(short), 1, 4, 25, None)
    dropped = write_config(
        tmp_path / "drop.toml", small, [(300, [0.5, 0.5]), (2000, [0.1, 0.9])], exhaustion="drop"
    )
    assert main(["validate", str(dropped)]) == 0
    assert "warning: source 's1' is short by" in capsys.readouterr().err


def test_validate_from_a_saved_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.cli.main import main

    prefixes, _ = write_sources(tmp_path, [50, 50])
    config = write_config(tmp_path / "mix.toml", prefixes, [(600, [0.5, 0.5])])
    _, state = run_loader(Mixture(config), 1, 2, 50, 3)
    (tmp_path / "state.json").write_text(json.dumps(state))
    assert main(["validate", str(config), "--state", str(tmp_path / "state.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for name, used in state["mixture"]["ledger"].items():
        assert report["sources"][name]["consumed"] == used
    assert sum(v["planned"] for v in report["sources"].values()) == 600
    (tmp_path / "bad.json").write_text(json.dumps({"format": "nope"}))
    assert main(["validate", str(config), "--state", str(tmp_path / "bad.json")]) == 2
    assert "not a mixture state" in capsys.readouterr().err


def test_validate_plot_and_bad_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.cli.main import main

    prefixes, _ = write_sources(tmp_path, [50, 50, 20])
    config = write_config(
        tmp_path / "mix.toml", prefixes, [(300, [0.5, 0.5, 0]), (2000, [0.2, 0.2, 0.6])]
    )
    plot = tmp_path / "plan.png"
    code = main(["validate", str(config), "--plot", str(plot)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert code == 2 and "needs matplotlib" in capsys.readouterr().err
    else:
        assert code == 1  # s2 is short; the plot is still drawn
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.toml").write_text(
        "[sources]\nweb = 'w'\n[[phases]]\ntokens = -1\nweights = { web = 1 }\n"
    )
    assert main(["validate", str(tmp_path / "bad.toml")]) == 2
    assert "bad.toml: phases.phase0.tokens must be >= 1, got -1" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "missing.toml")]) == 2


def test_sources_from_different_tokenizers_are_refused(tmp_path: Path) -> None:
    from tokenmill.errors import TokenizerMismatchError
    from tokenmill.formats.dataset_sidecar import write_sidecar

    prefixes, _ = write_sources(tmp_path, [5, 5])
    gpt2 = {"kind": "tiktoken", "sha256": "a" * 64, "vocab_size": 50257, "bos_id": None,
            "eod_id": 50256}  # fmt: skip
    write_sidecar(prefixes[0], gpt2)
    write_sidecar(prefixes[1], {**gpt2, "vocab_size": 32000})
    with pytest.raises(TokenizerMismatchError, match="vocab_size"):
        Mixture(config_dict(prefixes, [(10, [1.0, 1.0])]))
    write_sidecar(prefixes[1], gpt2)
    assert Mixture(config_dict(prefixes, [(10, [1.0, 1.0])])).total_tokens == 10
