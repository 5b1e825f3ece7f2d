"""``tokenmill build-cache CONFIG --sizes TRAIN VALID TEST [--check]``: index caches, offline.

Builds every index array a training run needs (GPTDataset, BlendedDataset, PackedDataset plans
when the config has ``packing``) into the config's ``path_to_cache``, on one CPU machine and
without torch.distributed. The files are exactly those the trainer's
``BlendedMegatronDatasetBuilder(...).build()`` would write, so its launch is a cache hit on every
rank. Entries already present and valid are not rewritten.

``--check`` writes nothing: it verifies every entry (files present and readable, dtypes and
shapes, descriptions) and the data fingerprints recorded by the build, prints each problem and
exits 1 if there is any.

The config file (YAML, TOML or JSON) uses GPTDatasetConfig's field names; see
``tokenmill.runs.config_file``. Sizes are sample counts or ``none``.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenmill.cli._errors import one_line

EPILOG = """\
examples:
  tokenmill build-cache run.yaml --sizes 1000000 10000 1000
  tokenmill build-cache run.yaml --sizes 1000000 10000 1000 --check
  tokenmill build-cache run.toml --json          # sizes from the file, report as JSON
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "build-cache",
        help="build (or --check) every index cache a training run needs, offline",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="dataset config (.yaml, .yml, .toml or .json)")
    parser.add_argument(
        "--sizes",
        nargs=3,
        metavar=("TRAIN", "VALID", "TEST"),
        help="samples per split (an integer or 'none'); default: the config's 'sizes'",
    )
    parser.add_argument("--check", action="store_true", help="verify only; exit 1 on problems")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar or lines")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tokenmill.errors import TokenmillError
    from tokenmill.runs.cache_build import build_cache, check_cache
    from tokenmill.runs.config_file import load_run_config, parse_sizes

    try:
        run_config = load_run_config(args.config)
        sizes = parse_sizes(args.sizes, "--sizes") if args.sizes is not None else None
        if args.check:
            report = check_cache(run_config, sizes)
        else:
            report = build_cache(run_config, sizes, progress=not args.quiet)
    except (OSError, ValueError, TokenmillError) as error:
        print(f"tokenmill build-cache: error: {one_line(error)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    elif args.check:
        if report.problems:
            print(f"{len(report.problems)} problem(s) in {report.cache_dir}:")
            for problem in report.problems:
                print(f"  - {problem}")
        else:
            print(f"cache OK: {len(report.entries)} entries in {report.cache_dir}")
    else:
        print(report.summary())
    return 1 if report.problems else 0
