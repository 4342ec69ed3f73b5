"""The figures: every file written (PNG, and SVG when asked for), decodable, not blank, listed
in the folder's manifest, never a stale SVG; the sweep variants; the geometry behind the address
map and the shapes its collections hold; meta loading for `kvfrag plot`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
import yaml
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.allocators.base import PARTS
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig

from kvfrag import (
    address_map_plots,
    breakdown_plots,
    capacity_plots,
    captions,
    figure_kit,
    lengths_plots,
    plots,
    results_io,
    sweep_plots,
    timeline_plots,
)
from kvfrag.outdir import MANIFEST

BPT = 819_200  # OPT-13B: bytes per token
CAP = 4 * 2**30
MML = 2048
ALLOCATORS = [
    ("slab-oracle", "contiguous", {"reserve": "oracle"}),
    ("buddy-pow2", "buddy", {"reserve": "pow2"}),
    ("paged-16", "paged", {"block_size": 16}),
]
META = {
    "scenario": "tiny",
    "model": "OPT-13B",
    "kv_budget": "4 GiB",
    "max_model_len": MML,
    "workload": "40 Poisson requests",
}


def _workload(n: int = 40, seed: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.cumsum(rng.exponential(0.1, n)),
            "prompt_tokens": rng.integers(10, 600, n),
            "output_tokens": rng.integers(10, 600, n),
        }
    )


def _write_results(folder: Path, allocators=ALLOCATORS, budgets=(CAP,)) -> Path:
    """A results folder as a run writes it: summary.csv and the two parquet files."""
    folder.mkdir(parents=True, exist_ok=True)
    wl = _workload()
    rows, series, requests = [], [], []
    sweep = len(budgets) > 1
    for point, cap in enumerate(budgets):
        for label, kind, opts in allocators:
            alloc = make_allocator(
                kind, capacity=cap, bytes_per_token=BPT, max_model_len=MML, **opts
            )
            res = run(wl, alloc, EngineConfig(max_num_batched_tokens=4096))
            # As summary.csv lays it out: the sweep keys between `point` and `model`.
            swept = {"kv_budget": f"{cap // 2**30} GiB"} if sweep else {}
            row = {
                "label": label,
                "kind": kind,
                "point": point,
                **swept,
                "model": "OPT-13B",
                "kv_budget_bytes": cap,
                **res.summary,
            }
            rows.append(row)
            for frame, out in ((res.timeseries, series), (res.requests, requests)):
                out.append(frame.assign(label=label, point=point))
    pd.DataFrame(rows).to_csv(folder / "summary.csv", index=False)
    pd.concat(series, ignore_index=True).to_parquet(folder / "timeseries.parquet")
    pd.concat(requests, ignore_index=True).to_parquet(folder / "requests.parquet")
    return folder


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return _write_results(tmp_path_factory.mktemp("results") / "tiny")


def _assert_drawn(path: Path) -> None:
    assert path.exists() and path.stat().st_size > 0, path
    if path.suffix == ".png":
        img = mpimg.imread(path)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200
        flat = img[..., :3].reshape(-1, 3)
        assert np.ptp(flat, axis=0).max() > 0.5  # not one colour
        assert len(np.unique(flat[:: max(len(flat) // 20000, 1)], axis=0)) > 10
    else:
        text = path.read_text()
        assert "<svg" in text and "</svg>" in text


def test_plot_results_writes_every_figure(tmp_path):
    """`kvfrag plot` (redraw): the scenario's meta in the caption, every figure as PNG (and as
    SVG when asked for), each written atomically; a second call overwrites."""
    folder = _write_results(tmp_path / "tiny")
    (folder / "scenario.resolved.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "tiny-redraw",
                "model": {"name": "OPT-13B", "layers": 40},
                "kv_budget": "4GiB",
                "workload": {"kind": "poisson", "requests": 40},
            }
        )
    )
    meta = plots.load_meta(folder)
    assert meta == {
        "scenario": "tiny-redraw",
        "model": "OPT-13B",
        "kv_budget": "4GiB",
        "workload": {"kind": "poisson", "requests": 40},
    }
    (folder / "plots").mkdir()
    (folder / "plots" / "breakdown.png").write_bytes(b"stale")
    paths = plots.redraw(folder)
    assert {p.name for p in paths} == {f"{f}.png" for f in plots.FIGURES}
    assert not list((folder / "plots").glob("*.svg"))
    paths = plots.redraw(folder, svg=True)
    names = {p.name for p in paths}
    assert names == {f"{f}.{ext}" for f in plots.FIGURES for ext in ("png", "svg")}
    for p in paths:
        assert p.parent == folder / "plots"
        _assert_drawn(p)
    leftovers = [p for p in (folder / "plots").iterdir() if p.name.endswith(".tmp")]
    assert not leftovers
    # Files are readable by others, like any other output (no 0600 temp-file mode).
    assert all(p.stat().st_mode & 0o044 for p in paths)
    svg = (folder / "plots" / "breakdown.svg").read_text()
    assert "tiny-redraw" in svg and "kind=poisson, requests=40" in svg


def test_load_meta_tolerates_missing_and_broken_files(tmp_path):
    assert plots.load_meta(tmp_path) == {}
    (tmp_path / "scenario.resolved.yaml").write_text("name: [unclosed\n")
    assert plots.load_meta(tmp_path) == {}
    (tmp_path / "scenario.resolved.yaml").write_text("- just\n- a list\n")
    assert plots.load_meta(tmp_path) == {}


def test_sweep_results(tmp_path):
    folder = _write_results(tmp_path / "sweep", ALLOCATORS[::2], budgets=(CAP, 2 * CAP))
    summary = pd.read_csv(folder / "summary.csv")
    assert sweep_plots.sweep_columns(summary) == ["kv_budget"]
    xlabel, xs, _, numeric = sweep_plots.sweep_axis(summary)
    assert numeric and xlabel == "KV budget (GiB)" and xs == {0: 4.0, 1: 8.0}
    fig = capacity_plots.capacity_figure(summary, META)
    assert fig.axes[0].get_xlabel() == "KV budget (GiB)"
    assert len(fig.axes[1].get_lines()) == 2  # a throughput line per allocator
    paths = plots.plot_results(folder, svg=True)
    assert {p.name for p in paths} >= {"capacity.png", "capacity.svg", "breakdown.png"}
    for p in paths:
        _assert_drawn(p)
    assert "KV budget: swept (4–8 GiB)" in captions.caption(None, summary)
    # One allocator swept: the timeline gets a panel per point, the breakdown a bar per point.
    ts = pd.read_parquet(folder / "timeseries.parquet")
    paged, paged_sum = ts[ts["label"] == "paged-16"], summary[summary["label"] == "paged-16"]
    fig = timeline_plots.timeline_figure(paged, paged_sum)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == [
        "kv_budget=4 GiB",
        "kv_budget=8 GiB",
    ]
    fig = breakdown_plots.breakdown_figure(paged_sum)
    ax, *zoom = fig.axes  # (and the zoom on the parts that hold no tokens, when they are small)
    names = zoom[0] if zoom else ax  # the bars' names go under the lowest row
    assert names.get_xlabel() == "KV budget (GiB)" and ax.get_title() == "paged-16"
    assert [t.get_text() for t in names.get_xticklabels()] == ["4", "8"]


def test_sweep_of_one_allocator_option():
    """A per-allocator key is empty for the other labels: the points still get its value."""
    rows = []
    for point, bs in enumerate((8, 16, 32)):
        for label in ("slab", "paged"):
            rows.append(
                {
                    "label": label,
                    "point": point,
                    "token_states_frac": 0.5,
                    "usable_free_frac": 0.5,
                    "mean_running": 3.0,
                    "max_running": 5,
                    "throughput_tok_s": 10.0 * (point + 1),
                    "allocators.paged.block_size": bs if label == "paged" else np.nan,
                }
            )
    summary = pd.DataFrame(rows)
    assert sweep_plots.sweep_columns(summary) == ["allocators.paged.block_size"]
    _, xs, text, numeric = sweep_plots.sweep_axis(summary)
    assert numeric and xs == {0: 8.0, 1: 16.0, 2: 32.0} and text[0] == "8"
    fig = breakdown_plots.breakdown_figure(summary)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles[:3] == ["block_size=8", "block_size=16", "block_size=32"]


def _rectangles(collection) -> np.ndarray:
    """(left, bottom, right, top) of each rectangle in a collection of bars, in data units."""
    corners = np.array([path.vertices[:4] for path in collection.get_paths()])
    return np.column_stack([corners[..., 0].min(1), corners[..., 1].min(1),
                            corners[..., 0].max(1), corners[..., 1].max(1)])


def test_breakdown_stacks_the_palette_in_order(results):
    """A collection per part, bottom up in the palette's colours, a rectangle per allocator in
    each; the stacks fill the budget."""
    summary = pd.read_csv(results / "summary.csv")
    fig = breakdown_plots.breakdown_figure(summary, META)
    ax = fig.axes[0]
    assert not ax.patches and not ax.containers  # no artist per bar
    # internal fragmentation is drawn as its two parts: over-reservation, then rounding
    drawn = ["token_states", "reserved", "internal_overreservation", "internal_rounding",
             "external", "usable_free"]
    assert [c.get_label() for c in ax.collections] == [figure_kit.PART_NAMES[p] for p in drawn]
    for collection, part in zip(ax.collections, drawn, strict=True):
        assert len(collection.get_paths()) == len(summary)  # one rectangle per allocator
        face = collection.get_facecolor()
        assert len(face) == 1 and np.allclose(face[0][:3], matplotlib_rgb(figure_kit.PALETTE[part]))
    assert ax.collections[3].get_hatch() == "///"
    # Results written before the split draw internal whole.
    split = [figure_kit.FRAC[p] for p in breakdown_plots.INTERNAL_SPLIT]
    old = breakdown_plots.breakdown_figure(summary.drop(columns=split), META)
    assert len(old.axes[0].collections) == len(PARTS)
    assert figure_kit.PALETTE["token_states"] == "#2ca02c"
    # Each bar is annotated with its token-states share.
    texts = [t.get_text() for t in ax.texts]
    expected = [f"{100 * v:.0f}%" for v in summary["token_states_frac"]]
    assert texts == expected
    # Each part sits on the one below, at its share; the stacks add up to the whole budget.
    rects = np.array([_rectangles(c) for c in ax.collections])  # (part, bar, ltrb)
    assert np.allclose(rects[1:, :, 1], rects[:-1, :, 3])
    shares = [summary[figure_kit.FRAC[p]].to_numpy(float) * 100 for p in drawn]
    assert np.allclose(rects[..., 3] - rects[..., 1], shares, atol=1e-9)
    assert np.allclose(rects[:, :, 2] - rects[:, :, 0], 0.7)
    assert np.allclose(rects[-1, :, 3], 100, atol=1e-6)


def matplotlib_rgb(color: str):
    from matplotlib.colors import to_rgb

    return to_rgb(color)


def test_address_map_geometry_and_truncation(results):
    requests = pd.read_parquet(results / "requests.parquet")
    summary = pd.read_csv(results / "summary.csv")
    slab = requests[requests["label"] == "slab-oracle"]
    polys = address_map_plots.slab_polygons(slab, BPT)
    n = len(slab)
    for part in ("token_states", "reserved", "internal", "outline"):
        assert polys[part].shape == (n, 6 if part in ("token_states", "reserved") else 4, 2)

    def area(p):  # shoelace, per polygon
        x, y = p[..., 0], p[..., 1]
        return 0.5 * np.abs(np.sum(x * np.roll(y, -1, 1) - np.roll(x, -1, 1) * y, axis=1))

    parts = area(polys["token_states"]) + area(polys["reserved"]) + area(polys["internal"])
    assert np.allclose(parts, area(polys["outline"]), rtol=1e-9, atol=1e-12)
    # Oracle slabs fit their request exactly: no internal fragmentation.
    assert np.allclose(area(polys["internal"]), 0)
    # Only contiguous and buddy labels get a panel; a cap on slabs says so in the title.
    fig = address_map_plots.address_map_figure(requests, summary, META, max_slabs=5)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert [t.split(":")[0] for t in titles] == ["slab-oracle", "buddy-pow2"]
    assert all(f"first 5 of {n} slabs" in t for t in titles)
    paged = requests[requests["label"] == "paged-16"]
    assert address_map_plots.address_map_figure(paged, summary) is None


def test_address_map_draws_every_slab_in_one_collection_per_part(results):
    """The address map holds a polygon per admitted slab in each part's collection (stored,
    reserved, internal, outline): as many as the run's records have slabs, no more artists."""
    requests = pd.read_parquet(results / "requests.parquet")
    summary = pd.read_csv(results / "summary.csv")
    fig = address_map_plots.address_map_figure(requests, summary, META)
    for ax in fig.axes:
        label = ax.get_title(loc="left")
        rows = requests[requests["label"] == label]
        slabs = int((rows["admitted_s"].notna() & rows["offset_bytes"].notna()).sum())
        assert slabs > 0
        assert not ax.patches and len(ax.collections) == 4, label
        assert [len(c.get_paths()) for c in ax.collections] == [slabs] * 4, label
        colors = [tuple(c.get_facecolor()[0][:3]) for c in ax.collections[:3]]
        expected = ["token_states", "reserved", "internal"]
        assert np.allclose(colors, [matplotlib_rgb(figure_kit.PALETTE[p]) for p in expected])


