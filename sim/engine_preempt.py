"""The engine's preemptions: whom a shortage preempts, and freeing a preempted request.

vLLM preempts by recomputation: the victim's memory is freed and it goes back to the head of
the queue (policy priority: by its key), to prefill its stored tokens again. Under async
scheduling a victim may be done already (its last token in flight: `drop_held`) or still
hold tokens that are computed but not processed, and the requests done at the last
iteration's end are freed once this one is scheduled (`release_held`). Functions of the engine,
kept apart from its loop (sim/engine.py) so that each stays a readable size; the walks of the
running list (sim/engine_walk.py) preempt through them too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfrag.sim.engine_requests import _Req

if TYPE_CHECKING:
    from kvfrag.sim.engine import Engine


def victim_of(eng: Engine) -> _Req:
    """Whom a shortage preempts: the newest running request (FCFS), or (policy priority)
    the one with the largest (priority, arrival), the first of them in admission order,
    as vLLM's max() over its running list. (Preempting them in that order until the
    decoders fit is what vLLM's walk of its running list comes to: each refusal takes the
    current largest, and one comes only while those left do not fit.)"""
    if not eng.by_priority:
        return next(reversed(eng.running))
    return max(eng.running, key=victim_key)


def in_flight(eng: Engine, r: _Req) -> int:
    """Async: `r`'s tokens scheduled in the previous iteration, its output not applied
    yet (a decoder's token; a prompt's chunk); 0 when synchronous."""
    if not eng.asynchronous:
        return 0
    got = eng.chunks_prev.get(r.req.rid)
    if got is not None:
        return got
    return 1 if eng._decodes(r) else 0


def preempt(eng: Engine, r: _Req, unstepped: int = 0, scheduled: bool = False) -> None:
    """Free `r` and queue it first (policy priority: by its key); `unstepped`: tokens this
    iteration gave it before vLLM would have (a decoder advanced before its turn came) or
    that vLLM takes back (a prefill chunk scheduled before it was preempted); `scheduled`
    (policy priority): vLLM had scheduled its token in this step, caching its blocks over
    the tokens known then (async: one more than those processed before)."""
    alloc, rid = eng.alloc, r.req.rid
    stored = alloc.tokens(rid) - unstepped
    decoded = eng._decodes(r)
    st = r.spec
    if st is not None:  # (its slots run ahead of its computed tokens; async: less those
        stored = st.computed - st.rollback  # rejected in its step in flight)
        st.computed = st.drafts = st.scheduled = st.rollback = 0
        st.decoding = False
    r.peak = max(r.peak, alloc.allocated_bytes(rid))
    if r.status == "completed":  # async: done, its last token in flight
        drop_held(eng, r)
        return
    if decoded and eng.asynchronous and r not in eng.fresh:
        eng._log_free(r, stored - 1 + scheduled)
        alloc.free_preempted(rid, stored - 1 + scheduled)  # (its last step in flight)
    else:
        eng._log_free(r)
        alloc.free(rid)
    del eng.running[r]
    eng.seqs -= r.req.n
    if r in eng.prefilling:
        eng.prefilling.remove(r)
    if eng.cfg.batching == "static" and not eng.running:
        eng._release_batch()  # its last running member left: the batch is over
    r.recomputed += stored
    r.preemptions += 1
    eng.recomputed += stored
    eng.preemptions += 1
    eng.preempted_now = True
    # A decoder recomputes everything it stored and its last sampled token, which had no
    # slot yet (a group's slots run one ahead: its stored tokens include it); a
    # half-prefilled one starts its prefill over.
    r.prefill = stored + 1 - r.lead if decoded else r.prefill
    r.status = "waiting"
    eng.queue.appendleft(r)


def drop_held(eng: Engine, r: _Req) -> None:
    """Async: preempt a done request that holds its memory until its last token's output
    is applied (vLLM's victim is the newest running request, done or not). It is freed
    now and counted as preempted; the token in flight still finishes it."""
    alloc, rid = eng.alloc, r.req.rid
    if r.spec is not None:
        r.spec.extra = False  # (not scheduled again)
    if r in eng.fresh:
        eng._log_free(r)
        alloc.free(rid)
    else:
        eng._log_free(r, alloc.tokens(rid) - 1)
        alloc.free_preempted(rid, alloc.tokens(rid) - 1)
    eng.held.remove(r)
    del eng.running[r]
    eng.seqs -= r.req.n
    r.preemptions += 1
    eng.preemptions += 1
    eng.preempted_now = True
    r.released = eng.now
    eng._retire(r)


def release_held(eng: Engine) -> None:
    """Async: free the requests done at the last iteration's end, once this iteration is
    scheduled (vLLM applies step k-1's output after scheduling step k), in rid order."""
    alloc = eng.alloc
    for r in sorted(eng.held, key=rid_of):
        rid = r.req.rid
        r.peak = max(r.peak, alloc.allocated_bytes(rid))
        r.released = eng.now
        eng._log_free(r)
        eng._spec_leave(r)
        alloc.free(rid)
        del eng.running[r]
        eng.seqs -= r.req.n
        eng._retire(r)
    eng.held.clear()


def rid_of(r: _Req) -> int:
    return r.req.rid


def victim_key(r: _Req) -> tuple[int, float]:
    """vLLM's victim order under policy priority: (priority, arrival time), the largest."""
    return (r.priority, r.arrival)
