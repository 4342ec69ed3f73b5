"""Figures draw at most what a person can read, and say what they leave out: what a careless (or
hostile) user found, on real results folders written by the command line.

- 2,000 allocators or 1,500 sweep points never finished drawing. A figure now draws the first
  MAX_ALLOCATORS allocators (in the scenario's order), and of a sweep MAX_POINT_PANELS points
  of the breakdown (MAX_BARS bars in all) and MAX_LINE_POINTS along the capacity figure's
  lines (evenly spaced, the first and last included); the timeline and the address map keep
  to MAX_PANELS panels. What is left out is said in the figure's title, in one line on stderr
  (`kvfrag run`, `kvfrag plot`) and in report.html.
- `kvfrag plot` and `kvfrag report` of a folder without its timeseries or requests file (or,
  for the report, a figure) drew what they could without a word: each now names the missing
  file and what it leaves out, one line on stderr per file, and report.html says the same.
  A folder without summary.csv is refused, as before.

The folders are small (five requests, a tiny model): the caps are passed by a few, not by
thousands, so that each test takes seconds.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim.allocators.base import PARTS

from kvfrag import (
    address_map_plots,
    breakdown_plots,
    capacity_plots,
    figure_kit,
    plots,
    results_io,
    timeline_plots,
)
from kvfrag.cli import main

HEAD = """\
name: NAME
model: {name: tiny, layers: 2, kv_heads: 2, head_dim: 64}
kv_budget: 4MiB
max_model_len: 2048
workload:
  synthetic:
    count: 5
    prompt: {kind: fixed, value: 100}
    output: {kind: fixed, value: 20}
    arrival: {kind: poisson, rate: 10}
  seed: 1
allocators:
"""
SLAB = "{label: LABEL, kind: contiguous, reserve: max_model_len, placement: first-fit}"
PAGED = "{label: LABEL, kind: paged, block_size: 16}"
#: Past the allocator cap by a few: all but the first two place slabs, past the address map's
#: own cap too.
MANY = figure_kit.MAX_ALLOCATORS + 6
SLABS = MANY - 2
#: Past the capacity figure's cap by a few (and the breakdown's by more).
POINTS = figure_kit.MAX_LINE_POINTS + 6


def _write(root: Path, name: str, allocators: list[str], sweep: str = "") -> Path:
    """Run a scenario (tables only) into root/name; the folder."""
    text = HEAD.replace("NAME", name) + "".join(f"  - {a}\n" for a in allocators) + sweep
    (root / f"{name}.yaml").write_text(text)
    out = root / name
    assert main(["run", str(root / f"{name}.yaml"), "-o", str(out), "-q", "-j", "1",
                 "--no-plots"]) == 0
    return out


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MANY allocators: two paged, then SLABS slab allocators."""
    allocators = [(PAGED if i < 2 else SLAB).replace("LABEL", f"a{i:02d}") for i in range(MANY)]
    return _write(tmp_path_factory.mktemp("many"), "many", allocators)


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One slab allocator over POINTS KV budgets."""
    budgets = ", ".join(str(4 * 2**20 + i * 2**16) for i in range(POINTS))
    return _write(tmp_path_factory.mktemp("swept"), "swept", [SLAB.replace("LABEL", "slab")],
                  f"sweep: {{kv_budget: [{budgets}]}}\n")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A slab and a paged allocator, figures and report drawn."""
    root = tmp_path_factory.mktemp("small")
    out = _write(root, "small", [SLAB.replace("LABEL", "slab"), PAGED.replace("LABEL", "paged")])
    assert main(["plot", str(out)]) == 0
    assert main(["report", str(out)]) == 0
    return out


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def _notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kvfrag: note: ")]


