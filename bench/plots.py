"""Drawing against simulating: what the figures of a run cost next to the run itself.

For each scenario (default: the quickstart and the block-size sweep) the simulation runs once,
in this process and serially (`sim.scenario_run.run`), and its tables are written into a temporary
folder (`kvfrag.results.write_results`); then `kvfrag.plots.plot_results` draws the figures
from those files, as `kvfrag run` and `kvfrag plot` do, PNG only (the default) and PNG+SVG
(`--svg`), each into a fresh copy of the folder and best of `--repeat` (the first draw of a
process also pays for loading fonts). Printed per scenario: seconds to simulate, to write the
tables, to draw each way, the files drawn, and drawing over simulating.

`--module PATH` times another `kvfrag/plots.py` (say, a copy of an older one) against the same
results; one whose `plot_results` takes no `svg` always writes both formats, and its time is
shown under PNG+SVG.

    python bench/plots.py [SCENARIO.yaml ...] [--repeat R] [--module PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import shutil
import tempfile
import time
from pathlib import Path
from types import ModuleType

from kvfrag.sim.scenario_run import run

from kvfrag.config import load_scenario
from kvfrag.results import write_results

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = (ROOT / "scenarios" / "quickstart.yaml", ROOT / "scenarios" / "block-size-sweep.yaml")


def plots_module(path: Path | None) -> ModuleType:
    """kvfrag.plots, or the module at `path` (imported under another name, beside it)."""
    if path is None:
        from kvfrag import plots

        return plots
    spec = importlib.util.spec_from_file_location("bench_plots_under_test", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def takes_svg(plots: ModuleType) -> bool:
    """Whether SVG is a choice (older plots.py files always wrote PNG and SVG)."""
    return "svg" in inspect.signature(plots.plot_results).parameters


def time_drawing(plots: ModuleType, tables: Path, svg: bool, repeat: int) -> tuple[float, int]:
    """Best wall time of `repeat` draws of every figure, each into a fresh copy of `tables`
    (a folder without figures), and the number of files one draw wrote."""
    best, files = float("inf"), 0
    for i in range(repeat):
        folder = tables.with_name(f"{tables.name}-{'svg' if svg else 'png'}-{i}")
        shutil.copytree(tables, folder)
        meta = plots.load_meta(folder)  # the caption's facts, as `kvfrag plot` reads them
        start = time.perf_counter()
        if takes_svg(plots):
            paths = plots.plot_results(folder, meta, svg=svg)
        else:
            paths = plots.plot_results(folder, meta)
        best = min(best, time.perf_counter() - start)
        files = len(paths)
        shutil.rmtree(folder)
    return best, files


def bench(scenario: Path, plots: ModuleType, repeat: int, work: Path) -> dict:
    """Simulate `scenario` once, write its tables under `work`, and time drawing them: the
    seconds of each step, with the (seconds, files) of each drawing (None: not a choice)."""
    loaded = load_scenario(scenario)
    start = time.perf_counter()
    result = run(loaded.scenario, loaded.base_dir)
    simulate = time.perf_counter() - start
    tables = work / loaded.scenario.name
    start = time.perf_counter()
    write_results(result, tables, loaded.resolved())
    write = time.perf_counter() - start
    png = time_drawing(plots, tables, False, repeat) if takes_svg(plots) else None
    both = time_drawing(plots, tables, True, repeat)
    return {
        "scenario": loaded.scenario.name,
        "runs": len(result.runs),
        "simulate": simulate,
        "write": write,
        "png": png,
        "both": both,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", type=Path, default=list(SCENARIOS))
    parser.add_argument("--repeat", type=int, default=3, help="best of R draws per format")
    parser.add_argument("--module", type=Path, help="time this plots.py instead of kvfrag's")
    args = parser.parse_args()
    plots = plots_module(args.module)
    print(f"plots: {args.module or 'kvfrag.plots'}; simulation serial in this process; "
          f"drawing best of {args.repeat}")
    print(f"{'scenario':<20}{'runs':>5}{'simulate s':>11}{'tables s':>9}"
          f"{'PNG s':>8}{'files':>6}{'PNG+SVG s':>10}{'files':>6}"
          f"{'PNG/sim':>9}{'PNG+SVG/sim':>12}")
    with tempfile.TemporaryDirectory(prefix="kvfrag-bench-plots-") as tmp:
        for scenario in args.scenarios:
            r = bench(scenario, plots, args.repeat, Path(tmp))
            sim = r["simulate"]
            if r["png"] is None:  # (a plots.py without the choice)
                png = f"{'-':>8}{'-':>6}"
                png_ratio = f"{'-':>9}"
            else:
                png = f"{r['png'][0]:>8.2f}{r['png'][1]:>6}"
                png_ratio = f"{r['png'][0] / sim:>8.1f}x"
            both, both_files = r["both"]
            print(f"{r['scenario']:<20}{r['runs']:>5}{sim:>11.2f}{r['write']:>9.2f}{png}"
                  f"{both:>10.2f}{both_files:>6}{png_ratio}{both / sim:>11.1f}x")


if __name__ == "__main__":
    main()
