"""`kvfrag compare`: rows matched across results folders, their differences, the scenario diff,
--json, -o (written safely, figures included) and its errors."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest

from kvfrag.cli import main
from kvfrag.results import SCHEMA_VERSION

SCENARIO = """\
name: cmp-tiny
model: {{name: tiny, layers: 2, kv_heads: 2, head_dim: 64}}
kv_budget: {budget}
max_model_len: 2048
workload:
  synthetic:
    count: 40
    prompt: {{kind: lognormal, mean: 300, p99: 1200}}
    output: {{kind: lognormal, mean: 100, p99: 400}}
    arrival: {{kind: poisson, rate: 20}}
  transforms: {{max_model_len: 2048, long_requests: clip}}
  seed: 3
engine:
  max_num_seqs: 32
  max_num_batched_tokens: 2048
  step_time: {{base_s: 0.01, per_batched_token_s: 0.0001, per_kv_token_s: 5.0e-8}}
allocators:
{allocators}{sweep}"""
SLAB = "  - {label: slab-oracle, kind: contiguous, reserve: oracle}\n"
PAGED = "  - {label: paged-16, kind: paged, block_size: 16}\n"
PAGED_32 = "  - {label: paged-32, kind: paged, block_size: 32}\n"


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _run(base: Path, name: str, budget: str = "2MiB", allocators: str = SLAB + PAGED,
         sweep: str = "") -> Path:
    scenario = base / f"{name}.yaml"
    scenario.write_text(SCENARIO.format(budget=budget, allocators=allocators, sweep=sweep))
    out = base / name
    rc, _, err = _main(["run", str(scenario), "-o", str(out), "-q", "--no-plots", "-j", "1"])
    assert rc == 0, err
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("compare")
    return {
        "a": _run(base, "a", "2MiB"),
        "b": _run(base, "b", "4MiB"),
        "c": _run(base, "c", "8MiB"),
        "other": _run(base, "other", "2MiB", allocators=PAGED + PAGED_32),
        "sweep": _run(base, "sweep", "2MiB", allocators=PAGED,
                      sweep="sweep:\n  kv_budget: [2MiB, 4MiB]\n"),
    }


def _summary(folder: Path) -> pd.DataFrame:
    return pd.read_csv(folder / "summary.csv").set_index("label")


def _table_row(text: str, metric: str) -> list[str]:
    """The cells of a metric's line in the table (the metric name first)."""
    line = next(ln for ln in text.splitlines() if ln.startswith(metric + "  "))
    return re.split(r"\s{2,}", line.strip())


def test_the_table_shows_both_runs_and_their_differences(folders):
    rc, out, err = _main(["compare", str(folders["a"]), str(folders["b"])])
    assert rc == 0 and err == ""
    a, b = _summary(folders["a"]), _summary(folders["b"])
    # The blocks are the rows in A's order: slab-oracle, then paged-16.
    header = next(ln for ln in out.splitlines() if "slab-oracle" in ln and "paged-16" in ln)
    assert header.index("slab-oracle") < header.index("paged-16")
    cells = _table_row(out, "token states")
    for i, label in enumerate(["slab-oracle", "paged-16"]):
        va, vb, delta = cells[1 + 3 * i : 4 + 3 * i]
        assert va == f"{100 * a.loc[label, 'token_states_frac']:.1f}%"
        assert vb == f"{100 * b.loc[label, 'token_states_frac']:.1f}%"
        pp = 100 * (b.loc[label, "token_states_frac"] - a.loc[label, "token_states_frac"])
        assert delta == f"{pp:+.1f}pp"
    cells = _table_row(out, "mean latency s")
    rel = 100 * (b.loc["paged-16", "mean_latency_s"] / a.loc["paged-16", "mean_latency_s"] - 1)
    assert cells[6] == f"{rel:+.1f}%"
    cells = _table_row(out, "completed")
    assert cells[1:4] == [f"{a.loc['slab-oracle', 'completed']:,}",
                          f"{b.loc['slab-oracle', 'completed']:,}", "="]
    # Why the numbers moved: the scenarios differ in their budget, and only there.
    diff = out.split("What differs in the scenarios")[1].split("\n\n")[0].splitlines()
    assert re.split(r"\s{2,}", diff[1].strip()) == ["key", "A", "B"]
    assert re.split(r"\s{2,}", diff[2].strip()) == ["kv_budget", "2.0 MiB", "4.0 MiB"]
    assert len(diff) == 3  # the scenario files' paths differ, but not their workloads
    assert "only in" not in out
    assert max(len(line) for line in out.splitlines()) <= 160


