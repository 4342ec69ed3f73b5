"""`kvfrag compare -o DIR`'s figures, from `kvfrag.comparison`'s document: folder against
folder, a bar per folder side by side for each compared row.

- `breakdown_figure`: the budget's five parts (time-averaged), stacked, with token states'
  share in the green and its Δ against the baseline above each other bar;
- `capacity_figure`: requests running, throughput, latency, time to first token and per
  output token (and prefix hits, sharing, compaction stall where a folder shows them), with
  the Δ against the baseline above each bar.

The folders, and the first scenario differences, are the caption at the bottom.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kvfrag.compare_table import _delta_text, _setting_text, _signed
from kvfrag.comparison import Folder

if TYPE_CHECKING:  # matplotlib is imported only when a figure is drawn
    from matplotlib.figure import Figure


#: Bar colours of the folders in the capacity figure (kvfrag.figure_kit's colours for labels).
FOLDER_COLORS = ("#1f77b4", "#8c564b", "#e377c2", "#17becf", "#393b79", "#7f7f7f", "#bcbd22")


def _caption(fig: Figure, doc: dict[str, Any], width_in: float) -> None:
    """The folders (and the first scenario differences) in small print at the bottom."""
    import textwrap

    bits = [f"{f['name']}: {f['path']}" + (f" ({f['scenario']})" if f["scenario"] else "")
            for f in doc["folders"]]
    for entry in doc["scenario_diff"][:3]:
        shown = [_setting_text(entry["key"], entry["values"][n["name"]], 24)
                 if n["name"] in entry["values"] else "(absent)" for n in doc["folders"]]
        bits.append(f"{entry['key']}: {' → '.join(shown)}")
    if len(doc["scenario_diff"]) > 3:
        bits.append(f"and {len(doc['scenario_diff']) - 3} more scenario differences")
    limit = max(int(width_in * 72 / (8 * 0.56)), 30)
    lines = textwrap.wrap("  ·  ".join(bits), limit)
    height = fig.get_figheight() + 0.17 * len(lines)
    fig.set_figheight(height)
    fig.text(0.5, 0.06 / height, "\n".join(lines), ha="center", va="bottom", fontsize=8,
             color="#444444", linespacing=1.4)
    bottom = (0.1 + 0.17 * len(lines)) / height
    fig.get_layout_engine().set(rect=(0, bottom, 1, 1 - bottom))


def _group_width(rows: list[dict[str, Any]], bars_in: float) -> tuple[float, bool]:
    """Inches a row's group of bars gets (room for its name, up to a limit), and whether its
    name is turned to fit."""
    name_in = 0.085 * max(len(r["name"]) for r in rows) + 0.2
    per_group = max(bars_in, min(name_in, 2.2))
    rotate = name_in > per_group or len(rows) * per_group > 18
    return (max(bars_in, 0.6) if rotate else per_group), rotate


def _group_axis(ax: Any, rows: list[dict[str, Any]], names: list[str], step: float,
                rotate: bool) -> None:
    """Folder letters under each bar, row names under each group."""
    n = len(names)
    minor = [g + (i - (n - 1) / 2) * step for g in range(len(rows)) for i in range(n)]
    ax.set_xticks(minor, [nm for _ in rows for nm in names], minor=True, fontsize=7)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows],
                  rotation=30 if rotate else 0, ha="right" if rotate else "center",
                  rotation_mode="anchor" if rotate else "default", fontsize=9)
    ax.tick_params(axis="x", which="major", length=0, pad=14)
    ax.tick_params(axis="x", which="minor", length=0)
    ax.set_xlim(-0.6, len(rows) - 0.4)


def breakdown_figure(doc: dict[str, Any], folders: list[Folder]) -> Figure:
    """The budget's five parts (time-averaged) as stacked bars: per row, a bar per folder
    side by side (A, B, ...), token states' share in the green, its Δ against the baseline
    above each other bar."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from kvfrag.breakdown_plots import INTERNAL_SPLIT
    from kvfrag.figure_kit import FRAC, HATCH, PALETTE, PART_NAMES, _bars
    from kvfrag.sim.allocators.base import PARTS

    rows = doc["rows"]
    names = [f["name"] for f in doc["folders"]]
    base = doc["baseline"]
    keys = {m["key"] for m in doc["metrics"]}
    parts = []  # bottom to top; internal as its two parts when the summaries have them
    for p in PARTS:
        split = p == "internal" and all(FRAC[q] in keys for q in INTERNAL_SPLIT)
        parts += [q for q in (INTERNAL_SPLIT if split else (p,)) if FRAC[q] in keys]
    n = len(names)
    step = 0.8 / n
    per_group, rotate = _group_width(rows, 0.45 * n)
    longest = max(len(r["name"]) for r in rows)
    width = min(max(6.5, len(rows) * per_group + 3.2), 22.0)
    fig = Figure(figsize=(width, 5.2 + (0.06 * min(longest, 40) if rotate else 0)), dpi=150,
                 layout="constrained")
    ax = fig.subplots()
    for i, nm in enumerate(names):
        x = np.array([g + (i - (n - 1) / 2) * step for g in range(len(rows))])
        have = np.array([nm in r["values"] for r in rows])
        bottom = np.zeros(len(rows))
        for p in parts:
            h = np.array([100 * (r["values"][nm][FRAC[p]] or 0.0) if nm in r["values"] else 0.0
                          for r in rows])
            _bars(ax, x[have], h[have], step * 0.9, bottom=bottom[have],
                  facecolors=PALETTE[p], edgecolors="white", linewidths=0.5,
                  hatch=HATCH.get(p))
            bottom += h
        for g, r in enumerate(rows):
            if nm not in r["values"]:
                ax.text(x[g], 1, "n/a", ha="center", va="bottom", fontsize=7, color="#666666")
                continue
            ts = 100 * (r["values"][nm]["token_states_frac"] or 0.0)
            ax.text(x[g], ts / 2 if ts >= 7 else ts + 1, f"{ts:.0f}%", ha="center",
                    va="center" if ts >= 7 else "bottom", fontsize=7 if n > 2 else 8,
                    fontweight="bold", color="white" if ts >= 7 else "#1a5e1a")
            delta = r["diff"].get(nm, {}).get("token_states_frac", {}).get("abs")
            if nm != base and delta is not None:
                ax.text(x[g], 101, _signed(100 * delta, "pp") if delta else "=",
                        ha="center", va="bottom", fontsize=7, color="#1a5e1a")
    _group_axis(ax, rows, names, step, rotate)
    ax.set_ylim(0, 108)
    ax.set_yticks(range(0, 101, 20))
    ax.yaxis.set_major_formatter("{x:.0f}%")
    ax.set_ylabel("share of the KV budget (time-averaged)")
    ax.spines[["top", "right"]].set_visible(False)
    handles = [Patch(facecolor=PALETTE[p], edgecolor="white", hatch=HATCH.get(p),
                     label=PART_NAMES[p]) for p in reversed(parts)]
    legend = fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False,
                        title=f"% in the green bar: token\nstates; above the bars: its Δ\n"
                        f"against {base}, in points", title_fontsize=8)
    legend.get_title().set_color("#444444")
    fig.suptitle(f"Where the KV budget goes: {' vs '.join(names)} (time-averaged)",
                 fontsize=11)
    _caption(fig, doc, width)
    return fig


