"""Figures of a results folder: where the KV budget went, over time, in the address space.

`plot_results(results_dir, meta)` reads what a run wrote (`summary.csv`, `timeseries.parquet`,
`requests.parquet`) and writes every figure into `results_dir/plots/` as PNG, and as SVG too
with `svg=True` (`kvfrag run --svg`, `kvfrag plot --svg`): each format is a full render of its
own, and the SVGs add about two thirds to the PNGs' drawing time, so they are opt-in.
Each figure also has its own function that takes DataFrames and returns a matplotlib `Figure`,
so figures can be built (and tested) without files:

- `breakdown_figure(summary)`: stacked bars, the budget split into its five parts per allocator
  (and, when the parts that hold no tokens are small, a row that zooms in on them)
- `timeline_figure(timeseries)`: the same split over time, with running and waiting requests
- `address_map_figure(requests, summary)`: every slab of a contiguous or buddy allocator
- `capacity_figure(summary)`: requests running at once, throughput and latency, and what a
  scenario is about where its runs show it (prefix-cache hits, memory saved by sharing,
  compaction stall); against the swept value for a sweep
- `lengths_figure(requests)`: the workload's prompt and output length distributions

The timeline and the address map draw every sweep point (a panel per allocator and point, up to
MAX_PANELS), or one (`point`, `kvfrag plot --point N`: `plots/timeline-pointN.png`, beside
the all-points figures). Sweep points are named as the printed
table names them (`block_size=32`, `n=2`: `point_names`), byte axes in the unit that fits the
budget (`byte_unit`), and a panel with nothing to draw says why.

A figure draws at most what a person can read, and says in its title what it leaves out: the
first MAX_ALLOCATORS allocators in the scenario's order; of a sweep, MAX_POINT_PANELS points
of the breakdown and MAX_LINE_POINTS along the capacity figure's lines, evenly spaced with the
first and last (`spread`), and the first points that fill MAX_PANELS panels of the timeline
and the address map. `plot_results` says it on stderr too, a line each (`left_out`), and
names a missing Parquet file and the figures left out for it.

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
import sys
import textwrap
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import matplotlib
import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from kvfrag.csvcells import unescape
from kvfrag.results import (
    OPTION_PREFIX,
    check_schema,
    folder_schema,
    short_labels,
    upgrade_summary,
    upgrade_timeseries,
)
from kvfrag.sim.allocators.base import PARTS  # the five parts, bottom to top of every stack
from kvfrag.sim.allocators.torch_caching import ADDRESS_BASE
from kvfrag.sim.engine import REJECT_REASONS

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
PALETTE["internal_padding"] = "#8c1c13"
PALETTE["internal_out_of_window"] = "#e8706a"
#: Hatching that tells internal fragmentation's parts apart (rounding from over-reservation;
#: a hybrid model's padding and out-of-window bytes).
HATCH: dict[str, str] = {"internal_rounding": "///", "internal_padding": "xx",
                         "internal_out_of_window": ".."}

#: How each part is named in legends.
PART_NAMES: dict[str, str] = {
    "token_states": "token states",
    "reserved": "reserved (not yet written)",
    "internal": "internal fragmentation",
    "internal_overreservation": "internal: over-reservation",
    "internal_rounding": "internal: rounding",
    "internal_padding": "internal: padding",
    "internal_out_of_window": "internal: out of window",
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

#: More slabs than this in one address-map panel: the first ones by admission time are drawn.
MAX_SLABS = 3000
#: At most this many panels (allocator x sweep point) in the timeline and in the address map:
#: a larger sweep shows its first points, and `kvfrag plot --point N` draws any one.
MAX_PANELS = 16
#: More timeseries segments than this per allocator: time-averaged into this many bins.
MAX_SEGMENTS = 2000
#: At most this many allocators in a figure (a bar, a line or a panel each): the first in the
#: scenario's order. Sixteen lines are still told apart (8 colours, 4 line styles, 8 markers)
#: and sixteen bars keep their names level; 2,000 would take hours to draw, and no one reads
#: them. The figure, `kvfrag run`/`kvfrag plot` and report.html say how many are left out.
MAX_ALLOCATORS = 16
#: At most this many sweep points in the breakdown (a panel each; one allocator: a bar each),
#: and at most MAX_BARS bars in all (sixteen allocators: six points): a panel needs room for
#: its bars' names. The points are evenly spaced, the first and last included (`spread`).
MAX_POINT_PANELS = 24
MAX_BARS = 96
#: At most this many sweep points along a line (the capacity figure against the swept value),
#: evenly spaced, the first and last included: a line needs far less room per point than a
#: panel, and fifty markers still stand apart.
MAX_LINE_POINTS = 50
#: At most this many named ticks on an axis of sweep points (more are thinned, evenly).
_MAX_TICKS = 16

#: More requests than this: the length CDFs are drawn through this many evenly spaced ranks.
_CDF_POINTS = 2000

GIB = 2**30
_T = TypeVar("_T")
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
    "capacity_bytes",
    "sim_time_s",
    "token_states_frac",
    "reserved_frac",
    "internal_frac",
    "external_frac",
    "usable_free_frac",
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
    "memory_saved_by_sharing_frac",
    "prefill_tokens_skipped",
    "prefill_tokens_skipped_first",
    "internal_overreservation_frac",
    "internal_padding_frac",
    "internal_out_of_window_frac",
    "internal_rounding_frac",
    *(f"{stat}_{col}" for col in ("ttft_s", "tpot_s") for stat in ("mean", "p50", "p90", "p99")),
    "prefix_hit_rate_tokens",
    "prefix_hit_rate_first_tokens",
    "compactions",
    "bytes_moved",
    "stall_s",
    "seed",
    "wall_s",
}
# Run settings that a sweep may change although they are not sweep-key columns themselves.
_SETTING_COLUMNS = ("kv_budget_bytes", "max_model_len", "bytes_per_token")

#: The summary's column of each part: a fraction of the budget (summary.csv, `<part>_frac`).
FRAC = {p: f"{p}_frac" for p in (*PARTS, "internal_overreservation", "internal_padding",
                                  "internal_out_of_window", "internal_rounding")}
#: The time series' column of each part: bytes (timeseries.parquet, `<part>_bytes`).
BYTES = {p: f"{p}_bytes" for p in PARTS}

#: Columns of each results file that the figures cannot do without (old layouts are
#: translated first: `kvfrag.results.upgrade_summary`). A file without them was not written
#: by `kvfrag run`.
SUMMARY_COLUMNS = ("label", "point", *(FRAC[p] for p in PARTS))
TIMESERIES_COLUMNS = ("t_s", "dt_s")
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


_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def byte_unit(top: float) -> tuple[str, float]:
    """The unit an axis that reaches `top` bytes reads best in, and its size in bytes: GiB for
    a 12 GiB budget, MiB for a 16 MiB one (ticks 0-16 rather than 0.000-0.014)."""
    for name, size in _UNITS:
        if top >= size:
            return name, float(size)
    return "B", 1.0


def _say(ax: Axes, text: str, width: int = 60) -> None:
    """An empty panel that says why it is empty, instead of being blank."""
    ax.text(
        0.5,
        0.5,
        textwrap.fill(text, width),
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=9,
        color="#555555",
        linespacing=1.4,
    )
    # (tick_params, not set_xticks: the panel may share its axes' tick locators with others)
    ax.tick_params(left=False, labelleft=False, bottom=False, labelbottom=False)


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


def spread(points: Sequence[_T], most: int) -> list[_T]:
    """At most `most` of `points`, evenly spaced, the first and last included (all of them
    when there are as few): a subset that spans the whole sweep, the same on every draw."""
    points = list(points)
    if len(points) <= most:
        return points
    if most <= 1:
        return points[:1]
    return [points[i] for i in np.linspace(0, len(points) - 1, most).round().astype(int)]


def _breakdown_keep(labels: list[str], points: list[int]) -> tuple[list[str], list[int]]:
    """The allocators and sweep points the breakdown draws (MAX_ALLOCATORS, MAX_POINT_PANELS,
    MAX_BARS)."""
    labels = labels[:MAX_ALLOCATORS]
    return labels, spread(points, max(1, min(MAX_POINT_PANELS, MAX_BARS // max(len(labels), 1))))


def _panel_keep(labels: list[str], points: list[int]) -> tuple[list[str], list[int]]:
    """The allocators and sweep points the timeline and the address map draw, a panel each:
    the first MAX_ALLOCATORS, and the first points that keep the panels to MAX_PANELS (the
    others one at a time: `kvfrag plot --point N`)."""
    labels = labels[:MAX_ALLOCATORS]
    return labels, points[: max(1, MAX_PANELS // max(len(labels), 1))]


def _allocators_note(shown: int, total: int, what: str = "allocators") -> list[str]:
    """The figure's note on allocators left out (none when none are)."""
    if shown >= total:
        return []
    return [f"showing {shown} of {total:,} {what}: the first {shown} in the scenario's order"]


