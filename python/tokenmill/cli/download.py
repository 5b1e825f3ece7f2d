"""``tokenmill download SOURCE LOCAL_DIR``: fetch a published dataset, verified and resumable.

SOURCE is a manifest written by ``tokenmill publish`` (``s3://.../manifest.json``,
``https://.../manifest.json`` or a local path), or a plain shard list: a local text file with
one ``URL [sha256]`` per line, or URLs given with ``--url`` (nanochat-style). Objects are
fetched in parallel, retried with exponential backoff, written to a hidden ``.partial`` file,
checked against the manifest's size and sha256 and renamed into place. Run it again after a
kill: finished objects are skipped and partial ones continue where they stopped.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading

from tokenmill.cli._errors import one_line

EPILOG = """\
examples:
  tokenmill download s3://bucket/runs/r1/manifest.json /local/data
  tokenmill download https://host/shards/manifest.json /local/data --workers 8
  tokenmill download --url https://host/shard_00000.bin --url https://host/shard_00001.bin data/
  tokenmill download shards.txt data/            # one 'URL [sha256]' per line
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "download",
        help="download a published manifest or an HTTP shard list, verified and resumable",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("arguments", nargs="+", metavar="SOURCE LOCAL_DIR")
    parser.add_argument("--url", action="append", default=[], help="an http(s) shard URL")
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="PREFIX",
        help="also fetch objects under this URL prefix or local directory (a manifest may "
        "otherwise name only objects under its own location)",
    )
    parser.add_argument("--workers", type=int, default=4, help="parallel downloads (4)")
    parser.add_argument("--retries", type=int, default=6, help="attempts per HTTP request (6)")
    parser.add_argument(
        "--part-size-mib", type=int, default=8, help="S3 ranged-read size in MiB (8)"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="total time an HTTP or s3:// object may take over all its requests and attempts, "
        "plus 1 s per MiB of its size; 0: no limit (600)",
    )
    parser.add_argument(
        "--quiet", "-q", action="store_true", help="no progress bar, per-object or summary lines"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tokenmill.common.progress import Progress
    from tokenmill.errors import TokenmillError
    from tokenmill.storage.download import download
    from tokenmill.storage.manifest import Manifest, parse_shard_list
    from tokenmill.storage.transfer import TransferPolicy

    try:
        if args.url:
            if len(args.arguments) != 1:
                raise ValueError("with --url, give only LOCAL_DIR")
            source: str | Manifest = parse_shard_list(args.url, "--url")
            local_dir = args.arguments[0]
        else:
            if len(args.arguments) != 2:
                raise ValueError("expected SOURCE LOCAL_DIR")
            source, local_dir = args.arguments
        policy = TransferPolicy(
            workers=args.workers,
            max_attempts=args.retries,
            part_bytes=args.part_size_mib << 20,
            deadline=args.deadline or None,
        )
        # in a log: one '[download] N fetched|present KEY' line per object; on a terminal: a bar
        display = Progress("download", unit="object", enabled=not args.quiet, log_interval=math.inf)
        counted = threading.Lock()  # called from the download threads

        def progress(key: str, what: str) -> None:
            with counted:
                display.update()
                display.event(f"{int(display.count)} {what} {key}")

        try:
            report = download(source, local_dir, policy=policy, progress=progress, allow=args.allow)
        finally:
            display.close(final_line=False)
    except (OSError, ValueError, TokenmillError, ImportError) as error:
        print(f"tokenmill download: error: {one_line(error)}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(
            f"downloaded {len(report.fetched)} objects ({report.bytes_fetched:,} bytes), "
            f"{len(report.skipped)} already present, into {report.local_dir} "
            f"({report.seconds:.2f} s)"
        )
        if report.unverified:
            print(
                f"warning: {len(report.unverified)} objects had no sha256 to verify: "
                + ", ".join(report.unverified),
                file=sys.stderr,
            )
    return 0
