"""`kvfrag plan SCENARIO --ttft-p99 2s --tpot-p99 50ms`: the highest arrival rate each
allocator serves within a latency target, and the goodput there.

The search variable is the workload's rate: a trace's `transforms.rate_scale` (its arrival
times compressed), or the `rate` of a synthetic (or a trace's own) Poisson, gamma or constant
arrival process. Every allocator, at every setting of an optional grid (`--grid
block_size=8,16,32`, and the scenario's own `sweep`), is searched separately
(`kvfrag.plan_search`); each round's runs for all of them go out together, on local worker
processes (`-j N`) or Ray (`--executor ray`), as `kvfrag run`'s points do.

Each finished run is staged as it completes (`kvfrag.results.PointStore`, beside the results
folder), so an interrupted plan continues with `--resume` without running a probe again. The
results folder (`results/<name>-plan/`) is written whole or not at all, with the same
ownership rules, lock and clean-up as `kvfrag run`'s (`kvfrag.outdir`): plan.csv (every
probe), answer.csv (the answer per allocator and setting), plan.png (the targeted latency
against the rate), scenario.resolved.yaml and plan.yaml (the search as run).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import logging
import math
import sys
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfrag import outdir
from kvfrag.args import add_set_argument, positive
from kvfrag.plan_search import (
    FAILED,
    FOUND,
    GOODPUT_COLUMNS,
    METRICS,
    NEVER,
    PERCENTILES,
    Search,
    Target,
    format_seconds,
    goodput,
    judge,
    parse_duration,
    parse_precision,
    run_searches,
)

if TYPE_CHECKING:
    import pandas as pd

    from kvfrag.config import LoadedScenario
    from kvfrag.results import PointStore
    from kvfrag.sim.scenario import Scenario
    from kvfrag.sim.sweep import Executor

#: `--grid` names that need no dotted key: what a deployment tunes first.
GRID_NAMES = ("block_size", "max_num_seqs", "gpu_memory_utilization")
#: Searches at most (allocators x grid settings): each is a dozen runs or so.
MAX_SEARCHES = 512
RATE_SCALE = "workload.transforms.rate_scale"
#: The summary key a staged probe carries its workload's measured arrival rate under.
ARRIVAL_KEY = "plan_arrival_rate_req_s"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="the highest arrival rate each allocator serves within a latency target",
        description="For every allocator of a scenario, find the highest arrival rate (the "
        "trace's own scaled, or the synthetic arrival rate) at which the latency target "
        "holds, by bracketing and bisection over runs, and the goodput there. Writes "
        "plan.csv, answer.csv and plan.png to results/<name>-plan/. Give at least one "
        "target, e.g. --ttft-p99 2s --tpot-p99 50ms.",
    )
    p.add_argument("scenario", type=Path,
                   help="scenario YAML file, or a shipped scenario's name (kvfrag scenarios)")
    for metric, name in METRICS.items():
        for q in PERCENTILES:
            p.add_argument(f"--{metric}-p{q}", metavar="TIME", dest=f"{metric}_p{q}",
                           help=f"bound on the p{q} {name} (e.g. "
                           f"{'2s' if metric == 'ttft' else '50ms'})")
    p.add_argument("--precision", default="2%", metavar="P",
                   help="relative width of the final bracket (default 2%%)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="also search at each of these values, naming the best per allocator: "
                   f"{', '.join(GRID_NAMES)} or any dotted scenario key (repeatable; the "
                   "scenario's own sweep is a grid too)")
    p.add_argument("-o", "--output", type=Path,
                   help="results folder (default results/<name>-plan)")
    add_set_argument(p, "kv_budget=40GB")
    p.add_argument("-j", "--jobs", type=positive, metavar="N",
                   help="worker processes (default: all cores; 1 runs in this process)")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="where runs go: local worker processes (default) or Ray")
    p.add_argument("--address", metavar="ADDR", help="Ray cluster to use (with --executor ray)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs an interrupted plan of the same scenario finished")
    p.add_argument("--wait", action="store_true",
                   help="wait for another kvfrag process writing the same results folder")
    p.add_argument("--no-plots", action="store_true", help="write tables only")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or table")
    p.set_defaults(func=cmd_plan)


# ------------------------------------------------------------------------ the question
def targets_of(args: argparse.Namespace) -> list[Target]:
    """The bounds given on the command line (ValueError: a bad one, or none)."""
    targets = []
    for metric in METRICS:
        for q in PERCENTILES:
            text = getattr(args, f"{metric}_p{q}", None)
            if text is not None:
                targets.append(Target(metric, q, parse_duration(text, f"--{metric}-p{q}")))
    if not targets:
        raise ValueError("plan: give a latency target, e.g. --ttft-p99 2s and/or "
                         "--tpot-p99 50ms (p50, p90 or p99 of ttft or tpot)")
    return targets


@dataclass(frozen=True)
class SearchVariable:
    """What a plan varies: a dotted scenario key, its value in the scenario, its bounds, and
    whether a probe's rate is that value (an arrival process's rate) or is measured from its
    workload (a trace's timestamps, scaled)."""

    key: str
    start: float
    lowest: float
    highest: float
    nominal: float | None  # rate per unit of the value, when the value sets it

    @property
    def short(self) -> str:
        return self.key.rsplit(".", 1)[-1]


def search_variable(point: Scenario) -> SearchVariable:
    from kvfrag.workloads.spec import (
        MAX_RATE,
        MAX_RATE_SCALE,
        MIN_RATE,
        MIN_RATE_SCALE,
        AtOnceArrivals,
        ClosedLoopArrivals,
    )

    w = point.workload
    source = "synthetic" if w.synthetic is not None else "trace"
    arrival = (w.synthetic or w.trace).arrival  # type: ignore[union-attr]
    scale = w.transforms.rate_scale
    if isinstance(arrival, ClosedLoopArrivals):
        raise ValueError(f"workload.{source}.arrival: closed-loop users set their own rate; "
                         "plan needs open-loop arrivals (a trace's timestamps, or a poisson, "
                         "gamma or constant rate)")
    if isinstance(arrival, AtOnceArrivals):
        raise ValueError(f"workload.{source}.arrival: every request arrives at once, so there "
                         "is no rate to search; give an arrival process, e.g. "
                         "arrival: {kind: poisson, rate: 2}")
    rate = getattr(arrival, "rate", None)
    if rate is not None:
        return SearchVariable(f"workload.{source}.arrival.rate", float(rate), MIN_RATE,
                              MAX_RATE, scale or 1.0)
    return SearchVariable(RATE_SCALE, float(scale or 1.0), MIN_RATE_SCALE, MAX_RATE_SCALE,
                          None)


def _is_rate_key(key: str) -> bool:
    return key == RATE_SCALE or key.endswith(".arrival.rate")


def parse_grid(items: list[str], scenario: Scenario) -> dict[str, list[Any]]:
    """`--grid KEY=V1,V2` items -> dotted key -> values (YAML scalars, duplicates dropped).
    `block_size` names every allocator that takes one; `gpu_memory_utilization` the budget's
    utilization (refused when the scenario gives the budget as a size)."""
    from kvfrag.config import _load_yaml
    from kvfrag.sim.allocators import options_of
    from kvfrag.sim.scenario_parts import GpuBudget

    grid: dict[str, list[Any]] = {}
    for item in items:
        shown = item if len(item) <= 60 else item[:57] + "..."
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name or not raw.strip():
            raise ValueError(f"--grid {shown!r}: write KEY=V1,V2,..., e.g. --grid "
                             "block_size=8,16,32")
        values: list[Any] = []
        for text in raw.split(","):
            try:
                value = _load_yaml(text)[1] if text.strip() else None
            except Exception:  # (YAML errors: one line below)
                value = None
            if value is None or isinstance(value, list | dict):
                raise ValueError(f"--grid {shown!r}: {text.strip()!r} is not a value")
            if value not in values:
                values.append(value)
        if "." in name:
            keys = [name]
        elif name == "block_size":
            keys = [f"allocators.{a.label}.block_size" for a in scenario.allocators
                    if "block_size" in options_of(a.kind)]
            if not keys:
                raise ValueError(f"--grid {shown!r}: no allocator of the scenario takes a "
                                 "block_size")
        elif name == "max_num_seqs":
            keys = ["engine.max_num_seqs"]
        elif name == "gpu_memory_utilization":
            if scenario.kv_budget is None:
                keys = ["gpu_memory_utilization"]
            elif isinstance(scenario.kv_budget, GpuBudget):
                keys = ["kv_budget.utilization"]
            else:
                raise ValueError(f"--grid {shown!r}: the scenario gives kv_budget as a size, so "
                                 "the utilization changes nothing; derive it from `hardware` "
                                 "(no kv_budget) or give kv_budget: {gpu_memory: ...}")
        else:
            raise ValueError(f"--grid {shown!r}: unknown name {name!r} (give "
                             f"{', '.join(GRID_NAMES)} or a dotted scenario key)")
        for key in keys:
            if _is_rate_key(key):
                raise ValueError(f"--grid {shown!r}: plan searches the arrival rate itself")
            grid[key] = values
    return grid


@dataclass(frozen=True)
class Setting:
    """One allocator at one grid setting: what one `Search` looks for."""

    label: str
    kind: str
    values: dict[str, Any]  # the grid keys that apply to this allocator, and their values
    data: dict[str, Any]  # the scenario's data at this setting (no sweep)
    variable: SearchVariable

    def describe(self) -> str:
        return ", ".join(f"{short_key(k)}={v}" for k, v in self.values.items())


def short_key(key: str) -> str:
    """A grid key as the answer names it: `block_size`, `max_num_seqs`, `kv_budget`."""
    parts = key.split(".")
    return parts[-1] if parts[0] in ("allocators", "engine") else key


def settings_of(scenario: Scenario, grid: dict[str, list[Any]]) -> tuple[list[Setting], list[str]]:
    """Every allocator at every grid setting that applies to it (keys under `allocators.L.`
    apply to allocator L only), each validated now: a bad one is one line before any run.
    Also the notes on what of the scenario's sweep is left out."""
    from kvfrag.sim.scenario import Scenario, set_path, show_values

    search_variable(scenario)  # (a workload with no rate to search: said once, not per allocator)
    notes = []
    full: dict[str, list[Any]] = {}
    for key, values in scenario.sweep.items():
        if _is_rate_key(key):
            notes.append(f"the scenario's sweep of {key} is left out: plan searches the rate")
        else:
            full[key] = list(values)
    full.update(grid)
    base = scenario.model_dump(mode="python", exclude={"sweep"})
    settings: list[Setting] = []
    for spec in scenario.allocators:
        keys = [k for k in full if not k.startswith("allocators.")
                or k.startswith(f"allocators.{spec.label}.")]
        for combo in itertools.product(*(full[k] for k in keys)):
            values = dict(zip(keys, combo, strict=True))
            data = copy.deepcopy(base)
            try:
                for key, value in values.items():
                    set_path(data, key, value)
                point = Scenario.model_validate(data)
                variable = search_variable(point)
            except ValueError as exc:
                where = f" ({show_values(values)})" if values else ""
                raise ValueError(f"{spec.label}{where}: {one_problem(exc)}") from None
            settings.append(Setting(spec.label, spec.kind, values, data, variable))
            if len(settings) > MAX_SEARCHES:
                raise ValueError(f"plan: more than {MAX_SEARCHES} searches (allocators x grid "
                                 "settings); give a smaller grid")
    return settings, notes


def check_workloads(settings: list[Setting], base_dir: Path) -> None:
    """Build each setting's workload once, at the scenario's own rate, before anything is
    locked or staged: a bad trace is bad input (one line, exit 2, nothing written), as for
    `kvfrag run`."""
    from kvfrag.sim.scenario import Scenario
    from kvfrag.sim.sweep import workload_key
    from kvfrag.workloads import build_workload

    seen = set()
    for setting in settings:
        point = Scenario.model_validate(setting.data)
        key = workload_key(point)
        if key not in seen:
            seen.add(key)
            build_workload(point.workload, base_dir, None, point.max_model_len)


def one_problem(exc: Exception) -> str:
    """A validation error as one line: the first problem and where it is."""
    from pydantic import ValidationError

    from kvfrag.sim.units import clip_quoted

    if isinstance(exc, ValidationError) and exc.errors():
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        text = f"{loc}: {msg}" if loc else msg
    else:
        text = str(exc)
    return clip_quoted(" ".join(text.split()))


# ------------------------------------------------------------------------ the command
def cmd_plan(args: argparse.Namespace) -> int:
    from kvfrag.config import load_scenario
    from kvfrag.results import PointStore
    from kvfrag.sim.sweep import make_executor

    targets = targets_of(args)
    precision = parse_precision(args.precision)
    loaded = load_scenario(args.scenario, args.sets)
    scenario = loaded.scenario
    grid = parse_grid(args.grid, scenario)
    settings, notes = settings_of(scenario, grid)
    check_workloads(settings, loaded.base_dir)
    out = args.output or Path("results") / f"{scenario.name}-plan"
    outdir.check_target(out, early=True)  # before any work: only kvfrag's own folders
    executor = make_executor(args.executor, args.jobs, args.address)
    store = PointStore(out)
    try:
        with outdir.terminate_as_interrupt(), \
                outdir.locked(out, f"kvfrag plan {args.scenario}", args.wait):
            outdir.clean_stale(out)
            outdir.check_target(out)  # again: another process may have written it meanwhile
            plan = _Plan(args, loaded, settings, targets, precision, grid, notes, out, store)
            with _ray_session(executor):
                return plan.run(executor)
    except KeyboardInterrupt as exc:
        hint = ""
        if store.dir.is_dir():
            hint = (f": the finished runs are staged in {store.dir}/; run again with --resume "
                    "to go on from them")
        print(f"\ninterrupted{hint}", file=sys.stderr)
        return outdir.interrupt_status(exc)


@contextlib.contextmanager
def _ray_session(executor: Executor) -> Iterator[None]:
    """One Ray instance for every round (RayExecutor starts and stops its own per `map`
    unless one is up: seconds a round)."""
    if executor.name != "ray":
        yield
        return
    import ray

    if ray.is_initialized():
        yield
        return
    address = getattr(executor, "address", None)
    ray.init(address=address, num_cpus=getattr(executor, "jobs", None) if address is None
             else None, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@dataclass
class _Probe:
    """What a plan keeps of one run: its summary and the request columns goodput needs."""

    key: str
    summary: dict[str, Any]
    requests: pd.DataFrame


class _Plan:
    """One `kvfrag plan`: the searches' rounds, each run staged as it finishes and kept by
    its key (a run staged by an interrupted plan is read back instead of run again), then
    the tables and the folder."""

    def __init__(
        self,
        args: argparse.Namespace,
        loaded: LoadedScenario,
        settings: list[Setting],
        targets: list[Target],
        precision: float,
        grid: dict[str, list[Any]],
        notes: list[str],
        out: Path,
        store: PointStore,
    ) -> None:
        self.args, self.loaded, self.settings = args, loaded, settings
        self.targets, self.precision, self.grid, self.notes = targets, precision, grid, notes
        self.out, self.store = out, store
        self.probes: dict[str, _Probe] = {}  # by run key
        self.keys: dict[tuple[Hashable, float], str] = {}  # (search, value) -> run key
        self.staged: set[str] = set()
        self.reused = 0
        self.rounds = 0
        self.counter = itertools.count()
        self.inputs: dict[int, list[Path]] = {}  # files each setting's workload reads

    def say(self, text: str) -> None:
        if not self.args.quiet:
            print(text, file=sys.stderr, flush=True)

    def run(self, executor: Executor) -> int:
        from kvfrag.run_cmd import code_fingerprint

        started = time.monotonic()
        self.staged = self.store.open(self.loaded.resolved(), self.args.resume,
                                      code_fingerprint(), self._every_input())
        scenario = self.loaded.scenario
        self.say(f"{scenario.name}: {len(self.settings)} search(es) for "
                 f"{' and '.join(t.describe() for t in self.targets)}, precision "
                 f"{self.precision:.3g}; varying {self.settings[0].variable.key}")
        for note in self.notes:
            self.say(f"kvfrag: note: {note}")
        searches = {
            i: Search(s.variable.start, self.precision, s.variable.lowest, s.variable.highest)
            for i, s in enumerate(self.settings)
        }
        rounds = run_searches(searches, lambda asks: self._round(executor, asks))
        probes = probe_table(self, searches)
        answers = answer_table(self, searches, probes)
        write_plan(self, probes, answers)
        failed = [s for s in searches.values() if s.status == FAILED]
        if not self.args.quiet:
            print(format_answer(answers, self))
            runs = len(self.probes)
            self.say(f"{rounds} round(s), {runs} run(s) ({self.reused} reused), "
                     f"{time.monotonic() - started:.1f} s; wrote {self.out}/")
        if failed:
            print(f"kvfrag: {len(failed)} search(es) stopped on a failed run (answer.csv says "
                  f"which); the finished runs stay staged in {self.store.dir}/: run again with "
                  "--resume to retry", file=sys.stderr)
            return 1
        self.store.remove()
        return 0

    def _every_input(self) -> list[Path]:
        from kvfrag.run_cmd import input_files, profile_files
        from kvfrag.sim.scenario import Scenario

        found: set[Path] = set()
        for i, setting in enumerate(self.settings):
            point = Scenario.model_validate(setting.data)
            files = input_files(point.workload, self.loaded.base_dir) + profile_files(point)
            self.inputs[i] = files
            found.update(files)
        return sorted(found)

    def point_at(self, setting: Setting, value: float) -> Scenario:
        from kvfrag.sim.scenario import Scenario, set_path

        data = copy.deepcopy(setting.data)
        set_path(data, setting.variable.key, value)
        return Scenario.model_validate(data)

    def _round(
        self, executor: Executor, asks: list[tuple[Hashable, float]]
    ) -> dict[tuple[Hashable, float], bool | str]:
        """Run (or reuse) one probe per search; whether each met the targets, or its error."""
        from kvfrag.sim.scenario_run import _arrival_rate
        from kvfrag.sim.sweep import (
            SerialExecutor,
            Task,
            build_workloads,
            distinct,
            point_key,
            workload_key,
        )

        started = time.monotonic()
        tasks: list[Task] = []
        for sid, value in asks:
            assert isinstance(sid, int)  # (a search is named by its setting's index)
            setting = self.settings[sid]
            point = self.point_at(setting, value)
            sweep = {**setting.values, setting.variable.key: value}
            # (no saturating replay: it answers another question, at twice the cost)
            task = Task(next(self.counter), point_key(point, setting.label), sid, sweep,
                        setting.label, setting.kind, point, workload_key(point), capacity=False)
            self.keys[(sid, value)] = task.key
            if task.key in self.probes:
                continue
            if task.key in self.staged:
                result = self.store.get(task.key)
                self.probes[task.key] = _Probe(task.key, dict(result.summary), result.requests)
                self.reused += 1
                continue
            tasks.append(task)
        unique = distinct(tasks)
        errors: dict[str, str] = {}  # by run key
        if unique:
            workloads, bad = build_workloads(unique, self.loaded.base_dir)
            errors.update({t.key: bad[t.workload] for t in unique if t.workload in bad})
            rates = {k: _arrival_rate(w) for k, w in workloads.items()}
            runnable = [t for t in unique if t.workload in workloads]
            use = executor
            if len(runnable) < 2 and executor.name == "processes":
                use = SerialExecutor()
            frames = {k: w.requests for k, w in workloads.items()}
            outcomes = use.map(runnable, frames)
            try:
                for outcome in outcomes:
                    self._keep(outcome, rates, errors)
            finally:
                close = getattr(outcomes, "close", None)
                if close is not None:
                    close()
        answer: dict[tuple[Hashable, float], bool | str] = {}
        for sid, value in asks:
            key = self.keys[(sid, value)]
            if key in self.probes:
                answer[(sid, value)] = judge(self.probes[key].summary, self.targets).met
            else:
                answer[(sid, value)] = errors.get(key, "no result")
        self.rounds += 1
        reused = f" ({len(asks) - len(unique)} known)" if len(unique) < len(asks) else ""
        self.say(f"round {self.rounds}: {len(unique)} run(s){reused}, "
                 f"{time.monotonic() - started:.1f} s")
        return answer

    def _keep(self, outcome: Any, rates: dict[str, float], errors: dict[str, str]) -> None:
        """Stage a finished run (its summary, and the request columns goodput needs)."""
        import pandas as pd

        from kvfrag.sim.engine_records import RunResult

        task = outcome.task
        if not outcome.ok or outcome.result is None:
            errors[task.key] = outcome.error or "failed"
            print(f"kvfrag: {task.describe()} failed: {errors[task.key]}", file=sys.stderr)
            return
        summary = {**outcome.result.summary, ARRIVAL_KEY: rates.get(task.workload, math.nan)}
        requests = outcome.result.requests.loc[:, list(GOODPUT_COLUMNS)]
        slim = RunResult(summary, pd.DataFrame(), requests)
        self.store.put(task.key, {"index": task.index, **task.params()}, slim,
                       self.inputs.get(task.point, []))
        self.probes[task.key] = _Probe(task.key, summary, requests)

    def rate_of(self, setting: Setting, value: float, probe: _Probe | None) -> float:
        """Requests per second at `value`: the arrival process's rate, or (a trace scaled)
        the rate measured on the probe's workload."""
        v = setting.variable
        if v.nominal is not None:
            return value * v.nominal
        return float(probe.summary.get(ARRIVAL_KEY, math.nan)) if probe else math.nan

    def goodput_of(self, probe: _Probe) -> tuple[float, float]:
        return goodput(probe.requests, self.targets)

# ------------------------------------------------------------------------ tables and files
#: Per-probe figures plan.csv keeps from a run's summary, in this order.
PROBE_COLUMNS = (
    "completed", "rejected", "unfinished", "preemptions",
    "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "p50_tpot_s", "p90_tpot_s", "p99_tpot_s",
    "p99_latency_s", "throughput_req_s", "throughput_tok_s",
)


def _grid_columns(settings: list[Setting]) -> dict[str, str]:
    """Grid key -> its column name (the short name, or the dotted key where two collide)."""
    keys = list(dict.fromkeys(k for s in settings for k in s.values))
    shorts = [short_key(k) for k in keys]
    return {k: short if shorts.count(short) == 1 else k for k, short in zip(keys, shorts,
                                                                            strict=True)}


def probe_table(plan: _Plan, searches: dict[int, Search]) -> pd.DataFrame:
    """plan.csv: one row per allocator, setting and value probed, in rate order."""
    import pandas as pd

    columns = _grid_columns(plan.settings)
    rows = []
    for sid, search in searches.items():
        setting = plan.settings[sid]
        var = setting.variable
        for value in sorted(search.probes):
            probe = plan.probes.get(plan.keys.get((sid, value), ""))
            summary = probe.summary if probe else {}
            verdict = judge(summary, plan.targets) if probe else None
            good = plan.goodput_of(probe) if probe else (math.nan, math.nan)
            rows.append({
                "search": sid,
                "label": setting.label,
                "kind": setting.kind,
                **{columns[k]: v for k, v in setting.values.items()},
                var.short: value,
                "rate_req_s": plan.rate_of(setting, value, probe),
                "arrival_rate_req_s": summary.get(ARRIVAL_KEY, math.nan),
                "met": bool(verdict and verdict.met),
                "why": verdict.why if verdict else "no result",
                **{c: summary.get(c, math.nan) for c in PROBE_COLUMNS},
                "goodput_req_s": good[0],
                "goodput_tok_s": good[1],
                "answer": value == search.answer,
                "key": probe.key if probe else "",
            })
    return _grid_first(pd.DataFrame(rows), rows, list(columns.values()))


def answer_table(plan: _Plan, searches: dict[int, Search], probes: pd.DataFrame
                 ) -> pd.DataFrame:
    """answer.csv: one row per allocator and setting; `best` marks each allocator's setting
    with the highest rate (the first of equals; the first setting when none met)."""
    import pandas as pd

    columns = _grid_columns(plan.settings)
    rows = []
    for sid, search in searches.items():
        setting = plan.settings[sid]
        mine = probes[probes["search"] == sid] if len(probes) else probes
        at = mine[mine["answer"]] if len(mine) else mine
        hit = at.iloc[0] if len(at) else None
        above = mine[mine[setting.variable.short] == search.hi] if search.hi is not None and \
            len(mine) else None
        fail = above.iloc[0] if above is not None and len(above) else None
        rows.append({
            "search": sid,
            "label": setting.label,
            "kind": setting.kind,
            **{columns[k]: v for k, v in setting.values.items()},
            "best": False,
            "status": search.status,
            "rate_req_s": hit["rate_req_s"] if hit is not None else math.nan,
            setting.variable.short: search.answer if search.answer is not None else math.nan,
            "x_scenario_rate": (search.answer / setting.variable.start
                                if search.answer is not None else math.nan),
            **{t.column: hit[t.column] if hit is not None else math.nan for t in plan.targets},
            "goodput_req_s": hit["goodput_req_s"] if hit is not None else math.nan,
            "goodput_tok_s": hit["goodput_tok_s"] if hit is not None else math.nan,
            "fails_at_req_s": fail["rate_req_s"] if fail is not None else math.nan,
            "fails_because": fail["why"] if fail is not None else "",
            "probes": len(search.probes),
            "error": search.error,
        })
    answers = _grid_first(pd.DataFrame(rows), rows, list(columns.values()))
    for _, group in answers.groupby("label", sort=False):
        rates = group["rate_req_s"].fillna(-1.0)
        answers.loc[rates.idxmax(), "best"] = True  # (idxmax: the first of equals)
    return answers


def _grid_first(frame: pd.DataFrame, rows: list[dict[str, Any]], grid: list[str]
                ) -> pd.DataFrame:
    """The grid's columns right after search, label and kind, as the values were given (a
    block size stays 8, not 8.0, where other allocators have none)."""
    import pandas as pd

    if not len(frame):
        return frame
    for col in grid:
        values = [r.get(col) for r in rows]
        whole = all(isinstance(v, int) and not isinstance(v, bool) for v in values
                    if v is not None)
        frame[col] = pd.Series(values, index=frame.index, dtype="Int64" if whole else object)
    head = ["search", "label", "kind", *grid]
    return frame[head + [c for c in frame.columns if c not in head]]


def format_answer(answers: pd.DataFrame, plan: _Plan) -> str:
    """The terminal table: each allocator's best setting, its rate, the targeted figures and
    the goodput there, and what failed just above it."""
    columns = _grid_columns(plan.settings)
    grid = [c for c in columns.values() if c in answers.columns]
    head = ["allocator", *(["best setting"] if grid else []), "max rate", "x scenario",
            *[t.name for t in plan.targets], "goodput", "good tok/s", "just above"]
    lines = []
    for _, row in answers[answers["best"]].iterrows():
        found = math.isfinite(row["rate_req_s"])
        setting = ", ".join(f"{c}={_cell(row[c])}" for c in grid if _cell(row[c]) != "")
        if row["status"] == FOUND:
            note = f"{_rate(row['fails_at_req_s'])}: {row['fails_because']}"
        elif row["status"] == FAILED:
            note = f"a run failed: {row['error']}"
        elif row["status"] == NEVER:
            note = f"missed at every rate probed, down to {_rate(row['fails_at_req_s'])}: " \
                f"{row['fails_because']}"
        else:
            note = "met at every rate probed: a lower bound"
            if all(t.metric == "tpot" for t in plan.targets):
                note += " (waiting requests do not decode: add a TTFT target)"
        lines.append([
            str(row["label"]), *([setting or "-"] if grid else []),
            _rate(row["rate_req_s"]) if found else "-",
            f"{row['x_scenario_rate']:.3g}" if found else "-",
            *[format_seconds(row[t.column]) if found else "-" for t in plan.targets],
            _rate(row["goodput_req_s"]) if found else "-",
            f"{row['goodput_tok_s']:,.0f}" if found else "-",
            note,
        ])
    widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head) - 1)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)) + "  " + \
            cells[-1]

    return "\n".join([line(head), *[line(r) for r in lines]])


