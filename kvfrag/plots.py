"""Figures of a results folder: `plot_results` draws them all, `redraw` is `kvfrag plot`.

`plot_results(results_dir, meta)` reads what a run wrote (`summary.csv`, `timeseries.parquet`,
`requests.parquet`: `kvfrag.results_io`) and writes every figure into `results_dir/plots/` as
PNG, and as SVG too with `svg=True` (`kvfrag run --svg`, `kvfrag plot --svg`): each format is
a full render of its own, and the SVGs add about two thirds to the PNGs' drawing time, so they
are opt-in. Each figure has its own module, whose function takes DataFrames and returns a
matplotlib `Figure`, so figures can be built (and tested) without files:

- `kvfrag.breakdown_plots.breakdown_figure(summary)`: stacked bars, the budget split into its
  five parts per allocator (and, when the parts that hold no tokens are small, a row that zooms
  in on them)
- `kvfrag.timeline_plots.timeline_figure(timeseries)`: the same split over time, with running
  and waiting requests
- `kvfrag.address_map_plots.address_map_figure(requests, summary)`: every slab of a contiguous
  or buddy allocator
- `kvfrag.capacity_plots.capacity_figure(summary)`: requests running at once, throughput and
  latency, and what a scenario is about where its runs show it (prefix-cache hits, memory
  saved by sharing, compaction stall); against the swept value for a sweep
- `kvfrag.lengths_plots.lengths_figure(requests)`: the workload's prompt and output length
  distributions
- `kvfrag.group_plots.group_figure(timeseries)`: a hybrid model's blocks per KV-cache group

They share `kvfrag.figure_kit` (palette, caps, saving), `kvfrag.captions` (the caption line)
and `kvfrag.sweep_plots` (what each sweep point is called and where it sits on an axis).

The timeline and the address map draw every sweep point (a panel per allocator and point, up to
MAX_PANELS), or one (`point`, `kvfrag plot --point N`: `plots/timeline-pointN.png`, beside
the all-points figures). A figure draws at most what a person can read, and says in its title
what it leaves out (`kvfrag.figure_kit`); `plot_results` says it on stderr too, a line each
(`left_out`), and names a missing Parquet file and the figures left out for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from kvfrag.address_map_plots import SLAB_KINDS, _slab_labels, address_map_figure
from kvfrag.breakdown_plots import breakdown_figure
from kvfrag.capacity_plots import capacity_figure
from kvfrag.captions import _describe
from kvfrag.figure_kit import (
    MAX_ALLOCATORS,
    MAX_LINE_POINTS,
    _breakdown_keep,
    _first_point,
    _labels,
    _panel_keep,
    _with_keys,
    save_figure,
    spread,
)
from kvfrag.group_plots import group_figure
from kvfrag.lengths_plots import lengths_figure
from kvfrag.results import check_schema, folder_schema, upgrade_timeseries
from kvfrag.results_io import REQUESTS_COLUMNS, TIMESERIES_COLUMNS, read_frame, read_summary
from kvfrag.sweep_plots import _pick_points
from kvfrag.timeline_plots import timeline_figure

#: Figure files written by `plot_results`, by figure (each as .png, and .svg when asked for).
FIGURES = ("breakdown", "timeline", "address_map", "capacity", "lengths")


def plot_results(
    results_dir: Path | str,
    meta: Mapping | None = None,
    svg: bool = False,
    point: int | None = None,
    say: Callable[[str], None] | None = None,
) -> list[Path]:
    """Draw every figure for a results folder into `results_dir/plots/`: PNG, and SVG too with
    `svg`; a figure whose Parquet file is missing or has no rows is skipped. Returns the paths.
    A damaged file raises `ResultsFileError` (a ValueError) before anything is drawn, and so
    does a `point` the sweep does not have (ValueError).

    What the figures leave out is told before they are drawn, a line each to `say` (default:
    `kvfrag: note: ...` on stderr, as `kvfrag run` and `kvfrag plot` show it): a missing or
    empty Parquet file and the figures left out for it, and the allocators and sweep points
    past the caps (`left_out`). Silence would read as "everything is drawn".

    The timeline and the address map show every sweep point; with `point`, only the figures
    of POINT_FIGURES are drawn, of that point alone, into files of their own (`point_stem`:
    `plots/timeline-point3.png`), so the all-points figures stay as they are. The captions
    come from the folder's own files (`scenario.resolved.yaml`, the tables) wherever they say
    it, `meta` filling in only what they do not: `kvfrag run` and `kvfrag plot` of one folder
    draw the same captions, and figures of the same size.

    A figure whose SVG is already there (from an earlier `svg=True` draw) gets its SVG redrawn
    too, even without `svg`: an SVG left as it was would claim to show these results while it
    shows older ones. Redrawn rather than removed, so nothing is ever deleted here and the
    folder's manifest, which lists the file already, stays right as it is."""
    results_dir = Path(results_dir)
    out = results_dir / "plots"
    version = folder_schema(results_dir)[0]
    check_schema(version, results_dir, "draw")
    summary = read_summary(results_dir / "summary.csv", version)
    if point is not None:
        _pick_points(sorted(int(p) for p in pd.unique(_with_keys(summary)["point"])), point,
                     f"{results_dir}: ")
    ts_path, req_path = results_dir / "timeseries.parquet", results_dir / "requests.parquet"
    timeseries = (
        read_frame(ts_path, TIMESERIES_COLUMNS, lambda ts: upgrade_timeseries(ts, version))
        if ts_path.exists() else None
    )
    requests = read_frame(req_path, REQUESTS_COLUMNS) if req_path.exists() else None
    has_ts = timeseries is not None and len(timeseries) > 0
    has_req = requests is not None and len(requests) > 0
    meta = _folder_meta(results_dir, meta, requests if has_req else None)
    notes = missing_notes(results_dir, timeseries, requests, summary)
    if has_ts and point is not None and not (_with_keys(timeseries)["point"] == point).any():
        has_ts = False  # (that point failed: no records)
        notes.append(f"{ts_path} has no records of sweep point {point} (did it fail? see "
                     "failures.csv): the timeline figure is left out")
    for note in notes + left_out(summary, requests if has_req else None, point):
        (say or _note)(note)
    # Built one at a time, so that only one figure is in memory at once.
    builders: list[tuple[str, Callable[[], Figure | None]]] = [
        ("breakdown", lambda: breakdown_figure(summary, meta)),
        (
            "timeline",
            lambda: timeline_figure(timeseries, summary, meta, point=point) if has_ts else None,
        ),
        (
            "address_map",
            lambda: (
                address_map_figure(requests, summary, meta, point=point, timeseries=timeseries)
                if has_req and (point is None or (_with_keys(requests)["point"] == point).any())
                else None
            ),
        ),
        ("capacity", lambda: capacity_figure(summary, meta)),
        ("lengths", lambda: lengths_figure(requests, meta, summary) if has_req else None),
        # (hybrid runs only: blocks per KV-cache group kind over time)
        ("groups", lambda: group_figure(timeseries, summary, meta, point) if has_ts else None),
    ]
    if point is not None:  # one point's figures, in files of their own (`point_stem`)
        builders = [(point_stem(name, point), build) for name, build in builders
                    if name in POINT_FIGURES]
    paths: list[Path] = []
    for name, build in builders:
        fig = build()
        if fig is not None:
            paths += save_figure(fig, out / name, svg or (out / f"{name}.svg").exists())
    return paths


