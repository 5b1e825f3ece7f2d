"""CI smoke run of the fuzz harnesses (tests/fuzz/harnesses.py) without atheris.

Each harness replays its seed corpus plus a few hundred deterministic random mutations (bit
flips, interesting integers, truncation, splices, inserted bytes). A harness swallows only the
exception types its parser documents, so any other exception fails the test. The long
coverage-guided runs (>= 10^6 executions each, under atheris) are documented in
docs/reliability.md; the inputs they found are replayed here too (REGRESSIONS).
"""

from __future__ import annotations

import base64
import random
import struct
from pathlib import Path

import pytest

from fuzz import harnesses

pytestmark = pytest.mark.filterwarnings("ignore::tokenmill.errors.PerformanceWarning")

MUTATIONS = 400
SLOW_HARNESS_MUTATIONS = {"cache_entry": 60}  # builds samples through torch: ~5 ms per input
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
