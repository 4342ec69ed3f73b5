"""`kvfrag compare DIR_A DIR_B [DIR_C ...]`: what changed between results folders.

The question this answers is "what changed between these two configurations": the summary
metrics of each run side by side with their differences, and what differs in the scenarios
themselves (`scenario.resolved.yaml`), so that the numbers come with their cause. The first
folder is the baseline; every difference is against it.

Rows are matched across folders by (label, sweep point values): the allocator's label and,
in a sweep, the value of every swept key (not the point's index, which means nothing across
scenarios). A folder that does not sweep a key another one sweeps is matched on the value its
own scenario gives that key (a single run at 16 GiB against a sweep over kv_budget meets the
16 GiB point). What cannot be matched is listed as only in the folders that have it.

Differences: for the shares of the budget (token states, reserved, internal, external, usable
free), kv utilization, prefix hit rate and memory saved by sharing, which are fractions,
the difference is in percentage points (`+6.5pp`); for counts and times it is relative
(`+12.3%`), or absolute when the baseline is 0 (`+48`); `=` when the values are the same.

Layout of the terminal table: one block of columns per matched row (metric, then A, B, Δ;
with more folders, each one's value and its Δ), the blocks side by side, as many as fit the
terminal's width (at most 160 columns; `COLUMNS` sets it when the output is not a terminal),
the rest below. The metrics run down the page, so a metric reads across the blocks in one line
(every allocator's token states on one row) and a block down its column (everything about
one allocator). The alternative, a wide table with one row per run and `A -> B (Δ)` cells,
needs 20 to 25 characters a cell: its 18 metrics make 400 columns, which no terminal shows,
and cutting it into slices scatters a run across them. The blocks keep 4 allocators of a
scenario within 150 columns, and one allocator within 60.

`--json` prints the same as one JSON document (NaN as null); `-o DIR` writes comparison.csv
(one row per compared row and metric, every numeric column of the summaries), comparison.json
(what --json prints), breakdown.png (the budget's five parts, a bar per folder side by side
for each row) and capacity.png (requests running, throughput, latency, time to first token
and per output token, and where present prefix hits, sharing and compaction stall, folder
against folder). The folder is written whole or not at all, with a manifest
(`kvfrag.outdir`): a folder that kvfrag compare did not write is refused, and so is one inside
(or holding) a compared folder. Without -o nothing is written.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import math
import os
import shutil
import string
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfrag import outdir

if TYPE_CHECKING:  # the command line imports pandas only when a command runs
    import pandas as pd
    from matplotlib.figure import Figure

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
#: The table's sections (a blank line after each of these metrics): memory, requests, speed.
_SECTION_ENDS = {"kv_utilization", "frag_refusals", "mean_tpot_s"}

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
#: The widest the terminal table gets, and the most characters a scenario value shows.
MAX_WIDTH = 160
_VALUE_CHARS = 48
#: Bar colours of the folders in the capacity figure (kvfrag.figure_kit's colours for labels).
FOLDER_COLORS = ("#1f77b4", "#8c564b", "#e377c2", "#17becf", "#393b79", "#7f7f7f", "#bcbd22")

_ABSENT = object()  # a key one scenario does not have


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="compare results folders: summary metrics side by side with their differences",
        description="Compare the results of two (or more) runs: the summary metrics of each "
        "allocator (and sweep point) side by side with their differences against the first "
        "folder, and what differs in the scenarios. Rows are matched by label and sweep "
        "values; the rest are listed. -o writes comparison.csv/json and figures.",
    )
    p.add_argument("folders", nargs="*", type=Path, metavar="DIR",
                   help="results folders written by kvfrag run; the first is the baseline")
    p.add_argument("-o", "--output", type=Path, metavar="DIR",
                   help="also write comparison.csv, comparison.json, breakdown.png and "
                   "capacity.png to this folder (default: write nothing)")
    p.add_argument("--json", action="store_true",
                   help="print the comparison as one JSON document on stdout instead of the "
                   "tables (see docs/compare.md)")
    p.add_argument("--wait", action="store_true",
                   help="with -o: wait for another kvfrag writing the same folder")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    if len(args.folders) < 2:
        raise ValueError(
            "compare needs at least two results folders (kvfrag compare DIR_A DIR_B ...), "
            f"got {len(args.folders)}"
        )
    if len(args.folders) > len(string.ascii_uppercase):
        raise ValueError(f"compare takes at most {len(string.ascii_uppercase)} folders")
    folders = [read_folder(path, name) for path, name in
               zip(args.folders, string.ascii_uppercase, strict=False)]
    if args.output is not None:
        check_output(args.output, args.folders)  # before the figures are drawn
    doc = compare(folders)
    if args.output is not None:
        write_output(args.output, doc, folders, args.wait)
    if args.json:
        from kvfrag.results import dumps_json

        print(dumps_json(doc))
    else:
        print(format_comparison(doc, _width()))
    if args.output is not None:
        if args.json:  # stdout holds the JSON only
            print(f"wrote {args.output}/", file=sys.stderr)
        else:
            print(f"\nwrote {args.output}/")
    return 0


def _width() -> int:
    return min(shutil.get_terminal_size((MAX_WIDTH, 24)).columns, MAX_WIDTH)


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


# ------------------------------------------------------------------------ the terminal
def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    v = float(value)
    if fmt == "pct":
        return f"{100 * v:.1f}%".replace("-0.0%", "0.0%")
    if fmt == "int":
        return f"{round(v):,}"
    if fmt == "ms":
        return f"{1e3 * v:,.1f}"
    if fmt == "s":
        return _seconds(v)
    if fmt == "g":
        return f"{v:.4g}"
    return fmt.format(v)


def _seconds(v: float) -> str:
    """About three significant digits: 0.0523, 2.27, 26.5, 4,410."""
    size = abs(v)
    if size >= 100:
        return f"{v:,.0f}"
    if size >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if size >= 1 else f"{v:.3g}"


def _delta_text(a: Any, b: Any, fmt: str, diff: str) -> str:
    """Δ for the table: `+6.5pp` for fractions, `+12.3%` for the rest (absolute, `+48`,
    when the baseline is 0); `=` when the values are the same, `-` when one is missing."""
    if a is None or b is None:
        return "-"
    a, b = float(a), float(b)
    if a == b:
        return "="
    if diff == "pp":
        return _signed(100 * (b - a), "pp")
    if a == 0:
        text = _cell(b - a, fmt).lstrip("-")
        return ("+" if b > a else "-") + text.rstrip("%")
    return _signed(100 * (b - a) / abs(a), "%")


def _signed(value: float, unit: str) -> str:
    """+6.5pp; two decimals where one would read 0; `~0` below that."""
    for text in (f"{value:+,.0f}" if abs(value) >= 1000 else f"{value:+.1f}", f"{value:+.2f}"):
        if text.lstrip("+-").strip("0.,"):
            return text + unit
    return f"~0{unit}"


def format_comparison(doc: dict[str, Any], width: int = MAX_WIDTH) -> str:
    """The comparison for the terminal: the folders, what differs in their scenarios, the
    metrics table (blocks side by side within `width` columns), and what was not matched."""
    lines = _folder_lines(doc, width)
    lines += ["", *_scenario_lines(doc, width)]
    matched = [r for r in doc["rows"] if r["diff"]]
    lines.append("")
    if matched:
        lines += _metric_lines(doc, matched, width)
    else:
        lines.append(f"No row of {doc['baseline']} matches a row of another folder (rows "
                     f"match by {', '.join(doc['match_on'])}).")
    for group in doc["only_in"]:
        where = ", ".join(group["in"])
        text = f"only in {where}: " + ", ".join(group["rows"])
        lines.append(_fill(text, width, indent=4))
    for note in doc["notes"]:
        lines.append(_fill(f"note: {note}", width, indent=6))
    return "\n".join(lines).rstrip("\n")


def _fill(text: str, width: int, indent: int) -> str:
    import textwrap

    return textwrap.fill(text, width, subsequent_indent=" " * indent, break_on_hyphens=False)


def _folder_lines(doc: dict[str, Any], width: int) -> list[str]:
    folders = doc["folders"]
    wide = max(len(f["path"]) for f in folders)
    lines = []
    for f in folders:
        about = f"{f['scenario'] or 'unnamed scenario'}, {f['runs']} run(s)"
        lines.append(f"{f['name']}  {f['path'].ljust(wide)}  {about}")
    base = doc["baseline"]
    others = [f["name"] for f in folders if f["name"] != base]
    against = (f"{others[0]} - {base}" if len(others) == 1
               else f"each folder - {base} (the baseline)")
    lines.append(_fill(f"Δ: {against}; shares of the budget and other fractions in percentage "
                       "points (pp), counts and times relative (%)", width, indent=3))
    return lines


def _scenario_lines(doc: dict[str, Any], width: int) -> list[str]:
    names = [f["name"] for f in doc["folders"]]
    diff = doc["scenario_diff"]
    if not diff:
        if any("not compared" in n for n in doc["notes"]):
            return ["Scenarios: not compared (see the notes below)."]
        return ["Scenarios: the same (scenario.resolved.yaml, apart from kvfrag_version)."]

    def show(entry: dict[str, Any], name: str) -> str:
        if name in entry["absent"]:
            return "(absent)"
        if name not in entry["values"]:
            return "(not read)"
        return _setting_text(entry["key"], entry["values"][name])

    table = [["key", *names]] + [[e["key"], *(show(e, n) for n in names)] for e in diff]
    lines = ["What differs in the scenarios (scenario.resolved.yaml):"]
    lines += ["  " + line for line in _align(table, right=False)]
    return [line[:width] for line in lines]


def _setting_text(key: str, value: Any, limit: int = _VALUE_CHARS) -> str:
    """A scenario value, short: sizes in binary units (`24.0 GiB`), mappings as JSON."""
    from kvfrag.sim.units import format_size

    last = key.split(".")[-1]
    if (last == "kv_budget" or last.endswith("_bytes")) and isinstance(value, int) \
            and not isinstance(value, bool):
        return format_size(value)
    text = _scalar_text(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


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


def _align(table: list[list[str]], right: bool = True) -> list[str]:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    out = []
    for row in table:
        cells = [c.ljust(w) if i == 0 or not right else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out


def _metric_lines(doc: dict[str, Any], rows: list[dict[str, Any]], width: int) -> list[str]:
    """The headline metrics, one block of columns per row, blocks side by side."""
    metrics = [m for m in doc["metrics"] if m["headline"]]
    fmts = {col: fmt for col, _, fmt, _ in METRICS}
    names = [f["name"] for f in doc["folders"]]
    base = doc["baseline"]
    several = len(names) > 2
    name_w = max(len("metric"), *(len(m["name"]) for m in metrics))
    blocks = []
    for row in rows:
        columns: list[tuple[str, list[str]]] = []
        for n in names:
            if n not in row["values"] and n != base:
                continue
            vals = row["values"].get(n)
            columns.append((n, [_cell(vals[m["key"]], fmts[m["key"]]) if vals else "-"
                                for m in metrics]))
            if n != base:
                a = row["values"][base]
                columns.append((f"Δ{n}" if several else "Δ",
                                [_delta_text(a[m["key"]], vals[m["key"]], fmts[m["key"]],
                                             m["diff"]) for m in metrics]))
        widths = [max(len(h), 6, *(len(c) for c in cells)) for h, cells in columns]
        inner = sum(widths) + 2 * (len(widths) - 1)
        title = row["name"]
        if len(title) > inner:
            extra = min(len(title), 40) - inner
            if extra > 0:
                widths[-1] += extra
                inner += extra
            if len(title) > inner:
                title = title[: inner - 1] + "…"
        blocks.append((title, columns, widths, inner))
    gap = "   "
    panels: list[list[int]] = [[]]
    used = name_w
    for i, (_, _, _, inner) in enumerate(blocks):
        if panels[-1] and used + len(gap) + inner > width:
            panels.append([])
            used = name_w
        panels[-1].append(i)
        used += len(gap) + inner
    lines: list[str] = []
    for panel in panels:
        if lines:
            lines.append("")
        head1, head2, head3 = " " * name_w, " " * name_w, "metric".ljust(name_w)
        for i in panel:
            title, columns, widths, inner = blocks[i]
            head1 += gap + title.ljust(inner)
            head2 += gap + "─" * inner
            head3 += gap + "  ".join(h.rjust(w) for (h, _), w in zip(columns, widths,
                                                                     strict=True))
        lines += [head1.rstrip(), head2, head3]
        for j, m in enumerate(metrics):
            line = m["name"].ljust(name_w)
            for i in panel:
                _, columns, widths, _ = blocks[i]
                line += gap + "  ".join(cells[j].rjust(w) for (_, cells), w in
                                        zip(columns, widths, strict=True))
            lines.append(line)
            if m["key"] in _SECTION_ENDS and j < len(metrics) - 1:
                lines.append("")
    lines.append("")
    return lines


# ------------------------------------------------------------------------ -o DIR
def check_output(out: Path, folders: list[Path]) -> None:
    """Refuse an output folder inside a compared folder (or holding one), and any folder
    that `kvfrag compare` did not write (a run's results included: replacing them with a
    comparison would lose them)."""
    target = Path(out).resolve()
    for f in folders:
        src = Path(f).resolve()
        if target == src or src in target.parents:
            raise outdir.UnsafeOutput(
                f"{out}: inside the compared folder {f}; kvfrag compare never writes into "
                "the folders it compares: choose another output path"
            )
        if target in src.parents:
            raise outdir.UnsafeOutput(
                f"{out}: holds the compared folder {f}; choose another output path"
            )
    outdir.check_target(out, early=True)
    _check_ours(Path(out))


def _check_ours(out: Path) -> None:
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        data = json.loads((out / outdir.MANIFEST).read_text(encoding="utf-8"))
        wrote = data.get("written_by")
    except (OSError, ValueError, AttributeError):
        wrote = None
    if wrote != "kvfrag compare":
        what = f"results of {wrote}" if wrote else "results kvfrag wrote"
        raise outdir.UnsafeOutput(
            f"{out}: holds {what}, not a comparison; kvfrag compare replaces only a folder it "
            "wrote: choose another output path"
        )


def write_output(out: Path, doc: dict[str, Any], folders: list[Folder], wait: bool) -> None:
    """comparison.csv, comparison.json and the figures, into `out`, whole or not at all."""
    from kvfrag.results import dumps_json

    out = Path(out)
    with outdir.terminate_as_interrupt(), outdir.locked(out, f"kvfrag compare -o {out}", wait):
        outdir.clean_stale(out)
        outdir.check_target(out)  # again: another kvfrag may have written it as we waited
        _check_ours(out)
        from kvfrag.csvcells import write_csv

        tmp = outdir.temp_dir(out)
        try:
            with outdir.writing(tmp):
                write_csv(comparison_frame(doc), tmp / "comparison.csv")
                (tmp / "comparison.json").write_text(dumps_json(doc) + "\n", encoding="utf-8")
                _save(breakdown_figure(doc, folders), tmp / "breakdown.png")
                _save(capacity_figure(doc), tmp / "capacity.png")
                outdir.write_manifest(tmp, "kvfrag compare")
            outdir.replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def comparison_frame(doc: dict[str, Any]) -> pd.DataFrame:
    """comparison.csv: one row per compared row and metric (every numeric summary column):
    label, the swept keys matched on, metric, headline, then each folder's value and, for
    each folder but the baseline, `delta_X` (X − baseline, in the metric's unit; fractions
    as fractions) and `rel_X` ((X − baseline) / |baseline|)."""
    import pandas as pd

    names = [f["name"] for f in doc["folders"]]
    base = doc["baseline"]
    keys = doc["match_on"][1:]
    records = []
    for row in doc["rows"]:
        for m in doc["metrics"]:
            rec: dict[str, Any] = {"label": row["label"]}
            rec.update({k: row["sweep"].get(k) for k in keys})
            rec.update({"metric": m["key"], "headline": m["headline"]})
            for n in names:
                rec[n] = row["values"].get(n, {}).get(m["key"])
            for n in names:
                if n == base:
                    continue
                d = row["diff"].get(n, {}).get(m["key"], {})
                rec[f"delta_{n}"] = d.get("abs")
                rec[f"rel_{n}"] = d.get("rel")
            records.append(rec)
    return pd.DataFrame(records)


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="png", dpi=150, metadata={"Software": None})


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
