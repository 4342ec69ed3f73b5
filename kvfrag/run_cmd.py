"""`kvfrag run SCENARIO.yaml` (alias `kvfrag sweep`) and `kvfrag plot RESULTS_DIR`.

A run is split into points (one allocator at one sweep point) that run on local worker
processes (`--jobs N`, default all cores) or on Ray (`--executor ray [--address ADDR]`).
Each finished point is staged as it completes (`kvfrag.results.PointStore`); `--resume`
skips the points an interrupted run finished. The results folder is assembled from the
points in the serial order, so it is the same whichever executor ran them. A failing point
is reported with its parameters and error, listed in failures.csv, and makes the exit
status 1; the others' results are written all the same.

Progress goes to stderr (none with -q): a bar of the requests the runs have finished or
rejected, moving within each run (every ~0.2 s), with the runs done, running and failed;
then one line while the results are written and one while the figures are drawn, each
ended with the seconds it took.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfrag import outdir
from kvfrag.args import add_set_argument, positive
from kvfrag.outdir import VALIDATE_DIR

if TYPE_CHECKING:  # the command line imports the simulator only when a command runs
    import pandas as pd
    from tqdm import tqdm

    from kvfrag.config import LoadedScenario
    from kvfrag.results import PointStore
    from kvfrag.sim.engine_records import RunResult
    from kvfrag.sim.sweep import Executor, Task
    from kvfrag.workloads import Workload


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        aliases=["sweep"],
        help="run a scenario: every allocator (and sweep point) on one workload",
        description="Run every allocator of a scenario (at every sweep point) on the same "
        "workload, in parallel, and write summary.csv/json, timeseries/requests Parquet and "
        "plots to results/<name>/. Each finished point is staged as it completes in "
        "results/.<name>.points/, so an interrupted sweep continues with --resume.",
    )
    p.add_argument("scenario", type=Path,
                   help="scenario YAML file, or a shipped scenario's name (kvfrag scenarios)")
    p.add_argument("-o", "--output", type=Path, help="results folder (default results/<name>)")
    add_set_argument(p, "kv_budget=40GB")
    p.add_argument(
        "-j",
        "--jobs",
        type=positive,
        metavar="N",
        help="worker processes (default: all cores; 1 runs in this process); with "
        "--executor ray and no --address, the CPUs of the local Ray instance",
    )
    p.add_argument(
        "--executor",
        choices=["local", "ray"],
        default="local",
        help="where points run: local worker processes (default) or Ray "
        "(pip install 'kvfrag[ray]')",
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="Ray cluster to use (ray://head:10001, head:6379 or auto; default: start a "
        "local instance)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the points an interrupted run of the same scenario finished and run only "
        "the rest (without it, earlier staged points are discarded)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="if another kvfrag process is writing the same results folder, wait for it "
        "(default: say which process holds it and stop)",
    )
    p.add_argument("--no-plots", action="store_true", help="write tables only")
    p.add_argument("--no-report", action="store_true",
                   help="no report.html (the figures and an interactive address map in one page)")
    p.add_argument(
        "--svg",
        action="store_true",
        help="write the figures as SVG too (default: PNG only; the SVGs add about two thirds "
        "to the drawing time)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or table")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the summary as JSON on stdout instead of the table (schema_version, "
        "scenario, results_dir, runs: summary.json's rows; see docs/data-dictionary.md)",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("plot", help="redraw the figures of a results folder")
    p.add_argument("results", type=Path, help="a folder written by kvfrag run")
    p.add_argument("--wait", action="store_true", help="wait for a run writing that folder")
    p.add_argument(
        "--svg",
        action="store_true",
        help="write the figures as SVG too (default: PNG only; SVGs an earlier --svg wrote are "
        "redrawn either way, so none is left stale)",
    )
    p.add_argument("--point", type=int, metavar="N",
                   help="draw the timeline and address map of sweep point N alone, as "
                   "plots/timeline-pointN.png and so on (the all-points figures stay as they are)")
    p.set_defaults(func=cmd_plot)


def cmd_run(args: argparse.Namespace) -> int:
    from kvfrag.config import load_scenario
    from kvfrag.results import PointStore
    from kvfrag.sim.sweep import make_executor

    loaded = load_scenario(args.scenario, args.sets)
    scenario = loaded.scenario
    out = args.output or Path("results") / scenario.name
    outdir.check_target(out, early=True)  # before any work: only kvfrag's own folders
    executor = make_executor(args.executor, args.jobs, args.address)
    store = PointStore(out)
    try:
        # (the handler first: a SIGTERM as the lock is taken still removes the lock file)
        with outdir.terminate_as_interrupt(), \
                outdir.locked(out, f"kvfrag run {args.scenario}", args.wait):
            outdir.clean_stale(out)
            outdir.clean_stale(out / VALIDATE_DIR)  # a killed `kvfrag validate` (same lock)
            outdir.check_target(out)  # again: another run may have written it as we waited
            return _run(args, loaded, out, executor, store)
    except KeyboardInterrupt as exc:
        hint = ""
        if store.dir.is_dir():
            hint = (f": {_staged_count(store)} finished point(s) are staged in {store.dir}/; "
                    "run again with --resume to finish")
        print(f"\ninterrupted{hint}", file=sys.stderr)
        return outdir.interrupt_status(exc)
    except outdir.OutputError as exc:
        done = _staged_count(store)
        if done:
            raise outdir.OutputError(
                f"{exc}; the {done} finished point(s) stay staged in {store.dir}/: run again "
                "with --resume to write the results without recomputing them"
            ) from None
        raise


def _staged_count(store: PointStore) -> int:
    try:
        return sum(1 for p in store.dir.iterdir() if (p / "summary.json").is_file())
    except OSError:
        return 0


def _run(
    args: argparse.Namespace,
    loaded: LoadedScenario,
    out: Path,
    executor: Executor,
    store: PointStore,
) -> int:
    from kvfrag.results import (
        dumps_json,
        format_table,
        summary_document,
        summary_records,
        write_results,
    )
    from kvfrag.sim.scenario_run import WORKLOAD_COUNTS, block_size_warnings
    from kvfrag.sim.sweep import SerialExecutor, assemble, build_workloads, distinct, plan
    from kvfrag.sim.units import format_size

    scenario = loaded.scenario
    resolved = loaded.resolved()
    tasks = plan(scenario)
    unique = distinct(tasks)
    inputs = {
        t.key: input_files(t.scenario.workload, loaded.base_dir) + profile_files(t.scenario)
        for t in unique
    }
    every_input = sorted({p for files in inputs.values() for p in files})
    # Every distinct workload is read and generated once, here, before anything is staged or
    # run (and shared with the workers): a bad trace at any sweep point is bad input that
    # refuses the whole run (exit 2, nothing written), and a FIFO or a device, refused by its
    # stat, is never opened by the staging's digests.
    workloads, errors = build_workloads(unique, loaded.base_dir)
    if errors and not workloads:  # nothing can run: the one-line error of a plain run
        raise ValueError(next(iter(errors.values())))
    staged = store.open(resolved, args.resume, code_fingerprint(), every_input)
    todo = [t for t in unique if t.key not in staged]
    geo = scenario.geometry
    own_len = " (the model's)" if scenario.model_len_default else ""
    if not args.quiet:
        gpus = "" if scenario.gpu is None else f" on {scenario.tp} x {scenario.gpu.name}" if (
            scenario.tp > 1) else f" on {scenario.gpu.name}"
        print(
            f"{scenario.name}: {geo.name}{gpus} ({format_size(geo.bytes_per_token)}/token"
            f"{' per GPU' if scenario.tp > 1 else ''}), KV budget "
            f"{format_size(scenario.budget_bytes)}{_derived(scenario)}, max_model_len "
            f"{scenario.max_model_len}{own_len}, {len(tasks)} run(s)",
            file=sys.stderr,
        )
        print(f"step time: {scenario.engine_config().step_time.source}", file=sys.stderr)
        if args.resume:
            print(
                f"resuming: {len(unique) - len(todo)} of {len(unique)} point(s) already "
                f"finished in {store.dir}/",
                file=sys.stderr,
            )
    specs = (next(a for a in t.scenario.allocators if a.label == t.label) for t in tasks)
    for line in block_size_warnings(specs):
        print(f"kvfrag: warning: {line}", file=sys.stderr)
    if args.resume and store.rerun:
        changed = sorted({p for paths in store.rerun.values() for p in paths})
        print(
            f"kvfrag: {len(store.rerun)} staged point(s) run again: their input changed "
            f"since ({', '.join(changed)})",
            file=sys.stderr,
        )

    failed: dict[str, str] = {}
    for task in todo:
        if task.workload in errors:
            failed[task.key] = errors[task.workload]
            print(f"kvfrag: {task.describe()} failed: {failed[task.key]}", file=sys.stderr)
    runnable = [t for t in todo if t.workload not in errors]
    if len(runnable) < 2 and executor.name == "processes":
        executor = SerialExecutor()
    results: dict[str, RunResult] = {}
    needed = {t.workload for t in runnable}  # (only these are shipped to the workers)
    _run_points(executor, runnable, {k: w for k, w in workloads.items() if k in needed}, store,
                results, failed, args.quiet, inputs)
    for key in staged:
        results[key] = store.get(key)

    result = assemble(scenario, tasks, results, workloads)
    failures = _failures(tasks, failed, list(scenario.sweep))
    workload = workloads.get(tasks[0].workload)
    spec = scenario.workload
    seeds = scenario.sweep.get("workload.seed")
    seed = f"seeds {', '.join(map(str, seeds))}" if seeds else f"seed {spec.seed}"
    source = spec.trace.path if spec.trace else f"synthetic, {seed}"
    notes = []
    if workload is not None:
        notes.append(f"workload: {source}, {len(workload.requests):,} requests")
        for name in WORKLOAD_COUNTS:
            if getattr(workload, name):
                notes.append(f"{name.replace('_', ' ')}: {getattr(workload, name):,}")
    step = _Step(args.quiet)
    plot = None
    if not args.no_plots and result.runs and workload is not None:
        from kvfrag.plots import plot_results

        meta = _meta(resolved, f"{source} ({len(workload.requests):,} requests)")
        draw = functools.partial(plot_results, svg=True) if args.svg else plot_results

        def plot(folder: Path) -> None:  # (the tables are written by now)
            step.start(f"drawing the figures in {out}/plots/")
            left_out: list[str] = []  # (said after the step's line ends, not on it)
            paths = draw(folder, meta, say=left_out.append)
            step.end(f"{len({p.with_suffix('') for p in paths})} figure(s)")
            for line in left_out:
                print(f"kvfrag: note: {line}", file=sys.stderr)
            if not args.no_report:
                from kvfrag.report import REPORT, write_report

                step.start(f"writing {out}/{REPORT}")
                write_report(folder)
                step.end()

    with step:
        step.start(f"writing {out}/")
        write_results(result, out, resolved, plot, failures)
        step.end()
    for line in rejection_warnings(result.summary()):
        print(f"kvfrag: warning: {line}", file=sys.stderr)
    human = sys.stderr if args.json else sys.stdout  # --json: stdout holds the JSON only
    if not args.quiet:
        if notes:
            print("; ".join(notes), file=human)
        if result.runs and not args.json:
            print(format_table(result.summary(), list(scenario.sweep)))
        print(f"wrote {out}/", file=human)
    if args.json:
        doc = summary_document(scenario.name, result.summary())
        print(dumps_json({
            "schema_version": doc["schema_version"],
            "scenario": doc["scenario"],
            "results_dir": str(out),
            "runs": doc["runs"],
            # the rows of failures.csv, a swept mapping or list native (as in `runs`)
            "failures": summary_records(
                _failures(tasks, failed, list(scenario.sweep), native=True)
            ),
        }))
    if failed:
        print(
            f"kvfrag: {len(failures)} of {len(tasks)} run(s) failed (listed in "
            f"{out}/failures.csv); the finished points stay staged in {store.dir}/: run again "
            "with --resume to retry only the failed ones",
            file=sys.stderr,
        )
        return 1
    store.remove()
    return 0


def _derived(scenario: Any) -> str:
    """How a derived KV budget was reached (empty when the scenario gives one)."""
    from kvfrag.sim.units import format_size

    if scenario.kv_budget is not None:
        return ""
    b = scenario.budget_breakdown()
    draft = f" - draft weights {format_size(b['draft_weights'])}" if b["draft_weights"] else ""
    return (f" (derived: {format_size(b['usable'])} usable - weights "
            f"{format_size(b['weights'])}{draft} - activations {format_size(b['activations'])} - "
            f"non-torch {format_size(b['non_torch'])})")


def profile_files(scenario: Any) -> list[Path]:
    """The step-time profile a point reads, if any (its path is absolute by now)."""
    from kvfrag.sim.scenario_parts import ProfileSpec
    from kvfrag.sim.timing import profile_file

    step = scenario.engine.step_time
    return [profile_file(step.profile).resolve()] if isinstance(step, ProfileSpec) else []


def input_files(spec: Any, base_dir: Path) -> list[Path]:
    """Every file a workload reads (traces, empirical length tables, shipped samples):
    staged points are reused only while these are byte for byte the same."""
    from kvfrag.config import workload_paths
    from kvfrag.workloads import resolve_path, samples

    found = set()
    for _, value in workload_paths(spec.model_dump(mode="json"), []):
        if value.startswith("sample:") and value.removeprefix("sample:") not in samples.names():
            continue  # (a sweep point's bad sample: its workload fails to build, and says so)
        found.add(resolve_path(value, base_dir).resolve())
    return sorted(found)


def rejection_warnings(summary: pd.DataFrame, share: float = 0.5) -> list[str]:
    """One line per run that rejected more than `share` of its requests, with the reasons."""
    from kvfrag.sim.engine_records import REJECT_REASONS

    lines = []
    for rec in summary.to_dict("records"):
        rejected, total = int(rec["rejected"]), int(rec["requests"])
        if total and rejected > share * total:
            reasons = [
                f"{why}: {int(rec[f'rejected_{why}']):,}"
                for why in REJECT_REASONS
                if rec.get(f"rejected_{why}")
            ]
            why = f" ({', '.join(reasons)})" if reasons else ""
            lines.append(
                f"{rec['label']} (point {rec['point']}) rejected {rejected:,} of {total:,} "
                f"requests{why}"
            )
    return lines


def code_fingerprint() -> str:
    """A hash of the simulator's source (sim/, workloads/): staged points are only reused by
    the code that computed them."""
    import hashlib

    from kvfrag import sim, workloads

    digest = hashlib.sha256()
    for package in (sim, workloads):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def _run_points(
    executor: Executor,
    tasks: list[Task],
    workloads: dict[str, Workload],
    store: PointStore,
    results: dict[str, RunResult],
    failed: dict[str, str],
    quiet: bool,
    inputs: dict[str, list[Path]],
) -> None:
    """Run `tasks`, staging each finished point as it completes."""
    bar_type = bar_class()
    frames = {key: w.requests for key, w in workloads.items()}
    disable = quiet or not tasks
    counts = None if disable else _RequestCounts(
        {t.key: len(frames[t.workload]) for t in tasks},
        lambda: _status(len(results), len(tasks), executor.running, len(failed)),
    )
    progress = None if counts is None else counts.running
    outcomes = executor.map(tasks, frames, progress)  # workers start here, before the bar's thread
    bar = bar_type(total=counts.total if counts else 0, unit="req", unit_scale=True,
                    disable=disable, file=sys.stderr)
    if counts is not None:
        counts.bar = bar
    try:
        bar.set_postfix_str(_status(len(results), len(tasks), executor.running, len(failed)))
        for outcome in outcomes:
            task = outcome.task
            if outcome.ok:
                assert outcome.result is not None
                store.put(
                    task.key, {"index": task.index, **task.params()}, outcome.result,
                    inputs[task.key],
                )
                results[task.key] = outcome.result
            else:
                failed[task.key] = outcome.error or "failed"
                msg = f"kvfrag: {task.describe()} failed: {outcome.error}"
                if disable:
                    print(msg, file=sys.stderr)
                else:
                    bar.write(msg, file=sys.stderr)
            if counts is not None:
                counts.finished(task)
    finally:
        bar.close()
        close = getattr(outcomes, "close", None)
        if close is not None:  # stop the workers: cancel what has not started
            close()


@functools.cache
def bar_class() -> type:
    """tqdm without its monitor thread, which would outlive the bar (even disabled): a later
    sweep in this process forks its workers only while it is single-threaded."""
    from tqdm import tqdm

    class _Bar(tqdm):
        monitor_interval = 0

    return _Bar


def _status(done: int, runs: int, running: int, failed: int) -> str:
    return f"runs done={done}/{runs} running={running} failed={failed}"


class _RequestCounts:
    """What the bar of `kvfrag run` counts: the requests the runs have retired (finished or
    rejected), those of the runs over and those of the runs in flight so far."""

    def __init__(self, sizes: dict[str, int], status: Callable[[], str]) -> None:
        self.sizes = sizes  # requests of each task, by key
        self.total = sum(sizes.values())
        self.status = status
        self.over = 0  # requests of the tasks over (finished or failed)
        self.so_far: dict[str, int] = {}  # requests retired by each task in flight
        self.bar: tqdm | None = None

    def running(self, task: Task, done: int) -> None:
        """`Executor.map`'s progress callback."""
        self.so_far[task.key] = min(done, self.sizes[task.key])
        self._show()

    def finished(self, task: Task) -> None:
        self.so_far.pop(task.key, None)
        self.over += self.sizes[task.key]
        self._show()

    def _show(self) -> None:
        bar = self.bar
        if bar is None:
            return
        bar.set_postfix_str(self.status(), refresh=False)
        n = self.over + sum(self.so_far.values())
        if n != bar.n:
            bar.update(n - bar.n)  # (tqdm redraws at most every 0.1 s)
        else:
            bar.refresh()