#: The figures `kvfrag plot --point N` draws for one sweep point (the others show every
#: point whatever N is, so they are left as they are).
POINT_FIGURES = ("timeline", "address_map", "groups")


def point_stem(name: str, point: int) -> str:
    """The file stem of figure `name` drawn for sweep point `point` alone (`timeline-point3`):
    never the all-points figure's, which the report embeds and a run redraws."""
    return f"{name}-point{point}"


def is_point_figure(path: Path | str) -> bool:
    """Whether `path` is a one-point figure (`plots/timeline-point3.png`)."""
    stem = Path(path).stem
    return any(stem.startswith(f"{name}-point") and stem[len(name) + 6 :].isdigit()
               for name in POINT_FIGURES)


#: The figures drawn from each Parquet file of a results folder.
NEEDS: dict[str, tuple[str, ...]] = {
    "timeseries.parquet": ("timeline",),
    "requests.parquet": ("address_map", "lengths"),
}


def drawn_from(name: str, summary: pd.DataFrame | None = None) -> list[str]:
    """The figures drawn from Parquet file `name` (NEEDS), less the address map where the
    summary's kinds show that no allocator places slabs."""
    figures = list(NEEDS[name])
    kinds = summary["kind"] if summary is not None and "kind" in summary.columns else None
    if kinds is not None and not kinds.astype(str).isin(SLAB_KINDS).any():
        figures = [f for f in figures if f != "address_map"]
    return figures