def test_json_is_the_same_comparison(folders):
    rc, out, _ = _main(["compare", str(folders["a"]), str(folders["b"]), "--json"])
    assert rc == 0
    doc = json.loads(out, parse_constant=lambda token: pytest.fail(f"not JSON: {token}"))
    assert doc["baseline"] == "A" and doc["schema_version"] == SCHEMA_VERSION
    assert [f["path"] for f in doc["folders"]] == [str(folders["a"]), str(folders["b"])]
    assert doc["scenario_diff"] == [
        {"key": "kv_budget", "values": {"A": 2 * 2**20, "B": 4 * 2**20}, "absent": []}
    ]
    a, b = _summary(folders["a"]), _summary(folders["b"])
    rows = {r["label"]: r for r in doc["rows"]}
    assert list(rows) == ["slab-oracle", "paged-16"]
    for label, row in rows.items():
        assert row["in"] == ["A", "B"]
        for col in ("token_states_frac", "mean_running", "throughput_tok_s", "p99_latency_s"):
            assert row["values"]["A"][col] == pytest.approx(a.loc[label, col], rel=1e-12)
            assert row["values"]["B"][col] == pytest.approx(b.loc[label, col], rel=1e-12)
            d = row["diff"]["B"][col]
            assert d["abs"] == pytest.approx(b.loc[label, col] - a.loc[label, col], abs=1e-12)
            assert d["rel"] == pytest.approx(
                (b.loc[label, col] - a.loc[label, col]) / a.loc[label, col], rel=1e-9
            )
    # Every numeric column is compared; the table's metrics are the headline ones.
    metrics = {m["key"]: m for m in doc["metrics"]}
    assert not [k for k in metrics if k.startswith("option.")]  # settings, not outcomes
    assert metrics["token_states_frac"]["diff"] == "pp"
    assert metrics["completed"]["diff"] == "relative"
    assert metrics["kv_budget_bytes"]["headline"] is False
    assert not metrics["prefix_hit_rate_tokens"]["headline"]  # no prefix caching here
    assert doc["only_in"] == []


def test_three_folders_differ_from_the_first(folders):
    args = ["compare", str(folders["a"]), str(folders["b"]), str(folders["c"])]
    rc, out, _ = _main(args)
    assert rc == 0
    assert "slab-oracle" in out
    heads = next(ln for ln in out.splitlines() if ln.lstrip().startswith("metric"))
    assert re.split(r"\s+", heads.strip())[:6] == ["metric", "A", "B", "ΔB", "C", "ΔC"]
    a, c = _summary(folders["a"]), _summary(folders["c"])
    cells = _table_row(out, "usable free")
    pp = 100 * (c.loc["slab-oracle", "usable_free_frac"] - a.loc["slab-oracle", "usable_free_frac"])
    assert cells[5] == f"{pp:+.1f}pp"  # C against A, not against B
    rc, out, _ = _main([*args, "--json"])
    doc = json.loads(out)
    row = doc["rows"][0]
    assert set(row["diff"]) == {"B", "C"}
    assert row["diff"]["C"]["usable_free_frac"]["abs"] == pytest.approx(pp / 100)
    assert [e["values"] for e in doc["scenario_diff"]] == [
        {"A": 2 * 2**20, "B": 4 * 2**20, "C": 8 * 2**20}
    ]


def test_rows_that_do_not_match_are_listed(folders):
    rc, out, _ = _main(["compare", str(folders["a"]), str(folders["other"])])
    assert rc == 0
    assert "only in A: slab-oracle" in out and "only in B: paged-32" in out
    header = next(ln for ln in out.splitlines() if "paged-16" in ln)
    assert "slab-oracle" not in header  # only the matched row gets a block
    diff = out.split("What differs in the scenarios")[1].split("\n\n")[0]
    assert "allocators.slab-oracle" in diff and "allocators.paged-32" in diff
    assert "(absent)" in diff
    _, out, _ = _main(["compare", str(folders["a"]), str(folders["other"]), "--json"])
    doc = json.loads(out)
    assert doc["only_in"] == [{"in": ["A"], "rows": ["slab-oracle"]},
                              {"in": ["B"], "rows": ["paged-32"]}]


def test_a_single_run_meets_the_sweep_point_of_its_value(folders):
    """A run at 2 MiB against a sweep over kv_budget (2 and 4 MiB): the 2 MiB point."""
    rc, out, _ = _main(["compare", str(folders["a"]), str(folders["sweep"]), "--json"])
    assert rc == 0
    doc = json.loads(out)
    assert doc["match_on"] == ["label", "kv_budget"]
    matched = [r for r in doc["rows"] if r["diff"]]
    assert [r["name"] for r in matched] == ["paged-16 @ kv_budget=2.0 MiB"]
    assert matched[0]["points"] == {"A": 0, "B": 0}
    assert matched[0]["diff"]["B"]["token_states_frac"]["abs"] == pytest.approx(0, abs=1e-12)
    assert {"in": ["B"], "rows": ["paged-16 @ kv_budget=4.0 MiB"]} in doc["only_in"]