def _frames(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    return (results_io.read_summary(folder / "summary.csv"),
            pd.read_parquet(folder / "timeseries.parquet"),
            pd.read_parquet(folder / "requests.parquet"))


# ------------------------------------------------------------------ caps: allocators
def test_many_allocators_are_drawn_to_the_cap_and_say_so(many, tmp_path, capsys):
    folder = _copy(many, tmp_path)
    started = time.monotonic()
    assert main(["plot", str(folder)]) == 0
    took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert {Path(p).name for p in out.split()} == {f"{f}.png" for f in plots.FIGURES}
    first = f"the first {figure_kit.MAX_ALLOCATORS} in the scenario's order"
    assert _notes(err) == [
        f"kvfrag: note: the figures show {figure_kit.MAX_ALLOCATORS} of {MANY} allocators (the "
        f"address map {figure_kit.MAX_ALLOCATORS} of {SLABS} slab allocators): {first}"
    ], err
    assert took < 60, took  # (a cap's worth of panels: about 10 s on a slow shared core)
    # The report says it too.
    assert main(["report", str(folder)]) == 0
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert f"The figures show {figure_kit.MAX_ALLOCATORS} of {MANY} allocators" in page
    assert f"Maps of the first {figure_kit.MAX_ALLOCATORS} of {SLABS} slab allocators" in page
    assert page.count("id=\"map-") == figure_kit.MAX_ALLOCATORS


def test_each_figure_shows_the_first_allocators_and_says_how_many_of_all(many):
    summary, ts, requests = _frames(many)
    order = [f"a{i:02d}" for i in range(MANY)]
    shown = order[: figure_kit.MAX_ALLOCATORS]
    note = f"(showing {figure_kit.MAX_ALLOCATORS} of {MANY} allocators: the first"

    fig = breakdown_plots.breakdown_figure(summary)
    assert [t.get_text() for t in fig.axes[-1].get_xticklabels()] == shown
    assert note in fig._suptitle.get_text()

    fig = capacity_plots.capacity_figure(summary)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == shown
    assert note in fig._suptitle.get_text()

    fig = timeline_plots.timeline_figure(ts, summary)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == shown
    assert note in fig._suptitle.get_text()

    fig = address_map_plots.address_map_figure(requests, summary)
    slabs = order[2: 2 + figure_kit.MAX_ALLOCATORS]
    assert [ax.get_title(loc="left") for ax in fig.axes] == slabs
    assert (f"(showing {figure_kit.MAX_ALLOCATORS} of {SLABS} slab allocators: the first"
            in fig._suptitle.get_text())


def test_allocators_and_points_together_keep_to_the_bars_a_breakdown_can_name():
    """No run needed: the breakdown reads only the summary."""
    labels, points = [f"alloc-{i}" for i in range(40)], range(30)
    summary = pd.DataFrame(
        [{"label": lb, "point": p, "kv_budget": f"{p + 1} GiB", "model": "m",
          **{figure_kit.FRAC[part]: 0.2 for part in PARTS}}
         for p in points for lb in labels]
    )
    fig = breakdown_plots.breakdown_figure(summary)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    per_point = figure_kit.MAX_BARS // figure_kit.MAX_ALLOCATORS
    assert len(panels) == per_point
    # Evenly spaced, the first and last included.
    assert panels[0].get_title() == "kv_budget=1 GiB" and panels[-1].get_title() == (
        "kv_budget=30 GiB")
    title = fig._suptitle.get_text()
    assert f"showing {figure_kit.MAX_ALLOCATORS} of 40 allocators" in title
    assert f"showing {per_point} of 30 sweep points: evenly spaced" in title
    assert plots.left_out(summary)[1].startswith(
        f"of 30 sweep points, the breakdown shows {per_point} (evenly spaced")


def test_spread_is_even_deterministic_and_keeps_both_ends():
    points = list(range(1500))
    kept = figure_kit.spread(points, 50)
    assert len(kept) == len(set(kept)) == 50
    assert kept[0] == 0 and kept[-1] == 1499 and kept == sorted(kept)
    assert kept == figure_kit.spread(points, 50)
    assert np.ptp(np.diff(kept)) <= 1  # as even as whole steps allow
    assert figure_kit.spread(points[:7], 50) == points[:7]
    assert figure_kit.spread(points, 1) == [0]


# ------------------------------------------------------------------ caps: sweep points
def test_many_sweep_points_are_drawn_to_the_cap_and_say_so(swept, tmp_path, capsys):
    folder = _copy(swept, tmp_path)
    # (--point: one timeline and address-map panel; their own cap is test_plots')
    assert main(["plot", str(folder), "--point", "0"]) == 0
    line = (f"kvfrag: note: of {POINTS} sweep points, the breakdown shows "
            f"{figure_kit.MAX_POINT_PANELS} and the capacity figure "
            f"{figure_kit.MAX_LINE_POINTS} (evenly spaced, the first and last included)")
    assert _notes(capsys.readouterr().err) == [line]
    assert main(["report", str(folder)]) == 0
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert f"Of {POINTS} sweep points, the breakdown shows {figure_kit.MAX_POINT_PANELS}" in page
    assert "the timeline and the address map show the first 16" in page


def test_each_sweep_figure_spans_the_sweep_and_says_how_many_of_all(swept):
    summary = results_io.read_summary(swept / "summary.csv")
    budgets = summary.sort_values("point")["kv_budget_bytes"].to_numpy(float) / 2**20

    fig = breakdown_plots.breakdown_figure(summary)
    ticks = [float(t.get_text()) for t in fig.axes[-1].get_xticklabels()]
    assert len(ticks) == figure_kit.MAX_POINT_PANELS
    assert ticks[0] == budgets[0] and ticks[-1] == budgets[-1]
    assert (f"(showing {figure_kit.MAX_POINT_PANELS} of {POINTS} sweep points: evenly spaced, the "
            "first and last included)") in fig._suptitle.get_text().replace("\n", " ")

    fig = capacity_plots.capacity_figure(summary)
    x = fig.axes[0].get_lines()[0].get_xdata()
    assert len(x) == figure_kit.MAX_LINE_POINTS and x[0] == budgets[0] and x[-1] == budgets[-1]
    assert f"(showing {figure_kit.MAX_LINE_POINTS} of {POINTS} sweep points" in (
        fig._suptitle.get_text().replace("\n", " "))


# ------------------------------------------------------------------ missing files
@pytest.mark.parametrize("name", ["timeseries.parquet", "requests.parquet"])
def test_plot_names_a_missing_file_and_what_it_leaves_out(small, tmp_path, capsys, name):
    folder = _copy(small, tmp_path)
    shutil.rmtree(folder / "plots")
    (folder / name).unlink()
    assert main(["plot", str(folder)]) == 0
    out, err = capsys.readouterr()
    left = {"timeseries.parquet": ("the timeline figure is", {"timeline"}),
            "requests.parquet": ("the address map and request-lengths figures are",
                                 {"address_map", "lengths"})}[name]
    assert _notes(err) == [f"kvfrag: note: {folder / name} is missing: {left[0]} left out"]
    drawn = {Path(p).stem for p in out.split()}
    assert drawn == set(plots.FIGURES) - left[1]


@pytest.mark.parametrize("name", ["timeseries.parquet", "requests.parquet"])
def test_report_names_a_missing_file_and_what_it_leaves_out(small, tmp_path, capsys, name):
    folder = _copy(small, tmp_path)
    (folder / name).unlink()
    for figure in plots.NEEDS[name]:
        (folder / "plots" / f"{figure}.png").unlink()
    assert main(["report", str(folder)]) == 0
    err = capsys.readouterr().err
    what = {"timeseries.parquet": "the timeline figure is left out",
            "requests.parquet": "the interactive address map and the address map and "
                                "request-lengths figures are left out"}[name]
    assert _notes(err) == [f"kvfrag: note: {folder / name} is missing: {what}"]
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert f"<code>{name}</code> is missing: {what}" in page


def test_report_names_missing_figures(small, tmp_path, capsys):
    folder = _copy(small, tmp_path)
    (folder / "plots" / "capacity.png").unlink()
    assert main(["report", str(folder)]) == 0
    line = (f"{folder}/plots/capacity.png is missing: the capacity figure is left out "
            "(kvfrag plot draws it)")
    assert _notes(capsys.readouterr().err) == [f"kvfrag: note: {line}"]
    assert "the capacity figure is left out" in (folder / "report.html").read_text()
    (folder / "plots" / "breakdown.png").unlink()
    assert main(["report", str(folder)]) == 0
    assert _notes(capsys.readouterr().err) == [
        f"kvfrag: note: {folder}/plots/ lacks breakdown.png, capacity.png: the breakdown and "
        "capacity figures are left out (kvfrag plot draws them)"]
    shutil.rmtree(folder / "plots")
    assert main(["report", str(folder)]) == 0
    (note,) = _notes(capsys.readouterr().err)
    assert note.startswith(f"kvfrag: note: {folder}/plots/ holds no figures")


def test_a_figure_drawn_before_its_file_went_is_shown_as_such(small, tmp_path, capsys):
    folder = _copy(small, tmp_path)
    (folder / "timeseries.parquet").unlink()
    assert main(["report", str(folder)]) == 0
    assert _notes(capsys.readouterr().err) == [
        f"kvfrag: note: {folder}/timeseries.parquet is missing: the timeline figure below is "
        "as drawn earlier"]
    assert "plots/timeline.png" in (folder / "report.html").read_text()


def test_a_complete_folder_draws_without_a_note(small, tmp_path, capsys):
    folder = _copy(small, tmp_path)
    assert main(["plot", str(folder)]) == 0
    assert main(["report", str(folder)]) == 0
    assert _notes(capsys.readouterr().err) == []
    assert "Left out" not in (folder / "report.html").read_text()


@pytest.mark.parametrize("command", ["plot", "report"])
def test_a_folder_without_its_summary_is_refused(small, tmp_path, capsys, command):
    folder = _copy(small, tmp_path)
    (folder / "summary.csv").unlink()
    assert main([command, str(folder)]) == 2
    err = capsys.readouterr().err
    assert err == f"kvfrag: error: {folder}: not a results folder (no summary.csv)\n"
