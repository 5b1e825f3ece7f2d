"""Plot the benchmarks' raw results: ``benchmarks/results/*.json`` -> ``docs/img/benchmarks/*.png``.

Every figure is drawn from the JSON a benchmark run wrote (``benchmarks/evidence.py``): the
tables it printed (``tables``, or parsed here from ``output`` for records written before
``tables`` existed) or its structured ``runs`` / ``summary``. Nothing is typed in by hand: a
figure changes only when its benchmark is re-run. Each plot's title names the run's date and
its load average, since the numbers come from a shared 2-core machine.

    pip install matplotlib
    python scripts/plot_benchmarks.py            # every result present
    python scripts/plot_benchmarks.py serving    # only these

The PNGs are committed; ``benchmarks/README.md`` shows them and ``tests/test_docs.py`` checks
that every one it shows exists.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "img" / "benchmarks"
MEGATRON, TOKENMILL, OTHER = "#7f7f7f", "#1f77b4", "#ff7f0e"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def number(cell: str) -> float:
    """The first number of a printed cell ("1,319 k/s" -> 1319.0, "11.170 s" -> 11.17)."""
    match = _NUMBER.search(cell)
    if match is None:
        raise ValueError(f"no number in {cell!r}")
    return float(match.group(0).replace(",", ""))


def tables(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The markdown tables of a run: recorded ones, else parsed from its printed lines."""
    if record.get("tables"):
        return list(record["tables"])
    found: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in record.get("output", []):
        stripped = line.strip()
        if not stripped.startswith("|"):
            current = None
            continue
        cells = [cell.strip() for cell in stripped.strip("|").split("|")]
        if current is None:
            current = {"header": cells, "rows": []}
            found.append(current)
        elif not all(set(cell) <= set("-: ") for cell in cells):
            current["rows"].append(cells)
    return found


def column(table: dict[str, Any], name: str) -> int:
    for index, header in enumerate(table["header"]):
        if name in header:
            return index
    raise KeyError(f"no column {name!r} in {table['header']}")


def caption(record: dict[str, Any]) -> str:
    load = record.get("load_average_before", [None])[0]
    after = record.get("load_average_after", [None])[0]
    day = str(record.get("started", ""))[:10]
    return f"{day}, {record['machine'].get('cpus_usable')} CPUs, load {load:.1f} -> {after:.1f}"


def barh(
    path: Path,
    title: str,
    labels: list[str],
    series: dict[str, tuple[list[float], str]],
    xlabel: str,
    *,
    log: bool = False,
    annotate: list[str] | None = None,
) -> None:
    """Horizontal grouped bars: one group per label, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(series)
    height = 0.8 / count
    figure, axes = plt.subplots(figsize=(9, max(2.6, 0.24 * len(labels) * count + 1.4)))
    for position, (name, (values, color)) in enumerate(series.items()):
        offsets = [i + (position - (count - 1) / 2) * height for i in range(len(labels))]
        axes.barh(offsets, values, height=height, label=name, color=color)
    if annotate:
        for i, text in enumerate(annotate):
            top = max(values[i] for values, _ in series.values())
            axes.annotate(
                text, (top, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8
            )
    axes.set_yticks(range(len(labels)), labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(xlabel)
    if log:
        axes.set_xscale("log")
    axes.margins(x=0.3 if annotate else 0.1)
    axes.set_title(title, fontsize=10)
    if count > 1:
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_side_by_side(
    title: str,
    unit: str,
    ratio: str,
    log: bool = False,
    label: str = "{}",
    columns: tuple[int, int] = (1, 2),
) -> Callable[[dict[str, Any], Path], None]:
    """A table with megatron-core's and tokenmill's figure in `columns` of each row: both bars,
    annotated with the row's `ratio` column."""

    def plot(record: dict[str, Any], path: Path) -> None:
        table = tables(record)[0]
        rows = table["rows"]
        megatron, ours = columns
        barh(
            path,
            f"{title}\n{caption(record)}",
            [label.format(row[0]) for row in rows],
            {
                "megatron-core 0.19.2": ([number(row[megatron]) for row in rows], MEGATRON),
                "tokenmill": ([number(row[ours]) for row in rows], TOKENMILL),
            },
            unit,
            log=log,
            annotate=[row[column(table, ratio)] for row in rows],
        )

    return plot


plot_gpt_index = plot_side_by_side(
    "GPTDataset index build (seconds, lower is better)", "seconds", "speed-up",
    label="{} documents",
)  # fmt: skip


