"""List the fuzz harnesses whose evidence is older than the code it vouches for.

    python benchmarks/fuzz_freshness.py            # exit 1 when any harness is listed
    python benchmarks/fuzz_freshness.py --root /path/to/checkout

For each harness of `tests/fuzz/targets.py`, the campaign log `docs/fuzz/<harness>.log` names the
commit it ran on (a `# commit: <sha>` line, written by `tests/fuzz/campaign.py`). A harness is
listed when its log is missing, names no commit, names a commit that is not an ancestor of HEAD
(a rebased or squashed history: the evidence cannot be placed), or when a commit after that one
changed one of its target files (`git log <commit>..HEAD -- <targets>`: modified, renamed or
deleted). Uncommitted changes to targets are reported separately (they do not list a harness: a
campaign refuses to run on them). Re-run a listed harness with `tests/fuzz/campaign.py`.
Needs only git and the standard library.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

COMMIT = re.compile(r"^# commit: ([0-9a-f]{7,40})\s*$", re.MULTILINE)
# the logs of 2026-11-27 named the commit in their first line ("..., tokenmill 488da0e (...")
OLD_HEADER_COMMIT = re.compile(r"\A# atheris campaign: [^\n]*?, tokenmill ([0-9a-f]{7,40})\b")


def git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=check
    )


def load_targets(root: Path) -> dict[str, tuple[str, ...]]:
    """TARGETS from tests/fuzz/targets.py, read as a literal (no import of tokenmill)."""
    source = (root / "tests" / "fuzz" / "targets.py").read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            names = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(name, ast.Name) and name.id == "TARGETS" for name in names):
                assert node.value is not None
                targets: dict[str, tuple[str, ...]] = ast.literal_eval(node.value)
                return targets
    raise SystemExit(f"no TARGETS in {root / 'tests/fuzz/targets.py'}")


def stale_harnesses(root: Path) -> dict[str, list[str]]:
    """Harness name -> why its log does not cover its targets' current code (fresh ones absent)."""
    stale: dict[str, list[str]] = {}
    for name, targets in sorted(load_targets(root).items()):
        log = root / "docs" / "fuzz" / f"{name}.log"
        if not log.is_file():
            stale[name] = [f"no campaign log ({log.relative_to(root)})"]
            continue
        text = log.read_text(encoding="utf-8", errors="replace")
        found = COMMIT.search(text) or OLD_HEADER_COMMIT.search(text)
        if found is None:
            stale[name] = [f"{log.relative_to(root)} names no commit ('# commit: <sha>')"]
            continue
        commit = found.group(1)
        if git(root, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode != 0:
            stale[name] = [f"its log's commit {commit[:12]} is not in this repository"]
            continue
        if git(root, "merge-base", "--is-ancestor", commit, "HEAD", check=False).returncode:
            stale[name] = [f"its log's commit {commit[:12]} is not an ancestor of HEAD"]
            continue
        changes = git(
            root, "log", "--format=%x00%h %ad %s", "--date=short", "--name-only",
            f"{commit}..HEAD", "--", *targets,
        ).stdout  # fmt: skip
        if changes.strip():
            stale[name] = [f"targets changed after {commit[:12]}, the commit of its log:"]
            stale[name] += _summarise(changes, set(targets))
    return stale


def _summarise(log_output: str, targets: set[str]) -> list[str]:
    """`git log --name-only` output (each commit after a NUL) as one line per commit: its short
    hash, date and subject, then the target files it changed."""
    lines: list[str] = []
    for block in log_output.split("\0")[1:]:
        header, *files = [row for row in block.splitlines() if row.strip()]
        changed = ", ".join(row for row in files if row in targets)
        lines.append(f"  {header[:90]}{'...' if len(header) > 90 else ''}: {changed}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    root = args.root.resolve()
    stale = stale_harnesses(root)
    for name, reasons in stale.items():
        print(f"{name}: " + "\n".join(reasons))
    targets = sorted({path for paths in load_targets(root).values() for path in paths})
    dirty = git(root, "status", "--porcelain", "--", *targets).stdout.strip()
    if dirty:
        print(f"(uncommitted changes to fuzz targets, not yet counted:\n{dirty})")
    if not stale:
        print("none: every harness's log covers its targets' code at HEAD")
    sys.exit(1 if stale else 0)


if __name__ == "__main__":
    main()
