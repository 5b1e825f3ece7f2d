"""The README and the documentation site: runnable examples run, links resolve, pages are current.

The python blocks of the docs pages run in the site's navigation order in one fresh directory
and one namespace (a page's examples may use files an earlier page wrote, as a reader following
the site would). A block is skipped only when it is marked: preceded by a
`<!-- not-run: reason -->` line (it needs a cluster, a bucket or a trainer's own objects).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
_BLOCK = re.compile(r"(<!-- not-run: [^>]+ -->\n)?```python\n(.*?)```", re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\((?!https?:|mailto:)([^)\s#]*)(#[^)\s]*)?\)")


def nav_pages() -> list[Path]:
    """docs/*.md in the order of mkdocs.yml's nav (pages of the docs directory only)."""
    nav = re.findall(r":\s+([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    return [DOCS / page for page in nav if (DOCS / page).is_file()]


def python_blocks(path: Path) -> list[tuple[str, bool]]:
    """(code, runnable) for every python block of a page."""
    return [(code, not marker) for marker, code in _BLOCK.findall(path.read_text("utf-8"))]


def test_every_docs_page_is_in_the_nav() -> None:
    pages = {p.relative_to(DOCS).as_posix() for p in nav_pages()}
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk - pages == set()


def test_docs_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TOKENMILL_CACHE_DIR", raising=False)
    namespace: dict[str, object] = {}
    ran = 0
    for page in [README, *nav_pages()]:
        for code, runnable in python_blocks(page):
            if runnable:
                exec(compile(code, str(page), "exec"), namespace)
                ran += 1
    assert ran >= 13  # every runnable block of the pages
    assert (tmp_path / "corpus.idx").exists()


@pytest.mark.parametrize("page", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target, _anchor in _LINK.findall(page.read_text("utf-8")):
        if target and not (page.parent / target).exists():
            broken.append(target)
    assert broken == [], f"{page}: links to missing files {broken}"


def test_readme_is_short_and_keeps_the_two_setup_commands() -> None:
    text = README.read_text("utf-8")
    assert text.count("\n") <= 200
    assert "pip install torch==2.13.0 && pip install . && tokenmill demo" in text
    test_command = (
        "pip install torch==2.13.0 && pip install '.[test]' && pip install --no-deps "
        "--ignore-requires-python megatron-core==0.19.2 && pip install triton && "
        "python -m pytest tests"
    )
    assert test_command in text
    # .ci/run installs the project the way the README says
    ci = (ROOT / ".ci" / "run").read_text()
    for command in (
        "pip install -q torch==2.13.0",
        'pip install -q ".[test]"',
        "megatron-core==0.19.2",
        "pip install -q triton",
    ):
        assert command in ci


def test_cli_reference_is_current() -> None:
    from tokenmill.cli.reference import render

    assert (DOCS / "cli.md").read_text("utf-8") == render(), (
        "docs/cli.md is stale: python -m tokenmill.cli.reference > docs/cli.md"
    )


@pytest.mark.skipif(
    shutil.which("mkdocs") is None and not os.environ.get("TOKENMILL_REQUIRE_DOCS"),
    reason="the docs extra is not installed (pip install '.[docs]'); .ci/run sets TOKENMILL_REQUIRE_DOCS",
)
def test_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "megatron" / "index.html").exists()
    assert (tmp_path / "site" / "benchmarks" / "SERVING" / "index.html").exists()


BENCHMARK_PAGES = sorted((ROOT / "benchmarks").glob("*.md"))
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


def _raw_links(page: Path) -> list[Path]:
    """The benchmarks' raw results a page links to (``.../results/<name>.json``)."""
    return [
        (page.parent / target).resolve()
        for target, _anchor in _LINK.findall(page.read_text("utf-8"))
        if target.endswith(".json") and "results/" in target
    ]


def test_quoted_benchmark_figures_link_their_raw_results() -> None:
    """Every raw result the README, the docs and the benchmark pages link to exists and holds
    what a reader needs to judge a figure: machine, versions, load average, the runs."""
    linked = {
        path
        for page in [README, *DOCS.rglob("*.md"), *BENCHMARK_PAGES]
        for path in _raw_links(page)
    }
    assert len(linked) >= 8
    for path in sorted(linked):
        assert path.is_file(), f"{path} is linked but missing"
        assert path.parent == ROOT / "benchmarks" / "results"
        record = json.loads(path.read_text("utf-8"))
        for key in ("benchmark", "started", "command", "machine", "versions"):
            assert record.get(key), f"{path.name}: no {key}"
        assert record["machine"].get("cpus_usable"), path.name
        assert record["versions"].get("tokenmill") and record["versions"].get("python"), path.name
        for key in ("load_average_before", "load_average_after"):
            assert len(record[key]) == 3, f"{path.name}: {key}"
        # the runs: structured, or every printed line of the run (each run and its tables)
        assert isinstance(record["runs"], list), path.name
        assert record["runs"] or record.get("output") or record.get("summary"), path.name


def test_readme_headline_figures_link_their_raw_results() -> None:
    text = README.read_text("utf-8")
    table = text.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    for row in rows[1:]:
        assert "](benchmarks/results/" in row, f"README headline row without raw results: {row}"


def test_benchmark_plots_exist() -> None:
    """Every plot a page shows exists (scripts/plot_benchmarks.py draws them from the JSON)."""
    shown = []
    for page in [*DOCS.rglob("*.md"), *BENCHMARK_PAGES]:
        for target in _IMAGE.findall(page.read_text("utf-8")):
            path = (page.parent / target).resolve()
            assert path.is_file(), f"{page.name} shows a missing image {target}"
            shown.append(path)
    plots = {p.resolve() for p in (DOCS / "img" / "benchmarks").glob("*.png")}
    assert plots and plots <= set(shown), f"plots no page shows: {sorted(plots - set(shown))}"


def test_benchmark_plots_are_drawn_from_the_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/plot_benchmarks.py still reads every committed result (a benchmark's JSON changing
    shape would leave the committed plots stale)."""
    pytest.importorskip("matplotlib")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plot_benchmarks", ROOT / "scripts" / "plot_benchmarks.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "IMAGES", tmp_path)
    assert module.main([]) == 0
    drawn = {p.name for p in tmp_path.glob("*.png")}
    assert drawn == {p.name for p in (DOCS / "img" / "benchmarks").glob("*.png")}
