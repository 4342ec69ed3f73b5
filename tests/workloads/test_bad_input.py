"""Every kind of bad input: a clear error naming file, row/line and column — or, with
drop_bad_rows, the rows dropped and counted."""

from __future__ import annotations

import gzip
import os
import random
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from kvfrag.workloads import WorkloadSpec, load_trace, readers, validate_requests
from kvfrag.workloads.table import WorkloadError, show
from pydantic import ValidationError

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
    ('{"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [1, 2, 3]}',
     "hash_ids", r"3 block hashes for 600 prompt tokens \(at most 2 blocks of 512 tokens\)"),
    ('{"timestamp": 5, "input_length": 1024, "output_length": 2, "hash_ids": [1, 2]}',
     None, None),
    ('{"timestamp": Infinity, "input_length": 4, "output_length": 2, "hash_ids": [1]}',
     "timestamp", "inf is not a finite number of ms"),
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
    with pytest.raises(WorkloadError, match=r"t\.csv: row 2 \(line 3\): malformed CSV row: 4 "
                       "fields, the header has 2$"):
        load_trace(path)


def test_unclosed_quote_stops_the_read(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text('prompt_tokens,output_tokens\n1,2\n"3,4\n5,6\n')
    expect_file_error(path, "malformed CSV: .*EOF inside string")


# --- rows with more fields than the header: their values cannot be trusted to be in their
# columns, so such a row is bad (dropped with drop_bad_rows), wherever it is ----------------

EXTRA = "arrival_s,prompt_tokens,output_tokens\n"


@pytest.mark.parametrize(("rows", "bad", "kept"), [
    # (pandas took a first row's extra field for an index column, shifting every value left)
    (["0,5,5,9", "1,6,6", "2,7,7"], [(1, 2, 4)], [6, 7]),
    (["0,5,5", "1,6,6,9", "2,7,7"], [(2, 3, 4)], [5, 7]),
    (["0,5,5,9,9", "1,6,6,1,1,1", "2,7,7", "3,8,8,8"], [(1, 2, 5), (2, 3, 6), (4, 5, 4)], [7]),
    (["0,5,5", "1,6,6", "2,7,7,"], [(3, 4, 4)], [5, 6]),  # a trailing comma is a field too
])
def test_extra_fields(tmp_path: Path, rows: list[str], bad: list[tuple[int, int, int]],
                      kept: list[int]) -> None:
    path = tmp_path / "t.csv"
    path.write_text(EXTRA + "\n".join(rows) + "\n")
    row, line, fields = bad[0]
    with pytest.raises(WorkloadError, match=f"^{re.escape(str(path))}: row {row} \\(line {line}"
                       f"\\): malformed CSV row: {fields} fields, the header has 3$"):
        load_trace(path)
    workload = load_trace(path, drop_bad_rows=True)
    assert workload.requests["prompt_tokens"].tolist() == kept
    assert workload.dropped_rows == len(bad)
    assert all(f"row {r} (line {n}): malformed CSV row: {f} fields" in workload.notes[0]
               for r, n, f in bad[:3])


@pytest.mark.parametrize(("rows", "match"), [
    (["0,x,5", "1,6,6,6", "2,7,7"], r"row 1 \(line 2\), column prompt_tokens: 'x'"),
    (["0,5,5", "1,6,6,6", "2,x,7"], r"row 2 \(line 3\): malformed CSV row"),
])
def test_first_bad_row_of_either_kind_is_reported(tmp_path: Path, rows: list[str],
                                                  match: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(EXTRA + "\n".join(rows) + "\n")
    with pytest.raises(WorkloadError, match=match):
        load_trace(path)
    assert load_trace(path, drop_bad_rows=True).dropped_rows == 2


def test_extra_field_rows_keep_later_row_numbers(tmp_path: Path, monkeypatch) -> None:
    """Rows after a skipped one, in this chunk and the next, keep their own numbers."""
    monkeypatch.setattr(readers, "_CHUNK_ROWS", 2)
    path = tmp_path / "t.csv"
    path.write_text(EXTRA + "0,5,5\n1,6,6,6\n2,7,7\n3,8,8\n4,x,9\n5,9,9,9\n")
    workload = load_trace(path, drop_bad_rows=True)
    assert workload.requests["prompt_tokens"].tolist() == [5, 7, 8]
    assert all(where in workload.notes[0] for where in (
        "row 2 (line 3): malformed", "row 5 (line 6), column prompt_tokens: 'x'",
        "row 6 (line 7): malformed"))
    path.write_text(EXTRA + "0,5,5\n1,6,6\n2,7,7\n3,8,8,8\n")
    with pytest.raises(WorkloadError, match=r"row 4 \(line 5\): malformed CSV row"):
        load_trace(path)


@pytest.mark.parametrize("seed", range(40))
def test_extra_fields_against_a_reference(tmp_path: Path, monkeypatch, seed: int) -> None:
    """Random rows of 3 to 5 fields, read in chunks of 1 to 100 rows: exactly the 3-field rows
    are kept, and the first wider one is the one reported."""
    rng = random.Random(seed)
    monkeypatch.setattr(readers, "_CHUNK_ROWS", rng.choice([1, 2, 3, 100]))
    widths = [rng.choice([3, 3, 3, 4, 5]) for _ in range(rng.randint(1, 12))]
    path = tmp_path / "t.csv"
    path.write_text(EXTRA + "".join(f"{i},{10 + i},1" + ",9" * (w - 3) + "\n"
                                    for i, w in enumerate(widths)))
    kept = [10 + i for i, w in enumerate(widths) if w == 3]
    wide = [(i + 1, w) for i, w in enumerate(widths) if w > 3]
    if kept:
        workload = load_trace(path, drop_bad_rows=True)
        assert workload.requests["prompt_tokens"].tolist() == kept
        assert workload.dropped_rows == len(wide)
    if wide:
        row, fields = wide[0]
        with pytest.raises(WorkloadError, match=rf"row {row} \(line {row + 1}\): malformed CSV "
                           rf"row: {fields} fields"):
            load_trace(path)


def test_extra_field_in_gzip_csv(tmp_path: Path) -> None:
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress((EXTRA + "0,5,5,5\n1,6,6\n2,7,7,7\n3,8,8\n").encode()))
    workload = load_trace(path, drop_bad_rows=True)
    assert (workload.dropped_rows, workload.requests["prompt_tokens"].tolist()) == (2, [6, 8])


def test_every_row_wider_than_the_header(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(readers, "_MAX_WIDE_HEAD", 5)
    path = tmp_path / "t.csv"
    path.write_text(EXTRA + "".join(f"{i},5,5,5\n" for i in range(10)))
    for drop in (False, True):
        with pytest.raises(WorkloadError, match="row 1 .*4 fields" if not drop else
                           "the first 5 rows all have more fields than the header"):
            load_trace(path, drop_bad_rows=drop)


def test_csv_field_over_128_kib(tmp_path: Path) -> None:
    """The csv module's own field limit does not apply: a long prompt's hash ids are data."""
    path = tmp_path / "t.csv"
    ids = ", ".join(map(str, range(40_000)))
    path.write_text(f'prompt_tokens,output_tokens,hash_ids\n640000,1,"[{ids}]"\n')
    workload = load_trace(path, hash_block_tokens=16)
    assert len(workload.requests["hash_ids"][0]) == 40_000


# --- what is not a regular, non-empty file is refused from its stat, before it is opened -----


@pytest.mark.parametrize("kind", ["folder", "fifo", "device", "empty"])
def test_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    path = not_regular(tmp_path, kind)
    problem = readers.trace_file_problem(path)
    assert problem is not None and problem.startswith("is ")
    match = "empty trace" if kind == "empty" else f"{re.escape(problem)}; a trace must be"
    with pytest.raises(WorkloadError, match=f"^{re.escape(str(path))}: {match}"):
        load_trace(path)


def not_regular(tmp_path: Path, kind: str) -> Path:
    """A folder, a FIFO (opening it would wait for a writer), /dev/zero or an empty file."""
    if kind == "device":
        if not Path("/dev/zero").is_char_device():
            pytest.skip("no /dev/zero here")
        return Path("/dev/zero")
    path = tmp_path / f"{kind}.csv"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs here")
        os.mkfifo(path)
    else:
        path.touch()
    return path


@pytest.mark.parametrize(("name", "header", "row", "unit"), [
    ("t.csv", EXTRA, "0,5,5\n", "rows"),
    ("t.jsonl", "", '{"prompt_tokens": 5, "output_tokens": 5}\n', "lines"),
])
def test_too_many_rows(tmp_path: Path, monkeypatch, name: str, header: str, row: str,
                       unit: str) -> None:
    monkeypatch.setattr(readers, "MAX_ROWS", 3)
    path = tmp_path / name
    path.write_text(header + row * 3)
    assert len(load_trace(path).requests) == 3
    path.write_text(header + row * 4)
    with pytest.raises(WorkloadError, match=f"more than 3 {unit}; kvfrag reads at most 3 "):
        load_trace(path)


# --- messages quote values as plain numbers, and never more than a short excerpt ------------


def test_show() -> None:
    assert show(np.int64(100)) == "100" and show(np.float64(1.5)) == "1.5"
    assert show(np.array([1, 2])) == "[1, 2]" and show([np.int64(3)]) == "[3]"
    assert show("abc") == "'abc'"
    assert show("x" * 10_000_000) == "'" + "x" * 59 + "..."
    assert len(show(list(range(10_000)))) == 63 and len(show(np.arange(10_000))) == 63


def test_parquet_order_message_is_a_plain_number(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"arrival_s": np.array([200, 100, 300], dtype=np.int64),
                             "prompt_tokens": [5, 5, 5], "output_tokens": [1, 1, 1]}), path)
    with pytest.raises(WorkloadError, match=r"row 2, column arrival_s: 100 is earlier") as info:
        load_trace(path)
    assert "np." not in str(info.value)


