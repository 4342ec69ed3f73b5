"""Trace readers: published traces and generic tables -> one validated request table.

A trace is a container (CSV, JSONL or Parquet, optionally gzip-compressed for CSV/JSONL) plus a
*layout*: which column holds the arrival time (and in which unit), the prompt and output
lengths, and optionally max_tokens, samples per prompt, prefix block hashes, priorities and
accepted-draft counts (`accepted_drafts`, a list per request, for speculative decoding).
Known layouts:

- `azure`: Azure LLM inference trace 2023 (`TIMESTAMP` datetime, `ContextTokens`,
  `GeneratedTokens`).
- `mooncake`: Mooncake FAST'25 traces (`timestamp` ms, `input_length`, `output_length`,
  `hash_ids` per 512-token block).
- `sarathi`: length-only tables (`num_prefill_tokens`, `num_decode_tokens`, plus `arrived_at`
  seconds if present, as in Vidur's traces). Without arrivals the table gets `arrival_s` 0.0,
  `Workload.has_arrivals` False, and needs an arrival process from the scenario.
- `kvfrag`: the request table's own column names (`arrival_s` seconds, `prompt_tokens`, ...).

With `format="auto"` the container is sniffed from the file's first bytes and the layout is the
first one whose columns are all present. Any other layout loads with a column mapping
(`columns={"arrival": ..., "prompt_tokens": ..., "output_tokens": ...}`) and a `time_unit`.

The path must name a regular, non-empty file: a folder, a device (`/dev/zero` never ends), a
FIFO (opening one waits for a writer) or an empty file is refused from its `stat`, before it
is opened. A file of more than `MAX_ROWS` rows is refused as it is read.

Files stream in chunks (CSV via pandas `chunksize`, Parquet by record batch, JSONL line by line
into per-chunk column lists); each chunk is parsed into typed arrays and the raw chunk dropped,
so only the final columns are held. Every bad value is reported with the file, the 1-based row
(CSV: `row R (line L)`; Parquet: `row R`) or line (JSONL) and the column, or, with
`drop_bad_rows`, dropped and counted in `Workload.dropped_rows`; so is a CSV row with more
fields than the header (its values cannot be trusted to be in their columns). Damage to the
file itself (text that is not UTF-8, truncated gzip or Parquet, duplicated column names, an
unclosed quote) always stops the read with an error naming the file. Gzip is recognised by its
magic bytes whatever the file is called, and a leading UTF-8 byte order mark is skipped.
Messages quote at most a short excerpt of a bad value (`table.show`).
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import re
import stat
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
import pandas as pd
from kvfrag.workloads import samples
from kvfrag.workloads.names import FIELDS, FORMATS, TIME_UNITS, Format, TimeUnit
from kvfrag.workloads.table import (
    Workload,
    WorkloadError,
    accepted_problem,
    show,
    validate_requests,
)

_UNITS_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9, "datetime": 1e9}
CONTAINERS = ("csv", "jsonl", "parquet")
_CHUNK_ROWS = 100_000
_MAX_EXAMPLES = 3
_GZIP_MAGIC = b"\x1f\x8b"
#: The most rows (JSONL: lines) a trace may have: 10^8 requests is beyond what a simulation
#: gets through, and the typed columns alone would then take gigabytes.
MAX_ROWS = 100_000_000
#: Leading CSV rows with more fields than the header before the header is taken to be wrong.
_MAX_WIDE_HEAD = 1000
_SKIPPED = re.compile(r"Skipping line (\d+): expected \d+ fields, saw (\d+)")


@dataclass(frozen=True)
class Layout:
    """Where the request fields live in a source file; `optional` fields are used if present."""

    name: str
    prompt_tokens: str
    output_tokens: str
    arrival: str | None = None
    time_unit: TimeUnit | None = None
    max_tokens: str | None = None
    n: str | None = None
    hash_ids: str | None = None
    hash_block_tokens: int | None = None
    priority: str | None = None
    accepted_drafts: str | None = None
    optional: frozenset[str] = frozenset()

    def fields(self) -> dict[str, str]:
        """Field -> source column, for the fields this layout maps."""
        return {f: col for f in FIELDS if (col := getattr(self, f)) is not None}


LAYOUTS: dict[str, Layout] = {
    "azure": Layout("azure", "ContextTokens", "GeneratedTokens", "TIMESTAMP", "datetime"),
    "mooncake": Layout(
        "mooncake", "input_length", "output_length", "timestamp", "ms",
        hash_ids="hash_ids", hash_block_tokens=512, optional=frozenset({"hash_ids"}),
    ),
    "sarathi": Layout(
        "sarathi", "num_prefill_tokens", "num_decode_tokens", "arrived_at", "s",
        optional=frozenset({"arrival"}),
    ),
    "kvfrag": Layout(
        "kvfrag", "prompt_tokens", "output_tokens", "arrival_s", "s",
        max_tokens="max_tokens", n="n", hash_ids="hash_ids", priority="priority",
        accepted_drafts="accepted_drafts",
        optional=frozenset({"arrival", "max_tokens", "n", "hash_ids", "priority",
                            "accepted_drafts"}),
    ),
}


def resolve_path(path: str | Path, base_dir: Path | None = None) -> Path:
    """`sample:NAME` -> the shipped sample; a relative path -> under `base_dir` (if given)."""
    text = str(path)
    if text.startswith("sample:"):
        return samples.path(text.removeprefix("sample:"))
    resolved = Path(text).expanduser()
    if base_dir is not None and not resolved.is_absolute():
        resolved = Path(base_dir) / resolved
    return resolved


#: What `trace_file_problem` says of a path that does not exist, and of an empty file.
MISSING, EMPTY = "does not exist", "is empty (0 bytes)"


def trace_file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a trace (or length table), as a predicate ("is a folder"),
    or None if it can: from its `stat` alone, so that a FIFO (opening one waits for a writer)
    or a device (`/dev/zero` reads for ever) is refused without being opened."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return MISSING
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        return f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        return "is a folder"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device"
    if stat.S_ISSOCK(mode):
        return "is a socket"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    return EMPTY if info.st_size == 0 else None


def _is_gzip(path: Path) -> bool:
    """By the magic bytes, not the suffix: a gzipped `trace.csv` is common and must not be
    decoded as (invalid) text."""
    with path.open("rb") as fh:
        return fh.read(2) == _GZIP_MAGIC


def _open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if _is_gzip(path) else path.open("rb")  # type: ignore[return-value]


def _open_text(path: Path) -> IO[str]:
    """CSV/JSONL text, gunzipped if needed; utf-8-sig so a leading BOM is not part of the data."""
    if _is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return path.open(encoding="utf-8-sig", newline="")


def _not_utf8(path: Path) -> str:
    """Where the first byte that is not UTF-8 is. Decoding line by line is exact, since b"\\n"
    never occurs inside a multi-byte character; offsets count uncompressed bytes."""
    offset = 0
    try:
        with _open_binary(path) as fh:
            for number, line in enumerate(fh, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return (f"{path}: line {number}: not UTF-8 text (byte 0x{line[exc.start]:02x} "
                            f"at offset {offset + exc.start}); re-encode the file as UTF-8")
                offset += len(line)
    except (OSError, EOFError, zlib.error):
        pass
    return f"{path}: not UTF-8 text; re-encode the file as UTF-8"


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, and not longer than `limit` characters."""
    return _short(" ".join(str(exc).split()), limit)


