"""Result writers: one folder per scenario, written whole or not at all.

Everything goes into a temporary sibling folder first; only when every file (and figure) is
written, with the manifest that marks the folder as kvfrag's (`kvfrag.outdir`), is it
renamed into place, replacing earlier results of kvfrag's (a `validate/` report that
`kvfrag validate` wrote there is carried over). A failed run leaves nothing half-written
behind, and never replaces a folder kvfrag did not write.

While a sweep runs, each finished point is staged as it completes, in a hidden sibling
folder (`PointStore`, `results/.<name>.points/`), so that an interrupted sweep can be
resumed; the final folder is assembled from it, and it is removed once that is written with
no point failed. A staged point records the digests of the input files it read, so a point
whose trace changed since is computed again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from kvfrag import outdir
from kvfrag.csvcells import write_csv
from kvfrag.outdir import VALIDATE_DIR, replace_dir, temp_dir, writing
from kvfrag.sim.engine_records import RunResult
from kvfrag.sim.scenario_run import ScenarioResult


def write_results(
    result: ScenarioResult,
    out_dir: Path,
    resolved: dict[str, Any],
    plot: Callable[[Path], object] | None = None,
    failures: pd.DataFrame | None = None,
) -> Path:
    """Write summary, records and the resolved scenario to `out_dir`, atomically; with
    `failures` (one row per failed run: its parameters and error), `failures.csv` too; each
    run that carries a memory snapshot (torch-caching), `snapshots/<label>[@<point>].pickle`."""
    out_dir = Path(out_dir)
    outdir.make_dirs(out_dir.parent)
    tmp = temp_dir(out_dir)
    try:
        with writing(tmp):
            (tmp / "scenario.resolved.yaml").write_text(
                yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8"
            )
            summary = result.summary()
            write_csv(summary_table(summary), tmp / "summary.csv")
            document = summary_document(result.scenario.name, summary)
            (tmp / "summary.json").write_text(dumps_json(document) + "\n", encoding="utf-8")
            result.frames("timeseries").to_parquet(tmp / "timeseries.parquet", index=False)
            result.frames("requests").to_parquet(tmp / "requests.parquet", index=False)
            if failures is not None and len(failures):
                write_csv(failures, tmp / "failures.csv")
            write_snapshots(result, tmp)
            if plot is not None:
                plot(tmp)
            kept = out_dir / VALIDATE_DIR
            if kept.is_dir():  # copied, not moved: a failed swap must leave the old folder whole
                shutil.copytree(kept, tmp / VALIDATE_DIR)
            outdir.write_manifest(tmp, "kvfrag run")
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


#: A results folder's subfolder of PyTorch memory snapshots (torch-caching runs).
SNAPSHOT_DIR = "snapshots"
#: The pickle protocol of snapshot files: what torch's `_dump_snapshot` writes (Python's
#: default) and PyTorch's memory viewer (MemoryViz.js, which parses protocols 2-4) reads.
SNAPSHOT_PROTOCOL = 4


def snapshot_name(label: str, point: int, sweeps: bool) -> str:
    """A run's snapshot file name: `<label>.pickle`, `<label>@<point>.pickle` in a sweep (the
    summary's `point`; labels may hold '@', but the last `@<number>` is always the point)."""
    return f"{label}@{point}.pickle" if sweeps else f"{label}.pickle"


def write_snapshots(result: ScenarioResult, folder: Path) -> list[Path]:
    """Write each run's memory snapshot (if it has one) into `folder`/snapshots/."""
    sweeps = bool(result.scenario.sweep)
    written = []
    for run in result.runs:
        if run.result.snapshot is None:
            continue
        path = Path(folder) / SNAPSHOT_DIR / snapshot_name(run.label, run.point, sweeps)
        path.parent.mkdir(exist_ok=True)
        write_snapshot(run.result.snapshot, path)
        written.append(path)
    return written


