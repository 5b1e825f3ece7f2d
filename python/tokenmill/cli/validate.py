"""``tokenmill validate CONFIG``: a mixture's demand against its inventory, before launch.

The demand is exact, not an estimate: every chunk of the budget is drawn exactly as the loader
will draw it (about 0.1 µs per chunk). A source whose planned consumption exceeds its inventory
(tokens x epochs) is a *shortfall*: an error (exit status 1) under the default ``halt`` policy, a
warning under ``drop`` (that source will leave the mixture and the others renormalise).
``--state STATE.json`` validates the rest of a run from a saved loader/mixture state (for a resume
with new weights or phases). ``--plot FILE.png`` (needs matplotlib) draws the mixture over the
budget, stacked by source with the phase boundaries marked, and each source's planned
consumption against its inventory.

Exit status: 0 ok (or only warnings), 1 predicted shortfall, 2 the config or a source is invalid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenmill.cli._errors import one_line
from tokenmill.cli._plot import matplotlib_missing

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check a mixture config's demand against its sources before launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="mixture config (.toml, .yaml or .yml)")
    parser.add_argument("--state", help="a saved loader or mixture state (JSON) to start from")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the plan (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=run)


def _report_dict(report: Any) -> dict[str, Any]:
    return {
        "exhaustion": report.exhaustion,
        "phases": [
            {"name": name, "tokens": tokens, "demand": dict(zip(report.sources, row))}
            for name, tokens, row in zip(report.phases, report.phase_tokens, report.demand)
        ],
        "sources": {
            name: {
                "inventory": report.inventory[s],
                "consumed": report.consumed[s],
                "planned": report.planned[s],
                "shortfall": report.shortfall[s],
            }
            for s, name in enumerate(report.sources)
        },
        "ok": report.ok,
    }


def _print_text(report: Any) -> None:
    width = max(len(name) for name in (*report.sources, "source"))
    header = f"{'source':<{width}}  {'inventory':>14}  {'consumed':>14}"
    for name in report.phases:
        header += f"  {name[:14]:>14}"
    print(header + f"  {'planned':>14}  {'shortfall':>14}")
    for s, name in enumerate(report.sources):
        line = f"{name:<{width}}  {report.inventory[s]:>14,}  {report.consumed[s]:>14,}"
        for row in report.demand:
            line += f"  {row[s]:>14,}"
        print(line + f"  {report.planned[s]:>14,}  {report.shortfall[s]:>14,}")


def plot_report(report: Any, path: str, title: str) -> None:
    """Mixture over the budget (stacked by source, phases marked) and demand vs inventory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    demand = np.asarray(report.demand, dtype=np.float64)  # [phases, sources]
    budgets = np.asarray(report.phase_tokens, dtype=np.float64)
    bounds = np.concatenate([[0.0], np.cumsum(budgets)])
    shares = demand / np.maximum(demand.sum(axis=1, keepdims=True), 1.0)
    figure, (mix_axes, stock_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.repeat(bounds, 2)[1:-1]  # a step per phase
    y = np.repeat(shares.T, 2, axis=1)
    mix_axes.stackplot(x, y, labels=report.sources)
    for boundary in bounds[1:-1]:
        mix_axes.axvline(boundary, color="black", linestyle="--", linewidth=1)
    for name, start in zip(report.phases, bounds[:-1]):
        mix_axes.annotate(name, (start, 1.0), xytext=(3, -12), textcoords="offset points")
    mix_axes.set_xlim(0, bounds[-1])
    mix_axes.set_ylim(0, 1)
    mix_axes.set_xlabel("tokens of the budget")
    mix_axes.set_ylabel("share of tokens (as drawn)")
    mix_axes.set_title(f"{title}: mixture by phase")
    mix_axes.legend(loc="lower left", fontsize="small")
    positions = np.arange(len(report.sources))
    stock_axes.bar(positions - 0.2, report.planned, width=0.4, label="planned")
    stock_axes.bar(positions + 0.2, report.inventory, width=0.4, label="inventory")
    for s, short in enumerate(report.shortfall):
        if short:
            stock_axes.annotate(
                "shortfall", (s - 0.2, report.planned[s]), color="red", ha="center", va="bottom"
            )
    stock_axes.set_xticks(positions, report.sources)
    stock_axes.set_ylabel("tokens")
    stock_axes.set_title("planned consumption vs inventory")
    stock_axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _read_state(path: str) -> dict[str, object]:
    """The mixture state in the JSON file `path` (a checkpoint's `mixture` entry, or the state
    itself); ValueError naming the file for text that is not JSON or not an object."""
    try:
        state = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: the state is not UTF-8 text (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}: the state is not JSON: {error.msg} at line {error.lineno} column "
            f"{error.colno}"
        ) from None
    if isinstance(state, dict) and "mixture" in state:
        state = state["mixture"]
    if not isinstance(state, dict):
        raise ValueError(
            f"{path}: the state must be a JSON object (a mixture state or a checkpoint with a "
            f"'mixture' entry), got {type(state).__name__}"
        )
    return state


def run(args: argparse.Namespace) -> int:
    from tokenmill.datasets.mixture import Mixture
    from tokenmill.errors import TokenmillError

    if args.plot and matplotlib_missing("validate"):
        return 2
    try:
        mixture = Mixture(args.config)
        state = None
        if args.state:
            state = _read_state(args.state)
        report = mixture.report(state)
    except (OSError, ValueError, TokenmillError) as error:
        print(f"tokenmill validate: error: {one_line(error)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_report_dict(report), indent=2))
    else:
        _print_text(report)
    for name, short, held in zip(report.sources, report.shortfall, report.inventory):
        if short:
            kind = "warning" if report.exhaustion == "drop" else "error"
            consequence = (
                "it will be dropped and the other weights renormalised"
                if report.exhaustion == "drop"
                else "training would halt (set exhaustion = 'drop' to renormalise instead)"
            )
            print(
                f"tokenmill validate: {kind}: source {name!r} is short by {short:,} tokens "
                f"(planned {short + held:,}, inventory {held:,}): {consequence}",
                file=sys.stderr,
            )
    if args.plot:
        plot_report(report, args.plot, Path(args.config).name)
    return 0 if report.ok else 1
