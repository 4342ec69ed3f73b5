"""Compaction on the contiguous allocator: when an admission would be refused as FRAGMENTED,
live slabs slide down (in address order) into one block, the free space becomes one hole at
the top, and the admission is retried; the move costs bytes moved / bandwidth seconds, which
the engine adds to the iteration."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import Reason, Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.units import parse_rate


def build(capacity=100, b=1, mml=100, **opts):
    return make_allocator(
        "contiguous", capacity=capacity, bytes_per_token=b, max_model_len=mml,
        reserve="oracle", **opts,
    )


def fragmented(**opts):
    """Five 20-byte slabs filling 100 bytes, then the 2nd and 4th freed: 40 bytes free in two
    20-byte holes, so a 30-byte slab fits nowhere."""
    a = build(**opts)
    for rid in range(5):
        assert a.admit(Request(rid, 10, 10), decoding=False).offset == 20 * rid
    a.free(1)
    a.free(3)
    return a


def check_layout(a) -> None:
    slabs, holes = a.slabs(), a.holes()
    at = 0
    for off, size in sorted([(o, s) for o, s, _ in slabs] + holes):
        assert off == at and size > 0, (slabs, holes)
        at += size
    assert at == a.capacity
    for (o1, s1), (o2, _) in itertools.pairwise(holes):
        assert o1 + s1 < o2
    a.account().check()


def test_parse_rate():
    assert parse_rate("4.8TB/s") == 4.8e12
    assert parse_rate("900 GB/s") == 9e11
    assert parse_rate("1GiB/s") == 2**30
    assert parse_rate(2e9) == parse_rate("2e9") == 2e9
    for bad in ("fast", "0", -1, "3XB/s", True):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_refused_without_compaction_admitted_with_it():
    req = Request(9, 15, 15)  # a 30-byte slab
    plain = fragmented()
    refusal = plain.admit(req)
    assert not refusal and refusal.reason is Reason.FRAGMENTED
    assert plain.compactions == 0 and plain.take_stall() == 0.0 and plain.take_moves() == []

    a = fragmented(compaction=True, bandwidth="1KB/s")
    assert a.slabs() == [(0, 20, 0), (40, 20, 2), (80, 20, 4)]
    grant = a.admit(req)
    assert grant and grant.offset == 60 and grant.nbytes == 30
    # Slab 0 stays, slabs 2 and 4 slide down, in order; the hole is at the top.
    assert a.slabs() == [(0, 20, 0), (20, 20, 2), (40, 20, 4), (60, 30, 9)]
    assert a.holes() == [(90, 10)]
    assert a.take_moves() == [(2, 40, 20, 20), (4, 80, 40, 20)]
    assert a.take_moves() == []
    assert (a.compactions, a.bytes_moved) == (1, 40)
    assert a.stall_s == 40 / 1000
    assert a.take_stall() == 40 / 1000 and a.take_stall() == 0.0
    assert a.stall_s == 40 / 1000  # the total stays
    check_layout(a)
    # Freed slabs come back at their new place.
    a.free(2)
    assert a.holes() == [(20, 20), (90, 10)]
    check_layout(a)


def test_no_compaction_when_a_hole_fits_or_memory_is_short():
    a = fragmented(compaction=True)
    assert a.admit(Request(9, 10, 10)).offset == 20  # fits the first hole: nothing moves
    assert a.compactions == 0 and a.take_moves() == []
    refusal = a.admit(Request(10, 15, 15))  # 30 > 20 free: out of memory, not fragmented
    assert not refusal and refusal.reason is Reason.OUT_OF_MEMORY
    assert a.compactions == 0 and a.holes() == [(60, 20)]


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="compaction must be true or false"):
        build(compaction="yes")
    with pytest.raises(ValueError, match="not a rate"):
        build(compaction=True, bandwidth="fast")
    assert build().bandwidth == 4.8e12


def test_every_sample_slab_moves():
    a = build(capacity=120)
    a.compaction = True
    assert a.admit(Request(0, 5, 5), decoding=False)  # [0, 10)
    assert a.admit(Request(1, 5, 5, n=2), decoding=False)  # [10, 20) and [20, 30)
    assert a.admit(Request(2, 5, 5), decoding=False)  # [30, 40)
    assert a.admit(Request(3, 40, 40), decoding=False)  # [40, 120)
    a.free(0)
    a.free(2)
    assert a.admit(Request(4, 8, 7), decoding=False).offset == 100  # 15 bytes, at the top
    assert a.take_moves() == [(1, 10, 0, 10), (1, 20, 10, 10), (3, 40, 20, 80)]
    assert a.bytes_moved == 100
    check_layout(a)
    a.free(1)
    check_layout(a)


# --------------------------------------------- random operations against a non-compacting twin
OPS = st.lists(
    st.tuples(st.sampled_from(["admit", "admit", "free", "step"]), st.integers(0, 10**6)),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(
    placement=st.sampled_from(["first-fit", "best-fit", "worst-fit", "next-fit"]),
    reserve=st.sampled_from(["oracle", "pow2", "max_tokens"]),
    ops=OPS,
)
def test_random_operations(placement, reserve, ops):
    b, mml = 3, 64
    a = make_allocator(
        "contiguous", capacity=b * 300 + 2, bytes_per_token=b, max_model_len=mml,
        reserve=reserve, placement=placement, compaction=True, bandwidth=1000,
    )
    rid = 0
    for op, x in ops:
        if op == "admit":
            req = Request(rid, 1 + x % 40, 1 + x // 40 % 20, 1 + x // 800 % 30 or None)
            rid += 1
            twin = copy.deepcopy(a)
            twin.compaction = False
            expected = twin.admit(req)
            before = a.slabs()
            moved = a.bytes_moved
            result = a.admit(req)
            moves = a.take_moves()
            if expected or expected.reason is not Reason.FRAGMENTED:
                assert result == expected and not moves and a.bytes_moved == moved
                continue
            assert result and a.compactions and a.bytes_moved > moved
            # Old slabs keep their order, packed from 0; exactly those that shifted moved.
            packed, at = [], 0
            for _off, size, r in before:
                packed.append((at, size, r))
                at += size
            assert [s for s in a.slabs() if s[2] != req.rid] == packed
            shifted = [(r, o, n, s) for (o, s, r), (n, _, _) in zip(before, packed, strict=True)
                       if o != n]
            assert moves == shifted
            assert a.bytes_moved - moved == sum(s for *_, s in shifted)
            assert a.take_stall() == pytest.approx((a.bytes_moved - moved) / 1000)
        elif op == "free" and a.rids():
            a.free(sorted(a.rids())[x % a.live])
        elif op == "step" and a.n_decoding:
            a.step(x % (a.steps_until_done() + 1))
            while a.n_decoding and a.steps_until_done() == 0:
                a.free(a.first_done())
        check_layout(a)
    assert a.stall_s == pytest.approx(a.bytes_moved / 1000)


# ------------------------------------------------------------------------------ the engine
def fragmenting_workload(n: int = 300, seed: int = 5) -> pd.DataFrame:
    """All requests at t = 0 (so timing never changes a decision), mixed sizes, max_tokens."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(20, 1200, n)
    output = rng.integers(5, 400, n)
    return pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.zeros(n),
            "prompt_tokens": prompt,
            "output_tokens": output,
            "max_tokens": output + rng.integers(0, 600, n),
        }
    )


