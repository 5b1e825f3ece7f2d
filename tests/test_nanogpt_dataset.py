"""NanogptDataset: NeMo's windows, one reading of every window per epoch for any ranks x workers,
exact mid-epoch resume (simulated Worlds and real DataLoader workers), BOS alignment."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tokenmill.common.world import World
from tokenmill.datasets.nanogpt import NanogptDataset
from tokenmill.errors import DataFormatError
from tokenmill.formats.nanogpt import write_nanogpt_shard

BOS = 0
SEQ = 7


def make_shards(directory: Path, sizes: list[int], bos_every: int = 0, seed: int = 0) -> list[str]:
    """uint32 shards of distinct tokens (so a window identifies itself), BOS at random places."""
    rng = np.random.default_rng(seed)
    paths, offset = [], 1
    for i, size in enumerate(sizes):
        tokens = np.arange(offset, offset + size, dtype=np.int64)
        offset += size
        if bos_every:
            tokens[rng.random(size) < 1 / bos_every] = BOS
        path = directory / f"shard_{i:03d}.bin"
        write_nanogpt_shard(path, tokens, np.uint32, bos_token=BOS if i % 2 == 0 else None)
        paths.append(str(path))
    return paths


def key(sample: dict[str, torch.Tensor]) -> tuple[int, ...]:
    assert sample["input_ids"].dtype == torch.int64 and sample["labels"].dtype == torch.int64
    assert torch.equal(sample["input_ids"][1:], sample["labels"][:-1])
    return (*sample["input_ids"].tolist(), int(sample["labels"][-1]))


def nemo_windows(tokens: np.ndarray, start: int, end: int, align: bool) -> list[tuple[int, ...]]:
    """NeMo's _process_file_tokens loop, one token at a time."""
    windows, pos = [], start
    if align:
        while pos < end and tokens[pos] != BOS:
            pos += 1
    while pos + SEQ < end:
        windows.append(tuple(int(t) for t in tokens[pos : pos + SEQ + 1]))
        pos += SEQ + 1
        if align:
            while pos < end and tokens[pos] != BOS:
                pos += 1
    return windows


def expected_windows(paths: list[str], order: list[int], total: int, align: bool) -> list[tuple]:
    """The documented plan, re-derived: whole files when n >= T, else token-range parts."""
    from tokenmill.formats.nanogpt import NanogptShard

    tokens = [NanogptShard(p).tokens for p in paths]
    n = len(order)
    windows: list[tuple[int, ...]] = []
    for g in range(total):
        if n >= total:
            for f in order[g::total]:
                windows += nemo_windows(tokens[f], 0, len(tokens[f]), align)
        else:
            f = order[g % n]
            sharing = len(range(g % n, total, n))
            part, size = g // n, len(tokens[f]) // sharing
            end = len(tokens[f]) if part == sharing - 1 else (part + 1) * size
            windows += nemo_windows(tokens[f], part * size, end, align)
    return windows


def read_all(dataset: NanogptDataset, ranks: int, workers: int) -> list[tuple[int, ...]]:
    out = []
    for rank in range(ranks):
        for worker in range(workers):
            dataset.world = World(rank, ranks, worker, workers)
            out += [key(sample) for sample in dataset]
    return out


@pytest.mark.parametrize("align", [False, True])
def test_single_reader_is_nemo(tmp_path: Path, align: bool) -> None:
    paths = make_shards(tmp_path, [300, 211], bos_every=9)
    dataset = NanogptDataset(paths, SEQ, bos_token=BOS, align_to_bos=align)
    got = [key(s) for s in dataset]
    assert got == expected_windows(paths, [0, 1], 1, align)
    assert len(got) == len(set(got)) > 10


