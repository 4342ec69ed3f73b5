"""Local worker processes die with their sweep: a killed `kvfrag run -j 2` (SIGKILL, SIGTERM)
leaves no worker behind, one Ctrl-C stops it within a second, and `ProcessExecutor.terminate`
kills the workers at once. Real processes, Linux only (/proc, PR_SET_PDEATHSIG)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvfrag.sim.sweep import ProcessExecutor, build_workloads, plan

from kvfrag import sim
from kvfrag.config import load_scenario

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="Linux only: /proc and PR_SET_PDEATHSIG"
)

ROOT = Path(__file__).resolve().parents[2]

# Four points of several seconds each (80,000 requests), two workers: still running when the
# tests stop them, and more points than workers (queued ones must not delay the stop).
SLOW = """\
name: slow
model: llama-3-8b
kv_budget: 2GiB
max_model_len: 2048
workload:
  synthetic:
    count: 80000
    prompt: {kind: uniform, low: 50, high: 800}
    output: {kind: uniform, low: 20, high: 400}
    arrival: {kind: poisson, rate: 20}
  seed: 3
engine:
  step_time: {base_s: 0.01, per_batched_token_s: 0.0001}
allocators:
  - {label: paged, kind: paged, block_size: 16}
  - {label: slab, kind: contiguous, reserve: max_model_len}
  - {label: paged-32, kind: paged, block_size: 32}
  - {label: buddy, kind: buddy, reserve: pow2}
"""
# `kvfrag run` with Python's own Ctrl-C handler, even where the test runner ignores SIGINT
# (a child inherits an ignored SIGINT, and Python then installs no KeyboardInterrupt for it).
LAUNCH = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from kvfrag.cli import main; sys.exit(main())"
)


# ------------------------------------------------------------------------ /proc
def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _children(pid: int, deep: bool = False) -> dict[int, str]:
    """Live children of `pid` (and theirs, if `deep`: a forkserver's workers): their start
    times (to tell a reused pid) by pid."""
    parents: dict[int, list[tuple[int, str]]] = {}
    for path in Path("/proc").iterdir():
        fields = _stat(int(path.name)) if path.name.isdigit() else None
        if fields and fields[0] not in "ZX":
            parents.setdefault(int(fields[1]), []).append((int(path.name), fields[19]))
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child, start in parents.get(todo.pop(), []):
            found[child] = start
            if deep:
                todo.append(child)
    return found


def _alive(pid: int, start: str) -> bool:
    """Whether the process is still running (a zombie is dead: it only waits to be reaped)."""
    fields = _stat(pid)
    return fields is not None and fields[19] == start and fields[0] not in "ZX"


def _survivors(workers: dict[int, str], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while True:
        alive = [pid for pid, start in workers.items() if _alive(pid, start)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


# ------------------------------------------------------------------------ kvfrag run -j 2
@pytest.fixture
def sweep(tmp_path):
    """Start `kvfrag run SLOW -j 2` in its own session; yield (process, its workers and any
    other descendant) once both workers run points; kill whatever is left afterwards."""
    path = tmp_path / "slow.yaml"
    path.write_text(SLOW)
    cmd = [sys.executable, "-c", LAUNCH, "run", str(path), "-j", "2", "-o",
           str(tmp_path / "out"), "--no-plots", "-q"]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    workers: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            workers = _children(proc.pid, deep=True)
            time.sleep(0.05)
        assert len(workers) >= 2 and proc.poll() is None, proc.communicate()
        time.sleep(0.5)  # into their points
        workers |= _children(proc.pid, deep=True)
        yield proc, workers
    finally:
        for pid, start in workers.items():  # a survivor has left the session's group
            if _alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_die_with_a_killed_parent(sweep, sig):
    proc, workers = sweep
    os.kill(proc.pid, sig)  # the parent only
    proc.wait(timeout=10)
    assert _survivors(workers, within=5) == []


def test_one_ctrl_c_stops_the_sweep_at_once(sweep):
    proc, workers = sweep
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole foreground group
    _, err = proc.communicate(timeout=10)
    took = time.monotonic() - started
    assert proc.returncode == 130, err
    assert "--resume" in err and "Traceback" not in err, err
    assert took < 3, f"took {took:.1f} s"
    assert _survivors(workers, within=1) == []


# ------------------------------------------------------------------------ in process
def _sleep(task, requests):  # a point that runs until its worker is killed
    time.sleep(60)


def _pdeathsig(task, requests) -> tuple[int, int, int]:
    """(PR_GET_PDEATHSIG, whether SIGINT is ignored, pid), in the worker."""
    import ctypes

    value = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    return value.value, int(ignored), os.getpid()


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    """Four tasks and their workload; forked workers run what this process patched."""
    monkeypatch.setattr(sim.sweep, "_mp_context", lambda: multiprocessing.get_context("fork"))
    path = tmp_path / "s.yaml"
    path.write_text(SLOW.replace("count: 80000", "count: 10"))
    loaded = load_scenario(path)
    todo = plan(loaded.scenario)
    built, _ = build_workloads(todo, loaded.base_dir)
    return todo, {key: w.requests for key, w in built.items()}


def _no_children() -> bool:
    return not multiprocessing.active_children() and not _children(os.getpid())


def test_terminate_kills_the_workers_now(tasks, monkeypatch):
    monkeypatch.setattr(sim.sweep, "run_task", _sleep)
    executor = ProcessExecutor(2)
    outcomes = executor.map(*tasks)
    workers = _children(os.getpid())
    assert len(workers) == 2
    started = time.monotonic()
    executor.terminate()
    executor.terminate()  # idempotent
    assert _survivors(workers, within=2) == []
    with pytest.raises(KeyboardInterrupt):  # the sweep stops: no made-up failed points
        next(outcomes)
    assert time.monotonic() - started < 2
    assert _no_children()


def test_closing_the_outcomes_early_kills_the_workers(tasks, monkeypatch):
    monkeypatch.setattr(sim.sweep, "run_task", _sleep)
    executor = ProcessExecutor(2)
    outcomes = executor.map(*tasks)
    workers = _children(os.getpid())
    time.sleep(0.2)  # running their points
    started = time.monotonic()
    outcomes.close()  # what the CLI does when interrupted
    assert time.monotonic() - started < 2
    assert _survivors(workers, within=0) == [] and _no_children()
    executor.terminate()  # nothing left: a no-op


def test_workers_ignore_ctrl_c_and_die_with_the_parent(tasks, monkeypatch):
    monkeypatch.setattr(sim.sweep, "run_task", _pdeathsig)
    outcomes = list(ProcessExecutor(2).map(*tasks))
    assert [o.error for o in outcomes] == [None] * 4
    for outcome in outcomes:
        deathsig, ignored, pid = outcome.result  # type: ignore[misc]
        assert (deathsig, ignored) == (signal.SIGKILL, 1) and pid != os.getpid()
    assert _no_children()
