"""`kvfrag plan` end to end on a tiny synthetic workload: the answer, the folder, resume, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from kvfrag.sim.scenario_run import run

from kvfrag import plan_cmd
from kvfrag.cli import main
from kvfrag.config import load_scenario
from kvfrag.outdir import MANIFEST

SCENARIO = """\
name: tiny
model: llama-3-8b
kv_budget: 256MiB
max_model_len: 2048
workload:
  synthetic:
    count: 40
    prompt: {kind: uniform, low: 100, high: 400}
    output: {kind: uniform, low: 20, high: 60}
    arrival: {kind: poisson, rate: 2}
  seed: 3
engine:
  max_num_seqs: 32
  step_time: {base_s: 0.01, per_batched_token_s: 0.00002}
allocators:
  - {label: paged-16, kind: paged, block_size: 16}
  - {label: slab-max, kind: contiguous, reserve: max_model_len}
"""
TARGET = ["--ttft-p99", "500ms"]


@pytest.fixture
def scenario(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    return path


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("plan")
    (folder / "s.yaml").write_text(SCENARIO)
    out = folder / "out"
    assert main(["plan", str(folder / "s.yaml"), *TARGET, "-o", str(out), "-q", "-j", "1"]) == 0
    return out


def point(path: Path, rate: float):
    return load_scenario(path, [f"workload.synthetic.arrival.rate={rate!r}"]).scenario


def test_the_answer_holds_and_the_rate_just_above_does_not(planned):
    """Checked by runs of the plain simulator at the answer and at the bracket's upper end."""
    answers = pd.read_csv(planned / "answer.csv")
    assert list(answers["label"]) == ["paged-16", "slab-max"]
    for _, row in answers.iterrows():
        assert row["status"] == "found" and row["best"]
        assert row["rate_req_s"] < row["fails_at_req_s"] <= row["rate_req_s"] * 1.02 + 1e-9
        for rate, holds in ((row["rate_req_s"], True), (row["fails_at_req_s"], False)):
            result = run(point(planned.parent / "s.yaml", rate))
            summary = result.summary().set_index("label").loc[row["label"]]
            assert (summary["p99_ttft_s"] <= 0.5 and summary["rejected"] == 0) == holds
            if holds:
                assert summary["p99_ttft_s"] == pytest.approx(row["p99_ttft_s"])
    # paged blocks fit far more requests than worst-case slabs of max_model_len
    rates = answers.set_index("label")["rate_req_s"]
    assert rates["paged-16"] > 2 * rates["slab-max"]


def test_every_probe_is_in_plan_csv(planned):
    probes = pd.read_csv(planned / "plan.csv")
    answers = pd.read_csv(planned / "answer.csv")
    for _, row in answers.iterrows():
        mine = probes[probes["label"] == row["label"]].sort_values("rate")
        assert len(mine) == row["probes"]
        assert 2.0 in set(mine["rate"])  # the scenario's own rate, where the search starts
        chosen = mine[mine["answer"]]
        assert len(chosen) == 1 and chosen["met"].all()
        assert chosen["rate_req_s"].iloc[0] == row["rate_req_s"]
        # met below the answer, failed above it, and the reason says why
        below = mine[mine["rate"] <= chosen["rate"].iloc[0]]
        above = mine[mine["rate"] > chosen["rate"].iloc[0]]
        assert below["met"].all() and not above["met"].any()
        assert above["why"].str.contains("p99 TTFT").all()
        # goodput never exceeds the throughput of the same run
        assert (mine["goodput_req_s"] <= mine["throughput_req_s"] + 1e-12).all()