def write_snapshot(snap: dict[str, Any], path: Path) -> None:
    """Pickle a snapshot dict as torch's `_dump_snapshot` does."""
    with Path(path).open("wb") as fh:
        pickle.dump(snap, fh, protocol=SNAPSHOT_PROTOCOL)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (dict, list, tuple, str, bytes, numbers, bool, None): a
    pickle that names any class or function is refused rather than run."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")


def read_snapshot(path: Path) -> Any:
    """What a snapshot pickle holds (plain data only), or ValueError naming the file."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            head = fh.read(2)
            fh.seek(0)
            return _PlainUnpickler(fh).load()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, UnicodeDecodeError) as exc:
        detail = str(exc) or type(exc).__name__
        if detail.startswith("it refers to"):
            raise ValueError(
                f"{path}: not a memory snapshot: {detail} (a snapshot holds plain data only)"
            ) from None
        if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:  # no protocol 2+ header
            raise ValueError(f"{path}: not a pickle file") from None
        raise ValueError(f"{path}: a damaged pickle file ({detail})") from None


def json_value(value: Any) -> Any:
    """A summary value as JSON holds it: numpy scalars unwrapped, NaN and inf as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return json_value(value.item())
    return value


#: The version of the layout of a results folder's files (summary.csv, summary.json,
#: timeseries.parquet, requests.parquet) and of the `--json` outputs, as
#: docs/data-dictionary.md describes them. Bumped when a documented column or key is renamed or
#: removed, or changes its unit or meaning; adding one does not bump it.
SCHEMA_VERSION = 2

#: Schema 1 -> 2, summary.csv / summary.json: the budget's parts, fractions of capacity_bytes,
#: say so (`_frac`); `free` (a copy of `usable_free`) and `allocator` (of `kind`) are gone, and
#: `options` (JSON text) became one `option.<key>` column per option key (see `summary_table`).
SUMMARY_RENAMES_V1 = {
    p: f"{p}_frac"
    for p in (
        "token_states", "reserved", "internal", "external", "usable_free",
        "internal_overreservation", "internal_rounding", "memory_saved_by_sharing",
    )
}
SUMMARY_DROPPED_V1 = ("free", "allocator")
#: Schema 1 -> 2, timeseries.parquet: times in seconds end in `_s`, sizes in `_bytes`.
TIMESERIES_RENAMES_V1 = {
    "t": "t_s",
    "dt": "dt_s",
    **{p: f"{p}_bytes" for p in (
        "token_states", "reserved", "internal", "external", "usable_free", "largest_hole",
    )},
}
#: The prefix of summary.csv's option columns (`option.block_size`, ...).
OPTION_PREFIX = "option."


def cell_text(value: Any) -> Any:
    """A summary value as a CSV cell holds it: a mapping or list as JSON text (one line, as
    `json.dumps` writes it), anything else as it is."""
    return json.dumps(value) if isinstance(value, dict | list | tuple) else value


def _option_columns(options: pd.Series) -> pd.DataFrame:
    """One `option.<key>` column per key of the `options` mappings (sorted by key), empty
    (None) where a row's allocator lacks that option; object dtype, so that 16 stays 16 beside
    an empty cell rather than becoming 16.0."""
    keys = sorted({k for o in options if isinstance(o, dict) for k in o})
    return pd.DataFrame(
        {
            f"{OPTION_PREFIX}{k}": pd.Series(
                [cell_text(o.get(k)) if isinstance(o, dict) else None for o in options],
                index=options.index, dtype=object,
            )
            for k in keys
        },
        index=options.index,
    )


def _expand_options(summary: pd.DataFrame) -> pd.DataFrame:
    """`summary` with its `options` column (mappings) replaced, in place, by `option.<key>`
    columns."""
    if "options" not in summary.columns:
        return summary
    at = list(summary.columns).index("options")
    return pd.concat(
        [summary.iloc[:, :at], _option_columns(summary["options"]), summary.iloc[:, at + 1:]],
        axis=1,
    )


def summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as summary.csv (and the terminal table) lays it out: no JSON object in a
    cell for the options (a column per option key, `option.<key>`, where `options` was), and a
    swept mapping or list as JSON text, since a CSV cell holds text, not structure."""
    table = _expand_options(summary)
    for col in table.columns:
        if table[col].dtype == object:  # (kept object: `map` would make 16 beside None 16.0)
            table[col] = pd.Series([cell_text(v) for v in table[col]], index=table.index,
                                   dtype=object)
    return table


def summary_records(summary: pd.DataFrame) -> list[dict[str, Any]]:
    """The summary's rows as JSON holds them: the columns of the summary, NaN as null, a
    mapping or list (options, a swept mapping) native."""
    return [{k: json_value(v) for k, v in row.items()} for row in summary.to_dict("records")]


def upgrade_summary(
    summary: pd.DataFrame | list[dict[str, Any]], version: int | None
) -> pd.DataFrame:
    """A summary of schema `version` (the rows of summary.csv, or of an old summary.json's
    `runs`) in this kvfrag's layout, so that readers of old results folders need only know
    the current names. Schema 0 (summary.json a bare list) and 1 have the same columns: the
    parts renamed with `_frac`, `free` and `allocator` dropped (`free` kept as
    `usable_free_frac` when that is missing), the `options` JSON text split into `option.<key>`
    columns. A current summary is returned as it is; with no version known (`None`: a
    summary.csv without its summary.json), schema-1 names are recognised as such."""
    frame = summary if isinstance(summary, pd.DataFrame) else pd.DataFrame(summary)
    if version is None:
        old = "token_states" in frame.columns and "token_states_frac" not in frame.columns
        version = 1 if old else SCHEMA_VERSION
    if version >= SCHEMA_VERSION:
        return frame
    frame = frame.copy()
    if "usable_free" not in frame.columns and "free" in frame.columns:
        frame = frame.rename(columns={"free": "usable_free"})
    frame = frame.drop(columns=[c for c in SUMMARY_DROPPED_V1 if c in frame.columns])
    frame = frame.rename(columns=SUMMARY_RENAMES_V1)
    if "options" in frame.columns:
        frame["options"] = frame["options"].map(_parse_options)
        frame = _expand_options(frame)
        for col in frame.columns:  # numbers as numbers, as summary.csv reads back
            if col.startswith(OPTION_PREFIX):
                frame[col] = _numbers(frame[col])
    return frame


def _numbers(column: pd.Series) -> pd.Series:
    """An option column as numbers when every value it has is one (an empty cell: NaN), as
    pandas reads it from a CSV; else as it is."""
    values = column.dropna()
    if len(values) and all(isinstance(v, int | float) and not isinstance(v, bool)
                           for v in values):
        return pd.to_numeric(column)
    return column


def _parse_options(text: Any) -> dict[str, Any] | None:
    """Schema 1's `options` cell (JSON text of a mapping) as the mapping; None when empty or
    not a mapping."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def upgrade_timeseries(timeseries: pd.DataFrame, version: int | None) -> pd.DataFrame:
    """timeseries.parquet of schema `version` with this kvfrag's column names (`t_s`, `dt_s`,
    the parts and largest hole in `_bytes`); a current one as it is (`None`, version unknown:
    schema-1 names are recognised as such)."""
    if version is None:
        old = "t" in timeseries.columns and "t_s" not in timeseries.columns
        version = 1 if old else SCHEMA_VERSION
    if version >= SCHEMA_VERSION:
        return timeseries
    return timeseries.rename(columns=TIMESERIES_RENAMES_V1)


def timeseries_names(names: Iterable[str], version: int | None) -> list[str]:
    """What the current timeseries columns `names` are called in a file of schema `version`
    (to read only those columns of an old file)."""
    if version is None or version >= SCHEMA_VERSION:
        return list(names)
    old = {new: name for name, new in TIMESERIES_RENAMES_V1.items()}
    return [old.get(n, n) for n in names]


