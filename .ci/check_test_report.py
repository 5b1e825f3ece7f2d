"""Fail a CI test run that proved less than it seems to: read pytest's junit XML and

* fail on any skipped test whose reason is not one of the machine's (.ci/allowed-skips.txt): a
  missing oracle or test dependency must never turn into a green run of skips;
* count the megatron-marked tests that ran (tests/conftest.py tags each with the junit property
  oracle=megatron-core) and fail when fewer than --min-megatron did, or when none ran in one of
  the differential modules (MEGATRON_MODULES). The floor sits below today's count (400 on
  2026-11-28) on purpose: the covering designs' case counts move by a few when a dimension or
  the generator changes, which must not fail CI; losing the oracle (every megatron test then
  fails or skips, and a skip fails here) or a whole module of comparisons still does;
* fail when no test of an oracle's own test module ran (moto, gigatoken, strace).

    python .ci/check_test_report.py junit.xml --allowed .ci/allowed-skips.txt --min-megatron 360
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# an oracle's own test module (junit classname tests.<module>): at least one of its tests ran
ORACLE_MODULES = {
    "moto": "test_s3_storage",
    "gigatoken": "test_gigatoken",
    "strace": "test_syscalls",
}

# the differential modules (junit classname tests.<module>): megatron-marked tests of each ran
MEGATRON_MODULES = (
    "test_gpt_dataset_megatron",
    "test_builder_megatron",
    "test_megatron_configs",
    "test_indexed_dataset_megatron",
    "test_megatron_compat",
    "test_serving",
    "test_blending_kernels",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--allowed", type=Path, required=True)
    parser.add_argument("--min-megatron", type=int, required=True)
    args = parser.parse_args()
    allowed = [
        re.compile(line.strip())
        for line in args.allowed.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    cases = ElementTree.parse(args.junit).getroot().iter("testcase")
    problems: list[str] = []
    megatron_ran = 0
    megatron_in: dict[str, int] = dict.fromkeys(MEGATRON_MODULES, 0)
    ran_in: dict[str, int] = dict.fromkeys(ORACLE_MODULES.values(), 0)
    allowed_skips: list[str] = []
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        skipped = case.find("skipped")
        properties = {(prop.get("name"), prop.get("value")) for prop in case.iter("property")}
        if skipped is not None:
            # a module skipped at collection says "collection skipped"; its text has the reason
            reason = " ".join(filter(None, [skipped.get("message"), skipped.text]))
            if any(pattern.search(reason) for pattern in allowed):
                allowed_skips.append(f"{name}: {reason}")
            else:
                problems.append(f"skipped (not a machine skip): {name}: {reason}")
            continue
        module = (case.get("classname") or "").split(".")
        if ("oracle", "megatron-core") in properties:
            megatron_ran += 1
            for wanted in megatron_in:
                if wanted in module:
                    megatron_in[wanted] += 1
        for wanted in ran_in:
            if wanted in module:
                ran_in[wanted] += 1
    print(f"megatron-marked tests run: {megatron_ran} (at least {args.min_megatron} required)")
    if megatron_ran < args.min_megatron:
        problems.append(f"only {megatron_ran} megatron-marked tests ran")
    for module, count in megatron_in.items():
        print(f"megatron-marked tests of tests/{module}.py run: {count}")
        if count == 0:
            problems.append(f"no megatron-marked test of tests/{module}.py ran")
    for oracle, module in ORACLE_MODULES.items():
        print(f"{oracle}: {ran_in[module]} tests of tests/{module}.py run")
        if ran_in[module] == 0:
            problems.append(f"no test of tests/{module}.py ran ({oracle})")
    for line in allowed_skips:
        print(f"machine skip (allowed): {line}")
    for line in problems:
        print(f"FAIL: {line}", file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
