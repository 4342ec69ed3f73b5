"""Names the command line offers before any trace is read: trace formats, time units and the
request fields a column map may name. Kept free of pandas so that `kvfrag --help` is quick."""

from __future__ import annotations

from typing import Literal, get_args

TimeUnit = Literal["s", "ms", "us", "ns", "datetime"]
TIME_UNITS: tuple[str, ...] = get_args(TimeUnit)
Format = Literal["auto", "azure", "mooncake", "sarathi", "kvfrag", "csv", "jsonl", "parquet"]
FORMATS: tuple[str, ...] = get_args(Format)
#: Request fields a column mapping may name, in the order problems are reported.
FIELDS: tuple[str, ...] = (
    "arrival", "prompt_tokens", "output_tokens", "max_tokens", "n", "hash_ids", "priority",
    "accepted_drafts",
)