def test_validate_quotes_plain_numbers() -> None:
    df = pd.DataFrame({"request_id": np.arange(2), "arrival_s": [5.0, 1.0],
                       "prompt_tokens": np.array([100, 0]), "output_tokens": np.ones(2, int)})
    with pytest.raises(WorkloadError, match=r"^t: row 2, column prompt_tokens: 0 is below 1"):
        validate_requests(df, "t")
    df["prompt_tokens"] = 100
    with pytest.raises(WorkloadError, match=r"^t: row 2, column arrival_s: 1\.0 is earlier"):
        validate_requests(df, "t")


@pytest.mark.parametrize("name", ["t.csv", "t.jsonl"])
def test_a_huge_cell_is_quoted_short(tmp_path: Path, name: str) -> None:
    cell = "9" * 2_000_000 + "x"
    path = tmp_path / name
    if name.endswith(".csv"):
        path.write_text(f"prompt_tokens,output_tokens\n5,5\n{cell},5\n")
    else:
        path.write_text('{"prompt_tokens": 5, "output_tokens": 5}\n'
                        f'{{"prompt_tokens": "{cell}", "output_tokens": 5}}\n')
    with pytest.raises(WorkloadError, match=r"column prompt_tokens: '9{59}\.\.\. is not a "
                       "number$") as info:
        load_trace(path)
    assert len(str(info.value)) < len(str(path)) + 150
    header = tmp_path / "h.csv"
    header.write_text("a" * 1_000_000 + ",b\n5,5\n")
    with pytest.raises(WorkloadError, match="cannot tell the trace layout") as info:
        load_trace(header)
    assert len(str(info.value)) < len(str(header)) + 400


