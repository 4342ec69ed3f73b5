"""Parallel and resumable sweeps: every executor gives the plain serial run's files, byte for
byte; a killed sweep resumes with only its missing points; a failing point is reported and
leaves the others' results intact."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kvfrag.sim.sweep  # noqa: F401 (sim.sweep below: the CLI imports it only when it runs)
import pandas as pd
import pytest
from kvfrag.sim.scenario_run import run as run_serial

from kvfrag import sim
from kvfrag.cli import main
from kvfrag.config import load_scenario
from kvfrag.results import write_results

ROOT = Path(__file__).resolve().parents[2]

# 3 budgets (one repeated: same point twice) x 2 block sizes x 2 allocators = 12 runs.
SCENARIO = """\
name: tiny-sweep
model: llama-3-8b
kv_budget: 2GiB
max_model_len: 2048
workload:
  synthetic:
    count: 150
    prompt: {kind: uniform, low: 50, high: 800}
    output: {kind: uniform, low: 20, high: 400}
    arrival: {kind: poisson, rate: 20}
  seed: 3
engine:
  step_time: {base_s: 0.01, per_batched_token_s: 0.0001}
allocators:
  - {label: paged, kind: paged, block_size: 16}
  - {label: slab, kind: contiguous, reserve: max_model_len}
sweep:
  kv_budget: [1GiB, 2GiB, 1GiB]
  allocators.paged.block_size: [8, 32]
