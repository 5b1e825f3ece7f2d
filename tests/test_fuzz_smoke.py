"""CI smoke run of the fuzz harnesses (tests/fuzz/harnesses.py) without atheris.

Each harness replays its seed corpus plus a few hundred deterministic random mutations (bit
flips, interesting integers, truncation, splices, inserted bytes). A harness swallows only the
exception types its parser documents, so any other exception fails the test. The long
coverage-guided runs (atheris; tests/fuzz/campaign.py, logs in docs/fuzz/) are documented in
docs/reliability.md; the inputs they found are replayed here too (REGRESSIONS).
"""

from __future__ import annotations

import base64
import io
import random
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fuzz import harnesses
from fuzz.targets import TARGETS
from tokenmill.errors import CacheError

pytestmark = pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning")

MUTATIONS = 400
# these build samples through torch: ~5 ms per input
SLOW_HARNESS_MUTATIONS = {"cache_entry": 60, "blended_cache": 60}
_INTERESTING = [0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1]
_INTERESTING += [2**63 - 1, 2**63, 2**64 - 1]

# Inputs the atheris campaign found (base64), each fixed; see docs/reliability.md.
REGRESSIONS: dict[str, list[str]] = {
    # numpy.load raised tokenize.TokenError for this header (now DataFormatError)
    "npy_tokens": [
        "ApNOVU1QWQEAdgB7J2Rlc2NyJzogJzx1MicsICdmb3J0cmFuX29yZGVyJzogRmFsc2UsICdzaGFwZSc6ICg1LCks"
        "IH0gICAgICAgICAgICAgICAgICAgICAgICABEzUsKSwgfSAgICAgICAgICAgICAgICAgICADACAgICAgICAKAAAB"
        "AAIAAwAEAA==",
    ],
    # np.diff wrapped around: descending int32 positions looked ascending (now rejected)
    "bos_idx": ["ARUAAAAAAABmfEZCtg=="],
    "cache_entry": [
        # the same numpy header failure, in a cached document_index
        "AZNOVU1QWQEAdgB7J2Rlc2NyJzogJzxpNCcsICdmb3J0cmFuX29yZGVyJzogRmFsc2UsICdzaGFwZSc6ICgzNiwp"
        "LCB9ICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgAHsKICAgICJjbGFz"
        "cyI6ICJHUFREYXRhc2V0IiwKICAgICAgICAgIAoBAAAABgAAICAiZGF0YXNldA==",
    ],
    "packing_plan": [
        # a plan entry longer than its row: the Python row path raised numpy's broadcast
        # ValueError (the C++ gather IndexError); both now raise IndexError naming the entry
        "AJNOVU1QWQEAdgB7J2Rlc2NyJzogJzxpOCcsICdmb3J0cmFuX29yZGVyJzogRmFsc2UsICdzaGFwZSc6ICg0MCwg"
        "NSksIH0gICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAKAwAA"
        "AAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAMAAAAAAAAADgAAAAAAAAAQAAAAAAAAAAIAAAAA"
        "AAAAAAAAAAAAAAANAAAAAAAAAAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAADQAAAAAAAAAOAAAAAAAA"
        "ABAAAAAAAAAAAgAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAF"
        "AAAAAAAAAAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAA"
        "AAAAAAAAAAAAAAAAAAQAAAAAAAAADgAAAAAAAAAQAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        "AAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAACAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        "ABEAAAAAAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAKAAAAAAAAAAAAAAAAAAAAEAAAAAAAAAAA"
        "AAAAAAAAAAAAAAAAAAAABwAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAcAAAAAAAAADgAA"
        "AAAAAAAQAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        "AAAAAQAAAAAAAAAOAAAAAAAAABAAAAAAAAAAAgAAAAAAAAAAAAAAAAAAAAwAAAAAAAAAAAAAAAAAAAAQAAAAAAAA"
        "AAAAAAAAAAAAAAAAAAAAAAAMAAAAAAAAAA4AAAAAAAAAEAAAAAAAAAACAAAAAAAAAAAAAAAAAAAABgAAAAAAAAAA"
        "AAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAAAAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAAAAAA"
        "AAAAAAANAAAAAAAAABwAAAAAAAAACQAAAAAAAAACAAAAAAAAAAAAAAAAAAAAEgAAAAAAAAAAAAAAAAAAAAcAAAAA"
        "AAAAAAAAAAAAAAAAAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAALAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAFAAAAAAAA"
        "AA4AAAAAAAAABQAAAAAAAAACAAAAAAAAAAAAAAAAAAAACAAAAAAAAAAOAAAAAAAAAAsAAAAAAAAAAgAAAAAAAAAA"
        "AAAAAAAAAAAAAAAAAAAADgAAAAAAAAAFAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAAMAAAAAAAAABwAAAAAAAAACwAA"
        "AAAAAAACAAAAAAAAAAAAAAAAAAAABwAAAAAAAAAcAAAAAAAAAAUAAAAAAAAAAgAAAAAAAAAAAAAAAAAAAAEAAAAA"
        "AAAAHAAAAAAAAAAGAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAATAAAAAAAAAAAAAAAAAAAABgAAAAAAAAAAAAAAAAAA"
        "AAAAAAAAAAAABAAAAAAAAAAcAAAAAAAAAAQAAAAAAAAAAgAAAAAAAAAAAAAAAAAAABEAAAAAAAAADgAAAAAAAAAP"
        "AAAAAAAAAAIAAAAAAAAAAAAAAAAAAAAJAAAAAAAAAAAAAAAAAAAADwAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAEAAA"
        "AAAAAAAOAAAAAAAAAA4AAAAAAAAAAgAAAAAAAAAAAAAAAAAAAA4AAAAAAAAAAAAAAAAAAAAIAAAAAAAAAAAAAAAA"
        "AAAAAAAAAAAAAAALAAAAAAAAAAAAAAAAAAAABwAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABgAAAAAAAAAOAAAAAAAA"
        "AAYAAAAAAAAAAgAAAAAAAAAAAAAAAAAAAAoAAAAAAAAADgAAAAAAAAAEAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAAP"
        "AAAAAAAAAA4AAAAAAAAABAAAAAAAAAACAAAAAAAAAAAAAAAAAAAAAwAAAAAAAAAcAAAAAAAAAGQAAAAAAAAAAgAA"
        "AAAAAAAAAAAAAAAAAA==",
        # an inserted-BOS flag with no bos_token_id: the Python row path asserted; it now
        # writes -1 as the C++ gather does, and both give the same row
        "AJNOVU1QWQEAdgB7J2Rlc2NyJzogJzxpOCcsICdmb3J0cmFuX29yZGVyJzogRmFsc2UsICdzaGFwZSc6ICg0MCwg"
        "NSksIH0gICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAKAwAA"
        "AAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAMAAAAAAAAADgAAAAAAAAAQAAAAAAAAAAIAAAAA"
        "AAAAAAAAAAAAAAANAAAAAAAAAAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAADQAAAAAAAAAOAAAAAAAA"
        "ABAAAAAAAAAAAgAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAF"
        "AAAAAAAAAAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAA"
        "AAAAAAAAAAAAAAAAAAQAAAAAAAAADgAAAAAAAAAQAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        "AAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAACAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        "ABEAAAAAAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAKAAAAAAAAAAAAAAAAAAAAEAAAAAAAAAAA"
        "AAAAAAAAAAAAAAAAAAAABwAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAcAAAAAAAAADgAA"
        "AAAAAAAQAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        "AAAAAQAAAAAAAAAOAAAAAAAAABAAAAAAAAAAAgAAAAAAAAAAAAAAAAAAAAwAAAAAAAAAAAAAAAAAAAAQAAAAAAAA"
        "AAAAAAAAAAAAAAAAAAAAAAAMAAAAAAAAAA4AAAAAAAAAEAAAAAAAAAACAAAAAAAAAAAAAAAAAAAABgAAAAAAAAAA"
        "AAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAAAAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAAAAAA"
        "AAAAAAANAAAAAAAAABwAAAAAAAAACQAAAAAAAAACAAAAAAAAAAAAAAAAAAAAEgAAAAAAAAAAAAAAAAAAAAcAAAAA"
        "AAAAAAAAAAAAAAAAAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAALAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAFAAAAAAAA"
        "AA4AAAAAAAAABQAAAAAAAAACAAAAAAAAAAAAAAAAAAAACAAAAAAAAAAOAAAAAAAAAAsAAAAAAAAAAgAAAAAAAAAA"
        "AAAAAAAAAAAAAAAAAAAADgAAAAAAAAAFAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAAMAAAAAAAAABwAAAAAAAAACwAA"
        "AAAAAAACAAAAAAAAAAAAAAAAAAAABwAAAAAAAAAcAAAAAAAAAAUAAAAAAAAAAgAAAAAAAAAAAAAAAAAAAAEAAAAA"
        "AAAAHAAAAAAAAAAGAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAATAAAAAAAAAAAAAAAAAAAABgAAAAAAAAAAAAAAAAAA"
        "AAAAAAAAAAAABAAAAAAAAAAcAAAAAAAAAAQAAAAAAAAAAgAAAAAAAAAAAAAAAAAAABEAAAAAAAAADgAAAAAAAAAP"
        "AAAAAAAAAAIAAAAAAAAAAAAAAAAAAAAJAAAAAAAAAAAAAAAAAAAADwAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAEAAA"
        "AAAAAAAOAAAAAAAAAA4AAAAAAAAAAgAAAAAAAAAAAAAAAAAAAA4AAAAAAAAAAAAAAAAAAAAIAAAAAAAAAAAAAAAA"
        "AAAAAAAAAAAAAAALAAAAAAAAAAAAAAAAAAAABwAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABgAAAAAAAAAOAAAAAAAA"
        "AAYAAAAAAAAAAgAAAAAAAAAAAAAAAAAAAAoAAAAAAAAADgAAAAAAAAAEAAAAAAAAAAIAAAAAAAAAAAAAAAAAAAAP"
        "AAAAAAAAAA4AAAAAAAAABAAAAAAAAAACAAAAAAAAAAAAAAAAAAAAAwAAAAAAAAAcAAAAAAAAAAMAAAAAAAAAAgAA"
        "AAAAAAABAAAAAAAAAA==",
    ],
}


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    """One to four random edits of `data` (libFuzzer's basic mutations, in miniature)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(7)
        if kind == 0 and out:  # flip a bit
            position = rng.randrange(len(out))
            out[position] ^= 1 << rng.randrange(8)
        elif kind == 1 and out:  # set a byte
            out[rng.randrange(len(out))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif kind == 2 and len(out) >= 8:  # overwrite an integer field
            width, signed = rng.choice([(4, "<I"), (8, "<Q")])
            value = rng.choice(_INTERESTING) % (1 << (8 * width))
            position = rng.randrange(len(out) - width + 1)
            struct.pack_into(signed, out, position, value)
        elif kind == 3:  # truncate
            del out[rng.randrange(len(out) + 1) :]
        elif kind == 4:  # insert random bytes
            position = rng.randrange(len(out) + 1)
            out[position:position] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == 5 and pool:  # splice with another seed
            other = rng.choice(pool)
            cut = rng.randrange(len(out) + 1)
            out[cut:] = other[rng.randrange(len(other) + 1) :]
        elif kind == 6 and out:  # duplicate a block
            start = rng.randrange(len(out))
            out[start:start] = out[start : start + rng.randint(1, 64)]
    return bytes(out)


@pytest.fixture(autouse=True)
def workdir(tmp_path: Path) -> None:
    harnesses.set_workdir(tmp_path / "fuzz")


@pytest.mark.parametrize("name", sorted(harnesses.HARNESSES))
def test_harness_smoke(name: str) -> None:
    harness = harnesses.HARNESSES[name]
    pool = harnesses.seeds(name)
    assert pool
    assert all(harness(seed) for seed in pool), "every seed must be accepted"
    rng = random.Random(name)
    rejected = 0
    for _ in range(SLOW_HARNESS_MUTATIONS.get(name, MUTATIONS)):
        rejected += not harness(mutate(rng, rng.choice(pool), pool))
    assert rejected > 0, "the mutations never reached a documented error path"
    harness(b"")  # empty input: accepted or rejected, never an undocumented exception
    for encoded in REGRESSIONS.get(name, []):
        harness(base64.b64decode(encoded))


def test_harness_lets_undocumented_exceptions_escape(monkeypatch: pytest.MonkeyPatch) -> None:
    """A harness is not a blanket except: an unexpected exception type propagates."""

    def broken(path: object, token_count: object = None) -> None:
        raise KeyError("not documented")

    monkeypatch.setattr(harnesses.bos_index, "read_bos_index", broken)
    with pytest.raises(KeyError):
        harnesses.bos_idx(b"\x00abcd")


def test_every_harness_has_seeds_and_documented_types() -> None:
    assert set(harnesses.HARNESSES) <= set(harnesses.ALLOWED)
    for name in harnesses.HARNESSES:
        assert harnesses.ALLOWED[name], name


def _npy(array: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


def _blended_corruptions() -> dict[str, tuple[bytes, str]]:
    """Hand-made corruptions of the blend cache entry: input bytes and the message they get."""
    fixture = harnesses._blended_fixture()
    blend = fixture["blend"]
    ids = np.load(io.BytesIO(fixture["files"]["dataset_index"]))
    samples = np.load(io.BytesIO(fixture["files"]["dataset_sample_index"]))
    assert ids.dtype == np.int16 and samples.dtype == np.int64 and ids.shape == samples.shape
    member = int(ids[3])
    past = samples.copy()
    past[3] = len(blend.datasets[member])  # one past the member's last sample
    cases: dict[str, tuple[bytes, str]] = {}
    for name, value in [("id_too_big", len(blend.datasets)), ("id_negative", -1)]:
        bad = ids.copy()
        bad[5] = value
        cases[name] = (b"\x01" + _npy(bad), r"dataset_index\[5\] = -?\d+ is outside")
    cases["sample_past_member"] = (
        b"\x02" + _npy(past),
        r"dataset_sample_index\[3\] = \d+ is outside",
    )
    negative = samples.copy()
    negative[0] = -1
    cases["sample_negative"] = (b"\x02" + _npy(negative), r"dataset_sample_index\[0\] = -1")
    cases["ids_int32"] = (b"\x01" + _npy(ids.astype(np.int32)), "dtype int32")
    cases["samples_int32"] = (b"\x02" + _npy(samples.astype(np.int32)), "dtype int32")
    cases["ids_short"] = (b"\x01" + _npy(ids[:-1]), "shape")
    truncated = fixture["files"]["dataset_sample_index"]
    cases["samples_truncated"] = (b"\x02" + truncated[: len(truncated) - 8], "truncated")
    cases["ids_header_only"] = (b"\x01" + fixture["files"]["dataset_index"][:40], "truncated")
    cases["description_changed"] = (b"\x00" + fixture["description"][:-2] + b"}}", "description")
    return cases


# corruptions of the entry's structure (dtype, shape, extent, description), which a rank that
# trusts the builders still checks; the ids out of range are value checks
_STRUCTURE_CASES = [
    "ids_int32",
    "samples_int32",
    "ids_short",
    "samples_truncated",
    "ids_header_only",
    "description_changed",
]
_BLENDED_CASES = [
    "id_too_big",
    "id_negative",
    "sample_past_member",
    "sample_negative",
    *_STRUCTURE_CASES,
]


@pytest.mark.parametrize("case", _BLENDED_CASES)
def test_blended_cache_corruptions_raise_cache_error(case: str) -> None:
    """Each corruption of a blend's cache entry is refused by the non-building load with
    CacheError naming the problem (never served, never another exception type)."""
    cases = _blended_corruptions()
    assert sorted(cases) == sorted(_BLENDED_CASES)
    data, message = cases[case]
    with pytest.raises(CacheError, match=message):
        harnesses.load_blended_entry(data)
    assert harnesses.blended_cache(data) is False


@pytest.mark.parametrize("case", _STRUCTURE_CASES)
def test_blended_cache_structure_is_checked_for_a_rank_that_trusts_the_builders(case: str) -> None:
    """A rank that trusts the builders' verdict skips the value checks, not the structure: a
    wrong dtype, length, extent or description is still CacheError."""
    data, message = _blended_corruptions()[case]
    trusting = bytes([data[0] | 0x80]) + data[1:]
    with pytest.raises(CacheError, match=message):
        harnesses.load_blended_entry(trusting)
    assert harnesses.blended_cache(trusting) is False


def test_blended_cache_unchecked_values_are_served_in_bounds_or_refused() -> None:
    """A trusting rank loads out-of-range ids unchecked (the builders checked the entry they
    committed); serving them raises IndexError instead of reading outside a member."""
    cases = _blended_corruptions()
    for case, row in [("id_too_big", 5), ("sample_past_member", 3)]:
        data = cases[case][0]
        trusting = bytes([data[0] | 0x80]) + data[1:]
        arrays = harnesses.load_blended_entry(trusting)
        assert harnesses.blended_cache(trusting) is True
        blend = harnesses._blended_fixture()["blend"]
        blend.dataset_index = arrays["dataset_index"]
        blend.dataset_sample_index = arrays["dataset_sample_index"]
        with pytest.raises(IndexError):
            blend[row]
        with pytest.raises(IndexError):
            blend.get_batch([0, row])


def test_blended_cache_accepts_and_serves_a_different_valid_entry() -> None:
    """A valid entry other than the writer's (every sample id 0) is accepted and served: the
    harness does not reject everything but the writer's bytes, and serves what it loaded."""
    fixture = harnesses._blended_fixture()
    samples = np.load(io.BytesIO(fixture["files"]["dataset_sample_index"]))
    data = b"\x02" + _npy(np.zeros_like(samples))
    assert harnesses.blended_cache(data)
    arrays = harnesses.load_blended_entry(data)
    blend = fixture["blend"]
    blend.dataset_index = arrays["dataset_index"]
    blend.dataset_sample_index = arrays["dataset_sample_index"]
    for sample in (0, len(blend) - 1):
        member = blend.datasets[int(arrays["dataset_index"][sample])]
        served, expected = blend[sample], member[0]
        assert all(bool((served[key] == value).all()) for key, value in expected.items())


