"""The figures: every file written (PNG and SVG), decodable, not blank; the sweep variants;
the geometry behind the address map; meta loading for `kvfrag plot`."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
import yaml

from kvfrag import plots
from sim.allocators import make_allocator
from sim.engine import EngineConfig, run

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
    """`kvfrag plot` (redraw): the scenario's meta in the caption, every figure, both formats,
    each written atomically; a second call overwrites."""
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
    assert plots.sweep_columns(summary) == ["kv_budget"]
    xlabel, xs, _, numeric = plots.sweep_axis(summary)
    assert numeric and xlabel == "KV budget (GiB)" and xs == {0: 4.0, 1: 8.0}
    fig = plots.capacity_figure(summary, META)
    assert fig.axes[0].get_xlabel() == "KV budget (GiB)"
    assert len(fig.axes[1].get_lines()) == 2  # a throughput line per allocator
    paths = plots.plot_results(folder)
    assert {p.name for p in paths} >= {"capacity.png", "capacity.svg", "breakdown.png"}
    for p in paths:
        _assert_drawn(p)
    assert "swept (4 GiB–8 GiB)" in plots.caption(None, summary)
    # One allocator swept: the timeline gets a panel per point, the breakdown a bar per point.
    ts = pd.read_parquet(folder / "timeseries.parquet")
    paged, paged_sum = ts[ts["label"] == "paged-16"], summary[summary["label"] == "paged-16"]
    fig = plots.timeline_figure(paged, paged_sum)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == [
        "kv_budget = 4 GiB",
        "kv_budget = 8 GiB",
    ]
    fig = plots.breakdown_figure(paged_sum)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "KV budget (GiB)" and ax.get_title() == "paged-16"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "8"]


def test_sweep_of_one_allocator_option():
    """A per-allocator key is empty for the other labels: the points still get its value."""
    rows = []
    for point, bs in enumerate((8, 16, 32)):
        for label in ("slab", "paged"):
            rows.append(
                {
                    "label": label,
                    "point": point,
                    "token_states": 0.5,
                    "usable_free": 0.5,
                    "mean_running": 3.0,
                    "max_running": 5,
                    "throughput_tok_s": 10.0 * (point + 1),
                    "allocators.paged.block_size": bs if label == "paged" else np.nan,
                }
            )
    summary = pd.DataFrame(rows)
    assert plots.sweep_columns(summary) == ["allocators.paged.block_size"]
    _, xs, text, numeric = plots.sweep_axis(summary)
    assert numeric and xs == {0: 8.0, 1: 16.0, 2: 32.0} and text[0] == "8"
    fig = plots.breakdown_figure(summary)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["block_size = 8", "block_size = 16", "block_size = 32"]


def test_breakdown_stacks_the_palette_in_order(results):
    summary = pd.read_csv(results / "summary.csv")
    fig = plots.breakdown_figure(summary, META)
    ax = fig.axes[0]
    assert len(ax.containers) == len(plots.PARTS)
    for container, part in zip(ax.containers, plots.PARTS, strict=True):
        face = container.patches[0].get_facecolor()
        assert np.allclose(face[:3], matplotlib_rgb(plots.PALETTE[part]))
    assert plots.PALETTE["token_states"] == "#2ca02c"
    # Each bar is annotated with its token-states share.
    texts = [t.get_text() for t in ax.texts]
    expected = [f"{100 * v:.0f}%" for v in summary["token_states"]]
    assert texts == expected
    # The stacks add up to the whole budget.
    tops = np.sum([[p.get_height() for p in c.patches] for c in ax.containers], axis=0)
    assert np.allclose(tops, 100, atol=1e-6)


def matplotlib_rgb(color: str):
    from matplotlib.colors import to_rgb

    return to_rgb(color)


def test_address_map_geometry_and_truncation(results):
    requests = pd.read_parquet(results / "requests.parquet")
    summary = pd.read_csv(results / "summary.csv")
    slab = requests[requests["label"] == "slab-oracle"]
    polys = plots.slab_polygons(slab, BPT)
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
    fig = plots.address_map_figure(requests, summary, META, max_slabs=5)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert [t.split(":")[0] for t in titles] == ["slab-oracle", "buddy-pow2"]
    assert all(f"first 5 of {n} slabs" in t for t in titles)
    assert plots.address_map_figure(requests[requests["label"] == "paged-16"], summary) is None


def test_timeline_resampling_keeps_areas(results):
    ts = pd.read_parquet(results / "timeseries.parquet")
    one = ts[ts["label"] == "paged-16"]
    coarse = plots.resample(one, 7, [*plots.PARTS, "running"])
    assert len(coarse) == 7
    for col in (*plots.PARTS, "running"):
        assert np.isclose((coarse[col] * coarse["dt"]).sum(), (one[col] * one["dt"]).sum())
    fig = plots.timeline_figure(ts, None, META, max_segments=20)
    assert "time-averaged in 20 steps" in fig._suptitle.get_text()
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == [a[0] for a in ALLOCATORS]


def test_lengths_use_one_label(results):
    requests = pd.read_parquet(results / "requests.parquet")
    fig = plots.lengths_figure(requests, META)
    ax = fig.axes[0]
    assert "(40 requests)" in ax.get_title()
    assert len(ax.get_lines()) == 2
    assert ax.get_xlabel().startswith("length (tokens)")


def test_frames_without_label_or_point(results):
    """A single run's frames (no label, no point columns) can be drawn as they are."""
    ts = pd.read_parquet(results / "timeseries.parquet")
    one = ts[ts["label"] == "paged-16"].drop(columns=["label", "point"])
    fig = plots.timeline_figure(one)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["run"]


def test_format_bytes_and_caption():
    assert plots.format_bytes(12 * 2**30) == "12 GiB"
    assert plots.format_bytes(819_200) == "800 KiB"
    assert plots.format_bytes(1.5 * 2**40) == "1.5 TiB"
    text = plots.caption(
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
    polys = plots.slab_polygons(req, BPT, end_s=3.0)
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
    polys = plots.slab_polygons(req, BPT)
    assert polys["outline"][0][:, 0].max() == 5.0
    stored = polys["token_states"][0]
    assert np.allclose(stored[:, 0], [0, 0, 1, 2, 5, 5])