"""
RUN_TASK = sim.sweep.run_task
RUNS = 12
DISTINCT = 8  # the repeated budget's runs compute once
FILES = ("summary.csv", "summary.json", "scenario.resolved.yaml")


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("scenario") / "tiny-sweep.yaml"
    path.write_text(SCENARIO)
    return path


@pytest.fixture(scope="module")
def reference(scenario, tmp_path_factory) -> Path:
    """The results of the plain serial run (`sim.scenario_run.run`), as `kvfrag run` wrote them."""
    loaded = load_scenario(scenario)
    out = tmp_path_factory.mktemp("ref") / "tiny-sweep"
    write_results(run_serial(loaded.scenario, loaded.base_dir), out, loaded.resolved())
    return out


def _run(scenario: Path, out: Path, *args: str) -> int:
    return main(["run", str(scenario), "-o", str(out), "-q", "--no-plots", *args])


def _same_results(out: Path, ref: Path) -> None:
    for name in FILES:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    for name in ("timeseries.parquet", "requests.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(out / name), pd.read_parquet(ref / name))
    assert not (out / "failures.csv").exists()
    assert not (out.parent / f".{out.name}.points").exists()  # staging removed when complete


def _staging(out: Path) -> Path:
    return out.parent / f".{out.name}.points"


def _staged(out: Path) -> int:
    """Whole staged points (not the temporary folder of one being written)."""
    return sum(
        1
        for p in _staging(out).iterdir()
        if not p.name.startswith(".") and (p / "summary.json").is_file()
    )


def _counting(monkeypatch, fail=lambda n, task: None) -> list[str]:
    """Count runs of the point runner (in this process or forked workers started after)."""
    calls: list[str] = []
    real = RUN_TASK

    def counted(task, requests):
        calls.append(task.key)
        fail(len(calls), task)
        return real(task, requests)

    monkeypatch.setattr(sim.sweep, "run_task", counted)
    return calls


@pytest.mark.parametrize(
    ("command", "jobs"), [("run", "1"), ("run", "2"), ("sweep", "3")]  # 3: more than the cores
)
def test_local_executors_match_the_serial_run(scenario, reference, tmp_path, command, jobs):
    out = tmp_path / "r"
    assert main([command, str(scenario), "-o", str(out), "-q", "--no-plots", "-j", jobs]) == 0
    _same_results(out, reference)


def test_workload_is_built_once_per_sweep(scenario, tmp_path, monkeypatch):
    built = []
    real = sim.sweep.build_workload

    def counted(*args, **kwargs):
        built.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(sim.sweep, "build_workload", counted)
    assert _run(scenario, tmp_path / "r", "-j", "2") == 0
    assert len(built) == 1


def test_resume_after_an_interrupt_runs_only_the_missing_points(
    scenario, reference, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "r"

    def interrupt(n, task):
        if n == 5:
            raise KeyboardInterrupt

    _counting(monkeypatch, interrupt)
    assert _run(scenario, out, "-j", "1") == 130
    assert "--resume" in capsys.readouterr().err
    assert not out.exists() and _staged(out) == 4
    calls = _counting(monkeypatch)
    assert _run(scenario, out, "-j", "1", "--resume") == 0
    assert len(calls) == DISTINCT - 4
    _same_results(out, reference)


def test_resume_after_sigkill_of_a_parallel_sweep(scenario, reference, tmp_path, monkeypatch):
    out = tmp_path / "r"
    # ~0.2 s a point with the compiled engine (0.5 s pure): long enough to kill it mid-way
    slow = ["--set", "workload.synthetic.count=4000"]
    cmd = [sys.executable, "-m", "kvfrag.cli", "run", str(scenario), "-o", str(out), "-q",
           "--no-plots", "-j", "2", *slow]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if _staging(out).exists() and _staged(out) >= 2:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the sweep finished before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its workers, no clean-up
    finally:
        proc.wait()
    staged = _staged(out)
    assert 2 <= staged < DISTINCT and not out.exists()
    calls = _counting(monkeypatch)
    assert _run(scenario, out, "-j", "1", "--resume", *slow) == 0
    assert len(calls) == DISTINCT - staged
    assert pd.read_csv(out / "summary.csv")["point"].tolist() == [i // 2 for i in range(RUNS)]
    # The same as a fresh run.
    fresh = tmp_path / "fresh"
    assert _run(scenario, fresh, "-j", "2", *slow) == 0
    for name in FILES:
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name


def test_a_failing_point_leaves_the_others_intact(
    scenario, reference, tmp_path, monkeypatch, capsys
):
    # Forked workers run the patched runner; make sure the pool forks.
    monkeypatch.setattr(sim.sweep, "_mp_context", lambda: multiprocessing.get_context("fork"))

    def boom(n, task):
        if task.point == 3 and task.label == "slab":
            raise RuntimeError("boom")

    _counting(monkeypatch, boom)
    out = tmp_path / "r"
    assert _run(scenario, out, "-j", "2") == 1
    err = capsys.readouterr().err
    assert "point 3 (slab; kv_budget=2GiB, allocators.paged.block_size=32)" in err
    assert "RuntimeError: boom" in err
    failures = pd.read_csv(out / "failures.csv")
    assert failures[["point", "label", "kv_budget", "error"]].values.tolist() == [
        [3, "slab", "2GiB", "RuntimeError: boom"]
    ]
    summary = pd.read_csv(out / "summary.csv")
    expected = pd.read_csv(reference / "summary.csv")
    expected = expected[~((expected["point"] == 3) & (expected["label"] == "slab"))]
    pd.testing.assert_frame_equal(summary, expected.reset_index(drop=True))
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == (RUNS - 1) * 150
    assert _staged(out) == DISTINCT - 1  # kept, so that --resume retries only the failure

    calls = _counting(monkeypatch)
    assert _run(scenario, out, "-j", "2", "--resume") == 0
    assert len(calls) == 1  # (one point left runs in this process)
    _same_results(out, reference)


def test_resume_refuses_points_of_another_scenario(scenario, tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"

    def interrupt(n, task):
        if n == 3:
            raise KeyboardInterrupt

    _counting(monkeypatch, interrupt)
    assert _run(scenario, out, "-j", "1") == 130
    capsys.readouterr()
    assert _run(scenario, out, "-j", "1", "--resume", "--set", "max_model_len=4096") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different scenario (differs at max_model_len)" in err[0]
    assert _staged(out) == 2  # left as it was
    # Nor does it reuse points computed by other simulator code.
    import kvfrag.run_cmd

    monkeypatch.setattr(kvfrag.run_cmd, "code_fingerprint", lambda: "edited")
    assert _run(scenario, out, "-j", "1", "--resume") == 2
    assert "other simulator code" in capsys.readouterr().err
    monkeypatch.undo()
    # Without --resume the staged points are discarded and everything runs again.
    calls = _counting(monkeypatch)
    assert _run(scenario, out, "-j", "1") == 0
    assert len(calls) == DISTINCT


def test_a_workload_that_cannot_be_built_at_one_point_refuses_the_run(tmp_path, capsys):
    # A file named in a sweep value is bad input like a bad scenario: every point's workload is
    # built before any runs, and the run stops there (exit 2, one line, nothing written).
    path = tmp_path / "s.yaml"
    swept = (
        "  workload.synthetic.output:\n"
        "    - {kind: uniform, low: 20, high: 400}\n"
        "    - {kind: empirical, path: missing.csv}\n"
    )
    path.write_text(SCENARIO.replace("  allocators.paged.block_size: [8, 32]\n", swept))
    out = tmp_path / "r"
    assert _run(path, out, "-j", "2") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.csv" in err and "point 1" in err
    assert not out.exists() and not list(tmp_path.glob(".r.*"))


def test_bad_executor_arguments_are_one_line(scenario, tmp_path, capsys):
    assert _run(scenario, tmp_path / "r", "--address", "auto") == 2
    assert "--address is for --executor ray" in capsys.readouterr().err


@pytest.fixture(scope="module")
def ray_instance():  # skipped where Ray is not installed (pip install '.[ray]')
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_matches_the_serial_run(ray_instance, scenario, reference, tmp_path):
    out = tmp_path / "r"
    assert _run(scenario, out, "--executor", "ray") == 0
    _same_results(out, reference)
