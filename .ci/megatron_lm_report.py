"""Writes tests/reports/megatron-lm-data/<version>.md from .ci/megatron-lm-tests' junit files.

Usage: megatron_lm_report.py <scratch> <report-dir> (<version> <installed> <branch> <commit>)...
Exits 1 when a test that passes on stock megatron-core does not pass under tokenmill.
"""

import datetime
import json
import os
import sys
import xml.etree.ElementTree as ElementTree


def outcomes(junit_path: str) -> dict[str, tuple[str, str]]:
    """Each test's id -> (passed / failed / error / skipped, the first line of junit's message)."""
    if not os.path.exists(junit_path):
        return {}
    result = {}
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "").strip().split("\n")[0][:160]
        result[test_id] = (outcome, message)
    return result


def main() -> int:
    scratch, report_dir, *rows = sys.argv[1:]
    os.makedirs(report_dir, exist_ok=True)
    status = 0
    for index in range(0, len(rows), 4):
        version, installed, branch, commit = rows[index : index + 4]
        stock = outcomes(os.path.join(scratch, f"{version}-stock.xml"))
        patched = outcomes(os.path.join(scratch, f"{version}-tokenmill.xml"))
        stock_passed = {test for test, (outcome, _) in stock.items() if outcome == "passed"}
        patched_passed = {test for test, (outcome, _) in patched.items() if outcome == "passed"}
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
            for outcome, _ in result.values():
                counts[outcome] += 1
            lines.append(
                f"| {label} | {len(result)} | {counts['passed']} | {counts['failed']} | "
                f"{counts['error']} | {counts['skipped']} |"
            )
        lines += ["", f"Passing on stock and not under tokenmill: {len(lost)}."]
        lines += [
            f"- `{test}`: {' '.join(patched.get(test, ('not run', '')))}".rstrip() for test in lost
        ]
        # failures and errors one by one; skips grouped by test function and reason
        not_passing = sorted(
            test for test, (outcome, _) in stock.items() if outcome in ("failed", "error")
        )
        skipped: dict[tuple[str, str], int] = {}
        for test, (outcome, message) in stock.items():
            if outcome == "skipped":
                group = (test.split("[")[0], message)
                skipped[group] = skipped.get(group, 0) + 1
        lines += [
            "",
            f"Failing on stock ({len(not_passing)}; the same machine: CPU only, no network, no "
            "transformers):",
        ]
        for test in not_passing:
            outcome, message = stock[test]
            under = patched.get(test, ("not run", ""))[0]
            lines.append(f"- `{test}`: {outcome}, {message} (under tokenmill: {under})")
        lines += ["", f"Skipped on stock ({sum(skipped.values())}):"]
        lines += [
            f"- `{function}` ({count}): {message}"
            for (function, message), count in sorted(skipped.items())
        ]
        deselected_path = os.path.join(scratch, f"{version}-stock.deselected.json")
        deselected: dict[str, str] = {}
        if os.path.exists(deselected_path):
            with open(deselected_path) as listing:
                deselected = json.load(listing)
        lines += [
            "",
            f"Deselected in both modes ({len(deselected)}; they cannot pass here on stock either):",
        ]
        lines += [f"- `{test}`: {reason}" for test, reason in sorted(deselected.items())]
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