def test_timeline_resampling_keeps_areas(results):
    ts = pd.read_parquet(results / "timeseries.parquet")
    one = ts[ts["label"] == "paged-16"]
    columns = [*figure_kit.BYTES.values(), "running"]
    coarse = timeline_plots.resample(one, 7, columns)
    assert len(coarse) == 7
    for col in columns:
        assert np.isclose((coarse[col] * coarse["dt_s"]).sum(), (one[col] * one["dt_s"]).sum())
    fig = timeline_plots.timeline_figure(ts, None, META, max_segments=20)
    assert "time-averaged in 20 steps" in fig._suptitle.get_text()
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == [a[0] for a in ALLOCATORS]


def test_lengths_use_one_label(results):
    requests = pd.read_parquet(results / "requests.parquet")
    fig = lengths_plots.lengths_figure(requests, META)
    ax = fig.axes[0]
    assert "(40 requests)" in ax.get_title()
    assert len(ax.get_lines()) == 2
    assert ax.get_xlabel().startswith("length (tokens)")


def test_frames_without_label_or_point(results):
    """A single run's frames (no label, no point columns) can be drawn as they are."""
    ts = pd.read_parquet(results / "timeseries.parquet")
    one = ts[ts["label"] == "paged-16"].drop(columns=["label", "point"])
    fig = timeline_plots.timeline_figure(one)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["run"]