def engine_run(log: bool = False, **opts):
    b = 1024
    alloc = make_allocator(
        "contiguous", capacity=b * 20_000, bytes_per_token=b, max_model_len=2048,
        reserve="max_tokens", placement="first-fit", **opts,
    )
    cfg = EngineConfig(
        max_num_seqs=64, max_num_batched_tokens=4096, log_allocations=log,
        step_time=StepTime(base_s=0.01, per_batched_token_s=1e-5, per_kv_token_s=1e-8),
    )
    return run(fragmenting_workload(), alloc, cfg)


def test_engine_reports_compaction_and_the_stall_lengthens_the_run():
    plain = engine_run().summary
    assert plain["frag_refusals"] > 0
    assert (plain["compactions"], plain["bytes_moved"], plain["stall_s"]) == (0, 0, 0.0)

    bw = 5e8  # slow enough to see: 500 MB/s
    slow = engine_run(compaction=True, bandwidth=bw).summary
    free = engine_run(compaction=True, bandwidth=1e30).summary  # the same run, no stall
    assert slow["frag_refusals"] == 0 and slow["completed"] == 300
    assert slow["compactions"] > 0 and slow["bytes_moved"] > 0
    assert slow["stall_s"] == pytest.approx(slow["bytes_moved"] / bw)
    # Same decisions (everything arrives at once), so the timeline is longer by the stall.
    for key in ("compactions", "bytes_moved", "events", "preemptions", "generated_tokens"):
        assert slow[key] == free[key], key
    assert slow["sim_time_s"] == pytest.approx(free["sim_time_s"] + slow["stall_s"], rel=1e-9)
    assert slow["mean_latency_s"] > free["mean_latency_s"]


