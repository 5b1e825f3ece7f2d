"""mkdocs hooks: markdown that lives beside the code becomes part of the site.

Benchmark reports (`benchmarks/*.md`) and the byte-level format spec
(`python/tokenmill/formats/README.md`) stay next to the scripts and code they describe, so that
they are read and updated there; this hook adds them to the site under `benchmarks/` and
`specs/`, and rewrites the docs' repository-relative links to them (`../benchmarks/X.md`) to the
site pages. The benchmarks' raw results (`benchmarks/results/*.json`) are published the same way,
so a figure's `[raw](...)` link works on GitHub and on the site. Links to other repository files
(scripts, sources) become code spans: the site has no page for them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
# repository file -> site path
EXTERNAL_PAGES = {
    **{f"benchmarks/{p.name}": f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.md")},
    "python/tokenmill/formats/README.md": "specs/formats.md",
    # the raw results the benchmark pages and the docs quote, published beside those pages
    **{
        f"benchmarks/results/{p.name}": f"benchmarks/results/{p.name}"
        for p in (ROOT / "benchmarks" / "results").glob("*.json")
    },
}
_LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|#|mailto:)([^)\s#]+)(#[^)\s]*)?\)")


def on_files(files: Files, config: Any) -> Files:
    for source, site_path in EXTERNAL_PAGES.items():
        files.append(File.generated(config, site_path, abs_src_path=str(ROOT / source)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    page_src = page.file.src_uri
    external_source = {v: k for k, v in EXTERNAL_PAGES.items()}.get(page_src)
    # the directory, in the repository, that the page's relative links start from
    base = (
        (ROOT / external_source).parent
        if external_source
        else ROOT / "docs" / Path(page_src).parent
    )

    def rewrite(match: re.Match[str]) -> str:
        text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        resolved = (base / target).resolve()
        try:
            repo_relative = resolved.relative_to(ROOT).as_posix()
        except ValueError:
            return match.group(0)
        if repo_relative.startswith("docs/"):
            site_target = repo_relative[len("docs/") :]
        elif repo_relative in EXTERNAL_PAGES:
            site_target = EXTERNAL_PAGES[repo_relative]
        else:
            return f"{text} (`{repo_relative}`)"
        page_dir = Path(page_src).parent
        relative = Path(_relpath(site_target, page_dir.as_posix()))
        return f"[{text}]({relative.as_posix()}{anchor})"

    return _LINK.sub(rewrite, markdown)


def _relpath(target: str, start: str) -> str:
    import os.path

    return os.path.relpath(target, start or ".")
