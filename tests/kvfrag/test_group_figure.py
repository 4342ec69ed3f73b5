"""What `kvfrag run` shows of a hybrid model's waste: the table's padding and out-of-window
columns (only where some run has them), the breakdown's segments for them, and the per-group
view over time (plots/groups.png, in report.html)."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvfrag import breakdown_plots, figure_kit
from kvfrag.cli import main
from kvfrag.group_plots import group_figure
from kvfrag.results import TABLE, format_table

warnings.filterwarnings("ignore", message=".*pure-Python.*")

ROOT = Path(__file__).resolve().parents[2]


def _table_summary(**columns) -> pd.DataFrame:
    rows = {key: [0.0, 0.0] for key, *_ in TABLE}
    rows.update(label=["hybrid", "paged-16"], compactions=[0, 0])
    rows.update(columns)
    return pd.DataFrame(rows)


def _header(table: str) -> list[str]:
    return [h for h in table.split("\n")[0].split("  ") if h]


def test_the_table_shows_padding_and_out_of_window_only_when_some_run_has_them():
    plain = _header(format_table(_table_summary(), []))
    assert "padding" not in plain and "out of win" not in plain
    table = format_table(_table_summary(internal_padding_frac=[0.041, 0.0],
                                        internal_out_of_window_frac=[0.058, 0.619]), [])
    header = _header(table)
    at = header.index("internal")
    assert header[at + 1:at + 3] == ["padding", "out of win"]
    rows = [line.split() for line in table.split("\n")[1:]]
    assert [r[at + 1:at + 3] for r in rows] == [["4.1%", "5.8%"], ["0.0%", "61.9%"]]


def _breakdown_summary(padding: float, out: float) -> pd.DataFrame:
    return pd.DataFrame({
        "label": ["hybrid", "paged-16"], "point": [0, 0], "kind": ["hybrid", "paged"],
        "token_states_frac": [0.6, 0.2], "reserved_frac": [0.01, 0.01],
        "internal_frac": [0.1 + padding, 0.62], "external_frac": [0.0, 0.0],
        "usable_free_frac": [0.29 - padding, 0.17],
        "internal_overreservation_frac": [0.0, 0.0],
        "internal_padding_frac": [padding, 0.0], "internal_out_of_window_frac": [out, 0.6],
        "internal_rounding_frac": [0.1 - out, 0.02],
    })


def test_the_breakdown_draws_padding_and_out_of_window_as_segments_of_internal():
    fig = breakdown_plots.breakdown_figure(_breakdown_summary(0.04, 0.06), {})
    ax = fig.axes[0]
    names = [c.get_label() for c in ax.collections]
    assert names == [figure_kit.PART_NAMES[p] for p in (
        "token_states", "reserved", "internal_overreservation", "internal_padding",
        "internal_out_of_window", "internal_rounding", "external", "usable_free")]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "internal: padding" in legend and "internal: out of window" in legend
    # each segment at its share: paged-16's out-of-window bar is 60 % of the budget
    oow = ax.collections[names.index("internal: out of window")]
    tops = [p.vertices[:4, 1].max() - p.vertices[:4, 1].min() for p in oow.get_paths()]
    assert tops == pytest.approx([6.0, 60.0])
    # full-attention results (both 0) draw internal as before: over-reservation, rounding
    zero = _breakdown_summary(0.0, 0.0)
    zero.loc[1, "internal_out_of_window_frac"] = 0.0
    names = [c.get_label() for c in breakdown_plots.breakdown_figure(zero, {}).axes[0].collections]
    assert "internal: padding" not in names and "internal: out of window" not in names


def test_group_figure_stacks_blocks_per_kind_and_skips_runs_without_groups():
    ts = pd.DataFrame({
        "t_s": [0.0, 1.0, 2.0, 0.0, 1.0], "dt_s": [1.0, 1.0, 1.0, 1.5, 1.5],
        "blocks_sliding_window": [10, 40, 20, None, None],
        "blocks_full": [5, 15, 30, None, None],
        "label": ["hybrid"] * 3 + ["paged-16"] * 2, "point": [0] * 5,
    })
    summary = pd.DataFrame({"label": ["hybrid", "paged-16"], "point": [0, 0],
                            "hybrid_num_blocks": [101, None]})
    fig = group_figure(ts, summary, {})
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == ["hybrid"]  # paged-16 has no groups
    ax = shown[0]
    # stacked bottom up in KINDS order (full, then sliding), the top at the total held
    assert [c.get_label() for c in ax.collections] == ["full attention", "sliding window"]
    top = ax.collections[1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(55.0)  # the most held at once: 15 full + 40 sliding, t = 1
    assert ax.get_lines()[0].get_ydata()[0] == 100  # the pool, less the null block
    assert group_figure(ts.drop(columns=["blocks_sliding_window", "blocks_full"]),
                        summary, {}) is None


def test_kvfrag_run_of_a_hybrid_scenario_draws_the_group_figure_into_the_report(tmp_path):
    doc = yaml.safe_load((ROOT / "scenarios/gemma3-27b-long-context.yaml").read_text())
    doc["workload"]["synthetic"]["count"] = 6
    doc["allocators"] = [a for a in doc["allocators"] if a["kind"] != "contiguous"]
    scenario = tmp_path / "g3.yaml"
    scenario.write_text(yaml.safe_dump(doc))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["run", str(scenario), "-o", str(tmp_path / "res")])
    assert rc == 0
    header = _header(next(line for line in out.getvalue().splitlines()
                          if line.startswith("label")))
    assert {"padding", "out of win", "max run"} <= set(header)
    assert (tmp_path / "res/plots/groups.png").is_file()
    assert "plots/groups.png" in (tmp_path / "res/report.html").read_text()
    ts = pd.read_parquet(tmp_path / "res/timeseries.parquet")
    hybrid = ts[ts["label"] == "hybrid"]
    assert hybrid["blocks_sliding_window"].max() > 0 and hybrid["blocks_full"].max() > 0
    assert ts[ts["label"] == "paged-16"]["blocks_full"].isna().all()