def figures_text(figures: Sequence[str]) -> str:
    """`the timeline figure`, `the address map and request-lengths figures`."""
    words = {"address_map": "address map", "lengths": "request-lengths"}
    names = " and ".join(words.get(f, f) for f in figures)
    return f"the {names} figure{'s' if len(figures) > 1 else ''}"


def missing_notes(
    results_dir: Path | str,
    timeseries: pd.DataFrame | None,
    requests: pd.DataFrame | None,
    summary: pd.DataFrame | None = None,
) -> list[str]:
    """A line for each Parquet file that is missing (None) or has no rows, naming it and the
    figures left out for it."""
    notes = []
    for name, frame in (("timeseries.parquet", timeseries), ("requests.parquet", requests)):
        if frame is None or not len(frame):
            why = "is missing" if frame is None else "has no rows"
            figures = drawn_from(name, summary)
            verb = "are" if len(figures) > 1 else "is"
            notes.append(f"{Path(results_dir) / name} {why}: {figures_text(figures)} {verb} "
                         "left out")
    return notes


def left_out(
    summary: pd.DataFrame, requests: pd.DataFrame | None = None, point: int | None = None
) -> list[str]:
    """What the figures of these results leave out, a line for the allocators and one for the
    sweep points (none when they draw everything); each figure's title says it for itself.
    `requests`: to count the address map's slab allocators; `point`: the one sweep point the
    timeline and the address map draw (`kvfrag plot --point N`)."""
    summary = _with_keys(summary)
    labels = _labels(summary)
    points = sorted(int(p) for p in pd.unique(summary["point"]))
    slab = []
    if requests is not None and "offset_bytes" in requests.columns:
        slab = _slab_labels(requests, summary)
    notes = []
    if len(labels) > MAX_ALLOCATORS:
        text = f"the figures show {MAX_ALLOCATORS} of {len(labels):,} allocators"
        if len(slab) > MAX_ALLOCATORS:
            text += f" (the address map {MAX_ALLOCATORS} of {len(slab):,} slab allocators)"
        notes.append(f"{text}: the first {MAX_ALLOCATORS} in the scenario's order")
    if len(points) <= 1:
        return notes
    spaced = [("the breakdown", len(_breakdown_keep(labels, points)[1])),
              ("the capacity figure", len(spread(points, MAX_LINE_POINTS)))]
    first = []
    if point is None:
        first.append(("the timeline", len(_panel_keep(labels, points)[1])))
        if slab:
            first.append(("the address map", len(_panel_keep(slab, points)[1])))
    spaced = [(what, n) for what, n in spaced if n < len(points)]
    first = [(what, f"the first {n}") for what, n in first if n < len(points)]
    parts = []
    if spaced:
        parts.append(_shows(spaced) + " (evenly spaced, the first and last included)")
    if first:
        parts.append(_shows(first) + " (kvfrag plot --point N draws any one)")
    if parts:
        notes.append(f"of {len(points):,} sweep points, " + "; ".join(parts))
    return notes


