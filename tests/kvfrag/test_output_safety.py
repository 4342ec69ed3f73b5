"""kvfrag never loses a file it did not write, never mixes stale results, and says why.

Real files that must survive `-o`, a real second process holding the lock, real signals, a
trace edited between an interrupted run and its `--resume`.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import kvfrag.sim.sweep
import pandas as pd
import pytest

import kvfrag.results
from kvfrag import outdir, sim
from kvfrag.cli import main
from kvfrag.outdir import MANIFEST, write_manifest

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "scenarios" / "quickstart.yaml"
TINY = ROOT / "scenarios" / "validate-tiny.yaml"
VALIDATE = ["--mode", "arena", "--set", "workload.transforms.first_n=20", "--set",
            "allocators=[{label: slab, kind: contiguous, reserve: oracle}]", "--checkpoints", "3"]
FAST = ["--set", "workload.transforms.first_n=30", "--no-plots", "-q", "-j", "1"]
TRACE_SCENARIO = """\
name: edited
model: llama-3-8b
kv_budget: 4GiB
max_model_len: 8192
workload:
  trace: {path: trace.csv}
allocators:
  - {label: paged, kind: paged, block_size: 16}
  - {label: slab, kind: contiguous, reserve: oracle}
"""


def _run(out: Path | str, *extra: str, scenario: Path = QUICK) -> int:
    return main(["run", str(scenario), "-o", str(out), *FAST, *extra])


def _siblings(folder: Path) -> list[str]:
    """What a run left beside its results folder (lock, staging, temporaries)."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}"))


# ------------------------------------------------------------------------ refusals
def test_a_users_folder_survives_and_nothing_is_written(tmp_path, capsys):
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "thesis.tex").write_text("draft")
    assert _run(mine) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(mine) in err and "thesis.tex" in err
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]
    assert (mine / "thesis.tex").read_text() == "draft"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mydata"]  # no lock, no staging


def test_the_current_folder_and_its_scenario_survive(tmp_path, monkeypatch, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(QUICK.read_text())
    monkeypatch.chdir(tmp_path)
    for target in (".", str(tmp_path)):
        assert _run(target, scenario=scenario) == 2
        assert "holds files kvfrag did not write" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]


def test_the_results_root_is_not_a_results_folder(tmp_path, capsys):
    root = tmp_path / "results"
    assert _run(root / "a") == 0 and _run(root / "b") == 0
    (root / "README.md").write_text("ours")
    assert _run(root) == 2  # would delete every other scenario's results
    assert sorted(p.name for p in root.iterdir()) == ["README.md", "a", "b"]
    assert "README.md" in capsys.readouterr().err


def test_an_existing_file_is_refused_not_renamed(tmp_path, capsys):
    target = tmp_path / "report.txt"
    target.write_text("keep")
    assert _run(target) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.txt"]
    assert target.read_text() == "keep"


def test_a_symbolic_link_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert _run(tmp_path / "link") == 2
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("name", ["..", "../src", "", ".", "a/b"])
def test_a_scenario_name_is_one_path_component(tmp_path, monkeypatch, capsys, name):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "code.py").write_text("x = 1")
    work = tmp_path / "work"
    (work / "results").mkdir(parents=True)
    monkeypatch.chdir(work)
    args = ["run", str(QUICK), *FAST, "--set", f"name={name}"]
    assert main(args) == 2
    assert "name" in capsys.readouterr().err
    assert (tmp_path / "src" / "code.py").read_text() == "x = 1"
    assert list((work / "results").iterdir()) == []


# ------------------------------------------------------------------------ replacing
def test_a_rerun_replaces_its_own_folder_but_not_added_files(tmp_path, capsys):
    out = tmp_path / "r"
    assert _run(out) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert "summary.csv" in manifest["files"] and manifest["written_by"] == "kvfrag run"
    assert _run(out) == 0
    (out / "notes.md").write_text("my notes")
    assert _run(out) == 2
    assert "notes.md" in capsys.readouterr().err
    assert (out / "notes.md").read_text() == "my notes"
    (out / "notes.md").unlink()
    assert _run(out) == 0
    assert _siblings(out) == []  # lock, staging and temporaries all gone


def test_an_empty_folder_is_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert _run(out) == 0
    assert (out / "summary.csv").is_file()