@pytest.mark.parametrize(
    "path",
    [
        "tokenmill.datasets.gpt.GPTDataset._getitem_python",  # members' Python path
        "tokenmill.serving.server.BatchServer.serve",  # the blend's batched C++ gather
        "tokenmill.index.cache_checks.value_problems",  # the load's value checks
    ],
)
def test_blended_harness_runs_each_path_and_lets_other_errors_escape(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The seeds reach the load's value checks and both sample paths, and an exception type
    the blend does not document escapes the harness (it is not a blanket except)."""
    seed = harnesses.seeds("blended_cache")[1]

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("not documented")

    monkeypatch.setattr(path, broken)
    with pytest.raises(KeyError):
        harnesses.blended_cache(seed)


# -- the campaigns' targets (tests/fuzz/targets.py) and their freshness ----------------------------

ROOT = Path(__file__).resolve().parents[1]


def _binding_sources(function: str) -> set[str]:
    """The binding file that defines `_core.<function>` (or a method of that name) and the
    kernel sources it includes (`#include "../x.hpp"`: x.hpp and x.cpp)."""
    found: set[str] = set()
    for binding in sorted((ROOT / "csrc" / "bindings").glob("*.cpp")):
        text = binding.read_text(encoding="utf-8")
        if re.search(rf'\.?def\(\s*"{re.escape(function)}"', text) is None:
            continue
        found.add(str(binding.relative_to(ROOT)))
        for header in re.findall(r'#include "\.\./([a-z_]+)\.hpp"', text):
            found.add(f"csrc/{header}.hpp")
            if (ROOT / "csrc" / f"{header}.cpp").is_file():
                found.add(f"csrc/{header}.cpp")
    return found


def _code_run_by(name: str) -> set[str]:
    """The tokenmill modules and `_core` sources the harness runs on its seeds (after one empty
    input, which builds its fixture), from the repository root."""
    import sys
    import threading

    import tokenmill

    package = str(Path(tokenmill.__file__).resolve().parent) + "/"
    harness = harnesses.HARNESSES[name]
    harness(b"")
    seeds = harnesses.seeds(name)
    modules: set[str] = set()
    functions: set[str] = set()

    def record(frame: Any, event: str, argument: Any) -> None:
        filename = frame.f_code.co_filename
        if filename.startswith(package):
            modules.add("python/tokenmill/" + filename[len(package) :])
        if event == "c_call":
            owner = getattr(argument, "__self__", None)
            module = getattr(argument, "__module__", None) or type(owner).__module__
            if str(module).startswith("tokenmill._core"):
                functions.add(argument.__name__)

    sys.setprofile(record)
    threading.setprofile(record)
    try:
        for seed in seeds:
            harness(seed)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    sources = set().union(*(_binding_sources(function) for function in functions))
    assert not {f for f in functions if not _binding_sources(f)}, "a _core call not found"
    return modules | sources


def test_targets_name_every_harness_and_existing_files() -> None:
    assert set(TARGETS) == set(harnesses.HARNESSES)
    missing = {path for paths in TARGETS.values() for path in paths if not (ROOT / path).is_file()}
    assert missing == set()


@pytest.mark.parametrize("name", sorted(harnesses.HARNESSES))
def test_targets_cover_the_code_the_harness_runs(name: str) -> None:
    """Every tokenmill module a harness runs on its seeds, and the binding (with the kernel
    sources it includes) of every `_core` function it calls, is one of its targets: a change
    to any of them makes `benchmarks/fuzz_freshness.py` list the harness."""
    assert _code_run_by(name) - set(TARGETS[name]) == set()


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def _freshness(root: Path) -> subprocess.CompletedProcess[str]:
    script = ROOT / "benchmarks" / "fuzz_freshness.py"
    return subprocess.run(
        [sys.executable, str(script), "--root", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_fuzz_freshness_lists_a_harness_whose_target_changed_after_its_log(
    tmp_path: Path,
) -> None:
    """In a scratch repository: a log naming the commit of its target is fresh; a later commit
    to the target lists the harness (naming that commit); a log naming no commit is listed."""
    root = tmp_path / "repo"
    (root / "tests" / "fuzz").mkdir(parents=True)
    (root / "docs" / "fuzz").mkdir(parents=True)
    (root / "src").mkdir()
    (root / "tests" / "fuzz" / "targets.py").write_text(
        'TARGETS: dict[str, tuple[str, ...]] = {"reader": ("src/reader.py",), "other": ("src/o.py",)}\n'
    )
    (root / "src" / "reader.py").write_text("one\n")
    (root / "src" / "o.py").write_text("other\n")
    _git(root, "init", "-q")
    for key, value in (("user.email", "t@example.com"), ("user.name", "t")):
        _git(root, "config", key, value)
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "the reader")
    ran_on = _git(root, "rev-parse", "HEAD")
    (root / "docs" / "fuzz" / "reader.log").write_text(f"# header\n# commit: {ran_on}\nexit=0\n")
    (root / "docs" / "fuzz" / "other.log").write_text("# a log of before commits were named\n")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "the campaign logs")
    listed = _freshness(root)
    assert listed.returncode == 1
    assert "other: docs/fuzz/other.log names no commit" in listed.stdout
    assert "reader" not in listed.stdout
    (root / "docs" / "fuzz" / "other.log").write_text(f"# commit: {ran_on}\n")
    _git(root, "commit", "-q", "-am", "other's log names its commit")
    fresh = _freshness(root)
    assert (fresh.returncode, fresh.stdout.splitlines()[-1][:5]) == (0, "none:"), fresh.stdout
    (root / "src" / "reader.py").write_text("two\n")
    _git(root, "commit", "-q", "-am", "the reader changes")
    changed = _git(root, "rev-parse", "--short", "HEAD")
    listed = _freshness(root)
    assert listed.returncode == 1
    assert listed.stdout.startswith(f"reader: targets changed after {ran_on[:12]}")
    assert f"{changed} " in listed.stdout and "the reader changes" in listed.stdout
    assert "src/reader.py" in listed.stdout and "other" not in listed.stdout