def _points_note(shown: int, total: int) -> list[str]:
    """The figure's note on sweep points left out by `spread` (none when none are)."""
    if shown >= total:
        return []
    return [f"showing {shown} of {total:,} sweep points: evenly spaced, the first and last "
            "included"]


def _notes_text(notes: Sequence[str], width_in: float) -> str:
    """Notes for the end of a figure's title: each in brackets on lines of its own, wrapped to
    the figure's width (at the title's 11 pt)."""
    chars = max(int(width_in * 72 / (11 * 0.56)), 30)
    return "".join("\n" + textwrap.fill(f"({note})", chars) for note in notes)


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
    # The budget the runs used (summary.csv) rather than how the scenario gave it: a number,
    # a size string or a GPU's terms (a mapping) all read `12 GiB`, as the axes do.
    budget = meta.get("kv_budget")
    derived = isinstance(budget, Mapping)
    col = "kv_budget_bytes" if _first(summary, "kv_budget_bytes") is not None else "capacity_bytes"
    keys = _swept_keys(summary)
    swept = "kv_budget" in keys or col in keys
    spread_ = _range(summary, col, format_bytes)
    if spread_:
        # A budget swept itself, or one derived per point (a sweep over max_num_seqs changes
        # the activation reserve, so the budget left for KV): never one figure for all.
        budget = f"swept ({spread_})" if swept else f"{spread_} per point"
    elif _first(summary, col) is not None:
        budget = format_bytes(float(_first(summary, col)))
    elif isinstance(budget, int | float) and not isinstance(budget, bool):
        budget = format_bytes(float(budget))
    elif derived:
        budget = _describe(budget)
    if budget is not None:
        parts.append(f"KV budget: {budget}" + (" (derived)" if derived and not swept else ""))
    mml_range = _range(summary, "max_model_len", lambda v: f"{v:.0f}")
    if mml_range:
        mml = f"swept ({mml_range})" if "max_model_len" in keys else f"{mml_range} per point"
    else:
        mml = meta.get("max_model_len") or _first(summary, "max_model_len")
    if mml is not None:
        parts.append(f"max_model_len: {mml if isinstance(mml, str) else int(mml)}")
    bpt = _first(summary, "bytes_per_token")
    if bpt is not None:
        parts.append(f"{format_bytes(float(bpt))} per token")
    workload = meta.get("workload")
    if workload:
        parts.append(f"workload: {_describe(workload)}")
    return parts


def _range(summary: pd.DataFrame | None, col: str, fmt) -> str | None:
    """`lo–hi` (`54.7–55.7 GiB`: the unit once) when `col` differs between the summary's
    rows, else None."""
    if summary is None or col not in summary.columns:
        return None
    vals = pd.to_numeric(summary[col], errors="coerce").dropna()
    if vals.nunique() <= 1:
        return None
    lo, hi = fmt(float(vals.min())), fmt(float(vals.max()))
    unit = lo.rpartition(" ")[2]
    if " " in lo and hi.endswith(" " + unit):
        lo = lo.rpartition(" ")[0]
    return f"{lo}–{hi}"


def _swept_keys(summary: pd.DataFrame | None) -> list[str]:
    """The sweep's own keys (`kv_budget`, `engine.max_num_seqs`), without the run settings
    that changed only because of them (a derived `kv_budget_bytes`)."""
    if summary is None or "point" not in summary.columns:
        return []
    return [c for c in sweep_columns(summary) if c not in _SETTING_COLUMNS
            or c not in _fallback_settings(summary)]


def _fallback_settings(summary: pd.DataFrame) -> set[str]:
    """The setting columns `sweep_columns` names only for want of sweep-key columns."""
    cols = list(summary.columns)
    if "model" in cols and "point" in cols and cols.index("point") < cols.index("model"):
        return set(_SETTING_COLUMNS) - set(cols[cols.index("point") + 1 : cols.index("model")])
    return set(_SETTING_COLUMNS)


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
        keys = [c for c in summary.columns
                if c not in _BASE_COLUMNS and not c.startswith(OPTION_PREFIX) and varies(c)]
    if keys:
        return keys
    return [c for c in _SETTING_COLUMNS if c in summary.columns and varies(c)]


def _axis_name(col: str, unit: str = "GiB") -> str:
    if col in ("kv_budget", "kv_budget_bytes"):
        return f"KV budget ({unit})"
    return col.split(".")[-1]


def sweep_axis(summary: pd.DataFrame) -> tuple[str, dict[int, float], dict[int, str], bool]:
    """How the sweep is shown on an x axis: (axis label, x per point, tick text per point,
    numeric?). Without a sweep column the points themselves are the x values. Swept mappings
    (JSON in summary.csv) get the short labels the printed table shows (`n=2`, `beam_width=3`)."""
    points = sorted(int(p) for p in pd.unique(summary["point"]))
    cols = sweep_columns(summary)
    if len(cols) == 1 or (cols and set(cols) <= {"kv_budget", "kv_budget_bytes"}):
        col = cols[0]
        if col == "kv_budget" and "kv_budget_bytes" in summary.columns:
            col = "kv_budget_bytes"
        vals = {p: _point_value(summary, p, col) for p in points}
        numeric = all(
            v is not None and not isinstance(v, bool) and _is_number(v) for v in vals.values()
        )
        if numeric:
            unit, scale = "", 1.0
            if col == "kv_budget_bytes":
                unit, scale = byte_unit(max(float(v) for v in vals.values()))
            xs = {p: float(v) / scale for p, v in vals.items()}
            text = {p: f"{xs[p]:g}" for p in points}
            return _axis_name(col, unit), xs, text, True
        names = point_names(summary, keys=False)
        return _axis_name(cols[0]), {p: float(i) for i, p in enumerate(points)}, names, False
    if cols:
        names = point_names(summary)
        return "sweep point", {p: float(i) for i, p in enumerate(points)}, names, False
    return "sweep point", {p: float(p) for p in points}, {p: str(p) for p in points}, False


def _point_value(summary: pd.DataFrame, point: int, col: str):
    vals = summary.loc[summary["point"] == point, col].dropna()
    return vals.iloc[0] if len(vals) else None


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


#: Longest text a sweep point gets in a title or on a tick.
_NAME_CHARS = 40


def point_names(summary: pd.DataFrame | None, keys: bool = True) -> dict[int, str]:
    """What each sweep point is, short, for titles and ticks: `block_size=32`, `n=2`,
    `kv_budget=8 GiB`; a swept mapping (JSON in summary.csv) as the keys whose values differ
    between the points (`kvfrag.results.short_labels`, as the printed table shows it); with
    `keys=False` a single swept scalar is just its value (an axis label names it). `point N`
    without a sweep."""
    if summary is None or "point" not in summary.columns:
        return {}
    points = sorted(int(p) for p in pd.unique(summary["point"]))
    cols = sweep_columns(summary)
    values = {c: {p: _point_value(summary, p, c) for p in points} for c in cols}
    short = {
        c: short_labels([v for v in vals.values() if isinstance(v, str)])
        for c, vals in values.items()
    }
    names = {}
    for p in points:
        bits = []
        for c in cols:
            v = values[c][p]
            if v is None:
                continue
            if isinstance(v, str) and v in short[c]:
                bits.append(short[c][v])
                continue
            if c == "kv_budget_bytes" and _is_number(v):
                v = format_bytes(float(v))
            name = c.split(".")[-1]
            bits.append(f"{name}={_fmt_value(v)}" if keys or len(cols) > 1 else _fmt_value(v))
        text = ", ".join(bits) or f"point {p}"
        names[p] = text if len(text) <= _NAME_CHARS else text[: _NAME_CHARS - 1] + "…"
    return names


def _point_title(summary: pd.DataFrame, point: int) -> str:
    """What a sweep point is, for a panel title: `block_size=32` or `point 3`."""
    return point_names(summary).get(point, f"point {point}")


def _pick_points(points: list[int], point: int | None, where: str = "") -> list[int]:
    """`[point]`, checked to be one of `points`; all of them when `point` is None."""
    if point is None:
        return points
    if point not in points:
        known = ", ".join(map(str, points)) or "none"
        raise ValueError(f"{where}no sweep point {point} (its points: {known})")
    return [point]


# ------------------------------------------------------------------------ 1. the breakdown
def _fractions(summary: pd.DataFrame) -> pd.DataFrame:
    """The five parts as fractions of the budget (the summary's `<part>_frac`), by part."""
    out = pd.DataFrame(index=summary.index)
    for p in PARTS:
        out[p] = summary[FRAC[p]].astype(float) if FRAC[p] in summary.columns else 0.0
    for p in INTERNAL_SPLIT:  # results written before the split have none
        if FRAC[p] in summary.columns:
            out[p] = summary[FRAC[p]].astype(float)
    return out.fillna(0.0)


