"""`kvfrag run SCENARIO.yaml` and `kvfrag plot RESULTS_DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from kvfrag.config import load_scenario
from kvfrag.results import format_table, write_results
from sim.scenario import count_runs
from sim.scenario import run as run_scenario
from sim.units import format_size


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a scenario: every allocator (and sweep point) on one workload",
        description="Run every allocator of a scenario on the same workload and write "
        "summary.csv/json, timeseries/requests Parquet and plots to results/<name>/.",
    )
    p.add_argument("scenario", type=Path, help="scenario YAML file")
    p.add_argument("-o", "--output", type=Path, help="results folder (default results/<name>)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set kv_budget=40GB (repeatable)",
    )
    p.add_argument("--no-plots", action="store_true", help="write tables only")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or table")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("plot", help="redraw the figures of a results folder")
    p.add_argument("results", type=Path, help="a folder written by kvfrag run")
    p.set_defaults(func=cmd_plot)


def cmd_run(args: argparse.Namespace) -> int:
    loaded = load_scenario(args.scenario, args.sets)
    scenario = loaded.scenario
    out = args.output or Path("results") / scenario.name
    total = count_runs(scenario)
    geo = scenario.geometry
    if not args.quiet:
        print(
            f"{scenario.name}: {geo.name} ({format_size(geo.bytes_per_token)}/token), "
            f"KV budget {format_size(scenario.budget_bytes)}, max_model_len "
            f"{scenario.max_model_len}, {total} run(s)",
            file=sys.stderr,
        )
    with tqdm(total=total, unit="run", disable=args.quiet or total < 2, file=sys.stderr) as bar:
        result = run_scenario(scenario, loaded.base_dir, on_run=lambda label: bar.update(1))
    workload = result.workloads[0]
    notes = [f"workload: {workload.source}, {len(workload.requests):,} requests"]
    for name in ("dropped_rows", "clipped", "rejected_long"):
        if getattr(workload, name):
            notes.append(f"{name.replace('_', ' ')}: {getattr(workload, name):,}")
    plot = None
    if not args.no_plots:
        from kvfrag.plots import plot_results

        spec = scenario.workload
        source = spec.trace.path if spec.trace else f"synthetic, seed {spec.seed}"
        meta = _meta(loaded.resolved(), f"{source} ({len(workload.requests):,} requests)")

        def plot(folder: Path) -> None:
            plot_results(folder, meta)

    write_results(result, out, loaded.resolved(), plot)
    if not args.quiet:
        print("; ".join(notes))
        print(format_table(result.summary(), list(scenario.sweep)))
        print(f"wrote {out}/")
    return 0


def _meta(resolved: dict, source: str) -> dict:
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
    from kvfrag.plots import redraw

    if not (args.results / "summary.csv").exists():
        raise FileNotFoundError(f"{args.results}: not a results folder (no summary.csv)")
    for path in redraw(args.results):
        print(path)
    return 0
