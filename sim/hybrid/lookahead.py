"""The hybrid decode cohort's look-ahead (`kvfrag.sim.hybrid.cohort`): how many decode steps
it can take before a decoder finds too few free blocks, and before one frees a block.

- `steps_until_full` walks steps, not decoders: a step's blocks taken and freed are the counts
  at its residues. vLLM allocates the running requests one after the other (each frees its
  skipped blocks, then takes its new ones), so a step where the blocks taken could exceed the
  free pool before the blocks freed come back is settled by walking that step's decoders in
  running order (admission order): only those steps, only those decoders;
- `steps_until_shrink` is the first step at which some residue of skipped blocks moves, or an
  in-window or chunked decoder reaches its next free (a heap), exact up to the first decoder's
  end (what the engine and the checks use); beyond it, a lower bound, or None when no decoder
  frees again before its end (a heap of each decoder's last free).

What `steps_until_full` counts is a `Gauge`: every block id (figure 0, the hybrid allocator's
one shared pool), or one pool of a partitioned model (`static-partition`: a pool per layer
type, its blocks a weighted sum of its managers' held-block figures), so that one cohort,
each decoder's form built once, answers for every pool.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop
from typing import TYPE_CHECKING

from kvfrag.sim.floor_sum import times
from kvfrag.sim.hybrid.forms import NEVER, SLOT_BITS, Figures, Form, Forms
from mypy_extensions import mypyc_attr

if TYPE_CHECKING:  # (cohort.py imports this module)
    from kvfrag.sim.hybrid.cohort import Cohort


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class Gauge:
    """The blocks a pool holds, as the look-ahead reads them from the cohort's figures:
    `weights` None, figure 0 (every block id: one shared pool); else the sum over managers of
    weight x held blocks per group (figure 6 + m), weight 0 for the managers of other pools.
    Keeps the look-ahead's sum of the blocks the ceil terms take (`steps_until_full`)."""

    def __init__(self, forms: Forms, weights: list[int] | None) -> None:
        self.whole = weights is None
        self.w = list(forms.m_groups) if weights is None else list(weights)
        self.ix = [m for m in range(len(self.w)) if self.w[m]]  # the managers counted
        # per term kind, its coefficient on these blocks (the whole: `blocks_vec`)
        self.bv = [sum(self.w[m] * v[6 + m] for m in self.ix) for v in forms.vecs]
        self.taken = 0  # (the ceil terms' blocks over a stretch, as of the three below)
        self.taken_clock = self.taken_done = self.taken_terms = -1

    def of(self, f: Figures) -> int:
        """These blocks in a vector of figures."""
        if self.whole:
            return f.f0
        total = 0
        for m in self.ix:
            total += self.w[m] * f.get(6 + m)
        return total

    def of_list(self, v: list[int]) -> int:
        """These blocks in a vector kept as a list (a correction)."""
        if self.whole:
            return v[0]
        total = 0
        for m in self.ix:
            total += self.w[m] * v[6 + m]
        return total

    def blocks_of(self, co: Forms, tokens: int, processed: int) -> int:
        """These blocks of a request with `tokens` slots, freed by `processed` computed."""
        if self.whole:
            return co.blocks_of(tokens, processed)
        total = 0
        for m in self.ix:
            total += self.w[m] * (-(-tokens // co.m_bs[m]) - co._skipped(m, processed))
        return total

    def rec_blocks(self, co: Cohort, rec: Form, clock: int) -> int:
        """These blocks by a decoder's form at `clock` (what the running sums count)."""
        if self.whole:
            return co._rec_blocks(rec, clock)
        total = self.of(rec) + times(self.of(rec.s), clock)
        for kind, x in rec.terms:
            total += times(self.bv[kind], (x + clock) // co.mods[kind])
        return total


def _hit(co: Cohort, kind: int, clock: int) -> int:
    """Decoders whose term of this kind moves at the step into `clock`."""
    group = co.members[kind].get(-clock % co.mods[kind])
    return 0 if group is None else len(group)

def steps_until_full(co: Cohort, clock: int, done: int, free: int,
                     order: Callable[[int], int], walk: int, g: Gauge) -> int:
    """Steps (at most `done`) the cohort can take before some decoder, in running order
    (`order`: its rank), finds too few of the `free` blocks (free now) of the pool `g`
    counts. `walk`: the most steps walked where the closed-form bound does not settle it
    (the answer is then `walk` where the steps walked all fit: a lower bound)."""
    n_ceil, sums, bv = co.n_ceil, co.sums, g.bv
    lag = co.lag
    # blocks the ceil terms take over the whole stretch: frees only lower it (async: and
    # what the first steps' corrections may add, `first_*`)
    taken = 0
    first_next = co.first_next if lag and co.fresh_clock == clock else co.empty
    first_now = co.first_now if lag and co.first_clock == clock else co.empty
    if lag:
        if co.fresh_clock == clock:
            taken += max(0, -g.of_list(co.fresh_corr)) + max(0, g.of_list(co.first_next_corr))
        if first_now:
            taken += max(0, -g.of_list(co.first_now_corr))
    # (the ceil terms' part is asked again as the free pool changes with the cohort as it
    # is: kept while the terms, clock and stretch stay)
    if g.taken_clock != clock or g.taken_done != done or g.taken_terms != co._terms:
        ceil = 0
        for k in range(n_ceil):
            if bv[k]:
                ceil += times(bv[k], sums[k].value_far(clock + done) - sums[k].value(clock))
        g.taken = ceil
        g.taken_clock, g.taken_done, g.taken_terms = clock, done, co._terms
    taken += g.taken
    if taken <= free:
        return done
    # (`blocks`, as the caller just asked; a pool's from the figures)
    now = (co.blocks_now(clock) - co.fixed.f0 if g.whole
           else g.of(co.figures(clock)) - g.of(co.fixed))
    limit = now + free
    # Decoders whose blocks leave their forms by the step walked (their events up to
    # `horizon`, looked up a stretch at a time, and only from the first such event on: the
    # walk often stops at its first steps)
    slope = g.of(co.slope_sum())
    horizon = min(done, 32)
    # (the heap's top bounds `first_due` from below, stale entries included: the first due
    # clock is looked up only once a step reaches that bound)
    due = co.bevents[0] >> SLOT_BITS if co.bevents else NEVER
    exact = False
    special: list[int] = []
    fetched = False
    recs = co.recs
    cur = now
    for t in range(1, done + 1):
        if t > walk:
            return walk
        k1 = clock + t
        if t > horizon:
            horizon = done
            fetched = False
        if not fetched and k1 >= due and not exact:
            due = co.first_due()
            exact = True
        if not fetched and k1 >= due:
            special = co._ending_by(clock + horizon, True)
            fetched = True
        up = 0
        for k in range(n_ceil):
            if bv[k]:
                up += bv[k] * _hit(co, k, k1)
        if t % 32 == 0:  # far from full: what the ceil terms take from here on fits
            rest = 0
            for k in range(n_ceil):
                if bv[k]:
                    rest += times(bv[k], sums[k].value_far(clock + done) - sums[k].value(k1 - 1))
            if cur + rest <= limit:
                return done
        delta = up + slope
        for k in range(n_ceil, len(co.mods)):
            delta += times(bv[k], _hit(co, k, k1))  # (sliding kinds' coefficient < 0)
        for rid in special:  # (their forms change within the stretch)
            rec = recs[rid]
            if rec.bev <= k1:  # (light events keep the blocks' form)
                tokens = rec.c + k1
                p = max(0, tokens - 1 - lag)
                delta += (g.blocks_of(co, tokens, p) - g.rec_blocks(co, rec, k1)
                          - g.blocks_of(co, tokens - 1, max(0, p - 1))
                          + g.rec_blocks(co, rec, k1 - 1))
        if t == 1 and co.fresh_clock == clock and co.fresh:
            delta -= g.of_list(co.fresh_corr)
        if t == 1 and first_now:
            delta -= g.of_list(co.first_now_corr)
        if first_next and t <= 2:
            delta += g.of_list(co.first_next_corr) * (1 if t == 1 else -1)
        if cur + up <= limit:
            cur += delta
            continue
        if delta == up:  # nothing freed at this step: its order cannot matter
            return t - 1
        # Blocks taken before others are freed could overrun: vLLM's order decides.
        cands: set[int] = set(special)
        for k in range(len(co.mods)):
            group = co.members[k].get(-k1 % co.mods[k])
            if group:
                cands.update(group)
        if t == 1 and co.fresh_clock == clock:
            cands.update(co.fresh)
            cands.update(first_now)
        if t <= 2:
            cands.update(first_next)
        walked = cur
        for rid in sorted(cands, key=order):
            rec = recs[rid]
            tokens = rec.c + k1
            change = (_exact(co, g, rid, tokens, k1)
                      - _exact(co, g, rid, tokens - 1, k1 - 1))
            if change:
                walked += change
                if walked > limit:
                    return t - 1
        cur += delta
        assert walked == cur, (walked, cur)
    return done

def _exact(co: Cohort, g: Gauge, rid: int, tokens: int, clock: int) -> int:
    """A decoder's blocks at `clock` (those `g` counts), from its managers (its prefill's at
    its join)."""
    if clock == co.fresh_clock:
        got = co.fresh.get(rid)
        if got is not None:
            return g.blocks_of(co, tokens, got[0])
    if co.lag:
        got = None
        if clock == co.fresh_clock + 1:
            got = co.first_next.get(rid)
        elif clock == co.first_clock:
            got = co.first_now.get(rid)
        if got is not None:
            return g.blocks_of(co, tokens, got[0])
    return g.blocks_of(co, tokens, max(0, tokens - 1 - co.lag))

def steps_until_shrink(co: Cohort, clock: int, done: int | None) -> int | None:
    """See the module: exact up to `done`, a lower bound past it, None if no decoder
    frees again before its end."""
    if not co.windowed or not co.recs:
        return None
    wix = co.windowed_ix
    # The step just taken freed a block (the engine asks whether memory came back).
    if co.freed_clock == clock and co.chunk_freed:
        return 1
    # (`co.empty` where none: asked at every event, a new empty dict each time showed)
    fresh = co.fresh if co.fresh_clock == clock else co.empty
    lag = co.lag
    # async: the decoders at their first step and those that joined now (`first_*`)
    first_now = co.first_now if lag and co.first_clock == clock else co.empty
    first_next = co.first_next if lag and co.fresh_clock == clock else co.empty
    # (every decoder that joined now: one that left since its step and joined again has
    # not stepped into this clock; made where a step's frees are counted: most answers
    # need it not)
    unformed: set[int] = set()
    made = False
    second = NEVER
    for k, _, _ in co.sliding:
        hit = _hit(co, k, clock)
        if hit and co.switched_clock == clock:
            hit -= len(co.switched[k])
        if hit and not made:
            made = True
            if co.fresh_clock == clock:
                unformed.update(co.arrived)
            if lag:
                unformed.update(first_now)
                unformed.update(first_next)
        if hit:  # (less the decoders that joined now: their step is still to come)
            mod = co.mods[k]
            for rid in unformed:
                hit -= sum(1 for kind, x in co.recs[rid].terms
                           if kind == k and (x + clock) % mod == 0)
        if hit > 0:
            return 1
    if co.prev_fresh:
        for rid, (processed, _) in co.prev_fresh.items():
            rec = co.recs[rid]
            tokens = rec.c + clock
            got = first_now.get(rid)
            p = got[0] if got is not None else tokens - 1 - lag
            if co._frees_between(wix, p, processed):
                return 1
    if lag and co.prev_first:
        for rid, (p, _) in co.prev_first.items():  # (their second step, just taken)
            tokens = co.recs[rid].c + clock
            if co._frees_between(wix, tokens - 1 - lag, p):
                return 1
    if first_now:
        for rid, (p, _) in first_now.items():  # (their step to come frees by the form)
            tokens = co.recs[rid].c + clock
            was = co.prev_fresh.get(rid)
            before = was[0] if was is not None else tokens - 2 - lag
            if co._frees_between(wix, p, before):
                return 1
            if tokens < co.recs[rid].final and co._frees_between(wix, tokens - lag, p):
                return 1
    if fresh or first_next:
        both = list(fresh)  # (those in either, once each)
        both.extend([rid for rid in first_next if rid not in fresh])
        for rid in both:
            rec = co.recs[rid]
            tokens = rec.c + clock
            got = fresh.get(rid)
            processed = got[0] if got is not None else tokens - 1 - lag
            ahead = first_next.get(rid)
            p = ahead[0] if ahead is not None else tokens - lag
            if tokens < rec.final and co._frees_between(wix, p, processed):
                return 1
            if (ahead is not None and tokens + 1 < rec.final
                    and co._frees_between(wix, tokens + 1 - lag, p)):
                second = 2  # (its second step frees by the form: no term counts it)
    best = second
    for k, _, _ in co.sliding:  # the first step that moves a residue held
        mod, members = co.mods[k], co.members[k]
        if members:
            for t in range(1, min(mod, best - 1) + 1):
                if (-(clock + t)) % mod in members:
                    best = t
                    break
    heap = co.nf_heap
    while heap:
        key = heap[0] >> SLOT_BITS
        found = co._at(heap[0])
        if found is None or found.nf != key or key <= clock:
            heappop(heap)
            continue
        best = min(best, key - clock)
        break
    if done is not None and best <= done:
        return best
    heap = co.last_heap
    while heap:
        key = heap[0] >> SLOT_BITS  # (-last: an arithmetic shift keeps the sign)
        found = co._at(heap[0])
        if found is None or found.last != -key or -key <= clock:
            heappop(heap)
            continue
        return best if best != NEVER else (done or 0) + 1
    return None