def folder_schema(folder: Path) -> tuple[int | None, dict[str, Any] | None]:
    """The schema version of a results folder, from its summary.json (0 for the bare list of
    rows written before versions; None when there is no summary.json), and that document
    (None unless an object). Raises ValueError naming the file when it cannot be read or is not
    a summary."""
    path = Path(folder) / "summary.json"
    if not path.is_file():
        return None, None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read ({error_reason(exc)})") from None
    if isinstance(doc, list):  # before schema versions: a bare list of rows
        return 0, None
    if isinstance(doc, dict) and isinstance(doc.get("schema_version"), int):
        return doc["schema_version"], doc
    raise ValueError(f"{path}: not a summary written by kvfrag run (no schema_version)")


def error_reason(exc: BaseException) -> str:
    """Why a file could not be read, in a few words: an OSError's message, else the first
    line of the exception's."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def check_schema(version: int | None, folder: Path, doing: str = "read") -> None:
    """Refuse a results folder written by a newer kvfrag (a layout this one cannot translate):
    a ValueError, one line, that says what to do."""
    if version is not None and version > SCHEMA_VERSION:
        raise ValueError(
            f"{folder}: schema_version {version}, newer than this kvfrag reads "
            f"({SCHEMA_VERSION}); upgrade kvfrag to {doing} it"
        )


def summary_document(scenario: str, summary: pd.DataFrame) -> dict[str, Any]:
    """What summary.json holds: the schema version, the scenario's name and one row per
    allocator x sweep point (`runs`)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "scenario": scenario,
        "runs": summary_records(summary),
    }


def dumps_json(document: Any) -> str:
    """`document` as strict JSON (indented; NaN or inf is an error, never a bare token)."""
    return json.dumps(document, indent=2, allow_nan=False)


