"""``tokenmill publish PATH... DESTINATION``: upload datasets and caches with a manifest.

Every PATH is a dataset prefix (its ``.bin``, ``.idx`` and ``.tokenmill.json``), a directory (an
index cache, uploaded under its own name) or a file. DESTINATION is ``s3://bucket/prefix``
(credentials and ``AWS_ENDPOINT_URL`` from the standard AWS environment) or a local directory
(e.g. one served over HTTP). Objects already present with the same size and sha256 are skipped,
so an interrupted publish is resumed by running it again; ``manifest.json`` is written last.
"""

from __future__ import annotations

import argparse
import math
import sys

from tokenmill.cli._errors import one_line

EPILOG = """\
examples:
  tokenmill build-cache run.yaml --sizes 1000000 10000 1000
  tokenmill publish data/web_text_document data/code_text_document /shared/index-cache \\
      s3://bucket/runs/r1 --config run.yaml
  tokenmill download s3://bucket/runs/r1/manifest.json /local/data
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "publish",
        help="upload shards, sidecars and index caches to a bucket, with a manifest",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="dataset prefix, directory, file")
    parser.add_argument("destination", help="s3://bucket/prefix or a local directory")
    parser.add_argument("--config", help="the dataset config these objects serve (recorded)")
    parser.add_argument("--workers", type=int, default=4, help="parallel uploads (4)")
    parser.add_argument(
        "--part-size-mib", type=int, default=8, help="multipart part size in MiB (8; S3: >= 5)"
    )
    parser.add_argument(
        "--quiet", "-q", action="store_true", help="no progress bar or per-object lines"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tokenmill.common.progress import Progress
    from tokenmill.errors import TokenmillError
    from tokenmill.storage.publish import publish
    from tokenmill.storage.transfer import TransferPolicy

    # in a log: one '[publish] uploaded|skipped KEY' line per object; on a terminal: a bar
    display = Progress("publish", unit="object", enabled=not args.quiet, log_interval=math.inf)

    def progress(key: str, what: str) -> None:
        display.update()
        display.event(f"{what} {key}")

    try:
        config = None
        if args.config:
            from tokenmill.runs.config_file import read_config_file

            config = {"file": args.config, "fields": read_config_file(args.config)}
        policy = TransferPolicy(workers=args.workers, part_bytes=args.part_size_mib << 20)
        report = publish(
            args.paths, args.destination, config=config, policy=policy, progress=progress
        )
    except (OSError, ValueError, TokenmillError, ImportError) as error:
        display.close(final_line=False)
        print(f"tokenmill publish: error: {one_line(error)}", file=sys.stderr)
        return 2
    display.close(final_line=False)
    print(
        f"published {len(report.manifest.objects)} objects "
        f"({report.manifest.total_bytes:,} bytes): {len(report.uploaded)} uploaded "
        f"({report.bytes_uploaded:,} bytes sent), {len(report.skipped)} already present; "
        f"manifest {report.manifest_location} ({report.seconds:.2f} s)"
    )
    return 0
