"""The printed table: what a scenario is about (prefix-cache hits, memory saved by sharing,
compaction stall) gets a column only when some run shows it, so the other scenarios' tables
stay as they were; swept mappings are labelled by the keys that differ."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvfrag.results import TABLE, format_table

#: The header every table has (no sweep, nothing particular to show).
BASE_HEADER = [
    "label", "tokens", "reserved", "internal", "external", "free", "kv util", "mean run",
    "max run", "done", "rej", "preempt", "frag ref", "tok/s", "p99 lat s", "ttft s", "p99 ttft",
    "tpot ms", "p99 tpot",
]


def _summary(**columns) -> pd.DataFrame:
    """Two runs' summary with every column the table reads (zeros), then `columns`."""
    rows = {key: [0.0, 0.0] for key, *_ in TABLE}
    rows.update(label=["paged-16", "prefix-16"], compactions=[0, 0])
    rows.update(columns)
    return pd.DataFrame(rows)


def _header(table: str) -> list[str]:
    return table.split("\n")[0].split("  ")


def _column(table: str, name: str) -> list[str]:
    """The cells under `name` (right-aligned: the header's end marks them)."""
    lines = table.split("\n")
    end = lines[0].index(name) + len(name)
    return [line[:end].split()[-1] for line in lines[1:]]


def test_other_scenarios_tables_do_not_change():
    header = [h for h in _header(format_table(_summary(), [])) if h]
    assert header == BASE_HEADER


@pytest.mark.parametrize(
    ("columns", "name", "cells"),
    [
        ({"prefix_hit_rate_tokens": [0.0, 0.0606]}, "hit %", ["0.0%", "6.1%"]),
        ({"memory_saved_by_sharing_frac": [0.0, 0.491]}, "saved", ["0.0%", "49.1%"]),
        ({"compactions": [0, 693], "stall_s": [0.0, 2.2677]}, "stall s", ["0.00", "2.27"]),
    ],
)
def test_the_headline_column_shows_only_when_relevant(columns, name, cells):
    table = format_table(_summary(**columns), [])
    assert [h for h in _header(table) if h] == [*BASE_HEADER, name]
    assert _column(table, name) == cells


def test_a_stall_column_needs_a_compaction():
    """stall_s is 0 without compactions; a column of zeros would carry nothing."""
    table = format_table(_summary(stall_s=[0.0, 0.0]), [])
    assert "stall s" not in table


def test_headline_columns_keep_their_order_and_old_results_print():
    summary = _summary(prefix_hit_rate_tokens=[0.0, 0.06],
                       memory_saved_by_sharing_frac=[0.0, 0.036], compactions=[1, 0],
                       stall_s=[0.5, 0.0])
    assert _header(format_table(summary, []))[-3:] == ["hit %", "saved", "stall s"]
    # Results from before these columns existed: no column, no error.
    old = summary.drop(columns=["prefix_hit_rate_tokens", "memory_saved_by_sharing_frac",
                                "compactions", "stall_s"])
    assert [h for h in _header(format_table(old, [])) if h] == BASE_HEADER


def test_swept_mappings_are_labelled_by_what_differs():
    workloads = [json.dumps({"trace": {"path": "t"}, "n": 2}),
                 json.dumps({"trace": {"path": "t"}, "n": 4}),
                 json.dumps({"trace": {"path": "t"}, "beam_width": 3})]
    summary = _summary().iloc[[0, 0, 0]].assign(workload=workloads,
                                                memory_saved_by_sharing_frac=[0.3, 0.5, 0.6])
    table = format_table(summary.reset_index(drop=True), ["workload"])
    assert [line.split()[0] for line in table.split("\n")[1:]] == ["n=2", "n=4", "beam_width=3"]
    assert "{" not in table and _header(table)[-1] == "saved"


def test_capacity_shows_where_computed_and_the_memory_figure_where_capped():
    summary = _summary(capacity_requests=[46.0, 64.0], capacity_memory_requests=[46.0, 378.0],
                       capacity_sample_requests=[2048, 2048], capacity_capped=[0, 1])
    table = format_table(summary, [])
    header = [h for h in _header(table) if h]
    at = header.index("max run")
    assert header[at + 1:at + 3] == ["capacity", "mem cap"]
    assert _column(table, "capacity") == ["46.0", "64.0"]
    assert _column(table, "mem cap") == ["46.0", "378.0"]
    uncapped = format_table(summary.assign(capacity_capped=[0, 0]), [])
    assert "capacity" in uncapped and "mem cap" not in uncapped