def test_allocation_log_moves_keep_offsets_consistent():
    res = engine_run(log=True, compaction=True, bandwidth="1GB/s")
    log = res.log
    assert "from_offset" in log.columns
    moves = log[log["op"] == "move"]
    assert len(moves) > 0 and int(moves["nbytes"].sum()) == res.summary["bytes_moved"]
    where: dict[int, tuple[int, int]] = {}  # rid -> (offset, bytes), replayed from the log
    for row in log.itertuples(index=False):
        if row.op == "admit":
            assert row.rid not in where
            where[row.rid] = (row.offset, row.nbytes)
        elif row.op == "move":
            offset, nbytes = where[row.rid]
            assert (row.from_offset, row.nbytes) == (offset, nbytes)
            assert row.offset < row.from_offset  # compaction only slides down
            where[row.rid] = (row.offset, nbytes)
        elif row.op == "free":
            assert where.pop(row.rid) == (row.offset, row.nbytes)  # freed where it was moved
        else:
            continue
        spans = sorted(where.values())
        for (o1, n1), (o2, _) in itertools.pairwise(spans):
            assert o1 + n1 <= o2, "slabs overlap"
        assert all(o + n <= 1024 * 20_000 for o, n in spans)
    assert (log.loc[log["op"] != "move", "from_offset"] == -1).all()
    # The per-request record has the final offset (after moves), as the last log row says.
    last = log[log["op"].isin(["admit", "move"])].groupby("rid")["offset"].last()
    offsets = res.requests.set_index("request_id")["offset_bytes"]
    assert (offsets.loc[last.index] == last).all()


def _pieces(requests: pd.DataFrame) -> list[tuple[int, float, float, int, int]]:
    """(rid, start, end, offset, bytes) of every place a slab was held, from the request
    table's move columns."""
    out = []
    for row in requests.itertuples(index=False):
        times, offsets = list(row.slab_move_t_s), list(row.slab_move_offset_bytes)
        ends = [*times[1:], row.released_s]
        out += [(row.request_id, t0, t1, off, row.peak_bytes)
                for t0, t1, off in zip(times, ends, offsets, strict=True)]
    return out


def test_request_table_records_each_slab_move():
    """A compacting run writes where each slab was over time (admission, then each move); the
    pieces stay in the budget, follow one another from admission to release, and no two live
    pieces overlap. A run without compaction writes no such columns."""
    assert "slab_move_t_s" not in engine_run().requests.columns
    res = engine_run(log=True, compaction=True, bandwidth="1GB/s")
    req = res.requests
    assert res.summary["compactions"] > 0
    assert req["slab_move_t_s"].map(len).equals(req["slab_move_offset_bytes"].map(len))
    assert (req["status"] == "completed").all() and (req["slab_move_t_s"].map(len) >= 1).all()
    moved = 0
    for row in req.itertuples(index=False):
        times, offsets = list(row.slab_move_t_s), list(row.slab_move_offset_bytes)
        assert times[0] == row.admitted_s  # from its admission ...
        assert offsets[-1] == row.offset_bytes  # ... to where it was freed
        assert all(t0 <= t1 for t0, t1 in itertools.pairwise([*times, row.released_s]))
        assert all(o1 > o0 for o0, o1 in itertools.pairwise(offsets[::-1]))  # slides down
        moved += len(times) - 1
    log = res.log
    assert moved > 0 and moved == (log["op"] == "move").sum()  # every move is recorded
    pieces = _pieces(req)
    assert all(off >= 0 and off + n <= 1024 * 20_000 for _, _, _, off, n in pieces)
    # Sweep over time: at each moment, the pieces held then lie apart.
    live = [p for p in pieces if p[2] > p[1]]
    for t in sorted({p[1] for p in live}):
        spans = sorted((off, n) for _, t0, t1, off, n in live if t0 <= t < t1)
        for (o1, n1), (o2, _) in itertools.pairwise(spans):
            assert o1 + n1 <= o2, f"slabs overlap at t = {t}"
    # The moves' times and places are the log's.
    logged = log[log["op"] == "move"].groupby("rid")["offset"].apply(list)
    for rid, offsets in logged.items():
        row = req[req["request_id"] == rid].iloc[0]
        assert list(row["slab_move_offset_bytes"])[1:] == offsets
