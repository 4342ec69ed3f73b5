"""Figures of a results folder: where the KV budget went, over time, in the address space.

`plot_results(results_dir, meta)` reads what a run wrote (`summary.csv`, `timeseries.parquet`,
`requests.parquet`) and writes every figure into `results_dir/plots/` as PNG, and as SVG too
with `svg=True` (`kvfrag run --svg`, `kvfrag plot --svg`): each format is a full render of its
own, and the SVGs add about two thirds to the PNGs' drawing time, so they are opt-in.
Each figure also has its own function that takes DataFrames and returns a matplotlib `Figure`,
so figures can be built (and tested) without files:

- `breakdown_figure(summary)`: stacked bars, the budget split into its five parts per allocator
- `timeline_figure(timeseries)`: the same split over time, with running and waiting requests
- `address_map_figure(requests, summary)`: every slab of a contiguous or buddy allocator
- `capacity_figure(summary)`: requests running at once and throughput (against a swept value)
- `lengths_figure(requests)`: the workload's prompt and output length distributions

Figures are built on `matplotlib.figure.Figure` (Agg), never pyplot: no global state, safe to
call from threads and from tests. One palette everywhere: token states are always green.
Rectangles are drawn as collections, one artist per colour rather than one per bar or slab:
a draw's Python cost grows with the number of artists, hardly with the shapes in a collection.
"""

from __future__ import annotations

import csv
import io
import math
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from sim.allocators.base import PARTS  # the five parts, bottom to top of every stack
from sim.engine import REJECT_REASONS

#: One colour per part of the budget, used by every figure. Green is always token states.
PALETTE: dict[str, str] = {
    "token_states": "#2ca02c",
    "reserved": "#ff9f4a",
    "internal": "#d62728",
    "external": "#9467bd",
    "usable_free": "#d9d9d9",
}
PALETTE["free"] = PALETTE["usable_free"]
PALETTE["internal_overreservation"] = PALETTE["internal"]
PALETTE["internal_rounding"] = "#f4a6a6"
#: Hatching that tells internal fragmentation's rounding from its over-reservation.
HATCH: dict[str, str] = {"internal_rounding": "///"}

#: How each part is named in legends.
PART_NAMES: dict[str, str] = {
    "token_states": "token states",
    "reserved": "reserved (not yet written)",
    "internal": "internal fragmentation",
    "internal_overreservation": "internal: over-reservation",
    "internal_rounding": "internal: rounding",
    "external": "external fragmentation",
    "usable_free": "free (usable)",
}

#: Colours, markers and line styles that tell allocators apart in line plots: no green (token
#: states), no orange/red/purple (reserved/internal/external).
LABEL_COLORS = (
    "#1f77b4",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#393b79",
    "#7f7f7f",
    "#000000",
    "#bcbd22",
)
LABEL_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LABEL_STYLES = ("-", "--", "-.", ":")
RUNNING_COLOR = "#1f77b4"
WAITING_COLOR = "#7f7f7f"
PROMPT_COLOR = "#1f77b4"
OUTPUT_COLOR = "#8c564b"
BAR_COLOR = "#4c72b0"

#: Figure files written by `plot_results`, by figure (each as .png, and .svg when asked for).
FIGURES = ("breakdown", "timeline", "address_map", "capacity", "lengths")

#: More slabs than this in one address map: the first ones by admission time are drawn.
MAX_SLABS = 3000
#: A single allocator swept over at most this many points: the timeline has a panel per point.
_MAX_POINT_PANELS = 9
#: More timeseries segments than this per allocator: time-averaged into this many bins.
MAX_SEGMENTS = 2000

#: More requests than this: the length CDFs are drawn through this many evenly spaced ranks.
_CDF_POINTS = 2000

GIB = 2**30
_DPI = 150
_LINE_IN = 0.17  # inches per caption line kept at the bottom of every figure

# Columns of summary.csv that are not sweep keys: run metadata and engine summary keys.
_BASE_COLUMNS = {
    "workload_dropped_rows",
    "workload_clipped",
    "workload_rejected_long",
    "workload_arrival_rate",
    "label",
    "kind",
    "point",
    "model",
    "scenario",
    "kv_budget_bytes",
    "bytes_per_token",
    "max_model_len",
    "allocator",
    "capacity_bytes",
    "sim_time_s",
    "token_states",
    "reserved",
    "internal",
    "external",
    "usable_free",
    "free",
    "kv_utilization",
    "mean_running",
    "max_running",
    "requests",
    "completed",
    "rejected",
    *(f"rejected_{why}" for why in REJECT_REASONS),
    "unfinished",
    "preemptions",
    "recomputed_tokens",
    "frag_refusals",
    "frag_blocked_s",
    "generated_tokens",
    "throughput_tok_s",
    "throughput_req_s",
    "mean_queueing_s",
    "p50_queueing_s",
    "p99_queueing_s",
    "mean_latency_s",
    "p50_latency_s",
    "p99_latency_s",
    "events",
    "memory_saved_by_sharing",
    "prefill_tokens_skipped",
    "prefill_tokens_skipped_first",
    "internal_overreservation",
    "internal_rounding",
    *(f"{stat}_{col}" for col in ("ttft_s", "tpot_s") for stat in ("mean", "p50", "p90", "p99")),
    "prefix_hit_rate_tokens",
    "prefix_hit_rate_first_tokens",
    "compactions",
    "bytes_moved",
    "stall_s",
    "seed",
    "wall_s",
    "options",
}
# Run settings that a sweep may change although they are not sweep-key columns themselves.
_SETTING_COLUMNS = ("kv_budget_bytes", "max_model_len", "bytes_per_token")

#: Columns of each results file that the figures cannot do without (in summary.csv, `free`
#: may stand in for `usable_free`). A file without them was not written by `kvfrag run`.
SUMMARY_COLUMNS = ("label", "point", *PARTS)
TIMESERIES_COLUMNS = ("t", "dt")
REQUESTS_COLUMNS = ("prompt_tokens", "output_tokens")


class ResultsFileError(ValueError):
    """A results file that is damaged or not as `kvfrag run` writes it. The message is one
    line that names the file, so that the CLI can print it as it is."""


