"""Result writers: one folder per scenario, written whole or not at all.

Everything goes into a temporary sibling folder first; only when every file (and figure) is
written is it renamed into place, replacing any earlier results. A failed run leaves nothing
half-written behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from sim.scenario import ScenarioResult


def write_results(
    result: ScenarioResult,
    out_dir: Path,
    resolved: dict[str, Any],
    plot: Callable[[Path], object] | None = None,
) -> Path:
    """Write summary, records and the resolved scenario to `out_dir`, atomically."""
    out_dir = Path(out_dir)
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; results are for reading
        (tmp / "scenario.resolved.yaml").write_text(
            yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8"
        )
        summary = result.summary()
        summary.to_csv(tmp / "summary.csv", index=False)
        records = [
            {k: _json_value(v) for k, v in row.items()} for row in summary.to_dict("records")
        ]
        (tmp / "summary.json").write_text(json.dumps(records, indent=2), encoding="utf-8")
        result.frames("timeseries").to_parquet(tmp / "timeseries.parquet", index=False)
        result.frames("requests").to_parquet(tmp / "requests.parquet", index=False)
        if plot is not None:
            plot(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return _json_value(value.item())
    return value


def _replace_dir(new: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rmdir(old)
        target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        if old is not None:
            old.rename(target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


#: Columns of the terminal table, with how to show them.
TABLE = (
    ("label", "label", str),
    ("token_states", "tokens", "pct"),
    ("reserved", "reserved", "pct"),
    ("internal", "internal", "pct"),
    ("external", "external", "pct"),
    ("free", "free", "pct"),
    ("kv_utilization", "kv util", "pct"),
    ("mean_running", "mean run", "{:.1f}"),
    ("max_running", "max run", "{:d}"),
    ("completed", "done", "{:d}"),
    ("rejected", "rej", "{:d}"),
    ("preemptions", "preempt", "{:d}"),
    ("frag_refusals", "frag ref", "{:d}"),
    ("throughput_tok_s", "tok/s", "{:,.0f}"),
    ("p99_latency_s", "p99 lat s", "{:.2f}"),
)


def format_table(summary: pd.DataFrame, sweep_keys: list[str]) -> str:
    """The summary as a fixed-width table for the terminal (fractions as % of the budget)."""
    cols = [(k, k.split(".")[-1], "{}") for k in sweep_keys] + list(TABLE)
    header = [name for _, name, _ in cols]
    rows = []
    for rec in summary.to_dict("records"):
        row = []
        for key, _, fmt in cols:
            value = rec.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                row.append("-")
            elif fmt == "pct":
                row.append(f"{100 * value:.1f}%")
            elif fmt is str:
                row.append(str(value))
            else:
                row.append(fmt.format(int(value) if fmt == "{:d}" else value))
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in
                       enumerate(zip(header, widths, strict=True)))]
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                               enumerate(zip(r, widths, strict=True))))
    return "\n".join(lines)