def _short(text: str, limit: int = 60) -> str:
    """A name or message from the file, cut to `limit` characters: a header cell can be
    megabytes long."""
    return text if len(text) <= limit else text[:limit] + "..."


def _parquet_file(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise WorkloadError(f"{path}: not a valid Parquet file: {_one_line(exc)}") from None


def _check_unique(path: Path, names: list[str], where: str) -> None:
    """pandas renames a repeated CSV column (`a`, `a.1`) and Parquet readers pick one of them,
    so a duplicated name would silently read the wrong data."""
    repeated = [name for name, count in Counter(names).items() if count > 1 and name != ""]
    if repeated:
        raise WorkloadError(f"{path}: {where}, column {_short(repeated[0])}: duplicated "
                            f"column name (appears {names.count(repeated[0])} times)")


def sniff_container(path: Path) -> str:
    """'parquet', 'jsonl' or 'csv' from the file's first bytes (not its name)."""
    with path.open("rb") as fh:
        if fh.read(4) == b"PAR1":
            return "parquet"
    with _open_text(path) as fh:
        for line in fh:
            if line.strip():
                return "jsonl" if line.lstrip().startswith("{") else "csv"
    raise WorkloadError(f"{path}: empty trace (the file has no content)")


@contextmanager
def _long_csv_fields() -> Iterator[None]:
    """The csv module refuses a field over 128 KiB (`_csv.Error`), which a long prompt's
    hash ids can exceed; pandas, which reads the data, has no such limit."""
    limit = csv.field_size_limit(2**31 - 1)
    try:
        yield
    finally:
        csv.field_size_limit(limit)


def _raw_csv_header(path: Path) -> list[str]:
    """The header's names as written (pandas' own names have duplicates renamed)."""
    with _open_text(path) as fh, _long_csv_fields():
        for row in csv.reader(fh):
            if row:
                return row
    return []


def _header(path: Path, container: str) -> list[str]:
    if container == "parquet":
        names = list(_parquet_file(path).schema_arrow.names)
        _check_unique(path, names, "schema")
        return names
    if container == "csv":
        _check_unique(path, _raw_csv_header(path), "line 1 (header)")
        try:
            return [str(c) for c in pd.read_csv(path, nrows=0, compression=_compression(path))
                    .columns]
        except pd.errors.EmptyDataError:
            raise WorkloadError(f"{path}: empty trace (the file has no header)") from None
    with _open_text(path) as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                record = _json_record(path, number, line)
                return list(record)
    raise WorkloadError(f"{path}: empty trace (the file has no content)")


def _json_record(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}: line {number}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise WorkloadError(f"{path}: line {number}: not a JSON object")
    return record


def _choose_layout(
    path: Path,
    fmt: str,
    header: list[str],
    columns: Mapping[str, str] | None,
    time_unit: TimeUnit | None,
    hash_block_tokens: int | None,
) -> Layout:
    if columns is not None:
        if fmt in LAYOUTS:
            raise WorkloadError(f"{path}: give either format={fmt!r} or a column mapping, not both")
        unknown = sorted(set(columns) - set(FIELDS))
        if unknown:
            raise WorkloadError(f"{path}: unknown field(s) {unknown} in the column mapping; "
                                f"fields are {', '.join(FIELDS)}")
        for needed in ("prompt_tokens", "output_tokens"):
            if needed not in columns:
                raise WorkloadError(f"{path}: the column mapping needs {needed!r}")
        layout = Layout("columns", **dict(columns))
    elif fmt in LAYOUTS:
        layout = LAYOUTS[fmt]
    else:
        layout = next((lay for lay in LAYOUTS.values() if _matches(lay, header)), None)
        if layout is None:
            raise WorkloadError(
                f"{path}: cannot tell the trace layout from its columns {show(header, 200)}; "
                f"name a format ({', '.join(LAYOUTS)}) or give a column mapping and a time unit"
            )
    if time_unit is not None:
        layout = replace(layout, time_unit=time_unit)
    if hash_block_tokens is not None:
        layout = replace(layout, hash_block_tokens=hash_block_tokens)
    # Optional fields whose column is absent are simply not used.
    absent = {f: None for f in layout.optional if getattr(layout, f) not in header}
    layout = replace(layout, **absent)
    if layout.arrival is not None and layout.time_unit is None:
        raise WorkloadError(f"{path}: arrival column {layout.arrival!r} needs a time unit "
                            f"({', '.join(TIME_UNITS)})")
    if layout.hash_ids is not None and layout.hash_block_tokens is None:
        raise WorkloadError(f"{path}: hash_ids column {layout.hash_ids!r} needs "
                            "hash_block_tokens (tokens per hashed block)")
    return layout


def _matches(layout: Layout, header: list[str]) -> bool:
    return all(col in header for f, col in layout.fields().items() if f not in layout.optional)


@dataclass
class _Chunk:
    """Raw values of one chunk: field -> Series, with each row's 1-based row/line number."""

    data: dict[str, pd.Series]
    locs: np.ndarray


def _compression(path: Path) -> str | None:
    return "gzip" if _is_gzip(path) else None


def _wide_head(path: Path, width: int, first_only: bool) -> list[tuple[int, int, int]]:
    """(row, line, fields) of the leading data rows with more fields than the header's `width`
    (`first_only`: of the first of them, the one a read without drop_bad_rows reports).

    pandas would take the first data row's extra field for an index column and shift every
    value one column to the left, or (with `index_col=False`) cut every row to that row's width,
    without a word; a later row with extra fields it skips and names by line. So the leading
    ones are found here (the scan stops at the first row that fits) and skipped by line.
    """
    found: list[tuple[int, int, int]] = []
    with _open_text(path) as fh, _long_csv_fields():
        reader = csv.reader(fh)
        header_seen = False
        row = begun = 0  # data rows so far; lines read before the current row
        for values in reader:
            line, begun = begun + 1, reader.line_num
            if not values:  # a blank line (pandas skips it too)
                continue
            if not header_seen:
                header_seen = True
                continue
            row += 1
            if len(values) <= width:
                break
            found.append((row, line, len(values)))
            if first_only:
                break
            if len(found) >= _MAX_WIDE_HEAD:
                raise WorkloadError(
                    f"{path}: the first {len(found):,} rows all have more fields than the header "
                    f"({len(values)} vs {width}): is a column name missing from line 1?"
                )
    return found


def _csv_chunks(
    path: Path, fields: dict[str, str], width: int, drop: bool, on_drop: Callable[[str], None]
) -> Iterator[_Chunk]:
    """A CSV file's chunks; a row with more fields than the header's `width` is dropped through
    `on_drop` (with `drop`) or stops the read, after the rows before it have been yielded (so
    the first bad row of the file is the one reported)."""

    def malformed(row: int, line: int, count: int) -> str:
        return (f"{path}: row {row} (line {line}): malformed CSV row: {count} fields, the "
                f"header has {width}")

    # No usecols: with it pandas silently ignores rows with extra fields.
    dtypes = {col: str for f, col in fields.items()
              if f in ("arrival", "hash_ids", "accepted_drafts")}
    head = _wide_head(path, width, first_only=not drop)
    if head and not drop:
        raise WorkloadError(malformed(*head[0]))
    for wide in head:
        on_drop(malformed(*wide))
    start = len(head) + 1  # the number of the next data row
    try:
        with pd.read_csv(
            path, dtype=dtypes, chunksize=_CHUNK_ROWS, compression=_compression(path),
            index_col=False, on_bad_lines="warn", skiprows=[line - 1 for _, line, _ in head],
        ) as reader:
            while True:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", pd.errors.ParserWarning)
                    frame = next(reader, None)
                # pandas names the lines it skipped (also those after the last row, where it
                # has no frame left to return); a row's number is its line's less one (the
                # header's line), as everywhere in this reader.
                skipped = [(int(line) - 1, int(line), int(count)) for w in caught
                           for line, count in _SKIPPED.findall(str(w.message))]
                if frame is None:
                    if skipped and not drop:
                        raise WorkloadError(malformed(*min(skipped)))
                    for wide in skipped:
                        on_drop(malformed(*wide))
                    return
                skipped_rows = np.array([row for row, _, _ in skipped], dtype=np.int64)
                numbers = np.arange(start, start + len(frame) + len(skipped), dtype=np.int64)
                rows = numbers[~np.isin(numbers, skipped_rows)][: len(frame)]
                start = max([start - 1, *skipped_rows.tolist(), *rows[-1:].tolist()]) + 1
                data = {f: frame[col] for f, col in fields.items()}
                if skipped and not drop:
                    row, line, count = min(skipped)
                    before = int(np.searchsorted(rows, row))
                    if before:
                        yield _Chunk({f: v.iloc[:before] for f, v in data.items()}, rows[:before])
                    raise WorkloadError(malformed(row, line, count))
                for wide in skipped:
                    on_drop(malformed(*wide))
                yield _Chunk(data, rows)
    except pd.errors.ParserError as exc:
        # Other structural damage (an unclosed quote) stops the read even with drop_bad_rows:
        # the rows after it could not be trusted.
        raise WorkloadError(f"{path}: malformed CSV: {_one_line(exc)}") from None


def _parquet_chunks(path: Path, fields: dict[str, str]) -> Iterator[_Chunk]:
    import pyarrow as pa

    wanted = list(dict.fromkeys(fields.values()))
    start = 1
    batches = _parquet_file(path).iter_batches(batch_size=_CHUNK_ROWS, columns=wanted)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            raise WorkloadError(f"{path}: not a valid Parquet file: corrupt data after row "
                                f"{start - 1}: {_one_line(exc)}") from None
        if batch is None:
            return
        frame = batch.to_pandas()
        rows = np.arange(start, start + len(frame))
        start += len(frame)
        yield _Chunk({f: frame[col] for f, col in fields.items()}, rows)


def _jsonl_chunks(
    path: Path, fields: dict[str, str], drop: bool, on_drop: Callable[[str], None]
) -> Iterator[_Chunk]:
    values: dict[str, list] = {f: [] for f in fields}
    lines: list[int] = []

    def flush() -> _Chunk:
        chunk = _Chunk(
            {f: pd.Series(v, dtype=_jsonl_dtype(v)) for f, v in values.items()},
            np.asarray(lines, dtype=np.int64),
        )
        for v in values.values():
            v.clear()
        lines.clear()
        return chunk

    with _open_text(path) as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = _json_record(path, number, line)
            except WorkloadError as exc:
                if not drop:
                    if lines:
                        yield flush()
                    raise
                on_drop(str(exc))
                continue
            for f, col in fields.items():
                values[f].append(record.get(col))
            lines.append(number)
            if len(lines) >= _CHUNK_ROWS:
                yield flush()
    if lines:
        yield flush()


def _jsonl_dtype(values: list) -> object:
    """Plain ints become int64 without a per-value Python check; anything else stays object."""
    return np.int64 if values and all(type(v) is int for v in values) else object


# --- parsing one field of one chunk: (typed values, bad mask, why-is-this-value-bad) ---------


def _missing(value: object) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _plain(value: object) -> object:
    """numpy scalars as Python ones, so messages say `inf`, not `np.float64(inf)`."""
    return value.item() if isinstance(value, np.generic) else value


def _length_problem(value: object) -> str:
    value = _plain(value)
    shown = show(value)
    if _missing(value):
        return "missing value (empty, null or NaN)"
    if isinstance(value, bool):
        return f"{shown} is not a number"
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"{shown} is not a number"
    if math.isnan(number):
        return f"{shown} is NaN"
    if math.isinf(number) or number > 2**62:
        return f"{shown} is not a finite token count"
    if number < 0:
        return f"{shown} is negative"
    if number != int(number):
        return f"{shown} is not a whole number"
    return f"{shown} is below 1 (token counts must be at least 1)"


def _parse_counts(raw: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Token counts / sample counts: whole numbers >= 1."""
    if raw.dtype.kind in "iu":
        values = raw.to_numpy(dtype=np.int64)
        return values, values < 1
    if raw.dtype.kind == "b":
        return np.zeros(len(raw), dtype=np.int64), np.ones(len(raw), dtype=bool)
    numbers = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(numbers) | (numbers < 1) | (numbers != np.floor(numbers))
        bad |= numbers > 2**62
    if raw.dtype == object:
        bad |= raw.map(lambda v: isinstance(v, bool)).to_numpy(dtype=bool)
    return np.where(bad, 0, numbers).astype(np.int64), bad


def _parse_priorities(raw: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Priorities: whole numbers of any sign (vLLM serves the lowest first)."""
    if raw.dtype.kind in "iu":
        return raw.to_numpy(dtype=np.int64), np.zeros(len(raw), dtype=bool)
    numbers = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(numbers) | (numbers != np.floor(numbers)) | (np.abs(numbers) > 2**62)
    if raw.dtype.kind == "b" or raw.dtype == object:
        bad |= raw.map(lambda v: isinstance(v, (bool, np.bool_))).to_numpy(dtype=bool)
    return np.where(bad, 0, numbers).astype(np.int64), bad


def _priority_problem(value: object) -> str:
    value = _plain(value)
    if _missing(value):
        return "missing priority (empty, null or NaN; leave the column out for priority 0)"
    return f"{show(value)} is not a whole number (a priority is an integer, lowest served first)"


def _parse_times(raw: pd.Series, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """Datetimes -> int64 ns since the epoch; numbers -> float64 in `unit`."""
    if unit == "datetime":
        stamps = pd.to_datetime(raw, format="ISO8601", errors="coerce", utc=True)
        bad = stamps.isna().to_numpy()
        nanos = stamps.dt.as_unit("ns").to_numpy(dtype="datetime64[ns]").view(np.int64)
        return np.where(bad, 0, nanos), bad
    numbers = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(numbers)
    if raw.dtype == object:
        bad |= raw.map(lambda v: isinstance(v, bool)).to_numpy(dtype=bool)
    return np.where(bad, 0.0, numbers), bad


def _time_problem(value: object, unit: str) -> str:
    value = _plain(value)
    if _missing(value):
        return "missing arrival time (empty, null or NaN)"
    if unit == "datetime":
        return f"{show(value)} is not a timestamp (expected e.g. '2023-11-16 18:17:03.98')"
    return f"{show(value)} is not a finite number of {unit}"


def _parse_hashes(raw: pd.Series) -> tuple[list[list[int] | None], np.ndarray]:
    parsed: list[list[int] | None] = []
    for value in raw:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = None
        if isinstance(value, (list, tuple, np.ndarray)):
            items = [int(x) if isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                     else None for x in value]
            parsed.append(None if None in items else items)  # type: ignore[arg-type]
        else:
            parsed.append(None)
    return parsed, np.array([h is None for h in parsed], dtype=bool)


def _parse_accepted(raw: pd.Series) -> tuple[list[list[int] | None], np.ndarray]:
    """Accepted-draft counts: a list of whole numbers >= 0 per row (JSON text in a CSV)."""
    parsed, bad = _parse_hashes(raw)
    for i, counts in enumerate(parsed):
        if counts is not None and accepted_problem(counts) is not None:
            parsed[i], bad[i] = None, True
    return parsed, bad


def _accepted_message(value: object) -> str:
    value = _plain(value)
    if _missing(value):
        return "missing accepted_drafts (empty, null or NaN)"
    return f"{show(value)} is not a non-empty list of whole numbers >= 0 (accepted drafts)"


@dataclass
class _Columns:
    """Typed columns accumulated over chunks, plus what was dropped and why."""

    times: list[np.ndarray] = field(default_factory=list)
    counts: dict[str, list[np.ndarray]] = field(default_factory=dict)
    hashes: list[list[int]] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    dropped: int = 0
    examples: list[str] = field(default_factory=list)
    last_time: float | int | None = None

    def drop(self, message: str) -> None:
        self.dropped += 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(message)


class _ChunkParser:
    def __init__(self, path: Path, container: str, layout: Layout, drop: bool) -> None:
        self.path = path
        self.container = container
        self.layout = layout
        self.fields = layout.fields()
        self.drop = drop
        self.out = _Columns()

    def where(self, loc: int) -> str:
        if self.container == "jsonl":
            return f"line {loc}"
        if self.container == "csv":
            return f"row {loc} (line {loc + 1})"
        return f"row {loc}"

    def message(self, chunk: _Chunk, index: int, name: str, problem: str) -> str:
        return f"{self.path}: {self.where(int(chunk.locs[index]))}, column {self.fields[name]}: " \
               f"{problem}"

    def check_hash_count(
        self,
        typed: dict[str, Any],
        bad: dict[str, np.ndarray],
        describe: dict[str, Callable[[int], str]],
    ) -> None:
        """A row may hash at most ceil(prompt_tokens / hash_block_tokens) blocks; more ids than
        blocks means the lengths and hashes disagree (wrong block size or a corrupt row)."""
        block = self.layout.hash_block_tokens
        assert block is not None  # _choose_layout requires it with a hash_ids column
        hashes, prompt = typed["hash_ids"], typed["prompt_tokens"]
        counts = np.array([0 if h is None else len(h) for h in hashes], dtype=np.int64)
        blocks = -(-prompt // block)
        over = ~bad["hash_ids"] & ~bad["prompt_tokens"] & (counts > blocks)
        bad["hash_ids"] = bad["hash_ids"] | over
        previous = describe["hash_ids"]
        describe["hash_ids"] = lambda i, p=previous: (
            f"{counts[i]} block hashes for {prompt[i]} prompt tokens (at most {blocks[i]} "
            f"blocks of {block} tokens)" if over[i] else p(i)
        )

    def add(self, chunk: _Chunk) -> None:
        n = len(chunk.locs)
        typed: dict[str, Any] = {}
        bad: dict[str, np.ndarray] = {}
        describe: dict[str, Callable[[int], str]] = {}
        unit = self.layout.time_unit or "s"
        for name in self.fields:
            raw = chunk.data[name]
            if name == "arrival":
                typed[name], bad[name] = _parse_times(raw, unit)
                describe[name] = lambda i, raw=raw: _time_problem(raw.iloc[i], unit)
            elif name == "priority":
                typed[name], bad[name] = _parse_priorities(raw)
                describe[name] = lambda i, raw=raw: _priority_problem(raw.iloc[i])
            elif name == "accepted_drafts":
                typed[name], bad[name] = _parse_accepted(raw)
                describe[name] = lambda i, raw=raw: _accepted_message(raw.iloc[i])
            elif name == "hash_ids":
                typed[name], bad[name] = _parse_hashes(raw)
                describe[name] = lambda i, raw=raw: f"{show(raw.iloc[i])} is not a list of integers"
            else:
                typed[name], bad[name] = _parse_counts(raw)
                describe[name] = lambda i, raw=raw: _length_problem(raw.iloc[i])
        if "max_tokens" in typed:
            limit, output = typed["max_tokens"], typed["output_tokens"]
            over = ~bad["max_tokens"] & ~bad["output_tokens"] & (limit < output)
            bad["max_tokens"] = bad["max_tokens"] | over
            previous = describe["max_tokens"]
            describe["max_tokens"] = lambda i, p=previous: (
                f"{limit[i]} is below output tokens {output[i]}" if over[i] else p(i)
            )
        if "hash_ids" in typed:
            self.check_hash_count(typed, bad, describe)
        value_bad = np.zeros(n, dtype=bool)
        for mask in bad.values():
            value_bad |= mask

        if "arrival" in typed:
            times = typed["arrival"]
            basis = ~value_bad if self.drop else ~bad["arrival"]
            order_bad = np.zeros(n, dtype=bool)
            ordered_times = times[basis]
            if len(ordered_times):
                head = ordered_times[:1] if self.out.last_time is None else [self.out.last_time]
                running = np.maximum.accumulate(np.concatenate([head, ordered_times]))
                order_bad[basis] = ordered_times < running[:-1]
                self.out.last_time = running[-1].item()
            raw_times = chunk.data["arrival"]
            prior = describe["arrival"]
            describe["arrival"] = lambda i, p=prior: (
                f"{show(raw_times.iloc[i])} is earlier than a previous arrival "
                "(arrivals must be in time order)" if order_bad[i] else p(i)
            )
            bad["arrival"] = bad["arrival"] | order_bad
            value_bad |= order_bad

        if value_bad.any():
            rows = np.flatnonzero(value_bad)
            if not self.drop:
                first = int(rows[0])
                name = next(f for f in self.fields if bad[f][first])
                raise WorkloadError(self.message(chunk, first, name, describe[name](first)))
            for i in rows[: _MAX_EXAMPLES - len(self.out.examples)]:
                name = next(f for f in self.fields if bad[f][i])
                self.out.examples.append(self.message(chunk, int(i), name, describe[name](int(i))))
            self.out.dropped += len(rows)
        keep = ~value_bad
        for name, values in typed.items():
            if name == "hash_ids":
                self.out.hashes.extend(h for h, k in zip(values, keep, strict=True) if k)
            elif name == "accepted_drafts":
                self.out.accepted.extend(a for a, k in zip(values, keep, strict=True) if k)
            elif name == "arrival":
                self.out.times.append(values[keep])
            else:
                self.out.counts.setdefault(name, []).append(values[keep])


def load_trace(
    path: str | Path,
    format: Format = "auto",
    columns: Mapping[str, str] | None = None,
    time_unit: TimeUnit | None = None,
    drop_bad_rows: bool = False,
    hash_block_tokens: int | None = None,
    base_dir: Path | None = None,
) -> Workload:
    """Read a trace file into a validated `Workload`.

    `path` may be `sample:NAME` (a shipped sample). `format` is "auto", a layout name
    (azure, mooncake, sarathi, kvfrag) or a container (csv, jsonl, parquet) used with `columns`,
    a mapping from request field (arrival, prompt_tokens, output_tokens, max_tokens, n,
    hash_ids, priority, accepted_drafts) to source column. `time_unit` overrides or supplies
    the arrival unit.
    """
    if format not in FORMATS:
        raise WorkloadError(f"{path}: unknown format {format!r}; formats: {', '.join(FORMATS)}")
    if not str(path).strip():  # (Path("") is the current folder)
        raise WorkloadError("the trace path is empty; name a trace file")
    resolved = resolve_path(path, base_dir)
    problem = trace_file_problem(resolved)  # before anything opens it
    if problem == MISSING:
        raise WorkloadError(f"{resolved}: no such trace file")
    if problem == EMPTY:
        raise WorkloadError(f"{resolved}: empty trace (the file is 0 bytes)")
    if problem is not None:
        raise WorkloadError(f"{resolved}: {problem}; a trace must be a regular file")
    try:
        return _read(resolved, format, columns, time_unit, drop_bad_rows, hash_block_tokens)
    except UnicodeDecodeError:
        raise WorkloadError(_not_utf8(resolved)) from None
    except csv.Error as exc:  # (the header and leading rows are read with the csv module)
        raise WorkloadError(f"{resolved}: malformed CSV: {_one_line(exc)}") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise WorkloadError(f"{resolved}: truncated or corrupt gzip data: {_one_line(exc)}") \
            from None


def _read(
    resolved: Path,
    format: Format,
    columns: Mapping[str, str] | None,
    time_unit: TimeUnit | None,
    drop_bad_rows: bool,
    hash_block_tokens: int | None,
) -> Workload:
    """`load_trace` after the argument checks; decoding errors are translated by the caller."""
    container = format if format in CONTAINERS else sniff_container(resolved)
    header = _header(resolved, container)
    layout = _choose_layout(resolved, format, header, columns, time_unit, hash_block_tokens)
    for name, col in layout.fields().items():
        if col not in header:
            where = {"csv": "line 1 (header)", "jsonl": "line 1", "parquet": "schema"}[container]
            raise WorkloadError(f"{resolved}: {where}, column {col}: missing ({name} column); "
                                f"found columns {show(header, 200)}")

    parser = _ChunkParser(resolved, container, layout, drop_bad_rows)
    fields = layout.fields()
    if container == "csv":
        chunks = _csv_chunks(resolved, fields, len(header), drop_bad_rows, parser.out.drop)
    elif container == "parquet":
        chunks = _parquet_chunks(resolved, fields)
    else:
        chunks = _jsonl_chunks(resolved, fields, drop_bad_rows, parser.out.drop)
    for chunk in chunks:
        if len(chunk.locs) and chunk.locs[-1] > MAX_ROWS:
            where = "lines" if container == "jsonl" else "rows"
            raise WorkloadError(f"{resolved}: more than {MAX_ROWS:,} {where}; kvfrag reads at "
                                f"most {MAX_ROWS:,} requests (split the file)")
        parser.add(chunk)
    return _assemble(resolved, layout, parser.out)


def _assemble(path: Path, layout: Layout, out: _Columns) -> Workload:
    """Concatenate the chunks column by column, releasing each chunk list as it goes."""

    def take(name: str) -> np.ndarray:
        return np.concatenate(out.counts.pop(name))

    prompt = take("prompt_tokens") if "prompt_tokens" in out.counts else np.zeros(0, np.int64)
    if len(prompt) == 0:
        detail = f" after dropping {out.dropped} bad row(s)" if out.dropped else ""
        raise WorkloadError(f"{path}: empty trace (no requests{detail})")
    table: dict[str, Any] = {"request_id": np.arange(len(prompt), dtype=np.int64)}
    notes: list[str] = []
    if layout.arrival is not None:
        times = np.concatenate(out.times)
        out.times.clear()
        per_second = _UNITS_PER_SECOND[layout.time_unit or "s"]
        table["arrival_s"] = (times - times[0]).astype(np.float64) / per_second
        del times
    else:
        table["arrival_s"] = np.zeros(len(prompt))
        notes.append("no arrival times in the source; arrival_s is 0.0 until an arrival process "
                     "is applied")
    table["prompt_tokens"] = prompt
    for name in ("output_tokens", "max_tokens", "n"):
        if name in out.counts:
            table[name] = take(name)
    if layout.hash_ids is not None:
        table["hash_ids"] = pd.Series(out.hashes, dtype=object)
    if "priority" in out.counts:
        table["priority"] = take("priority")
    if layout.accepted_drafts is not None:
        table["accepted_drafts"] = pd.Series(out.accepted, dtype=object)
    df = pd.DataFrame(table, copy=False)
    if layout.hash_ids is not None:
        df.attrs["hash_block_tokens"] = layout.hash_block_tokens
    if out.dropped:
        notes.append(f"dropped {out.dropped} bad row(s), e.g. " + "; ".join(out.examples))
    validate_requests(df, str(path))
    return Workload(
        requests=df,
        source=str(path),
        dropped_rows=out.dropped,
        notes=tuple(notes),
        has_arrivals=layout.arrival is not None,
    )
