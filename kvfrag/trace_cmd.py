"""`kvfrag trace stats PATH [--format F] [--plot OUT]`: summarise a trace as a table (and plot).

PATH may be a file or `sample:NAME` (a trace sample shipped with kvfrag). The numbers come from
`workloads.stats`; this module only formats them and draws the PNG (length CDFs and the arrival
rate over time), written atomically so a failed run never leaves half a file.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfrag import outdir
from kvfrag.workloads import samples
from kvfrag.workloads.names import FIELDS, FORMATS, TIME_UNITS

if TYPE_CHECKING:  # read only when a trace is (`kvfrag --help` stays quick)
    from kvfrag.workloads import Workload
    from kvfrag.workloads.stats import LengthStats, TraceStats


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser("trace", help="inspect request traces")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    stats = trace_sub.add_parser(
        "stats",
        help="rows, time span, rate, burstiness and length percentiles of a trace",
        description=f"Shipped samples: {', '.join('sample:' + n for n in samples.names())}.",
    )
    stats.add_argument("path", metavar="PATH", help="trace file, or sample:NAME")
    stats.add_argument("--format", default="auto", choices=FORMATS, help="default: auto-detect")
    stats.add_argument("--time-unit", choices=TIME_UNITS, help="unit of the arrival column")
    stats.add_argument(
        "--column", action="append", default=[], metavar="FIELD=COLUMN",
        help=f"map a request field ({', '.join(FIELDS)}) to a source column; repeatable",
    )
    stats.add_argument("--drop-bad-rows", action="store_true",
                       help="skip (and count) bad rows instead of stopping at the first")
    stats.add_argument("--plot", metavar="OUT", type=Path,
                       help="also write length CDFs and the arrival rate to this PNG")
    stats.add_argument("--json", action="store_true",
                       help="print the statistics as JSON on stdout instead of the table "
                       "(see docs/data-dictionary.md)")
    stats.set_defaults(func=run_stats)


def _column_map(pairs: list[str]) -> dict[str, str] | None:
    if not pairs:
        return None
    mapping = {}
    for pair in pairs:
        field, sep, column = pair.partition("=")
        if not sep or not field or not column:
            raise ValueError(f"--column {pair!r}: expected FIELD=COLUMN")
        mapping[field] = column
    return mapping


def run_stats(args: argparse.Namespace) -> int:
    from kvfrag.workloads import load_trace
    from kvfrag.workloads.stats import trace_stats

    workload = load_trace(
        args.path,
        format=args.format,
        columns=_column_map(args.column),
        time_unit=args.time_unit,
        drop_bad_rows=args.drop_bad_rows,
    )
    if args.plot is not None:
        check_plot_target(args.plot)  # before the table: refuse early, write nothing
        outdir.make_dirs(args.plot.parent)
    stats = trace_stats(workload)
    if not args.json:
        print(format_stats(stats, workload))
    if args.plot is not None:
        write_plot(workload, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    if args.json:  # stdout holds the JSON only, printed once the plot is written
        from kvfrag.results import dumps_json

        print(dumps_json(stats_document(stats, workload)))
    return 0


def stats_document(stats: TraceStats, workload: Workload) -> dict[str, Any]:
    """What `trace stats --json` prints: the figures of the table, unrounded (seconds,
    requests/s, tokens); those without arrival times (or prefix hashes) are null."""
    from dataclasses import asdict

    from kvfrag.results import SCHEMA_VERSION

    def finite(value: float | None) -> float | None:
        return None if value is None or not math.isfinite(value) else value

    def lengths(s: LengthStats) -> dict[str, float | int | None]:
        return {k: finite(v) if isinstance(v, float) else v for k, v in asdict(s).items()}

    reuse = None
    if stats.prefix_reuse is not None:
        blocks, tokens = stats.prefix_reuse
        reuse = {"blocks": blocks, "prompt_tokens": tokens}
    return {
        "schema_version": SCHEMA_VERSION,
        "source": stats.source,
        "rows": stats.rows,
        "dropped_rows": workload.dropped_rows,
        "span_s": finite(stats.span_s),
        "mean_rate": finite(stats.mean_rate),
        "interarrival_cv": finite(stats.interarrival_cv),
        "prefix_reuse": reuse,
        "prompt": lengths(stats.prompt),
        "output": lengths(stats.output),
        "notes": list(workload.notes),
    }


def format_stats(stats: TraceStats, workload: Workload) -> str:
    def opt(value: float | None, fmt: str, unit: str) -> str:
        return "n/a (no arrival times)" if value is None else f"{value:{fmt}}{unit}"

    lines = [
        f"source            {stats.source}",
        f"rows              {stats.rows:,}",
        f"time span         {opt(stats.span_s, '.1f', ' s')}",
        f"mean rate         {opt(stats.mean_rate, '.2f', ' req/s')}",
        f"inter-arrival CV  {opt(stats.interarrival_cv, '.2f', '')}",
    ]
    if workload.dropped_rows:
        lines.append(f"dropped rows      {workload.dropped_rows:,}")
    if stats.prefix_reuse is not None:
        blocks, tokens = stats.prefix_reuse
        lines.append(
            f"prefix reuse      {100 * blocks:.1f} % of blocks, {100 * tokens:.1f} % of prompt "
            "tokens at most (unbounded cache, arrival order)"
        )
    rows = [["tokens", "mean", "p50", "p90", "p99", "max"]]
    for name, s in (("prompt", stats.prompt), ("output", stats.output)):
        rows.append([name, f"{s.mean:.1f}", *(_num(p) for p in (s.p50, s.p90, s.p99)),
                     str(s.max)])
    lines += ["", *_columns(rows)]
    lines += [f"note: {note}" for note in workload.notes]
    return "\n".join(lines)


def _columns(rows: list[list[str]]) -> list[str]:
    """`rows` as aligned text: the first column left, the others right, each as wide as its
    widest cell plus two spaces (10 at least), so 9- and 10-digit values never run together."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    first = max(8, widths[0] + 2)
    return [f"{row[0]:<{first}}" + "".join(f"{c:>{max(10, w + 2)}}" for c, w in
                                           zip(row[1:], widths[1:], strict=True)) for row in rows]


