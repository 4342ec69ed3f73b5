"""Sweeps over two keys in the figures and the report: a line per value of the second key,
tick labels and panel titles that do not collide, the KV budget per point in the caption,
`kvfrag plot --point N` in files of its own, and report.html's size."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim.allocators.base import PARTS
from matplotlib.backends.backend_agg import FigureCanvasAgg

from kvfrag import address_map_plots, breakdown_plots, capacity_plots, captions, sweep_plots
from kvfrag.cli import main
from kvfrag.outdir import MANIFEST, foreign_files
from kvfrag.sweep_plots import line_split

RATE, SEQS = "workload.transforms.rate_scale", "engine.max_num_seqs"


def _summary(rates, seqs, budgets=None) -> pd.DataFrame:
    """summary.csv as a sweep over rate_scale x max_num_seqs writes it (the sweep keys between
    `point` and `model`), with numbers that differ per point and allocator."""
    rows = []
    for point, (rate, seq) in enumerate(itertools.product(rates, seqs)):
        for i, (label, kind) in enumerate((("slab-max", "contiguous"), ("paged-16", "paged"))):
            fracs = np.array([0.1 + 0.01 * point, 0.05, 0.3 - 0.2 * i, 0.02, 0.0])
            fracs[-1] = 1 - fracs.sum()
            rows.append({
                "label": label, "kind": kind, "point": point, RATE: rate, SEQS: seq,
                "model": "llama-3-8b",
                "kv_budget_bytes": (budgets or {}).get(seq, 55 * 2**30),
                **{f"{p}_frac": f for p, f in zip(PARTS, fracs, strict=True)},
                "mean_running": min(seq, 10 * rate) / (1 + i), "max_running": min(seq, 12 * rate),
                "throughput_tok_s": 100.0 * rate * (2 - i) + seq,
                "mean_latency_s": 1.0 + point, "p99_latency_s": 2.0 + point,
            })
    return pd.DataFrame(rows)


def _boxes(fig, texts) -> list:
    renderer = FigureCanvasAgg(fig).get_renderer()
    return [t.get_window_extent(renderer) for t in texts if t.get_text()]


def _no_overlap(boxes) -> bool:
    return not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))


def test_two_keys_a_line_per_value_of_the_second():
    summary = _summary([1, 4, 8], [16, 64, 256])
    split = line_split(summary, sweep_plots.sweep_columns(summary))
    assert split is not None and split.key == RATE and split.title == "max_num_seqs"
    assert split.names == ["max_num_seqs=16", "max_num_seqs=64", "max_num_seqs=256"]
    fig = capacity_plots.capacity_figure(summary)
    ax = fig.axes[1]  # throughput: a line per allocator and max_num_seqs, through 3 rates
    joined = [ln for ln in ax.get_lines() if ln.get_linestyle() != "None"]
    assert len(joined) == 2 * 3
    assert all(list(ln.get_xdata()) == [1, 4, 8] for ln in joined)
    assert len({ln.get_linestyle() for ln in joined}) == 3
    paged = summary[(summary["label"] == "paged-16") & (summary[SEQS] == 64)]
    assert any(list(ln.get_ydata()) == list(paged["throughput_tok_s"]) for ln in joined)
    assert ax.get_xlabel().startswith("rate_scale")
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:2] == ["slab-max", "paged-16"] and "max_num_seqs=256" in legend
    assert "max_num_seqs" in fig._suptitle.get_text()


def test_many_values_put_the_longer_key_on_x():
    """Six max_num_seqs against two rates: max_num_seqs along x, a line per rate."""
    summary = _summary([1, 8], [8, 16, 32, 64, 128, 256])
    split = line_split(summary, sweep_plots.sweep_columns(summary))
    assert split is not None and split.key == SEQS and split.names == ["rate_scale=1",
                                                                       "rate_scale=8"]


def test_too_many_values_keep_ticks_apart():
    """5 x 5 values: no split is readable by line style, so a tick per point, whose names
    (a line per key, turned, thinned) do not collide."""
    summary = _summary([1, 2, 3, 4, 5], [8, 16, 32, 64, 128])
    assert line_split(summary, sweep_plots.sweep_columns(summary)) is None
    fig = capacity_plots.capacity_figure(summary)
    ax = fig.axes[0]
    labels = ax.get_xticklabels()
    assert 2 <= len(labels) < 25
    assert all("\n" in t.get_text() for t in labels)
    renderer = FigureCanvasAgg(fig).get_renderer()
    (rotation,) = {t.get_rotation() for t in labels}
    assert rotation == 30
    # Turned labels are parallel strips: neighbours clear each other when the gap between
    # their ticks, across the strips, is at least a label's height.
    at = ax.transData.transform([(t.get_position()[0], 0) for t in labels])[:, 0]
    labels[0].set_rotation(0)
    height = labels[0].get_window_extent(renderer).height
    assert np.diff(at).min() * np.sin(np.radians(rotation)) >= height


def test_breakdown_titles_of_two_keys_do_not_collide():
    fig = breakdown_plots.breakdown_figure(_summary([1, 4], [128, 256]))
    titles = [ax.title for ax in fig.axes if ax.get_title()]
    assert len(titles) == 4 and all("\n" in t.get_text() for t in titles)
    assert _no_overlap(_boxes(fig, titles))


def test_budget_per_point_is_not_called_swept():
    """A sweep over max_num_seqs changes the derived budget (the activation reserve): the
    caption says the range per point; `swept` only when kv_budget itself is swept."""
    gib = 2**30
    summary = _summary([1], [128, 256], budgets={128: 55.7 * gib, 256: 54.7 * gib})
    text = captions.caption(None, summary)
    assert "KV budget: 54.7–55.7 GiB per point" in text and "swept" not in text
    swept = summary.drop(columns=[RATE]).rename(columns={SEQS: "kv_budget"})
    assert "KV budget: swept (54.7–55.7 GiB)" in captions.caption(None, swept)
    one = _summary([1], [128, 256])
    assert "KV budget: 55 GiB" in captions.caption(None, one)


SCENARIO = """\
name: two-keys
model: llama-3-8b
kv_budget: 3GiB
max_model_len: 2048
workload:
  trace: {path: "sample:azure-conv"}
  transforms: {first_n: 80}