@pytest.mark.parametrize("files", [1, 2, 5])
@pytest.mark.parametrize("align", [False, True])
def test_every_window_once_for_any_world(tmp_path: Path, files: int, align: bool) -> None:
    paths = make_shards(tmp_path, [150 + 37 * i for i in range(files)], bos_every=6)
    for ranks in (1, 2, 3, 4):
        for workers in (1, 2, 3):  # DataLoader num_workers 0 counts as one worker
            dataset = NanogptDataset(
                paths, SEQ, bos_token=BOS, align_to_bos=align, shuffle_files=True, seed=11,
                worker_split="once",
            )  # fmt: skip
            got = read_all(dataset, ranks, workers)
            counts = collections.Counter(got)
            assert max(counts.values()) == 1, (ranks, workers)
            expected = expected_windows(paths, dataset.file_order(0), ranks * workers, align)
            assert sorted(got) == sorted(expected), (ranks, workers)
            if files >= ranks * workers:  # whole files: the same windows whatever the split
                assert sorted(got) == sorted(expected_windows(paths, [0], 1, align) if files == 1
                                             else expected_windows(paths, list(range(files)), 1, align))  # fmt: skip


def test_nemo_split_of_several_files(tmp_path: Path) -> None:
    """NeMo's rule: files g, g+T, ...; a reader left with one file reads only its g-th T-th of
    it; a reader with no file reads every file (tests/test_interop_peers.py runs NeMo itself)."""
    paths = make_shards(tmp_path, [100, 200, 300])
    dataset = NanogptDataset(paths, SEQ)
    spans = {g: [(p.file, p.start, p.end) for p in dataset.parts(0, g, 3)] for g in range(3)}
    assert spans == {0: [(0, 0, 33)], 1: [(1, 66, 132)], 2: [(2, 200, 300)]}
    assert [(p.file, p.start, p.end) for p in dataset.parts(0, 1, 2)] == [(1, 100, 200)]
    assert [(p.file, p.end) for p in dataset.parts(0, 0, 2)] == [(0, 100), (2, 300)]
    assert [(p.file, p.start, p.end) for p in dataset.parts(0, 3, 4)] == [
        (0, 0, 100), (1, 0, 200), (2, 0, 300)]  # fmt: skip
    once = NanogptDataset(paths, SEQ, worker_split="once")
    assert [(p.file, p.start, p.end) for p in once.parts(0, 1, 3)] == [(1, 0, 200)]
    with pytest.raises(ValueError, match="worker_split"):
        NanogptDataset(paths, SEQ, worker_split="each")  # type: ignore[arg-type]