#: The capacity figure's panels: (main metric, its line (or None), title, y label, factor).
_PANELS = (
    ("mean_running", "max_running", "Requests running at once\n(bar: mean, line: max)",
     "requests", 1.0, None),
    ("throughput_tok_s", None, "Throughput\n(generated tokens / s)", "tokens / s", 1.0, None),
    ("mean_latency_s", "p99_latency_s", "Latency, arrival to finish\n(bar: mean, line: p99)",
     "s", 1.0, None),
    ("mean_ttft_s", "p99_ttft_s", "Time to first token\n(bar: mean, line: p99)", "s", 1.0,
     None),
    ("mean_tpot_s", "p99_tpot_s", "Time per output token\n(bar: mean, line: p99)", "ms",
     1e3, None),
    ("prefix_hit_rate_tokens", None, "Prefix cache hits\n(prompt tokens found cached)", "%",
     100.0, "prefix_hit_rate_tokens"),
    ("memory_saved_by_sharing_frac", None, "Memory saved by sharing", "%", 100.0,
     "memory_saved_by_sharing_frac"),
    ("stall_s", None, "Compaction stall", "s", 1.0, "compactions"),
)


def capacity_figure(doc: dict[str, Any]) -> Figure:
    """Requests running, throughput, latency, time to first token and per output token (and
    prefix hits, sharing, compaction stall where a folder shows them): per row, a bar per
    folder, with the Δ against the baseline above the others."""
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from kvfrag.figure_kit import _bars

    rows = doc["rows"]
    names = [f["name"] for f in doc["folders"]]
    base = doc["baseline"]
    metrics = {m["key"]: m for m in doc["metrics"]}
    panels = [p for p in _PANELS if p[0] in metrics
              and (p[5] is None or metrics[p[0]]["headline"])]
    n = len(names)
    step = 0.8 / n
    bars = len(rows) * n
    ncols = 3 if bars <= 12 else 2 if bars <= 24 else 1
    nrows = math.ceil(len(panels) / ncols)
    per_group, rotate = _group_width(rows, 0.32 * n)
    longest = max(len(r["name"]) for r in rows)
    panel_w = max(3.6, len(rows) * per_group + 1.0)
    width = min(ncols * panel_w, 22.0)
    fig = Figure(figsize=(width, nrows * (3.6 + (0.05 * min(longest, 40) if rotate else 0))),
                 dpi=150, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (main, line, title, ylabel, factor, _) in zip(axes, panels, strict=False):
        top = 0.0
        for i, nm in enumerate(names):
            x = np.array([g + (i - (n - 1) / 2) * step for g in range(len(rows))])
            vals = np.array([_num(r["values"].get(nm, {}).get(main)) * factor for r in rows])
            ext = np.array([_num(r["values"].get(nm, {}).get(line)) * factor if line else np.nan
                            for r in rows])
            ok = np.isfinite(vals)
            _bars(ax, x[ok], vals[ok], step * 0.9, facecolors=FOLDER_COLORS[i % 7],
                  edgecolors="none")
            if line:
                ax.hlines(ext, x - step * 0.45, x + step * 0.45, colors="black",
                          linewidths=1.5, zorder=3)
            heights = np.fmax(np.nan_to_num(vals), np.nan_to_num(ext))
            top = max(top, float(heights.max(initial=0.0)))
            if nm == base:
                continue
            for g, r in enumerate(rows):
                d = r["diff"].get(nm, {}).get(main)
                if d is None or d["abs"] is None:
                    continue
                a = r["values"][base][main]
                text = _delta_text(a, r["values"][nm][main], "g", metrics[main]["diff"])
                ax.annotate(text, (x[g], heights[g]), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", fontsize=6.5,
                            rotation=90 if n > 2 or bars > 12 else 0)
        ax.set_ylim(0, (top or 1.0) * 1.25)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
        _group_axis(ax, rows, names, step, rotate)
        ax.spines[["top", "right"]].set_visible(False)
    handles = [Patch(facecolor=FOLDER_COLORS[i % 7], label=f"{nm}: {f['path']}")
               for i, (nm, f) in enumerate(zip(names, doc["folders"], strict=True))]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    fig.suptitle(f"Serving capacity and latency: {' vs '.join(names)} (numbers above the bars: "
                 f"Δ of the bar against {base})", fontsize=11)
    _caption(fig, doc, width)
    return fig


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)
