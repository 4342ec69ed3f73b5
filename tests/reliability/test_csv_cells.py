"""CSV outputs open in a spreadsheet as text: a cell that would start a formula is escaped.

A swept trace path (or any text a user wrote) that starts with `=`, `+`, `-` or `@` lands in
summary.csv with a leading `'`; kvfrag's own readers (`compare`, `plot`, `report`) take it back
as it was written.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pandas as pd
import pytest

from kvfrag.cli import main
from kvfrag.csvcells import escape_cell, unescape, unescape_cell, write_csv
from kvfrag.results_io import read_summary

SAMPLE = Path(__file__).resolve().parents[2] / "workloads" / "samples" / "azure-conv.csv"


@pytest.mark.parametrize(
    "text", ["=HYPERLINK(\"x\")", "+1", "-2+3", "@SUM(A1)", "\tx", "\rx", "'=x", "'", "plain"]
)
def test_every_text_comes_back_as_written(text):
    escaped = escape_cell(text)
    assert not str(escaped).startswith(("=", "+", "-", "@", "\t", "\r"))
    assert unescape_cell(escaped) == text


def test_numbers_stay_numbers(tmp_path):
    frame = pd.DataFrame({"n": [-1, 2], "x": [-0.5, 1.0], "s": ["-1", "ok"]})
    write_csv(frame, tmp_path / "f.csv")
    rows = list(csv.reader((tmp_path / "f.csv").open()))
    assert rows[1] == ["-1", "-0.5", "'-1"]
    back = unescape(pd.read_csv(tmp_path / "f.csv", dtype={"s": str}))
    assert back["s"].tolist() == ["-1", "ok"] and back["n"].tolist() == [-1, 2]


def test_a_swept_trace_path_starting_with_equals_is_escaped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    head = "".join(SAMPLE.read_text().splitlines(keepends=True)[:6])
    (tmp_path / "=cmd.csv").write_text(head)
    (tmp_path / "b.csv").write_text(head)
    (tmp_path / "s.yaml").write_text(
        "model: {name: tiny, layers: 2, kv_heads: 2, head_dim: 64}\nkv_budget: 4MiB\n"
        "max_model_len: 2048\nworkload:\n  trace: {path: b.csv}\n"
        "allocators:\n  - {label: paged-16, kind: paged, block_size: 16}\n"
        "sweep:\n  workload.trace.path: ['=cmd.csv', b.csv]\n"
    )
    assert main(["run", "s.yaml", "-o", "r", "-q", "-j", "1", "--no-plots"]) == 0
    cells = [c for row in csv.reader((tmp_path / "r" / "summary.csv").open()) for c in row]
    assert "'=cmd.csv" in cells
    assert not [c for c in cells if c.startswith(("=", "+", "@"))]
    summary = read_summary(tmp_path / "r" / "summary.csv", 2)
    assert summary["workload.trace.path"].tolist() == ["=cmd.csv", "b.csv"]