def _rate(value: float) -> str:
    return f"{value:.3g} req/s" if math.isfinite(value) else "-"


def _cell(value: Any) -> str:
    """A grid value as the table shows it; none (a key that does not apply) is empty."""
    import pandas as pd

    if value is None or (not isinstance(value, list | dict) and pd.isna(value)):
        return ""
    return str(value)


def plan_settings(plan: _Plan) -> dict[str, Any]:
    """plan.yaml: the question as asked and how it was searched."""
    variable = plan.settings[0].variable
    return {
        "targets": {f"{t.metric}_p{t.percentile}_s": t.seconds for t in plan.targets},
        "precision": plan.precision,
        "varies": variable.key,
        "grid": {k: list(v) for k, v in plan.grid.items()},
        "scenario_sweep_as_grid": {k: list(v) for k, v in plan.loaded.scenario.sweep.items()
                                   if not _is_rate_key(k)},
        "notes": plan.notes,
    }


def write_plan(plan: _Plan, probes: pd.DataFrame, answers: pd.DataFrame) -> Path:
    """The results folder, written whole into a temporary beside it and renamed into place."""
    import shutil

    import yaml

    from kvfrag.csvcells import write_csv

    out = plan.out
    outdir.make_dirs(out.parent)
    tmp = outdir.temp_dir(out)
    try:
        with outdir.writing(tmp):
            (tmp / "scenario.resolved.yaml").write_text(
                yaml.safe_dump(plan.loaded.resolved(), sort_keys=False), encoding="utf-8")
            (tmp / "plan.yaml").write_text(yaml.safe_dump(plan_settings(plan), sort_keys=False),
                                           encoding="utf-8")
            write_csv(probes, tmp / "plan.csv")
            write_csv(answers, tmp / "answer.csv")
            if not plan.args.no_plots and len(probes):
                from kvfrag.figure_kit import save_figure
                from kvfrag.plan_plots import plan_figure

                fig = plan_figure(probes, answers, plan.targets, plan.settings[0].variable.key)
                save_figure(fig, tmp / "plan")
            outdir.write_manifest(tmp, "kvfrag plan")
        outdir.replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
