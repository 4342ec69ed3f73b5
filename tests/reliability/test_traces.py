"""Bad traces, from what a careless (or hostile) user found, through the command line on real
files: each is refused as bad input (exit status 2) with one line naming the file and where in
it, and nothing is written; or, with `drop_bad_rows`, dropped and counted.

- A CSV row with more fields than the header is a bad row like any other.
- `trace stats` columns are as wide as their contents.
- Messages quote plain numbers (`100`, not `np.int64(100)`) and at most a short excerpt of a
  bad value.
- A trace path that is a folder, a device, a FIFO or an empty file is refused from its stat,
  before anything opens it (opening a FIFO waits for a writer; /dev/zero never ends).
- A bad trace at one sweep point refuses the whole sweep before any run starts.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvfrag.cli import main

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROWS = [
    "2023-11-16 18:15:46.6805900,374,44",
    "2023-11-16 18:15:50.9951690,396,109",
    "2023-11-16 18:15:51.2224670,879,55",
]
SCENARIO = """\
model: {name: tiny, layers: 2, kv_heads: 2, head_dim: 64}
kv_budget: 4MiB
max_model_len: 2048
workload:
  trace: {path: TRACE, drop_bad_rows: DROP}
allocators:
  - {label: paged-16, kind: paged, block_size: 16}
"""


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run in tmp_path, and fail (rather than hang) should anything open a FIFO or read a
    device: the checks must stat, not open."""
    monkeypatch.chdir(tmp_path)

    def hung(*_: object) -> None:
        raise TimeoutError("blocked on a trace path")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def trace(tmp_path: Path, rows: list[str], name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + "\n".join(rows) + "\n")
    return path


def scenario(tmp_path: Path, path: str, drop: bool = False, sweep: str = "") -> Path:
    text = SCENARIO.replace("TRACE", path).replace("DROP", str(drop).lower())
    out = tmp_path / "s.yaml"
    out.write_text(text + (f"sweep:\n  {sweep}\n" if sweep else ""))
    return out


def run(tmp_path: Path) -> int:
    return main(["run", "s.yaml", "-q", "--no-plots", "-j", "1"])


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("kvfrag: error: ")
    return err[0]


def nothing_written(tmp_path: Path) -> None:
    results = tmp_path / "results"
    assert not results.exists() or not any(results.iterdir())


# --- 1. a CSV row with more fields than the header ---------------------------------------


@pytest.mark.parametrize("position", [0, 1])
def test_extra_field_is_refused_naming_file_and_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], position: int
) -> None:
    rows = list(ROWS)
    rows[position] += ",7"
    trace(tmp_path, rows)
    scenario(tmp_path, "trace.csv")
    assert run(tmp_path) == 2
    line = one_error_line(capsys)
    where = f"row {position + 1} (line {position + 2})"
    assert f"trace.csv: {where}: malformed CSV row: 4 fields, the header has 3" in line
    nothing_written(tmp_path)


def test_drop_bad_rows_drops_an_extra_field_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The first data row: pandas alone would shift every value one column to the left.
    trace(tmp_path, [ROWS[0] + ",7", ROWS[1], ROWS[2] + ",8,9", "2023-11-16 18:15:52,abc,1"])
    scenario(tmp_path, "trace.csv", drop=True)
    assert run(tmp_path) == 0
    summary = pd.read_csv(tmp_path / "results" / "s" / "summary.csv")
    assert summary["workload_dropped_rows"].tolist() == [3]
    assert summary["requests"].tolist() == [1]
    assert main(["trace", "stats", "trace.csv", "--drop-bad-rows", "--json"]) == 0
    assert '"dropped_rows": 3' in capsys.readouterr().out


# --- 2. trace stats columns -----------------------------------------------------------------


