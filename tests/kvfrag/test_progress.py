"""Progress on long work (issue 17): the engine's callback, `kvfrag run`'s bar of requests
(moving within a run, in-process and from worker processes), the lines while results are
written and figures drawn, and `kvfrag validate`'s bar. None of it changes a result."""

from __future__ import annotations

import multiprocessing
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim import engine
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.geometry import preset
from kvfrag.sim.sweep import ProcessExecutor, SerialExecutor, build_workloads, plan

from kvfrag import run_cmd, sim
from kvfrag.cli import main
from kvfrag.config import load_scenario

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "scenarios" / "quickstart.yaml"
TINY = ROOT / "scenarios" / "validate-tiny.yaml"
CONFIG = EngineConfig(
    max_num_seqs=64,
    max_num_batched_tokens=4096,
    step_time=StepTime(base_s=0.01, per_batched_token_s=1e-4),
)
SCENARIO = """\
name: progress
model: llama-3-8b
kv_budget: 2GiB
max_model_len: 2048
workload:
  synthetic:
    count: 3000
    prompt: {kind: uniform, low: 50, high: 800}
    output: {kind: uniform, low: 20, high: 400}
    arrival: {kind: poisson, rate: 20}
  seed: 3
engine:
  step_time: {base_s: 0.01, per_batched_token_s: 0.0001}
allocators:
  - {label: paged, kind: paged, block_size: 16}
"""


def _workload(n: int = 2000, seed: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(20, 900, n)
    prompt[::97] = 5000  # over max_model_len: rejected, and counted as done all the same
    return pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.cumsum(rng.exponential(1 / 30, n)),
        "prompt_tokens": prompt,
        "output_tokens": rng.integers(1, 400, n),
    })


@pytest.fixture
def eager(monkeypatch):
    """Progress at every turn of the engine's loop, and a bar that redraws at every update."""
    monkeypatch.setattr(engine, "PROGRESS_TURNS", 1)
    monkeypatch.setattr(engine, "PROGRESS_S", 0.0)
    monkeypatch.setattr(sim.sweep, "PROGRESS_S", 0.005)  # how often workers' counters are read
    base = run_cmd.bar_class()

    class Eager(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, mininterval=0, miniters=1, **kwargs)

    monkeypatch.setattr(run_cmd, "bar_class", lambda: Eager)


# ------------------------------------------------------------------------ the engine
def _allocator():
    geo = preset("llama-3-8b")
    return make_allocator("paged", capacity=1 << 30, bytes_per_token=geo.bytes_per_token,
                          max_model_len=2048, geometry=geo, block_size=16)


def test_engine_progress_counts_up_to_the_total_and_changes_nothing(eager):
    workload = _workload()
    calls: list[tuple[int, int]] = []
    plain = run(workload, _allocator(), CONFIG)
    watched = run(workload, _allocator(), CONFIG, lambda done, total: calls.append((done, total)))
    assert len(calls) > 10
    assert {total for _, total in calls} == {len(workload)}
    done = [d for d, _ in calls]
    assert done == sorted(done) and 0 < done[len(done) // 2] < len(workload)
    assert calls[-1] == (len(workload), len(workload))
    assert plain.summary == watched.summary
    for name in ("requests", "timeseries"):
        pd.testing.assert_frame_equal(getattr(plain, name), getattr(watched, name))
    assert (plain.requests["status"] == "rejected").sum() > 0


def test_engine_progress_is_throttled_by_the_clock():
    calls = []
    run(_workload(), _allocator(), CONFIG, lambda done, total: calls.append(done))
    assert calls[-1] == 2000 and len(calls) <= 5  # a run of a fraction of a second


# ------------------------------------------------------------------------ executors
@pytest.fixture
def tasks(tmp_path, monkeypatch):
    """Two tasks of 3,000 requests; forked workers inherit this process's patches."""
    monkeypatch.setattr(sim.sweep, "_mp_context", lambda: multiprocessing.get_context("fork"))
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO + "  - {label: slab, kind: contiguous, reserve: max_model_len}\n")
    loaded = load_scenario(path)
    todo = plan(loaded.scenario)
    built, _ = build_workloads(todo, loaded.base_dir)
    return todo, {key: w.requests for key, w in built.items()}