#: internal fragmentation drawn as its parts, when the summary has them: over-reservation
#: and rounding always, a hybrid model's padding and out of window where some bar has them.
INTERNAL_SPLIT = ("internal_overreservation", "internal_padding", "internal_out_of_window",
                  "internal_rounding")
_ALWAYS_SPLIT = ("internal_overreservation", "internal_rounding")


def _drawn_parts(frac: pd.DataFrame) -> list[str]:
    """The stacked parts, bottom up: internal split into over-reservation, padding, out of
    window and rounding (the middle two only where some bar has them)."""
    if not all(p in frac.columns for p in _ALWAYS_SPLIT):
        return list(PARTS)
    split = [p for p in INTERNAL_SPLIT
             if p in _ALWAYS_SPLIT or (p in frac.columns and bool((frac[p] > 0).any()))]
    i = PARTS.index("internal")
    return [*PARTS[:i], *split, *PARTS[i + 1:]]


def _breakdown_panels(
    summary: pd.DataFrame, full: pd.DataFrame | None = None
) -> list[tuple[str, list[str], pd.DataFrame, str]]:
    """(title, bar names, rows, x label) per panel: a panel per sweep point with a bar per
    allocator; a single allocator swept gets one panel with a bar per point. Points are named
    from `full` (the whole summary, of which `summary` is the part drawn), as everywhere."""
    full = summary if full is None else full
    points = sorted(int(p) for p in pd.unique(summary["point"]))
    labels = _labels(summary)
    if len(labels) == 1 and len(points) > 1:
        xlabel, _, text, _ = sweep_axis(full)
        rows = summary.drop_duplicates("point").sort_values("point")
        names = [text[int(p)] for p in rows["point"]]
        return [(labels[0], names, rows.set_index(pd.Index(names)), xlabel)]
    panels = []
    for point in points:
        rows = summary[summary["point"] == point]
        rows = rows.set_index(rows["label"].astype(str))
        rows = rows[~rows.index.duplicated()]
        present = [lb for lb in labels if lb in rows.index]
        title = _point_title(full, point) if len(points) > 1 else ""
        panels.append((title, present, rows.loc[present], ""))
    return panels


#: The parts that hold no tokens and are not free: a breakdown whose largest stack of them is
#: at most ZOOM_BELOW % of the budget gets a second row of panels with just these, on an axis
#: that fits them (a block-size sweep's 0-8 % would be a sliver on a 0-100 % bar).
_NOT_TOKENS = ("reserved", "internal", *INTERNAL_SPLIT, "external")
ZOOM_BELOW = 30.0


