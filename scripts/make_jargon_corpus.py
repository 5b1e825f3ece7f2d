"""Build ``python/tokenmill/data/jargon.jsonl.gz``, the demo corpus shipped inside the package.

Source: the Jargon File 4.4.7 (public domain, "to be freely used, shared, and modified") from
Debian's ``jargon-text`` package, which installs ``/usr/share/doc/jargon-text/jargon.txt.gz``::

    apt-get update && apt-get install -y jargon-text
    python scripts/make_jargon_corpus.py

One document per lexicon entry (2,307 entries): the lines from an entry's ``   :term: ...``
header to the next header, letter heading or the appendices, dedented by the 3-space margin.
The output is deterministic (sorted keys, gzip mtime 0), so re-running it on the same input
gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

SOURCE = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
OUTPUT = (
    Path(__file__).resolve().parent.parent / "python" / "tokenmill" / "data" / "jargon.jsonl.gz"
)

_ENTRY = re.compile(r"^   :(?P<term>[^:]+(?::[^:\s][^:]*)*):")
_LETTER = re.compile(r"^  [A-Z]$")
_END = re.compile(r"^\s+Part\sIII\.\sAppendices$")  # the spaces are U+00A0


def entries(text: str) -> list[tuple[str, str]]:
    """The (term, body) of every lexicon entry, in file order."""
    found: list[tuple[str, str]] = []
    term: str | None = None
    lines: list[str] = []

    def close() -> None:
        if term is not None:
            body = "\n".join(line[3:] if line.startswith("   ") else line for line in lines)
            found.append((term, body.strip("\n") + "\n"))

    for line in text.splitlines():
        match = _ENTRY.match(line)
        if match or _LETTER.match(line) or _END.match(line):
            close()
            term, lines = None, []
            if _END.match(line):
                break
            if match:
                term = match.group("term")
        if term is not None:
            lines.append(line.rstrip())
    close()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    if not args.source.exists():
        print(
            f"{args.source} not found; install it with: "
            "apt-get update && apt-get install -y jargon-text",
            file=sys.stderr,
        )
        return 1
    text = gzip.decompress(args.source.read_bytes()).decode("utf-8")
    found = entries(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(
        json.dumps({"term": term, "text": body}, ensure_ascii=False, sort_keys=True) + "\n"
        for term, body in found
    ).encode("utf-8")
    temporary = args.output.with_name(args.output.name + ".tmp")
    with (
        open(temporary, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as stream,
    ):
        stream.write(payload)
    temporary.replace(args.output)
    print(
        f"{args.output}: {len(found)} entries, {len(payload):,} bytes of jsonl, "
        f"{args.output.stat().st_size:,} bytes gzipped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