def test_stats_columns_fit_ten_digit_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "t.csv").write_text(
        "prompt_tokens,output_tokens\n1234567890,987654321\n1234567891,987654322\n"
    )
    assert main(["trace", "stats", "t.csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("tokens"))
    table = lines[start:start + 3]
    assert [line.split() for line in table] == [
        ["tokens", "mean", "p50", "p90", "p99", "max"],
        ["prompt", "1234567890.5", "1234567890.5", "1234567890.9", "1234567891", "1234567891"],
        ["output", "987654321.5", "987654321.5", "987654321.9", "987654322", "987654322"],
    ]
    # Every column ends where its header ends, with at least two spaces between cells.
    ends = [[i + len(c) for i, c in _cells(line)] for line in table]
    assert ends[0][1:] == ends[1][1:] == ends[2][1:]
    assert all(" " * 2 in line[len(line.split()[0]):] for line in table)


def _cells(line: str) -> list[tuple[int, str]]:
    out, i = [], 0
    for cell in line.split():
        i = line.index(cell, i)
        out.append((i, cell))
        i += len(cell)
    return out


# --- 3 and 4. plain numbers, short excerpts -----------------------------------------------


def test_messages_show_plain_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pq.write_table(pa.table({
        "arrival_s": np.array([200, 100, 300], dtype=np.int64),
        "prompt_tokens": np.array([5, 5, 5], dtype=np.int64),
        "output_tokens": np.array([1, 1, 1], dtype=np.int64),
    }), tmp_path / "t.parquet")
    assert main(["trace", "stats", "t.parquet"]) == 2
    line = one_error_line(capsys)
    assert "t.parquet: row 2, column arrival_s: 100 is earlier than a previous arrival" in line
    assert "np." not in line


def test_a_huge_cell_is_not_echoed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cell = "1" * 5_000_000 + "x"
    trace(tmp_path, [ROWS[0], f"2023-11-16 18:15:50.9951690,{cell},109", ROWS[2]])
    scenario(tmp_path, "trace.csv")
    assert run(tmp_path) == 2
    line = one_error_line(capsys)
    assert "row 2 (line 3), column ContextTokens: '" + "1" * 59 + "... is not a number" in line
    assert len(line) < len(str(tmp_path)) + 200
    nothing_written(tmp_path)


# --- 5. paths that are not regular, non-empty files ------------------------------------------


def not_regular(tmp_path: Path, kind: str) -> str:
    if kind == "device":
        if not Path("/dev/zero").is_char_device():
            pytest.skip("no /dev/zero here")
        return "/dev/zero"
    path = tmp_path / kind
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs here")
        os.mkfifo(path)
    else:
        path.touch()
    return kind


PROBLEMS = {"folder": "is a folder", "fifo": "is a FIFO (named pipe)", "device": "is a device",
            "empty": "is empty (0 bytes)"}


@pytest.mark.parametrize("kind", list(PROBLEMS))
def test_run_refuses_a_trace_that_is_not_a_regular_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = not_regular(tmp_path, kind)
    scenario(tmp_path, path)
    assert run(tmp_path) == 2
    line = one_error_line(capsys)
    assert f"s.yaml:5: workload.trace.path: '{path}' {PROBLEMS[kind]}" in line
    nothing_written(tmp_path)


def test_an_empty_path_is_not_the_current_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario(tmp_path, "''")
    assert run(tmp_path) == 2
    assert "s.yaml:5: workload.trace.path: the path is empty" in one_error_line(capsys)
    assert main(["trace", "stats", ""]) == 2
    assert "the trace path is empty" in one_error_line(capsys)
    nothing_written(tmp_path)


@pytest.mark.parametrize("kind", list(PROBLEMS))
def test_trace_stats_refuses_what_is_not_a_regular_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = not_regular(tmp_path, kind)
    plot = tmp_path / "p.png"
    assert main(["trace", "stats", path, "--plot", str(plot)]) == 2
    line = one_error_line(capsys)
    expected = "empty trace" if kind == "empty" else f"{PROBLEMS[kind]}; a trace must be"
    assert line.startswith(f"kvfrag: error: {path}: {expected}")
    assert not plot.exists()


# --- 6. a bad trace at one sweep point -----------------------------------------------------


@pytest.mark.parametrize(("bad", "expected"), [
    ("bad.csv", "bad.csv: row 2 (line 3), column ContextTokens: 'abc' is not a number"),
    ("wide.csv", "wide.csv: row 3 (line 4): malformed CSV row: 4 fields, the header has 3"),
    ("fifo", "fifo: is a FIFO (named pipe)"),
    ("missing.csv", "missing.csv: no such trace file"),
])
def test_a_bad_trace_at_one_sweep_point_refuses_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str, expected: str
) -> None:
    trace(tmp_path, ROWS, "good.csv")
    trace(tmp_path, [ROWS[0], ROWS[1].replace(",396,", ",abc,"), ROWS[2]], "bad.csv")
    trace(tmp_path, [ROWS[0], ROWS[1], ROWS[2] + ",1"], "wide.csv")
    if bad == "fifo":
        not_regular(tmp_path, "fifo")
    scenario(tmp_path, "good.csv", sweep=f"workload.trace.path: [good.csv, {bad}]")
    assert run(tmp_path) == 2
    line = one_error_line(capsys)
    assert f"point 1 (workload.trace.path={bad}): " in line and expected in line
    nothing_written(tmp_path)
    assert not (tmp_path / "results" / ".s.points").exists()