class _Step:
    """One line on stderr per step of the work after the runs (none when quiet):
    `writing results/x/ ...` when it starts, ` 2.1 s` when it ends. A line left open by an
    error is ended before the error is told; an interrupt's message starts a new line itself.
    """

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.started: float | None = None

    def start(self, what: str) -> None:
        self.end()
        self.started = time.monotonic()
        if not self.quiet:
            print(f"{what} ...", end="", file=sys.stderr, flush=True)

    def end(self, note: str = "") -> None:
        if self.started is None:
            return
        seconds = time.monotonic() - self.started
        self.started = None
        if not self.quiet:
            print(f" {note}{', ' if note else ''}{seconds:.1f} s", file=sys.stderr, flush=True)

    def __enter__(self) -> _Step:
        return self

    def __exit__(self, kind: type | None, *_: object) -> None:
        if self.started is not None and kind is not None:
            self.started = None
            if not self.quiet and not issubclass(kind, KeyboardInterrupt):
                with contextlib.suppress(OSError, ValueError):
                    print(file=sys.stderr, flush=True)


def _failures(
    tasks: list[Task], failed: dict[str, str], sweep_keys: list[str], native: bool = False
) -> pd.DataFrame:
    """One row per failed run: where it is in the sweep, its parameters, its error (a swept
    mapping or list as JSON text, for a CSV cell, unless `native`)."""
    import pandas as pd

    rows = [
        {
            "point": t.point,
            "label": t.label,
            "kind": t.kind,
            **{k: t.sweep.get(k) if native else _scalar(t.sweep.get(k)) for k in sweep_keys},
            "key": t.key,
            "error": failed[t.key],
        }
        for t in tasks
        if t.key in failed
    ]
    return pd.DataFrame(rows)


