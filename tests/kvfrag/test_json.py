"""`--json` on run, trace stats and validate; summary.json's schema version; and the data
dictionary (docs/data-dictionary.md), held to the columns a real run writes."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest

from kvfrag.cli import main
from kvfrag.results import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[2]
DICTIONARY = ROOT / "docs" / "data-dictionary.md"
TINY = str(ROOT / "scenarios" / "validate-tiny.yaml")
SMALL = ["--set", "kv_budget=4MiB", "--set", "workload.transforms.first_n=40"]

# Every kind of summary column: slabs, paged blocks and prefix caching (its own columns), on a
# workload with shared prefixes, swept over one key (its own column).
SCENARIO = """\
name: json-tiny
model: {name: tiny, layers: 2, kv_heads: 2, head_dim: 64}
kv_budget: 4MiB
max_model_len: 2048
workload:
  synthetic:
    count: 60
    prompt: {kind: lognormal, mean: 300, p99: 1200}
    output: {kind: lognormal, mean: 100, p99: 400}
    shared_prefix: {tokens: 256, groups: 2, chunk_tokens: 16}
    arrival: {kind: poisson, rate: 20}
  transforms: {max_model_len: 2048, long_requests: clip}
  seed: 3
engine:
  max_num_seqs: 32
  max_num_batched_tokens: 2048
  chunked_prefill: true
  step_time: {base_s: 0.01, per_batched_token_s: 0.0001, per_kv_token_s: 5.0e-8}
allocators:
  - {label: slab-oracle, kind: contiguous, reserve: oracle}
  - {label: paged-16, kind: paged, block_size: 16}
  - {label: cached-16, kind: prefix-caching, block_size: 16}
sweep:
  engine.max_num_seqs: [16, 32]
"""
SWEEP_KEYS = ["engine.max_num_seqs"]


def _strict(text: str):
    """json.loads that refuses the NaN / Infinity tokens Python's json would accept."""

    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict, str]:
    """A swept run with --json (and progress and notes, which must stay off stdout)."""
    base = tmp_path_factory.mktemp("json")
    scenario = base / "json-tiny.yaml"
    scenario.write_text(SCENARIO)
    out = base / "r"
    rc, stdout, stderr = _main(["run", str(scenario), "-o", str(out), "--no-plots", "--json",
                                "-j", "1"])
    assert rc == 0, stderr
    return out, _strict(stdout), stderr


def _same(csv_value, json_value) -> bool:
    if isinstance(csv_value, float) and math.isnan(csv_value):
        return json_value is None or json_value == ""  # (an empty cell: NaN, or empty text)
    if isinstance(csv_value, float):
        return isinstance(json_value, int | float) and json_value == pytest.approx(csv_value,
                                                                                   rel=1e-15)
    if isinstance(csv_value, bool | int):
        return json_value == csv_value
    return str(json_value) == str(csv_value)


def test_run_json_is_the_summary(run):
    out, doc, stderr = run
    assert list(doc) == ["schema_version", "scenario", "results_dir", "runs", "failures"]
    assert doc["schema_version"] == SCHEMA_VERSION == 2
    assert doc["scenario"] == "json-tiny" and doc["results_dir"] == str(out)
    assert doc["failures"] == []
    assert "wrote" in stderr and "workload:" in stderr  # notes on stderr, not in the JSON
    summary = pd.read_csv(out / "summary.csv")
    assert len(doc["runs"]) == len(summary) == 6
    options = [c for c in summary.columns if c.startswith("option.")]
    assert options == ["option.block_size", "option.reserve"]  # sorted, where `options` is
    for row, rec in zip(doc["runs"], summary.to_dict("records"), strict=True):
        # The JSON's `options` object stands where the CSV's option columns are.
        at = list(summary.columns).index(options[0])
        expected = [*summary.columns[:at], "options", *summary.columns[at + len(options):]]
        assert list(row) == expected
        for col in options:  # an empty cell: the allocator has no such option
            key = col.removeprefix("option.")
            assert row["options"].get(key) == (None if pd.isna(rec[col]) else rec[col])
        bad = {k: (v, row[k]) for k, v in rec.items() if k not in options
               and not _same(v, row[k])}
        assert not bad
    assert {r["label"]: r["options"] for r in doc["runs"][:3]} == {
        "slab-oracle": {"reserve": "oracle"}, "paged-16": {"block_size": 16},
        "cached-16": {"block_size": 16}}
    # NaN is null: the prefix-caching columns of the other allocators' rows, for one.
    paged = next(r for r in doc["runs"] if r["label"] == "paged-16")
    assert paged["prefix_hit_blocks"] is None
    cached = next(r for r in doc["runs"] if r["label"] == "cached-16")
    assert cached["prefix_hit_blocks"] > 0


