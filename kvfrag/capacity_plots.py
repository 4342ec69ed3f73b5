"""The capacity figure (`kvfrag.plots` draws it): how many requests each allocator
holds at once, its throughput and latency, and what a scenario is about where its runs show
it (prefix-cache hits, memory saved by sharing, compaction stall); bars per allocator, or for
a sweep, lines against the swept value (two keys and more: `kvfrag.sweep_plots`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvfrag.captions import _new_figure, _swept_keys
from kvfrag.figure_kit import (
    _MAX_TICKS,
    BAR_COLOR,
    MAX_ALLOCATORS,
    MAX_LINE_POINTS,
    _allocators_note,
    _bars,
    _columns,
    _finish_axes,
    _label_style,
    _labels,
    _notes_text,
    _points_note,
    _with_keys,
    format_bytes,
    spread,
)
from kvfrag.sweep_plots import (
    GROUP_STYLES,
    _axis_name,
    fit_text,
    line_split,
    sweep_axis,
    tick_layout,
)


def _capacity_metrics(summary: pd.DataFrame) -> list[dict[str, Any]]:
    """The capacity figure's panels: requests running, capacity (requests at once at
    saturation, `sim.capacity`), throughput and latency always (capacity and latency where the
    summary has them), then what a scenario is about when its runs show it: prefix
    cache hits, memory saved by sharing, compaction stall."""

    def shows(col: str) -> bool:
        return col in summary.columns and bool(
            (pd.to_numeric(summary[col], errors="coerce").fillna(0) > 0).any()
        )

    metrics: list[dict[str, Any]] = [
        {"main": "mean_running", "extra": "max_running", "fmt": "{:.1f}", "efmt": "{:.0f}",
         "ylabel": "requests running at once", "title": "Requests running at once",
         "bar_note": "bar: time-averaged mean, black line: max",
         "line_note": "filled, joined: time-averaged mean; hollow: max"},
        {"main": "throughput_tok_s", "fmt": "{:,.0f}", "title": "Throughput",
         "ylabel": "throughput (generated tokens / s)",
         "bar_note": "generated tokens over the run's span"},
    ]
    if shows("capacity_requests"):  # (what the memory holds, whatever the arrival rate)
        metrics.insert(1, {
            "main": "capacity_requests", "fmt": "{:.1f}", "title": "Capacity",
            "ylabel": "requests running at once, saturated",
            "bar_note": "requests at once when the queue never empties",
            "line_note": "requests at once when the queue never empties"})
    if "mean_latency_s" in summary.columns:
        metrics.append(
            {"main": "mean_latency_s", "extra": "p99_latency_s", "fmt": "s",
             "ylabel": "latency, arrival to finish (s)", "title": "Latency",
             "bar_note": "bar: mean, black line: p99", "line_note": "filled, joined: mean; "
             "hollow: p99"}
        )
    if shows("prefix_hit_rate_tokens"):
        metrics.append(
            {"main": "prefix_hit_rate_tokens", "extra": "prefix_hit_rate_first_tokens",
             "factor": 100.0, "fmt": "{:.1f}%", "efmt": "{:.1f}%",
             "ylabel": "prompt tokens found cached (%)", "title": "Prefix cache hits",
             "bar_note": "bar: at every admission, black line: first admissions only",
             "line_note": "filled, joined: every admission; hollow: first admissions"}
        )
    if shows("memory_saved_by_sharing_frac"):
        metrics.append(
            {"main": "memory_saved_by_sharing_frac", "factor": 100.0, "fmt": "{:.1f}%",
             "ylabel": "memory saved by sharing (%)", "title": "Memory saved by sharing",
             "bar_note": "share of what separate copies would need"}
        )
    if shows("compactions"):
        metrics.append(
            {"main": "stall_s", "fmt": "{:.2f} s", "ylabel": "stall (s)",
             "title": "Compaction stall", "bar_note": "running requests wait while slabs move",
             "compactions": True}
        )
    return metrics


def _values(rows: pd.DataFrame, col: str | None, factor: float = 1.0) -> np.ndarray:
    if col is None or col not in rows.columns:
        return np.full(len(rows), np.nan)
    return pd.to_numeric(rows[col], errors="coerce").to_numpy(float) * factor


def _grid(n: int) -> tuple[int, int]:
    """(rows, columns) of `n` panels: up to three in a row, four as two by two."""
    ncols = _columns(n)
    return math.ceil(n / ncols), ncols


def capacity_figure(summary: pd.DataFrame, meta: Mapping | None = None) -> Figure:
    """Requests running at once (mean and max), throughput and latency (mean and p99) per
    allocator, and where a scenario shows them, prefix cache hits, memory saved by sharing
    and compaction stall; for a sweep, each against the swept value, a line per allocator. At
    most MAX_ALLOCATORS allocators (the first) and MAX_LINE_POINTS sweep points (evenly spaced):
    the title says what is left out."""
    full = summary = _with_keys(summary)
    every = _labels(summary)
    labels = every[:MAX_ALLOCATORS]
    points = sorted(int(p) for p in pd.unique(summary["point"]))
    kept = spread(points, MAX_LINE_POINTS)
    notes = _allocators_note(len(labels), len(every)) + _points_note(len(kept), len(points))
    if notes:
        summary = summary[summary["label"].astype(str).isin(labels) & summary["point"].isin(kept)]
    metrics = _capacity_metrics(summary)
    if len(points) > 1:
        return _capacity_sweep(summary, labels, meta, metrics, full, notes)
    rows = (
        summary.drop_duplicates("label")
        .set_index(summary.drop_duplicates("label")["label"].astype(str))
        .loc[labels]
    )
    nrows, ncols = _grid(len(metrics))
    per_bar = max(0.75, 0.085 * max(len(s) for s in labels) + 0.25)
    long_names = 1.0 + per_bar * len(labels) > 7.5
    if long_names:
        per_bar = 0.6
    panel_w = max(1.0 + per_bar * len(labels), 3.6)
    fig_w = max(min(ncols * panel_w, 15), 7.0)
    fig = _new_figure(
        fig_w,
        (4.6 if nrows == 1 else 4.0) * nrows
        + (0.08 * max(len(s) for s in labels) if long_names else 0) + 0.2 * len(notes),
        meta,
        full,
    )
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    x = np.arange(len(labels))
    for ax, m in zip(axes, metrics, strict=False):
        factor = m.get("factor", 1.0)
        main = _values(rows, m["main"], factor)
        extra = _values(rows, m.get("extra"), factor)
        top = _top(np.append(main, extra))
        _bars(ax, x, np.nan_to_num(main), 0.6, facecolors=BAR_COLOR, edgecolors="none")
        if m.get("extra"):
            ax.hlines(extra, x - 0.3, x + 0.3, colors="black", linewidths=2.0, zorder=3)
        for i, (xi, v, e) in enumerate(zip(x, main, extra, strict=True)):
            if not np.isfinite(v):
                ax.text(xi, 0, "–", ha="center", va="bottom", fontsize=8)
                continue
            text = _format(v, m["fmt"])
            if m.get("compactions"):
                count = _values(rows, "compactions")[i]
                moved = _values(rows, "bytes_moved")[i]
                if np.isfinite(count) and count > 0:
                    text += f"\n{count:,.0f} compactions"
                    if np.isfinite(moved):
                        text += f"\n{format_bytes(moved)} moved"
            has_extra = bool(m.get("extra")) and np.isfinite(e)
            etext = _format(e, m.get("efmt", m["fmt"])) if has_extra else ""
            if has_extra and v >= 0.12 * top:  # the value inside its bar, the extra on its line
                ax.text(xi, v / 2, text, ha="center", va="center", color="white", fontsize=9,
                        fontweight="bold")
                ax.text(xi, e, etext, ha="center", va="bottom", fontsize=8)
            else:  # a low bar: both values above the bar and the line, in the title's order
                label = f"{text} / {etext}" if has_extra else text
                ax.text(xi, max(v, e) if has_extra else v, label, ha="center", va="bottom",
                        fontsize=8)
        ax.set_ylabel(m["ylabel"])
        ax.set_title(f"{m['title']}\n({m['bar_note']})", fontsize=10)
        ax.set_ylim(0, top * (1.3 if m.get("compactions") else 1.18))
        ax.set_xticks(
            x,
            labels,
            rotation=35 if long_names else 0,
            ha="right" if long_names else "center",
            rotation_mode="anchor" if long_names else "default",
        )
        _finish_axes(ax)
    fig.suptitle("Serving capacity and latency per allocator" + _notes_text(notes, fig_w),
                 fontsize=11)
    return fig


def _top(values: np.ndarray) -> float:
    """The largest finite value, 1 when there is none above 0 (an axis limit that is never
    NaN or zero)."""
    finite = values[np.isfinite(values)]
    return float(finite.max()) if len(finite) and finite.max() > 0 else 1.0


def _format(value: float, fmt: str) -> str:
    """`fmt.format(value)`; fmt "s": seconds to about three significant digits (0.044, 2.27,
    26.5, 4,410)."""
    if fmt != "s":
        return fmt.format(value)
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if size >= 1 else f"{value:.2g}"


def _capacity_sweep(
    summary: pd.DataFrame,
    labels: list[str],
    meta,
    metrics: list[dict[str, Any]],
    full: pd.DataFrame,
    notes: list[str],
) -> Figure:
    """The capacity figure of a sweep: `summary`'s rows (the part of `full` drawn) against
    the swept value, named from `full`. A sweep over two keys or more puts its first key on x
    and draws a line per value of the others (`kvfrag.sweep_plots.line_split`), each in a
    style of its own; where they take too many values, a point per tick, named in lines."""
    split = line_split(full, _swept_keys(full))
    if split is None:
        xlabel, xs, text, numeric = sweep_axis(full)
        group = {p: 0 for p in xs}
    else:
        xlabel, xs, text, numeric = _axis_name(split.key), split.xs, split.text, split.numeric
        group = split.group
    drawn = {int(p) for p in pd.unique(summary["point"])}
    xs = {p: x for p, x in xs.items() if p in drawn}
    nrows, ncols = _grid(len(metrics))
    fig_w = min(6.0 * ncols, 17)
    fig = _new_figure(fig_w, (4.8 if nrows == 1 else 4.0) * nrows + 0.2 * len(notes), meta, full)
    axes = fig.subplots(nrows, ncols, sharex=True, squeeze=False).ravel()
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    axes = axes[: len(metrics)]
    groups = sorted({group[p] for p in xs})
    for i, label in enumerate(labels):
        style = _label_style(i)
        for j in groups:
            if split is not None:
                style = {**style, "linestyle": GROUP_STYLES[j]}
            rows = summary[summary["label"].astype(str) == label].sort_values("point")
            rows = rows.drop_duplicates("point")
            rows = rows[[group[int(p)] == j for p in rows["point"]]]
            x = np.array([xs[int(p)] for p in rows["point"]])
            order = np.argsort(x, kind="stable")
            x = x[order]
            for ax, m in zip(axes, metrics, strict=True):
                factor = m.get("factor", 1.0)
                if m["main"] in rows:
                    ax.plot(x, _values(rows, m["main"], factor)[order], ms=5,
                            label=label if j == groups[0] else None, **style)
                if m.get("extra") and m["extra"] in rows:
                    ax.plot(
                        x,
                        _values(rows, m["extra"], factor)[order],
                        color=style["color"],
                        marker=style["marker"],
                        ms=6,
                        linestyle="none",
                        mfc="none",
                        mew=1.0,
                        alpha=0.7,
                    )
    for ax, m in zip(axes, metrics, strict=True):
        ax.set_ylabel(m["ylabel"])
        note = m.get("line_note") if m.get("extra") else None
        ax.set_title(m["title"] + (f"\n({note})" if note else ""), fontsize=10)
    values = sorted(set(xs.values()))
    log_x = numeric and values[0] > 0 and values[-1] / values[0] >= 8
    axis_in = fig_w / ncols - 1.6  # (the y axis' label and ticks take the rest)
    for j, ax in enumerate(axes):
        if j + ncols >= len(axes):
            ax.set_xlabel(xlabel + (" (log scale)" if log_x else ""))
        else:
            ax.tick_params(labelbottom=False)
        ys = [np.asarray(ln.get_ydata(), float) for ln in ax.get_lines()]
        ax.set_ylim(0, _top(np.concatenate(ys) if ys else np.zeros(0)) * 1.1)
        if log_x:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_minor_locator(mticker.NullLocator())
            ax.xaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
        if not numeric or len(values) <= 12:
            names = {xs[p]: fit_text(text[p], axis_in / len(values)) for p in xs}
            fit, rot = tick_layout([names[v] for v in values], axis_in)
            ticks = spread(values, min(fit, _MAX_TICKS))
            ax.set_xticks(ticks, [names[t] for t in ticks], rotation=rot,
                          ha="right" if rot else "center",
                          rotation_mode="anchor" if rot else "default")
        ax.grid(alpha=0.3)
        _finish_axes(ax)
    handles, names = axes[1].get_legend_handles_labels()
    if split is not None and len(groups) > 1:
        grey = "#444444"
        handles += [Line2D([], [], color="none")] + [
            Line2D([], [], color=grey, linestyle=GROUP_STYLES[j]) for j in groups]
        names += [f"lines: {split.title}"] + [split.names[j] for j in groups]
    fig.legend(handles, names, loc="outside right center", fontsize=9, frameon=False)
    fig.suptitle(f"Serving capacity and latency against {xlabel}, per allocator"
                 + (f" and {split.title}" if split is not None and len(groups) > 1 else "")
                 + _notes_text(notes, fig_w), fontsize=11)
    return fig
