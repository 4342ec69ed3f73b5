"""Results folders of an older schema: `kvfrag compare`, `kvfrag plot` and `kvfrag report`
read a folder written by schema 1 (or 0: summary.json a bare list) under this kvfrag's names
(`kvfrag.results.upgrade_summary`, `upgrade_timeseries`), and refuse one of a newer schema."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvfrag.cli import main
from kvfrag.outdir import write_manifest
from kvfrag.results import SCHEMA_VERSION, upgrade_summary, upgrade_timeseries

CAP = 4 * 2**20

#: Two runs' summary as schema 1 wrote it: fractions under bare part names, `free` (a copy of
#: `usable_free`), `allocator` (a copy of `kind`), `options` as JSON text.
V1_ROWS = [
    {
        "label": "slab-oracle", "kind": "contiguous", "point": 0, "model": "tiny",
        "hardware": "", "tp": 1, "kv_budget_bytes": CAP, "allocator": "contiguous",
        "capacity_bytes": CAP, "bytes_per_token": 1024, "max_model_len": 2048,
        "sim_time_s": 10.0, "token_states": 0.6, "reserved": 0.1, "internal": 0.05,
        "external": 0.15, "usable_free": 0.1, "free": 0.1, "internal_overreservation": 0.05,
        "internal_rounding": 0.0, "kv_utilization": 0.8, "memory_saved_by_sharing": 0.0,
        "mean_running": 4.0, "max_running": 7, "requests": 40, "completed": 40, "rejected": 0,
        "preemptions": 0, "frag_refusals": 3, "throughput_tok_s": 300.0,
        "mean_latency_s": 5.0, "p99_latency_s": 12.0, "mean_ttft_s": 4.0, "p99_ttft_s": 9.0,
        "mean_tpot_s": 0.012, "p99_tpot_s": 0.02, "events": 3,
        "options": json.dumps({"reserve": "oracle"}, sort_keys=True),
        "workload_dropped_rows": 0,
    },
    {
        "label": "paged-16", "kind": "paged", "point": 0, "model": "tiny",
        "hardware": "", "tp": 1, "kv_budget_bytes": CAP, "allocator": "paged",
        "capacity_bytes": CAP, "bytes_per_token": 1024, "max_model_len": 2048,
        "sim_time_s": 8.0, "token_states": 0.8, "reserved": 0.02, "internal": 0.01,
        "external": 0.0, "usable_free": 0.17, "free": 0.17, "internal_overreservation": 0.0,
        "internal_rounding": 0.01, "kv_utilization": 0.96, "memory_saved_by_sharing": 0.0,
        "mean_running": 5.5, "max_running": 9, "requests": 40, "completed": 40, "rejected": 0,
        "preemptions": 2, "frag_refusals": 0, "throughput_tok_s": 380.0,
        "mean_latency_s": 4.0, "p99_latency_s": 11.0, "mean_ttft_s": 3.0, "p99_ttft_s": 8.0,
        "mean_tpot_s": 0.014, "p99_tpot_s": 0.027, "events": 3,
        "options": json.dumps({"block_size": 16}, sort_keys=True),
        "workload_dropped_rows": 0,
    },
]
PARTS_V1 = ("token_states", "reserved", "internal", "external", "usable_free")


def _v1_timeseries() -> pd.DataFrame:
    """Three intervals per run, as schema 1 named the columns (times and bytes unsuffixed)."""
    rows = []
    for label in ("slab-oracle", "paged-16"):
        for i, (t, dt) in enumerate(((0.0, 2.0), (2.0, 3.0), (5.0, 3.0))):
            used = CAP // 8 * (i + 1)
            rows.append({"t": t, "dt": dt, "iterations": i, "running": i + 1, "waiting": 2 - i,
                         "token_states": used, "reserved": CAP // 16, "internal": CAP // 32,
                         "external": CAP // 32, "usable_free": CAP - used - CAP // 8,
                         "largest_hole": CAP // 4, "frag_blocked": i == 1,
                         "label": label, "point": 0})
    return pd.DataFrame(rows)


def _v1_folder(path: Path, doc: str = "object") -> Path:
    """A results folder as kvfrag run wrote it under schema 1 (`doc="list"`: schema 0, whose
    summary.json was the bare list of rows)."""
    path.mkdir(parents=True)
    pd.DataFrame(V1_ROWS).to_csv(path / "summary.csv", index=False)
    document = (V1_ROWS if doc == "list"
                else {"schema_version": 1, "scenario": "old-tiny", "runs": V1_ROWS})
    (path / "summary.json").write_text(json.dumps(document, indent=2) + "\n")
    _v1_timeseries().to_parquet(path / "timeseries.parquet", index=False)
    (path / "scenario.resolved.yaml").write_text("name: old-tiny\nkv_budget: 4MiB\n")
    write_manifest(path, "kvfrag run")
    return path


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("version", [0, 1])
def test_a_schema_1_summary_gets_the_current_names(version):
    old = pd.read_csv(io.StringIO(pd.DataFrame(V1_ROWS).to_csv(index=False)))
    new = upgrade_summary(old, version)
    columns = list(new.columns)
    assert not {"free", "allocator", "options", *PARTS_V1} & set(columns)
    # The options' columns stand where `options` stood, one per key, sorted.
    at = columns.index("events") + 1
    assert columns[at:at + 3] == ["option.block_size", "option.reserve", "workload_dropped_rows"]
    assert math.isnan(new.loc[0, "option.block_size"]) and new.loc[1, "option.block_size"] == 16
    assert new.loc[0, "option.reserve"] == "oracle" and pd.isna(new.loc[1, "option.reserve"])
    for name in (*PARTS_V1, "internal_overreservation", "internal_rounding",
                 "memory_saved_by_sharing"):
        assert list(new[f"{name}_frac"]) == list(old[name]), name
    # What was not renamed is as it was, in its place.
    kept = [c for c in old.columns if c in new.columns]
    assert [c for c in columns if c in kept] == kept
    assert new[kept].equals(old[kept])
    # summary.json's rows translate alike (options: JSON text there too, in schema 1).
    rows = upgrade_summary(V1_ROWS, version)
    assert list(rows.columns) == columns
    assert list(rows["token_states_frac"]) == [0.6, 0.8]


def test_a_current_summary_is_left_as_it_is():
    current = upgrade_summary(V1_ROWS, 1)
    assert upgrade_summary(current, SCHEMA_VERSION) is current
    assert upgrade_summary(current, None) is current  # (no version: the names tell)
    assert list(upgrade_summary(pd.DataFrame(V1_ROWS), None).columns) == list(current.columns)


def test_a_schema_1_timeseries_gets_the_current_names():
    old = _v1_timeseries()
    new = upgrade_timeseries(old, 1)
    assert list(new.columns) == [
        "t_s", "dt_s", "iterations", "running", "waiting", "token_states_bytes",
        "reserved_bytes", "internal_bytes", "external_bytes", "usable_free_bytes",
        "largest_hole_bytes", "frag_blocked", "label", "point",
    ]
    assert new.to_numpy().tolist() == old.to_numpy().tolist()  # the values as they were
    assert upgrade_timeseries(new, SCHEMA_VERSION) is new


def test_plot_and_report_read_a_schema_1_folder(tmp_path):
    folder = _v1_folder(tmp_path / "old")
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()
              and p.name != ".kvfrag-manifest.json"}
    rc, out, err = _main(["plot", str(folder)])
    assert rc == 0, err
    drawn = {Path(line).name for line in out.split()}
    assert {"breakdown.png", "timeline.png", "capacity.png"} <= drawn
    rc, out, err = _main(["report", str(folder)])
    assert rc == 0, err
    page = (folder / "report.html").read_text(encoding="utf-8")
    for row in V1_ROWS:  # the old fractions, shown under the current columns
        assert f"{100 * row['token_states']:.1f} %" in page
    assert "token_states_frac" in page and "option.block_size" in page
    # Read, not rewritten: the old files are as they were.
    assert {name: (folder / name).read_bytes() for name in before} == before


@pytest.mark.parametrize("doc", ["object", "list"])
def test_compare_reads_schema_1_and_0_folders(tmp_path, doc):
    old = _v1_folder(tmp_path / "old", doc)
    copy = tmp_path / "copy"
    shutil.copytree(old, copy)
    rc, out, err = _main(["compare", str(old), str(copy), "--json"])
    assert rc == 0, err
    result = json.loads(out)
    version = 0 if doc == "list" else 1
    assert [f["schema_version"] for f in result["folders"]] == [version, version]
    rows = {r["label"]: r for r in result["rows"]}
    for row in V1_ROWS:
        values = rows[row["label"]]["values"]["A"]
        assert values["token_states_frac"] == row["token_states"]
        assert values["usable_free_frac"] == row["usable_free"]
        assert "free" not in values and "token_states" not in values
    assert any("read under this kvfrag's names" in n for n in result["notes"])


@pytest.mark.parametrize("command", ["plot", "report", "compare"])
def test_a_newer_schema_is_refused(tmp_path, command):
    folder = _v1_folder(tmp_path / "new")
    doc = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").write_text(json.dumps({**doc, "schema_version": 99}))
    other = _v1_folder(tmp_path / "other")
    args = [command, str(folder)] + ([str(other)] if command == "compare" else [])
    rc, out, err = _main(args)
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"kvfrag: error: {folder}: schema_version 99, newer than this kvfrag "
                           f"reads ({SCHEMA_VERSION}); upgrade kvfrag")
    assert not (folder / "plots").exists() and not (folder / "report.html").exists()
