"""The engine's timing: an iteration's seconds, and how many decode-only iterations a stretch
runs before the next event.

An iteration takes the step time's base and per-token terms, its KV reads counted from the
allocator (every sequence reads its whole context). A stretch of decode-only iterations grows by
one token per decoding sequence each iteration, so its durations w0, w0 + w1, ... add up in
closed form; it ends at the first of: a completion, memory coming back while requests wait,
an idle cached block's eviction a waiting group awaits, the next arrival that could be admitted
or `max_time_s`, and a decoder short of a block. Functions of the engine, kept apart from its
loop (sim/engine.py) so that each stays a readable size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvfrag.sim.engine_config import StepTime
from kvfrag.sim.spec_steps import kv_read_objects

if TYPE_CHECKING:
    from kvfrag.sim.engine import Engine


def kv_read_tokens(eng: Engine) -> int:
    if eng.specs is not None:  # (slots run ahead of tokens: the contexts read)
        if eng.specs.arrayed:
            return eng.specs.kv_read(bool(eng.chunk_cost))
        return kv_read_objects(eng.running, bool(eng.chunk_cost))
    if eng.chunk_cost:
        return eng.alloc.decoding_sequence_tokens()
    return eng.alloc.sequence_tokens() - eng.held_done_tokens


def iteration_time(eng: Engine, batched: int) -> tuple[float, float]:
    """This iteration's seconds (its prefill chunks' attention is in prefill_attn_s), and
    the step time's cost per KV token read (what a decode stretch grows by). Decoders
    that took no token this iteration (`tokenless`) neither sample nor read."""
    decoders = eng.alloc.decoding_weight - eng.tokenless
    if eng.spec is not None:  # (every token a decoder verifies is sampled)
        decoders = eng.spec_decode_tokens
    # Sampled positions: one per decoding sequence and per prompt whose prefill ends now.
    logits = min(decoders + len(eng.prefilled), batched)
    st = eng.st
    if isinstance(st, StepTime):  # (compiled: a direct call, not a Protocol's lookup)
        base, per_kv = st.affine(batched, logits, decoders > 0)
    else:
        base, per_kv = st.affine(batched, logits, decoders > 0)
    kv = kv_read_tokens(eng)
    if eng.spec is None:
        kv -= eng.tokenless_kv  # (decoders that took no token read nothing)
    return base + per_kv * kv + eng.prefill_attn_s, per_kv


def stretch(eng: Engine, decoders: int) -> tuple[int, float, float, float]:
    """How many decode-only iterations run before the next event, and their timing."""
    alloc = eng.alloc
    w0, per_kv = iteration_time(eng, decoders)
    w1 = per_kv * decoders  # each iteration adds one token per decoding sequence
    done = alloc.steps_until_done()
    assert done is not None  # (a stretch has decoders)
    n = 1 + done
    if (eng.preempted_now or eng.released_now) and eng.queue:
        # admissions were skipped this iteration, or it freed memory and seats after
        # they were tried (async): the next one tries them
        n = 1
    shrink = alloc.steps_until_shrink() if eng.queue else None
    if shrink is not None:  # memory comes back then: the queue head may fit
        n = min(n, shrink)
    evict = alloc.steps_until_evict() if eng.queue and eng.groups else None
    if evict is not None:  # a waiting group may fit then (see `_released`)
        n = min(n, evict)
    horizon = eng.arrivals.next_s
    if eng.queue and eng.cfg.admission == "fcfs" and not eng.by_priority:
        # Behind a waiting head, strict FCFS admits nobody new before the head, and the
        # head waits for memory or room that only a completion gives back: an arrival now
        # changes nothing but the queue's length. It joins at the next event.
        horizon = math.inf
    if eng.cfg.max_time_s is not None:
        horizon = min(horizon, eng.cfg.max_time_s)
    if horizon < math.inf:
        n = iterations_to_reach(horizon - eng.now, w0, w1, n)
    # (last, and no further than the stretch: the min commutes with the ones above)
    full = alloc.steps_until_full_within(n - 1)
    if full is not None:
        n = min(n, 1 + full)
    return n, w0, w1, n * w0 + w1 * n * (n - 1) / 2


def iterations_to_reach(delta: float, w0: float, w1: float, most: int) -> int:
    """Fewest iterations (>= 1) whose durations w0, w0+w1, ... add up to at least `delta`, or
    `most` if they do not reach it within `most`.

    `most` bounds the search: far horizons (an arrival or `max_time_s` 1e300 s away) give
    iteration counts where n - 1 == n in floats, and a step-by-step search there never ends.
    """
    if delta <= w0 or most <= 1:
        return 1
    if most * w0 + w1 * most * (most - 1) / 2 < delta:
        return most
    if w1 == 0:
        n = math.ceil(delta / w0)
    else:
        a = w0 - w1 / 2
        n = math.ceil((-a + math.sqrt(a * a + 2 * w1 * delta)) / w1)
    n = min(max(n, 1), most)
    while n > 1 and (n - 1) * w0 + w1 * (n - 1) * (n - 2) / 2 >= delta:
        n -= 1
    while n * w0 + w1 * n * (n - 1) / 2 < delta:
        n += 1
    return n
