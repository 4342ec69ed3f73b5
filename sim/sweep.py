"""Sweeps, point by point: in-process, on local worker processes, or on Ray.

A sweep is split into *tasks*: one allocator at one sweep point (what `sim.scenario_run.iter_runs`
yields), in that canonical order, each named by a stable `key` (a hash of the point's scenario
and the allocator label) so that a finished task can be recognised again. Each distinct
workload is built once, in the calling process, and shipped to the workers once: to each
local worker process when it starts (inherited through fork where the platform has it), or
into Ray's object store with one `ray.put`. Workers get tasks and return `RunResult`s, or the
error of a task that raised; one failing task never stops the others.

Whoever ran it, a task runs the same code on the same inputs, so results are identical
whichever executor produced them; `assemble` puts them back in the canonical order. Nothing
here writes files: staging finished points on disk is the `kvfrag` package's job.

Progress within a point: `map(..., progress)` calls `progress(task, done)` in the caller's
thread with the requests a running task has retired so far (`sim.engine.run`'s callback, at
most every ~0.2 s): in-process from the engine itself, from local workers through one shared
array of counters that the caller reads while it waits (no extra pipe, no thread). Ray tasks
report only when they finish.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pandas as pd
from kvfrag.sim.engine import PROGRESS_S
from kvfrag.sim.engine_records import RunResult
from kvfrag.sim.scenario import Scenario
from kvfrag.sim.scenario_run import PointRun, ScenarioResult, iter_runs, run_point
from kvfrag.workloads import Workload, build_workload


# ------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class Task:
    """One allocator at one sweep point."""

    index: int  # position in the canonical (serial) order
    key: str  # stable name: same point scenario and label -> same key
    point: int
    sweep: dict[str, Any]
    label: str
    kind: str
    scenario: Scenario  # the point's scenario
    workload: str  # key of the workload it runs on
    capacity: bool = True  # with the saturating replay's figures (`kvfrag plan` needs none)

    def params(self) -> dict[str, Any]:
        return {"point": self.point, "label": self.label, "kind": self.kind, **self.sweep}

    def describe(self) -> str:
        values = ", ".join(f"{k}={v}" for k, v in self.sweep.items())
        return f"point {self.point} ({self.label}" + (f"; {values})" if values else ")")


@dataclass
class Outcome:
    """What became of a task: a result, or the error it raised."""

    task: Task
    result: RunResult | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def point_key(point: Scenario, label: str) -> str:
    digest = hashlib.sha256(f"{point.model_dump_json()}|{label}".encode())
    return digest.hexdigest()[:20]


def workload_key(point: Scenario) -> str:
    return f"{point.workload.model_dump_json()}|{point.max_model_len}"


def plan(scenario: Scenario) -> list[Task]:
    """Every task of the scenario, in the order the serial run takes them."""
    return [
        Task(n, point_key(point, spec.label), i, values, spec.label, spec.kind, point,
             workload_key(point))
        for n, (i, values, point, spec) in enumerate(iter_runs(scenario))
    ]


def distinct(tasks: Iterable[Task]) -> list[Task]:
    """The first task of each key: tasks with the same key compute the same result."""
    seen: dict[str, Task] = {}
    for task in tasks:
        seen.setdefault(task.key, task)
    return list(seen.values())


def build_workloads(
    tasks: Iterable[Task], base_dir: Path
) -> tuple[dict[str, Workload], dict[str, str]]:
    """Build each distinct workload of `tasks` once: (built by key, error message by key).

    Bad input (`WorkloadError`: a bad trace or length table, a transform that cannot apply)
    is raised, naming the sweep point: like a bad scenario it refuses the whole sweep before
    any run, rather than failing only that point's runs.
    """
    from kvfrag.sim.speculative_spec import check_workload
    from kvfrag.workloads import WorkloadError

    built: dict[str, Workload] = {}
    errors: dict[str, str] = {}
    for task in tasks:
        key = task.workload
        if key in errors:
            continue
        point = task.scenario
        try:
            if key not in built:
                built[key] = build_workload(point.workload, base_dir, None, point.max_model_len)
            # (what speculative decoding needs of the table, at every point that asks for it)
            check_workload(point.engine.speculative, built[key].requests, built[key].source)
        except WorkloadError as exc:
            if not task.sweep:
                raise
            values = ", ".join(f"{k}={v}" for k, v in task.sweep.items())
            raise WorkloadError(f"point {task.point} ({values}): {exc}") from None
        except Exception as exc:
            errors[key] = _error(exc)
    return built, errors


#: `progress(task, done)`: `task` has retired `done` of its workload's requests so far.
Progress = Callable[[Task, int], None]


def run_task(
    task: Task, requests: pd.DataFrame, progress: Callable[[int, int], None] | None = None
) -> RunResult:
    """Run one task on its workload's request table (the same code as `sim.scenario_run.run`);
    `progress(done, total)` as `sim.engine.run` calls it."""
    point = task.scenario
    spec = next(a for a in point.allocators if a.label == task.label)
    return run_point(point, spec, requests, progress, task.capacity)


def _attempt(
    task: Task, requests: pd.DataFrame, progress: Callable[[int, int], None] | None = None
) -> tuple[RunResult | None, str | None]:
    try:
        if progress is None:  # (the two-argument call: what a patched runner takes)
            return run_task(task, requests), None
        return run_task(task, requests, progress), None
    except Exception as exc:  # a failing point is reported, it does not stop the others
        return None, _error(exc)


def _error(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def assemble(
    scenario: Scenario,
    tasks: list[Task],
    results: Mapping[str, RunResult],
    workloads: Mapping[str, Workload],
) -> ScenarioResult:
    """The tasks that have a result (by key), as one `ScenarioResult` in canonical order."""
    runs = [
        PointRun(t.point, t.sweep, t.label, t.kind, t.scenario, results[t.key])
        for t in tasks
        if t.key in results
    ]
    by_point = {t.point: workloads[t.workload] for t in tasks if t.workload in workloads}
    return ScenarioResult(scenario, by_point, runs)


# ------------------------------------------------------------------------ executors
class Executor(Protocol):
    """Runs tasks and yields their outcomes as they finish (in any order).

    `map` starts the work when it is called (worker processes are forked then, before the
    caller starts any thread) and returns an iterator of outcomes; closing that iterator
    early (or an interrupt while it waits) stops the work: what has not finished is dropped.
    `progress(task, done)`, if given, is called while the outcomes are iterated, in the
    iterating thread, with the requests a running task has retired so far (an executor may
    also call it only when a task finishes, or not at all).
    """

    name: str

    @property
    def workers(self) -> int: ...

    @property
    def running(self) -> int: ...

    def map(
        self,
        tasks: list[Task],
        workloads: Mapping[str, pd.DataFrame],
        progress: Progress | None = None,
    ) -> Iterator[Outcome]:
        ...


class SerialExecutor:
    """In this process, one task after the other: exactly the serial run."""

    name = "serial"

    def __init__(self) -> None:
        self.running = 0

    @property
    def workers(self) -> int:
        return 1

    def map(
        self,
        tasks: list[Task],
        workloads: Mapping[str, pd.DataFrame],
        progress: Progress | None = None,
    ) -> Iterator[Outcome]:
        for task in tasks:
            self.running = 1
            report = None if progress is None else functools.partial(_report, progress, task)
            result, error = _attempt(task, workloads[task.workload], report)
            self.running = 0
            yield Outcome(task, result, error)


def _report(progress: Progress, task: Task, done: int, total: int) -> None:
    progress(task, done)


#: The workloads of a local worker process, set once when it starts.
_WORKLOADS: Mapping[str, pd.DataFrame] = {}
#: A local worker's view of the sweep's progress counters (shared memory, one per task: the
#: requests it retired so far), or None when nobody reads them.
_PROGRESS: Any = None
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class WorkersKilled(KeyboardInterrupt):
    """`ProcessExecutor.terminate()` killed the workers: the sweep stops as for Ctrl-C (its
    unfinished points did not fail, they were abandoned)."""


def _init_worker(
    workloads: Mapping[str, pd.DataFrame], parent: int | None, progress: Any = None
) -> None:
    """Keep the workloads (and the progress counters), and tie the worker's life to the
    sweep's: Ctrl-C in a terminal reaches the whole process group, but only the parent
    decides what to do about it; a parent that dies, however (SIGKILL included), takes its
    workers with it."""
    global _WORKLOADS, _PROGRESS
    _WORKLOADS = workloads
    _PROGRESS = progress
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked by the parent while it forked us
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent(parent)


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL this worker when the process that forked it dies (Linux), and a thread that
    exits once the sweep's process is gone (elsewhere, and a second line of defence).

    `parent` is the sweep's pid when it forked this worker itself (fork, spawn): gone means
    re-parented. Under forkserver (None) the server is the parent and outlives the sweep as
    long as a worker lives, so the sweep is watched through multiprocessing's parent
    sentinel, a pipe that reaches end of file when the sweep's process exits.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    sweep = multiprocessing.parent_process()

    def gone() -> bool:
        if parent is not None:
            return os.getppid() != parent
        return sweep is not None and not sweep.is_alive()

    if gone():  # it died before prctl: no signal will come
        os._exit(1)

    def watch() -> None:
        while not gone():
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kvfrag-parent-watch", daemon=True).start()


def _work(task: Task, slot: int | None = None) -> tuple[RunResult | None, str | None]:
    report = None
    if slot is not None and _PROGRESS is not None:
        counters = _PROGRESS

        def report(done: int, total: int) -> None:
            counters[slot] = done  # one aligned 8-byte store: the reader needs no lock

    return _attempt(task, _WORKLOADS[task.workload], report)


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Hold back SIGINT while workers are forked: a child gets it only once it ignores it,
    the parent (here) as soon as it is done forking."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _PoolCounts:
    """What the progress bar reads from a pool of workers: its size and points in flight."""

    _workers = 0
    _in_flight = 0

    @property
    def workers(self) -> int:
        return self._workers

    @property
    def running(self) -> int:
        return min(self._workers, self._in_flight)


class ProcessExecutor(_PoolCounts):
    """Local worker processes. The workloads reach each worker once, when it starts.

    Workers die with this process (see `_init_worker`). A sweep that completes shuts the
    pool down cleanly; an interrupted one (Ctrl-C or SIGTERM raised while waiting, or its
    outcomes closed early) kills the workers at once rather than letting their points run
    to the end.
    """

    name = "processes"

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs or os.cpu_count() or 1
        if self.jobs < 1:
            raise ValueError("--jobs must be >= 1")
        self._workers = self.jobs
        self._in_flight = 0
        self._pool: ProcessPoolExecutor | None = None
        self._killed = False

    def map(
        self,
        tasks: list[Task],
        workloads: Mapping[str, pd.DataFrame],
        progress: Progress | None = None,
    ) -> Iterator[Outcome]:
        if not tasks:
            return iter(())
        self._workers = min(self.jobs, len(tasks))
        context = _mp_context()
        parent = None if context.get_start_method() == "forkserver" else os.getpid()
        # One counter per task, in shared memory: its worker writes, this process reads.
        counters = None if progress is None else context.Array("q", len(tasks), lock=False)
        pool = ProcessPoolExecutor(
            max_workers=self._workers,
            mp_context=context,
            initializer=_init_worker,
            initargs=(dict(workloads), parent, counters),
        )
        self._pool, self._killed = pool, False
        try:  # start the workers now, before the caller starts threads (a progress bar)
            with _sigint_blocked():
                pending = {
                    pool.submit(_work, task, None if counters is None else slot): (task, slot)
                    for slot, task in enumerate(tasks)
                }
        except BaseException:
            self._stop(pool)
            raise
        self._in_flight = len(pending)
        collect = self._collect(pool, pending, progress, counters)
        return _Outcomes(collect, lambda: self._stop(pool))

    def terminate(self) -> None:
        """Kill the workers now; the outcomes' iterator then raises `WorkersKilled`.

        For a SIGTERM handler: it only sends signals and closes a pipe (no lock, no wait),
        and does nothing the second time or when no sweep runs. Reaping the workers is left
        to the iterator's clean-up (or the pool's own thread).
        """
        pool = self._pool
        if pool is None or self._killed:
            return
        self._killed = True
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
        # A worker killed halfway through sending a result would leave the pool's thread
        # waiting for the rest forever: this process holds the pipe's other writing end.
        results = getattr(pool, "_result_queue", None)
        if results is not None:
            results._writer.close()

    def _stop(self, pool: ProcessPoolExecutor) -> None:
        """Kill the workers, then shut the pool down: quick, as nothing is left to wait for."""
        if self._pool is not pool:  # finished, or stopped already
            return
        self.terminate()
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=True, cancel_futures=True)
        for process in processes:  # reaped: no zombie left behind
            process.join(timeout=1)
        self._pool = None

    def _collect(
        self,
        pool: ProcessPoolExecutor,
        pending: dict[Future, tuple[Task, int]],
        progress: Progress | None,
        counters: Any,
    ) -> Iterator[Outcome]:
        finished = False
        seen = [0] * len(pending)
        timeout = None if progress is None else PROGRESS_S
        try:
            while pending:
                done, _ = wait(pending, timeout, return_when=FIRST_COMPLETED)
                if self._killed:
                    raise WorkersKilled("the sweep's workers were terminated")
                if progress is not None:  # the running tasks' counters that moved
                    for task, slot in [pending[f] for f in pending if f not in done]:
                        if counters[slot] != seen[slot]:
                            seen[slot] = counters[slot]
                            progress(task, seen[slot])
                for future in done:
                    task, _ = pending.pop(future)
                    self._in_flight = len(pending)
                    exc = future.exception()
                    if exc is not None:  # the worker died (killed, out of memory): its task fails
                        yield Outcome(task, None, f"worker process failed: {_error(exc)}")
                    else:
                        result, error = future.result()
                        yield Outcome(task, result, error)
            finished = True
        finally:
            self._in_flight = 0
            if finished:
                pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
            else:
                self._stop(pool)


class _Outcomes(Iterator[Outcome]):
    """`ProcessExecutor.map`'s outcomes. Closing them stops the workers even before the first
    outcome was asked for (a generator that has not started runs no `finally` on close)."""

    def __init__(self, outcomes: Iterator[Outcome], stop: Callable[[], None]) -> None:
        self._outcomes = outcomes
        self._stop = stop

    def __next__(self) -> Outcome:
        return next(self._outcomes)

    def close(self) -> None:
        self._outcomes.close()  # type: ignore[attr-defined]
        self._stop()


def _mp_context() -> multiprocessing.context.BaseContext:
    """fork where it is safe (workers inherit the workloads for free), else forkserver/spawn."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


