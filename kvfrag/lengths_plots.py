"""The lengths figure: the workload's prompt and output lengths, as cumulative distributions.

Every allocator replays the same workload, so `lengths_figure(requests)` draws the first
allocator's requests of the first sweep point, with each distribution's median, p99 and
maximum in the legend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from kvfrag.captions import _new_figure
from kvfrag.figure_kit import (
    OUTPUT_COLOR,
    PROMPT_COLOR,
    _finish_axes,
    _first_point,
    _labels,
    _with_keys,
)

#: More requests than this: the length CDFs are drawn through this many evenly spaced ranks.
_CDF_POINTS = 2000


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