@pytest.mark.parametrize("executor", [SerialExecutor, lambda: ProcessExecutor(2)])
def test_executors_report_progress_within_points(tasks, eager, executor):
    todo, frames = tasks
    seen: dict[str, list[int]] = {t.label: [] for t in todo}
    over: list[str] = []

    def progress(task, done):
        assert task.label not in over  # nothing after its outcome
        seen[task.label].append(done)

    outcomes = {o.task.label: o for o in executor().map(todo, frames, progress)}
    for outcome in outcomes.values():
        over.append(outcome.task.label)
    plain = {o.task.label: o for o in SerialExecutor().map(todo, frames)}
    for label, counts in seen.items():
        assert counts == sorted(counts) and any(0 < c < 3000 for c in counts), (label, counts)
        assert outcomes[label].result.summary == plain[label].result.summary


# ------------------------------------------------------------------------ kvfrag run
def _bar_states(err: str) -> list[tuple[int, str]]:
    """(percent, runs status) of every state the bar was drawn in."""
    return [(int(p), s) for p, s in re.findall(r"(\d+)%\|[^\r\n]*?\[[^\]]*?(runs [^\]]*)\]", err)]


def test_a_single_run_shows_progress_within_the_run(tmp_path, eager, capsys):
    scenario = tmp_path / "progress.yaml"
    scenario.write_text(SCENARIO)
    assert main(["run", str(scenario), "-o", str(tmp_path / "r"), "--no-plots", "-j", "1"]) == 0
    states = _bar_states(capsys.readouterr().err)
    within = {p for p, s in states if 0 < p < 100 and s.startswith("runs done=0/1 running=1")}
    assert len(within) >= 3, states  # more than a start and an end
    assert states[-1] == (100, "runs done=1/1 running=0 failed=0")


def test_a_parallel_run_shows_progress_within_its_runs(tmp_path, eager, capsys, monkeypatch):
    monkeypatch.setattr(sim.sweep, "_mp_context", lambda: multiprocessing.get_context("fork"))
    scenario = tmp_path / "progress.yaml"
    scenario.write_text(SCENARIO + "  - {label: paged-32, kind: paged, block_size: 32}\n")
    assert main(["run", str(scenario), "-o", str(tmp_path / "r"), "--no-plots", "-j", "2"]) == 0
    states = _bar_states(capsys.readouterr().err)
    assert any(0 < p < 50 and s.startswith("runs done=0/2") for p, s in states), states
    assert states[-1] == (100, "runs done=2/2 running=0 failed=0")


def test_writing_and_drawing_are_told_unless_quiet(tmp_path, capsys):
    args = ["run", str(QUICK), "-j", "1", "--set", "workload.transforms.first_n=30"]
    assert main([*args, "-o", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"writing {re.escape(str(tmp_path / 'r'))}/ \.\.\. \d+\.\d s\n", err)
    assert re.search(r"drawing the figures in .*/plots/ \.\.\. 5 figure\(s\), \d+\.\d s\n", err)
    assert "runs done=4/4" in err
    assert main([*args, "-o", str(tmp_path / "q"), "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_ctrl_c_inside_a_run_stops_it_cleanly(tmp_path, eager, monkeypatch, capsys):
    def interrupted(self, task, done):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_cmd._RequestCounts, "running", interrupted)
    scenario = tmp_path / "progress.yaml"
    scenario.write_text(SCENARIO)
    assert main(["run", str(scenario), "-o", str(tmp_path / "r"), "--no-plots", "-j", "1"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------ kvfrag validate
def test_validate_shows_a_bar(tmp_path, capsys):
    pytest.importorskip("torch")
    args = ["validate", str(TINY), "--mode", "arena", "--checkpoints", "3",
            "--set", "workload.transforms.first_n=40"]
    assert main([*args, "-o", str(tmp_path / "v")]) == 0
    err = capsys.readouterr().err
    assert re.search(r"100%\|[^\r\n]*\| 3/3 ", err), err
    assert "slab-oracle [arena]: replaying" in err and "  orca-pow2 [arena]: pass\n" in err
    assert main([*args, "-o", str(tmp_path / "q"), "-q"]) == 0
    assert capsys.readouterr().err == ""