def _ray_task(task: Task, requests: pd.DataFrame) -> tuple[RunResult | None, str | None]:
    return _attempt(task, requests)


class RayExecutor(_PoolCounts):
    """Ray tasks, one CPU each. The workloads go into the object store once (`ray.put`).

    Connects to `address` (a cluster: `ray://host:10001`, `host:6379` or `auto`), or starts
    a local instance with `jobs` CPUs (default: all) when there is none; an instance already
    initialised in this process (`ray.init(...)` by the caller) is used as it is. The cluster
    must have kvfrag installed, at the same version, for identical results.
    """

    name = "ray"

    def __init__(self, address: str | None = None, jobs: int | None = None) -> None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ValueError(
                "--executor ray needs Ray: pip install 'kvfrag[ray]'"
            ) from None
        if jobs is not None and jobs < 1:
            raise ValueError("--jobs must be >= 1")
        self.address = address
        self.jobs = jobs
        self._workers = 0
        self._in_flight = 0

    def map(
        self,
        tasks: list[Task],
        workloads: Mapping[str, pd.DataFrame],
        progress: Progress | None = None,
    ) -> Iterator[Outcome]:
        """(Ray tasks report no progress before they finish: `progress` goes unused.)"""
        import ray

        if not tasks:
            return iter(())
        own = not ray.is_initialized()
        if own:
            ray.init(
                address=self.address,
                num_cpus=self.jobs if self.address is None else None,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
        try:
            self._workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
            refs = {key: ray.put(df) for key, df in workloads.items()}  # once per sweep
        except BaseException:
            if own:
                ray.shutdown()
            raise
        return self._collect(tasks, refs, own)

    def _collect(self, tasks: list[Task], refs: dict[str, Any], own: bool) -> Iterator[Outcome]:
        import ray

        remote = ray.remote(num_cpus=1)(_ray_task)
        window = 4 * self._workers  # queued on the cluster; the rest wait here
        todo = iter(tasks)
        pending: dict[Any, Task] = {}

        def refill() -> None:
            while len(pending) < window:
                task = next(todo, None)
                if task is None:
                    return
                pending[remote.remote(task, refs[task.workload])] = task

        try:
            refill()
            while pending:
                self._in_flight = len(pending)
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    task = pending.pop(ref)
                    try:
                        result, error = ray.get(ref)
                    except Exception as exc:  # the task's worker or node was lost
                        result, error = None, f"ray task failed: {_error(exc)}"
                    self._in_flight = len(pending)
                    yield Outcome(task, result, error)
                refill()
        finally:
            self._in_flight = 0
            for ref in pending:
                ray.cancel(ref, force=True)
            if own:
                ray.shutdown()


def make_executor(
    executor: str = "local", jobs: int | None = None, address: str | None = None
) -> Executor:
    """`local` (worker processes; in-process when jobs is 1) or `ray`."""
    if executor == "ray":
        return RayExecutor(address, jobs)
    if executor != "local":
        raise ValueError(f"unknown executor {executor!r} (local or ray)")
    if address is not None:
        raise ValueError("--address is for --executor ray")
    jobs = jobs or os.cpu_count() or 1
    if jobs < 1:
        raise ValueError("--jobs must be >= 1")
    return SerialExecutor() if jobs == 1 else ProcessExecutor(jobs)


# ------------------------------------------------------------------------ in memory
def run_sweep(
    scenario: Scenario, base_dir: Path | None = None, executor: Executor | None = None
) -> tuple[ScenarioResult, list[Outcome]]:
    """Every task of the scenario on `executor` (default serial), nothing staged: the
    `ScenarioResult` of the tasks that finished, and the outcomes of those that failed."""
    base_dir = Path(".") if base_dir is None else base_dir
    executor = executor or SerialExecutor()
    tasks = plan(scenario)
    unique = distinct(tasks)
    workloads, errors = build_workloads(unique, base_dir)
    failed = [Outcome(t, None, errors[t.workload]) for t in unique if t.workload in errors]
    runnable = [t for t in unique if t.workload in workloads]
    if len(runnable) < 2 and not isinstance(executor, RayExecutor):
        executor = SerialExecutor()
    results: dict[str, RunResult] = {}
    frames = {k: w.requests for k, w in workloads.items()}
    for outcome in executor.map(runnable, frames):
        if outcome.ok:
            results[outcome.task.key] = outcome.result  # type: ignore[assignment]
        else:
            failed.append(outcome)
    return assemble(scenario, tasks, results, workloads), failed
