"""``tokenmill inspect PATH``: what a token source holds, and whether it is intact.

Reports the format and version, dtype, token and document counts, BOS/EOS counts, document-length
percentiles and the first tokens, and runs the integrity checks (header against file size,
``.bos.idx`` sorted, in range, complete and pointing at one token id, Megatron's document index,
documents ending with ``--eos-token``). Exits 1 when a check fails, 2 on a usage error.
``--json`` prints one JSON object; ``--plot FILE.png`` draws the document-length histogram
(needs matplotlib). An ``s3://`` path is fetched once into the local object cache first.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tokenmill.cli._errors import one_line
from tokenmill.cli._plot import matplotlib_missing

FIRST_TOKENS = 16
PERCENTILES = (0, 50, 90, 99, 100)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="describe and check token shards of any supported format",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", help="Megatron prefix, nanogpt .bin, .npy/raw file or directory")
    parser.add_argument("--bos-token", type=int, help="BOS id (count, documents, .bos.idx check)")
    parser.add_argument("--eos-token", type=int, help="EOS id (count, documents, index check)")
    parser.add_argument("--dtype", help="dtype of raw headerless .bin files")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="document-length histogram")
    parser.add_argument(
        "--packing",
        action="store_true",
        help="report how PackedDataset would pack the documents (needs --sequence-length)",
    )
    parser.add_argument("--sequence-length", type=int, help="row length for --packing")
    parser.add_argument(
        "--bos-aligned", action="store_true", help="--packing: full rows starting at a BOS"
    )
    parser.set_defaults(handler=run)


def _check(checks: list[dict[str, Any]], name: str, ok: bool, detail: str = "") -> None:
    checks.append({"name": name, "ok": bool(ok), "detail": detail})


def inspect_path(
    path: str, bos_token: int | None, eos_token: int | None, dtype: str | None
) -> tuple[dict[str, Any], Any]:
    """The report of ``inspect`` and the document lengths (or None)."""
    import numpy as np

    from tokenmill.errors import DataFormatError
    from tokenmill.formats.sources import document_lengths, open_source
    from tokenmill.formats.token_scan import count_token

    report: dict[str, Any] = {"path": path}
    checks: list[dict[str, Any]] = []
    report["checks"] = checks
    try:
        source = open_source(path, dtype)
    except (DataFormatError, ValueError) as error:
        _check(checks, "open", False, str(error))
        report["ok"] = False
        return report, None
    _check(checks, "open", True, "header, sizes and index consistent")
    report.update(format=source.format, dtype=source.dtype.name, files=len(source.shards))
    report["tokens"] = source.token_count
    first = source.shards[0]
    for key in ("version", "magic", "legacy", "dtype_code", "sequences"):
        if key in first.info:
            report[key] = first.info[key]
    report["first_tokens"] = [int(t) for t in first.tokens[:FIRST_TOKENS]]
    all_lengths = []
    origins = set()
    bos_count = eos_count = 0
    inferred_bos: set[int] = set()
    for shard in source.shards:
        tokens = shard.tokens
        if shard.bos_positions is not None:
            positions = shard.bos_positions
            name = f"bos_index {shard.bos_index_path}"
            held = np.unique(tokens[positions]) if positions.shape[0] else np.zeros(0, np.int64)
            if bos_token is not None:
                wrong = int(np.count_nonzero(tokens[positions] != bos_token))
                _check(checks, name + " points at BOS", wrong == 0,
                       f"{wrong} of {positions.shape[0]} positions hold another token")  # fmt: skip
                complete = count_token(tokens, bos_token) == positions.shape[0]
                _check(checks, name + " complete", complete,
                       f"{positions.shape[0]} positions, {count_token(tokens, bos_token)} BOS tokens")  # fmt: skip
            else:
                _check(checks, name + " points at one token id", held.shape[0] <= 1,
                       f"positions hold token ids {held[:8].tolist()}")  # fmt: skip
                inferred_bos.update(int(v) for v in held[:1])
        lengths, origin = document_lengths(shard, bos_token, eos_token)
        if lengths is not None:
            all_lengths.append(lengths)
            origins.add(origin)
        if bos_token is not None:
            bos_count += count_token(tokens, bos_token)
        if eos_token is not None:
            shard_eos = count_token(tokens, eos_token)
            eos_count += shard_eos
            if origin == "index" and lengths is not None:
                ends = np.cumsum(lengths)[lengths > 0] - 1
                missing = int(np.count_nonzero(tokens[ends] != eos_token))
                _check(checks, f"{shard.name}: documents end with EOS", missing == 0,
                       f"{missing} of {ends.shape[0]} documents do not end with {eos_token}")  # fmt: skip
    if bos_token is not None:
        report["bos_token"], report["bos_count"] = bos_token, bos_count
    elif len(inferred_bos) == 1:
        report["bos_token_from_index"] = inferred_bos.pop()
    if eos_token is not None:
        report["eos_token"], report["eos_count"] = eos_token, eos_count
    lengths_all = np.concatenate(all_lengths) if all_lengths else None
    if lengths_all is not None:
        report["documents"] = int(lengths_all.shape[0])
        report["documents_from"] = sorted(o for o in origins if o)
        if lengths_all.shape[0]:
            values = np.percentile(lengths_all, PERCENTILES, method="lower")
            report["document_length_percentiles"] = {
                f"p{p}": int(v) for p, v in zip(PERCENTILES, values)
            }
    report["ok"] = all(check["ok"] for check in checks)
    return report, lengths_all


def _print_text(report: dict[str, Any]) -> None:
    for key, value in report.items():
        if key in ("checks", "ok"):
            continue
        print(f"{key:>28}: {value}")
    for check in report["checks"]:
        status = "ok  " if check["ok"] else "FAIL"
        print(f"[{status}] {check['name']}: {check['detail']}")
    print("all checks passed" if report["ok"] else "CHECKS FAILED")


def _plot(lengths: Any, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.hist(lengths, bins=min(100, max(1, len(lengths))), log=True)
    axes.set_xlabel("document length (tokens)")
    axes.set_ylabel("documents")
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def packing_report(lengths: Any, sequence_length: int, bos_aligned: bool) -> dict[str, Any]:
    """Rows, padding and dropped tokens of PackedDataset's plan for these documents."""
    import numpy as np

    from tokenmill.datasets.packed import check_packing_memory
    from tokenmill.index.packing import plan_packing

    check_packing_memory(np.asarray(lengths), sequence_length, 0, "inspect --packing")
    plan = plan_packing(lengths, sequence_length, bos_aligned=bos_aligned, num_threads=2)
    row_tokens = plan.num_rows * sequence_length
    data = int(plan.entries[:, 2].sum())
    return {
        "sequence_length": sequence_length,
        "bos_aligned": bos_aligned,
        "rows": plan.num_rows,
        "tokens_kept": data,
        "padding_tokens": plan.padding,
        "inserted_bos_tokens": plan.inserted_bos,
        "dropped_tokens": int(sum(int(x) for x in lengths)) - data,
        "padding_fraction": plan.padding / row_tokens if row_tokens else 0.0,
    }