def _scalar(value: object) -> object:
    return value if isinstance(value, int | float | str | bool) else json.dumps(value)


def _meta(resolved: dict, source: str) -> dict:
    from kvfrag.sim.units import format_size

    return {
        "name": resolved.get("name"),
        "model": resolved.get("model"),
        "kv_budget": format_size(resolved["kv_budget"])
        if isinstance(resolved.get("kv_budget"), int)
        else resolved.get("kv_budget"),
        "max_model_len": resolved.get("max_model_len"),
        "workload": source,
    }


def cmd_plot(args: argparse.Namespace) -> int:
    """Redraw in place, under the folder's lock; Ctrl-C, SIGTERM and SIGHUP stop it with the
    lock released, and what it drew by then is recorded (the folder stays replaceable)."""
    from kvfrag.plots import redraw

    folder = args.results
    if not (folder / "summary.csv").exists():
        raise FileNotFoundError(f"{folder}: not a results folder (no summary.csv)")

    def figures() -> set[Path]:
        try:
            return {p for p in (folder / "plots").iterdir()
                    if p.suffix in (".png", ".svg") and p.is_file() and not p.is_symlink()}
        except OSError:
            return set()

    # it redraws plots/ in place: only in a folder kvfrag wrote (the current one included)
    outdir.check_target(folder, replace=False)
    with outdir.terminate_as_interrupt(), \
            outdir.locked(folder, f"kvfrag plot {folder}", args.wait), outdir.writing(folder):
        outdir.clean_stale_inside(folder)
        outdir.check_target(folder, replace=False)  # again: a run may have replaced it
        before = figures()
        try:
            paths = redraw(folder, svg=args.svg, point=args.point)
        except BaseException:
            # (figures that appeared in plots/ while this process held the lock: its own)
            outdir.add_to_manifest(folder, sorted(figures() - before))
            raise
        outdir.add_to_manifest(folder, paths)
    for path in paths:
        print(path)
    return 0
