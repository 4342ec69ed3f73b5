"""CSV files a spreadsheet opens as text: cells that would start a formula are escaped.

kvfrag's CSV outputs carry text the user wrote (a swept trace path, a label, an error
message). A spreadsheet opening summary.csv evaluates a cell that starts with `=`, `+`, `-`,
`@`, a tab or a carriage return as a formula (CSV injection), so such a text cell is written
with a leading `'`, which spreadsheets show as the text itself. Text already starting with `'`
gets one more, so that `unescape` gives back exactly what was written; numbers are never
touched (a negative number stays a number).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

#: What a spreadsheet takes for the start of a formula.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def escape_cell(value: object) -> object:
    if isinstance(value, str) and value.startswith((*FORMULA_START, "'")):
        return "'" + value
    return value


def unescape_cell(value: object) -> object:
    if isinstance(value, str) and value.startswith("'"):
        return value[1:]
    return value


def _text_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if frame[c].dtype == object or pd.api.types.is_string_dtype(
        frame[c].dtype)]


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    """`frame.to_csv(path, index=False)` with every text cell escaped."""
    text = _text_columns(frame)
    if text:
        frame = frame.assign(**{c: frame[c].map(escape_cell) for c in text})
    frame.to_csv(path, index=False)


def unescape(frame: pd.DataFrame) -> pd.DataFrame:
    """A frame read from a CSV `write_csv` wrote, with its text cells as they were."""
    text = _text_columns(frame)
    if not text:
        return frame
    return frame.assign(**{c: frame[c].map(unescape_cell) for c in text})
