"""The timeline figure: the KV budget's five parts over time, per allocator and sweep point.

`timeline_figure(timeseries, summary)` stacks the parts (in the unit that fits the budget)
under a small panel of the requests running and waiting, and shades where the queue's head
was refused for fragmentation. Every sweep point is drawn (`point`: that one only) up to
MAX_PANELS panels; runs longer than MAX_SEGMENTS segments are time-averaged (`resample`,
which keeps areas).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from kvfrag.captions import _new_figure
from kvfrag.figure_kit import (
    BYTES,
    MAX_SEGMENTS,
    PALETTE,
    PART_NAMES,
    RUNNING_COLOR,
    WAITING_COLOR,
    _allocators_note,
    _columns,
    _finish_axes,
    _labels,
    _left_out,
    _notes_text,
    _panel_keep,
    _say,
    _with_keys,
    byte_unit,
)
from kvfrag.sim.allocators.base import PARTS
from kvfrag.sweep_plots import _pick_points, point_names


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
