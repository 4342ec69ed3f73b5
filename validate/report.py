"""The validation report: validate.csv / validate.json (one row per allocator and mode),
series.parquet (every measured instant), validate.png (predicted vs measured over the replay),
written into a temporary sibling folder and renamed into place, whole or not at all.

Per quantity q the table has q_pred and q_meas (at the reference instant: the first failing
one, else the one with the most memory allocated), q_abs_err (the largest |measured -
predicted| over the whole replay, bytes or counts), q_rel_err (that, over the KV budget) and
q_tol (the tolerance it is held to: 0 everywhere, arena and paged bytes are exact). A quantity
measured in bytes is named with its unit (`token_states_bytes_pred`, `free_bytes_meas`, ...):
the summary's `token_states_frac` is a fraction, this one bytes. validate.json holds the same
rows in an object with the `schema_version` (`{"schema_version", "scenario", "rows"}`).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from kvfrag.validate.outcome import FAILING, Outcome

from kvfrag import outdir
from kvfrag.csvcells import write_csv
from kvfrag.results import json_value

META = (
    "label", "kind", "point", "mode", "device", "status", "capacity", "ops", "checks",
    "max_running", "corrupt", "problems", "first_fail_seq", "first_fail", "note",
)
QUANTITIES = (
    "token_states", "held_unwritten", "free", "allocated", "reserved", "inactive_split",
    "segments", "peak_allocated", "peak_reserved", "ooms", "num_ooms", "num_alloc_retries",
)
#: The quantities measured in bytes: named `<q>_bytes` in the table (the rest are counts).
BYTE_QUANTITIES = frozenset({
    "token_states", "held_unwritten", "free", "allocated", "reserved", "inactive_split",
    "peak_allocated", "peak_reserved",
})
FIELDS = ("pred", "meas", "abs_err", "rel_err", "tol")
GREEN, ORANGE, GREY = "#2ca02c", "#ff7f0e", "#7f7f7f"
SERIES_STYLE = {  # quantity -> colour; token_states is green wherever it appears
    "token_states": GREEN,
    "held_unwritten": ORANGE,
    "free": GREY,
    "allocated": "#1f77b4",
    "reserved": "#9467bd",
    "inactive_split": "#d62728",
}
MiB = 1 << 20


def table(outcomes: list[Outcome]) -> pd.DataFrame:
    """One row per outcome: its metadata, then pred/meas/errors/tolerance per quantity."""
    present = [q for q in QUANTITIES if any(q in o.figures for o in outcomes)]
    rows = []
    rename = {"capacity": "capacity_bytes", "corrupt": "corrupt_requests"}
    for o in outcomes:
        row: dict[str, Any] = {rename.get(k, k): getattr(o, k) for k in META}
        for q in present:
            fig = o.figures.get(q, {})
            name = quantity_name(q)
            for f in FIELDS:
                row[f"{name}_{f}"] = fig.get(f)
        rows.append(row)
    return pd.DataFrame(rows)


def quantity_name(q: str) -> str:
    """A quantity's name in the table: with `_bytes` when it is measured in bytes."""
    return f"{q}_bytes" if q in BYTE_QUANTITIES else q