def test_a_folder_without_a_manifest_is_not_taken_for_results(tmp_path, capsys):
    """Results folders were once recognised by their file names; no more: the names prove
    nothing (a copy of results the user edited, a folder of theirs laid out alike), only a
    manifest does."""
    out = tmp_path / "old"
    assert _run(out) == 0
    (out / MANIFEST).unlink()  # as earlier kvfrag versions left it
    before = sorted(p.name for p in out.iterdir())
    assert _run(out) == 2
    assert "summary.csv" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before


# ------------------------------------------------------------------------ locking
HOLDER = """\
import sys
from pathlib import Path
from kvfrag.outdir import locked
with locked(Path(sys.argv[1]), "test holder"):
    print("locked", flush=True)
    sys.stdin.read()
"""


def _hold(target: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(target)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def _release(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_second_process_holding_the_lock_stops_a_run(tmp_path, capsys):
    out = tmp_path / "r"
    holder = _hold(out)
    try:
        assert _run(out) == 4
        err = capsys.readouterr().err
        assert f"process {holder.pid} (test holder" in err and "--wait" in err
        assert not out.exists()
        args = ["validate", str(TINY), "-o", str(out / "validate"), "-q", *VALIDATE]
        assert main(args) == 4  # a report into a run folder takes the run folder's lock
    finally:
        _release(holder)
    assert _run(out) == 0


HOLD_AND_FORK = """
import os, signal, sys, time
from kvfrag import outdir
with outdir.locked(outdir.Path(sys.argv[1]), "test holder"):
    child = os.fork()
    if child == 0:  # a worker that outlives its parent for a while (not on its pipes)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no release
"""


def test_a_killed_holder_frees_the_folder_though_its_child_lives(tmp_path):
    out = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-c", HOLD_AND_FORK, str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout)
    try:
        os.kill(child, 0)  # (still there, with its copy of the lock's descriptor closed)
        with outdir.locked(out, "test"):
            pass
    finally:
        os.kill(child, signal.SIGKILL)


def test_wait_takes_the_lock_when_it_is_released(tmp_path):
    out = tmp_path / "r"
    holder = _hold(out)
    cmd = [sys.executable, "-m", "kvfrag.cli", "run", str(QUICK), "-o", str(out), *FAST,
           "--wait"]
    waiter = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert waiter.stderr is not None
    said: list[str] = []
    heard = threading.Event()  # it said it waits, or it ended
    message = f"waiting for process {holder.pid}"

    def listen() -> None:  # (its start-up is slow on a loaded machine: wait for its word)
        for line in waiter.stderr:
            said.append(line)
            if message in line:
                heard.set()
        heard.set()

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        assert heard.wait(timeout=120) and any(message in line for line in said), (
            f"did not wait: {''.join(said)}"
        )
        assert waiter.poll() is None and not out.exists()
    finally:
        _release(holder)
    assert waiter.wait(timeout=120) == 0, "".join(said)
    listener.join(timeout=30)
    assert (out / "summary.csv").is_file() and _siblings(out) == []


def _killed_temporary(target: Path, name: str) -> Path:
    """A temporary of `target` as a killed writer leaves it (marked by kvfrag), renamed to
    `name` (as `.old-` ones are)."""
    tmp = outdir.temp_dir(target)
    (tmp / "summary.csv").write_text("half")
    return tmp.rename(tmp.with_name(name))


def test_stale_temporaries_of_a_killed_run_are_removed(tmp_path):
    """Only marked temporaries of this very folder go; a look-alike name proves nothing."""
    out = tmp_path / "r"
    stale = [_killed_temporary(out, ".r.tmp-abcd_123"), _killed_temporary(out, ".r.old-zz9yx8w7")]
    others = [tmp_path / ".r2.tmp-abcd_123", tmp_path / ".rtmp-abcd1234", tmp_path / "r.tmp-x",
              tmp_path / ".r.tmp-unmarked"]  # (the user's, whatever their names)
    for folder in others:
        folder.mkdir()
        (folder / "summary.csv").write_text("half")
    others.append(_killed_temporary(tmp_path / "r2", ".r2.tmp-abcdefgh"))  # another folder's
    assert _run(out) == 0
    assert not any(p.exists() for p in stale)
    assert all((p / "summary.csv").exists() for p in others)  # not ours to remove
    report = _killed_temporary(out / "validate", ".validate.tmp-k1ll3d_x")  # a killed validate
    assert _run(out) == 0
    assert not report.exists()


# ------------------------------------------------------------------------ signals
def test_sigterm_while_writing_leaves_no_temporary(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"

    def terminated(folder, meta, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends

    monkeypatch.setattr("kvfrag.plots.plot_results", terminated)
    args = ["run", str(QUICK), "-o", str(out), "-q", "-j", "1",
            "--set", "workload.transforms.first_n=30"]
    handler = signal.getsignal(signal.SIGTERM)  # (SIG_DFL, or a library's, e.g. Ray's)
    assert main(args) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "--resume" in err and "Traceback" not in err
    assert _siblings(out) == [".r.points"]  # the staged points only: no temporary, no lock
    assert signal.getsignal(signal.SIGTERM) == handler  # handler restored
    assert main([*args, "--resume", "--no-plots"]) == 0


def test_ctrl_c_while_plots_are_drawn(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"

    def interrupted(folder, meta, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvfrag.plots.plot_results", interrupted)
    args = ["run", str(QUICK), "-o", str(out), "-q", "-j", "1",
            "--set", "workload.transforms.first_n=30"]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "run again with --resume" in err and "Traceback" not in err
    assert _siblings(out) == [".r.points"]


def test_a_real_sigterm_stops_a_run_cleanly(tmp_path):
    out = tmp_path / "r"
    slow = ["--set", "workload.transforms.first_n=1000", "--set", "kv_budget=64GiB"]
    cmd = [sys.executable, "-m", "kvfrag.cli", "run", str(QUICK), "-o", str(out), "-q",
           "--no-plots", "-j", "1", *slow]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    points = tmp_path / ".r.points"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(points.glob("*/summary.json")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "--resume" in err and "Traceback" not in err
    assert _siblings(out) == [".r.points"] and not out.exists()


# ------------------------------------------------------------------------ write failures
def test_a_file_in_the_way_of_the_output(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert _run(tmp_path / "afile" / "out") == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "afile" in err and "Traceback" not in err


def test_a_read_only_place(tmp_path, monkeypatch, capsys):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ro"))

    monkeypatch.setattr(outdir.os, "open", read_only)
    assert _run(tmp_path / "ro" / "r") == 3
    err = capsys.readouterr().err
    assert "Read-only file system" in err and str(tmp_path / "ro" / "r") in err


def test_disk_full_while_staging(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    real = kvfrag.results.PointStore._put
    calls = []

    def full(self, key, meta, result, inputs):
        calls.append(key)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, key, meta, result, inputs)

    monkeypatch.setattr(kvfrag.results.PointStore, "_put", full)
    assert _run(out) == 3
    err = capsys.readouterr().err
    assert "no space left on device" in err and "--resume" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".r.tmp-*"))
    monkeypatch.setattr(kvfrag.results.PointStore, "_put", real)
    assert _run(out, "--resume") == 0


def test_disk_full_while_writing_keeps_the_old_results(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    assert _run(out) == 0
    before = (out / "summary.csv").read_bytes()

    def full(folder, what):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / MANIFEST))

    monkeypatch.setattr(kvfrag.results.outdir, "write_manifest", full)
    assert _run(out, "--set", "kv_budget=8GiB") == 3
    err = capsys.readouterr().err
    assert "no space left on device" in err and "--resume" in err
    assert (out / "summary.csv").read_bytes() == before
    assert _siblings(out) == [".r.points"]


# ------------------------------------------------------------------------ resume
class TraceRun:
    """A two-point scenario over a trace file of its own, interrupted after its first point
    was staged; `calls` lists the labels of the points run since."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        rows = (ROOT / "workloads" / "samples" / "azure-conv.csv").read_text().splitlines()
        self.trace = tmp_path / "trace.csv"
        self.trace.write_text("\n".join(rows[:201]) + "\n")
        self.scenario = tmp_path / "edited.yaml"
        self.scenario.write_text(TRACE_SCENARIO)
        self.out = tmp_path / "r"
        self.calls: list[str] = []
        real, interrupt = sim.sweep.run_task, [True]

        def counted(task, requests):
            self.calls.append(task.label)
            if len(self.calls) == 2 and interrupt[0]:
                raise KeyboardInterrupt
            return real(task, requests)

        monkeypatch.setattr(sim.sweep, "run_task", counted)
        assert _run(self.out, scenario=self.scenario) == 130
        assert self.calls == ["paged", "slab"]  # paged staged, slab interrupted
        interrupt[0] = False
        self.calls.clear()

    def run(self, out: Path, *extra: str) -> int:
        return _run(out, *extra, scenario=self.scenario)


def test_resume_reruns_points_whose_trace_changed(tmp_path, monkeypatch, capsys):
    t = TraceRun(tmp_path, monkeypatch)
    capsys.readouterr()
    table = pd.read_csv(t.trace)
    table["GeneratedTokens"] *= 2  # every output twice as long
    table.to_csv(t.trace, index=False)
    assert t.run(t.out, "--resume") == 0
    assert sorted(t.calls) == ["paged", "slab"]  # the staged point ran again
    assert "input changed" in capsys.readouterr().err
    fresh = tmp_path / "fresh"
    assert t.run(fresh) == 0
    assert (t.out / "summary.csv").read_bytes() == (fresh / "summary.csv").read_bytes()


def test_resume_reuses_points_whose_trace_is_unchanged(tmp_path, monkeypatch):
    t = TraceRun(tmp_path, monkeypatch)
    os.utime(t.trace, ns=(1, 1))  # touched, not changed: the digest decides
    assert t.run(t.out, "--resume") == 0
    assert t.calls == ["slab"]


# ------------------------------------------------------------------------ modes and plots
def test_every_folder_has_one_mode(tmp_path, monkeypatch):
    out = tmp_path / "r"
    real = sim.sweep.run_task
    calls = []

    def second(task, requests):
        calls.append(task)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(task, requests)

    monkeypatch.setattr(sim.sweep, "run_task", second)
    assert _run(out) == 130
    expected = outdir.DIR_MODE
    staged = [tmp_path / ".r.points", *(tmp_path / ".r.points").iterdir()]
    assert [stat.S_IMODE(p.stat().st_mode) for p in staged if p.is_dir()] == [expected] * 2
    monkeypatch.setattr(sim.sweep, "run_task", real)
    assert _run(out, "--resume") == 0
    args = ["validate", str(TINY), "-o", str(out / "validate"), "-q", *VALIDATE]
    assert main(args) == 0
    for folder in [out, out / "validate"]:
        assert stat.S_IMODE(folder.stat().st_mode) == expected, folder


def test_plot_records_what_it_draws_and_refuses_other_folders(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", str(QUICK), "-o", str(out), "-q", "-j", "1",
                 "--set", "workload.transforms.first_n=30"]) == 0
    drawn = out / "plots" / "breakdown.png"
    drawn.unlink()
    assert main(["plot", str(out)]) == 0
    assert drawn.is_file()
    assert _run(out) == 0  # what plot drew is kvfrag's: the folder stays replaceable
    (out / "mine.txt").write_text("x")
    assert main(["plot", str(out)]) == 2
    assert "mine.txt" in capsys.readouterr().err


def test_manifest_accounts_for_a_nested_report(tmp_path):
    folder = tmp_path / "f"
    (folder / "validate").mkdir(parents=True)
    (folder / "summary.csv").write_text("x")
    (folder / "validate" / "validate.csv").write_text("y")
    write_manifest(folder / "validate", "kvfrag validate")
    write_manifest(folder, "kvfrag run")
    assert json.loads((folder / MANIFEST).read_text())["files"] == ["summary.csv"]
    assert outdir.foreign_files(folder) == []
    (folder / "validate" / "extra.bin").write_text("z")
    assert outdir.foreign_files(folder) == ["validate/extra.bin"]


def test_a_run_that_rejects_most_requests_says_why(tmp_path, capsys):
    assert _run(tmp_path / "r", "--set", "kv_budget=1MiB") == 0
    err = capsys.readouterr().err
    assert "warning: paged-16 (point 0) rejected 30 of 30 requests (too_large: 30)" in err
    summary = pd.read_csv(tmp_path / "r" / "summary.csv")
    parts = ["token_states_frac", "reserved_frac", "internal_frac", "external_frac",
             "usable_free_frac"]
    assert (summary[parts].sum(axis=1) - 1).abs().max() < 1e-12


def test_workload_counts_are_on_record(tmp_path):
    args = ["--set", "workload.transforms.max_model_len=1024", "--set", "max_model_len=1024",
            "--set", "workload.transforms.long_requests=clip"]
    assert _run(tmp_path / "r", *args) == 0
    records = json.loads((tmp_path / "r" / "summary.json").read_text())["runs"]
    clipped = {r["workload_clipped"] for r in records}
    assert len(clipped) == 1 and clipped.pop() > 0
    assert {r["workload_dropped_rows"] for r in records} == {0}


def test_a_killed_report_in_a_folder_of_its_own_is_cleaned(tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    killed = _killed_temporary(out / "validate", ".validate.tmp-abcdefgh")  # validate made r/
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / ".x.tmp-abcdefgh").mkdir()  # unmarked: the user's, whatever its name
    (tmp_path / "mine" / ".x.tmp-abcdefgh" / "keep.txt").write_text("mine")
    assert _run(tmp_path / "mine") == 2
    assert ".x.tmp-abcdefgh/" in capsys.readouterr().err
    assert (tmp_path / "mine" / ".x.tmp-abcdefgh" / "keep.txt").exists()
    assert _run(out) == 0
    assert not killed.exists()


def test_validate_refuses_a_users_folder_and_a_file(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.bin").write_text("keep")
    (tmp_path / "file").write_text("keep")
    for target in (mine, tmp_path / "file"):
        assert main(["validate", str(TINY), "-o", str(target), "-q", *VALIDATE]) == 2
        assert str(target) in capsys.readouterr().err
    assert (mine / "data.bin").read_text() == "keep"
    assert (tmp_path / "file").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine"]


def test_the_served_arrival_rate_is_on_record(tmp_path):
    assert _run(tmp_path / "r") == 0
    records = json.loads((tmp_path / "r" / "summary.json").read_text())["runs"]
    arrivals = pd.read_parquet(tmp_path / "r" / "requests.parquet").query("label == 'paged-16'")
    expected = (len(arrivals) - 1) / arrivals["arrival_s"].max()
    assert [r["workload_arrival_rate"] for r in records] == [pytest.approx(expected)] * 4


def test_swept_mappings_get_short_labels():
    from kvfrag.results import format_table, short_labels

    a = json.dumps({"base_s": 0.01, "per_kv_token_s": 0.0})
    b = json.dumps({"base_s": 0.02, "per_kv_token_s": 0.0})
    assert short_labels([a, b, a]) == {a: "base_s=0.01", b: "base_s=0.02"}
    nested = [json.dumps({"synthetic": {"seed": s, "count": 5}}) for s in (1, 2)]
    assert list(short_labels(nested).values()) == ["synthetic.seed=1", "synthetic.seed=2"]
    summary = pd.DataFrame({"engine.step_time": [a, b], "label": ["x", "x"],
                            "token_states_frac": [0.5, -4.8e-18]})
    table = format_table(summary, ["engine.step_time"])
    assert "base_s=0.02" in table and "{" not in table and "-0.0%" not in table
    # The run's own summary holds the mappings themselves (summary.json keeps them native):
    # the same table.
    native = summary.assign(**{"engine.step_time": [json.loads(a), json.loads(b)]})
    assert format_table(native, ["engine.step_time"]) == table


def test_sigterm_inside_the_simulation_stops_the_run(tmp_path, monkeypatch, capsys):
    """SimPy rebuilds an exception raised in a process from its args: a SIGTERM that lands
    while a point is simulated must still stop the run (not fail the point)."""

    from kvfrag.sim.timing import TableTime

    affine = TableTime.affine  # (the quickstart is timed on a GPU's roofline: TableTime)

    def terminated(self, *args):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises inside SimPy's loop
        return affine(self, *args)

    # (the engine itself may be compiled, its methods out of monkeypatch's reach: the step
    # time it calls from inside its SimPy process is not)
    monkeypatch.setattr(TableTime, "affine", terminated)
    assert _run(tmp_path / "r") == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "failed" not in err and "Traceback" not in err and "interrupted" in err
    rebuilt = type(outdir.Terminated(signal.SIGHUP))(*outdir.Terminated(signal.SIGHUP).args)
    assert rebuilt.signum == signal.SIGHUP and str(rebuilt) == "SIGHUP"