def test_output_folder_holds_the_csv_and_figures(folders, tmp_path):
    out = tmp_path / "cmp"
    rc, stdout, _ = _main(["compare", str(folders["a"]), str(folders["b"]), "-o", str(out)])
    assert rc == 0 and f"wrote {out}/" in stdout
    manifest = json.loads((out / ".kvfrag-manifest.json").read_text())
    assert manifest["written_by"] == "kvfrag compare"
    assert sorted(manifest["files"]) == ["breakdown.png", "capacity.png", "comparison.csv",
                                         "comparison.json"]
    for png in ("breakdown.png", "capacity.png"):
        assert matplotlib.image.imread(out / png).std() > 0.01, png  # not a blank canvas
    csv = pd.read_csv(out / "comparison.csv")
    assert list(csv.columns) == ["label", "metric", "headline", "A", "B", "delta_B", "rel_B"]
    a, b = _summary(folders["a"]), _summary(folders["b"])
    row = csv[(csv["label"] == "paged-16") & (csv["metric"] == "throughput_tok_s")].iloc[0]
    assert row["A"] == pytest.approx(a.loc["paged-16", "throughput_tok_s"])
    assert row["delta_B"] == pytest.approx(b.loc["paged-16", "throughput_tok_s"]
                                           - a.loc["paged-16", "throughput_tok_s"])
    # Nothing was written into the compared folders, and a second comparison replaces the first.
    assert not any("comparison" in p.name for p in folders["a"].rglob("*"))
    rc, _, _ = _main(["compare", str(folders["a"]), str(folders["c"]), "-o", str(out), "--json"])
    assert rc == 0
    assert json.loads((out / "comparison.json").read_text())["folders"][1]["path"] == str(
        folders["c"])


def test_without_output_nothing_is_written(folders, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = {p: p.stat().st_mtime_ns for f in folders.values() for p in f.rglob("*")}
    assert _main(["compare", str(folders["a"]), str(folders["b"])])[0] == 0
    assert list(tmp_path.iterdir()) == []
    assert {p: p.stat().st_mtime_ns for f in folders.values() for p in f.rglob("*")} == before


@pytest.mark.parametrize("where", ["user", "results", "inside", "same", "holds"])
def test_output_refuses_folders_it_did_not_write(folders, tmp_path, where):
    if where == "user":
        out = tmp_path / "mine"
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    elif where == "results":
        out = tmp_path / "results"
        shutil.copytree(folders["c"], out)  # a run's results: not to be replaced by a comparison
    elif where == "inside":
        out = folders["a"] / "cmp"
    elif where == "same":
        out = folders["b"]
    else:
        out = folders["a"].parent
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    rc, stdout, err = _main(["compare", str(folders["a"]), str(folders["b"]), "-o", str(out)])
    assert rc == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvfrag: error: {out}")
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before
    assert not (folders["a"] / "cmp").exists()


def _schema(folder: Path, tmp_path: Path, version) -> Path:
    copy = tmp_path / f"v{version}"
    shutil.copytree(folder, copy)
    doc = json.loads((copy / "summary.json").read_text())
    new = doc["runs"] if version == "list" else {**doc, "schema_version": version}
    (copy / "summary.json").write_text(json.dumps(new))
    return copy


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("one", "at least two results folders"),
        ("none", "at least two results folders"),
        ("missing", "no such folder"),
        ("empty", "not a kvfrag results folder (no summary.csv)"),
        ("damaged", "(truncated or damaged)"),
        ("newer", "newer than this kvfrag reads"),
    ],
)
def test_bad_inputs_are_one_line_and_exit_2(folders, tmp_path, case, expected):
    a = str(folders["a"])
    (tmp_path / "empty").mkdir()
    args = {
        "one": [a],
        "none": [],
        "missing": [a, str(tmp_path / "nowhere")],
        "empty": [a, str(tmp_path / "empty")],
        "newer": [a, str(_schema(folders["b"], tmp_path, 99))],
    }.get(case)
    if case == "damaged":
        copy = tmp_path / "damaged"
        shutil.copytree(folders["b"], copy)
        text = (copy / "summary.csv").read_text()
        (copy / "summary.csv").write_text(text[: len(text) // 2])
        args = [a, str(copy)]
    rc, stdout, err = _main(["compare", *args, "-o", str(tmp_path / "out")])
    assert rc == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfrag: error: ") and expected in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("version", ["list", 1])
def test_an_older_schema_is_translated_not_refused(folders, tmp_path, version):
    """A folder of an older schema (0: summary.json a bare list) compares with a current one:
    its columns are read under the current names (the full translation of a schema-1 folder:
    test_schema.py), and the comparison says so in a note."""
    old = _schema(folders["b"], tmp_path, version)
    rc, out, err = _main(["compare", str(folders["a"]), str(old), "--json"])
    assert rc == 0, err
    doc = json.loads(out)
    number = 0 if version == "list" else version
    assert [f["schema_version"] for f in doc["folders"]] == [SCHEMA_VERSION, number]
    assert any(f"schema_version {number}" in n for n in doc["notes"])
    rc, same, _ = _main(["compare", str(folders["a"]), str(folders["b"]), "--json"])
    assert rc == 0 and json.loads(same)["rows"] == doc["rows"]
