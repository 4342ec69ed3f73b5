"""What one replay found: a per-checkpoint series of predicted vs measured figures, summed up.

Every replay (arena, paged, torch) produces a `series` DataFrame with one row per measured
instant (`seq` of the log row, `op`) and columns `pred_<q>` / `meas_<q>` for each quantity q
it measures. `summarize` turns that into one figure per quantity: the largest absolute error
over the replay, the same relative to the KV budget, and the predicted and measured values at
a reference instant (the first failing one, else the one with the most memory allocated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

#: Statuses: pass/fail against the tolerances; error: the replay could not finish;
#: skip: not run here; measured: torch mode without a model to compare with.
FAILING = ("fail", "error")


@dataclass
class Outcome:
    """One allocator replayed in one mode."""

    label: str
    kind: str
    mode: str
    device: str
    capacity: int
    point: int = 0
    status: str = "pass"
    note: str = ""
    ops: int = 0  # log operations replayed
    checks: int = 0  # instants measured
    max_running: int = 0  # from the simulated run
    corrupt: int = 0  # requests whose bytes no longer held their pattern
    first_fail_seq: int | None = None
    first_fail: str = ""
    problems: int = 0
    series: pd.DataFrame = field(default_factory=pd.DataFrame)
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)

    def fail(self, seq: int, message: str) -> None:
        """Record a failure; the first one is kept as the failing operation."""
        self.problems += 1
        if self.first_fail_seq is None:
            self.first_fail_seq = int(seq)
            self.first_fail = message

    def finish(self, tolerances: dict[str, float]) -> Outcome:
        """Fill `figures` from the series and settle the status against `tolerances`."""
        self.figures = summarize(self.series, tolerances, self.capacity)
        if self.status in ("pass", "fail"):
            over = [
                q for q, f in self.figures.items()
                if f["abs_err"] is not None and f["abs_err"] > f["tol"]
            ]
            self.status = "fail" if over or self.problems or self.corrupt else "pass"
        return self


def summarize(
    series: pd.DataFrame, tolerances: dict[str, float], capacity: int
) -> dict[str, dict[str, Any]]:
    """Per quantity: pred/meas at the reference instant, max |error|, relative error, tolerance."""
    if series.empty:
        return {}
    names = [c[5:] for c in series.columns if c.startswith("pred_")]
    names = [q for q in names if f"meas_{q}" in series.columns]
    errors = {q: (series[f"meas_{q}"] - series[f"pred_{q}"]).abs() for q in names}
    bad = pd.Series(False, index=series.index)
    for q in names:
        bad |= (errors[q] > tolerances.get(q, 0)).fillna(False)
    if bad.any():
        ref = bad.idxmax()
    else:
        key = "meas_allocated" if "meas_allocated" in series else f"meas_{names[0]}"
        ref = series[key].idxmax()
    out = {}
    for q in names:
        out[q] = _figure(
            series.at[ref, f"pred_{q}"], series.at[ref, f"meas_{q}"], errors[q].max(),
            tolerances.get(q, 0), capacity,
        )
    for q in ("allocated", "reserved"):
        if f"pred_{q}" in series and f"meas_{q}" in series:
            pred, meas = series[f"pred_{q}"].max(), series[f"meas_{q}"].max()
            tol = tolerances.get(f"peak_{q}", tolerances.get(q, 0))
            out[f"peak_{q}"] = _figure(pred, meas, abs(meas - pred), tol, capacity)
    return out


def _figure(pred: Any, meas: Any, err: Any, tol: float, capacity: int) -> dict[str, Any]:
    err = _num(err)
    return {
        "pred": _num(pred),
        "meas": _num(meas),
        "abs_err": err,
        "rel_err": None if err is None or not capacity else err / capacity,
        "tol": tol,
    }


def _num(value: Any) -> int | float | None:
    value = value.item() if hasattr(value, "item") else value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
