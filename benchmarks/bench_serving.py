"""Sample-serving throughput: tokenmill vs megatron-core on the same data, in one process run.

Usage: python benchmarks/bench_serving.py [PATH_PREFIX] [--seq-length N ...] [--markdown]

Same harness as ``tokenmill bench`` (see ``tokenmill.cli.bench`` for what each row measures);
fixed seeds; generates a random ~300 MB uint16 corpus when no prefix is given. Results and the
machine are recorded in benchmarks/SERVING.md.
"""

from __future__ import annotations

import argparse
import sys

from tokenmill.cli.bench import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    from evidence import recorded

    with recorded("serving"):
        status = main()
    sys.exit(status)
