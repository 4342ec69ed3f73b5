"""The engine's walks of its running list, request by request, and speculative decoding's way
around them.

vLLM schedules its running requests in admission order: each takes its token, its drafts or
its prefill chunk and the blocks they need while token budget is left, and a refusal preempts
a victim. The fast engine takes that walk only where its order matters (`walk_running`: a
prompt partway ahead of a decoder; `walk_decoders`: policy priority at a shortage;
`continue_prefills`: the prompts partway, when every decoder went first) and,
under speculative decoding, where the vectorised steps (sim/spec_steps.py) do not apply
(`spec_schedule`): each is then an event, not the common case. Functions of the engine, kept
apart from its loop (sim/engine.py) so that each stays a readable size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfrag.sim.allocators.base import Grant, Refusal
from kvfrag.sim.engine_preempt import in_flight, preempt, victim_of
from kvfrag.sim.engine_recording import integrate, parts_now, row
from kvfrag.sim.engine_requests import _Req
from kvfrag.sim.spec_steps import slots_wanted

if TYPE_CHECKING:
    from kvfrag.sim.engine import Engine


def walk_decoders(eng: Engine) -> None:
    """Policy priority, a decoder short of a block: vLLM's walk of its running list, each
    decoder taking its slot in admission order (`grow`, not the cohort's step). A refusal
    preempts the victim by priority, which may have taken its slot already: it gives its
    token back, its blocks freed as vLLM frees them (a block its slot filled is cached,
    as vLLM caches it when scheduled). Only at a shortage: an event."""
    alloc = eng.alloc
    stepped: set[_Req] = set()
    for r in list(eng.running):
        rid = r.req.rid
        if r.status != "running" or not alloc.is_decoding(rid):
            continue
        if grow_walked(eng, r, 1, stepped, {})[0] is not None:
            stepped.add(r)
    eng.walked = True


def grow_walked(eng: Engine, r: _Req, tokens: int, stepped: set[_Req],
                 granted: dict[_Req, tuple[int, float]]) -> tuple[Grant | None, int, int]:
    """Grow `r` by `tokens` in a walk of the running list, preempting the victim of each
    refusal (`preempt_walked`) until it fits or `r` itself is preempted. Returns (the
    grant, or None when `r` went; the sequences and prefill tokens given back to the token
    budget by victims scheduled earlier in the walk)."""
    seqs = chunks = 0
    while isinstance(grant := eng.alloc.grow(r.req.rid, tokens, in_flight(eng, r)),
                     Refusal):
        victim = victim_of(eng)
        back, back_chunk = preempt_walked(eng, victim, stepped, granted)
        seqs += back
        chunks += back_chunk
        if victim is r:
            return None, seqs, chunks
    return grant, seqs, chunks


def preempt_walked(eng: Engine, victim: _Req, stepped: set[_Req],
                    granted: dict[_Req, tuple[int, float]]) -> tuple[int, int]:
    """Preempt `victim` in a walk of the running list. Under policy priority it may have
    been scheduled earlier in the walk: a decoder in `stepped` gives its token back (vLLM
    had scheduled it: its slot's block cached), a chunk in `granted` (tokens, attention
    seconds) its tokens and attention. Returns (sequences, prefill tokens) given back to
    the token budget."""
    st = victim.spec
    if victim in stepped:
        stepped.discard(victim)
        if st is not None:  # (its tokens scheduled go back; its slots are freed)
            back = st.scheduled
            st.computed -= back
            preempt(eng, victim)
            return back, 0
        preempt(eng, victim, 1, True)
        return victim.req.n, 0
    if victim in granted:
        chunk, seconds = granted.pop(victim)
        eng.prefill_attn_s -= seconds
        if victim in eng.prefilled:
            eng.prefilled.remove(victim)
        if st is not None:
            st.computed -= chunk
        preempt(eng, victim, 0 if st is not None else chunk)
        return 0, chunk
    preempt(eng, victim)
    return 0, 0


def walk_running(eng: Engine) -> tuple[int, int]:
    """vLLM's walk of its running list in admission order, when a prefill chunk is ahead
    of a decoder (`_prefill_ahead`): each request takes its token or its chunk and its
    blocks in turn, while token budget is left; a refusal preempts the newest running
    request (FCFS: not scheduled yet, or the request itself, which ends the walk) or the
    victim by priority (`victim_of`; one scheduled already gives its tokens back, and one
    that preempted itself lets the following ones go on). Decoders past the budget take
    no token this iteration. An event: it happens only while some prompt is partway.
    Returns (decoding sequences that took a token, prefill tokens)."""
    alloc, cfg = eng.alloc, eng.cfg
    budget = cfg.max_num_batched_tokens
    cap = eng._set_long_cap()
    eng.dropped = 0
    stepped = chunks = 0
    took: set[_Req] = set()  # scheduled in this walk: a victim by priority may be one
    granted: dict[_Req, tuple[int, float]] = {}
    spec, ds = eng.spec is not None, eng.draft_slots
    if spec:
        for r in eng.running:
            r.spec.scheduled = 0  # type: ignore[union-attr]
    for r in list(eng.running):
        if r.status != "running" and not (r.spec is not None and r.spec.extra):
            continue  # preempted by an earlier request's shortage
        rid = r.req.rid
        if spec and r.spec is not None and r.spec.decoding:
            # its sampled token and drafts, cut to the token and input budgets and to
            # max_model_len (vLLM leaves room for the token it samples)
            st = r.spec
            assert st is not None
            tokens = min(1 + st.drafts,
                         budget - stepped - chunks - ds * (len(took) + len(granted) + 1),
                         alloc.max_model_len - st.computed - 1)
            if tokens <= 0:
                eng.tokenless += r.req.n
                eng.tokenless_kv += st.computed
                continue
            more = spec_slots(eng, r, tokens)
            grown = True
            if more:
                grant, back, back_chunk = grow_walked(eng, r, more, took, granted)
                stepped -= back
                chunks -= back_chunk
                grown = grant is not None
            if grown:
                st.computed += tokens
                st.scheduled = tokens
                stepped += tokens
                took.add(r)
            continue
        if alloc.is_decoding(rid):
            if stepped + chunks + r.req.n > budget:
                eng.tokenless += r.req.n
                eng.tokenless_kv += r.req.n * alloc.tokens(rid)
                if eng.asynchronous:
                    eng.chunks_now[rid] = 0  # (nothing of it in flight next step)
                    alloc.unscheduled(rid)
                continue
            grant, back, back_chunk = grow_walked(eng, r, 1, took, granted)
            stepped -= back
            chunks -= back_chunk
            if grant is not None:
                stepped += r.req.n
                took.add(r)
            continue
        left = budget - stepped - chunks - ds * (len(took) + len(granted) + 1)
        if left <= 0:
            continue
        chunk, attention = next_chunk(eng, r, left, cap)
        if not chunk:
            continue  # (Mamba "align" mode: no block boundary in reach this step)
        last = chunk == r.prefill_left
        more = spec_slots(eng, r, chunk) if spec else chunk + (r.lead if last else 0)
        grant = None
        if more:
            grant, back, back_chunk = grow_walked(eng, r, more, took, granted)
            stepped -= back
            chunks -= back_chunk
        if grant is not None or not more:
            if grant is not None:
                eng._log_op("grow", rid, grant.nbytes, -1, grant.blocks)
            if r.spec is not None:
                r.spec.computed += chunk
                r.spec.scheduled = chunk
            r.prefill_left -= chunk
            chunks += chunk
            granted[r] = (chunk, attention)
            if eng.asynchronous:
                eng.chunks_now[rid] = chunk
            if last:
                eng.prefilling.remove(r)
                eng.prefilled.append(r)
    eng.spec_decode_tokens = stepped
    return stepped, chunks


def continue_prefills(eng: Engine, budget: int) -> int:
    """Chunked prefill: give in-progress prompts their next chunk, oldest first."""
    used = 0
    eng.dropped = 0
    if not eng.prefilling:
        return used
    granted = eng.granted
    for r in list(eng.prefilling):
        if used >= budget:
            break
        if r.status != "running":
            continue  # preempted by an earlier chunk this iteration
        chunk, attention = next_chunk(eng, r, budget - used, eng.long_cap)
        if not chunk:
            continue  # (Mamba "align" mode: no block boundary in reach this step)
        last = chunk == r.prefill_left
        while isinstance(grant := eng.alloc.grow(
                r.req.rid, chunk + (r.lead if last else 0), in_flight(eng, r)), Refusal):
            victim = victim_of(eng)
            # vLLM schedules running requests in admission order: a decoder after this
            # one had not taken its token yet, nor its share of the budget (policy
            # priority: one before it gives its token back).
            unstepped = int(victim is not r and eng.alloc.is_decoding(victim.req.rid))
            if unstepped:
                eng.dropped += victim.req.n
                budget += victim.req.n
            elif victim in granted:  # (policy priority) its chunk goes back to the budget
                unstepped, seconds = granted.pop(victim)
                used -= unstepped
                eng.prefill_attn_s -= seconds
                if victim in eng.prefilled:
                    eng.prefilled.remove(victim)
            # (a decoder before r in admission order: vLLM had scheduled its token)
            before = eng.by_priority and unstepped == 1 and _before(eng.running, victim, r)
            preempt(eng, victim, unstepped, before)
            if victim is r:
                break
        else:
            eng._log_op("grow", r.req.rid, grant.nbytes, -1, grant.blocks)
            r.prefill_left -= chunk
            used += chunk
            if eng.asynchronous:
                eng.chunks_now[r.req.rid] = chunk
            if eng.by_priority:
                granted[r] = (chunk, attention)
            if last:
                eng.prefilling.remove(r)
                eng.prefilled.append(r)
    granted.clear()
    return used


def _before(running: dict[_Req, None], a: _Req, b: _Req) -> bool:
    """Whether `a` was admitted before `b` (both running): a walk, at a preemption only."""
    for r in running:
        if r is a or r is b:
            return r is a
    return False


def next_chunk(eng: Engine, r: _Req, room: int, cap: int) -> tuple[int, float]:
    """The prefill chunk `r` takes with `room` tokens of budget left under the long-prefill
    `cap` (0: none), aligned as its allocator needs (0: none this step), and its attention's
    seconds, added to the iteration's: it runs even when a preemption discards the chunk."""
    chunk = min(r.prefill_left, room, cap if cap else r.prefill_left)
    chunk = eng.alloc.aligned_chunk(r.req, r.prefill - r.prefill_left, chunk, r.prefill,
                                    eng.cfg.prefill_chunk_limit)
    attention = 0.0
    if chunk and eng.chunk_cost:
        attention = eng.st.prefill_s(chunk, r.prefill - r.prefill_left)
        eng.prefill_attn_s += attention
    return chunk, attention


def spec_slots(eng: Engine, r: _Req, tokens: int) -> int:
    """Speculative decoding: the slots `r` grows by to hold `tokens` more
    (`slots_wanted`)."""
    assert r.spec is not None
    want = slots_wanted(r.spec, tokens, eng.lookahead, eng.alloc.max_model_len)
    return max(want - eng.alloc.tokens(r.req.rid), 0)


def spec_schedule(eng: Engine) -> tuple[int, int]:
    """Speculative decoding: schedule this iteration; returns (prefill tokens, decoders'
    tokens). The decoders go first, vectorised (`SpecSteps.plan`), when no prompt is
    partway and none of them is cut or short of a block; otherwise vLLM's walk of the
    running list takes the iteration, on the SpecState objects.

    Taking the state up into the arrays and back costs a few microseconds a request: after
    each return to the walk the arrays wait `backoff` turns (doubled at each return, halved
    at each planned iteration, at most 64), so that a run whose budget binds, or whose
    prompts come partway every other iteration, walks rather than moving its state to and
    fro at every turn."""
    specs, alloc = eng.specs, eng.alloc
    assert specs is not None
    if eng.spec_fast and not eng.prefilling:
        if not specs.arrayed and specs.wait:
            specs.wait -= 1
        elif not specs.arrayed:
            running = list(eng.running)
            specs.load(running, [alloc.tokens(r.req.rid) for r in running])
        if specs.arrayed and specs.plan(eng.cfg.max_num_batched_tokens,
                                        alloc.free_bytes() // eng.block_bytes):
            assert eng.paged is not None
            rids, more = specs.crossings()
            eng.paged.grow_within(rids, more)  # (the plan checked the free blocks)
            decoders = eng.spec_decode_tokens = specs.commit(sum(more))
            specs.backoff >>= 1
            return eng._schedule(decoders), decoders
    if specs.arrayed:
        specs.wait = specs.backoff
        specs.backoff = min(2 * specs.backoff + 1, 64)
    spec_unload(eng)
    decoders, chunks = walk_running(eng)
    return eng._schedule(decoders, chunks), decoders


def spec_stretch(eng: Engine, w0: float, per_kv: float) -> bool:
    """Speculative decoding, this decode-only iteration (its decoders planned) and as many
    more as nothing happens (`SpecSteps.stretch`): one event, one row with the parts
    integrated step by step. False when it stays a single iteration."""
    specs, alloc = eng.specs, eng.alloc
    assert specs is not None
    if (not specs.arrayed or eng.queue or eng.held or eng.preempted_now
            or eng.released_now or not specs.all_decoding()):
        return False
    horizon = eng.arrivals.next_s
    if eng.cfg.max_time_s is not None:
        horizon = min(horizon, eng.cfg.max_time_s)
    p0, p1, p2, p3, p4 = parts_now(eng)
    hole = alloc.largest_hole()
    got = specs.stretch(horizon - eng.now, w0, per_kv,
                        alloc.free_bytes() // eng.block_bytes, alloc.bytes_per_token)
    if got is None:
        return False
    n, duration, tokens, blocks, tail, rids, more = got
    assert eng.paged is not None
    eng.paged.grow_within(rids, more)  # (every decoder told its slots held)
    blocks *= eng.block_bytes
    integrate(eng, p0 * duration + tokens, p1 * duration + blocks - tail - tokens,
              p2 * duration + tail, p3 * duration, p4 * duration - blocks)
    eng.saved += alloc.saved_by_sharing() * duration
    eng.overreserved += alloc.overreserved_bytes() * duration
    s = eng.rows
    s.stretches = True
    row(eng, duration, n, p0 + tokens / duration, p1 + (blocks - tail - tokens) / duration,
        p2 + tail / duration, p3, p4 - blocks / duration, hole)
    eng.env.timeout(duration).callbacks.append(eng._iterated)
    return True


def spec_unload(eng: Engine) -> None:
    """Back to the SpecState objects, the allocator told every slot held (within the
    blocks it holds: never refused)."""
    specs = eng.specs
    if specs is None or not specs.arrayed:
        return
    for rid, more in specs.store():
        grant = eng.alloc.grow(rid, more, decoder_in_flight(eng, eng.by_rid[rid]))
        assert not isinstance(grant, Refusal)


def decoder_in_flight(eng: Engine, r: _Req) -> int:
    """Async: a decoder's tokens in flight (`engine_preempt.in_flight`, its state in the arrays)."""
    if not eng.asynchronous:
        return 0
    return eng.chunks_prev.get(r.req.rid, 1)
