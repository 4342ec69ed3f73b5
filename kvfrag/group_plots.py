"""The per-group view of hybrid runs: block ids held per KV-cache group kind over time.

A hybrid model's allocator (`hybrid`) keeps one block table per KV-cache group; the engine
records, at each time-series row, the blocks each kind of group holds (`blocks_<kind>`
columns of timeseries.parquet: full, sliding_window, chunked_local, mla, mamba). This figure
stacks them over time, a panel per run, with the pool's block ids as a dashed line: with the
hybrid manager on, the sliding groups' share stays bounded by their window while the full
groups' grows with the requests; with it off (every layer promoted to full) one kind holds
everything. Runs of other allocators have no such columns and get no panel; a folder
without any gets no figure (`group_figure` returns None)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from kvfrag.captions import _new_figure
from kvfrag.figure_kit import (
    MAX_PANELS,
    MAX_SEGMENTS,
    _finish_axes,
    _labels,
    _notes_text,
    _with_keys,
)
from kvfrag.sweep_plots import _point_title
from kvfrag.timeline_plots import resample

#: The prefix of the time series' per-group-kind columns.
PREFIX = "blocks_"
#: Each group kind's colour and name (sliding: the window's green-blue, full: grey-blue).
KINDS: dict[str, tuple[str, str]] = {
    "full": ("#4c72b0", "full attention"),
    "mla": ("#8172b3", "MLA"),
    "sliding_window": ("#55a868", "sliding window"),
    "chunked_local": ("#64b5cd", "chunked local"),
    "mamba": ("#c44e52", "Mamba state"),
}


def group_columns(timeseries: pd.DataFrame | None) -> list[str]:
    """The time series' `blocks_<kind>` columns, in KINDS order (unknown kinds last)."""
    if timeseries is None:
        return []
    cols = [c for c in timeseries.columns if c.startswith(PREFIX)]
    order = {kind: i for i, kind in enumerate(KINDS)}
    return sorted(cols, key=lambda c: (order.get(c[len(PREFIX):], len(order)), c))


def group_figure(
    timeseries: pd.DataFrame | None,
    summary: pd.DataFrame | None,
    meta: Mapping | None = None,
    point: int | None = None,
) -> Figure | None:
    """Stacked blocks held per KV-cache group kind over time, a panel per run that has
    groups (at most MAX_PANELS, the first in the scenario's order); None where none has."""
    cols = group_columns(timeseries)
    if timeseries is None or not cols or not len(timeseries):
        return None
    ts = _with_keys(timeseries)
    if point is not None:
        ts = ts[ts["point"] == point]
    runs = []
    labels = _labels(summary) if summary is not None else _labels(ts)
    points = sorted(int(p) for p in pd.unique(ts["point"]))
    for p in points:
        for label in labels:
            rows = ts[(ts["point"] == p) & (ts["label"].astype(str) == label)]
            held = [c for c in cols if rows[c].notna().any()] if len(rows) else []
            if held:
                runs.append((p, label, rows, held))
    if not runs:
        return None
    notes = []
    if len(runs) > MAX_PANELS:
        notes.append(f"showing {MAX_PANELS} of {len(runs)} hybrid runs: the first in the "
                     "scenario's order")
        runs = runs[:MAX_PANELS]
    ncols = min(len(runs), 2)
    nrows = math.ceil(len(runs) / ncols)
    width = 5.6 * ncols + 2.2
    fig = _new_figure(width, 0.9 + 2.9 * nrows + 0.2 * len(notes), meta, summary)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for ax in axes[len(runs):]:
        ax.set_visible(False)
    drawn: dict[str, None] = {}
    for ax, (p, label, rows, held) in zip(axes, runs, strict=False):
        rows = rows.sort_values("t_s")
        rows = rows.assign(**{c: rows[c].fillna(0.0) for c in held})
        if len(rows) > MAX_SEGMENTS:
            rows = resample(rows, MAX_SEGMENTS, held)
        t = rows["t_s"].to_numpy(float)
        x = np.append(t, t[-1] + float(rows["dt_s"].iloc[-1]))
        bottom = np.zeros(len(x))
        for c in held:
            kind = c[len(PREFIX):]
            color, name = KINDS.get(kind, ("#999999", kind))
            y = rows[c].to_numpy(float)
            y = np.append(y, y[-1])
            ax.fill_between(x, bottom, bottom + y, step="post", color=color, linewidth=0,
                            label=name)
            bottom = bottom + y
            drawn[kind] = None
        pool = _pool_blocks(summary, label, p)
        if pool:
            ax.axhline(pool, color="#444444", linestyle="--", linewidth=1.0)
            ax.text(x[0], pool, f" pool: {pool:,} block ids", va="bottom", ha="left",
                    fontsize=8, color="#444444")
            ax.set_ylim(0, pool * 1.12)
        title = label if len(points) == 1 else f"{label}, {_point_title(summary, p)}" \
            if summary is not None else f"{label}, point {p}"
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("simulated time (s)")
        ax.set_xlim(x[0], x[-1])
        _finish_axes(ax)
    for ax in axes[::ncols]:
        ax.set_ylabel("block ids held")
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=KINDS.get(k, ("#999999", k))[0], label=KINDS.get(k, ("", k))[1])
               for k in drawn]
    fig.legend(handles=handles, loc="outside right center", fontsize=9, frameon=False,
               title="KV-cache group kind", title_fontsize=9)
    fig.suptitle("Blocks held per KV-cache group kind over time (hybrid allocators)"
                 + _notes_text(notes, width), fontsize=11)
    return fig


def _pool_blocks(summary: pd.DataFrame | None, label: str, point: int) -> int:
    """The block ids requests can hold in a run's pool (the plan's, less the null block)."""
    if summary is None or "hybrid_num_blocks" not in summary.columns:
        return 0
    s = _with_keys(summary)
    rows = s[(s["label"].astype(str) == label) & (s["point"] == point)]
    if not len(rows):
        return 0
    value = pd.to_numeric(rows["hybrid_num_blocks"], errors="coerce").iloc[0]
    return int(value) - 1 if pd.notna(value) and value > 0 else 0
