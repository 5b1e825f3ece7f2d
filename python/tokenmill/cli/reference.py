"""The CLI reference page (docs/cli.md), rendered from the argparse parsers themselves.

The page is generated rather than written so that it cannot drift from the flags: a test
(tests/test_docs.py) renders it again and compares. Regenerate with
``python -m tokenmill.cli.reference > docs/cli.md``.
"""

from __future__ import annotations

import argparse
import os

from tokenmill.cli.main import build_parser

# argparse wraps help to the terminal width; a fixed width makes the page reproducible.
_HELP_WIDTH = "100"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse has no public accessor for subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    """Return docs/cli.md: the top-level help, then each command's full help."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _HELP_WIDTH
    try:
        parser = build_parser()
        parts = [
            "# CLI reference\n",
            "Generated from the parsers by `python -m tokenmill.cli.reference > docs/cli.md`;",
            "a test keeps this page equal to the installed `tokenmill --help`.\n",
            "```text",
            parser.format_help().rstrip(),
            "```\n",
        ]
        for name, sub in sorted(_subcommands(parser).items()):
            parts += [f"## `tokenmill {name}`\n", "```text", sub.format_help().rstrip(), "```\n"]
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
