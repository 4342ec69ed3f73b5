"""Sweeps over two keys or more, as figures show them (`kvfrag.plots`).

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
    from kvfrag.plots import _fmt_value, _is_number, _point_value

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