def _shows(items: Sequence[tuple[str, object]]) -> str:
    """`the breakdown shows 6 and the capacity figure 50`, or `A and B show 6` when alike."""
    if len({str(n) for _, n in items}) == 1:
        whats = " and ".join(what for what, _ in items)
        return f"{whats} {'shows' if len(items) == 1 else 'show'} {items[0][1]}"
    (what, n), *rest = items
    return f"{what} shows {n}" + "".join(f" and {w} {m}" for w, m in rest)


def _note(line: str) -> None:
    """`plot_results`' default `say`: a line on stderr."""
    print(f"kvfrag: note: {line}", file=sys.stderr, flush=True)


def _folder_meta(
    results_dir: Path, meta: Mapping | None, requests: pd.DataFrame | None
) -> dict:
    """The caption's facts: the folder's (`load_meta`) over `meta`, with the workload as
    `kvfrag run` prints it (its source and the requests it holds)."""
    folder = load_meta(results_dir)
    merged = {**dict(meta or {}), **folder}
    if folder.get("scenario"):
        merged.pop("name", None)
    spec = folder.get("workload")
    if isinstance(spec, Mapping):
        count = None
        if requests is not None:
            req = _with_keys(requests)
            first = req[req["point"] == _first_point(req)]
            count = int((first["label"].astype(str) == _labels(first)[0]).sum())
        merged["workload"] = workload_text(spec, folder.get("seeds"), count)
    merged.pop("seeds", None)
    return merged


def workload_text(spec: Mapping, seeds: Sequence | None = None, count: int | None = None) -> str:
    """A resolved workload as `kvfrag run` names it: its trace's path, or `synthetic, seed N`
    (`seeds ...` when swept), with the number of requests; other mappings by their settings."""
    trace = spec.get("trace")
    if isinstance(trace, Mapping) and trace.get("path"):
        text = str(trace["path"])
    elif spec.get("synthetic") is not None:
        if seeds:
            text = f"synthetic, seeds {', '.join(map(str, seeds))}"
        else:
            text = f"synthetic, seed {spec.get('seed', 0)}"
    else:
        text = _describe(spec)
    return f"{text} ({count:,} requests)" if count else text


def load_meta(results_dir: Path | str) -> dict:
    """The caption's facts from `results_dir/scenario.resolved.yaml`, if it is there (missing
    file or keys: an empty or partial dict); `seeds` when the sweep is over workload.seed."""
    path = Path(results_dir) / "scenario.resolved.yaml"
    if not path.exists():
        return {}
    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(doc, Mapping):
        return {}
    meta: dict = {}
    if doc.get("name"):
        meta["scenario"] = str(doc["name"])
    model = doc.get("model")
    if isinstance(model, Mapping):
        model = model.get("name")
    if model:
        meta["model"] = str(model)
    for key in ("kv_budget", "max_model_len"):
        if doc.get(key) is not None:
            meta[key] = doc[key]
    if doc.get("workload") is not None:
        meta["workload"] = doc["workload"]
    sweep = doc.get("sweep")
    if isinstance(sweep, Mapping) and isinstance(sweep.get("workload.seed"), list):
        meta["seeds"] = sweep["workload.seed"]
    return meta


def redraw(results_dir: Path | str, svg: bool = False, point: int | None = None) -> list[Path]:
    """`kvfrag plot RESULTS_DIR [--svg] [--point N]`: redraw a results folder's figures from
    its files (PNG; SVG too with `svg`, and wherever an SVG was drawn before: see
    `plot_results`); with `point`, the timeline, the address map (and, for hybrid runs, the
    groups figure) of that sweep point alone, as `plots/timeline-pointN.png` and so on."""
    return plot_results(Path(results_dir), load_meta(results_dir), svg, point)


__all__ = [
    "FIGURES",
    "NEEDS",
    "POINT_FIGURES",
    "drawn_from",
    "figures_text",
    "is_point_figure",
    "left_out",
    "load_meta",
    "missing_notes",
    "plot_results",
    "point_stem",
    "redraw",
    "workload_text",
]
