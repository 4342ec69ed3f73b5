"""What changed between results folders, as one document: the model behind `kvfrag compare`.

`read_folder` reads a results folder (its summary, checked, and its resolved scenario);
`compare` matches the folders' rows and works out their differences and what differs in their
scenarios (`scenario_diff`), as one JSON-ready document: what `kvfrag compare --json` prints,
and what the terminal table (`kvfrag.compare_table`) and the figures (`kvfrag.compare_plots`)
are drawn from.

Rows are matched across folders by (label, sweep point values): the allocator's label and,
in a sweep, the value of every swept key (not the point's index, which means nothing across
scenarios). A folder that does not sweep a key another one sweeps is matched on the value its
own scenario gives that key (a single run at 16 GiB against a sweep over kv_budget meets the
16 GiB point). What cannot be matched is listed as only in the folders that have it.

Differences: for the shares of the budget (token states, reserved, internal, external, usable
free), kv utilization, prefix hit rate and memory saved by sharing, which are fractions,
the difference is in percentage points (`+6.5pp`); for counts and times it is relative
(`+12.3%`), or absolute when the baseline is 0 (`+48`); `=` when the values are the same.
"""

from __future__ import annotations

import filecmp
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line imports pandas only when a command runs
    import pandas as pd


#: The headline metrics of the terminal table: (summary column, name, how it is shown, a
#: column that must be above zero in some row of some folder for the metric to be shown).
#: "pct" columns are fractions: shown as %, their differences in percentage points.
METRICS: tuple[tuple[str, str, str, str | None], ...] = (
    ("token_states_frac", "token states", "pct", None),
    ("reserved_frac", "reserved", "pct", None),
    ("internal_frac", "internal", "pct", None),
    ("external_frac", "external", "pct", None),
    ("usable_free_frac", "usable free", "pct", None),
    ("kv_utilization", "kv utilization", "pct", None),
    ("mean_running", "mean running", "{:,.1f}", None),
    ("max_running", "max running", "int", None),
    ("completed", "completed", "int", None),
    ("rejected", "rejected", "int", None),
    ("preemptions", "preemptions", "int", None),
    ("frag_refusals", "frag refusals", "int", None),
    ("throughput_tok_s", "throughput tok/s", "{:,.0f}", None),
    ("mean_latency_s", "mean latency s", "s", None),
    ("p99_latency_s", "p99 latency s", "s", None),
    ("mean_ttft_s", "mean ttft s", "s", None),
    ("mean_tpot_s", "mean tpot ms", "ms", None),
    ("prefix_hit_rate_tokens", "prefix hit rate", "pct", "prefix_hit_rate_tokens"),
    ("memory_saved_by_sharing_frac", "saved by sharing", "pct", "memory_saved_by_sharing_frac"),
    ("stall_s", "compaction stall s", "s", "compactions"),
)

#: Summary columns that are fractions (of the budget, of what was allocated, of lookups):
#: their differences are in percentage points.
FRACTIONS = {
    "token_states_frac", "reserved_frac", "internal_frac", "external_frac", "usable_free_frac",
    "internal_overreservation_frac", "internal_rounding_frac", "kv_utilization",
    "memory_saved_by_sharing_frac", "prefix_hit_rate_first_tokens", "prefix_hit_rate_tokens",
    "prefix_hit_rate_blocks",
}
#: Columns that say where a row belongs, not how it went: never compared as metrics.
_IDENTITY = {"label", "kind", "point"}

#: Keys of scenario.resolved.yaml left out of the scenario diff.
_IGNORED_KEYS = {"kvfrag_version"}

_ABSENT = object()  # a key one scenario does not have


# ------------------------------------------------------------------------ reading
@dataclass
class Folder:
    """One results folder, as read: its name in the comparison (A, B, ...) and its files."""

    name: str
    path: Path
    summary: pd.DataFrame
    schema_version: int | None = None
    scenario: str | None = None
    resolved: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def sweep_keys(self) -> list[str]:
        """Its swept keys: the columns summary.csv puts between `point` and `model`."""
        cols = [str(c) for c in self.summary.columns]
        if "point" in cols and "model" in cols and cols.index("point") < cols.index("model"):
            return cols[cols.index("point") + 1 : cols.index("model")]
        sweep = (self.resolved or {}).get("sweep")
        return [k for k in sweep if k in cols] if isinstance(sweep, dict) else []


