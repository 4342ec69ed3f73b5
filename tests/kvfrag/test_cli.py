"""`kvfrag run` end to end, and its errors: one line, non-zero exit, nothing left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
import yaml

from kvfrag.cli import main
from kvfrag.outdir import register_nested, write_manifest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["token_states_frac", "reserved_frac", "internal_frac", "external_frac", "usable_free_frac"]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("results") / "quickstart"
    assert main(["run", str(ROOT / "scenarios" / "quickstart.yaml"), "-o", str(out), "-q"]) == 0
    return out


def test_run_writes_every_file(quickstart):
    for name in (
        "scenario.resolved.yaml",
        "summary.csv",
        "summary.json",
        "timeseries.parquet",
        "requests.parquet",
    ):
        assert (quickstart / name).stat().st_size > 0, name
    pngs = sorted((quickstart / "plots").glob("*.png"))
    svgs = sorted((quickstart / "plots").glob("*.svg"))
    assert len(pngs) >= 5 and not svgs  # SVG is opt-in: kvfrag run --svg
    for png in pngs:
        image = matplotlib.image.imread(png)
        assert image.std() > 0.01, png  # not a blank canvas


def test_summary_fractions_sum_to_one(quickstart):
    summary = pd.read_csv(quickstart / "summary.csv")
    assert list(summary["label"]) == ["slab-max", "orca-pow2", "slab-oracle", "paged-16"]
    required = {
        "label", "kind", "kv_utilization", "mean_running", "max_running", "completed",
        "rejected", "preemptions", "frag_refusals", "throughput_tok_s", "p50_latency_s",
        "p99_latency_s", *PARTS,
    }
    assert required <= set(summary.columns)
    assert (summary[PARTS].sum(axis=1) - 1).abs().max() < 1e-9
    assert (summary["completed"] == 1000).all()
    # The layouts order as expected: paged stores the most, worst-case slabs the least.
    by = summary.set_index("label")["token_states_frac"]
    assert by["paged-16"] > by["slab-oracle"] > by["slab-max"]
    assert summary.set_index("label").loc["slab-max", "max_running"] == 16
    records = json.loads((quickstart / "summary.json").read_text())["runs"]
    assert [r["label"] for r in records] == list(summary["label"])


def test_resolved_scenario_has_seed_and_version(quickstart):
    resolved = yaml.safe_load((quickstart / "scenario.resolved.yaml").read_text())
    assert resolved["kvfrag_version"]
    assert resolved["workload"]["seed"] == 0
    assert resolved["kv_budget"] == 16 * 2**30


def test_records_cover_every_run(quickstart):
    ts = pd.read_parquet(quickstart / "timeseries.parquet")
    req = pd.read_parquet(quickstart / "requests.parquet")
    assert set(ts["label"]) == set(req["label"]) == {
        "slab-max", "orca-pow2", "slab-oracle", "paged-16"
    }
    assert (req.groupby("label").size() == 1000).all()


def test_plot_redraws_from_files(quickstart, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(quickstart, copy)
    shutil.rmtree(copy / "plots")
    assert main(["plot", str(copy)]) == 0
    assert len(list((copy / "plots").glob("*.png"))) >= 5


def test_run_prints_a_summary_table(tmp_path, capsys):
    out = tmp_path / "r"
    scenario = ROOT / "scenarios" / "seed-slab-vs-paged.yaml"
    assert main(["run", str(scenario), "-o", str(out), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "slab-max" in printed and "paged-16" in printed
    summary = pd.read_csv(out / "summary.csv").set_index("label")
    assert summary.loc["slab-max", "max_running"] == 46
    assert summary.loc["paged-16", "max_running"] == 378
    # The seed's point as capacity: how many requests each holds when the queue never empties
    # (46 worst-case slabs of 1 GiB in 50 GB; 378 requests of 63 blocks of 2 MiB)
    assert summary.loc["slab-max", "capacity_requests"] == 46
    assert summary.loc["paged-16", "capacity_requests"] == 378
    assert (summary["capacity_memory_requests"] == summary["capacity_requests"]).all()
    header, slab, paged = printed.splitlines()[-4:-1]
    end = header.index(" capacity") + len(" capacity")  # (right-aligned under its header)
    assert slab[:end].split()[-1] == "46.0" and paged[:end].split()[-1] == "378.0"


SCENARIO = """\
model: llama-3-8b
kv_budget: 1GiB
max_model_len: 2048
workload:
  trace: {path: TRACE}
allocators:
  - {label: paged-16, kind: paged, block_size: 16}
"""


@pytest.mark.parametrize(
    ("text", "args", "expected"),
    [
        ("model: [broken\n", [], "malformed YAML"),
        (SCENARIO.replace("kind: paged", "kind: pagd"), [], "unknown allocator kind 'pagd'"),
        (SCENARIO, ["--set", "kv_budget"], "write key=value"),
        (SCENARIO, ["--set", "allocators.paged-8.block_size=8"], "no allocator labelled"),
        (SCENARIO.replace("TRACE", "missing.csv"), [], "missing.csv"),
    ],
)
def test_errors_are_one_line_and_leave_nothing(tmp_path, monkeypatch, capsys, text, args, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(text.replace("TRACE", "sample:azure-conv"))
    assert main(["run", "s.yaml", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvfrag: error: ") and expected in err[0]
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_failure_while_writing_leaves_no_half_folder(tmp_path, monkeypatch):
    import kvfrag.plots

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(kvfrag.plots, "plot_results", broken)
    out = tmp_path / "results" / "quickstart"
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["run", str(ROOT / "scenarios" / "quickstart.yaml"), "-o", str(out), "-q",
              "--set", "workload.transforms.first_n=50"])
    # No half-written results folder; the finished points stay staged for --resume.
    assert [p.name for p in (tmp_path / "results").iterdir()] == [".quickstart.points"]


def test_a_new_run_keeps_the_validation_report(tmp_path):
    out = tmp_path / "results" / "quickstart"
    args = ["run", str(ROOT / "scenarios" / "quickstart.yaml"), "-o", str(out), "-q",
            "--no-plots", "--set", "workload.transforms.first_n=30"]
    assert main(args) == 0
    report = out / "validate" / "validate.csv"
    report.parent.mkdir()
    report.write_text("label,status\npaged-16,pass\n")
    write_manifest(report.parent, "kvfrag validate")  # as `kvfrag validate` leaves it:
    register_nested(report.parent)  # a report the run folder's manifest names
    (out / "summary.csv").write_text("stale")
    assert main(args) == 0
    assert report.read_text() == "label,status\npaged-16,pass\n"  # carried over
    assert (out / "summary.csv").read_text() != "stale"  # the run's own files are new


def test_the_command_line_loads_no_simulator_for_help():
    """`kvfrag --help` and argument errors answer before pandas, pydantic or the simulator
    load (bench/startup.py measures the time)."""
    import subprocess
    import sys

    code = (
        "import sys, kvfrag.cli; kvfrag.cli.build_parser(); "
        "heavy = [m for m in ('pandas', 'pydantic', 'numpy', 'kvfrag.sim.engine', 'matplotlib') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
