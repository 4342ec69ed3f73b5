"""Sweeps as figures show them: which columns are the sweep's keys, what each point is
called, and where it sits on an axis (`kvfrag.plots` and every figure module).

- `sweep_columns`: the summary's sweep-key columns (those between `point` and `hardware` whose
  value changes from point to point); `point_names`: each point as the printed table names it
  (`block_size=32`, `n=2`, `kv_budget=8 GiB`); `sweep_axis`: the points on an x axis, by their
  swept value where it is a number.

A sweep varies several keys at once (its points are their product): `block_size` x
`max_num_seqs` names each point `block_size=16, max_num_seqs=128`. Strung along one axis,
such names pile on each other and the axis reads as arbitrary point numbers. So:

- `line_split`: the capacity figure puts the sweep's first key on the x axis and draws a
  line per value of the others (per allocator), when they take few enough values to tell
  apart by line style (`MAX_GROUPS`; else the first key that leaves few enough);
- `fit_text`: a point's name on a tick or over a panel breaks into a line per key when it is
  wider than the room it has, and `tick_layout` turns and thins ticks that still collide.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from kvfrag.figure_kit import byte_unit, format_bytes
from kvfrag.results import OPTION_PREFIX, short_labels
from kvfrag.sim.engine_records import REJECT_REASONS

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


def key_span(cols: list[str]) -> list[str] | None:
    """The columns summary.csv puts a sweep's keys in: after `point`, up to `hardware` (the
    run's settings follow). `model` is among them: a sweep over the model writes its name
    there, and it varies only then. None for a table without that layout."""
    end = "hardware" if "hardware" in cols else "model"
    if "point" not in cols or end not in cols or cols.index("point") > cols.index(end):
        return None
    return cols[cols.index("point") + 1 : cols.index(end)]


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

    between = key_span(list(summary.columns))
    if between is not None:
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


#: Line styles that tell the values of the other keys apart (the colours and markers tell the
#: allocators apart): more combinations than this and the figure keeps one axis of points.
GROUP_STYLES = ("-", "--", ":", "-.")
MAX_GROUPS = len(GROUP_STYLES)

#: Width of a character at 1 pt, in inches (DejaVu Sans, average): to tell whether text fits.
_CHAR_IN = 0.56 / 72


@dataclass(frozen=True)
class Split:
    """How a two-key (or more) sweep is drawn: `key` on the x axis (`xs`: x per point,
    `text`: tick text per point, `numeric`: whether x is the key's own value), and a line per
    combination of the other keys (`group`: its index per point, `names`: each one's name,
    `title`: what the combinations are of)."""

    key: str
    xs: dict[int, float]
    text: dict[int, str]
    numeric: bool
    group: dict[int, int]
    names: list[str]
    title: str


def line_split(summary: pd.DataFrame, keys: list[str]) -> Split | None:
    """The capacity figure's split of a sweep over `keys` (the summary's sweep-key columns,
    in the scenario's order): its first key along x and a line per combination of the
    others; where those take more than MAX_GROUPS combinations, the first key that leaves
    few enough (`rate_scale` x six `max_num_seqs`: max_num_seqs along x, a line per rate).
    None for a sweep of one key, or when no key leaves few enough."""
    if len(keys) < 2:
        return None
    for key in keys:
        split = _split(summary, key, [k for k in keys if k != key])
        if split is not None:
            return split
    return None


def _split(summary: pd.DataFrame, key: str, others: list[str]) -> Split | None:
    """`key` along x, a line per combination of `others`; None when those take more than
    MAX_GROUPS combinations, or when one holds a value of `key` twice (no line through it)."""
    points = sorted(int(p) for p in pd.unique(summary["point"]))
    value = {p: _point_value(summary, p, key) for p in points}
    rest = {p: tuple(_fmt_value(_point_value(summary, p, c)) for c in others) for p in points}
    combos = list(dict.fromkeys(rest.values()))
    if len(combos) > MAX_GROUPS or any(v is None for v in value.values()):
        return None
    if len({(rest[p], str(value[p])) for p in points}) < len(points):
        return None
    numeric = all(_is_number(v) and not isinstance(v, bool) for v in value.values())
    if numeric:
        xs = {p: float(value[p]) for p in points}
        text = {p: f"{xs[p]:g}" for p in points}
    else:
        order = list(dict.fromkeys(str(value[p]) for p in points))
        xs = {p: float(order.index(str(value[p]))) for p in points}
        text = {p: str(value[p]) for p in points}
    short = [c.split(".")[-1] for c in others]
    names = [", ".join(f"{k}={v}" for k, v in zip(short, combo, strict=True))
             for combo in combos]
    group = {p: combos.index(rest[p]) for p in points}
    return Split(key, xs, text, numeric, group, names, ", ".join(short))


def fit_text(text: str, width_in: float, fontsize: float = 10) -> str:
    """`text` (a point's name, `block_size=16, max_num_seqs=128`) as it fits `width_in`
    inches at `fontsize`: as it is, or a line per key."""
    if len(text) * fontsize * _CHAR_IN <= width_in:
        return text
    return text.replace(", ", "\n")


def tick_layout(
    names: list[str], width_in: float, fontsize: float = 10
) -> tuple[int, int]:
    """(how many of `names`, evenly spaced, fit on an axis `width_in` inches wide; the angle
    to turn them by): level when they fit side by side, else turned 30 degrees, where
    neighbours need twice the height of their lines between them (1 / sin 30 degrees)."""
    if not names:
        return 0, 0
    lines = [line for name in names for line in name.split("\n")]
    widest = max(len(line) for line in lines) * fontsize * _CHAR_IN + 0.15
    if widest * len(names) <= width_in:
        return len(names), 0
    rows = max(name.count("\n") + 1 for name in names)
    turned = 2 * rows * fontsize * 1.3 / 72
    # (a quarter more: the ticks `spread` picks are evenly spaced only to a point or so)
    return max(1, min(len(names), int(width_in / (1.25 * turned)))), 30
