"""Every kind of bad input: a clear error naming file, row/line and column — or, with
drop_bad_rows, the rows dropped and counted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workloads import load_trace
from workloads.table import WorkloadError

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
GOOD = [
    "2023-11-16 18:15:46.6805900,374,44",
    "2023-11-16 18:15:50.9951690,396,109",
    "2023-11-16 18:15:51.2224670,879,55",
]


def azure(tmp_path: Path, bad_row: str, position: int = 1) -> Path:
    """An Azure-layout CSV with `bad_row` as data row `position + 1`."""
    rows = [*GOOD[:position], bad_row, *GOOD[position:]]
    path = tmp_path / "trace.csv"
    path.write_text(AZURE_HEADER + "\n".join(rows) + "\n")
    return path


def expect(path: Path, where: str, column: str, problem: str) -> None:
    pattern = f"{re.escape(str(path))}: {re.escape(where)}, column {column}: .*{problem}"
    with pytest.raises(WorkloadError, match=pattern):
        load_trace(path)
    dropped = load_trace(path, drop_bad_rows=True)
    assert dropped.dropped_rows == 1
    assert len(dropped.requests) == 3
    assert any("dropped 1 bad row" in note and column in note for note in dropped.notes)


@pytest.mark.parametrize(("row", "column", "problem"), [
    ("2023-11-16 18:15:50.1,abc,5", "ContextTokens", "'abc' is not a number"),
    ("2023-11-16 18:15:50.1,-3,5", "ContextTokens", "is negative"),
    ("2023-11-16 18:15:50.1,12.5,5", "ContextTokens", "not a whole number"),
    ("2023-11-16 18:15:50.1,NaN,5", "ContextTokens", "missing value"),
    ("2023-11-16 18:15:50.1,,5", "ContextTokens", "missing value"),
    ("2023-11-16 18:15:50.1,10,0", "GeneratedTokens", "below 1"),
    ("2023-11-16 18:15:50.1,10", "GeneratedTokens", "missing value"),
    ("not a time,10,5", "TIMESTAMP", "is not a timestamp"),
    ("2023-11-16 18:15:40.0,10,5", "TIMESTAMP", "earlier than a previous arrival"),
])
def test_bad_csv_value(tmp_path: Path, row: str, column: str, problem: str) -> None:
    expect(azure(tmp_path, row), "row 2 (line 3)", column, problem)


def test_first_bad_row_is_reported(tmp_path: Path) -> None:
    rows = [GOOD[0], "2023-11-16 18:15:50.1,1,x", "2023-11-16 18:15:50.2,y,1"]
    path = tmp_path / "trace.csv"
    path.write_text(AZURE_HEADER + "\n".join(rows) + "\n")
    with pytest.raises(WorkloadError, match=r"row 2 \(line 3\), column GeneratedTokens: 'x'"):
        load_trace(path)


def test_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:50.1,10\n")
    with pytest.raises(WorkloadError, match="cannot tell the trace layout"):
        load_trace(path)
    with pytest.raises(WorkloadError,
                       match=r"trace.csv: line 1 \(header\), column GeneratedTokens: missing"):
        load_trace(path, format="azure")


def test_drop_counts_several_kinds(tmp_path: Path) -> None:
    rows = [GOOD[0], "2023-11-16 18:15:47,abc,1", GOOD[1], "2023-11-16 18:15:40,5,5",
            "bad,1,1", GOOD[2], "2023-11-16 18:15:52,7,-1"]
    path = tmp_path / "trace.csv"
    path.write_text(AZURE_HEADER + "\n".join(rows) + "\n")
    workload = load_trace(path, drop_bad_rows=True)
    assert workload.dropped_rows == 4
    assert workload.requests["prompt_tokens"].tolist() == [374, 396, 879]
    assert workload.requests["arrival_s"].is_monotonic_increasing


@pytest.mark.parametrize(("content", "match"), [
    ("", "empty trace"),
    (AZURE_HEADER, "empty trace"),
])
def test_empty_csv(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=match):
        load_trace(path, format="azure")


def test_all_rows_dropped_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(AZURE_HEADER + "x,1,1\n")
    with pytest.raises(WorkloadError, match=r"empty trace \(no requests after dropping 1"):
        load_trace(path, drop_bad_rows=True)


MOONCAKE = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}'


@pytest.mark.parametrize(("line", "column", "problem"), [
    ('{"timestamp": 5, "input_length": "abc", "output_length": 2, "hash_ids": [1]}',
     "input_length", "'abc' is not a number"),
    ('{"timestamp": 5, "input_length": -1, "output_length": 2, "hash_ids": [1]}',
     "input_length", "is negative"),
    ('{"timestamp": 5, "input_length": 4, "output_length": 2, "hash_ids": [1]}',
     None, None),
    ('{"timestamp": 5, "input_length": 4, "output_length": 0, "hash_ids": [1]}',
     "output_length", "below 1"),
    ('{"timestamp": 5, "input_length": 4, "output_length": true, "hash_ids": [1]}',
     "output_length", "True is not a number"),
    ('{"timestamp": 5, "input_length": 4, "hash_ids": [1]}',
     "output_length", "missing value"),
    ('{"timestamp": NaN, "input_length": 4, "output_length": 2, "hash_ids": [1]}',
     "timestamp", "missing arrival time"),
    ('{"timestamp": "soon", "input_length": 4, "output_length": 2, "hash_ids": [1]}',
     "timestamp", "'soon' is not a finite number of ms"),
    ('{"timestamp": -5, "input_length": 4, "output_length": 2, "hash_ids": [1]}',
     "timestamp", "earlier than a previous arrival"),
    ('{"timestamp": 5, "input_length": 4, "output_length": 2, "hash_ids": ["a"]}',
     "hash_ids", "not a list of integers"),
])
def test_bad_jsonl_value(tmp_path: Path, line: str, column: str | None,
                         problem: str | None) -> None:
    path = tmp_path / "trace.jsonl"
    last = MOONCAKE.replace('"timestamp": 0', '"timestamp": 9')
    path.write_text(f"{MOONCAKE}\n{line}\n{last}\n")
    if column is None:
        assert len(load_trace(path).requests) == 3
        return
    with pytest.raises(WorkloadError, match=f"trace.jsonl: line 2, column {column}: .*{problem}"):
        load_trace(path)
    workload = load_trace(path, drop_bad_rows=True)
    assert (workload.dropped_rows, len(workload.requests)) == (1, 2)


@pytest.mark.parametrize(("line", "match"), [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: not a JSON object"),
])
def test_broken_jsonl_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{MOONCAKE}\n{line}\n{MOONCAKE}\n")
    with pytest.raises(WorkloadError, match=match):
        load_trace(path)
    assert load_trace(path, drop_bad_rows=True).dropped_rows == 1


def test_empty_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n\n")
    with pytest.raises(WorkloadError, match="empty trace"):
        load_trace(path, format="jsonl")


def test_max_tokens_below_output(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("p,o,m\n5,5,5\n5,6,4\n")
    with pytest.raises(WorkloadError, match=r"row 2 .*column m: 4 is below output tokens 6"):
        load_trace(path, columns={"prompt_tokens": "p", "output_tokens": "o", "max_tokens": "m"})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"format": "xml"}, "unknown format"),
    ({"format": "azure", "columns": {"prompt_tokens": "a", "output_tokens": "b"}}, "not both"),
    ({"columns": {"prompt_tokens": "a"}}, "needs 'output_tokens'"),
    ({"columns": {"prompt_tokens": "a", "output_tokens": "b", "x": "c"}}, "unknown field"),
])
def test_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(WorkloadError, match=match):
        load_trace(path, **kwargs)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no such trace file"):
        load_trace(tmp_path / "nope.csv")


def test_malformed_csv(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n1,2\n3,4,5,6\n")
    with pytest.raises(WorkloadError, match=r"t\.csv: malformed CSV"):
        load_trace(path)