allocators:
  - {label: slab-max, kind: contiguous, reserve: max_model_len}
  - {label: paged-16, kind: paged, block_size: 16}
sweep:
  workload.transforms.rate_scale: [1, 4]
  engine.max_num_seqs: [16, 64]
"""


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("two-keys")
    (root / "s.yaml").write_text(SCENARIO)
    out = root / "out"
    assert main(["run", str(root / "s.yaml"), "-o", str(out), "-q", "-j", "1"]) == 0
    return out


def test_report_stays_light(swept):
    """A sweep of 4 points x 1 slab allocator, 80 requests each: the page is plotly.js packed
    (about 1.9 MB) and little else, the maps' slabs rebuilt exactly from the page's columns."""
    from kvfrag import report

    page = (swept / "report.html").read_text(encoding="utf-8")
    assert len(page.encode()) < 2.6 * 2**20
    blobs = dict(re.findall(r"<script type='application/gzip' id='([^']+)'>([^<]*)<", page))
    assert set(blobs) == {"kvfrag-plotly", "kvfrag-maps"}
    assert len(blobs["kvfrag-maps"]) < 100_000
    assert "<div class='wide'><table class='summary'>" in page
    requests = pd.read_parquet(swept / "requests.parquet")
    summary = pd.read_csv(swept / "summary.csv")
    maps, _ = report.address_maps(requests, summary)
    assert len(maps) == 4
    req = requests[(requests["point"] == 0) & (requests["label"] == "slab-max")]
    bpt = float(summary["bytes_per_token"].iloc[0])
    polys = address_map_plots.slab_polygons(req, bpt, scale=2**30)
    rebuilt = report.corners(report.compact(polys, []))
    for part, corners in polys.items():
        got = rebuilt[part][:, : corners.shape[1]]
        np.testing.assert_allclose(got, corners, atol=2e-5 * np.nanmax(np.abs(corners)))
    assert (rebuilt["outline"][:, -1] == rebuilt["outline"][:, 0]).all()  # closed


def test_plot_point_writes_files_of_its_own(swept):
    """`kvfrag plot --point N` leaves the all-points figures as they are, the report embeds
    those, and the manifest lists the new files (so kvfrag may still replace the folder)."""
    before = {p.name: p.read_bytes() for p in (swept / "plots").glob("*.png")}
    assert main(["plot", str(swept), "--point", "3"]) == 0
    after = {p.name: p.read_bytes() for p in (swept / "plots").glob("*.png")}
    assert {n: after[n] for n in before} == before
    assert set(after) - set(before) == {"timeline-point3.png", "address_map-point3.png"}
    files = json.loads((swept / MANIFEST).read_text())["files"]
    assert {"plots/timeline-point3.png", "plots/address_map-point3.png"} <= set(files)
    assert main(["report", str(swept)]) == 0
    page = (swept / "report.html").read_text(encoding="utf-8")
    assert "plots/timeline.png" in page and "-point3" not in page
    assert page.count("<img ") == len(before) - 1  # (the address map: a link)
    assert foreign_files(swept) == []  # all kvfrag's still: a run may replace the folder


def test_a_moved_slab_counts_once_per_place():
    """The page's slab budget counts rectangles: compaction's moves add one each."""
    from kvfrag.address_map_plots import MOVE_T
    from kvfrag.report import _rectangles_keep

    placed = pd.DataFrame({MOVE_T: [None, [0.0, 1.0, 2.0], np.array([0.0, 5.0]), None]})
    assert [_rectangles_keep(placed, most) for most in (1, 3, 4, 6, 7, 99)] == [1, 1, 2, 3, 4, 4]
    assert _rectangles_keep(placed.drop(columns=[MOVE_T]), 3) == 3
