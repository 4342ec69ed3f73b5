"""The fast engine held to the per-iteration reference (sim/reference.py), as the engine
tests hold it: every request's outcome and times, the run's length and its memory parts.

Not a test file: the engine tests load it by path (`runpy.run_path`), since tests are not a
package (pytest runs with --import-mode=importlib).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pytest
from kvfrag.sim.allocators.base import PARTS
from kvfrag.sim.engine_records import RunResult


def assert_fast_equals_reference(fast: RunResult, slow: dict, parts: Iterable[str] = PARTS,
                                 columns: Iterable[str] = ()) -> None:
    """`fast` (engine.run) equals `slow` (reference.reference) request by request; `parts`:
    the memory parts (fractions of the budget over time) compared; `columns`: request
    columns compared besides the usual ones (the same name on both sides)."""
    rows = fast.requests.set_index("request_id")
    for rid, r in slow["requests"].items():
        row = rows.loc[rid]
        assert row["status"] == r["status"], rid
        assert row["preemptions"] == r["preemptions"], rid
        assert row["recomputed_tokens"] == r["recomputed"], rid
        assert row["peak_bytes"] == r["peak"], rid
        for col in columns:
            assert row[col] == r[col], (rid, col)
        for col, key in (("admitted_s", "admitted"), ("first_token_s", "first"),
                         ("finished_s", "finished")):
            if math.isnan(r[key]):
                assert math.isnan(row[col]), (rid, col)
            else:
                assert row[col] == pytest.approx(r[key], rel=1e-9, abs=1e-9), (rid, col)
        if r["status"] == "completed":
            assert row["generated_tokens"] == r["generated"], rid
    assert fast.summary["sim_time_s"] == pytest.approx(slow["time"], rel=1e-9)
    for p in parts:
        got = fast.summary[f"{p}_frac"]
        assert got == pytest.approx(slow["fractions"][p], rel=1e-7, abs=1e-9), p