def test_summary_json_has_the_schema_version(run):
    out, doc, _ = run
    written = _strict((out / "summary.json").read_text())
    assert list(written) == ["schema_version", "scenario", "runs"]
    assert written["schema_version"] == SCHEMA_VERSION
    assert written == {k: doc[k] for k in ("schema_version", "scenario", "runs")}


def test_without_json_the_table_is_printed(run, tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO.split("sweep:")[0])
    rc, stdout, _ = _main(["run", str(scenario), "-o", str(tmp_path / "r"), "--no-plots",
                           "-j", "1"])
    assert rc == 0 and "cached-16" in stdout and "wrote" in stdout
    with pytest.raises(ValueError):
        json.loads(stdout)
    rc, stdout, _ = _main(["run", str(scenario), "-o", str(tmp_path / "r"), "--no-plots",
                           "-j", "1", "-q", "--json"])
    assert rc == 0 and len(_strict(stdout)["runs"]) == 3  # -q silences stderr, not the JSON


def _run_failing_sweep(tmp_path, monkeypatch, sweep: str) -> dict:
    """`run --json` of a tiny scenario whose second point fails while it runs (`sweep`: the
    sweep's one line); the exit status is the same with --json. (A point whose input is bad,
    a missing trace, refuses the whole run before any point runs: test_sweep.py.)"""
    import kvfrag.sim.sweep

    real = kvfrag.sim.sweep.run_task

    def run_task(task, *args):
        if task.point == 1:
            raise RuntimeError("the allocator broke at point 1")
        return real(task, *args)

    monkeypatch.setattr(kvfrag.sim.sweep, "run_task", run_task)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(
        "model: {name: tiny, layers: 2, kv_heads: 2, head_dim: 64}\nkv_budget: 4MiB\n"
        "max_model_len: 2048\nworkload:\n  trace: {path: 'sample:azure-conv'}\n"
        "  transforms: {first_n: 20, max_model_len: 2048, long_requests: clip}\n"
        "allocators:\n  - {label: paged-16, kind: paged, block_size: 16}\n"
        f"sweep:\n  {sweep}\n"
    )
    rc, stdout, stderr = _main(["run", "s.yaml", "-o", "r", "--no-plots", "--json", "-j", "1"])
    assert rc == 1, stderr
    return _strict(stdout)


def test_run_json_lists_the_failures(tmp_path, monkeypatch):
    doc = _run_failing_sweep(
        tmp_path, monkeypatch, "workload.trace.path: ['sample:azure-conv', 'sample:azure-code']"
    )
    assert [r["point"] for r in doc["runs"]] == [0]
    failures = pd.read_csv(tmp_path / "r" / "failures.csv").to_dict("records")
    assert doc["failures"] == failures and "the allocator broke" in failures[0]["error"]


def test_run_json_failures_hold_a_swept_mapping_native(tmp_path, monkeypatch):
    doc = _run_failing_sweep(
        tmp_path, monkeypatch,
        "workload.trace: [{path: 'sample:azure-conv'}, {path: 'sample:azure-code'}]",
    )
    [failure] = doc["failures"]
    assert failure["workload.trace"] == {"path": "sample:azure-code"}
    [row] = pd.read_csv(tmp_path / "r" / "failures.csv").to_dict("records")
    assert json.loads(row["workload.trace"]) == {"path": "sample:azure-code"}  # (CSV: text)
    assert {k: v for k, v in failure.items() if k != "workload.trace"} == {
        k: v for k, v in row.items() if k != "workload.trace"
    }


def test_trace_stats_json():
    from kvfrag.workloads import load_trace
    from kvfrag.workloads.stats import trace_stats

    rc, stdout, stderr = _main(["trace", "stats", "sample:azure-conv", "--json"])
    assert rc == 0, stderr
    doc = _strict(stdout)
    stats = trace_stats(load_trace("sample:azure-conv"))
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["rows"] == stats.rows == 2000
    assert doc["span_s"] == stats.span_s and doc["mean_rate"] == stats.mean_rate
    assert doc["prompt"]["p99"] == stats.prompt.p99 and doc["output"]["max"] == stats.output.max
    assert doc["prefix_reuse"] is None and doc["notes"] == []
    rc, stdout, _ = _main(["trace", "stats", "sample:mooncake-conv", "--json"])
    reuse = _strict(stdout)["prefix_reuse"]
    assert rc == 0 and set(reuse) == {"blocks", "prompt_tokens"} and 0 < reuse["blocks"] < 1


