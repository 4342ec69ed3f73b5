"""What the engine records as it runs, and the records it hands back at the end.

Each event adds its memory parts' byte-seconds to the run's time integrals (an iteration: the
parts now times its duration; a decode stretch: the allocator's exact integrals over its
steps) and one row to the time series; `result` turns the run into `RunResult`. Functions of
the engine, kept apart from its loop (sim/engine.py) so that each stays a readable size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from kvfrag.sim.allocators.base import Reason
from kvfrag.sim.engine_records import _ROWS_PER_CHUNK, RunResult
from kvfrag.sim.engine_summary import summary

if TYPE_CHECKING:
    from kvfrag.sim.engine import Engine


def parts_now(eng: Engine) -> tuple[int, int, int, int, int]:
    """The allocator's parts now (PARTS order), judged by the queue's head. Under speculative
    decoding's arrays the allocator is told a request's slots at its block crossings only
    (sim/spec_steps.py): the slots held past those it was told are stored tokens, not
    reserved, and move from the one to the other."""
    alloc = eng.alloc
    p0, p1, p2, p3, p4 = alloc.parts(eng._probe())
    if eng.specs is not None and eng.specs.lag:
        moved = eng.specs.lag * alloc.bytes_per_token
        p0, p1 = p0 + moved, p1 - moved
    return p0, p1, p2, p3, p4


def record(eng: Engine, dt: float, iterations: int) -> None:
    """`iterations` (0: a wait) lasting `dt` seconds, the parts as they are now."""
    alloc = eng.alloc
    p0, p1, p2, p3, p4 = parts_now(eng)
    integrate(eng, p0 * dt, p1 * dt, p2 * dt, p3 * dt, p4 * dt)
    eng.saved += alloc.saved_by_sharing() * dt
    eng.overreserved += alloc.overreserved_bytes() * dt
    if eng.waste_split:
        padding, out = alloc.waste_parts()
        eng.padding += padding * dt
        eng.out_of_window += out * dt
    row(eng, dt, iterations, p0, p1, p2, p3, p4, alloc.largest_hole())


def record_stretch(eng: Engine, n: int, w0: float, w1: float, duration: float) -> None:
    """This iteration (already stepped) plus n-1 more: exact integrals, one row."""
    alloc = eng.alloc
    probe = eng._probe()
    p0, p1, p2, p3, p4 = alloc.parts(probe)
    s0, s1, s2, s3, s4 = p0 * w0, p1 * w0, p2 * w0, p3 * w0, p4 * w0
    eng.saved += alloc.saved_by_sharing() * w0
    eng.overreserved += alloc.overreserved_bytes() * duration  # fixed in a stretch
    if n > 1:
        more = alloc.integrals(n - 1, probe, w0 + w1, w1)  # (PARTS, then saved)
        s0, s1, s2 = s0 + more[0], s1 + more[1], s2 + more[2]
        s3, s4 = s3 + more[3], s4 + more[4]
        eng.saved += more[5]
    if eng.waste_split:
        padding, out = alloc.waste_parts()
        eng.padding += padding * w0
        eng.out_of_window += out * w0
        if n > 1:
            wasted = alloc.waste_integrals(n - 1, w0 + w1, w1)
            eng.padding += wasted[0]
            eng.out_of_window += wasted[1]
    integrate(eng, s0, s1, s2, s3, s4)
    eng.rows.stretches = True
    row(eng, duration, n, s0 / duration, s1 / duration, s2 / duration, s3 / duration,
        s4 / duration, alloc.largest_hole())


def integrate(eng: Engine, s0: float, s1: float, s2: float, s3: float, s4: float) -> None:
    """Add byte-seconds to each part's time integral (PARTS order, spelled out: compiled,
    five float attributes cost less than a list of boxed floats and a loop over it)."""
    eng.area0 += s0
    eng.area1 += s1
    eng.area2 += s2
    eng.area3 += s3
    eng.area4 += s4


def row(
    eng: Engine, dt: float, iterations: int, p0: object, p1: object, p2: object, p3: object,
    p4: object, largest_hole: int,
) -> None:
    """One row of the time series: `dt` seconds of `iterations`, the parts' mean bytes."""
    # (`object`: the parts go into the row as they come, ints as ints; compiled, a `float`
    # parameter would turn an int into a float)
    running = len(eng.running)
    eng.busy_running += running * dt
    blocked = eng.head_reason is Reason.FRAGMENTED and bool(eng.queue)
    if blocked:
        eng.frag_blocked_s += dt
    rows = eng.rows
    rows.t.append(eng.now)
    rows.dt.append(dt)
    rows.iterations.append(iterations)
    rows.running.append(running)
    rows.waiting.append(len(eng.queue))
    rows.p0.append(p0)  # (PARTS, spelled out: no loop)
    rows.p1.append(p1)
    rows.p2.append(p2)
    rows.p3.append(p3)
    rows.p4.append(p4)
    rows.hole.append(largest_hole)
    rows.blocked.append(blocked)
    if eng.group_of:  # (per group: `_Rows.flush` sums them per kind)
        rows.groups.extend(eng.alloc.group_blocks())
    if len(rows.t) == _ROWS_PER_CHUNK:
        rows.flush()


def result(eng: Engine) -> RunResult:
    """The run's records: requests, time series, allocation log and summary (speculative
    decoding's arrays already stored back: `engine_walk.spec_unload`)."""
    alloc, out = eng.alloc, eng.out
    at_end = np.zeros(len(eng.inputs), dtype=np.int64)
    for rid in alloc.rids():  # still holding memory when the run stopped
        r = eng.by_rid[rid]
        at_end[r.idx] = alloc.tokens(rid)
        r.peak = max(r.peak, alloc.allocated_bytes(rid))
    for r in list(eng.made.values()):  # running, waiting, or held when the run stopped
        out.store(r)
    requests = out.frame(at_end, moved=eng.track_moves and alloc.compactions > 0)
    timeseries = eng.rows.frame(eng.group_names)  # (which empties the rows)
    log = None if eng.log is None else eng.log.frame()
    return RunResult(summary(eng, requests, timeseries), timeseries, requests, log)