def read_folder(path: Path, name: str) -> Folder:
    """A results folder's summary (checked), schema version and resolved scenario; a folder
    that is not one raises a one-line ValueError naming it."""
    import yaml

    from kvfrag.results import SCHEMA_VERSION, check_schema, error_reason, folder_schema
    from kvfrag.results_io import read_summary

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such folder")
    if not path.is_dir():
        raise ValueError(f"{path}: not a folder (give a results folder written by kvfrag run)")
    if not (path / "summary.csv").is_file():
        raise ValueError(f"{path}: not a kvfrag results folder (no summary.csv)")
    version, doc = folder_schema(path)
    check_schema(version, path, "compare")
    # (an older layout is translated to this kvfrag's names: folders of any schema up to this
    # one compare alike)
    summary = read_summary(path / "summary.csv", version)
    summary["label"] = summary["label"].astype(str)
    folder = Folder(name, path, summary, version)
    folder.scenario = (doc or {}).get("scenario")
    if version is not None and version < SCHEMA_VERSION:
        folder.notes.append(f"{name} was written by schema_version {version}: its columns were "
                            f"read under this kvfrag's names (schema_version {SCHEMA_VERSION})")
    resolved_path = path / "scenario.resolved.yaml"
    try:
        resolved = yaml.safe_load(resolved_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        folder.notes.append(f"{name} has no scenario.resolved.yaml: its scenario is not compared")
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        folder.notes.append(f"{name}'s scenario.resolved.yaml cannot be read "
                            f"({error_reason(exc)}): its scenario is not compared")
    else:
        if isinstance(resolved, dict):
            folder.resolved = resolved
            folder.scenario = folder.scenario or resolved.get("name")
        else:
            folder.notes.append(f"{name}'s scenario.resolved.yaml is not a mapping: its "
                                "scenario is not compared")
    return folder


# ------------------------------------------------------------------------ matching
def _lookup(resolved: dict[str, Any] | None, key: str) -> Any:
    """The value of a dotted key in a resolved scenario (`allocators.<label>.<field>` finds
    the allocator by its label), or `_ABSENT`."""
    node: Any = resolved
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list):
            found = [a for a in node if isinstance(a, dict) and str(a.get("label")) == part]
            if len(found) != 1:
                return _ABSENT
            node = found[0]
        else:
            return _ABSENT
    return node


