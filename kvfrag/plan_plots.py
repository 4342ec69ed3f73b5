"""plan.png: the targeted latency percentile against the arrival rate, one line per allocator.

One panel per target (`p99 TTFT <= 2 s`, ...): every rate probed for each allocator's best
setting, the target as a dashed line, the rate found marked with a star; probes that missed
the target (for any reason, rejections and unfinished requests included) are hollow. Both
axes are logarithmic: probes double while bracketing, then close in. Built on a bare
`Figure` (Agg), like every kvfrag figure.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.ticker as mticker
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvfrag.figure_kit import LABEL_COLORS, LABEL_MARKERS
from kvfrag.plan_search import Target, format_seconds

TARGET_COLOR = "#d62728"
#: Allocators drawn at most (the first ones, in the scenario's order).
MAX_LINES = len(LABEL_COLORS)


def plan_figure(
    probes: pd.DataFrame, answers: pd.DataFrame, targets: Sequence[Target], varies: str
) -> Figure:
    """The figure of one plan, from plan.csv's and answer.csv's frames."""
    best = answers[answers["best"]].head(MAX_LINES)
    fig = Figure(figsize=(6.0 * len(targets), 4.4), layout="constrained")
    axes = fig.subplots(1, len(targets), squeeze=False)[0]
    for ax, target in zip(axes, targets, strict=True):
        handles: list[Line2D] = []
        for i, (_, row) in enumerate(best.iterrows()):
            mine = probes[probes["search"] == row["search"]].sort_values("rate_req_s")
            mine = mine[np.isfinite(mine["rate_req_s"].astype(float))
                        & (mine[target.column].astype(float) > 0)]
            if not len(mine):
                continue
            color = LABEL_COLORS[i % len(LABEL_COLORS)]
            marker = LABEL_MARKERS[i % len(LABEL_MARKERS)]
            x, y = mine["rate_req_s"].astype(float), mine[target.column].astype(float)
            met = mine["met"].astype(bool).to_numpy()
            ax.plot(x, y, color=color, linewidth=1.2)
            handles.append(Line2D([], [], color=color, marker=marker, markersize=5,
                                  label=_name(row, answers)))
            ax.scatter(x[met], y[met], color=color, marker=marker, s=28, zorder=3)
            ax.scatter(x[~met], y[~met], facecolors="none", edgecolors=color, marker=marker,
                       s=28, zorder=3)
            chosen = mine[mine["answer"].astype(bool)]
            if len(chosen):
                ax.scatter(chosen["rate_req_s"], chosen[target.column], color=color,
                           marker="*", s=180, edgecolors="black", linewidths=0.6, zorder=4)
        handles.append(ax.axhline(target.seconds, color=TARGET_COLOR, linestyle="--",
                                  linewidth=1.2,
                                  label=f"target {format_seconds(target.seconds)}"))
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # (plain numbers, not 6x10^0)
            axis.set_major_formatter(_Plain())
            axis.set_minor_formatter(_Plain(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(f"{target.name} (s)")
        ax.set_title(target.describe())
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(handles=handles, fontsize=8, loc="best")
    left = len(answers[answers["best"]]) - len(best)
    note = f"; first {MAX_LINES} allocators ({left} left out)" if left > 0 else ""
    fig.suptitle(f"Highest rate within the target, varying {varies} (star: the rate found; "
                 f"hollow: target missed){note}", fontsize=10)
    return fig


class _Plain(mticker.LogFormatter):
    """Log-axis ticks as plain numbers (0.05, 2, 20), labelled as matplotlib chooses."""

    def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
        return f"{x:g}"


def _name(row: pd.Series, answers: pd.DataFrame) -> str:
    """The allocator's label, with its best setting when there is a grid."""
    grid = []
    for col in answers.columns:  # (the grid's columns come between kind and best)
        if col == "best":
            break
        value = row[col]
        if col not in ("search", "label", "kind") and not pd.isna(value):
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # (read back from a CSV with empty cells: 8.0)
            grid.append(f"{col}={value}")
    return f"{row['label']} ({', '.join(grid)})" if grid else str(row["label"])