def breakdown_figure(summary: pd.DataFrame, meta: Mapping | None = None) -> Figure:
    """Stacked bars: the KV budget split into token states, reserved, internal, external and
    free (time-averaged, % of the budget), one bar per allocator and a panel per sweep point
    (one allocator swept: a bar per sweep point). When the parts that hold no tokens (reserved,
    internal, external) are small, a row below zooms in on them. At most MAX_ALLOCATORS
    allocators (the first) and MAX_POINT_PANELS sweep points (evenly spaced), MAX_BARS bars in
    all: the title says what is left out."""
    full = summary = _with_keys(summary)
    labels, points = _labels(summary), sorted(int(p) for p in pd.unique(summary["point"]))
    shown, kept = _breakdown_keep(labels, points)
    notes = _allocators_note(len(shown), len(labels)) + _points_note(len(kept), len(points))
    if notes:
        summary = summary[summary["label"].astype(str).isin(shown) & summary["point"].isin(kept)]
    panels = _breakdown_panels(summary, full)
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
    drawn = _drawn_parts(_fractions(summary))
    waste_parts = [p for p in drawn if p in _NOT_TOKENS]
    waste_top = float((_fractions(summary)[waste_parts].sum(axis=1) * 100).max())
    zoom = 0 < waste_top <= ZOOM_BELOW
    width = 1.0 + panel_w * ncols + 2.4
    height = (4.6 if nrows == 1 else 3.6) + (0.075 * longest if rotate else 0.0)
    zoom_h = 1.7 if zoom else 0.0
    fig_w = max(min(width, 17), 6.0)
    fig = _new_figure(fig_w, 0.6 + (height + zoom_h) * nrows + 0.2 * len(notes), meta, full)
    if zoom:
        gs = fig.add_gridspec(2 * nrows, ncols, height_ratios=[height - 0.6, zoom_h] * nrows)
        axes, zooms = [], []
        for i in range(nrows * ncols):
            r, c = divmod(i, ncols)
            ax = fig.add_subplot(gs[2 * r, c], sharey=axes[0] if axes else None)
            axes.append(ax)
        for i, ax in enumerate(axes):  # (after the main panels: fig.axes[:n] are those)
            r, c = divmod(i, ncols)
            zooms.append(
                fig.add_subplot(gs[2 * r + 1, c], sharex=ax, sharey=zooms[0] if zooms else None)
            )
    else:
        axes = list(fig.subplots(nrows, ncols, sharey=True, squeeze=False).ravel())
        zooms = []
    for ax in [*axes[npanels:], *zooms[npanels:]]:
        ax.set_visible(False)
    for i, (title, names, rows, xlabel) in enumerate(panels):
        ax = axes[i]
        frac = _fractions(rows) * 100
        x = np.arange(len(names))
        bottom = np.zeros(len(names))
        for p in _drawn_parts(frac):  # one collection per part: its colour across the bars
            _part_bars(ax, x, frac[p].to_numpy(), bottom, p, label=PART_NAMES[p])
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
        ticks_on = zooms[i] if zoom else ax
        if zoom:
            ax.tick_params(labelbottom=False)
            _zoom_bars(zooms[i], x, frac, waste_top)
        ticks_on.set_xticks(
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
            from kvfrag.sweep_plots import fit_text  # (a point's name: a line per key if wide)

            ax.set_title(fit_text(title, panel_w - 0.2), fontsize=10,
                         fontweight="bold" if xlabel else "normal")
        if xlabel:
            ticks_on.set_xlabel(xlabel)
        _finish_axes(ax)
    for ax in axes[::ncols]:
        ax.set_ylabel("share of the KV budget (time-averaged)")
    for ax in zooms[::ncols]:
        ax.set_ylabel("not holding tokens\n(zoomed)", fontsize=9)
    handles = [
        Patch(facecolor=PALETTE[p], edgecolor="white", hatch=HATCH.get(p), label=PART_NAMES[p])
        for p in reversed(drawn)
    ]
    legend = fig.legend(
        handles=handles,
        loc="outside right center",
        fontsize=9,
        frameon=False,
        title="% in the green bar:\ntoken states, the share\nof the budget holding KV"
        + ("\n\nbelow: reserved, internal\nand external only, on an\naxis that fits them"
           if zoom else ""),
        title_fontsize=8,
    )
    legend.get_title().set_color("#444444")
    fig.suptitle("Where the KV-cache budget goes, per allocator (time-averaged)"
                 + _notes_text(notes, fig_w), fontsize=11)
    return fig


def _part_bars(ax: Axes, x: np.ndarray, values: np.ndarray, bottom: np.ndarray, part: str,
               label: str | None = None) -> None:
    """One part of the stacked breakdown bars, in its colour and hatch, on `bottom`."""
    named = {"label": label} if label is not None else {}
    _bars(ax, x, values, 0.7, bottom=bottom, facecolors=PALETTE[part], edgecolors="white",
          linewidths=0.6, hatch=HATCH.get(part), **named)


def _zoom_bars(ax: Axes, x: np.ndarray, frac: pd.DataFrame, top: float) -> None:
    """The parts that hold no tokens, stacked on their own axis (0 to a little over `top` %),
    each stack labelled with its total."""
    bottom = np.zeros(len(x))
    for p in _drawn_parts(frac):
        if p not in _NOT_TOKENS:
            continue
        _part_bars(ax, x, frac[p].to_numpy(), bottom, p)
        bottom += frac[p].to_numpy()
    for xi, total in zip(x, bottom, strict=True):
        ax.text(xi, total, f"{total:.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.3)
    decimals = 0 if top >= 5 else 1
    ax.yaxis.set_major_locator(mticker.MaxNLocator(4))
    ax.yaxis.set_major_formatter(mticker.PercentFormatter(decimals=decimals))
    _finish_axes(ax)


# ------------------------------------------------------------------------- 2. over time
def resample(ts: pd.DataFrame, bins: int, columns: Sequence[str]) -> pd.DataFrame:
    """A piecewise-constant series (t_s, dt_s, columns) as `bins` equal steps, each the exact
    time-weighted mean of `columns` over its interval (areas are kept)."""
    t = ts["t_s"].to_numpy(float)
    dt = ts["dt_s"].to_numpy(float)
    edges_in = np.append(t, t[-1] + dt[-1])
    edges = np.linspace(edges_in[0], edges_in[-1], bins + 1)
    width = np.diff(edges)
    out = {"t_s": edges[:-1], "dt_s": width}
    for c in columns:
        cum = np.concatenate(([0.0], np.cumsum(ts[c].to_numpy(float) * dt)))
        at = np.interp(edges, edges_in, cum)
        out[c] = np.diff(at) / np.where(width > 0, width, 1.0)
    return pd.DataFrame(out)


def _steps(ts: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray]:
    """x and y for a `step='post'` drawing of a piecewise-constant column."""
    t = ts["t_s"].to_numpy(float)
    x = np.append(t, t[-1] + float(ts["dt_s"].iloc[-1]))
    y = ts[col].to_numpy(float)
    return x, np.append(y, y[-1])


def _timeline_panels(
    timeseries: pd.DataFrame, summary: pd.DataFrame | None, point: int | None
) -> tuple[list[tuple[str, pd.DataFrame, int]], int, str, list[str]]:
    """(title, rows, point) per panel, the number of columns, what the figure title adds, and
    its notes on what is left out (`_panel_keep`: the first MAX_ALLOCATORS allocators, and the
    first points that keep to MAX_PANELS panels). Every sweep point is drawn (or `point`
    alone): a single allocator gets a panel per point; several get a row per point with a
    panel per allocator."""
    names_of = timeseries["label"].astype(str)
    present = set(pd.unique(names_of))
    labels = _labels(summary) if summary is not None else _labels(timeseries)
    labels = [lb for lb in labels if lb in present]
    points = sorted(int(p) for p in pd.unique(timeseries["point"]))
    if summary is not None and "point" in summary.columns:
        points = sorted(set(points) | {int(p) for p in pd.unique(summary["point"])})
    points = _pick_points(points, point)
    swept = summary is not None and "point" in summary.columns and summary["point"].nunique() > 1
    names = point_names(summary) if swept else {}
    shown, keep = _panel_keep(labels, points)
    notes = _allocators_note(len(shown), len(labels)) + _left_out(points[len(keep):])

    def rows(label: str, p: int) -> pd.DataFrame:
        return timeseries[(timeseries["point"] == p) & (names_of == label)]

    if len(shown) == 1 and len(points) > 1:
        panels = [(names.get(p, f"point {p}"), rows(shown[0], p), p) for p in keep]
        return panels, _columns(len(panels)), f" ({shown[0]})", notes
    if len(keep) == 1:
        p = keep[0]
        panels = [(lb, rows(lb, p), p) for lb in shown]
        suffix = f" ({names.get(p, f'point {p}')})" if swept else ""
        return panels, _columns(len(panels)), suffix, notes
    panels = [(f"{lb}  ·  {names.get(p, f'point {p}')}", rows(lb, p), p)
              for p in keep for lb in shown]
    ncols = len(shown) if len(shown) <= 5 else _columns(len(panels))
    return panels, ncols, "", notes


def _columns(n: int) -> int:
    """Columns of a grid of `n` panels: up to three in a row, four as two by two."""
    return n if n <= 3 else (2 if n == 4 else 3)


def _left_out(points: list[int]) -> list[str]:
    """The figure title's note on sweep points not drawn (the timeline's, the address map's)."""
    if not points:
        return []
    which = f"{points[0]}" if len(points) == 1 else f"{points[0]}–{points[-1]}"
    return [f"sweep points {which} not drawn: more than {MAX_PANELS} panels; "
            "kvfrag plot --point N draws any one"]


def timeline_figure(
    timeseries: pd.DataFrame,
    summary: pd.DataFrame | None = None,
    meta: Mapping | None = None,
    point: int | None = None,
    max_segments: int = MAX_SEGMENTS,
) -> Figure:
    """The KV budget split into its five parts over time (stacked, in the unit that fits the
    budget), per allocator and sweep point, with the requests running and waiting in a small
    panel above each. Every sweep point is drawn (`point`: that one only) up to MAX_PANELS
    panels, and the first MAX_ALLOCATORS allocators: the title says what is left out. A run
    with no records says so. Runs longer than `max_segments` segments are time-averaged into
    that many steps. Panels of one sweep point share their time axis."""
    timeseries = _with_keys(timeseries)
    panels, ncols, suffix, notes = _timeline_panels(timeseries, summary, point)
    if not panels:
        raise ValueError("no timeseries rows to draw")
    n = len(panels)
    nrows = math.ceil(n / ncols)
    panel_w = 4.6 if ncols <= 3 else max(3.3, 14.0 / ncols)
    panel_h = 4.0 if nrows <= 2 else 3.3
    fig_w = min(2.5 + panel_w * ncols, 17.5)
    fig = _new_figure(fig_w, 0.9 + panel_h * nrows + 0.2 * len(notes), meta, summary)
    gs = fig.add_gridspec(2 * nrows, ncols, height_ratios=[1, 2.8] * nrows)
    resampled = any_blocked = False
    # First the series as drawn (sorted, resampled), and the top of the memory axis.
    series: list[pd.DataFrame | None] = []
    top_bytes = 0.0
    for _, ts, pt in panels:
        if not len(ts):
            series.append(None)
            continue
        ts = ts.sort_values("t_s", kind="stable")
        ts = ts[ts["dt_s"] > 0] if (ts["dt_s"] > 0).any() else ts
        if "frag_blocked" in ts.columns:
            ts = ts.assign(frag_blocked=ts["frag_blocked"].astype(float))
        if len(ts) > max_segments:
            cols = [c for c in (*BYTES.values(), "running", "waiting", "frag_blocked")
                    if c in ts.columns]
            ts = resample(ts, max_segments, cols)
            resampled = True
        series.append(ts)
        parts = [BYTES[p] for p in PARTS if BYTES[p] in ts.columns]
        if parts:
            top_bytes = max(top_bytes, float(np.nanmax(ts[parts].to_numpy(float).sum(axis=1))))
        if summary is not None and "kv_budget_bytes" in summary.columns:
            cap = summary.loc[_with_keys(summary)["point"] == pt, "kv_budget_bytes"].dropna()
            if len(cap):
                top_bytes = max(top_bytes, float(cap.max()))
    unit, scale = byte_unit(top_bytes)
    low0 = None
    by_point: dict[int, Axes] = {}
    top_of: dict[int, Axes] = {}  # the requests panels of one point share their scale
    lows, tops = [], []
    peaks: dict[int, dict[str, float]] = {}
    for i, ((title, _, pt), ts) in enumerate(zip(panels, series, strict=True)):
        r, c = divmod(i, ncols)
        low = fig.add_subplot(gs[2 * r + 1, c], sharex=by_point.get(pt), sharey=low0)
        top = fig.add_subplot(gs[2 * r, c], sharex=low, sharey=top_of.get(pt))
        by_point.setdefault(pt, low)
        top_of.setdefault(pt, top)
        peak = peaks.setdefault(pt, {"running": 0.0, "waiting": 0.0})
        low0 = low0 or low
        lows.append(low)
        tops.append(top)
        top.set_title(title, fontsize=10, fontweight="bold")
        top.tick_params(labelbottom=False)
        _finish_axes(top)
        _finish_axes(low)
        if ts is None:
            top.set_visible(False)
            low.set_title(title, fontsize=10, fontweight="bold")
            _say(low, "no records of this run over time (did it fail? see failures.csv)", 36)
            continue
        # Requests running and waiting.
        for col, color, z in (("waiting", WAITING_COLOR, 2), ("running", RUNNING_COLOR, 3)):
            if col in ts.columns:
                x, y = _steps(ts, col)
                top.plot(x, y, drawstyle="steps-post", color=color, lw=1.0, label=col, zorder=z)
                peak[col] = max(peak[col], float(np.nanmax(y)))
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
        # The budget, stacked.
        bottom = None
        for p in PARTS:
            if BYTES[p] not in ts.columns:
                continue
            x, y = _steps(ts, BYTES[p])
            y = y / scale
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
        low.set_xlabel("time (s)")
        low.margins(x=0)
    low0.set_ylim(0, top_bytes / scale * 1.001 if top_bytes > 0 else 1)
    # No 2.5 steps: tick labels of one width however tall the layout makes the panels (a
    # locator that picks wider labels after the layout has sized the margins clips them).
    low0.yaxis.set_major_locator(mticker.MaxNLocator(nbins=6, steps=[1, 2, 5, 10]))
    log_queue = {}
    for pt, top in top_of.items():
        peak = peaks[pt]
        top.set_ylim(0, max(peak.values()) * 1.08 or 1)
        # A long queue would flatten the running line: show both on a symlog scale.
        log_queue[pt] = peak["waiting"] > 10 * max(peak["running"], 1.0)
        if log_queue[pt]:
            top.set_yscale("symlog", linthresh=10)
            top.set_ylim(0, peak["waiting"] * 1.5)
            top.yaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
    for i, ((_, _, pt), low, top) in enumerate(zip(panels, lows, tops, strict=True)):
        if i % ncols == 0 or top.get_yscale() != tops[i - 1].get_yscale():
            top.set_ylabel("requests" + ("\n(symlog)" if log_queue[pt] else ""))
        if i % ncols == 0:
            low.set_ylabel(f"KV memory ({unit})")
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
    title += _notes_text(notes, fig_w)
    fig.suptitle(title, fontsize=11)
    return fig


# ------------------------------------------------------------------- 3. the address space
def slab_polygons(
    requests: pd.DataFrame,
    bytes_per_token: float,
    end_s: float | None = None,
    scale: float = GIB,
    base: float = 0.0,
) -> dict[str, np.ndarray]:
    """Polygons (time s, address in units of `scale` bytes above `base`: GiB from 0 by
    default) of each admitted slab's stored tokens, reserved and internal parts, and its
    outline: arrays of shape (slabs, corners, 2); each row of `requests` is one slab (its
    `peak_bytes`), at `offset_bytes`. Stored tokens grow linearly from the prompt plus the
    first output token's slot (at the first token) to the final length (at the finish); the
    slab is held until `released_s` (static batching frees a batch together). A request still
    running at the end (`end_s`) is drawn as long as it was then (`tokens_at_end`). A row with
    `piece_start_s` / `piece_end_s` (see `slab_pieces`; NaN: from admission / to release) is
    the part of its slab held at `offset_bytes` in that time: its parts are those of the whole
    slab cut to that time, so that the pieces of a slab moved by compaction join up."""
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
    off = (req["offset_bytes"].to_numpy(float) - base) / scale
    peak = req["peak_bytes"].to_numpy(float) / scale
    b = float(bytes_per_token) / scale
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

    h0, hf, hn, h1 = s0, s0, s1, s1  # stored height at a, f1, fin and rel
    if PIECE_START in req.columns:  # pieces of slabs: the whole slab's corners, cut in time
        ps = req[PIECE_START].to_numpy(float)
        pe = req[PIECE_END].to_numpy(float)
        t0 = np.where(np.isnan(ps), a, np.clip(ps, a, rel))
        t1 = np.where(np.isnan(pe), rel, np.clip(pe, t0, rel))
        g1, g2 = f1, fin  # when the whole slab's stored part starts and stops growing
        a, f1, fin, rel = t0, np.clip(f1, t0, t1), np.clip(fin, t0, t1), t1
        h0, hf = (_stored_at(t, g1, g2, s0, s1, late=False) for t in (a, f1))
        hn, h1 = (_stored_at(t, g1, g2, s0, s1, late=True) for t in (fin, rel))
    stored = polys(
        (a, off), (a, off + h0), (f1, off + hf), (fin, off + hn), (rel, off + h1), (rel, off)
    )
    reserved = polys(
        (a, off + h0),
        (f1, off + hf),
        (fin, off + hn),
        (rel, off + h1),
        (rel, off + final),
        (a, off + final),
    )
    internal = polys((a, off + final), (rel, off + final), (rel, off + peak), (a, off + peak))
    outline = polys((a, off), (rel, off), (rel, off + peak), (a, off + peak))
    return {"token_states": stored, "reserved": reserved, "internal": internal, "outline": outline}


def _stored_at(
    t: np.ndarray, g1: np.ndarray, g2: np.ndarray, s0: np.ndarray, s1: np.ndarray, late: bool
) -> np.ndarray:
    """A slab's stored height at `t`: `s0` until `g1`, growing linearly to `s1` at `g2`, then
    `s1`; where `g1 == g2` the step is `s0` at it, or `s1` if `late`."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ramp = s0 + (s1 - s0) * (t - g1) / (g2 - g1)
    if late:
        return np.where(t >= g2, s1, np.where(t <= g1, s0, ramp))
    return np.where(t <= g1, s0, np.where(t >= g2, s1, ramp))


#: Columns of requests.parquet written for allocators that compacted: where each request's
#: (first) slab was placed over time, as times and offsets: its admission, then each move.
MOVE_T = "slab_move_t_s"
MOVE_OFFSET = "slab_move_offset_bytes"
#: Columns `slab_pieces` adds: when the piece of a slab begins and ends (NaN: its admission,
#: its release).
PIECE_START = "piece_start_s"
PIECE_END = "piece_end_s"


def moves_known(requests: pd.DataFrame) -> bool:
    """Whether the results record where these requests' slabs moved (`MOVE_T`)."""
    return MOVE_T in requests.columns and bool(requests[MOVE_T].notna().any())


def slab_pieces(slabs: pd.DataFrame) -> pd.DataFrame:
    """Slabs (rows of `_slabs`) cut into one row per place each was held at, where the results
    record moves (`MOVE_T`, `MOVE_OFFSET`): `offset_bytes` the place, `PIECE_START` and
    `PIECE_END` when it was there (NaN: from admission, to release). Only a request's first
    slab's moves are recorded: its other sequences' slabs stay as they are."""
    if MOVE_T not in slabs.columns:
        return slabs
    first = ~slabs.index.duplicated()
    times = slabs[MOVE_T].to_numpy(object)
    places = slabs[MOVE_OFFSET].to_numpy(object)
    offset = slabs["offset_bytes"].to_numpy(float)
    counts, starts, ends, offsets = [], [], [], []
    nan = math.nan
    for j in range(len(slabs)):
        t, o = times[j], places[j]
        if not first[j] or not isinstance(t, list | tuple | np.ndarray) or not len(t):
            counts.append(1)
            starts.append(nan)
            ends.append(nan)
            offsets.append(offset[j])
            continue
        t = [float(x) for x in t]
        n = 0
        for k in range(len(t)):  # (a piece left at once, by a second move then, is not drawn)
            end = t[k + 1] if k + 1 < len(t) else nan
            if end == t[k]:
                continue
            starts.append(t[k] if k else nan)
            ends.append(end)
            offsets.append(float(o[k]))
            n += 1
        counts.append(n)
    out = slabs.iloc[np.repeat(np.arange(len(slabs)), counts)].drop(columns=[MOVE_T, MOVE_OFFSET])
    return out.assign(offset_bytes=np.array(offsets, dtype=float),
                      **{PIECE_START: np.array(starts, dtype=float),
                         PIECE_END: np.array(ends, dtype=float)})


#: The column of requests.parquet that lists every sequence's slab offset of a request (n
#: samples or beams; the first is `offset_bytes`), written when the workload has sample groups
#: or beams. Without it (results from before it existed) only each request's first slab can be
#: placed.
SLAB_OFFSETS = "slab_offsets_bytes"


def sequences(requests: pd.DataFrame) -> np.ndarray:
    """Sequences per request (n samples, or beam_width beams), each with its own slab on a slab
    allocator: a `sequences` column where results have one, else what a finished request's
    sequences generated together over what one generates (`generated_tokens` over
    `output_tokens`: exact, as each sequence generates `output_tokens`); 1 for the others."""
    n = len(requests)
    if "sequences" in requests.columns:
        return np.maximum(np.nan_to_num(requests["sequences"].to_numpy(float), nan=1), 1).astype(
            int
        )
    if "generated_tokens" not in requests.columns or "output_tokens" not in requests.columns:
        return np.ones(n, dtype=int)
    gen = requests["generated_tokens"].to_numpy(float)
    out = requests["output_tokens"].to_numpy(float)
    if "status" in requests.columns:
        done = (requests["status"].astype(str) == "completed").to_numpy()
    else:
        done = requests["finished_s"].notna().to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(done & (out > 0), gen / np.where(out > 0, out, 1), 1.0)
    return np.maximum(np.ceil(np.nan_to_num(ratio, nan=1.0) - 1e-9), 1).astype(int)


def _slabs(req: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """One row per slab to draw, and the most sequences a request has. A request with k
    sequences holds k slabs of `peak_bytes / k` each: every one at its own offset where the
    results list them (`SLAB_OFFSETS`), else only the first (`offset_bytes`), since where the
    others are is not recorded; drawing one slab k times as tall would cover other slabs."""
    k = sequences(req)
    most = int(k.max()) if len(k) else 1
    if most <= 1:
        return req, 1
    req = req.assign(peak_bytes=req["peak_bytes"].to_numpy(float) // k)
    if SLAB_OFFSETS in req.columns:
        req = req.explode(SLAB_OFFSETS)
        req = req.assign(offset_bytes=req[SLAB_OFFSETS].astype(float)).drop(columns=SLAB_OFFSETS)
    return req, most


#: Allocator kinds that place each request in a slab of its own (an address-map panel each).
SLAB_KINDS = ("contiguous", "buddy", "torch-caching")


def _slab_labels(requests: pd.DataFrame, summary: pd.DataFrame | None) -> list[str]:
    """Labels whose requests have slab offsets, or whose kind places slabs (one that admitted
    nothing gets a panel that says so)."""
    requests = _with_keys(requests)
    has = requests.groupby(requests["label"].astype(str))["offset_bytes"].apply(
        lambda s: s.notna().any()
    )
    kinds = {}
    if summary is not None and "kind" in summary.columns:
        kinds = dict(zip(summary["label"].astype(str), summary["kind"].astype(str), strict=True))
    order = _labels(summary) if summary is not None else _labels(requests)
    present = set(requests["label"].astype(str))
    return [lb for lb in order
            if has.get(lb, False) or (lb in present and kinds.get(lb) in SLAB_KINDS)]


def address_map_figure(
    requests: pd.DataFrame,
    summary: pd.DataFrame,
    meta: Mapping | None = None,
    point: int | None = None,
    max_slabs: int = MAX_SLABS,
    timeseries: pd.DataFrame | None = None,
) -> Figure | None:
    """Every slab of each contiguous or buddy allocator in the address space over time: stored
    tokens green, reserved orange, internal fragmentation red, holes white; a panel per
    allocator and sweep point (`point`: that one only). None when no allocator has slabs. More
    than `max_slabs` slabs in a panel: the first by admission are drawn. A panel that cannot
    be drawn as it was (slabs moved by compaction, in results that do not record the moves)
    says why; slabs whose moves are recorded are drawn a piece per place they were held at
    (`slab_pieces`). Addresses are in the unit that
    fits the budget; torch's caching allocator's are virtual (its segments' addresses are
    never reused), drawn from its first segment. At most MAX_PANELS panels, of the first
    MAX_ALLOCATORS slab allocators: the title says what is left out."""
    requests = _with_keys(requests)
    summary = _with_keys(summary)
    if "offset_bytes" not in requests.columns:
        return None
    points = sorted(int(p) for p in pd.unique(requests["point"]))
    points = _pick_points(points, point)
    every = _slab_labels(requests[requests["point"].isin(points)], summary)
    if not every:
        return None
    labels, keep = _panel_keep(every, points)
    left = _allocators_note(len(labels), len(every), "slab allocators") + _left_out(
        points[len(keep):])
    swept = summary["point"].nunique() > 1
    names = point_names(summary) if swept else {}
    panels = [(label, p) for label in labels for p in keep]
    # One allocator: a point per row, so that the panels keep the width time needs; several:
    # an allocator per row, a point per column.
    ncols = min(len(keep), 4) if len(labels) > 1 else 1 if len(keep) <= 4 else 2
    nrows = math.ceil(len(panels) / ncols)
    sums = summary.assign(label=summary["label"].astype(str)).drop_duplicates(["label", "point"])
    sums = sums.set_index(["label", "point"])
    caps = [_row_value(_row(sums, lb, p), "kv_budget_bytes", summary, "kv_budget_bytes")
            or _row_value(_row(sums, lb, p), "capacity_bytes", summary, "capacity_bytes") or 0.0
            for lb, p in panels]
    unit, scale = byte_unit(max(caps))
    width = 11.5 if ncols == 1 else min(1.6 + 5.0 * ncols, 17.5)
    fig = _new_figure(width, 0.9 + (3.2 if nrows <= 3 else 2.7) * nrows + 0.2 * len(left),
                      meta, summary)
    gs = fig.add_gridspec(nrows, ncols)
    chars = int(width / ncols * 11)  # a panel title's characters per line
    by_point: dict[int, Axes] = {}
    xmax: dict[int, float] = {}
    axes = []
    all_notes: list[str] = []
    drawn: list[bool] = []  # whether a panel has slabs (else it says why not)
    for i, ((label, pt), cap) in enumerate(zip(panels, caps, strict=True)):
        ax = fig.add_subplot(gs[divmod(i, ncols)], sharex=by_point.get(pt))
        by_point.setdefault(pt, ax)
        axes.append(ax)
        req = requests[(requests["point"] == pt) & (requests["label"].astype(str) == label)]
        row = _row(sums, label, pt)
        head = f"{label}  ·  {names[pt]}" if len(keep) > 1 and pt in names else label
        notes, right, drew = _map_panel(ax, req, row, summary, cap, scale, max_slabs, timeseries,
                                  label, pt, chars)
        xmax[pt] = max(xmax.get(pt, 0.0), right)
        all_notes += notes
        drawn.append(drew)
        title = head + (": " + "; ".join(notes) if notes else "")
        ax.set_title(textwrap.fill(title, chars), fontsize=9 if ncols > 1 else 10,
                     fontweight="bold", loc="left")
        ax.set_facecolor("white")
        for side in ("top", "right"):
            ax.spines[side].set_visible(True)
    for pt, ax in by_point.items():
        ax.set_xlim(0, xmax[pt] if xmax[pt] > 0 else 1)
    for ax, drew in zip(axes, drawn, strict=True):
        if drew:  # (as the timeline's: tick labels of one width)
            ax.yaxis.set_major_locator(mticker.MaxNLocator(nbins=6, steps=[1, 2, 5, 10]))
    for i, ax in enumerate(axes):
        if not drawn[i]:
            continue
        virtual = "virtual addresses" in ax.get_title(loc="left")
        if i % ncols == 0 or not drawn[i - 1] or virtual:
            ax.set_ylabel(f"{'virtual ' if virtual else ''}address ({unit})")
        if i + ncols >= len(axes) or not drawn[i + ncols]:
            ax.set_xlabel("time (s)")
    handles = [
        Patch(color=PALETTE["token_states"], label="token states (stored)"),
        Patch(color=PALETTE["reserved"], alpha=0.55, label="reserved (not yet written)"),
        Patch(color=PALETTE["internal"], alpha=0.55, label="internal fragmentation"),
        Patch(facecolor="white", edgecolor="#555555", label="hole (free)"),
    ]
    fig.legend(handles=handles, loc="outside right center", fontsize=9, frameon=False)
    title = (
        "Address space of the slab allocators: one rectangle per slab, "
        "from admission to release"
    )
    if any(moves_known(requests[requests["label"].astype(str) == lb]) for lb in labels):
        title += " (moved by compaction: a piece at each place it was held)"
    if swept and len(keep) == 1:
        title += f"\n({names.get(keep[0], f'point {keep[0]}')})"
    if any(note.startswith("only each request's 1st") for note in all_notes):
        title += ("\n(a request of several sequences holds a slab per sequence; the results "
                  "keep the first one's offset only, so only that one is drawn)")
    title += _notes_text(left, width)
    fig.suptitle(title, fontsize=11)
    return fig


def _row(sums: pd.DataFrame, label: str, point: int) -> pd.Series | None:
    key = (label, point)
    return sums.loc[key] if key in sums.index else None


def _map_panel(
    ax: Axes,
    req: pd.DataFrame,
    row: pd.Series | None,
    summary: pd.DataFrame,
    cap: float,
    scale: float,
    max_slabs: int,
    timeseries: pd.DataFrame | None,
    label: str,
    point: int,
    chars: int,
) -> tuple[list[str], float, bool]:
    """Draw one allocator's slabs at one sweep point (or say why they cannot be drawn); the
    notes for its title, the time its panel reaches, and whether it drew any."""
    bpt = _row_value(row, "bytes_per_token", summary, "bytes_per_token")
    kind = str(row["kind"]) if row is not None and "kind" in row.index else ""
    compactions = row.get("compactions") if row is not None else None
    end_s = None
    if timeseries is not None and len(timeseries):
        tsl = _with_keys(timeseries)
        tsl = tsl[(tsl["point"] == point) & (tsl["label"].astype(str) == label)]
        if len(tsl):
            end_s = float((tsl["t_s"] + tsl["dt_s"]).max())
    ax.set_ylim(0, cap / scale if cap else 1)
    if (compactions is not None and pd.notna(compactions) and compactions > 0
            and not moves_known(req)):  # (results from before moves were recorded)
        moved = row.get("bytes_moved")
        stall = row.get("stall_s")
        what = f"{int(compactions):,} compactions"
        if moved is not None and pd.notna(moved):
            what += f" moved {format_bytes(float(moved))}"
        if stall is not None and pd.notna(stall):
            what += f" ({float(stall):.2f} s of stall)"
        _say(ax, f"Not drawn: {what}. requests.parquet keeps only the offset each slab had "
                 "when it was freed, so where the slabs were before they moved is not known.",
             min(chars, 90))
        return [], end_s or 0.0, False
    placed = req[req["admitted_s"].notna() & req["offset_bytes"].notna()]
    if not len(placed):
        why = "no request was admitted"
        if len(req) and "reason" in req.columns:
            reasons = req["reason"].astype(str)
            counts = reasons[reasons != ""].value_counts()
            if len(counts):
                why += " (rejected: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()) + ")"
        _say(ax, f"Nothing to draw: {why}.", min(chars, 90))
        return [], end_s or 0.0, False
    placed = placed.sort_values("admitted_s", kind="stable")
    notes = []
    total = len(placed)
    right = None
    if total > max_slabs:
        right = float(placed["admitted_s"].iloc[max_slabs])
        placed = placed.iloc[:max_slabs]
        notes.append(f"first {max_slabs} of {total} slabs by admission time (up to t = "
                     f"{right:.0f} s)")
    slabs, most = _slabs(placed)
    if most > 1 and SLAB_OFFSETS not in placed.columns:
        notes.append(f"only each request's 1st of {most} slabs")
    base = 0.0
    if kind == "torch-caching":
        base = float(ADDRESS_BASE)
        notes.append("virtual addresses from the first segment (never reused: they pass the "
                     "budget)")
    slabs = slab_pieces(slabs)  # (compaction: a piece per place a slab was held at)
    polys = slab_polygons(slabs, bpt, end_s, scale=scale, base=base)
    for part in ("token_states", "reserved", "internal"):
        ax.add_collection(
            PolyCollection(
                polys[part],
                facecolors=PALETTE[part],
                edgecolors="none",
                alpha=1.0 if part == "token_states" else 0.55,
                rasterized=True,
                antialiased=False,
            )
        )
    ax.add_collection(  # thin outlines tell neighbouring slabs apart
        PolyCollection(
            polys["outline"],
            facecolors="none",
            edgecolors="#555555",
            linewidths=0.3 if len(slabs) < 300 else 0.12,
            alpha=0.8 if len(slabs) < 300 else 0.5,
            rasterized=True,
        )
    )
    top = float(np.nanmax(polys["outline"][..., 1])) if len(slabs) else 0.0
    if base or not cap:
        ax.set_ylim(0, max(cap / scale, top))
    if right is None:
        fin = placed["finished_s"].dropna()
        right = max(float(fin.max()) if len(fin) else 0.0, end_s or 0.0)
        if "released_s" in placed.columns and placed["released_s"].notna().any():
            right = max(right, float(placed["released_s"].max()))
    return notes, right, True


def _row_value(row, col: str, summary: pd.DataFrame, fallback: str):
    if row is not None and col in row.index and pd.notna(row[col]):
        return float(row[col])
    v = _first(summary, fallback)
    return float(v) if v is not None else None


# ------------------------------------------------------------------------ 4. capacity
def capacity_figure(summary: pd.DataFrame, meta: Mapping | None = None) -> Figure:
    """Requests running at once, throughput and latency per allocator, against the swept
    value for a sweep: `kvfrag.capacity_plots.capacity_figure`."""
    from kvfrag.capacity_plots import capacity_figure as draw

    return draw(summary, meta)


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
#: `read_summary`'s default: the schema version is read from the summary.json beside.
_BESIDE = -1


def read_summary(path: Path | str, version: int | None = _BESIDE) -> pd.DataFrame:
    """`summary.csv`, checked before it is drawn: pandas reads a truncated or foreign file into
    NaN-padded rows (or none) without a word, and the figures would then silently show
    nothing, or the wrong thing. Raises `ResultsFileError` naming the file and the damage.

    Written by an older kvfrag (schema `version`, by default the summary.json's beside it),
    its columns are translated to this kvfrag's names (`kvfrag.results.upgrade_summary`); a
    newer one is refused (ValueError). Without a version (no summary.json), a header with the
    schema-1 names is taken as schema 1."""
    path = Path(path)
    if version == _BESIDE:
        version = folder_schema(path.parent)[0]
        check_schema(version, path.parent)

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
    present = set(upgrade_summary(pd.DataFrame(columns=header), version).columns)
    missing = [c for c in SUMMARY_COLUMNS if c not in present]
    if len(missing) == len(SUMMARY_COLUMNS):
        raise foreign(f"no {', '.join(SUMMARY_COLUMNS)} columns")
    if missing:
        raise bad(f"missing columns {', '.join(missing)}")
    if not rows:
        raise bad("no rows, only a header")
    summary = upgrade_summary(unescape(pd.read_csv(io.StringIO(text))), version)
    for col in ("point", *(FRAC[p] for p in PARTS)):
        values = pd.to_numeric(summary[col], errors="coerce")
        if col == "point" and not values.isna().any() and (values % 1 != 0).any():
            raise bad("column point holds values that are not whole numbers")
        if values.isna().any():
            raise bad(f"column {col} holds values that are not numbers")
    if summary["label"].isna().any():
        raise bad("column label has empty values")
    return summary


def read_frame(
    path: Path | str,
    columns: Sequence[str],
    upgrade: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
) -> pd.DataFrame:
    """A Parquet file of a results folder, with the `columns` the figures need (after
    `upgrade`, which translates an older layout's names); a damaged one raises
    `ResultsFileError` naming it (pyarrow's own errors do not always)."""
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
    if upgrade is not None:
        frame = upgrade(frame)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ResultsFileError(f"{path}: missing columns {', '.join(missing)}")
    return frame


# ------------------------------------------------------------------------ entry points
def plot_results(
    results_dir: Path | str,
    meta: Mapping | None = None,
    svg: bool = False,
    point: int | None = None,
    say: Callable[[str], None] | None = None,
) -> list[Path]:
    """Draw every figure for a results folder into `results_dir/plots/`: PNG, and SVG too with
    `svg`; a figure whose Parquet file is missing or has no rows is skipped. Returns the paths.
    A damaged file raises `ResultsFileError` (a ValueError) before anything is drawn, and so
    does a `point` the sweep does not have (ValueError).

    What the figures leave out is told before they are drawn, a line each to `say` (default:
    `kvfrag: note: ...` on stderr, as `kvfrag run` and `kvfrag plot` show it): a missing or
    empty Parquet file and the figures left out for it, and the allocators and sweep points
    past the caps (`left_out`). Silence would read as "everything is drawn".

    The timeline and the address map show every sweep point; with `point`, only the figures
    of POINT_FIGURES are drawn, of that point alone, into files of their own (`point_stem`:
    `plots/timeline-point3.png`), so the all-points figures stay as they are. The captions
    come from the folder's own files (`scenario.resolved.yaml`, the tables) wherever they say
    it, `meta` filling in only what they do not: `kvfrag run` and `kvfrag plot` of one folder
    draw the same captions, and figures of the same size.

    A figure whose SVG is already there (from an earlier `svg=True` draw) gets its SVG redrawn
    too, even without `svg`: an SVG left as it was would claim to show these results while it
    shows older ones. Redrawn rather than removed, so nothing is ever deleted here and the
    folder's manifest, which lists the file already, stays right as it is."""
    from kvfrag.group_plots import group_figure

    results_dir = Path(results_dir)
    out = results_dir / "plots"
    version = folder_schema(results_dir)[0]
    check_schema(version, results_dir, "draw")
    summary = read_summary(results_dir / "summary.csv", version)
    if point is not None:
        _pick_points(sorted(int(p) for p in pd.unique(_with_keys(summary)["point"])), point,
                     f"{results_dir}: ")
    ts_path, req_path = results_dir / "timeseries.parquet", results_dir / "requests.parquet"
    timeseries = (
        read_frame(ts_path, TIMESERIES_COLUMNS, lambda ts: upgrade_timeseries(ts, version))
        if ts_path.exists() else None
    )
    requests = read_frame(req_path, REQUESTS_COLUMNS) if req_path.exists() else None
    has_ts = timeseries is not None and len(timeseries) > 0
    has_req = requests is not None and len(requests) > 0
    meta = _folder_meta(results_dir, meta, requests if has_req else None)
    notes = missing_notes(results_dir, timeseries, requests, summary)
    if has_ts and point is not None and not (_with_keys(timeseries)["point"] == point).any():
        has_ts = False  # (that point failed: no records)
        notes.append(f"{ts_path} has no records of sweep point {point} (did it fail? see "
                     "failures.csv): the timeline figure is left out")
    for note in notes + left_out(summary, requests if has_req else None, point):
        (say or _note)(note)
    # Built one at a time, so that only one figure is in memory at once.
    builders: list[tuple[str, Callable[[], Figure | None]]] = [
        ("breakdown", lambda: breakdown_figure(summary, meta)),
        (
            "timeline",
            lambda: timeline_figure(timeseries, summary, meta, point=point) if has_ts else None,
        ),
        (
            "address_map",
            lambda: (
                address_map_figure(requests, summary, meta, point=point, timeseries=timeseries)
                if has_req and (point is None or (_with_keys(requests)["point"] == point).any())
                else None
            ),
        ),
        ("capacity", lambda: capacity_figure(summary, meta)),
        ("lengths", lambda: lengths_figure(requests, meta, summary) if has_req else None),
        # (hybrid runs only: blocks per KV-cache group kind over time)
        ("groups", lambda: group_figure(timeseries, summary, meta, point) if has_ts else None),
    ]
    if point is not None:  # one point's figures, in files of their own (`point_stem`)
        builders = [(point_stem(name, point), build) for name, build in builders
                    if name in POINT_FIGURES]
    paths: list[Path] = []
    for name, build in builders:
        fig = build()
        if fig is not None:
            paths += save_figure(fig, out / name, svg or (out / f"{name}.svg").exists())
    return paths


#: The figures `kvfrag plot --point N` draws for one sweep point (the others show every
#: point whatever N is, so they are left as they are).
POINT_FIGURES = ("timeline", "address_map", "groups")


def point_stem(name: str, point: int) -> str:
    """The file stem of figure `name` drawn for sweep point `point` alone (`timeline-point3`):
    never the all-points figure's, which the report embeds and a run redraws."""
    return f"{name}-point{point}"


def is_point_figure(path: Path | str) -> bool:
    """Whether `path` is a one-point figure (`plots/timeline-point3.png`)."""
    stem = Path(path).stem
    return any(stem.startswith(f"{name}-point") and stem[len(name) + 6 :].isdigit()
               for name in POINT_FIGURES)


#: The figures drawn from each Parquet file of a results folder.
NEEDS: dict[str, tuple[str, ...]] = {
    "timeseries.parquet": ("timeline",),
    "requests.parquet": ("address_map", "lengths"),
}


def drawn_from(name: str, summary: pd.DataFrame | None = None) -> list[str]:
    """The figures drawn from Parquet file `name` (NEEDS), less the address map where the
    summary's kinds show that no allocator places slabs."""
    figures = list(NEEDS[name])
    kinds = summary["kind"] if summary is not None and "kind" in summary.columns else None
    if kinds is not None and not kinds.astype(str).isin(SLAB_KINDS).any():
        figures = [f for f in figures if f != "address_map"]
    return figures


def figures_text(figures: Sequence[str]) -> str:
    """`the timeline figure`, `the address map and request-lengths figures`."""
    words = {"address_map": "address map", "lengths": "request-lengths"}
    names = " and ".join(words.get(f, f) for f in figures)
    return f"the {names} figure{'s' if len(figures) > 1 else ''}"


def missing_notes(
    results_dir: Path | str,
    timeseries: pd.DataFrame | None,
    requests: pd.DataFrame | None,
    summary: pd.DataFrame | None = None,
) -> list[str]:
    """A line for each Parquet file that is missing (None) or has no rows, naming it and the
    figures left out for it."""
    notes = []
    for name, frame in (("timeseries.parquet", timeseries), ("requests.parquet", requests)):
        if frame is None or not len(frame):
            why = "is missing" if frame is None else "has no rows"
            figures = drawn_from(name, summary)
            verb = "are" if len(figures) > 1 else "is"
            notes.append(f"{Path(results_dir) / name} {why}: {figures_text(figures)} {verb} "
                         "left out")
    return notes


def left_out(
    summary: pd.DataFrame, requests: pd.DataFrame | None = None, point: int | None = None
) -> list[str]:
    """What the figures of these results leave out, a line for the allocators and one for the
    sweep points (none when they draw everything); each figure's title says it for itself.
    `requests`: to count the address map's slab allocators; `point`: the one sweep point the
    timeline and the address map draw (`kvfrag plot --point N`)."""
    summary = _with_keys(summary)
    labels = _labels(summary)
    points = sorted(int(p) for p in pd.unique(summary["point"]))
    slab = []
    if requests is not None and "offset_bytes" in requests.columns:
        slab = _slab_labels(requests, summary)
    notes = []
    if len(labels) > MAX_ALLOCATORS:
        text = f"the figures show {MAX_ALLOCATORS} of {len(labels):,} allocators"
        if len(slab) > MAX_ALLOCATORS:
            text += f" (the address map {MAX_ALLOCATORS} of {len(slab):,} slab allocators)"
        notes.append(f"{text}: the first {MAX_ALLOCATORS} in the scenario's order")
    if len(points) <= 1:
        return notes
    spaced = [("the breakdown", len(_breakdown_keep(labels, points)[1])),
              ("the capacity figure", len(spread(points, MAX_LINE_POINTS)))]
    first = []
    if point is None:
        first.append(("the timeline", len(_panel_keep(labels, points)[1])))
        if slab:
            first.append(("the address map", len(_panel_keep(slab, points)[1])))
    spaced = [(what, n) for what, n in spaced if n < len(points)]
    first = [(what, f"the first {n}") for what, n in first if n < len(points)]
    parts = []
    if spaced:
        parts.append(_shows(spaced) + " (evenly spaced, the first and last included)")
    if first:
        parts.append(_shows(first) + " (kvfrag plot --point N draws any one)")
    if parts:
        notes.append(f"of {len(points):,} sweep points, " + "; ".join(parts))
    return notes


def _shows(items: Sequence[tuple[str, object]]) -> str:
    """`the breakdown shows 6 and the capacity figure 50`, or `A and B show 6` when alike."""
    if len({str(n) for _, n in items}) == 1:
        whats = " and ".join(what for what, _ in items)
        return f"{whats} {'shows' if len(items) == 1 else 'show'} {items[0][1]}"
    (what, n), *rest = items
    return f"{what} shows {n}" + "".join(f" and {w} {m}" for w, m in rest)


def _note(line: str) -> None:
    """`plot_results`' default `say`: a line on stderr."""
    print(f"kvfrag: note: {line}", file=sys.stderr, flush=True)


def _folder_meta(
    results_dir: Path, meta: Mapping | None, requests: pd.DataFrame | None
) -> dict:
    """The caption's facts: the folder's (`load_meta`) over `meta`, with the workload as
    `kvfrag run` prints it (its source and the requests it holds)."""
    folder = load_meta(results_dir)
    merged = {**dict(meta or {}), **folder}
    if folder.get("scenario"):
        merged.pop("name", None)
    spec = folder.get("workload")
    if isinstance(spec, Mapping):
        count = None
        if requests is not None:
            req = _with_keys(requests)
            first = req[req["point"] == _first_point(req)]
            count = int((first["label"].astype(str) == _labels(first)[0]).sum())
        merged["workload"] = workload_text(spec, folder.get("seeds"), count)
    merged.pop("seeds", None)
    return merged


def workload_text(spec: Mapping, seeds: Sequence | None = None, count: int | None = None) -> str:
    """A resolved workload as `kvfrag run` names it: its trace's path, or `synthetic, seed N`
    (`seeds ...` when swept), with the number of requests; other mappings by their settings."""
    trace = spec.get("trace")
    if isinstance(trace, Mapping) and trace.get("path"):
        text = str(trace["path"])
    elif spec.get("synthetic") is not None:
        if seeds:
            text = f"synthetic, seeds {', '.join(map(str, seeds))}"
        else:
            text = f"synthetic, seed {spec.get('seed', 0)}"
    else:
        text = _describe(spec)
    return f"{text} ({count:,} requests)" if count else text


def load_meta(results_dir: Path | str) -> dict:
    """The caption's facts from `results_dir/scenario.resolved.yaml`, if it is there (missing
    file or keys: an empty or partial dict); `seeds` when the sweep is over workload.seed."""
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
    sweep = doc.get("sweep")
    if isinstance(sweep, Mapping) and isinstance(sweep.get("workload.seed"), list):
        meta["seeds"] = sweep["workload.seed"]
    return meta


def redraw(results_dir: Path | str, svg: bool = False, point: int | None = None) -> list[Path]:
    """`kvfrag plot RESULTS_DIR [--svg] [--point N]`: redraw a results folder's figures from
    its files (PNG; SVG too with `svg`, and wherever an SVG was drawn before: see
    `plot_results`); with `point`, the timeline, the address map (and, for hybrid runs, the
    groups figure) of that sweep point alone, as `plots/timeline-pointN.png` and so on."""
    return plot_results(Path(results_dir), load_meta(results_dir), svg, point)


__all__ = [
    "FIGURES",
    "PALETTE",
    "PARTS",
    "PART_NAMES",
    "ResultsFileError",
    "address_map_figure",
    "breakdown_figure",
    "byte_unit",
    "capacity_figure",
    "caption",
    "caption_parts",
    "drawn_from",
    "figures_text",
    "format_bytes",
    "left_out",
    "lengths_figure",
    "load_meta",
    "missing_notes",
    "plot_results",
    "point_names",
    "point_stem",
    "read_frame",
    "read_summary",
    "redraw",
    "resample",
    "save_figure",
    "sequences",
    "slab_polygons",
    "sweep_axis",
    "sweep_columns",
    "timeline_figure",
    "workload_text",
]
