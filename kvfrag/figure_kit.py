"""What every figure of a results folder shares: one palette, the caps on what a figure
draws, and the plumbing that lays figures out and writes them.

- `PALETTE`, `HATCH`, `PART_NAMES`: a colour and a name per part of the KV budget, the same in
  every figure (token states are always green); `LABEL_COLORS`, `LABEL_MARKERS` and
  `LABEL_STYLES` tell allocators apart in line plots without those colours.
- The caps: a figure draws at most what a person can read (MAX_ALLOCATORS allocators,
  MAX_PANELS panels, MAX_POINT_PANELS and MAX_LINE_POINTS sweep points, evenly spaced by
  `spread`), and says in its title what it leaves out (`_allocators_note`, `_points_note`,
  `_left_out`).
- `format_bytes` and `byte_unit`: bytes as people read them; `_bars`: bars drawn as one
  collection; `save_figure`: PNG (and SVG), each file written atomically.

Figures are built on `matplotlib.figure.Figure` (Agg), never pyplot: no global state, safe to
call from threads and from tests. Rectangles are drawn as collections, one artist per colour
rather than one per bar or slab: a draw's Python cost grows with the number of artists, hardly
with the shapes in a collection.
"""

from __future__ import annotations

import math
import os
import textwrap
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from kvfrag.sim.allocators.base import PARTS  # the five parts, bottom to top of every stack

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

GIB = 2**30
_T = TypeVar("_T")
_DPI = 150

#: The summary's column of each part: a fraction of the budget (summary.csv, `<part>_frac`).
FRAC = {p: f"{p}_frac" for p in (*PARTS, "internal_overreservation", "internal_padding",
                                  "internal_out_of_window", "internal_rounding")}
#: The time series' column of each part: bytes (timeseries.parquet, `<part>_bytes`).
BYTES = {p: f"{p}_bytes" for p in PARTS}


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