def run(args: argparse.Namespace) -> int:
    if args.plot and matplotlib_missing("inspect"):
        return 2
    try:
        path = args.path
        if path.startswith("s3://"):
            from tokenmill.storage.staging import fetch_source

            path = fetch_source(path)  # every check reads every token: fetch the objects once
        report, lengths = inspect_path(path, args.bos_token, args.eos_token, args.dtype)
    except (FileNotFoundError, PermissionError) as error:
        print(f"tokenmill inspect: error: {one_line(error)}", file=sys.stderr)
        return 2
    if args.packing:
        if not args.sequence_length:
            print("tokenmill inspect: error: --packing needs --sequence-length", file=sys.stderr)
            return 2
        if lengths is None:
            print(
                "tokenmill inspect: error: --packing needs document boundaries (pass --bos-token "
                "or --eos-token)",
                file=sys.stderr,
            )
            return 2
        report["packing"] = packing_report(lengths, args.sequence_length, args.bos_aligned)
    if args.plot:
        if lengths is None or not len(lengths):
            print(
                "tokenmill inspect: error: no document boundaries to plot (pass --bos-token or "
                "--eos-token)",
                file=sys.stderr,
            )
            return 2
        _plot(lengths, args.plot, args.path)
        report["plot"] = args.plot
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_text(report)
    return 0 if report["ok"] else 1
