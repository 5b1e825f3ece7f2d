"""Writes tests/reports/megatron-lm-data/<version>.md from .ci/megatron-lm-tests' junit files.

Usage: megatron_lm_report.py <scratch> <report-dir> (<version> <installed> <branch> <commit>)...
Exits 1 when a test that passes on stock megatron-core does not pass under tokenmill.
"""

import datetime
import os
import sys
import xml.etree.ElementTree as ElementTree


def outcomes(junit_path: str) -> dict[str, str]:
    """Each test's id -> passed / failed / error / skipped ("collection" when nothing ran)."""
    if not os.path.exists(junit_path):
        return {}
    result = {}
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        result[test_id] = outcome
    return result


def main() -> int:
    scratch, report_dir, *rows = sys.argv[1:]
    os.makedirs(report_dir, exist_ok=True)
    status = 0
    for index in range(0, len(rows), 4):
        version, installed, branch, commit = rows[index : index + 4]
        stock = outcomes(os.path.join(scratch, f"{version}-stock.xml"))
        patched = outcomes(os.path.join(scratch, f"{version}-tokenmill.xml"))
        stock_passed = {test for test, outcome in stock.items() if outcome == "passed"}
        patched_passed = {test for test, outcome in patched.items() if outcome == "passed"}
        lost = sorted(stock_passed - patched_passed)
        gained = sorted(patched_passed - stock_passed)
        status |= bool(lost) or not stock
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        lines = [
            f"# Megatron-LM {branch} tests/unit_tests/data: megatron-core {installed}",
            "",
            f"Written by `.ci/megatron-lm-tests {version}` on {when}: Megatron-LM {branch} at "
            f"{commit}, megatron-core {installed}, Python {sys.version.split()[0]}, one gloo rank "
            "on CPU (`.ci/megatron_lm_conftest.py`).",
            "",
            "| | tests | passed | failed | error | skipped |",
            "|---|---|---|---|---|---|",
        ]
        for label, result in (
            ("stock megatron-core", stock),
            ("tokenmill.patch_megatron()", patched),
        ):
            counts = {name: 0 for name in ("passed", "failed", "error", "skipped")}
            for outcome in result.values():
                counts[outcome] += 1
            lines.append(
                f"| {label} | {len(result)} | {counts['passed']} | {counts['failed']} | "
                f"{counts['error']} | {counts['skipped']} |"
            )
        lines += ["", f"Passing on stock and not under tokenmill: {len(lost)}."]
        lines += [f"- `{test}`: {patched.get(test, 'not run')}" for test in lost]
        not_passing = sorted(test for test, outcome in stock.items() if outcome != "passed")
        lines += ["", f"Not passing on stock ({len(not_passing)}; the same machine, no network):"]
        lines += [
            f"- `{test}`: {stock[test]} (under tokenmill: {patched.get(test, 'not run')})"
            for test in not_passing
        ]
        if gained:
            lines += ["", f"Passing under tokenmill and not on stock: {len(gained)}."]
            lines += [f"- `{test}`" for test in gained]
        with open(os.path.join(report_dir, f"{version}.md"), "w") as report:
            report.write("\n".join(lines) + "\n")
        print(
            f"{version}: stock {len(stock_passed)}/{len(stock)} passed, tokenmill "
            f"{len(patched_passed)}/{len(patched)} passed, {len(lost)} passing on stock only"
        )
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
