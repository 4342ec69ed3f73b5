"""Reading a results folder's files for its figures, checked first.

`read_summary` reads summary.csv and `read_frame` a Parquet file, each translated from an older
kvfrag's layout (`kvfrag.results.upgrade_summary`, `upgrade_timeseries`) and checked to have
the columns the figures need. pandas reads a truncated or foreign file into NaN-padded rows
without a word, and the figures would then show nothing, or the wrong thing: a damaged file
raises `ResultsFileError` instead, one line naming the file and the damage.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from kvfrag.csvcells import unescape
from kvfrag.figure_kit import FRAC
from kvfrag.results import check_schema, folder_schema, upgrade_summary
from kvfrag.sim.allocators.base import PARTS

#: Columns of each results file that the figures cannot do without (old layouts are
#: translated first: `kvfrag.results.upgrade_summary`). A file without them was not written
#: by `kvfrag run`.
SUMMARY_COLUMNS = ("label", "point", *(FRAC[p] for p in PARTS))
TIMESERIES_COLUMNS = ("t_s", "dt_s")
REQUESTS_COLUMNS = ("prompt_tokens", "output_tokens")


class ResultsFileError(ValueError):
    """A results file that is damaged or not as `kvfrag run` writes it. The message is one
    line that names the file, so that the CLI can print it as it is."""


#: `read_summary`'s default: the schema version is read from the summary.json beside.
_BESIDE = -1


def read_summary(path: Path | str, version: int | None = _BESIDE) -> pd.DataFrame:
    """`summary.csv`, checked before it is drawn: pandas reads a truncated or foreign file into
    NaN-padded rows (or none) without a word, and the figures would then silently show
    nothing, or the wrong thing. Raises `ResultsFileError` naming the file and the damage.

    Written by an older kvfrag (schema `version`, by default the summary.json's beside it),
    its columns are translated to this kvfrag's names (`kvfrag.results.upgrade_summary`); a
    newer one is refused (ValueError). Without a version (no summary.json), a header with the
    schema-1 names is taken as schema 1."""
    path = Path(path)
    if version == _BESIDE:
        version = folder_schema(path.parent)[0]
        check_schema(version, path.parent)

    def bad(what: str) -> ResultsFileError:
        return ResultsFileError(f"{path}: {what}")

    def foreign(why: str) -> ResultsFileError:
        return bad(f"not a CSV written by kvfrag run ({why})")

    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise foreign("not UTF-8 text") from None
    except OSError as exc:
        raise bad(f"cannot be read ({exc.strerror or exc})") from None
    if "\0" in text:
        raise foreign("binary data")
    failed = (path.parent / "failures.csv").exists()
    if failed and not text.strip(" ,\r\n"):  # what `kvfrag run` writes when no run finished
        raise bad("no runs in it (every run failed: see failures.csv)")
    if not text.strip():
        raise bad("empty file")
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: list[str] | None = None
    rows = 0
    try:
        for row in reader:
            if not row:
                continue  # a blank line
            if header is None:
                header = row
            elif len(row) != len(header):
                raise bad(
                    f"line {reader.line_num} has {len(row)} fields, the header {len(header)} "
                    "(truncated or damaged)"
                )
            else:
                rows += 1
    except csv.Error as exc:
        raise bad(f"line {reader.line_num}: {exc} (truncated or damaged)") from None
    if header is None:
        raise bad("empty file")
    if not text.endswith(("\n", "\r")):
        raise bad("truncated (its last line does not end)")
    present = set(upgrade_summary(pd.DataFrame(columns=header), version).columns)
    missing = [c for c in SUMMARY_COLUMNS if c not in present]
    if len(missing) == len(SUMMARY_COLUMNS):
        raise foreign(f"no {', '.join(SUMMARY_COLUMNS)} columns")
    if missing:
        raise bad(f"missing columns {', '.join(missing)}")
    if not rows:
        raise bad("no rows, only a header")
    summary = upgrade_summary(unescape(pd.read_csv(io.StringIO(text))), version)
    for col in ("point", *(FRAC[p] for p in PARTS)):
        values = pd.to_numeric(summary[col], errors="coerce")
        if col == "point" and not values.isna().any() and (values % 1 != 0).any():
            raise bad("column point holds values that are not whole numbers")
        if values.isna().any():
            raise bad(f"column {col} holds values that are not numbers")
    if summary["label"].isna().any():
        raise bad("column label has empty values")
    return summary


def read_frame(
    path: Path | str,
    columns: Sequence[str],
    upgrade: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
) -> pd.DataFrame:
    """A Parquet file of a results folder, with the `columns` the figures need (after
    `upgrade`, which translates an older layout's names); a damaged one raises
    `ResultsFileError` naming it (pyarrow's own errors do not always)."""
    from pyarrow import ArrowException

    path = Path(path)
    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError, ArrowException) as exc:
        lines = str(exc).strip().splitlines()
        why = lines[0] if lines else ""
        if str(path) in why:  # "Could not open Parquet input source '<path>': <why>"
            why = why.split(str(path))[-1].lstrip("'\": ")
        why = why or type(exc).__name__
        raise ResultsFileError(f"{path}: not a readable Parquet file, damaged? ({why})") from None
    if upgrade is not None:
        frame = upgrade(frame)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ResultsFileError(f"{path}: missing columns {', '.join(missing)}")
    return frame