# --------------------------------------------------------------------------------- helpers
def format_bytes(n: float) -> str:
    """A byte count as people read it: 12 GiB, 800 MiB, 1.5 TiB."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "?"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if abs(v - round(v)) < 0.05 else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def _labels(df: pd.DataFrame) -> list[str]:
    """Allocator labels in the order the run wrote them (the scenario's order)."""
    if "label" not in df.columns:
        return ["run"]
    return [str(x) for x in pd.unique(df["label"].astype(str))]


def _with_keys(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with `label` and `point` columns (a single run's frames have neither)."""
    if "label" in df.columns and "point" in df.columns:
        return df
    df = df.copy()
    if "label" not in df.columns:
        df["label"] = "run"
    if "point" not in df.columns:
        df["point"] = 0
    return df


def _first_point(df: pd.DataFrame) -> int:
    return int(df["point"].min()) if "point" in df.columns and len(df) else 0


def _label_style(i: int) -> dict:
    return {
        "color": LABEL_COLORS[i % len(LABEL_COLORS)],
        "marker": LABEL_MARKERS[i % len(LABEL_MARKERS)],
        "linestyle": LABEL_STYLES[(i // len(LABEL_COLORS)) % len(LABEL_STYLES)],
    }


def _first(summary: pd.DataFrame | None, col: str):
    if summary is None or col not in summary.columns:
        return None
    vals = summary[col].dropna()
    return vals.iloc[0] if len(vals) else None


def caption_parts(meta: Mapping | None = None, summary: pd.DataFrame | None = None) -> list[str]:
    """The facts of the caption line: scenario, model, KV budget, max_model_len, workload.
    `meta` (what the caller knows) wins over the summary, except for values a sweep changed."""
    meta = dict(meta or {})
    parts = []
    scenario = meta.get("scenario") or meta.get("name") or _first(summary, "scenario")
    if scenario:
        parts.append(f"scenario: {scenario}")
    model = meta.get("model") or _first(summary, "model")
    if isinstance(model, Mapping):
        model = model.get("name")
    if model:
        parts.append(f"model: {model}")
    budget = meta.get("kv_budget")
    col = "kv_budget_bytes" if _first(summary, "kv_budget_bytes") is not None else "capacity_bytes"
    swept = _swept_range(summary, col, format_bytes)
    if swept:
        budget = swept
    elif budget is None and _first(summary, col) is not None:
        budget = format_bytes(float(_first(summary, col)))
    if isinstance(budget, int | float) and not isinstance(budget, bool):
        budget = format_bytes(float(budget))
    if budget is not None:
        parts.append(f"KV budget: {budget}")
    mml = (
        _swept_range(summary, "max_model_len", lambda v: f"{v:.0f}")
        or meta.get("max_model_len")
        or _first(summary, "max_model_len")
    )
    if mml is not None:
        parts.append(f"max_model_len: {mml if isinstance(mml, str) else int(mml)}")
    bpt = _first(summary, "bytes_per_token")
    if bpt is not None:
        parts.append(f"{format_bytes(float(bpt))} per token")
    workload = meta.get("workload")
    if workload:
        parts.append(f"workload: {_describe(workload)}")
    return parts


def _swept_range(summary: pd.DataFrame | None, col: str, fmt) -> str | None:
    """`swept (lo–hi)` when a sweep changed `col`, else None."""
    if summary is None or col not in summary.columns:
        return None
    vals = pd.to_numeric(summary[col], errors="coerce").dropna()
    if vals.nunique() <= 1:
        return None
    return f"swept ({fmt(float(vals.min()))}–{fmt(float(vals.max()))})"


def caption(meta: Mapping | None = None, summary: pd.DataFrame | None = None) -> str:
    """The caption line: scenario, model, KV budget, max_model_len, workload."""
    return _SEP.join(caption_parts(meta, summary))


_SEP = "  ·  "


def _wrap(parts: list[str], width_in: float, fontsize: float) -> list[str]:
    """Join caption parts into lines that fit `width_in` inches (breaking between parts)."""
    limit = max(int(width_in * 72 / (fontsize * 0.56)), 20)
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(_SEP) + len(part) <= limit:
            lines[-1] += _SEP + part
        else:
            lines.append(part if len(part) <= limit else part[: limit - 1] + "…")
    return lines


def _describe(value, limit: int = 100) -> str:
    """A short one-line description of a scalar or a mapping (the resolved workload spec):
    `trace PATH` or the synthetic settings, then the other settings that are set, by their
    last key (None, False and "auto" left out)."""
    if not isinstance(value, Mapping):
        text = str(value)
    else:
        value = dict(value)
        head = []
        trace = value.pop("trace", None)
        if isinstance(trace, Mapping) and trace.get("path"):
            head.append(f"trace {trace['path']}")
            trace = {k: v for k, v in trace.items() if k != "path"}
        synthetic = value.pop("synthetic", None)
        if synthetic:
            head.append("synthetic")
        items = []
        for part in (synthetic, trace, value):
            items += _leaves(part)
        text = ", ".join(head + items)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _leaves(v, key: str = "") -> list[str]:
    if isinstance(v, Mapping):
        if key and set(v) <= {"kind", "value"} and "value" in v:  # {kind: fixed, value: 256}
            return [f"{key}={v['value']}"]
        out = []
        for k, sub in v.items():
            out += _leaves(sub, str(k))
        return out
    if v is None or v is False or v == "auto" or v == [] or not key:
        return []
    return [f"{key}={v}"]


def _new_figure(width: float, height: float, meta, summary) -> Figure:
    """A figure with constrained layout that keeps room for the caption line at the bottom."""
    lines = _wrap(caption_parts(meta, summary), width, 8)
    height += _LINE_IN * len(lines)
    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    if lines:
        fig.text(
            0.5,
            0.06 / height,
            "\n".join(lines),
            ha="center",
            va="bottom",
            fontsize=8,
            color="#444444",
            linespacing=1.4,
        )
        bottom = (0.1 + _LINE_IN * len(lines)) / height
        fig.get_layout_engine().set(rect=(0, bottom, 1, 1 - bottom))
    return fig


def _finish_axes(ax) -> None:
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)


def _bars(
    ax: Axes,
    x: np.ndarray,
    heights: np.ndarray,
    width: float,
    bottom: np.ndarray | float = 0.0,
    **style: Any,
) -> PolyCollection:
    """Vertical bars centred on `x`, as `ax.bar` draws them but as one `PolyCollection` for
    the lot: `ax.bar` makes a Rectangle artist per bar, and a figure's draw time grows with
    its artists. `style` is PolyCollection's (facecolors, edgecolors, linewidths, hatch,
    label). The corners go in a Rectangle's order and join as its do (mitred), so the bars
    come out pixel for pixel as `ax.bar`'s."""
    x = np.asarray(x, float)
    heights = np.asarray(heights, float)
    low = np.broadcast_to(np.asarray(bottom, float), heights.shape)
    left, right, high = x - width / 2, x + width / 2, low + heights
    corners = [(left, low), (right, low), (right, high), (left, high)]
    verts = np.stack([np.stack(c, axis=-1) for c in corners], axis=1)
    bars = PolyCollection(verts, joinstyle="miter", **style)
    bars.sticky_edges.y.extend(np.unique(low).tolist())  # as ax.bar: no margin below a base
    ax.add_collection(bars)
    ax.autoscale_view()  # before matplotlib 3.11, add_collection updates only the data limits
    return bars


def save_figure(fig: Figure, stem: Path | str, svg: bool = False) -> list[Path]:
    """Write `fig` as `stem`.png (and `stem`.svg with `svg`), each atomically; returns the
    paths. Every file is a full render of the figure, so a format nobody asked for is not
    written; the SVG reuses the PNG's layout rather than laying the figure out again."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    engine = fig.get_layout_engine()
    try:
        with matplotlib.rc_context({"svg.hashsalt": "kvfrag", "svg.fonttype": "none"}):
            for fmt in ("png", "svg") if svg else ("png",):
                paths.append(_save_atomic(fig, stem.with_name(f"{stem.name}.{fmt}"), fmt))
                if engine is not None:
                    fig.set_layout_engine("none")  # laid out by the first save: keep that
    finally:
        if engine is not None:
            fig.set_layout_engine(engine)
    return paths


def _save_atomic(fig: Figure, path: Path, fmt: str) -> Path:
    """Save into a temporary file next to `path`, then rename it over `path`."""
    # Not mkstemp: its 0600 mode would stick to the figure; open("xb") keeps the umask.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as fh:
            meta = {"Software": None} if fmt == "png" else {"Date": None}
            fig.savefig(fh, format=fmt, dpi=_DPI, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------- sweeps
def sweep_columns(summary: pd.DataFrame) -> list[str]:
    """The summary's sweep-key columns: those that are not run metadata or engine keys and
    whose value changes from point to point (run settings such as kv_budget_bytes when a sweep
    changed only those). Empty when there is no sweep."""
    if "point" not in summary.columns or summary["point"].nunique() <= 1:
        return []

    def varies(col: str) -> bool:
        per_point = summary.groupby("point")[col].agg(
            lambda s: s.dropna().astype(str).iloc[0] if s.notna().any() else None
        )
        return per_point.dropna().nunique() > 1

    cols = list(summary.columns)
    if "model" in cols and cols.index("point") < cols.index("model"):
        # summary.csv puts the sweep keys between `point` and `model`.
        between = cols[cols.index("point") + 1 : cols.index("model")]
        keys = [c for c in between if varies(c)]
    else:
        keys = [c for c in summary.columns if c not in _BASE_COLUMNS and varies(c)]
    if keys:
        return keys
    return [c for c in _SETTING_COLUMNS if c in summary.columns and varies(c)]


def _axis_name(col: str) -> str:
    if col in ("kv_budget", "kv_budget_bytes"):
        return "KV budget (GiB)"
    return col


def sweep_axis(summary: pd.DataFrame) -> tuple[str, dict[int, float], dict[int, str], bool]:
    """How the sweep is shown on an x axis: (axis label, x per point, tick text per point,
    numeric?). Without a sweep column the points themselves are the x values."""
    points = sorted(int(p) for p in pd.unique(summary["point"]))
    cols = sweep_columns(summary)

    def value(point: int, col: str):
        vals = summary.loc[summary["point"] == point, col].dropna()
        return vals.iloc[0] if len(vals) else None

    if len(cols) == 1 or (cols and set(cols) <= {"kv_budget", "kv_budget_bytes"}):
        col = cols[0]
        if col == "kv_budget" and "kv_budget_bytes" in summary.columns:
            col = "kv_budget_bytes"
        vals = {p: value(p, col) for p in points}
        numeric = all(
            v is not None and not isinstance(v, bool) and _is_number(v) for v in vals.values()
        )
        if numeric:
            scale = GIB if col == "kv_budget_bytes" else 1
            xs = {p: float(v) / scale for p, v in vals.items()}
            text = {p: f"{xs[p]:g}" for p in points}
            return _axis_name(col), xs, text, True
        text = {p: str(vals[p]) for p in points}
        return _axis_name(cols[0]), {p: float(i) for i, p in enumerate(points)}, text, False
    if cols:
        text = {
            p: ", ".join(f"{c.split('.')[-1]}={_fmt_value(value(p, c))}" for c in cols)
            for p in points
        }
        return "sweep point", {p: float(i) for i, p in enumerate(points)}, text, False
    return "sweep point", {p: float(p) for p in points}, {p: str(p) for p in points}, False


def _fmt_value(v) -> str:
    """A sweep value for a label: 16 rather than 16.0."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _is_number(v) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _point_title(summary: pd.DataFrame, point: int) -> str:
    """What a sweep point is, for a panel title: `block_size = 32` or `point 3`."""
    cols = sweep_columns(summary)
    if not cols:
        return f"point {point}"
    rows = summary[summary["point"] == point]
    bits = []
    for c in cols:
        vals = rows[c].dropna()
        if not len(vals):
            continue
        v = vals.iloc[0]
        if c == "kv_budget_bytes":
            v = format_bytes(float(v))
        bits.append(f"{c.split('.')[-1]} = {_fmt_value(v)}")
    return ", ".join(bits) or f"point {point}"


# ------------------------------------------------------------------------ 1. the breakdown
def _fractions(summary: pd.DataFrame) -> pd.DataFrame:
    """The five parts as fractions of the budget (`free` stands in for a missing
    `usable_free`)."""
    out = pd.DataFrame(index=summary.index)
    for p in PARTS:
        if p in summary.columns:
            out[p] = summary[p].astype(float)
        elif p == "usable_free" and "free" in summary.columns:
            out[p] = summary["free"].astype(float)
        else:
            out[p] = 0.0
    for p in INTERNAL_SPLIT:  # results written before the split have none
        if p in summary.columns:
            out[p] = summary[p].astype(float)
    return out.fillna(0.0)


#: internal fragmentation drawn as its two parts, when the summary has them.
INTERNAL_SPLIT = ("internal_overreservation", "internal_rounding")


def _drawn_parts(frac: pd.DataFrame) -> list[str]:
    """The stacked parts, bottom up: internal split into over-reservation and rounding."""
    if not all(p in frac.columns for p in INTERNAL_SPLIT):
        return list(PARTS)
    i = PARTS.index("internal")
    return [*PARTS[:i], *INTERNAL_SPLIT, *PARTS[i + 1:]]


def _breakdown_panels(summary: pd.DataFrame) -> list[tuple[str, list[str], pd.DataFrame, str]]:
    """(title, bar names, rows, x label) per panel: a panel per sweep point with a bar per
    allocator; a single allocator swept gets one panel with a bar per point."""
    points = sorted(int(p) for p in pd.unique(summary["point"]))
    labels = _labels(summary)
    if len(labels) == 1 and len(points) > 1:
        xlabel, _, text, _ = sweep_axis(summary)
        rows = summary.drop_duplicates("point").sort_values("point")
        names = [text[int(p)] for p in rows["point"]]
        return [(labels[0], names, rows.set_index(pd.Index(names)), xlabel)]
    panels = []
    for point in points:
        rows = summary[summary["point"] == point]
        rows = rows.set_index(rows["label"].astype(str))
        rows = rows[~rows.index.duplicated()]
        present = [lb for lb in labels if lb in rows.index]
        title = _point_title(summary, point) if len(points) > 1 else ""
        panels.append((title, present, rows.loc[present], ""))
    return panels


def breakdown_figure(summary: pd.DataFrame, meta: Mapping | None = None) -> Figure:
    """Stacked bars: the KV budget split into token states, reserved, internal, external and
    free (time-averaged, % of the budget), one bar per allocator and a panel per sweep point
    (one allocator swept: a bar per sweep point)."""
    summary = _with_keys(summary)
    panels = _breakdown_panels(summary)
    npanels = len(panels)
    nbars = max(len(names) for _, names, _, _ in panels)
    longest = max(len(n) for _, names, _, _ in panels for n in names)
    # Room for each bar's name; rotate the names when one panel would get too wide.
    per_bar = max(0.75, 0.085 * longest + 0.25)
    rotate = per_bar * nbars > 12
    if rotate:
        per_bar = 0.6
    panel_w = per_bar * nbars + 0.5
    ncols = max(1, min(npanels, int(13 / panel_w), 6))
    nrows = math.ceil(npanels / ncols)
    width = 1.0 + panel_w * ncols + 2.4
    height = (4.6 if nrows == 1 else 3.6) + (0.075 * longest if rotate else 0.0)
    fig = _new_figure(max(min(width, 17), 6.0), 0.6 + height * nrows, meta, summary)
    axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False).ravel()
    for ax in axes[npanels:]:
        ax.set_visible(False)
    for ax, (title, names, rows, xlabel) in zip(axes, panels, strict=False):
        frac = _fractions(rows) * 100
        x = np.arange(len(names))
        bottom = np.zeros(len(names))
        for p in _drawn_parts(frac):  # one collection per part: its colour across the bars
            _bars(
                ax,
                x,
                frac[p].to_numpy(),
                0.7,
                bottom=bottom,
                facecolors=PALETTE[p],
                edgecolors="white",
                linewidths=0.6,
                label=PART_NAMES[p],
                hatch=HATCH.get(p),
            )
            bottom += frac[p].to_numpy()
        for xi, ts in zip(x, frac["token_states"].to_numpy(), strict=True):
            inside = ts >= 7
            ax.text(
                xi,
                ts / 2 if inside else ts + 1,
                f"{ts:.0f}%",
                ha="center",
                va="center" if inside else "bottom",
                fontsize=9,
                fontweight="bold",
                color="white" if inside else "#1a5e1a",
            )
        ax.set_xticks(
            x,
            names,
            rotation=35 if rotate else 0,
            ha="right" if rotate else "center",
            rotation_mode="anchor" if rotate else "default",
        )
        ax.set_ylim(0, 100)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.yaxis.set_major_formatter(mticker.PercentFormatter(decimals=0))
        if title:
            ax.set_title(title, fontsize=10, fontweight="bold" if xlabel else "normal")
        if xlabel:
            ax.set_xlabel(xlabel)
        _finish_axes(ax)
    for ax in axes[::ncols]:
        ax.set_ylabel("share of the KV budget (time-averaged)")
    drawn = _drawn_parts(_fractions(summary))
    handles = [
        Patch(facecolor=PALETTE[p], edgecolor="white", hatch=HATCH.get(p), label=PART_NAMES[p])
        for p in reversed(drawn)
    ]
    legend = fig.legend(
        handles=handles,
        loc="outside right center",
        fontsize=9,
        frameon=False,
        title="% in the green bar:\ntoken states, the share\nof the budget holding KV",
        title_fontsize=8,
    )
    legend.get_title().set_color("#444444")
    fig.suptitle("Where the KV-cache budget goes, per allocator (time-averaged)", fontsize=11)
    return fig


# ------------------------------------------------------------------------- 2. over time
def resample(ts: pd.DataFrame, bins: int, columns: Sequence[str]) -> pd.DataFrame:
    """A piecewise-constant series (t, dt, columns) as `bins` equal steps, each the exact
    time-weighted mean of `columns` over its interval (areas are kept)."""
    t = ts["t"].to_numpy(float)
    dt = ts["dt"].to_numpy(float)
    edges_in = np.append(t, t[-1] + dt[-1])
    edges = np.linspace(edges_in[0], edges_in[-1], bins + 1)
    width = np.diff(edges)
    out = {"t": edges[:-1], "dt": width}
    for c in columns:
        cum = np.concatenate(([0.0], np.cumsum(ts[c].to_numpy(float) * dt)))
        at = np.interp(edges, edges_in, cum)
        out[c] = np.diff(at) / np.where(width > 0, width, 1.0)
    return pd.DataFrame(out)


def _steps(ts: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray]:
    """x and y for a `step='post'` drawing of a piecewise-constant column."""
    t = ts["t"].to_numpy(float)
    x = np.append(t, t[-1] + float(ts["dt"].iloc[-1]))
    y = ts[col].to_numpy(float)
    return x, np.append(y, y[-1])


def _timeline_panels(
    timeseries: pd.DataFrame, summary: pd.DataFrame | None, point: int | None
) -> tuple[list[tuple[str, pd.DataFrame, int]], str]:
    """(title, rows, point) per panel, and what the figure title adds: a panel per allocator
    at one sweep point, or, for a single allocator swept over a few points, one per point."""
    labels = _labels(summary) if summary is not None else _labels(timeseries)
    labels = [lb for lb in labels if (timeseries["label"].astype(str) == lb).any()]
    points = sorted(int(p) for p in pd.unique(timeseries["point"]))
    swept = summary is not None and "point" in summary.columns and summary["point"].nunique() > 1
    if point is None and len(labels) == 1 and 1 < len(points) <= _MAX_POINT_PANELS:
        rows = timeseries[timeseries["label"].astype(str) == labels[0]]
        panels = [
            (_point_title(summary, p) if swept else f"point {p}", rows[rows["point"] == p], p)
            for p in points
        ]
        return panels, f" ({labels[0]})"
    if point is None:
        point = points[0] if points else 0
    rows = timeseries[timeseries["point"] == point]
    panels = [(lb, rows[rows["label"].astype(str) == lb], point) for lb in labels]
    panels = [pn for pn in panels if len(pn[1])]
    if not panels:
        raise ValueError(f"no timeseries rows for point {point}")
    return panels, f" ({_point_title(summary, point)})" if swept else ""


def timeline_figure(
    timeseries: pd.DataFrame,
    summary: pd.DataFrame | None = None,
    meta: Mapping | None = None,
    point: int | None = None,
    max_segments: int = MAX_SEGMENTS,
) -> Figure:
    """The KV budget split into its five parts over time (GiB, stacked), per allocator, with
    the requests running and waiting in a small panel above each. One sweep point (`point`, or
    the first), except that a single allocator swept over a few points gets a panel per point.
    Runs longer than `max_segments` segments are time-averaged into that many steps."""
    timeseries = _with_keys(timeseries)
    panels, suffix = _timeline_panels(timeseries, summary, point)
    n = len(panels)
    ncols = n if n <= 3 else (2 if n == 4 else 3)
    nrows = math.ceil(n / ncols)
    fig = _new_figure(min(2.5 + 4.6 * ncols, 17), 0.9 + 4.0 * nrows, meta, summary)
    gs = fig.add_gridspec(2 * nrows, ncols, height_ratios=[1, 2.8] * nrows)
    top0 = low0 = None
    resampled = any_blocked = False
    ymax = 0.0
    lows = []
    peaks = {"running": 0.0, "waiting": 0.0}
    for i, (title, ts, pt) in enumerate(panels):
        r, c = divmod(i, ncols)
        low = fig.add_subplot(gs[2 * r + 1, c], sharex=low0, sharey=low0)
        top = fig.add_subplot(gs[2 * r, c], sharex=low, sharey=top0)
        low0 = low0 or low
        top0 = top0 or top
        lows.append(low)
        ts = ts.sort_values("t", kind="stable")
        ts = ts[ts["dt"] > 0] if (ts["dt"] > 0).any() else ts
        if "frag_blocked" in ts.columns:
            ts = ts.assign(frag_blocked=ts["frag_blocked"].astype(float))
        if len(ts) > max_segments:
            cols = [c for c in (*PARTS, "running", "waiting", "frag_blocked") if c in ts.columns]
            ts = resample(ts, max_segments, cols)
            resampled = True
        # Requests running and waiting.
        for col, color, z in (("waiting", WAITING_COLOR, 2), ("running", RUNNING_COLOR, 3)):
            if col in ts.columns:
                x, y = _steps(ts, col)
                top.plot(x, y, drawstyle="steps-post", color=color, lw=1.0, label=col, zorder=z)
                peaks[col] = max(peaks[col], float(np.nanmax(y)))
        if "frag_blocked" in ts.columns:
            x, y = _steps(ts, "frag_blocked")
            mask = y >= 0.5
            if mask.any():
                any_blocked = True
                top.fill_between(
                    x,
                    0,
                    1,
                    where=mask,
                    step="post",
                    color=PALETTE["external"],
                    alpha=0.25,
                    lw=0,
                    transform=top.get_xaxis_transform(),
                    label="queue head refused: fragmented",
                )
        top.set_title(title, fontsize=10, fontweight="bold")
        top.tick_params(labelbottom=False)
        _finish_axes(top)
        # The budget, stacked.
        bottom = None
        for p in PARTS:
            if p not in ts.columns:
                continue
            x, y = _steps(ts, p)
            y = y / GIB
            base = np.zeros_like(y) if bottom is None else bottom
            low.fill_between(
                x,
                base,
                base + y,
                step="post",
                color=PALETTE[p],
                lw=0,
                label=PART_NAMES[p],
                rasterized=len(x) > 500,
            )
            bottom = base + y
        if bottom is not None:
            ymax = max(ymax, float(np.nanmax(bottom)))
        if summary is not None and "kv_budget_bytes" in summary.columns:
            cap = summary.loc[_with_keys(summary)["point"] == pt, "kv_budget_bytes"].dropna()
            if len(cap):
                ymax = max(ymax, float(cap.max()) / GIB)
        low.set_xlabel("time (s)")
        low.margins(x=0)
        _finish_axes(low)
    low0.set_ylim(0, ymax * 1.001 if ymax > 0 else 1)
    top0.set_ylim(0, max(peaks.values()) * 1.08 or 1)
    log_queue = peaks["waiting"] > 10 * max(peaks["running"], 1.0)
    if log_queue:  # a long queue would flatten the running line: show both on a symlog scale
        top0.set_yscale("symlog", linthresh=10)
        top0.set_ylim(0, peaks["waiting"] * 1.5)
        top0.yaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
    for i, ax in enumerate(lows):
        if i % ncols == 0:
            ax.set_ylabel("KV memory (GiB)")
    for ax in fig.axes:
        if ax.get_subplotspec().colspan.start == 0 and ax not in lows:
            ax.set_ylabel("requests" + ("\n(symlog)" if log_queue else ""))
    handles = [Patch(color=PALETTE[p], label=PART_NAMES[p]) for p in reversed(PARTS)]
    handles += [
        Line2D([], [], color=RUNNING_COLOR, label="requests running"),
        Line2D([], [], color=WAITING_COLOR, label="requests waiting"),
    ]
    if any_blocked:
        handles.append(
            Patch(color=PALETTE["external"], alpha=0.25, label="queue head refused:\nfragmented")
        )
    fig.legend(handles=handles, loc="outside right center", fontsize=9, frameon=False)
    title = "KV-cache budget over time, per allocator" + suffix
    if resampled:
        title += f"\n(long runs: time-averaged in {max_segments} steps)"
    fig.suptitle(title, fontsize=11)
    return fig


# ------------------------------------------------------------------- 3. the address space
def slab_polygons(
    requests: pd.DataFrame,
    bytes_per_token: float,
    end_s: float | None = None,
) -> dict[str, np.ndarray]:
    """Polygons (time s, address GiB) of each admitted slab's stored tokens, reserved and
    internal parts, and its outline: arrays of shape (requests, corners, 2). Stored tokens grow
    linearly from the prompt plus the first output token's slot (at the first token) to the
    final length (at the finish); the slab is held until `released_s` (static batching frees a
    batch together). A request still running at the end (`end_s`) is drawn as long as it was
    then (`tokens_at_end`)."""
    req = requests[requests["admitted_s"].notna() & requests["offset_bytes"].notna()]
    if end_s is None:
        end_s = (
            float(np.nanmax(req[["finished_s", "admitted_s"]].to_numpy(float))) if len(req) else 0.0
        )
    a = req["admitted_s"].to_numpy(float)
    fin = req["finished_s"].to_numpy(float)
    unfinished = np.isnan(fin)
    fin = np.where(unfinished, end_s, fin)
    # Static batching holds a finished request's slab until its whole batch is done.
    rel = req["released_s"].to_numpy(float) if "released_s" in req else fin
    rel = np.where(np.isnan(rel), fin, np.maximum(rel, fin))
    f1 = req["first_token_s"].to_numpy(float)
    f1 = np.clip(np.where(np.isnan(f1), fin, f1), a, fin)
    off = req["offset_bytes"].to_numpy(float) / GIB
    peak = req["peak_bytes"].to_numpy(float) / GIB
    b = float(bytes_per_token) / GIB
    final = req["final_tokens"].to_numpy(float) * b
    # A request still running when the run stopped has no recorded slab size (peak 0): draw
    # the slab as its final length, since the reservation beyond that is unknown.
    peak = np.where(peak > 0, peak, final)
    final = np.minimum(np.where(final > 0, final, peak), peak)
    s0 = np.minimum((req["prompt_tokens"].to_numpy(float) + 1) * b, final)
    s1 = final
    if unfinished.any():  # still running when the run stopped: as long as it was then
        at_end = req["tokens_at_end"].to_numpy(float) * b
        s1 = np.where(unfinished, np.clip(at_end, s0, final), final)

    def polys(*corners: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        return np.stack([np.stack([x, y], axis=-1) for x, y in corners], axis=1)

    stored = polys(
        (a, off), (a, off + s0), (f1, off + s0), (fin, off + s1), (rel, off + s1), (rel, off)
    )
    reserved = polys(
        (a, off + s0),
        (f1, off + s0),
        (fin, off + s1),
        (rel, off + s1),
        (rel, off + final),
        (a, off + final),
    )
    internal = polys((a, off + final), (rel, off + final), (rel, off + peak), (a, off + peak))
    outline = polys((a, off), (rel, off), (rel, off + peak), (a, off + peak))
    return {"token_states": stored, "reserved": reserved, "internal": internal, "outline": outline}


def _slab_labels(requests: pd.DataFrame, summary: pd.DataFrame | None) -> list[str]:
    """Labels whose requests have slab offsets (contiguous and buddy allocators)."""
    requests = _with_keys(requests)
    has = requests.groupby(requests["label"].astype(str))["offset_bytes"].apply(
        lambda s: s.notna().any()
    )
    order = _labels(summary) if summary is not None else _labels(requests)
    return [lb for lb in order if has.get(lb, False)]


def address_map_figure(
    requests: pd.DataFrame,
    summary: pd.DataFrame,
    meta: Mapping | None = None,
    point: int | None = None,
    max_slabs: int = MAX_SLABS,
    timeseries: pd.DataFrame | None = None,
) -> Figure | None:
    """Every slab of each contiguous or buddy allocator in the address space over time: stored
    tokens green, reserved orange, internal fragmentation red, holes white. None when no
    allocator has slabs. More than `max_slabs` slabs: the first by admission are drawn."""
    requests = _with_keys(requests)
    summary = _with_keys(summary)
    if "offset_bytes" not in requests.columns:
        return None
    if point is None:
        point = _first_point(requests)
    requests = requests[requests["point"] == point]
    labels = _slab_labels(requests, summary)
    if not labels:
        return None
    n = len(labels)
    fig = _new_figure(11.5, 0.9 + 3.2 * n, meta, summary)
    axes = fig.subplots(n, 1, sharex=True, squeeze=False).ravel()
    sums = (
        summary[summary["point"] == point]
        .drop_duplicates("label")
        .set_index(
            summary.loc[summary["point"] == point].drop_duplicates("label")["label"].astype(str)
        )
    )
    xmax = 0.0
    for ax, label in zip(axes, labels, strict=True):
        req = requests[requests["label"].astype(str) == label]
        req = req[req["admitted_s"].notna() & req["offset_bytes"].notna()].sort_values(
            "admitted_s", kind="stable"
        )
        row = sums.loc[label] if label in sums.index else None
        bpt = _row_value(row, "bytes_per_token", summary, "bytes_per_token")
        cap = _row_value(row, "kv_budget_bytes", summary, "kv_budget_bytes")
        if cap is None:
            cap = _row_value(row, "capacity_bytes", summary, "capacity_bytes")
        end_s = tsl = None
        if timeseries is not None and len(timeseries):
            tsl = _with_keys(timeseries)
            tsl = tsl[(tsl["point"] == point) & (tsl["label"].astype(str) == label)]
            if len(tsl):
                end_s = float((tsl["t"] + tsl["dt"]).max())
        total = len(req)
        right = None
        if total > max_slabs:
            right = float(req["admitted_s"].iloc[max_slabs])
            req = req.iloc[:max_slabs]
        polys = slab_polygons(req, bpt, end_s)
        for part in ("token_states", "reserved", "internal"):
            color = PALETTE[part]
            alpha = 1.0 if part == "token_states" else 0.55
            ax.add_collection(
                PolyCollection(
                    polys[part],
                    facecolors=color,
                    edgecolors="none",
                    alpha=alpha,
                    rasterized=True,
                    antialiased=False,
                )
            )
        ax.add_collection(  # thin outlines tell neighbouring slabs apart
            PolyCollection(
                polys["outline"],
                facecolors="none",
                edgecolors="#555555",
                linewidths=0.3 if len(req) < 300 else 0.12,
                alpha=0.8 if len(req) < 300 else 0.5,
                rasterized=True,
            )
        )
        if right is None:
            fin = req["finished_s"].dropna()
            right = max(float(fin.max()) if len(fin) else 0.0, end_s or 0.0)
        xmax = max(xmax, right)
        ax.set_ylim(0, (cap / GIB) if cap else float(np.nanmax(polys["outline"][..., 1])))
        ax.set_ylabel("address (GiB)")
        title = f"{label}"
        if total > max_slabs:
            title += (
                f": first {max_slabs} of {total} slabs by admission time (up to t = {right:.0f} s)"
            )
        ax.set_title(title, fontsize=10, fontweight="bold", loc="left")
        ax.set_facecolor("white")
        for side in ("top", "right"):
            ax.spines[side].set_visible(True)
    axes[0].set_xlim(0, xmax if xmax > 0 else 1)
    axes[-1].set_xlabel("time (s)")
    handles = [
        Patch(color=PALETTE["token_states"], label="token states (stored)"),
        Patch(color=PALETTE["reserved"], alpha=0.55, label="reserved (not yet written)"),
        Patch(color=PALETTE["internal"], alpha=0.55, label="internal fragmentation"),
        Patch(facecolor="white", edgecolor="#555555", label="hole (free)"),
    ]
    fig.legend(handles=handles, loc="outside right center", fontsize=9, frameon=False)
    title = (
        "Address space of the slab allocators: one rectangle per request's slab, "
        "from admission to finish"
    )
    if summary["point"].nunique() > 1:
        title += f"\n({_point_title(summary, point)})"
    fig.suptitle(title, fontsize=11)
    return fig


def _row_value(row, col: str, summary: pd.DataFrame, fallback: str):
    if row is not None and col in row.index and pd.notna(row[col]):
        return float(row[col])
    v = _first(summary, fallback)
    return float(v) if v is not None else None


# ------------------------------------------------------------------------ 4. capacity
def capacity_figure(summary: pd.DataFrame, meta: Mapping | None = None) -> Figure:
    """Requests running at once (mean and max) and decode throughput per allocator; for a
    sweep, both against the swept value, a line per allocator."""
    summary = _with_keys(summary)
    labels = _labels(summary)
    if summary["point"].nunique() > 1:
        return _capacity_sweep(summary, labels, meta)
    rows = (
        summary.drop_duplicates("label")
        .set_index(summary.drop_duplicates("label")["label"].astype(str))
        .loc[labels]
    )
    per_bar = max(0.75, 0.085 * max(len(s) for s in labels) + 0.25)
    long_names = 2 * (1.0 + per_bar * len(labels)) > 15
    if long_names:
        per_bar = 0.6
    fig = _new_figure(
        max(min(2 * (1.0 + per_bar * len(labels)), 15), 7.0),
        4.6 + (0.08 * max(len(s) for s in labels) if long_names else 0),
        meta,
        summary,
    )
    ax_run, ax_tp = fig.subplots(1, 2)
    x = np.arange(len(labels))
    mean = np.nan_to_num(
        rows["mean_running"].to_numpy(float) if "mean_running" in rows else np.zeros(len(x))
    )
    mx = rows["max_running"].to_numpy(float) if "max_running" in rows else np.full(len(x), np.nan)
    _bars(ax_run, x, mean, 0.6, facecolors=BAR_COLOR, edgecolors="none")
    ax_run.hlines(mx, x - 0.3, x + 0.3, colors="black", linewidths=2.0, zorder=3)
    for xi, m, top in zip(x, mean, mx, strict=True):
        ax_run.text(
            xi,
            m / 2,
            f"{m:.1f}",
            ha="center",
            va="center",
            color="white",
            fontsize=9,
            fontweight="bold",
        )
        if np.isfinite(top):
            ax_run.text(xi, top, f"{top:.0f}", ha="center", va="bottom", fontsize=8)
    ax_run.set_ylabel("requests running at once")
    ax_run.set_title(
        "Requests running at once\n(bar: time-averaged mean, black line: max)", fontsize=10
    )
    ax_run.set_ylim(0, _top(np.append(mx, mean)) * 1.18)
    tp = np.nan_to_num(
        rows["throughput_tok_s"].to_numpy(float) if "throughput_tok_s" in rows else np.zeros(len(x))
    )
    _bars(ax_tp, x, tp, 0.6, facecolors=BAR_COLOR, edgecolors="none")
    for xi, v in zip(x, tp, strict=True):
        ax_tp.text(xi, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
    ax_tp.set_ylabel("throughput (generated tokens / s)")
    ax_tp.set_title("Throughput\n(generated tokens over the run's span)", fontsize=10)
    ax_tp.set_ylim(0, _top(tp) * 1.12)
    for ax in (ax_run, ax_tp):
        ax.set_xticks(
            x,
            labels,
            rotation=35 if long_names else 0,
            ha="right" if long_names else "center",
            rotation_mode="anchor" if long_names else "default",
        )
        _finish_axes(ax)
    fig.suptitle("Serving capacity per allocator", fontsize=11)
    return fig


def _top(values: np.ndarray) -> float:
    """The largest finite value, at least 1 (an axis limit that is never NaN or zero)."""
    finite = values[np.isfinite(values)]
    return max(float(finite.max()), 1.0) if len(finite) else 1.0


def _capacity_sweep(summary: pd.DataFrame, labels: list[str], meta) -> Figure:
    xlabel, xs, text, numeric = sweep_axis(summary)
    fig = _new_figure(12, 4.8, meta, summary)
    ax_run, ax_tp = fig.subplots(1, 2, sharex=True)
    for i, label in enumerate(labels):
        rows = summary[summary["label"].astype(str) == label].sort_values("point")
        rows = rows.drop_duplicates("point")
        x = np.array([xs[int(p)] for p in rows["point"]])
        order = np.argsort(x, kind="stable")
        x = x[order]
        style = _label_style(i)
        if "mean_running" in rows:
            ax_run.plot(x, rows["mean_running"].to_numpy(float)[order], label=label, ms=5, **style)
        if "max_running" in rows:
            ax_run.plot(
                x,
                rows["max_running"].to_numpy(float)[order],
                color=style["color"],
                marker=style["marker"],
                ms=6,
                linestyle="none",
                mfc="none",
                mew=1.0,
                alpha=0.7,
            )
        if "throughput_tok_s" in rows:
            ax_tp.plot(
                x, rows["throughput_tok_s"].to_numpy(float)[order], label=label, ms=5, **style
            )
    ax_run.set_ylabel("requests running at once")
    ax_run.set_title(
        "Requests running at once\n(filled, joined: time-averaged mean; hollow: max)",
        fontsize=10,
    )
    ax_tp.set_ylabel("throughput (generated tokens / s)")
    ax_tp.set_title("Throughput", fontsize=10)
    values = sorted(set(xs.values()))
    log_x = numeric and values[0] > 0 and values[-1] / values[0] >= 8
    for ax in (ax_run, ax_tp):
        ax.set_xlabel(xlabel + (" (log scale)" if log_x else ""))
        ys = [np.asarray(ln.get_ydata(), float) for ln in ax.get_lines()]
        ax.set_ylim(0, _top(np.concatenate(ys) if ys else np.zeros(0)) * 1.1)
        if log_x:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_minor_locator(mticker.NullLocator())
            ax.xaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
        if not numeric or len(xs) <= 12:
            ticks = sorted(set(xs.values()))
            names = {xs[p]: text[p] for p in xs}
            rot = 30 if max(len(s) for s in names.values()) > 8 else 0
            ax.set_xticks(
                ticks, [names[t] for t in ticks], rotation=rot, ha="right" if rot else "center"
            )
        ax.grid(alpha=0.3)
        _finish_axes(ax)
    fig.legend(
        *ax_tp.get_legend_handles_labels(), loc="outside right center", fontsize=9, frameon=False
    )
    fig.suptitle(f"Serving capacity against {xlabel}, per allocator", fontsize=11)
    return fig


# ---------------------------------------------------------------------- 5. the workload
def lengths_figure(
    requests: pd.DataFrame, meta: Mapping | None = None, summary: pd.DataFrame | None = None
) -> Figure:
    """Cumulative distributions of the workload's prompt and output lengths (tokens). All
    allocators replay the same workload, so the first label's requests are used."""
    requests = _with_keys(requests)
    point = _first_point(requests)
    req = requests[requests["point"] == point]
    label = _labels(req)[0]
    req = req[req["label"].astype(str) == label]
    fig = _new_figure(7.5, 4.6, meta, summary)
    ax = fig.subplots()
    lo, hi = math.inf, 0.0
    for col, color, name in (
        ("prompt_tokens", PROMPT_COLOR, "prompt"),
        ("output_tokens", OUTPUT_COLOR, "output"),
    ):
        if col not in req.columns:
            continue
        v = np.sort(req[col].dropna().to_numpy(float))
        if not len(v):
            continue
        y = np.arange(1, len(v) + 1) / len(v)
        med, p99 = np.percentile(v, 50), np.percentile(v, 99)
        if len(v) > _CDF_POINTS:  # keep the SVG small: the CDF at evenly spaced ranks
            keep = np.unique(np.linspace(0, len(v) - 1, _CDF_POINTS).round().astype(int))
            v, y = v[keep], y[keep]
        ax.step(
            np.append(v[:1], v),
            np.append(0, y),
            where="post",
            color=color,
            lw=1.6,
            label=f"{name} tokens (median {med:,.0f}, p99 {p99:,.0f}, max {v[-1]:,.0f})",
        )
        lo, hi = min(lo, v[0]), max(hi, v[-1])
    if hi > 0 and lo > 0 and hi / lo > 200:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("length (tokens)" + (", log scale" if ax.get_xscale() == "log" else ""))
    ax.set_ylabel("fraction of requests ≤ length")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=True, framealpha=0.9, edgecolor="none", loc="upper left")
    _finish_axes(ax)
    ax.set_title(f"Workload: request lengths ({len(req):,} requests)", fontsize=11)
    return fig


# ------------------------------------------------------------------------ reading files
def read_summary(path: Path | str) -> pd.DataFrame:
    """`summary.csv`, checked before it is drawn: pandas reads a truncated or foreign file into
    NaN-padded rows (or none) without a word, and the figures would then silently show
    nothing, or the wrong thing. Raises `ResultsFileError` naming the file and the damage."""
    path = Path(path)

    def bad(what: str) -> ResultsFileError:
        return ResultsFileError(f"{path}: {what}")

    def foreign(why: str) -> ResultsFileError:
        return bad(f"not a CSV written by kvfrag run ({why})")

    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise foreign("not UTF-8 text") from None
    except OSError as exc:
        raise bad(f"cannot be read ({exc.strerror or exc})") from None
    if "\0" in text:
        raise foreign("binary data")
    failed = (path.parent / "failures.csv").exists()
    if failed and not text.strip(" ,\r\n"):  # what `kvfrag run` writes when no run finished
        raise bad("no runs in it (every run failed: see failures.csv)")
    if not text.strip():
        raise bad("empty file")
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: list[str] | None = None
    rows = 0
    try:
        for row in reader:
            if not row:
                continue  # a blank line
            if header is None:
                header = row
            elif len(row) != len(header):
                raise bad(
                    f"line {reader.line_num} has {len(row)} fields, the header {len(header)} "
                    "(truncated or damaged)"
                )
            else:
                rows += 1
    except csv.Error as exc:
        raise bad(f"line {reader.line_num}: {exc} (truncated or damaged)") from None
    if header is None:
        raise bad("empty file")
    if not text.endswith(("\n", "\r")):
        raise bad("truncated (its last line does not end)")
    present = set(header) | ({"usable_free"} if "free" in header else set())
    missing = [c for c in SUMMARY_COLUMNS if c not in present]
    if len(missing) == len(SUMMARY_COLUMNS):
        raise foreign(f"no {', '.join(SUMMARY_COLUMNS)} columns")
    if missing:
        raise bad(f"missing columns {', '.join(missing)}")
    if not rows:
        raise bad("no rows, only a header")
    summary = pd.read_csv(io.StringIO(text))
    for col in ("point", *PARTS):
        if col not in summary.columns:
            continue  # `usable_free`, when `free` stands in for it
        values = pd.to_numeric(summary[col], errors="coerce")
        if col == "point" and not values.isna().any() and (values % 1 != 0).any():
            raise bad("column point holds values that are not whole numbers")
        if values.isna().any():
            raise bad(f"column {col} holds values that are not numbers")
    if summary["label"].isna().any():
        raise bad("column label has empty values")
    return summary


def read_frame(path: Path | str, columns: Sequence[str]) -> pd.DataFrame:
    """A Parquet file of a results folder, with the `columns` the figures need; a damaged
    one raises `ResultsFileError` naming it (pyarrow's own errors do not always)."""
    from pyarrow import ArrowException

    path = Path(path)
    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError, ArrowException) as exc:
        lines = str(exc).strip().splitlines()
        why = lines[0] if lines else ""
        if str(path) in why:  # "Could not open Parquet input source '<path>': <why>"
            why = why.split(str(path))[-1].lstrip("'\": ")
        why = why or type(exc).__name__
        raise ResultsFileError(f"{path}: not a readable Parquet file, damaged? ({why})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ResultsFileError(f"{path}: missing columns {', '.join(missing)}")
    return frame


# ------------------------------------------------------------------------ entry points
def plot_results(
    results_dir: Path | str, meta: Mapping | None = None, svg: bool = False
) -> list[Path]:
    """Draw every figure for a results folder into `results_dir/plots/`: PNG, and SVG too with
    `svg`; a figure whose Parquet file is missing or has no rows is skipped. Returns the paths.
    A damaged file raises `ResultsFileError` (a ValueError) before anything is drawn.

    A figure whose SVG is already there (from an earlier `svg=True` draw) gets its SVG redrawn
    too, even without `svg`: an SVG left as it was would claim to show these results while it
    shows older ones. Redrawn rather than removed, so nothing is ever deleted here and the
    folder's manifest, which lists the file already, stays right as it is."""
    results_dir = Path(results_dir)
    out = results_dir / "plots"
    summary = read_summary(results_dir / "summary.csv")
    ts_path, req_path = results_dir / "timeseries.parquet", results_dir / "requests.parquet"
    timeseries = read_frame(ts_path, TIMESERIES_COLUMNS) if ts_path.exists() else None
    requests = read_frame(req_path, REQUESTS_COLUMNS) if req_path.exists() else None
    has_ts = timeseries is not None and len(timeseries) > 0
    has_req = requests is not None and len(requests) > 0
    # Built one at a time, so that only one figure is in memory at once.
    builders: list[tuple[str, Callable[[], Figure | None]]] = [
        ("breakdown", lambda: breakdown_figure(summary, meta)),
        ("timeline", lambda: timeline_figure(timeseries, summary, meta) if has_ts else None),
        (
            "address_map",
            lambda: (
                address_map_figure(requests, summary, meta, timeseries=timeseries)
                if has_req
                else None
            ),
        ),
        ("capacity", lambda: capacity_figure(summary, meta)),
        ("lengths", lambda: lengths_figure(requests, meta, summary) if has_req else None),
    ]
    paths: list[Path] = []
    for name, build in builders:
        fig = build()
        if fig is not None:
            paths += save_figure(fig, out / name, svg or (out / f"{name}.svg").exists())
    return paths


def load_meta(results_dir: Path | str) -> dict:
    """The caption's facts from `results_dir/scenario.resolved.yaml`, if it is there (missing
    file or keys: an empty or partial dict)."""
    path = Path(results_dir) / "scenario.resolved.yaml"
    if not path.exists():
        return {}
    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(doc, Mapping):
        return {}
    meta: dict = {}
    if doc.get("name"):
        meta["scenario"] = str(doc["name"])
    model = doc.get("model")
    if isinstance(model, Mapping):
        model = model.get("name")
    if model:
        meta["model"] = str(model)
    for key in ("kv_budget", "max_model_len"):
        if doc.get(key) is not None:
            meta[key] = doc[key]
    if doc.get("workload") is not None:
        meta["workload"] = doc["workload"]
    return meta


def redraw(results_dir: Path | str, svg: bool = False) -> list[Path]:
    """`kvfrag plot RESULTS_DIR [--svg]`: redraw a results folder's figures from its files
    (PNG; SVG too with `svg`, and wherever an SVG was drawn before: see `plot_results`)."""
    return plot_results(Path(results_dir), load_meta(results_dir), svg)


__all__ = [
    "FIGURES",
    "PALETTE",
    "PARTS",
    "PART_NAMES",
    "ResultsFileError",
    "address_map_figure",
    "breakdown_figure",
    "capacity_figure",
    "caption",
    "caption_parts",
    "format_bytes",
    "lengths_figure",
    "load_meta",
    "plot_results",
    "read_frame",
    "read_summary",
    "redraw",
    "resample",
    "save_figure",
    "slab_polygons",
    "sweep_axis",
    "sweep_columns",
    "timeline_figure",
]