def test_format_bytes_and_caption():
    assert figure_kit.format_bytes(12 * 2**30) == "12 GiB"
    assert figure_kit.format_bytes(819_200) == "800 KiB"
    assert figure_kit.format_bytes(1.5 * 2**40) == "1.5 TiB"
    text = captions.caption(
        {
            "model": {"name": "OPT-13B"},
            "kv_budget": "12 GiB",
            "max_model_len": 2048,
            "workload": {"kind": "poisson", "n": 5},
        }
    )
    assert text == (
        "model: OPT-13B  ·  KV budget: 12 GiB  ·  max_model_len: 2048  ·  "
        "workload: kind=poisson, n=5"
    )


def test_slab_polygons_of_a_request_still_running_at_the_end():
    """Stopped runs: no finish; the slab is drawn as long as the request was at the end."""
    tokens_per_gib = 2**30 / BPT  # addresses are in GiB; compare them in tokens
    req = pd.DataFrame(
        {
            "admitted_s": [0.0],
            "first_token_s": [1.0],
            "finished_s": [np.nan],
            "released_s": [np.nan],
            "offset_bytes": [0.0],
            "peak_bytes": [2048 * BPT],
            "prompt_tokens": [99],
            "final_tokens": [1000],
            "tokens_at_end": [120],
        }
    )
    polys = address_map_plots.slab_polygons(req, BPT, end_s=3.0)
    stored = polys["token_states"][0]
    assert np.allclose(stored[:, 0], [0, 0, 1, 3, 3, 3])
    assert np.allclose(stored[:, 1] * tokens_per_gib, [0, 100, 100, 120, 120, 0])
    assert np.isclose(polys["outline"][0][:, 1].max() * tokens_per_gib, 2048)
    assert np.allclose(polys["internal"][0][:, 1] * tokens_per_gib, [1000, 1000, 2048, 2048])


def test_static_batching_slabs_are_held_until_their_batch_ends():
    req = pd.DataFrame(
        {
            "admitted_s": [0.0],
            "first_token_s": [1.0],
            "finished_s": [2.0],
            "released_s": [5.0],
            "offset_bytes": [0.0],
            "peak_bytes": [200 * BPT],
            "prompt_tokens": [99],
            "final_tokens": [150],
            "tokens_at_end": [0],
        }
    )
    polys = address_map_plots.slab_polygons(req, BPT)
    assert polys["outline"][0][:, 0].max() == 5.0
    stored = polys["token_states"][0]
    assert np.allclose(stored[:, 0], [0, 0, 1, 2, 5, 5])


# ---------------------------------------------------------------- damaged results files
def _csv_without(data: bytes, *columns: str) -> bytes:
    from io import BytesIO, StringIO

    frame = pd.read_csv(BytesIO(data)).drop(columns=list(columns))
    out = StringIO()
    frame.to_csv(out, index=False)
    return out.getvalue().encode()


def _csv_with(data: bytes, column: str, value: str) -> bytes:
    from io import BytesIO, StringIO

    frame = pd.read_csv(BytesIO(data))
    frame[column] = frame[column].astype(object)
    frame.loc[1, column] = value
    out = StringIO()
    frame.to_csv(out, index=False)
    return out.getvalue().encode()


TINY_SCENARIO = """\
name: tiny
model: opt-13b
kv_budget: 4GiB
max_model_len: 2048
workload:
  trace: {path: "sample:azure-conv"}
  transforms: {first_n: 40}
allocators:
  - {label: slab-oracle, kind: contiguous, reserve: oracle}
  - {label: paged-16, kind: paged, block_size: 16}
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A results folder as `kvfrag run` writes it (figures left out: they are redrawn)."""
    from kvfrag.cli import main

    base = tmp_path_factory.mktemp("written")
    (base / "tiny.yaml").write_text(TINY_SCENARIO)
    out = base / "tiny"
    assert main(["run", str(base / "tiny.yaml"), "-o", str(out), "-q", "--no-plots"]) == 0
    return out


def _copy(results: Path, folder: Path) -> Path:
    shutil.copytree(results, folder)
    return folder