# --- the file itself is damaged: always an error naming the file, even with drop_bad_rows ----


def expect_file_error(path: Path, match: str, **kwargs: object) -> None:
    for drop in (False, True):
        with pytest.raises(WorkloadError, match=f"^{re.escape(str(path))}: {match}"):
            load_trace(path, drop_bad_rows=drop, **kwargs)  # type: ignore[arg-type]


def test_duplicate_csv_column(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44,375\n")
    expect_file_error(path, r"line 1 \(header\), column ContextTokens: duplicated column name "
                      r"\(appears 2 times\)")
    expect_file_error(path, "line 1 .*ContextTokens: duplicated", format="azure")


def test_duplicate_parquet_column(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    table = pa.Table.from_arrays([pa.array([5, 6]), pa.array([1, 2]), pa.array([7, 8])],
                                 names=["prompt_tokens", "output_tokens", "prompt_tokens"])
    pq.write_table(table, path)
    expect_file_error(path, "schema, column prompt_tokens: duplicated column name")


def test_hash_ids_longer_than_prompt_csv(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text('prompt_tokens,output_tokens,hash_ids\n8,1,"[1, 2]"\n5,1,"[1, 2, 3]"\n'
                    '9,1,"[1, 2, 3]"\n')
    with pytest.raises(WorkloadError, match=r"t\.csv: row 2 \(line 3\), column hash_ids: 3 block "
                       r"hashes for 5 prompt tokens \(at most 2 blocks of 4 tokens\)"):
        load_trace(path, hash_block_tokens=4)
    workload = load_trace(path, hash_block_tokens=4, drop_bad_rows=True)
    assert workload.dropped_rows == 1
    assert workload.requests["hash_ids"].tolist() == [[1, 2], [1, 2, 3]]


def test_validate_rejects_hash_ids_longer_than_prompt() -> None:
    df = pd.DataFrame({
        "request_id": np.arange(2, dtype=np.int64),
        "arrival_s": np.zeros(2),
        "prompt_tokens": np.array([16, 17], dtype=np.int64),
        "output_tokens": np.ones(2, dtype=np.int64),
        "hash_ids": pd.Series([[1], [1, 2, 3]], dtype=object),
    })
    df.attrs["hash_block_tokens"] = 16
    with pytest.raises(WorkloadError, match=r"t: row 2, column hash_ids: .*more ids than the "
                       "prompt has blocks of 16 tokens"):
        validate_requests(df, "t")


AZURE_BYTES = (AZURE_HEADER + "\n".join(GOOD) + "\n").encode()


@pytest.mark.parametrize("name", ["trace.csv", "trace.jsonl"])
def test_latin1_is_not_utf8(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name.endswith(".csv"):
        data = AZURE_BYTES + "2023-11-16 18:15:52,caf\u00e9,1\n".encode("latin-1")
        line, offset = 5, len(AZURE_BYTES) + len("2023-11-16 18:15:52,caf")
    else:
        first = (MOONCAKE + "\n").encode()
        data = first + '{"timestamp": 5, "name": "caf\u00e9"}\n'.encode("latin-1")
        line, offset = 2, len(first) + len('{"timestamp": 5, "name": "caf')
    path.write_bytes(data)
    expect_file_error(path, f"line {line}: not UTF-8 text \\(byte 0xe9 at offset {offset}\\)")


def test_latin1_header(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes("d\u00e9but,prompt_tokens\n1,2\n".encode("latin-1"))
    expect_file_error(path, r"line 1: not UTF-8 text \(byte 0xe9 at offset 1\)")


@pytest.mark.parametrize("name", ["trace.csv", "trace.data", "trace.csv.gz"])
def test_gzip_is_read_whatever_the_name(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(gzip.compress(AZURE_BYTES))
    assert load_trace(path).requests["prompt_tokens"].tolist() == [374, 396, 879]


def test_gzip_jsonl_without_suffix(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(gzip.compress(f"{MOONCAKE}\n{MOONCAKE}\n".encode()))
    assert len(load_trace(path).requests) == 2


@pytest.mark.parametrize("name", ["trace.csv.gz", "trace.csv", "trace.jsonl.gz"])
def test_truncated_gzip(tmp_path: Path, name: str) -> None:
    rows = "".join(f"{i},{i + 1},{i + 2}\n" for i in range(20_000))
    text = ("arrival_s,prompt_tokens,output_tokens\n" + rows) if ".csv" in name else "".join(
        f'{{"arrival_s": {i}, "prompt_tokens": 5, "output_tokens": 5}}\n' for i in range(20_000))
    data = gzip.compress(text.encode())
    path = tmp_path / name
    path.write_bytes(data[: len(data) // 2])
    expect_file_error(path, "truncated or corrupt gzip data")


def test_jsonl_and_csv_with_bom(tmp_path: Path) -> None:
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + f"{MOONCAKE}\n{MOONCAKE}\n".encode())
    assert load_trace(jsonl).requests["prompt_tokens"].tolist() == [10, 10]
    csv = tmp_path / "trace.csv"
    csv.write_bytes(b"\xef\xbb\xbf" + AZURE_BYTES)
    assert len(load_trace(csv).requests) == 3
    gz = tmp_path / "trace.csv.gz"
    gz.write_bytes(gzip.compress(b"\xef\xbb\xbf" + AZURE_BYTES))
    assert len(load_trace(gz).requests) == 3


def parquet_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "good.parquet"
    n = 5000
    pq.write_table(pa.table({"prompt_tokens": np.arange(1, n + 1),
                             "output_tokens": np.arange(1, n + 1)}), path)
    return path.read_bytes()


def test_truncated_parquet(tmp_path: Path) -> None:
    data = parquet_bytes(tmp_path)
    path = tmp_path / "t.parquet"
    path.write_bytes(data[: len(data) // 2])
    expect_file_error(path, "not a valid Parquet file: .*magic bytes")


def test_corrupt_parquet_pages(tmp_path: Path) -> None:
    data = bytearray(parquet_bytes(tmp_path))
    data[8: len(data) // 2] = b"\xff" * (len(data) // 2 - 8)  # the footer stays readable
    path = tmp_path / "t.parquet"
    path.write_bytes(bytes(data))
    expect_file_error(path, "not a valid Parquet file: corrupt data after row 0")


def test_csv_read_as_parquet(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(AZURE_BYTES)
    columns = {"prompt_tokens": "ContextTokens", "output_tokens": "GeneratedTokens"}
    expect_file_error(path, "not a valid Parquet file", format="parquet", columns=columns)


# --- non-finite numbers ---------------------------------------------------------------------


@pytest.mark.parametrize(("value", "problem"), [
    ("inf", "'inf' is not a finite number of s"),
    ("-inf", "'-inf' is not a finite number of s"),
    ("1e999", "'1e999' is not a finite number of s"),
    ("nan", "missing arrival time"),
])
def test_non_finite_arrival_csv(tmp_path: Path, value: str, problem: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(f"arrival_s,prompt_tokens,output_tokens\n0,5,5\n{value},5,5\n2,5,5\n3,5,5\n")
    expect(path, "row 2 (line 3)", "arrival_s", re.escape(problem))


def test_non_finite_token_count_csv(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("prompt_tokens,output_tokens\n5,5\ninf,5\n")
    with pytest.raises(WorkloadError, match=r"t\.csv: row 2 \(line 3\), column prompt_tokens: "
                       "inf is not a finite token count"):
        load_trace(path)


@pytest.mark.parametrize("text", [
    "synthetic: {count: 5, prompt: {kind: fixed, value: 5}, output: {kind: fixed, value: 5},"
    " arrival: {kind: poisson, rate: .inf}}",
    "synthetic: {count: 5, prompt: {kind: fixed, value: 5}, output: {kind: fixed, value: 5},"
    " arrival: {kind: poisson, rate: 'inf'}}",
    "synthetic: {count: 5, prompt: {kind: fixed, value: 5}, output: {kind: fixed, value: 5},"
    " arrival: {kind: gamma, rate: 2, cv: .nan}}",
    "synthetic: {count: 5, prompt: {kind: fixed, value: 5}, output: {kind: fixed, value: 5},"
    " arrival: {kind: closed_loop, users: 2, think_s: .inf}}",
    "synthetic: {count: 5, prompt: {kind: fixed, value: 5}, output: {kind: fixed, value: 5},"
    " arrival: {kind: closed_loop, users: 2, think_s: 1, stagger_s: 'nan'}}",
    "synthetic: {count: 5, prompt: {kind: lognormal, mean: .inf, sigma: 1},"
    " output: {kind: fixed, value: 5}}",
    "synthetic: {count: 5, prompt: {kind: normal, mean: 100, std: .inf},"
    " output: {kind: fixed, value: 5}}",
    "synthetic: {count: 5, prompt: {kind: fixed, value: 5}, output: {kind: fixed, value: 5},"
    " correlation: .nan}",
    "trace: {path: t.csv}\ntransforms: {rate_scale: .inf}",
    "trace: {path: t.csv}\ntransforms: {rate_scale: 'Infinity'}",
    "trace: {path: t.csv}\ntransforms: {window: {start_s: 0, end_s: .inf}}",
])
def test_spec_rejects_non_finite(text: str) -> None:
    with pytest.raises(ValidationError, match="finite number"):
        WorkloadSpec.model_validate(yaml.safe_load(text))


def test_spec_accepts_finite() -> None:
    spec = WorkloadSpec.model_validate(yaml.safe_load(
        "trace: {path: t.csv, arrival: {kind: gamma, rate: '2.5', cv: 3}}\n"
        "transforms: {rate_scale: 1.5, window: {start_s: 0, end_s: 10.5}}"))
    assert spec.transforms.rate_scale == 1.5
