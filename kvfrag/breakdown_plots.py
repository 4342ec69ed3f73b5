"""The breakdown figure: where the KV budget went, per allocator.

`breakdown_figure(summary)` stacks the budget's five parts (token states, reserved, internal,
external and free; internal split into over-reservation, rounding and a hybrid model's padding
and out-of-window bytes where the summary has them), time-averaged, as % of the budget: a bar
per allocator and a panel per sweep point, or a bar per point when one allocator is swept.
When the parts that hold no tokens are small (at most ZOOM_BELOW %), a row below zooms in on
them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kvfrag.captions import _new_figure
from kvfrag.figure_kit import (
    FRAC,
    HATCH,
    PALETTE,
    PART_NAMES,
    _allocators_note,
    _bars,
    _breakdown_keep,
    _finish_axes,
    _labels,
    _notes_text,
    _points_note,
    _with_keys,
)
from kvfrag.sim.allocators.base import PARTS
from kvfrag.sweep_plots import _point_title, fit_text, sweep_axis


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
        if title:  # (a point's name: a line per key if wide)
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