def test_zero_windows_raise_instead_of_yielding_nothing(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.mkdir()
    paths = make_shards(short, [5, 6])
    with pytest.raises(ValueError, match=r"no window of seq_len \+ 1 = 8 tokens .*11 tokens"):
        next(iter(NanogptDataset(paths, SEQ)))
    no_bos = tmp_path / "no_bos"
    no_bos.mkdir()
    paths = make_shards(no_bos, [64, 64])  # tokens 1..128: no BOS (0) anywhere
    with pytest.raises(ValueError, match="starting at BOS token 0"):
        list(NanogptDataset(paths, SEQ, bos_token=BOS, align_to_bos=True))
    (path,) = make_shards(tmp_path, [20])
    # windows of 7 over NeMo's parts [0, 6), [6, 12), [12, 20) of 3 readers: 0, 0, 1
    finite = NanogptDataset(path, 6)
    assert finite.windows_per_reader(3) == [0, 0, 1]
    finite.world = World(0, 1, 0, 3)
    assert list(finite) == []  # an empty reader of a finite epoch, while reader 2 has one
    finite.world = World(0, 1, 2, 3)
    assert len(list(finite)) == 1
    looping = NanogptDataset(path, 6, infinite=True)
    looping.world = World(0, 1, 0, 3)
    with pytest.raises(ValueError, match=r"reader 0 of 3 .* loop without ever yielding"):
        next(iter(looping))


def test_nemo_single_file_split(tmp_path: Path) -> None:
    (path,) = make_shards(tmp_path, [1000])
    dataset = NanogptDataset(path, SEQ)
    # NeMo: tokens_per_worker = total // T, the last worker takes the remainder
    assert dataset.parts(0, 0, 3)[0].start == 0 and dataset.parts(0, 0, 3)[0].end == 333
    assert (dataset.parts(0, 2, 3)[0].start, dataset.parts(0, 2, 3)[0].end) == (666, 1000)


def test_shuffle_is_seeded_identical_on_ranks_and_changes_per_epoch(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, [40] * 12)
    first = NanogptDataset(paths, SEQ, shuffle_files=True, seed=5)
    second = NanogptDataset(paths, SEQ, shuffle_files=True, seed=5)
    assert first.file_order(0) == second.file_order(0) != list(range(12))
    assert first.file_order(1) != first.file_order(0)
    assert NanogptDataset(paths, SEQ, shuffle_files=True, seed=6).file_order(0) != first.file_order(
        0
    )


def test_epoch_ends_unless_infinite(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, [64, 64])
    dataset = NanogptDataset(paths, SEQ, shuffle_files=True)
    one_epoch = [key(s) for s in dataset]
    assert len(one_epoch) == 16
    looping = NanogptDataset(paths, SEQ, shuffle_files=True, infinite=True)
    iterator = iter(looping)
    many = [key(next(iterator)) for _ in range(40)]
    assert sorted(many[:16]) == sorted(many[16:32]) == sorted(one_epoch)
    assert looping.epoch == 2


def resume_case(tmp_path: Path, ranks: int, workers: int, seed: int, align: bool) -> None:
    paths = make_shards(tmp_path, [90, 143, 77], bos_every=5, seed=seed)
    options = {"bos_token": BOS, "align_to_bos": align, "shuffle_files": True, "seed": 3,
               "worker_split": "once"}  # fmt: skip
    full = sorted(read_all(NanogptDataset(paths, SEQ, **options), ranks, workers))
    rng = np.random.default_rng(seed)
    dataset = NanogptDataset(paths, SEQ, **options)
    before, states = [], []
    for rank in range(ranks):
        for worker in range(workers):
            dataset.world = World(rank, ranks, worker, workers)
            iterator = iter(dataset)
            for _ in range(int(rng.integers(0, 12))):
                sample = next(iterator, None)
                if sample is None:
                    break
                before.append(key(sample))
            states.append(dataset.state_dict())
    state = NanogptDataset.merge_states(states)
    resumed = NanogptDataset(paths, SEQ, **options)
    resumed.load_state_dict(state)
    after = read_all(resumed, ranks, workers)
    assert sorted(before + after) == full


@pytest.mark.parametrize("align", [False, True])
def test_resume_mid_epoch_any_world(tmp_path: Path, align: bool) -> None:
    for case, (ranks, workers) in enumerate([(1, 1), (2, 1), (1, 3), (2, 2), (4, 3), (3, 2)]):
        directory = tmp_path / f"c{case}"
        directory.mkdir()
        resume_case(directory, ranks, workers, seed=case, align=align)


def test_resume_with_real_dataloader_workers(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    paths = make_shards(tmp_path, [400, 333, 120])
    options = {"shuffle_files": True, "seed": 1}
    for num_workers, batch_size, steps, drop_last in [(2, 3, 5, False), (2, 4, 7, True), (1, 2, 4, False), (0, 5, 3, False)]:  # fmt: skip
        dataset = NanogptDataset(paths, SEQ, **options)
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                            drop_last=drop_last)  # fmt: skip
        everything = [tuple(row) for b in loader for row in torch.cat([b["input_ids"], b["labels"][:, -1:]], 1).tolist()]  # fmt: skip
        assert len(set(everything)) == len(everything)
        taken, consumed = [], 0
        for step, batch in enumerate(loader):
            if step == steps:
                break
            taken += [tuple(r) for r in torch.cat([batch["input_ids"], batch["labels"][:, -1:]], 1).tolist()]  # fmt: skip
            consumed += batch["input_ids"].shape[0]
        state = dataset.loader_state_dict(consumed, batch_size=batch_size,
                                          num_workers=num_workers, drop_last=drop_last)  # fmt: skip
        resumed = NanogptDataset(paths, SEQ, **options)
        resumed.load_state_dict(state)
        rest = [tuple(r) for b in DataLoader(resumed, batch_size=batch_size, num_workers=num_workers, drop_last=drop_last)
                for r in torch.cat([b["input_ids"], b["labels"][:, -1:]], 1).tolist()]  # fmt: skip
        assert taken == everything[: len(taken)]
        assert sorted(taken + rest) == sorted(everything), (num_workers, batch_size)


def test_state_errors(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, [64, 64])
    dataset = NanogptDataset(paths, SEQ, seed=1)
    with pytest.raises(ValueError, match="seed 1 over 2 files"):
        NanogptDataset(paths, SEQ, seed=2).load_state_dict(dataset.state_dict())
    with pytest.raises(ValueError, match="not a NanogptDataset state"):
        dataset.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="exceeds the samples"):
        dataset.loader_state_dict(10**6, batch_size=2, num_workers=1)


