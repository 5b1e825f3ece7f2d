"""``tokenmill demo``: an end-to-end run on data made on the spot (filled in below)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("demo", help="run an end-to-end example on embedded data")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    print("tokenmill demo: not yet implemented")
    return 0