def plot_ratio_table(name: str, title: str) -> Callable[[dict[str, Any], Path], None]:
    """A table whose rows have different units: plot each row's ratio column."""

    def plot(record: dict[str, Any], path: Path) -> None:
        table = tables(record)[0]
        ratio = column(table, "speed-up")
        rows = table["rows"]
        barh(
            path,
            f"{title}\n{caption(record)}",
            [row[0] for row in rows],
            {name: ([number(row[ratio]) for row in rows], TOKENMILL)},
            "megatron-core 0.19.2 time / tokenmill time (higher is better)",
            annotate=[row[ratio] for row in rows],
        )

    return plot


plot_blending = plot_side_by_side(
    "Blending kernels (ns per sample, log scale, lower is better)", "ns / sample", "speed-up",
    log=True, columns=(2, 3),
)  # fmt: skip
plot_serving = plot_side_by_side(
    "Sample serving (samples/s, log scale, higher is better)", "samples / s", "ratio", log=True
)


def plot_megatron_loader(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"stock": "megatron-core 0.19.2", "tokenmill": "after patch_megatron()"}
    colors = {"stock": MEGATRON, "tokenmill": TOKENMILL}
    figure, panels = plt.subplots(1, 2, figsize=(9, 3.2))
    for panel, key, label in (
        (panels[0], "samples_per_second", "samples / s (higher is better)"),
        (panels[1], "cpu_per_1000", "CPU-s per 1000 samples (lower is better)"),
    ):
        for position, library in enumerate(("stock", "tokenmill")):
            values = [run[key] for run in record["runs"] if run["library"] == library]
            panel.scatter([position] * len(values), values, color=colors[library], zorder=3)
            summary = record["summary"][
                "samples_per_second"
                if key == "samples_per_second"
                else "cpu_seconds_per_1000_samples"
            ][library]
            panel.bar(position, summary, color=colors[library], alpha=0.35, width=0.6)
        panel.set_xticks([0, 1], [names["stock"], names["tokenmill"]], fontsize=8)
        panel.set_ylabel(label, fontsize=8)
    summary = record["summary"]
    figure.suptitle(
        "Megatron-LM's build_pretraining_data_loader, unchanged (bars: medians, dots: runs): "
        f"{summary['speedup']:.1f}x samples/s, {summary['cpu_ratio']:.1f}x less CPU\n"
        f"{caption(record)}",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_tokenize(record: dict[str, Any], path: Path) -> None:
    speed = [table for table in tables(record) if any("M tok/s" in h for h in table["header"])]
    labels: list[str] = []
    values: list[float] = []
    colors: list[str] = []
    threads = [
        line.split(" thread")[0] for line in record["output"] if " thread(s), best of" in line
    ]
    for count, table in zip(threads, speed):
        tok = column(table, "M tok/s")
        for row in table["rows"]:
            if len(row) <= tok:  # a row that did not run ("not run: ...")
                continue
            labels.append(f"{row[0]} ({count} thr.)")
            values.append(number(row[tok]))
            colors.append(TOKENMILL if row[0].startswith("tokenmill") else OTHER)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 0.32 * len(labels) + 1.4))
    axes.barh(range(len(labels)), values, color=colors)
    for i, value in enumerate(values):
        axes.annotate(
            f"{value:g}", (value, i), xytext=(4, 0), textcoords="offset points", va="center",
            fontsize=7,
        )  # fmt: skip
    axes.set_yticks(range(len(labels)), labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.margins(x=0.15)
    corpus = next(line for line in record["output"] if line.startswith("corpus "))
    text = corpus.split(": ", 1)[1].split(";")[0]  # "45.7 MB of text"
    axes.set_xlabel(f"M tokens / s, GPT-2 BPE on {text} (log scale, higher is better)")
    axes.set_title(f"Tokenize (blue: tokenmill)\n{caption(record)}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_s3(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = tables(record)[0]
    rows = table["rows"][1:]  # the local mmap row fetches nothing
    labels = [row[0] for row in rows]
    colors = [MEGATRON if "megatron" in label else TOKENMILL for label in labels]
    figure, panels = plt.subplots(1, 2, figsize=(10, 0.4 * len(rows) + 1.6), sharey=True)
    for panel, index, label in (
        (panels[0], column(table, "requests"), "requests / 1000 samples"),
        (panels[1], column(table, "MiB"), "MiB fetched / 1000 samples (log)"),
    ):
        values = [number(row[index]) for row in rows]
        panel.barh(range(len(rows)), values, color=colors)
        for i, value in enumerate(values):
            panel.annotate(
                f"{value:g}", (value, i), xytext=(3, 0), textcoords="offset points",
                va="center", fontsize=7,
            )  # fmt: skip
        panel.set_xlabel(label, fontsize=8)
        panel.margins(x=0.2)
    panels[1].set_xscale("log")
    panels[0].set_yticks(range(len(rows)), labels, fontsize=7)
    panels[0].invert_yaxis()
    figure.suptitle(
        f"s3:// reads on moto (exact counts; grey: megatron-core 0.19.2)\n{caption(record)}",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_packing(record: dict[str, Any], path: Path) -> None:
    table = tables(record)[0]
    rows = table["rows"]
    barh(
        path,
        f"Packing (% of tokens): {record['output'][0]}\n{caption(record)}",
        [row[0] for row in rows],
        {
            "padding + inserted BOS": ([number(row[2]) for row in rows], TOKENMILL),
            "dropped": ([number(row[3]) for row in rows], OTHER),
        },
        "% (lower is better)",
        annotate=[f"{row[2]} / {row[3]}" for row in rows],
    )


def plot_durability(record: dict[str, Any], path: Path) -> None:
    summary = record["summary"]
    labels = list(summary)
    barh(
        path,
        f"Durable writes (seconds, best of the runs)\n{caption(record)}",
        labels,
        {
            "fsync (default)": ([summary[k]["fsync_s"] for k in labels], TOKENMILL),
            "TOKENMILL_FSYNC=0": ([summary[k]["no_fsync_s"] for k in labels], OTHER),
        },
        "seconds",
        annotate=[f"{summary[k]['fsync_s'] / summary[k]['no_fsync_s']:.2f}x" for k in labels],
    )


def plot_mixture(record: dict[str, Any], path: Path) -> None:
    runs = record["runs"]
    summary = record["summary"]
    barh(
        path,
        f"Mixture loader, in-process, {summary['parameters']['global_batch']} x "
        f"{summary['parameters']['sequence_length']}-token steps (M tokens/s read by rank 0)\n"
        f"draws {summary['draw_ns_per_chunk']:.0f} ns/chunk, demand over the budget "
        f"{summary['demand_seconds']:.3f} s, resume {summary['resume_ms']:.1f} ms; "
        f"{caption(record)}",
        [f"rank 0 of {run['world_size']}" for run in runs],
        {"tokenmill": ([run["tokens_per_second"] / 1e6 for run in runs], TOKENMILL)},
        "M tokens / s (higher is better)",
        annotate=[f"{run['steps_per_second']:,.0f} steps/s" for run in runs],
    )


def plot_scale(record: dict[str, Any], path: Path) -> None:
    """Time to the first sample of a blend of S sources, per phase (fastest of the runs); the
    10,000-source run under a descriptor limit (``scale_10000.json``) joins it when present."""
    labels: list[str] = []
    megatron: list[float] = []
    tokenmill: list[float] = []
    notes: list[str] = []
    rows = list(record["summary"]["time_to_first_sample"])
    extra = RESULTS / "scale_10000.json"
    if extra.exists():
        rows += json.loads(extra.read_text("utf-8"))["summary"]["time_to_first_sample"]
    for row in rows:
        best = row["best"]
        for phase in ("cold", "warm", "warm, not building"):
            theirs = best.get("megatron", {}).get(phase, {})
            ours = best.get("tokenmill", {}).get(phase, {})
            if "seconds" not in ours:
                continue
            limit = f", ulimit -n {row['fd_limit']}" if row.get("fd_limit") else ""
            labels.append(f"S={row['sources']:,} {phase}{limit}")
            tokenmill.append(ours["seconds"])
            if "seconds" in theirs:
                megatron.append(theirs["seconds"])
                notes.append(f"{theirs['seconds'] / ours['seconds']:.1f}x")
            else:
                megatron.append(0.0)
                error = str(theirs.get("error", "not run"))
                notes.append("megatron-core: " + ("EMFILE" if "Errno 24" in error else error[:24]))
    barh(
        path,
        f"Blend of S sources: builder to sample 0 (seconds, lower is better)\n{caption(record)}",
        labels,
        {
            "megatron-core 0.19.2": (megatron, MEGATRON),
            "tokenmill": (tokenmill, TOKENMILL),
        },
        "seconds (log)",
        log=True,
        annotate=notes,
    )


PLOTS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "gpt_index": plot_gpt_index,
    "indexed": plot_ratio_table("tokenmill", "Megatron .bin/.idx: finalize, add_index, reads"),
    "blending": plot_blending,
    "serving": plot_serving,
    "megatron_loader": plot_megatron_loader,
    "tokenize": plot_tokenize,
    "s3": plot_s3,
    "mixture": plot_mixture,
    "packing": plot_packing,
    "durability": plot_durability,
    "scale": plot_scale,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"results to plot (default: all of {list(PLOTS)})")
    args = parser.parse_args(argv)
    IMAGES.mkdir(parents=True, exist_ok=True)
    for name in args.names or list(PLOTS):
        source = RESULTS / f"{name}.json"
        if not source.exists():
            print(f"{name}: no {source.relative_to(ROOT)}, skipped")
            continue
        record = json.loads(source.read_text("utf-8"))
        target = IMAGES / f"{name}.png"
        PLOTS[name](record, target)
        print(f"{source.relative_to(ROOT)} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
