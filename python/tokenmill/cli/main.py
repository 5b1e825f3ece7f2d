"""Entry point of the ``tokenmill`` console script.

Subcommands register themselves in ``_SUBCOMMANDS``; each module adds its parser and a handler.
Heavy imports happen inside the handlers so ``tokenmill --help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import tokenmill

Handler = Callable[[argparse.Namespace], int]
Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _subcommand_registrars() -> list[Registrar]:
    from tokenmill.cli import (
        bench,
        build_cache,
        convert,
        demo,
        download,
        inspect_cmd,
        publish,
        tokenize_cmd,
        validate,
    )

    return [
        demo.register,
        tokenize_cmd.register,
        convert.register,
        inspect_cmd.register,
        bench.register,
        validate.register,
        build_cache.register,
        publish.register,
        download.register,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="tokenmill: token shards, Megatron-exact indices and fast sample serving "
        "for LLM pre-training.",
    )
    parser.add_argument("--version", action="version", version=f"tokenmill {tokenmill.__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error instead of one line"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in _subcommand_registrars():
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    from tokenmill.cli._errors import install_sigterm, report_error, restore_sigterm

    previous = install_sigterm()
    try:
        return handler(args)
    except (Exception, KeyboardInterrupt) as error:
        if getattr(args, "debug", False):
            raise
        return report_error(str(getattr(args, "command", None) or "tokenmill"), error)
    finally:
        restore_sigterm(previous)


if __name__ == "__main__":
    sys.exit(main())