def _num(value: float) -> str:
    """A percentile as written in the traces' SOURCE.md: whole, or with one decimal."""
    rounded = round(value, 1)
    return f"{rounded:.0f}" if rounded == int(rounded) else f"{rounded:.1f}"


def write_plot(workload: Workload, out: Path) -> None:
    from matplotlib.figure import Figure

    from kvfrag.workloads.stats import arrival_rate, length_cdf

    fig = Figure(figsize=(11, 4), layout="constrained")
    cdf_ax, rate_ax = fig.subplots(1, 2)
    df = workload.requests
    for column, label in (("prompt_tokens", "prompt"), ("output_tokens", "output")):
        x, y = length_cdf(df[column].to_numpy())
        cdf_ax.step(x, y, where="post", label=label)
    cdf_ax.set_xscale("log")
    cdf_ax.set_xlabel("length (tokens, log scale)")
    cdf_ax.set_ylabel("fraction of requests")
    cdf_ax.set_title("Length CDFs")
    cdf_ax.legend()
    cdf_ax.grid(alpha=0.3)

    rate = arrival_rate(workload)
    rate_ax.set_title("Arrival rate over time")
    rate_ax.set_xlabel("time since first request (s)")
    rate_ax.set_ylabel("arrival rate (requests/s)")
    if rate is None:
        rate_ax.text(0.5, 0.5, "no arrival times", ha="center", va="center",
                     transform=rate_ax.transAxes)
    else:
        edges, per_second = rate
        rate_ax.stairs(per_second, edges)
        rate_ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(workload.source).name}: {len(df):,} requests")

    out = Path(out)
    check_plot_target(out)
    outdir.make_dirs(out.parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".png")
    except OSError as exc:
        raise outdir.output_error(exc, out, exact=True) from None
    try:
        with os.fdopen(fd, "wb") as fh, outdir.writing(out, exact=True):
            fig.savefig(fh, format="png", dpi=100, metadata={"Software": PLOT_SOFTWARE})
        os.chmod(tmp, outdir.FILE_MODE)  # mkstemp creates 0600; give the usual permissions
        with outdir.writing(out, exact=True):
            os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


#: The PNG `Software` text of a figure `trace stats --plot` wrote: how it knows a file it may
#: replace from a user's.
PLOT_SOFTWARE = "kvfrag trace stats"


def check_plot_target(out: Path) -> None:
    """Refuse to write over anything but a PNG that `trace stats --plot` wrote."""
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise outdir.UnsafeOutput(f"{out}: exists and is not a plain file; choose another name")
    if out.exists() and png_software(out) != PLOT_SOFTWARE:
        raise outdir.UnsafeOutput(
            f"{out}: exists and was not written by kvfrag trace stats; kvfrag will not replace "
            "it (choose another name, or remove it)"
        )


def png_software(path: Path) -> str | None:
    """The `Software` text of a PNG file, if any (Pillow reads it: matplotlib depends on it)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.info.get("Software") if image.format == "PNG" else None
    except (OSError, ValueError):  # not an image (Pillow's UnidentifiedImageError), unreadable
        return None