def test_the_folder_is_kvfrags(planned):
    manifest = json.loads((planned / MANIFEST).read_text())
    assert manifest["written_by"] == "kvfrag plan"
    assert set(manifest["files"]) == {"plan.csv", "answer.csv", "plan.png", "plan.yaml",
                                      "scenario.resolved.yaml"}
    assert (planned / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    settings = yaml.safe_load((planned / "plan.yaml").read_text())
    assert settings["targets"] == {"ttft_p99_s": 0.5}
    assert settings["varies"] == "workload.synthetic.arrival.rate"
    assert yaml.safe_load((planned / "scenario.resolved.yaml").read_text())["name"] == "tiny"
    assert not (planned.parent / ".out.points").exists()  # staged runs go once written


def test_resume_reuses_the_runs_of_an_interrupted_plan(scenario, monkeypatch, capsys):
    original = plan_cmd._Plan._round
    calls = []

    def interrupted(self, executor, asks):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, executor, asks)

    monkeypatch.setattr(plan_cmd._Plan, "_round", interrupted)
    assert main(["plan", "s.yaml", *TARGET, "-j", "1"]) == 130
    assert "--resume" in capsys.readouterr().err
    staged = Path("results/.tiny-plan.points")
    assert len([p for p in staged.iterdir() if (p / "summary.json").is_file()]) == 4
    assert not Path("results/tiny-plan").exists()

    monkeypatch.setattr(plan_cmd._Plan, "_round", original)
    assert main(["plan", "s.yaml", *TARGET, "-j", "1", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "(4 reused)" in err
    resumed = pd.read_csv("results/tiny-plan/answer.csv")
    assert main(["plan", "s.yaml", *TARGET, "-j", "1", "-o", "fresh"]) == 0
    pd.testing.assert_frame_equal(resumed, pd.read_csv("fresh/answer.csv"))
    assert "reused" in capsys.readouterr().err and not staged.exists()


def test_workers_give_the_same_answer(scenario):
    assert main(["plan", "s.yaml", *TARGET, "-q", "-j", "1", "-o", "one"]) == 0
    assert main(["plan", "s.yaml", *TARGET, "-q", "-j", "2", "-o", "two"]) == 0
    pd.testing.assert_frame_equal(pd.read_csv("one/plan.csv"), pd.read_csv("two/plan.csv"))


def test_a_grid_names_the_best_setting_per_allocator(scenario, capsys):
    assert main(["plan", "s.yaml", *TARGET, "-j", "1", "--grid", "block_size=16,128",
                 "--no-plots"]) == 0
    answers = pd.read_csv("results/tiny-plan/answer.csv")
    paged = answers[answers["label"] == "paged-16"]
    assert sorted(paged["block_size"]) == [16, 128]
    assert answers.groupby("label")["best"].sum().to_dict() == {"paged-16": 1, "slab-max": 1}
    best = paged[paged["best"]].iloc[0]
    assert best["rate_req_s"] == paged["rate_req_s"].max()
    # slab-max takes no block size: searched once, with no setting
    assert answers[answers["label"] == "slab-max"]["block_size"].isna().all()
    assert "block_size=" in capsys.readouterr().out
    assert not Path("results/tiny-plan/plan.png").exists()


def test_never_overwrites_a_folder_it_did_not_write(scenario, capsys):
    mine = Path("mine")
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(["plan", "s.yaml", *TARGET, "-q", "-o", "mine"]) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(("args", "expected"), [
    ([], "give a latency target"),
    (["--ttft-p99", "2h"], "--ttft-p99: '2h' is not a duration"),
    (["--tpot-p90", "50"], "--tpot-p90: '50' is not a duration"),
    (["--ttft-p99", "0ms"], "must be above 0"),
    ([*TARGET, "--precision", "0"], "--precision"),
    ([*TARGET, "--grid", "block_sz=8"], "unknown name 'block_sz'"),
    ([*TARGET, "--grid", "block_size"], "write KEY=V1,V2"),
    ([*TARGET, "--grid", "block_size=8,[1]"], "is not a value"),
    ([*TARGET, "--grid", "workload.transforms.rate_scale=1,2"], "searches the arrival rate"),
    ([*TARGET, "--grid", "gpu_memory_utilization=0.8"], "gives kv_budget as a size"),
    ([*TARGET, "--grid", "max_num_seqs=0"], "engine.max_num_seqs"),
    ([*TARGET, "--set", "workload.synthetic.arrival={kind: at_once}"], "arrives at once"),
])
def test_bad_input_is_one_line_and_writes_nothing(scenario, capsys, args, expected):
    assert main(["plan", "s.yaml", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvfrag: error: "), err
    assert expected in err[0]
    assert not Path("results").exists()


def test_the_figure_has_a_panel_per_target(planned):
    from kvfrag.plan_plots import plan_figure
    from kvfrag.plan_search import Target

    probes = pd.read_csv(planned / "plan.csv")
    answers = pd.read_csv(planned / "answer.csv")
    targets = [Target("ttft", 99, 0.5), Target("tpot", 90, 0.05)]
    fig = plan_figure(probes, answers, targets, "workload.synthetic.arrival.rate")
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == ["p99 TTFT <= 500 ms", "p90 TPOT <= 50 ms"]
    for ax, target in zip(axes, targets, strict=True):
        assert target.seconds in [line.get_ydata()[0] for line in ax.get_lines()]  # the target
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels[:2] == ["paged-16", "slab-max"]


def test_targets_never_met_or_always_met_say_so(scenario, monkeypatch, capsys):
    import kvfrag.plan_search

    monkeypatch.setattr(kvfrag.plan_search, "MAX_STEPS", 3)  # (2**3 either way: quick)
    # one iteration takes 10 ms at least: a p50 TPOT of 5 ms is never met
    assert main(["plan", "s.yaml", "--tpot-p50", "5ms", "-j", "1", "-o", "never",
                 "--no-plots"]) == 0
    answers = pd.read_csv("never/answer.csv")
    assert (answers["status"] == "missed at every rate probed").all()
    assert answers["rate_req_s"].isna().all() and (answers["probes"] == 4).all()
    assert answers["fails_because"].str.startswith("p50 TPOT").all()
    assert "down to 0.25 req/s" in capsys.readouterr().out
    # a loose TPOT bound holds at any rate: the answer is a lower bound, and said to be
    assert main(["plan", "s.yaml", "--tpot-p99", "1s", "-j", "1", "-o", "above",
                 "--no-plots"]) == 0
    answers = pd.read_csv("above/answer.csv")
    assert (answers["status"] == "met at every rate probed").all()
    assert (answers["rate"] == 16).all()
    assert "add a TTFT target" in capsys.readouterr().out


def test_a_bad_trace_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("t.csv").write_text("prompt_tokens,output_tokens,arrival_s\n10,5,0\n10,x,1\n")
    text = SCENARIO.split("workload:")[0] + "workload:\n  trace: {path: t.csv}\nengine:\n" + \
        SCENARIO.split("engine:\n")[1]
    Path("t.yaml").write_text(text)
    assert main(["plan", "t.yaml", *TARGET]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "column output_tokens: 'x' is not a number" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv", "t.yaml"]


def test_plan_runs_skip_the_saturating_replay(scenario, monkeypatch):
    """The capacity replay answers another question at the cost of a second run: a plan's
    runs never make it."""
    import kvfrag.sim.capacity

    def replay(*args, **kwargs):
        raise AssertionError("a plan ran the saturating replay")

    monkeypatch.setattr(kvfrag.sim.capacity, "saturate", replay)
    assert main(["plan", "s.yaml", *TARGET, "-j", "1", "-q", "--no-plots"]) == 0
    assert pd.read_csv("results/tiny-plan/answer.csv")["status"].eq("found").all()
