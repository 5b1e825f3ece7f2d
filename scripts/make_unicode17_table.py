"""Print ``UNICODE_17_RANGES`` for ``python/tokenmill/tokenize/unicode17.py``.

The table is the code points whose Unicode age is 17.0 (assigned in Unicode 17.0, unassigned
before), as Unicode's ``DerivedAge.txt`` lists them. gigatoken 0.10 classifies characters with
Unicode 17 tables, tiktoken and HF ``tokenizers`` with older ones, so these are the code points
on which their pre-tokenizers can disagree (measured: 4,657 of the 4,803 change GPT-2 ids; the
rest are marks and symbols that every version puts in the same pattern class).

Input, one of:

* ``--derived-age PATH``: Unicode's ``DerivedAge.txt`` (UCD 17.0 or later);
* the ``unicode-age`` package (PyPI, MIT; a compact copy of ``DerivedAge.txt``), used when
  installed: ``pip install unicode-age==18.0.0.0``.

Usage: ``python scripts/make_unicode17_table.py [--derived-age DerivedAge.txt]``; paste the output
over the table in ``unicode17.py`` (the output is deterministic).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_LINE = re.compile(r"^([0-9A-F]{4,6})(?:\.\.([0-9A-F]{4,6}))?\s*;\s*(\d+)\.(\d+)")


def ranges_from_derived_age(path: Path, version: tuple[int, int]) -> list[tuple[int, int]]:
    """The ``[first, last]`` ranges of ``DerivedAge.txt`` whose age is ``version``."""
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _LINE.match(line)
        if match and (int(match.group(3)), int(match.group(4))) == version:
            first = int(match.group(1), 16)
            found.append((first, int(match.group(2) or match.group(1), 16)))
    return found


def ranges_from_unicode_age(version: tuple[int, int]) -> list[tuple[int, int]]:
    """The same ranges from the ``unicode-age`` package."""
    from unicode_age.unicode_age_db import iter_spans

    return [
        (first, last) for first, last, major, minor in iter_spans() if (major, minor) == version
    ]


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with adjacent ones joined."""
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and merged[-1][1] + 1 >= first:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--derived-age", type=Path, help="Unicode's DerivedAge.txt")
    args = parser.parse_args()
    version = (17, 0)
    if args.derived_age:
        ranges = ranges_from_derived_age(args.derived_age, version)
    else:
        try:
            ranges = ranges_from_unicode_age(version)
        except ImportError:
            sys.exit("pass --derived-age DerivedAge.txt or pip install unicode-age==18.0.0.0")
    ranges = merge(ranges)
    count = sum(last - first + 1 for first, last in ranges)
    print(f"# {count:,} code points in {len(ranges)} ranges (scripts/make_unicode17_table.py)")
    print("UNICODE_17_RANGES: tuple[tuple[int, int], ...] = (")
    for first, last in ranges:
        print(f"    (0x{first:04X}, 0x{last:04X}),")
    print(")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