DAMAGED_SUMMARIES = {
    "empty": (lambda d: b"", "empty file"),
    "blank lines": (lambda d: b"\n\n", "empty file"),
    "header only": (lambda d: d.split(b"\n")[0] + b"\n", "no rows, only a header"),
    "truncated last row": (lambda d: d[:-30], "truncated"),
    "truncated mid-file": (lambda d: d[: len(d) // 2], "truncated"),
    "truncated header": (lambda d: d[:50], "truncated"),
    "row cut short": (
        lambda d: d.split(b"\n")[0] + b"\n" + d.split(b"\n")[1][:40] + b"\n",
        "line 2 has",
    ),
    "garbage bytes": (lambda d: bytes(range(256)) * 8, "not a CSV written by kvfrag run"),
    "binary": (lambda d: b"PAR1\x00\x01\x02" + d, "not a CSV written by kvfrag run"),
    "foreign csv": (lambda d: b"name,value\na,1\nb,2\n", "not a CSV written by kvfrag run"),
    "missing columns": (
        lambda d: _csv_without(d, "label", "token_states_frac"),
        "missing columns label, token_states_frac",
    ),
    "part not a number": (
        lambda d: _csv_with(d, "token_states_frac", "n/a"),
        "column token_states_frac holds values that are not numbers",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGED_SUMMARIES))
def test_damaged_summary_is_a_clear_error(written, tmp_path, capsys, damage):
    """`kvfrag plot` on a damaged summary.csv: one line naming the file and the damage, exit 2,
    nothing drawn (pandas alone would read most of these into nothing, or NaN rows)."""
    from kvfrag.cli import main

    make, expected = DAMAGED_SUMMARIES[damage]
    folder = _copy(written, tmp_path / "damaged")
    path = folder / "summary.csv"
    path.write_bytes(make(path.read_bytes()))
    with pytest.raises(results_io.ResultsFileError) as caught:
        plots.redraw(folder)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message
    assert main(["plot", str(folder)]) == 2
    assert capsys.readouterr().err == f"kvfrag: error: {message}\n"
    assert not (folder / "plots").exists()


DAMAGED_PARQUET = {
    "truncated": (lambda p: p.read_bytes()[: p.stat().st_size // 2], "not a readable Parquet file"),
    "cut at the end": (lambda p: p.read_bytes()[:-8], "not a readable Parquet file"),
    "empty": (lambda p: b"", "not a readable Parquet file"),
    "garbage": (lambda p: bytes(range(256)) * 8, "not a readable Parquet file"),
}


@pytest.mark.parametrize("name", ["timeseries.parquet", "requests.parquet"])
@pytest.mark.parametrize("damage", list(DAMAGED_PARQUET))
def test_damaged_parquet_is_a_clear_error(written, tmp_path, capsys, name, damage):
    from kvfrag.cli import main

    make, expected = DAMAGED_PARQUET[damage]
    folder = _copy(written, tmp_path / "damaged")
    path = folder / name
    path.write_bytes(make(path))
    with pytest.raises(results_io.ResultsFileError) as caught:
        plots.redraw(folder)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message
    assert main(["plot", str(folder)]) == 2
    assert capsys.readouterr().err == f"kvfrag: error: {message}\n"
    assert not (folder / "plots").exists()


def test_summary_of_a_run_where_every_point_failed(written, tmp_path):
    """`kvfrag run` writes an empty summary when no point finished: say so, not 'damaged'."""
    folder = _copy(written, tmp_path / "failed")
    (folder / "summary.csv").write_text("\n")
    (folder / "failures.csv").write_text("label,point,error\npaged-16,0,boom\n")
    with pytest.raises(results_io.ResultsFileError, match=r"every run failed: see failures\.csv"):
        plots.redraw(folder)


def test_parquet_without_the_columns_figures_need(written, tmp_path):
    folder = _copy(written, tmp_path / "damaged")
    pd.read_parquet(folder / "timeseries.parquet").drop(columns=["t_s"]).to_parquet(
        folder / "timeseries.parquet"
    )
    with pytest.raises(results_io.ResultsFileError,
                       match=r"timeseries\.parquet: missing columns t_s$"):
        plots.redraw(folder)


def test_a_run_that_rejected_everything_is_drawn(written, tmp_path, capsys):
    """`kvfrag run` with a budget that holds no request: every request is rejected, the parts
    still sum to 1, the reasons are counted, and the folder plots."""
    from kvfrag.cli import main

    out = tmp_path / "none-fit"
    scenario = written.parent / "tiny.yaml"
    args = ["run", str(scenario), "-o", str(out), "-q", "--set", "kv_budget=1MiB"]
    assert main(args) == 0
    summary = results_io.read_summary(out / "summary.csv")
    assert (summary["requests"] > 0).all() and (summary["completed"] == 0).all()
    assert (summary["rejected"] == summary["requests"]).all()
    assert (summary["rejected_too_large"] == summary["requests"]).all()
    sums = summary[[figure_kit.FRAC[p] for p in PARTS]].sum(axis=1)
    assert np.allclose(sums, 1.0, rtol=0, atol=1e-12)
    assert [p.name for p in (out / "plots").glob("breakdown.*")] == ["breakdown.png"]
    capsys.readouterr()
    assert main(["plot", str(out)]) == 0


# ------------------------------------------------------------------ formats and the manifest
def _manifest_files(folder: Path) -> set[str]:
    """The files a folder's manifest lists, checked to be exactly the files in it."""
    listed = set(json.loads((folder / MANIFEST).read_text())["files"])
    on_disk = {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != MANIFEST
    }
    assert listed == on_disk
    return listed


@pytest.mark.parametrize("svg", [False, True], ids=["default", "--svg"])
def test_run_writes_svg_only_when_asked_and_lists_it(written, tmp_path, svg):
    """`kvfrag run`: PNG figures only by default, SVG too with --svg; the manifest lists
    exactly what was written either way."""
    from kvfrag.cli import main

    out = tmp_path / "run"
    args = ["run", str(written.parent / "tiny.yaml"), "-o", str(out), "-q", "-j", "1"]
    assert main(args + (["--svg"] if svg else [])) == 0
    files = _manifest_files(out)
    pngs = {f"plots/{f}.png" for f in plots.FIGURES}
    svgs = {f"plots/{f}.svg" for f in plots.FIGURES}
    assert pngs <= files
    assert {f for f in files if f.startswith("plots/")} == (pngs | svgs if svg else pngs)
    for name in sorted(files & svgs):
        _assert_drawn(out / name)


def test_plot_never_leaves_a_stale_svg(written, tmp_path, capsys):
    """`kvfrag plot --svg`, then `kvfrag plot`: the SVGs the first drew are drawn again by the
    second (from the current files, as its PNGs are), listed in the manifest, and printed."""
    from kvfrag.cli import main

    folder = _copy(written, tmp_path / "r")
    assert main(["plot", str(folder)]) == 0
    assert not list((folder / "plots").glob("*.svg"))  # PNG only, unless asked
    assert main(["plot", str(folder), "--svg"]) == 0
    svgs = sorted((folder / "plots").glob("*.svg"))
    assert {p.name for p in svgs} == {f"{f}.svg" for f in plots.FIGURES}
    assert {f"plots/{p.name}" for p in svgs} <= _manifest_files(folder)
    # Something the captions show changes; a plain `kvfrag plot` must not leave the SVGs
    # showing the old scenario name beside PNGs that show the new one.
    resolved = folder / "scenario.resolved.yaml"
    doc = yaml.safe_load(resolved.read_text())
    doc["name"] = "renamed-since"
    resolved.write_text(yaml.safe_dump(doc, sort_keys=False))
    capsys.readouterr()
    assert main(["plot", str(folder)]) == 0
    printed = capsys.readouterr().out.split("\n")
    for svg in svgs:
        assert str(svg) in printed
        assert "renamed-since" in svg.read_text()
    assert sorted((folder / "plots").glob("*.svg")) == svgs
    assert {f"plots/{p.name}" for p in svgs} <= _manifest_files(folder)


# ------------------------------------------------- figures that are right for every scenario
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def beams(tmp_path_factory) -> Path:
    """sharing-beam-search as shipped: beam widths 2, 4, 6 on buddy slabs and paged blocks."""
    from kvfrag.cli import main

    out = tmp_path_factory.mktemp("beams") / "sharing-beam-search"
    scenario = ROOT / "scenarios" / "sharing-beam-search.yaml"
    assert main(["run", str(scenario), "-o", str(out), "-q", "--no-plots", "-j", "1"]) == 0
    return out


def _overlapping_pairs(rects: np.ndarray) -> int:
    """Pairs of (left, bottom, right, top) rectangles whose interiors intersect."""
    rects = rects[np.argsort(rects[:, 0], kind="stable")]
    pairs = 0
    for i, (_, bottom, right, top) in enumerate(rects):
        for other in rects[i + 1:]:
            if other[0] >= right:
                break  # sorted by left edge: no later one starts before this one ends
            if other[1] < top and bottom < other[3]:
                pairs += 1
    return pairs


def test_address_map_of_beams_draws_slabs_where_they_are(beams):
    """Each beam keeps a slab of its own: drawing a request's first slab as tall as all of its
    beams' slabs put slabs over one another and past the budget (220 overlapping pairs at width
    2, request 0 at 11.74 GB + 1.68 GB in 12 GiB). Now every live slab drawn is one slab where
    it is: no two overlap, none passes the budget, and every point is drawn."""
    requests = pd.read_parquet(beams / "requests.parquet")
    summary = results_io.read_summary(beams / "summary.csv")
    ts = pd.read_parquet(beams / "timeseries.parquet")
    fig = address_map_plots.address_map_figure(requests, summary, timeseries=ts)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert [t.split(":")[0] for t in titles] == [
        f"orca-oracle  ·  beam_width={w}" for w in (2, 4, 6)
    ]
    assert not any("1st of" in t for t in titles)  # every beam's slab is placed
    assert address_map_plots.SLAB_OFFSETS in requests.columns
    budget = 12 * 2**30 / 2**30  # GiB, the axis' unit
    for ax, width in zip(fig.axes, (2, 4, 6), strict=True):
        assert ax.get_ylabel() == "address (GiB)" and ax.get_ylim() == (0, budget)
        outline = ax.collections[3]
        rects = _rectangles(outline)
        assert len(rects) == 600 * width  # one per beam
        assert _overlapping_pairs(rects) == 0
        assert rects[:, 3].max() <= budget + 1e-9
        # Each rectangle is one beam's slab: the request's bytes over its beams.
        point = requests["point"] == width // 2 - 1
        rows = requests[(requests["label"] == "orca-oracle") & point]
        assert (address_map_plots.sequences(rows) == width).all()
        assert (rows[address_map_plots.SLAB_OFFSETS].map(len) == width).all()
        heights = np.sort(rects[:, 3] - rects[:, 1])
        expect = np.sort(np.repeat(rows["peak_bytes"].to_numpy() / width / 2**30, width))
        assert np.allclose(heights, expect)


def test_address_map_draws_every_slab_of_several_sequences_where_results_list_them():
    """With each sequence's offset in the results (`slab_offsets_bytes`), every slab is drawn."""
    one = 100 * BPT
    req = pd.DataFrame(
        {
            "label": "slab", "point": 0, "status": "completed",
            "admitted_s": [0.0, 1.0], "first_token_s": [0.5, 1.5], "finished_s": [3.0, 4.0],
            "released_s": [3.0, 4.0], "offset_bytes": [0, 2 * one], "peak_bytes": [2 * one, one],
            "prompt_tokens": [50, 50], "output_tokens": [50, 50], "generated_tokens": [100, 50],
            "final_tokens": [100, 100], "tokens_at_end": [0, 0],
            address_map_plots.SLAB_OFFSETS: [[0, 3 * one], [2 * one]],
        }
    )
    summary = pd.DataFrame({"label": ["slab"], "point": [0], "kind": ["contiguous"],
                            "kv_budget_bytes": [4 * one], "bytes_per_token": [BPT],
                            **{figure_kit.FRAC[p]: [0.2] for p in PARTS}})
    fig = address_map_plots.address_map_figure(req, summary)
    (ax,) = fig.axes
    unit, size = figure_kit.byte_unit(4 * one)
    assert ax.get_ylabel() == f"address ({unit})"
    rects = _rectangles(ax.collections[3]) * size / one  # in slabs
    assert np.allclose(sorted(rects[:, 1]), [0, 2, 3])
    assert np.allclose(rects[:, 3] - rects[:, 1], 1)
    assert ax.get_title(loc="left") == "slab"  # nothing left out, nothing to note


def _sweep_results(tmp_path: Path) -> Path:
    return _write_results(tmp_path / "sweep", ALLOCATORS, budgets=(CAP, 2 * CAP))


def test_every_sweep_point_is_drawn_and_plot_picks_one(tmp_path):
    """The timeline and the address map draw every point of a sweep (a row or column each);
    `point` (kvfrag plot --point N) draws one; a point the sweep lacks is an error."""
    folder = _sweep_results(tmp_path)
    summary = results_io.read_summary(folder / "summary.csv")
    ts = pd.read_parquet(folder / "timeseries.parquet")
    requests = pd.read_parquet(folder / "requests.parquet")
    fig = timeline_plots.timeline_figure(ts, summary)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == [f"{lb}  ·  kv_budget={b} GiB" for b in (4, 8) for lb, _, _ in ALLOCATORS]
    fig = address_map_plots.address_map_figure(requests, summary, timeseries=ts)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles == [f"{lb}  ·  kv_budget={b} GiB" for lb in ("slab-oracle", "buddy-pow2")
                      for b in (4, 8)]
    # A panel's budget is its own point's.
    assert [ax.get_ylim()[1] for ax in fig.axes] == [4, 8, 4, 8]
    one = timeline_plots.timeline_figure(ts, summary, point=1)
    assert [ax.get_title() for ax in one.axes if ax.get_title()] == [a[0] for a in ALLOCATORS]
    assert "(kv_budget=8 GiB)" in one._suptitle.get_text()
    one = address_map_plots.address_map_figure(requests, summary, point=1)
    assert [ax.get_title(loc="left") for ax in one.axes] == ["slab-oracle", "buddy-pow2"]
    with pytest.raises(ValueError, match=r"no sweep point 5 \(its points: 0, 1\)"):
        plots.redraw(folder, point=5)
    paths = plots.redraw(folder, point=1)  # its own files: the all-points figures stay
    assert {p.name for p in paths} == {"timeline-point1.png", "address_map-point1.png"}
    assert all(plots.is_point_figure(p) for p in paths)


def test_more_points_than_panels_say_which_are_left_out(results):
    ts = pd.read_parquet(results / "timeseries.parquet")
    paged = ts[ts["label"] == "paged-16"]
    many = pd.concat([paged.assign(point=p) for p in range(figure_kit.MAX_PANELS + 2)])
    fig = timeline_plots.timeline_figure(many)
    assert len([ax for ax in fig.axes if ax.get_title()]) == figure_kit.MAX_PANELS
    assert "sweep points 16–17 not drawn" in fig._suptitle.get_text()
    assert "--point N" in fig._suptitle.get_text()


SWEPT_WORKLOADS = [
    {"trace": {"path": "sample:azure-conv"}, "transforms": {"first_n": 150}, "n": 2},
    {"trace": {"path": "sample:azure-conv"}, "transforms": {"first_n": 150}, "n": 4},
    {"trace": {"path": "sample:azure-conv"}, "transforms": {"first_n": 150}, "beam_width": 3},
]


def _texts(fig) -> list[str]:
    texts = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        texts += [ax.get_title(loc=loc) for loc in ("left", "center", "right")]
        texts += [ax.get_xlabel(), ax.get_ylabel()]
        texts += [t.get_text() for t in (*ax.texts, *ax.get_xticklabels())]
    return [t for t in texts if t]


def test_swept_mappings_get_short_labels(results):
    """A sweep over whole mappings (validate-sharing's workloads) is labelled as the table
    labels it, by the keys that differ, in every figure: no JSON in titles or ticks."""
    base = pd.read_csv(results / "summary.csv")
    rows = []
    for point, workload in enumerate(SWEPT_WORKLOADS):
        part = base.copy()
        part.insert(part.columns.get_loc("point") + 1, "workload", json.dumps(workload))
        rows.append(part.assign(point=point))
    summary = pd.concat(rows, ignore_index=True)
    assert sweep_plots.point_names(summary) == {0: "n=2", 1: "n=4", 2: "beam_width=3"}
    fig = breakdown_plots.breakdown_figure(summary)
    assert [ax.get_title() for ax in fig.axes[:3]] == ["n=2", "n=4", "beam_width=3"]
    cap = capacity_plots.capacity_figure(summary)
    assert [t.get_text() for t in cap.axes[-1].get_xticklabels()] == ["n=2", "n=4", "beam_width=3"]
    for figure in (fig, cap):
        assert not [t for t in _texts(figure) if "{" in t or '"' in t]


def test_axes_are_in_units_that_fit_the_budget(tmp_path):
    """A 16 MiB budget is drawn on a MiB axis (0-16), not a GiB one (0.000-0.014)."""
    assert figure_kit.byte_unit(16 * 2**20) == ("MiB", 2**20)
    assert figure_kit.byte_unit(12 * 2**30) == ("GiB", 2**30)
    folder = _write_results(tmp_path / "small", ALLOCATORS, budgets=(900 * 2**20,))
    summary = results_io.read_summary(folder / "summary.csv")
    ts = pd.read_parquet(folder / "timeseries.parquet")
    requests = pd.read_parquet(folder / "requests.parquet")
    fig = timeline_plots.timeline_figure(ts, summary)
    memory = [ax for ax in fig.axes if ax.get_ylabel().startswith("KV memory")]
    assert memory and memory[0].get_ylabel() == "KV memory (MiB)"
    assert 900 <= memory[0].get_ylim()[1] < 901
    fig = address_map_plots.address_map_figure(requests, summary)
    assert fig.axes[0].get_ylabel() == "address (MiB)" and fig.axes[0].get_ylim() == (0, 900)
    assert "KV budget: 900 MiB" in captions.caption(None, summary)


def test_captions_are_the_same_from_run_and_plot(written, tmp_path):
    """`kvfrag run` and `kvfrag plot` of one folder draw the same figures, byte for byte (the
    caption's facts come from the folder, whatever the caller passes); a KV budget given as a
    GPU's terms reads as bytes, not as the raw mapping."""
    from kvfrag.cli import main

    out = tmp_path / "run"
    assert main(["run", str(written.parent / "tiny.yaml"), "-o", str(out), "-q", "-j", "1"]) == 0
    drawn = {p.name: p.read_bytes() for p in (out / "plots").glob("*.png")}
    assert main(["plot", str(out)]) == 0
    assert {p.name: p.read_bytes() for p in (out / "plots").glob("*.png")} == drawn
    summary = results_io.read_summary(out / "summary.csv")
    meta = {"kv_budget": {"gpu_memory": 40 * 2**30, "utilization": 0.9}}
    assert "KV budget: 4 GiB (derived)" in captions.caption(meta, summary)
    assert "gpu_memory" not in captions.caption(meta, summary)
    meta = plots._folder_meta(out, {"workload": "anything the caller says"}, None)
    assert meta["workload"] == "sample:azure-conv"
    assert plots.workload_text({"synthetic": {"count": 5}, "seed": 3}, None, 1500) == (
        "synthetic, seed 3 (1,500 requests)"
    )


def test_small_parts_get_a_zoom(results):
    """When reserved, internal and external are small, a row below the bars shows only them
    on an axis that fits (a block-size sweep's 0-8 % is a sliver on a 0-100 % bar)."""
    summary = pd.read_csv(results / "summary.csv")
    paged = summary[summary["label"] == "paged-16"].copy()
    for part, value in (("token_states", 0.77), ("reserved", 0.058), ("internal", 0.022),
                        ("internal_overreservation", 0.0), ("internal_rounding", 0.022),
                        ("external", 0.0), ("usable_free", 0.15)):
        paged[figure_kit.FRAC[part]] = value
    fig = breakdown_plots.breakdown_figure(paged)
    bars, zoom = fig.axes
    assert [t.get_text() for t in zoom.texts] == ["8.0%"]
    assert 8.0 < zoom.get_ylim()[1] <= 12.0 and bars.get_ylim() == (0, 100)
    assert len(zoom.collections) == 4  # reserved, the two internal parts, external
    wasteful = summary.copy()
    wasteful["internal_frac"] = wasteful["internal_rounding_frac"] = 0.5
    assert len(breakdown_plots.breakdown_figure(wasteful).axes) == 1


def test_the_capacity_figure_shows_what_a_scenario_is_about(results):
    """Latency always; prefix-cache hits, memory saved by sharing and compaction stall only
    where a run shows them."""
    summary = pd.read_csv(results / "summary.csv")
    titles = [ax.get_title().split("\n")[0] for ax in capacity_plots.capacity_figure(summary).axes
              if ax.get_visible()]
    assert titles == ["Requests running at once", "Throughput", "Latency"]
    special = summary.copy()
    special["prefix_hit_rate_tokens"] = [0.0, 0.0, 0.061]
    special["memory_saved_by_sharing_frac"] = [0.0, 0.0, 0.49]
    special["compactions"], special["stall_s"] = [693, 0, 0], [2.27, 0.0, 0.0]
    special["bytes_moved"] = [3.5e12, 0, 0]
    fig = capacity_plots.capacity_figure(special)
    axes = {ax.get_title().split("\n")[0]: ax for ax in fig.axes if ax.get_visible()}
    assert list(axes) == ["Requests running at once", "Throughput", "Latency",
                          "Prefix cache hits", "Memory saved by sharing", "Compaction stall"]
    assert "6.1%" in [t.get_text() for t in axes["Prefix cache hits"].texts]
    assert "49.0%" in [t.get_text() for t in axes["Memory saved by sharing"].texts]
    stall = [t.get_text() for t in axes["Compaction stall"].texts]
    assert stall[0].startswith("2.27 s\n693 compactions")
    sweep = pd.concat([special.assign(point=0), special.assign(point=1)])
    sweep.insert(sweep.columns.get_loc("point") + 1, "workload.n", [1, 1, 1, 2, 2, 2])
    axes = [ax for ax in capacity_plots.capacity_figure(sweep).axes if ax.get_visible()]
    assert len(axes) == 6 and all(len(ax.get_lines()) >= len(ALLOCATORS) for ax in axes)


def test_panels_with_nothing_to_draw_say_why(results):
    """An allocator whose slabs compaction moved, one that admitted nothing, and a run with
    no records over time: each panel says why it is empty."""
    requests = pd.read_parquet(results / "requests.parquet")
    summary = pd.read_csv(results / "summary.csv")
    moved = summary.assign(compactions=[3, 0, 0], bytes_moved=[2**30, 0, 0], stall_s=[0.5, 0, 0])
    fig = address_map_plots.address_map_figure(requests, moved)
    first = fig.axes[0]
    assert not first.collections
    assert "3 compactions moved 1 GiB" in first.texts[0].get_text()
    assert len(fig.axes[1].collections) == 4  # the buddy's slabs are drawn as ever
    none = requests.copy()
    buddy = none["label"] == "buddy-pow2"
    none.loc[buddy, "admitted_s"] = np.nan
    none.loc[buddy, "reason"] = "too_large"
    fig = address_map_plots.address_map_figure(none, summary.assign(label=summary["label"]))
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any("no request was admitted (rejected: too_large 40)" in t for t in texts)
    ts = pd.read_parquet(results / "timeseries.parquet")
    two = pd.concat([ts.assign(point=0), ts[ts["label"] != "paged-16"].assign(point=1)])
    fig = timeline_plots.timeline_figure(two, pd.concat([summary.assign(point=p) for p in (0, 1)]))
    said = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert len(said) == 1 and "no records" in said[0]


def test_torch_addresses_are_drawn_from_its_first_segment(results):
    """torch's caching allocator hands out virtual addresses from 0x7F0000000000 and never
    reuses a segment's: drawn from its first segment, on an axis as tall as they reach."""
    from kvfrag.sim.allocators.torch_blocks import ADDRESS_BASE

    requests = pd.read_parquet(results / "requests.parquet")
    summary = pd.read_csv(results / "summary.csv")
    slab = requests["label"] == "slab-oracle"
    requests.loc[slab, "offset_bytes"] = requests.loc[slab, "offset_bytes"] + ADDRESS_BASE
    summary.loc[summary["label"] == "slab-oracle", "kind"] = "torch-caching"
    fig = address_map_plots.address_map_figure(requests, summary)
    ax = fig.axes[0]
    assert "virtual addresses" in ax.get_title(loc="left")
    assert ax.get_ylabel() == "virtual address (GiB)"
    rects = _rectangles(ax.collections[3])
    assert rects[:, 1].min() >= 0 and rects[:, 3].max() <= ax.get_ylim()[1] <= 4


# --------------------------------------------------------------- compaction: slabs that move
@pytest.fixture(scope="module")
def compaction(tmp_path_factory) -> Path:
    """compaction as shipped: first fit without and with compaction, and paged blocks."""
    from kvfrag.cli import main

    out = tmp_path_factory.mktemp("compaction") / "compaction"
    scenario = ROOT / "scenarios" / "compaction.yaml"
    assert main(["run", str(scenario), "-o", str(out), "-q", "--no-plots", "-j", "1"]) == 0
    return out


def _overlapping_pieces(rects: np.ndarray) -> int:
    """Pairs of (left, bottom, right, top) rectangles of positive width that overlap in both
    time and address."""
    return _overlapping_pairs(rects[rects[:, 2] > rects[:, 0]])


def test_address_map_draws_slabs_moved_by_compaction_piece_by_piece(compaction):
    """The results record where each slab moved: compacting allocators' slabs are drawn a
    piece per place they were held, all within the budget, none over another."""
    requests = pd.read_parquet(compaction / "requests.parquet")
    summary = results_io.read_summary(compaction / "summary.csv")
    assert address_map_plots.MOVE_T in requests.columns
    fig = address_map_plots.address_map_figure(requests, summary)
    axes = {ax.get_title(loc="left").split(":")[0]: ax for ax in fig.axes}
    assert list(axes) == ["first-fit", "compact-1.6TBps", "compact-0.8TBps"]
    budget = 8.0  # GiB
    for label, ax in axes.items():
        assert not ax.texts, label  # drawn, not explained away
        rows = requests[requests["label"] == label]
        compacted = summary.loc[summary["label"] == label, "compactions"].iloc[0] > 0
        assert compacted == (label != "first-fit")
        rects = _rectangles(ax.collections[3])
        pieces = rows[address_map_plots.MOVE_T].map(len).sum() if compacted else len(rows)
        assert 0 < len(rects) <= pieces and (len(rects) > len(rows)) == compacted
        assert _overlapping_pieces(rects) == 0, label
        assert rects[:, 1].min() >= 0 and rects[:, 3].max() <= budget + 1e-9
    # Results from before moves were recorded: the panel says why it is not drawn.
    moves = [address_map_plots.MOVE_T, address_map_plots.MOVE_OFFSET]
    old = address_map_plots.address_map_figure(requests.drop(columns=moves), summary)
    said = [t.get_text() for ax in old.axes for t in ax.texts]
    assert len(said) == 2 and all("is not known" in " ".join(t.split()) for t in said)


def test_pieces_of_a_moved_slab_keep_its_parts_continuous():
    """A slab moved twice: three pieces at their offsets, from admission to release, whose
    stored part grows across them as the unmoved slab's would."""
    one = 100 * BPT
    req = pd.DataFrame(
        {
            "request_id": [7], "admitted_s": [0.0], "first_token_s": [1.0],
            "finished_s": [5.0], "released_s": [5.0], "offset_bytes": [0],
            "peak_bytes": [one], "prompt_tokens": [19], "final_tokens": [80],
            "tokens_at_end": [0],
            address_map_plots.MOVE_T: [[0.0, 3.0, 4.0]],
            address_map_plots.MOVE_OFFSET: [[2 * one, one, 0]],
        }
    )
    pieces = address_map_plots.slab_pieces(req)
    assert list(pieces["offset_bytes"]) == [2 * one, one, 0]
    moves = [address_map_plots.MOVE_T, address_map_plots.MOVE_OFFSET]
    whole = address_map_plots.slab_polygons(req.drop(columns=moves), BPT, scale=one)
    cut = address_map_plots.slab_polygons(pieces, BPT, scale=one)
    outline = cut["outline"]
    assert np.allclose(outline[:, 0, 0], [0, 3, 4]) and np.allclose(outline[:, 1, 0], [3, 4, 5])
    assert np.allclose(outline[:, 0, 1], [2, 1, 0]) and np.allclose(outline[:, 2, 1], [3, 2, 1])

    def stored_top(polys: np.ndarray, base: np.ndarray, t: float) -> float:
        """The stored part's height at `t` in the piece that holds it."""
        for poly, b in zip(polys, base, strict=True):
            xs, ys = poly[1:5, 0], poly[1:5, 1] - b
            if xs[0] <= t <= xs[-1]:
                return float(np.interp(t, xs, ys))
        raise AssertionError(t)

    for t in (0.0, 0.5, 1.0, 2.0, 3.0, 3.5, 4.0, 4.5, 5.0):
        expect = stored_top(whole["token_states"], np.zeros(1), t)
        assert stored_top(cut["token_states"], np.array([2, 1, 0]), t) == pytest.approx(expect)
    # At each move both pieces meet at the same height above their offsets.
    ts = cut["token_states"]
    assert ts[0, 4, 1] - 2 == pytest.approx(ts[1, 1, 1] - 1)
    assert ts[1, 4, 1] - 1 == pytest.approx(ts[2, 1, 1])


def test_a_sweep_over_the_model_is_named_by_the_model(results):
    """A sweep over `model` (and max_model_len) names its points by the model's name, not by
    the bytes per token that follow from it, and the caption says the model was swept."""
    base = pd.read_csv(results / "summary.csv")
    rows = []
    for point, (model, mml, bpt) in enumerate([("gemma-3-27b", 4096, 507904),
                                               ("gpt-oss-120b", 4096, 73728),
                                               ("gpt-oss-120b", 8192, 73728)]):
        part = base.drop(columns=["point", "model", "max_model_len", "bytes_per_token"],
                         errors="ignore")
        # as summary.csv lays it out: the sweep keys after `point`, the settings from hardware
        front = pd.DataFrame({"label": part.pop("label"), "kind": part.pop("kind"),
                              "point": point, "model": model, "max_model_len": mml,
                              "hardware": "", "bytes_per_token": bpt})
        rows.append(pd.concat([front, part], axis=1))
    summary = pd.concat(rows, ignore_index=True)
    names = sweep_plots.point_names(summary)
    assert names == {0: "model=gemma-3-27b, max_model_len=4096",
                     1: "model=gpt-oss-120b, max_model_len=4096",
                     2: "model=gpt-oss-120b, max_model_len=8192"}
    text = captions.caption(None, summary)
    assert "model: swept (gemma-3-27b, gpt-oss-120b)" in text
    assert "72–496 KiB per token per point" in text
