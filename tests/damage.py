"""Damage generators for the corruption suite (`tests/test_damaged_inputs.py`), and its runner.

A file format is described as a list of :class:`Field` (name, byte offset, size, struct format);
the generators then produce named damaged copies of the file's bytes:

* :func:`truncations`: cut at the start and in the middle of every field (and to 0 bytes);
* :func:`bit_flips`: flip the lowest and highest bit of every field (seeded);
* :func:`boundary_values`: substitute 0, 1, -1, the type's min and max, and the value +- 1 into
  every integer field;
* :func:`text_damage`: for text formats (JSON, YAML, TOML): truncation at every line, byte
  flips, and every number replaced by boundary values or a string;
* swapped files and overlapping/misaligned entries are built by the suite itself, per format.

Run as a script (``python tests/damage.py FORMAT WORKDIR``), it applies every case of one format
in a fresh process and prints a JSON report: the number of cases and every case that was *not*
either a clean error naming the file (and a field) or output identical to the undamaged file's,
plus the process's peak RSS. The suite runs it under a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
import os
import re
import resource
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Field:
    """A field of a binary file: ``size`` bytes at ``offset``, packed as ``fmt`` (or raw)."""

    name: str
    offset: int
    size: int
    fmt: str | None = None


def truncations(data: bytes, fields: Sequence[Field]) -> Iterator[tuple[str, bytes]]:
    """The file cut at the start and the middle of every field, and to nothing."""
    yield "truncated to 0 bytes", b""
    seen = {0}
    for field in fields:
        for cut in (field.offset, field.offset + field.size // 2):
            if cut not in seen and cut < len(data):
                seen.add(cut)
                yield f"truncated at {field.name} (byte {cut})", data[:cut]


def bit_flips(data: bytes, fields: Sequence[Field]) -> Iterator[tuple[str, bytes]]:
    """The lowest bit of the first byte and the highest bit of the last byte of every field."""
    for field in fields:
        for position, bit in ((field.offset, 0), (field.offset + field.size - 1, 7)):
            if position < len(data):
                damaged = bytearray(data)
                damaged[position] ^= 1 << bit
                yield f"bit {bit} of byte {position} flipped ({field.name})", bytes(damaged)


def boundary_values(data: bytes, fields: Sequence[Field]) -> Iterator[tuple[str, bytes]]:
    """Every integer field set to 0, 1, -1, its min and max, and its value +- 1."""
    for field in fields:
        if field.fmt is None:
            continue
        code = field.fmt[-1]
        signed = code.islower()
        bits = struct.calcsize(field.fmt) * 8
        low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        (value,) = struct.unpack_from(field.fmt, data, field.offset)
        for substitute in sorted({0, 1, -1, low, high, value - 1, value + 1}):
            if substitute == value:
                continue
            if not signed and substitute < 0:
                substitute &= (1 << bits) - 1
            if not low <= substitute <= high:
                continue
            damaged = bytearray(data)
            struct.pack_into(field.fmt, damaged, field.offset, substitute)
            yield f"{field.name} = {substitute} (was {value})", bytes(damaged)


def binary_damage(data: bytes, fields: Sequence[Field]) -> Iterator[tuple[str, bytes]]:
    """All three binary generators."""
    yield from truncations(data, fields)
    yield from bit_flips(data, fields)
    yield from boundary_values(data, fields)


_NUMBER = re.compile(rb"(?<![\w.])-?\d+(\.\d+)?(?![\w.])")


def text_damage(text: bytes) -> Iterator[tuple[str, bytes]]:
    """Truncation at every line, a flipped byte per line, every number replaced by boundary
    values and by a string, and an alias bomb / deep nesting appended where they parse."""
    lines = text.splitlines(keepends=True)
    offset = 0
    for number, line in enumerate(lines):
        yield f"truncated before line {number + 1}", text[:offset]
        yield f"truncated inside line {number + 1}", text[: offset + len(line) // 2]
        if line.strip():
            damaged = bytearray(text)
            damaged[offset + len(line) // 2] ^= 0x20
            yield f"byte flipped in line {number + 1}", bytes(damaged)
        offset += len(line)
    for match in _NUMBER.finditer(text):
        for substitute in (b"-1", b"0", b"9223372036854775808", b"1e308", b'"12"', b"1.5"):
            if substitute == match.group(0):
                continue
            damaged = text[: match.start()] + substitute + text[match.end() :]
            yield (
                f"number {match.group(0).decode()} at byte {match.start()} -> {substitute.decode()}",
                damaged,
            )


# -- the runner --------------------------------------------------------------------------------


def _clean() -> tuple[type[BaseException], ...]:
    from tokenmill.errors import TokenmillError

    return (
        ValueError,
        IndexError,
        OverflowError,
        FileNotFoundError,
        TypeError,
        KeyError,
        TokenmillError,
    )


@dataclass
class Outcome:
    cases: int = 0
    errors: int = 0
    identical: int = 0
    undetectable: int = 0
    variants: int = 0

    def __post_init__(self) -> None:
        self.bad: list[str] = []


def judge(
    outcome: Outcome,
    label: str,
    run: Callable[[], Any],
    reference: Any,
    names: Sequence[str],
    fields: Sequence[str] = (),
    same: Callable[[Any, Any], bool] | None = None,
    variant: Callable[[Any], bool] | None = None,
) -> None:
    """Run one damaged case: a clean error naming a file of `names` (and a field of `fields`),
    or a result equal to `reference`; anything else is recorded as bad.

    `variant`, for formats whose every value may legitimately differ (configs, manifests,
    states, plans): an accepted result that `variant` confirms is itself valid (it survives a
    round trip through the validating reader) is a *different valid input*, counted apart.
    """
    outcome.cases += 1
    try:
        result = run()
    except _clean() as error:
        message = str(error)
        if not any(name in message for name in names):
            outcome.bad.append(f"{label}: {type(error).__name__} names no file: {message[:300]}")
        elif fields and not any(field in message for field in fields):
            outcome.bad.append(f"{label}: {type(error).__name__} names no field: {message[:300]}")
        elif "\n" in message.strip() and len(message) > 4000:
            outcome.bad.append(f"{label}: error message of {len(message)} chars")
        else:
            outcome.errors += 1
        return
    except BaseException as error:  # the point: nothing else may escape
        outcome.bad.append(f"{label}: unclean {type(error).__name__}: {str(error)[:300]}")
        return
    equal = same(result, reference) if same is not None else result == reference
    if equal:
        outcome.identical += 1
    elif variant is not None and variant(result):
        outcome.variants += 1
    else:
        outcome.bad.append(f"{label}: served output that differs from the undamaged file's")


def _peak_rss_kib() -> int:
    """This process image's peak RSS: VmHWM (ru_maxrss keeps the forking parent's peak across
    exec on Linux, so a large pytest parent would count)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(argv: Sequence[str]) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import damage_cases

    kind, workdir = argv
    outcome = Outcome()
    damage_cases.CASES[kind](Path(workdir), outcome)
    peak_kib = _peak_rss_kib()
    report = {
        "kind": kind,
        "cases": outcome.cases,
        "errors": outcome.errors,
        "identical": outcome.identical,
        "undetectable": outcome.undetectable,
        "variants": outcome.variants,
        "bad": outcome.bad[:50],
        "bad_count": len(outcome.bad),
        "peak_rss_mib": peak_kib / 1024,
    }
    print(json.dumps(report))
    return 0


def arrays_equal(first: Any, second: Any) -> bool:
    """Deep equality of nested lists/tuples of arrays."""
    if isinstance(first, (list, tuple)):
        return (
            isinstance(second, (list, tuple))
            and len(first) == len(second)
            and all(arrays_equal(a, b) for a, b in zip(first, second))
        )
    return bool(np.array_equal(np.asarray(first), np.asarray(second)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