def _norm(key: str, value: Any, rec: dict[str, Any]) -> Any:
    """A sweep value as matching compares it: numbers as floats (16 and "16" match), JSON
    text as its canonical form, kv_budget as the bytes the run had."""
    if key == "kv_budget" and _number(rec.get("kv_budget_bytes")) is not None:
        return float(rec["kv_budget_bytes"])
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    if isinstance(value, str) and value[:1] in "{[":
        try:
            return json.dumps(json.loads(value), sort_keys=True)
        except ValueError:
            return value
    number = _number(value)
    if number is not None:
        return number
    return None if _missing(value) else str(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


@dataclass
class Row:
    """One compared row: its label and sweep values, and its record in each folder."""

    label: str
    sweep: dict[str, Any]
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # folder name -> record


def match_rows(folders: list[Folder]) -> tuple[list[Row], list[str], list[str]]:
    """The rows of every folder, matched by (label, sweep values); the swept keys matched on,
    and notes on keys that could not be."""
    keys: list[str] = []
    for f in folders:
        keys += [k for k in f.sweep_keys if k not in keys]
    fixed: dict[tuple[str, str], Any] = {}  # (folder, key) -> the value its scenario gives
    notes = []
    usable = []
    for key in keys:
        lacking = [f for f in folders if key not in f.sweep_keys]
        for f in lacking:
            fixed[(f.name, key)] = _lookup(f.resolved, key)
        unknown = [f.name for f in lacking if fixed[(f.name, key)] is _ABSENT]
        if unknown:
            swept = [f.name for f in folders if key in f.sweep_keys]
            notes.append(
                f"{', '.join(swept)} sweep{'s' if len(swept) == 1 else ''} {key}, which "
                f"{', '.join(unknown)} does not set: rows that differ only in it are not "
                "matched"
            )
        else:
            usable.append(key)
    rows: dict[tuple, Row] = {}
    for f in folders:
        extra = [k for k in f.sweep_keys if k not in usable]
        records = f.summary.to_dict("records")
        idents = []
        for rec in records:
            values = {k: rec.get(k) if k in f.sweep_keys else fixed[(f.name, k)] for k in usable}
            idents.append((values, (rec["label"], *(_norm(k, v, rec) for k, v in values.items()))))
        count = Counter(ident for _, ident in idents)
        for rec, (values, ident) in zip(records, idents, strict=True):
            if count[ident] > 1:  # rows that only a key the others lack tells apart
                values = {**values, **{k: rec.get(k) for k in extra}}
                ident = (*ident, f.name, rec.get("point"))
            row = rows.setdefault(ident, Row(str(rec["label"]), values))
            row.records[f.name] = rec
    return list(rows.values()), usable, notes


def _row_names(rows: list[Row]) -> list[str]:
    """What each row is, short: `paged-16`, `paged-16 @ block_size=32, kv_budget=8.0 GiB`."""
    from kvfrag.results import short_labels
    from kvfrag.sim.units import format_size

    keys = [k for r in rows for k in r.sweep]
    short = {
        k: short_labels([r.sweep.get(k) for r in rows if isinstance(r.sweep.get(k), str)])
        for k in dict.fromkeys(keys)
    }
    names = []
    for r in rows:
        bits = []
        for k, v in r.sweep.items():
            if isinstance(v, str) and v in short[k]:
                bits.append(short[k][v])
                continue
            rec = next(iter(r.records.values()))
            if k == "kv_budget" and _number(rec.get("kv_budget_bytes")) is not None:
                v = format_size(int(rec["kv_budget_bytes"]))
            elif isinstance(v, float) and v.is_integer():
                v = int(v)
            bits.append(f"{k.split('.')[-1]}={_scalar_text(v)}")
        names.append(f"{r.label} @ {', '.join(bits)}" if bits else r.label)
    return names


# ------------------------------------------------------------------------ scenario diff
def _by_label(node: Any) -> Any:
    """Lists of allocators as mappings by label, so that they diff item by item."""
    if isinstance(node, dict):
        return {k: _by_label(v) for k, v in node.items()}
    if (isinstance(node, list) and node and all(isinstance(a, dict) and "label" in a
                                                 for a in node)
            and len({str(a["label"]) for a in node}) == len(node)):
        return {str(a["label"]): {k: _by_label(v) for k, v in a.items() if k != "label"}
                for a in node}
    return node


def scenario_diff(folders: list[Folder]) -> tuple[list[dict[str, Any]], list[str]]:
    """What differs between the folders' resolved scenarios, as dotted keys (a mapping only
    some have, one entry), and notes: kvfrag versions, paths that differ only in their
    folder (the same file's contents), scenarios not compared."""
    have = [f for f in folders if f.resolved is not None]
    if len(have) < 2:
        return [], []
    trees = [_by_label(f.resolved) for f in have]
    names = [f.name for f in have]
    entries: list[dict[str, Any]] = []
    same_files: list[str] = []

    def walk(nodes: list[Any], path: str) -> None:
        present = [n for n in nodes if n is not _ABSENT]
        if len(present) == len(nodes) and all(isinstance(n, dict) for n in nodes):
            for key in dict.fromkeys(k for n in nodes for k in n):
                if not path and key in _IGNORED_KEYS:
                    continue
                walk([n.get(key, _ABSENT) for n in nodes], f"{path}.{key}" if path else str(key))
            return
        if all(_same(n, nodes[0]) for n in nodes[1:]):
            return
        if _same_file(nodes):
            same_files.append(path)
            return
        entries.append({
            "key": path,
            "values": {nm: n for nm, n in zip(names, nodes, strict=True) if n is not _ABSENT},
            "absent": [nm for nm, n in zip(names, nodes, strict=True) if n is _ABSENT],
        })

    walk(trees, "")
    notes = []
    versions = {f.name: f.resolved.get("kvfrag_version") for f in have}
    if len(set(map(str, versions.values()))) > 1:
        notes.append("written by different kvfrag versions ("
                     + ", ".join(f"{n}: {v}" for n, v in versions.items())
                     + "): the simulator itself may explain differences")
    if same_files:
        notes.append(f"{', '.join(same_files)}: different paths to files with the same "
                     "contents (not listed as a difference)")
    return entries, notes


def _same(a: Any, b: Any) -> bool:
    if a is _ABSENT or b is _ABSENT:
        return a is b
    return a == b or (_number(a) is not None and _number(a) == _number(b)
                      and not isinstance(a, str) and not isinstance(b, str))


def _same_file(nodes: list[Any]) -> bool:
    """Absolute paths that name files with the same contents (scenarios run from different
    folders, each with its copy of a trace): noise, not a difference."""
    if not all(isinstance(n, str) and os.path.isabs(n) for n in nodes):
        return False
    try:
        return all(Path(n).is_file() and filecmp.cmp(nodes[0], n, shallow=False)
                   for n in nodes[1:]) and Path(nodes[0]).is_file()
    except OSError:
        return False


# ------------------------------------------------------------------------ the comparison
def _metric_columns(folders: list[Folder]) -> list[dict[str, Any]]:
    """Every numeric summary column of any folder (not identity or sweep columns): the
    headline metrics first, in the table's order, then the others in summary.csv's order."""
    import pandas as pd

    from kvfrag.results import OPTION_PREFIX

    sweep = {k for f in folders for k in f.sweep_keys}
    numeric: list[str] = []
    for f in folders:
        for col in f.summary.columns:
            col = str(col)
            if col in _IDENTITY or col in sweep or col in numeric or col.startswith(OPTION_PREFIX):
                continue  # (options are settings: the scenario diff shows them)
            values = f.summary[col]
            if pd.api.types.is_bool_dtype(values) or not pd.api.types.is_numeric_dtype(values):
                continue
            numeric.append(col)
    out = []
    for col, name, fmt, when in METRICS:
        if col in numeric:
            shown = when is None or any(
                when in f.summary.columns
                and bool((pd.to_numeric(f.summary[when], errors="coerce") > 0).any())
                for f in folders
            )
            out.append({"key": col, "name": name, "format": fmt, "headline": shown,
                        "diff": "pp" if col in FRACTIONS else "relative"})
    headline = {m["key"] for m in out}
    out += [{"key": col, "name": col, "format": "g", "headline": False,
             "diff": "pp" if col in FRACTIONS else "relative"}
            for col in numeric if col not in headline]
    return out


def compare(folders: list[Folder]) -> dict[str, Any]:
    """The comparison as one JSON-ready document (what `--json` prints; NaN as None)."""
    from kvfrag.results import SCHEMA_VERSION, json_value

    rows, keys, match_notes = match_rows(folders)
    names = _row_names(rows)
    metrics = _metric_columns(folders)
    diff, diff_notes = scenario_diff(folders)
    base = folders[0].name
    out_rows = []
    for row, name in zip(rows, names, strict=True):
        values = {
            f: {m["key"]: json_value(_value(rec, m["key"])) for m in metrics}
            for f, rec in row.records.items()
        }
        deltas = {}
        if base in values:
            for f in values:
                if f != base:
                    deltas[f] = {m["key"]: _delta(values[base][m["key"]], values[f][m["key"]])
                                 for m in metrics}
        out_rows.append({
            "name": name,
            "label": row.label,
            "sweep": {k: json_value(v) for k, v in row.sweep.items()},
            "in": list(row.records),
            "points": {f: json_value(rec.get("point")) for f, rec in row.records.items()},
            "values": values,
            "diff": deltas,
        })
    everywhere = [f.name for f in folders]
    groups: dict[tuple[str, ...], list[str]] = {}
    for r in out_rows:
        if r["in"] != everywhere:
            groups.setdefault(tuple(r["in"]), []).append(r["name"])
    return {
        "schema_version": SCHEMA_VERSION,
        "baseline": base,
        "folders": [
            {"name": f.name, "path": str(f.path), "scenario": f.scenario,
             "schema_version": f.schema_version,
             "kvfrag_version": (f.resolved or {}).get("kvfrag_version"),
             "runs": len(f.summary)}
            for f in folders
        ],
        "match_on": ["label", *keys],
        "scenario_diff": [
            {"key": e["key"], "values": {k: _plain(v) for k, v in e["values"].items()},
             "absent": e["absent"]}
            for e in diff
        ],
        "metrics": [{k: m[k] for k in ("key", "name", "headline", "diff")} for m in metrics],
        "rows": out_rows,
        "only_in": [{"in": list(k), "rows": v} for k, v in groups.items()],
        "notes": [n for f in folders for n in f.notes] + match_notes + diff_notes,
    }


def _value(rec: dict[str, Any], key: str) -> Any:
    value = rec.get(key)
    return None if _missing(value) else value


def _delta(a: Any, b: Any) -> dict[str, float | None]:
    """B − A (`abs`, in the column's unit) and (B − A) / |A| (`rel`; null when A is 0)."""
    if a is None or b is None:
        return {"abs": None, "rel": None}
    d = float(b) - float(a)
    return {"abs": d, "rel": d / abs(float(a)) if a else None}


def _plain(value: Any) -> Any:
    """A YAML value as JSON holds it (dates and other non-JSON scalars as text)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def _scalar_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(", ", ": "))
    return str(value)