class StagedScenarioMismatch(ValueError):
    """`--resume` found staged points of a different scenario."""


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class PointStore:
    """Finished sweep points, one folder each, staged while a sweep runs.

    Layout, beside the results folder `results/<name>/`::

        results/.<name>.points/
            scenario.resolved.yaml     the scenario these points belong to
            code.txt                   and a fingerprint of the simulator code that ran them
            inputs.json                size, mtime and SHA-256 of every input file read
            <key>/summary.json         one finished point: its summary, where it belongs
                                       and the digests of the input files it read,
            <key>/timeseries.parquet   its accounting over time
            <key>/requests.parquet     and its per-request records
            <key>/snapshot.pickle      and its memory snapshot (torch-caching runs only)

    A point's folder is written under a temporary name and renamed when complete, so a
    killed sweep leaves only whole points (and temporary folders, removed on the next open).
    The caller holds the results folder's lock (`kvfrag.outdir.locked`) throughout.
    """

    SCENARIO = "scenario.resolved.yaml"
    CODE = "code.txt"
    INPUTS = "inputs.json"
    SNAPSHOT = "snapshot.pickle"

    def __init__(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        self.dir = out_dir.parent / f".{out_dir.name}.points"
        self.inputs: dict[str, dict[str, Any]] = {}  # path -> size, mtime_ns, sha256
        self.rerun: dict[str, list[str]] = {}  # staged keys dropped: inputs that changed

    def open(
        self,
        resolved: dict[str, Any],
        resume: bool,
        code: str = "",
        inputs: Iterable[Path] = (),
    ) -> set[str]:
        """Start staging for `resolved`; the keys already finished (only with `resume`).

        Without `resume`, anything staged before is discarded. With it, the staged points
        must belong to the same resolved scenario and have been computed by the same code
        (`code`, a fingerprint), else `StagedScenarioMismatch`; a staged point whose input
        files (of `inputs`, every file the run reads) changed since is dropped, to be
        computed again (`rerun` says which and why).
        """
        with writing(self.dir):
            return self._open(resolved, resume, code, list(inputs))

    def _open(
        self, resolved: dict[str, Any], resume: bool, code: str, inputs: list[Path]
    ) -> set[str]:
        scenario_file = self.dir / self.SCENARIO
        if self.dir.exists():
            self._check_ours()
            if not resume or not scenario_file.exists():
                shutil.rmtree(self.dir)  # (no scenario file: killed before any point was staged)
        cache = self._read_inputs() if self.dir.exists() else {}
        self.inputs = self._digests(inputs, cache)
        if not self.dir.exists():
            self.dir.mkdir(parents=True)
            _write_atomic(self.dir / self.CODE, code + "\n")
            self._write_inputs()
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
        self._write_inputs()
        outdir.clean_stale_inside(self.dir)  # points being written when it was killed
        keys = set()
        for p in sorted(self.dir.iterdir()):
            if p.name.startswith(".") or not (p / "summary.json").is_file():
                continue
            changed = self._changed_inputs(p)
            if changed:
                self.rerun[p.name] = changed
                shutil.rmtree(p)
            else:
                keys.add(p.name)
        return keys

    def _check_ours(self) -> None:
        """Refuse to remove a folder of that name that kvfrag did not stage."""
        names = {p.name for p in self.dir.iterdir()}
        if names and not names & {self.SCENARIO, self.CODE}:
            raise outdir.UnsafeOutput(
                f"{self.dir}: not a folder of points staged by kvfrag; move it away"
            )

    def _read_inputs(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads((self.dir / self.INPUTS).read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _digests(
        inputs: list[Path], cache: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """Size, mtime and digest of each input; a file whose size and mtime are as cached is
        not read again."""
        out = {}
        for path in inputs:
            key = str(path)
            try:
                st = path.stat()
            except FileNotFoundError:  # its points fail to build their workload, and say so
                continue
            known = cache.get(key, {})
            same = known.get("size") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns
            out[key] = {
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "sha256": known["sha256"] if same else file_digest(path),
            }
        return out

    def _write_inputs(self) -> None:
        _write_atomic(self.dir / self.INPUTS, json.dumps(self.inputs, indent=1))

    def _digest(self, path: str) -> str | None:
        record = self.inputs.get(path)
        return None if record is None else record["sha256"]

    def _changed_inputs(self, folder: Path) -> list[str]:
        try:
            record = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
            read = record["inputs"]
        except (OSError, ValueError, KeyError):
            return ["(inputs not recorded)"]
        return sorted(p for p, d in read.items() if self._digest(p) != d)

    def put(
        self, key: str, meta: dict[str, Any], result: RunResult, inputs: Iterable[Path] = ()
    ) -> None:
        """Stage one finished point, atomically, with the digests of the files it read."""
        with writing(self.dir):
            self._put(key, meta, result, inputs)

    def _put(self, key: str, meta: dict[str, Any], result: RunResult, inputs: Iterable[Path]
             ) -> None:
        tmp = temp_dir(self.dir / key)
        try:
            read = {str(p): self._digest(str(p)) or file_digest(p) for p in inputs}
            record = {**meta, "key": key, "inputs": read, "summary": result.summary}
            (tmp / "summary.json").write_text(
                json.dumps(record, default=_json_default, indent=1), encoding="utf-8"
            )
            result.timeseries.to_parquet(tmp / "timeseries.parquet", index=False)
            result.requests.to_parquet(tmp / "requests.parquet", index=False)
            if result.snapshot is not None:
                write_snapshot(result.snapshot, tmp / self.SNAPSHOT)
            target = self.dir / key
            if target.exists():
                shutil.rmtree(target)
            outdir.unmark(tmp)  # (a staged point, no longer a temporary)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def get(self, key: str) -> RunResult:
        folder = self.dir / key
        record = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        snap = folder / self.SNAPSHOT
        return RunResult(
            record["summary"],
            pd.read_parquet(folder / "timeseries.parquet"),
            pd.read_parquet(folder / "requests.parquet"),
            snapshot=read_snapshot(snap) if snap.is_file() else None,
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


#: Columns of the terminal table, with how to show them; a fourth item names a summary column
#: that must be above zero in some row for the column to be shown at all (what a scenario is
#: about, left out of the tables of the others).
TABLE = (
    ("label", "label", str),
    ("token_states_frac", "tokens", "pct"),
    ("reserved_frac", "reserved", "pct"),
    ("internal_frac", "internal", "pct"),
    # (internal's parts on hybrid models: pages padded past their layers' slots, and tokens
    # no layer reads again)
    ("internal_padding_frac", "padding", "pct", "internal_padding_frac"),
    ("internal_out_of_window_frac", "out of win", "pct", "internal_out_of_window_frac"),
    ("external_frac", "external", "pct"),
    ("usable_free_frac", "free", "pct"),
    ("kv_utilization", "kv util", "pct"),
    ("mean_running", "mean run", "{:.1f}"),
    ("max_running", "max run", "{:d}"),
    # (shown where it was computed: results written before it print as they did)
    ("capacity_requests", "capacity", "{:.1f}", "capacity_sample_requests"),
    ("capacity_memory_requests", "mem cap", "{:.1f}", "capacity_capped"),
    ("completed", "done", "{:d}"),
    ("rejected", "rej", "{:d}"),
    ("preemptions", "preempt", "{:d}"),
    ("frag_refusals", "frag ref", "{:d}"),
    ("throughput_tok_s", "tok/s", "{:,.0f}"),
    ("p99_latency_s", "p99 lat s", "{:.2f}"),
    ("mean_ttft_s", "ttft s", "{:.2f}"),
    ("p99_ttft_s", "p99 ttft", "{:.2f}"),
    ("mean_tpot_s", "tpot ms", "ms"),
    ("p99_tpot_s", "p99 tpot", "ms"),
    ("prefix_hit_rate_tokens", "hit %", "pct", "prefix_hit_rate_tokens"),
    ("memory_saved_by_sharing_frac", "saved", "pct", "memory_saved_by_sharing_frac"),
    ("stall_s", "stall s", "{:.2f}", "compactions"),
)


def short_labels(values: list[Any]) -> dict[str, str]:
    """Readable labels for swept mappings (JSON in the summary's cells): `k=v` of the keys
    whose values differ between the points, nested keys dotted (`base_s=0.01`)."""
    parsed: dict[str, dict[str, Any]] = {}
    for value in values:
        if isinstance(value, str) and value.startswith("{"):
            try:
                parsed[value] = _flatten(json.loads(value))
            except ValueError:
                continue
    keys = sorted({k for flat in parsed.values() for k in flat})
    differ = [
        k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in parsed.values()}) > 1
    ] or keys
    return {
        value: ", ".join(f"{k}={flat[k]}" for k in differ if k in flat) or "{}"
        for value, flat in parsed.items()
    }


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def format_table(summary: pd.DataFrame, sweep_keys: list[str]) -> str:
    """The summary as a fixed-width table for the terminal (fractions as % of the budget); the
    columns of `TABLE` with a condition only when some row meets it."""
    summary = summary_table(summary)  # (swept mappings as the JSON text `short_labels` reads)

    def shown(when: str) -> bool:
        return when in summary and bool((pd.to_numeric(summary[when], errors="coerce") > 0).any())

    cols = [(k, k.split(".")[-1], "{}") for k in sweep_keys] + [
        (key, name, fmt) for key, name, fmt, *when in TABLE if all(map(shown, when))
    ]
    header = [name for _, name, _ in cols]
    labels = {k: short_labels(summary[k].tolist()) for k in sweep_keys if k in summary}
    rows = []
    for rec in summary.to_dict("records"):
        row = []
        for key, _, fmt in cols:
            value = rec.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                row.append("-")
            elif fmt == "pct":
                row.append(f"{100 * value:.1f}%".replace("-0.0%", "0.0%"))  # (round-off)
            elif fmt == "ms":
                row.append(f"{1e3 * value:.1f}")
            elif key in labels and value in labels[key]:
                row.append(labels[key][value])
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