def test_trace_stats_json_without_arrivals_and_with_a_plot(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_tokens,output_tokens\n10,5\n20,7\n30,9\n")
    png = tmp_path / "t.png"
    rc, stdout, stderr = _main(["trace", "stats", str(trace), "--json", "--plot", str(png)])
    assert rc == 0 and png.is_file()
    doc = _strict(stdout)  # stdout is the JSON alone: the plot's line went to stderr
    assert "plot written" in stderr
    assert doc["span_s"] is doc["mean_rate"] is doc["interarrival_cv"] is None
    assert doc["prompt"]["max"] == 30 and len(doc["notes"]) == 1


def test_validate_json(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "report"
    rc, stdout, stderr = _main(["validate", TINY, "--device", "cpu", *SMALL, "--checkpoints",
                                "8", "-o", str(out), "--json"])
    assert rc == 0, stderr
    doc = _strict(stdout)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["scenario"] == "validate-tiny"
    assert doc["verdict"] == "pass" and doc["failed"] == 0 and doc["report_dir"] == str(out)
    written = json.loads((out / "validate.json").read_text())
    assert written == {"schema_version": SCHEMA_VERSION, "scenario": "validate-tiny",
                       "rows": doc["rows"]}
    paged = next(r for r in doc["rows"] if r["label"] == "paged-16")
    assert {"token_states_bytes_pred", "token_states_bytes_meas", "free_bytes_abs_err",
            "allocated_bytes_tol"} <= set(paged)
    assert not {"token_states_pred", "free_pred"} & set(paged)  # (bytes say so)
    # torch-caching is skipped on cpu: counted as skipped, neither ok nor a failure
    skipped = [r for r in doc["rows"] if r["status"] == "skip"]
    assert [r["kind"] for r in skipped] == ["torch-caching"]
    assert doc["skipped"] == 1 and doc["ok"] == len(doc["rows"]) - 1 == 4
    assert "paged-16 [paged]: pass" in stderr


def test_validate_json_fail_verdict(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import kvfrag.validate.replay as replay

    real = replay.MemoryReplay.count

    def off_by_one(self):
        tokens, held, free = real(self)
        return tokens + 1, held - 1, free

    monkeypatch.setattr(replay.MemoryReplay, "count", off_by_one)
    rc, stdout, _ = _main(["validate", TINY, *SMALL, "--mode", "paged", "--checkpoints", "5",
                           "-o", str(tmp_path / "r"), "--json", "-q"])
    doc = _strict(stdout)
    assert rc == 1 and doc["verdict"] == "fail" and doc["failed"] == 1
    assert doc["rows"][0]["status"] == "fail"


# ---------------------------------------------------------------- the data dictionary
def _dictionary() -> dict[str, list[str]]:
    """The names in the first column of each section's tables, by the section's (## heading's)
    first `code` word: a file name, or a command."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in DICTIONARY.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            code = re.search(r"`([^`]+)`", line)
            current = code.group(1) if code else None
            if current is not None:
                sections[current] = []
        elif line.startswith("|") and current is not None:
            cell = line.strip("|").split("|")[0].strip()
            if re.fullmatch(r"`[^`]+`", cell):
                sections[current].append(cell.strip("`"))
    return sections


def _listed(name: str) -> list[str]:
    names = _dictionary()[name]
    assert len(names) == len(set(names)), f"{name}: a column listed twice"
    return names


def test_dictionary_lists_every_column_a_run_writes(run):
    out, doc, _ = run
    summary = pd.read_csv(out / "summary.csv")
    columns = list(summary.columns)
    # The swept keys sit between `point` and `model`, named after the keys; the option columns
    # (one per option key the scenario's allocators set) after the engine's figures.
    assert columns[columns.index("point") + 1:columns.index("model")] == SWEEP_KEYS
    options = ["option.block_size", "option.reserve"]
    at = columns.index("events") + 1
    assert columns[at:at + len(options)] == options
    # (the spec_* columns exist only with engine.speculative: tests/sim/test_speculative_engine)
    listed = {c for c in _listed("summary.csv") if not c.startswith("spec_")}
    assert listed == set(columns) - set(SWEEP_KEYS) - set(options)
    optional = {"slab_offsets_bytes", "slab_move_t_s", "slab_move_offset_bytes",
                "priority"}  # (when present)
    for name in ("timeseries.parquet", "requests.parquet"):
        columns = set(pd.read_parquet(out / name).columns)
        assert set(_listed(name)) - optional == columns - optional, name
    assert _listed("summary.json") == list(_strict((out / "summary.json").read_text()))
    assert _listed("kvfrag run --json") == list(doc)


def test_dictionary_lists_the_json_outputs(tmp_path):
    from kvfrag.validate_cmd import report_document

    rc, stdout, _ = _main(["trace", "stats", "sample:azure-conv", "--json"])
    assert rc == 0 and _listed("kvfrag trace stats --json") == list(_strict(stdout))
    assert _listed("kvfrag validate --json") == list(report_document("x", tmp_path, []))


def test_dictionary_states_the_schema_version():
    text = DICTIONARY.read_text(encoding="utf-8")
    assert f"now **{SCHEMA_VERSION}**" in text
