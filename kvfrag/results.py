"""Result writers: one folder per scenario, written whole or not at all.

Everything goes into a temporary sibling folder first; only when every file (and figure) is
written is it renamed into place, replacing any earlier results (a `validate/` report that
`kvfrag validate` wrote there is carried over). A failed run leaves nothing half-written
behind.

While a sweep runs, each finished point is staged as it completes, in a hidden sibling
folder (`PointStore`, `results/.<name>.points/`), so that an interrupted sweep can be
resumed; the final folder is assembled from it, and it is removed once that is written with
no point failed.
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

from sim.engine import RunResult
from sim.scenario import ScenarioResult

#: `kvfrag validate`'s report folder inside a scenario's results. A new run keeps it: the
#: report describes its own simulation (with its resolved scenario), not the run's.
VALIDATE_DIR = "validate"


def write_results(
    result: ScenarioResult,
    out_dir: Path,
    resolved: dict[str, Any],
    plot: Callable[[Path], object] | None = None,
    failures: pd.DataFrame | None = None,
) -> Path:
    """Write summary, records and the resolved scenario to `out_dir`, atomically; with
    `failures` (one row per failed run: its parameters and error), `failures.csv` too."""
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
            {k: json_value(v) for k, v in row.items()} for row in summary.to_dict("records")
        ]
        (tmp / "summary.json").write_text(json.dumps(records, indent=2), encoding="utf-8")
        result.frames("timeseries").to_parquet(tmp / "timeseries.parquet", index=False)
        result.frames("requests").to_parquet(tmp / "requests.parquet", index=False)
        if failures is not None and len(failures):
            failures.to_csv(tmp / "failures.csv", index=False)
        if plot is not None:
            plot(tmp)
        kept = out_dir / VALIDATE_DIR
        if kept.is_dir():  # copied, not moved: a failed swap must leave the old folder whole
            shutil.copytree(kept, tmp / VALIDATE_DIR)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def json_value(value: Any) -> Any:
    """A summary value as JSON holds it: numpy scalars unwrapped, NaN and inf as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return json_value(value.item())
    return value


def replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`, replacing it; the old folder goes only once the new is in."""
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


class StagedScenarioMismatch(ValueError):
    """`--resume` found staged points of a different scenario."""


class PointStore:
    """Finished sweep points, one folder each, staged while a sweep runs.

    Layout, beside the results folder `results/<name>/`::

        results/.<name>.points/
            scenario.resolved.yaml     the scenario these points belong to
            code.txt                   and a fingerprint of the simulator code that ran them
            <key>/summary.json         one finished point: its summary and where it belongs,
            <key>/timeseries.parquet   its accounting over time
            <key>/requests.parquet     and its per-request records

    A point's folder is written under a temporary name and renamed when complete, so a
    killed sweep leaves only whole points (and temporary folders, which are ignored).
    """

    SCENARIO = "scenario.resolved.yaml"
    CODE = "code.txt"

    def __init__(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        self.dir = out_dir.parent / f".{out_dir.name}.points"

    def open(self, resolved: dict[str, Any], resume: bool, code: str = "") -> set[str]:
        """Start staging for `resolved`; the keys already finished (only with `resume`).

        Without `resume`, anything staged before is discarded. With it, the staged points
        must belong to the same resolved scenario and have been computed by the same code
        (`code`, a fingerprint), else `StagedScenarioMismatch`.
        """
        scenario_file = self.dir / self.SCENARIO
        if self.dir.exists() and (not resume or not scenario_file.exists()):
            shutil.rmtree(self.dir)  # (no scenario file: killed before any point was staged)
        if not self.dir.exists():
            self.dir.mkdir(parents=True)
            _write_atomic(self.dir / self.CODE, code + "\n")
            _write_atomic(scenario_file, yaml.safe_dump(resolved, sort_keys=False))
            return set()
        staged = yaml.safe_load(scenario_file.read_text(encoding="utf-8"))
        if staged != resolved:
            where = _first_difference(staged, resolved)
            raise StagedScenarioMismatch(
                f"--resume: {self.dir} holds points of a different scenario"
                + (f" (differs at {where})" if where else "")
                + "; run without --resume to start over"
            )
        code_file = self.dir / self.CODE
        staged_code = code_file.read_text(encoding="utf-8").strip() if code_file.exists() else ""
        if staged_code != code:
            raise StagedScenarioMismatch(
                f"--resume: the points in {self.dir} were computed by other simulator code "
                "(it changed since); run without --resume to start over"
            )
        for stale in self.dir.glob(".*.tmp-*"):  # points being written when it was killed
            shutil.rmtree(stale, ignore_errors=True)
        return {
            p.name
            for p in self.dir.iterdir()
            if not p.name.startswith(".") and (p / "summary.json").is_file()
        }

    def put(self, key: str, meta: dict[str, Any], result: RunResult) -> None:
        """Stage one finished point, atomically."""
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=self.dir))
        try:
            record = {**meta, "key": key, "summary": result.summary}
            (tmp / "summary.json").write_text(
                json.dumps(record, default=_json_default, indent=1), encoding="utf-8"
            )
            result.timeseries.to_parquet(tmp / "timeseries.parquet", index=False)
            result.requests.to_parquet(tmp / "requests.parquet", index=False)
            target = self.dir / key
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def get(self, key: str) -> RunResult:
        folder = self.dir / key
        record = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        return RunResult(
            record["summary"],
            pd.read_parquet(folder / "timeseries.parquet"),
            pd.read_parquet(folder / "requests.parquet"),
        )

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"cannot stage a {type(value).__name__} in a point's summary")


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The dotted path of the first place two resolved scenarios differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}".lstrip("."))
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
        return None
    return path or None


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