def report_rows(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """The table's rows as JSON holds them (NaN as null)."""
    return [{k: json_value(v) for k, v in r.items()} for r in table(outcomes).to_dict("records")]


def write_report(
    outcomes: list[Outcome],
    out_dir: Path,
    resolved: dict[str, Any] | None = None,
    scenario: str | None = None,
) -> Path:
    """Write the report folder atomically; returns it. `scenario` names it in validate.json
    (default: the resolved scenario's `name`)."""
    out_dir = Path(out_dir)
    outdir.make_dirs(out_dir.parent)
    tmp = outdir.temp_dir(out_dir)
    try:
        with outdir.writing(tmp):
            name = scenario if scenario is not None else (resolved or {}).get("name")
            _write_files(outcomes, tmp, resolved, name)
        outdir.replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_files(
    outcomes: list[Outcome], tmp: Path, resolved: dict[str, Any] | None, scenario: str | None
) -> None:
    """Every file of the report, into the temporary folder `tmp`; the manifest last."""
    from kvfrag.results import SCHEMA_VERSION

    write_csv(table(outcomes), tmp / "validate.csv")
    document = {"schema_version": SCHEMA_VERSION, "scenario": scenario,
                "rows": report_rows(outcomes)}
    (tmp / "validate.json").write_text(json.dumps(document, indent=2), encoding="utf-8")
    series = [
        o.series.assign(label=o.label, mode=o.mode, point=o.point)
        for o in outcomes
        if not o.series.empty
    ]
    if series:
        pd.concat(series, ignore_index=True).to_parquet(tmp / "series.parquet", index=False)
    if resolved is not None:
        (tmp / "scenario.resolved.yaml").write_text(
            yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8"
        )
    figure(outcomes).savefig(tmp / "validate.png", dpi=110)
    outdir.write_manifest(tmp, "kvfrag validate")


def figure(outcomes: list[Outcome]):
    """Predicted (lines) vs measured (markers) over each replay, one panel per outcome."""
    from matplotlib.figure import Figure

    shown = [o for o in outcomes if not o.series.empty] or outcomes[:1]
    ncols = 2 if len(shown) > 1 else 1
    nrows = max(1, math.ceil(len(shown) / ncols))
    fig = Figure(figsize=(6.5 * ncols, 3.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, o in zip(axes, shown, strict=False):
        handles.update(_panel(ax, o))
    for ax in axes[len(shown):]:
        ax.set_visible(False)
    if not shown:
        axes[0].text(0.5, 0.5, "nothing replayed", ha="center", va="center")
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center",
                   ncols=min(len(handles), 7), fontsize=8)
    fig.suptitle("kvfrag validate: predicted (lines) vs measured (markers)")
    return fig


def _panel(ax: Any, o: Outcome) -> dict[str, Any]:
    """Draw one outcome; returns legend handles by name."""
    s, handles = o.series, {}
    ax.set_title(f"{o.label} · {o.mode} · {o.status}", fontsize=9)
    if s.empty:
        ax.text(0.5, 0.5, o.note or "no measurements", ha="center", va="center", fontsize=8)
        return handles
    x = s["seq"]
    for q, colour in SERIES_STYLE.items():
        if f"meas_{q}" not in s:
            continue
        pred = s.get(f"pred_{q}")
        if pred is not None and pred.notna().any():
            (handles[q],) = ax.plot(x, pred / MiB, color=colour, lw=1.2)
        (meas,) = ax.plot(x, s[f"meas_{q}"] / MiB, ls="none", marker="o", ms=3, mfc="none",
                          color=colour)
        handles.setdefault(q, meas)
    if "refused_meas" in s and s["refused_meas"].any():
        hit = s[s["refused_meas"].astype(bool)]
        (handles["OOM (measured)"],) = ax.plot(
            hit["seq"], [0] * len(hit), ls="none", marker="x", color="red"
        )
    if o.first_fail_seq is not None:
        handles["first failure"] = ax.axvline(o.first_fail_seq, color="red", lw=0.8, ls=":")
    ax.set_xlabel("log operation (seq)")
    ax.set_ylabel("MiB")
    return handles


def format_table(outcomes: list[Outcome]) -> str:
    """A short terminal table: status and the largest error per outcome (and its sweep point,
    when there are several)."""
    points = len({o.point for o in outcomes}) > 1
    header = ["label", "mode", "status", "checks", "max |err| B", "corrupt", "first failure"]
    if points:
        header.insert(1, "point")
    rows = []
    for o in outcomes:
        errs = [f["abs_err"] for f in o.figures.values() if f["abs_err"] is not None]
        first = o.first_fail or o.note
        if o.first_fail_seq is not None:
            first = f"seq {o.first_fail_seq}: {first}"
        rows.append([
            o.label, o.mode, o.status, str(o.checks),
            f"{max(errs):,}" if errs else "-", str(o.corrupt), first[:70] or "-",
        ])
        if points:
            rows[-1].insert(1, str(o.point))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(verdict_line(outcomes))
    return "\n".join(lines)


def tally(outcomes: list[Outcome]) -> tuple[int, int, int]:
    """(ok, skipped, failed): a skipped replay did not run here, so it is neither ok nor
    failed (it does not fail the exit status either)."""
    failed = sum(o.status in FAILING for o in outcomes)
    skipped = sum(o.status == "skip" for o in outcomes)
    return len(outcomes) - failed - skipped, skipped, failed


def verdict_line(outcomes: list[Outcome]) -> str:
    """The table's last line: "3 of 8 ok, 4 skipped, 1 failed" (zero counts left out)."""
    ok, skipped, failed = tally(outcomes)
    return f"{ok} of {len(outcomes)} ok" + (f", {skipped} skipped" if skipped else "") + (
        f", {failed} failed" if failed else "")