def test_bos_index_and_scan_agree_and_bad_index_is_refused(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, [500], bos_every=7)
    with_index = [key(s) for s in NanogptDataset(paths, SEQ, bos_token=BOS, align_to_bos=True)]
    sidecar = Path(paths[0]).with_suffix(".bos.idx")
    positions = np.fromfile(sidecar, dtype="<i4")
    sidecar.unlink()
    scanned = [key(s) for s in NanogptDataset(paths, SEQ, bos_token=BOS, align_to_bos=True)]
    assert with_index == scanned
    # NeMo's processor stores file.tell() + index (header bytes + 4 bytes per uint32 token):
    # from the reader's point of view, positions shifted off the BOS tokens
    shifted = (1024 + positions * 4) // 8
    sidecar.write_bytes(np.unique(shifted[shifted < 500]).astype("<i4").tobytes())
    with pytest.raises(DataFormatError, match=r"shard_000\.bos\.idx.*not the BOS token"):
        list(NanogptDataset(paths, SEQ, bos_token=BOS, align_to_bos=True))


def test_constructor_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        NanogptDataset(str(tmp_path / "*.bin"), SEQ)
    paths = make_shards(tmp_path, [10])
    with pytest.raises(ValueError, match="bos_token"):
        NanogptDataset(paths, SEQ, align_to_bos=True)
    with pytest.raises(ValueError, match="seq_len"):
        NanogptDataset(paths, 0)
    (tmp_path / "bad.bin").write_bytes(bytes(2000))
    with pytest.raises(DataFormatError, match=r"bad\.bin.*magic"):
        NanogptDataset(str(tmp_path / "*.bin"), SEQ)


def test_world_arithmetic() -> None:
    world = World(rank=2, world_size=3, worker_id=1, num_workers=4)
    assert world.total_workers == 12 and world.global_worker_id == 9
    assert list(world.rank_workers()) == [8, 9, 10, 11]
    assert World.current() == World()  # no process group, no DataLoader worker
    assert World.current(world) == world
    with pytest.raises(ValueError, match="rank must be in"):
        World(rank=3, world_size=3)
    with pytest.raises(ValueError, match="worker_id"):
        World(worker_id=1, num_workers=1)


def test_resume_under_a_different_number_of_readers_is_refused(tmp_path: Path) -> None:
    """Per-reader positions do not carry over to another split of the files: fail loudly."""
    paths = make_shards(tmp_path, [90, 143, 77])
    dataset = NanogptDataset(paths, SEQ, shuffle_files=True, seed=3)
    dataset.world = World(0, 2, 0, 1)
    iterator = iter(dataset)
    next(iterator)
    state = dataset.state_dict()
    assert state["total_workers"] == 2
    resumed = NanogptDataset(paths, SEQ, shuffle_files=True, seed=3)
    resumed.load_state_dict(state)
    resumed.world = World(0, 3, 0, 1)
    with pytest.raises(ValueError, match=r"taken with 2 readers .* now runs with 3"):
        next(iter(resumed))


def test_resume_under_another_worker_split_is_refused(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, [90, 143, 77])
    dataset = NanogptDataset(paths, SEQ, worker_split="once")
    state = dataset.state_dict()
    assert state["worker_split"] == "once"
    with pytest.raises(ValueError, match=r"worker_split='once'.*worker_split='nemo'"):
        NanogptDataset(paths, SEQ).load_state_dict(state)
    legacy = {key: value for key, value in state.items() if key != "worker_split"}
    with pytest.raises(ValueError, match="taken with worker_split='once'"):
        NanogptDataset(paths, SEQ).load_state_dict(legacy)  # older states: the "once" plan
    NanogptDataset(paths, SEQ, worker_split="once").load_state_dict(legacy)
