"""The hybrid allocator's decode cohort as running sums in the decode clock K, so that an engine
event costs about the same however many requests decode (`kvfrag.sim.allocators.hybrid`).

Each decoder's figures are a closed form between its events (`kvfrag.sim.hybrid.forms`:
a + s x K + terms floor((x + K) / mod)); at an event its form is rebuilt. The terms are kept per
kind as paged.py keeps its block counts (`FloorSum`: counts per residue), with the decoders of
each residue, and the slopes as a count of decoders per slope, so that:
- the figures now, and their weighted sums over a stretch (`integrals`), cost O(residues)
  plus the decoders with an event inside the stretch, walked piece by piece;
- the look-ahead (`kvfrag.sim.hybrid.lookahead`: `steps_until_full`, `steps_until_shrink`)
  walks steps, not decoders, reading the counts at each step's residues.

A decoder in the clock it joined holds its prefill's blocks (vLLM frees them at its first
decode step): its parts differ from the form above at that clock only, kept as a correction.

Async scheduling (`set_lag(1)`): vLLM frees by the tokens processed, its last token in flight:
a decoder of L tokens has processed L - 1 - lag, and its first step frees by the tokens before
its final chunk (that chunk in flight), a second correction, at the clock after it joined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from heapq import heapify, heappop, heappush

from kvfrag.sim.floor_sum import FloorSum, times
from kvfrag.sim.hybrid import lookahead
from kvfrag.sim.hybrid.forms import NEVER, SLOT_BITS, SLOT_MASK, Figures, Form, Forms
from kvfrag.sim.hybrid.managers import Manager
from kvfrag.sim.model_view import ModelView
from mypy_extensions import mypyc_attr


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class Cohort(Forms):
    """The decoders' figures as running sums (see the module)."""

    def __init__(self, managers: Sequence[Manager], views: Sequence[ModelView | None],
                 page: int, max_len: int) -> None:
        super().__init__(managers, views, page, max_len)
        self.gauge = lookahead.Gauge(self, None)  # (every block id: the look-ahead's default)
        self.clear()

    def pool_gauge(self, weights: list[int]) -> lookahead.Gauge:
        """A gauge of one pool's blocks (per manager, the pool's blocks per held block of
        each group: 0 for other pools' managers), for `steps_until_full`."""
        return lookahead.Gauge(self, weights)

    def set_lag(self, lag: int) -> None:
        """Async scheduling (lag 1): decoders free by L - 1 - lag processed (see the module).
        Before any decoder joins."""
        assert not self.recs
        self.lag = lag
        self._slopes.clear()
        self.slopes.clear()
        self.slope_n.clear()
        self.slope_counted.clear()
        self._events_at()

    def clear(self) -> None:
        width = self.width
        self.fixed = Figures(width)  # over the requests outside the cohort (`add_fixed`)
        self._changes = 0  # every change of the sums: `figures` keeps its last answer
        self._memo = Figures(width)  # (`figures`' last answer, made in place by `totals`)
        self._memo_clock = -1  # (two ints, not a tuple: the check runs several times an event)
        self._memo_changes = -1
        self._blocks_memo = 0  # `blocks_now`'s last answer, at this clock and change
        self._blocks_clock = -1
        self._blocks_changes = -1
        self._terms = 0  # every change of the terms (`_add`): `steps_until_full` keeps its sum
        self.slope_n = [0] * len(self.slopes)  # per slope (`_build`), the decoders with it
        self.slope_counted = [0] * len(self.slopes)  # per slope, those `S` counts
        self.recs: dict[int, Form] = {}
        self.A = Figures(width)  # sum of a
        self.S = Figures(width)  # sum of s: `slope_sum`, kept while `_S_ok`
        self._S_ok = True
        self.sums = [FloorSum(mod) for mod in self.mods]
        # per term kind: residue of x -> the decoders with that residue (each decoder has at
        # most one term of a kind: the set's size is the count a step at that residue moves)
        self.members: list[dict[int, set[int]]] = [{} for _ in self.mods]
        # The heaps of the decoders' next clocks, lazily pruned: keys clock << SLOT_BITS | slot,
        # one int (a tuple per entry, made and compared element by element, cost more than
        # the rest of a push). A slot is a decoder's while it is in the cohort (`rid_at`; a rid
        # can be any int, a slot is dense and below 2**SLOT_BITS); an entry is live where its
        # slot's decoder has that clock now, as an entry of a rid gone and back would be.
        self.rid_at: list[int] = []  # slot -> its decoder's rid (-1: free)
        # slot -> its decoder's record (None: free): a heap entry's, read without a dict
        # lookup (and the rid made an int object again for it)
        self.form_at: list[Form | None] = []
        self.free_slots: list[int] = []
        self.events: list[int] = []  # `Form.event`
        self.bevents: list[int] = []  # `Form.bev`
        self.nf_heap: list[int] = []  # `Form.nf`
        self.last_heap: list[int] = []  # -(`Form.last`) << SLOT_BITS | slot: the latest first
        # decoders that joined at `fresh_clock` -> (processed, parts now less their form's)
        self.fresh: dict[int, tuple[int, list[int]]] = {}
        self.fresh_corr = [0] * width
        self.fresh_clock = -1
        # decoders that joined at clock - 1 -> (processed, ...): `fresh` of then, kept whole
        # (a dict made anew of the processed alone cost more than the rest of a step)
        self.prev_fresh: dict[int, tuple[int, list[int]]] = {}
        # async: decoders that joined at `fresh_clock` -> (processed at their first step, its
        # parts less their form's then); those that joined at `first_clock` - 1, at it now
        self.first_next: dict[int, tuple[int, list[int]]] = {}
        self.first_next_corr = [0] * width
        self.first_now: dict[int, tuple[int, list[int]]] = {}
        self.first_now_corr = [0] * width
        self.first_clock = -1
        # those at their first step at clock - 1 (`first_now` of then)
        self.prev_first: dict[int, tuple[int, list[int]]] = {}
        # every decoder that joined at `fresh_clock` (those in `fresh` and those that joined
        # with their form's tokens processed: a decoder that left since its step and joined
        # again has not stepped into this clock)
        self.arrived: set[int] = set()
        self.switched_clock = -1  # clock at which `switched` decoders reached their window
        self.switched: list[set[int]] = [set() for _ in self.mods]  # per sliding term kind
        # decoders still in the cohort whose step into `freed_clock` freed a chunked block
        self.freed_clock = -1
        self.chunk_freed: set[int] = set()
        self.empty: dict[int, tuple[int, list[int]]] = {}  # (read only: where none is kept)

    def _final_block(self, rid: int, rec: Form, clock: int) -> None:
        """A decoder enters its final length's block (an event `_next_event` calls light):
        its reserved slots, tb x (bs x ceil(L / bs) - L) before, are tb x (F - L) from now."""
        d = self._final_shift(rec)
        rec.f2 += d
        rec.f3 -= d
        self.A.f2 += d
        self.A.f3 -= d
        self._moved(0)  # (reserved and internal move, the blocks stay)
        nxt, rec.light = self._next_event(rec.c + rec.event, rec.final)
        rec.event = NEVER if nxt == NEVER else nxt - rec.c
        if rec.event != NEVER:
            heappush(self.events, rec.event << SLOT_BITS | rec.slot)

    def _moved(self, blocks: int) -> None:
        """A change to the sums that moves the blocks at `_blocks_clock` by `blocks`:
        `blocks_now`'s last answer, where valid, is kept so (most changes are decoders joining
        and leaving, and the free pool is asked after each)."""
        if self._blocks_changes == self._changes:
            self._blocks_memo += blocks
            self._blocks_changes += 1
        self._changes += 1

    def _add(self, rid: int, rec: Form, sign: int) -> None:
        if self._blocks_changes == self._changes:
            b = self._rec_blocks(rec, self._blocks_clock)
            self._moved(b if sign > 0 else -b)
        else:
            self._changes += 1
        self._terms += 1
        self.A.add(rec, sign)
        if rec.sid >= 0:
            self.slope_n[rec.sid] = self.slope_n[rec.sid] + sign  # (`+=`: a generic add)
            self._S_ok = False
        sums, mods, members = self.sums, self.mods, self.members
        for kind, x in rec.terms:
            sums[kind].add(x, sign)
            r = x % mods[kind]
            held = members[kind]
            group = held.get(r)
            if sign > 0:
                if group is None:
                    held[r] = {rid}
                else:
                    group.add(rid)
            else:
                assert group is not None
                group.discard(rid)
                if not group:
                    del held[r]

    def slope_sum(self) -> Figures:
        """The sum of the decoders' slopes: per slope, the change in its decoders' count
        since the last sum, times it (a decoder joining and another leaving with the same
        slope move nothing)."""
        if not self._S_ok:
            S, counted, now = self.S, self.slope_counted, self.slope_n
            for sid in range(len(now)):
                d = now[sid] - counted[sid]
                if d:
                    S.add_times(self.slopes[sid], d)
                    counted[sid] = now[sid]
            self._S_ok = True
        return self.S

    def _take_slot(self, rid: int) -> int:
        """A free slot for a decoder joining (`rid_at`)."""
        if self.free_slots:
            slot = self.free_slots.pop()
            self.rid_at[slot] = rid
        else:
            slot = len(self.rid_at)
            assert slot <= SLOT_MASK
            self.rid_at.append(rid)
            self.form_at.append(None)
        return slot

    def _at(self, key: int) -> Form | None:
        """The record of the decoder in a heap key's slot (None: the slot is free)."""
        return self.form_at[key & SLOT_MASK]

    def _enter(self, rid: int, rec: Form) -> None:
        """A decoder's record (its slot set: `join` takes one, a rebuild keeps it) counted."""
        self.recs[rid] = rec
        self._add(rid, rec, 1)
        slot = rec.slot
        self.form_at[slot] = rec
        if rec.event != NEVER:
            if len(self.events) > 2 * len(self.recs) + 64:  # mostly stale: keep the live ones
                self.events = [r.event << SLOT_BITS | r.slot for r in self.recs.values()
                               if r.event != NEVER]
                heapify(self.events)
            else:
                heappush(self.events, rec.event << SLOT_BITS | slot)
        if rec.bev != NEVER:
            if len(self.bevents) > 2 * len(self.recs) + 64:
                self.bevents = [r.bev << SLOT_BITS | r.slot for r in self.recs.values()
                                if r.bev != NEVER]
                heapify(self.bevents)
            else:
                heappush(self.bevents, rec.bev << SLOT_BITS | slot)
        if rec.nf != NEVER:
            heappush(self.nf_heap, rec.nf << SLOT_BITS | slot)
        if rec.last >= 0:
            heappush(self.last_heap, -rec.last << SLOT_BITS | slot)

    def _rotate(self, clock: int) -> None:
        """Forget the prefill corrections of an earlier clock (keeping the last clock's
        decoders, whose first step `steps_until_shrink` looks at)."""
        if self.fresh_clock != clock:
            # (the dicts and corrections are made anew only where they hold something: an
            # empty one's corrections are zeros, as decoders leaving take theirs out)
            self._changes += 1
            follows = self.fresh_clock == clock - 1
            if follows and self.fresh:
                self.prev_fresh = self.fresh  # (replaced below: not shared)
            elif self.prev_fresh:
                self.prev_fresh = {}
            if self.fresh:
                self.fresh = {}
                self.fresh_corr = [0] * self.width
            if self.lag:
                if self.first_clock == clock - 1 and self.first_now:
                    self.prev_first = self.first_now  # (replaced below: not shared)
                elif self.prev_first:
                    self.prev_first = {}
                if follows and self.first_next:
                    self.first_now = self.first_next
                    self.first_now_corr = self.first_next_corr
                    self.first_next = {}
                    self.first_next_corr = [0] * self.width
                else:
                    if self.first_now:
                        self.first_now = {}
                        self.first_now_corr = [0] * self.width
                    if self.first_next:
                        self.first_next = {}
                        self.first_next_corr = [0] * self.width
                self.first_clock = clock
            if self.arrived:
                self.arrived = set()
            self.fresh_clock = clock

    def join(self, rid: int, c: int, final: int, processed: int, clock: int,
             held: Figures, first: int = -1) -> None:
        """A decoder joins at `clock` holding what its prefill left (`processed` computed;
        `held`: its parts then, `parts_of(c + clock, processed, final)`, as the coordinator
        counted them outside the cohort). `first` (lag): processed at its first step."""
        self._rotate(clock)
        tokens = c + clock
        lag = self.lag
        formed = tokens - 1 - lag
        if not self.windowed:  # (no group frees while a request runs: processed moves nothing)
            processed, first = formed, tokens - lag
        # Its parts by its form: what it holds less the blocks that its form's processed
        # tokens skip beyond its own (`_shift`: no parts counted afresh)
        diff: list[int] = []
        if processed == formed:
            now = held
        else:
            diff = self._shift(processed, max(0, formed))
            # (within the first window both skip nothing: its parts are its form's)
            if any(d for d in diff):  # (a generator: compiled, a loop; not a call)
                now = held.copy()
                now.add_list([-d for d in diff])
            else:
                now = held
        rec = self._build(rid, c, final, clock, now)[0]
        rec.slot = self._take_slot(rid)
        self._enter(rid, rec)
        self.arrived.add(rid)
        if lag and first != tokens - lag and tokens < final:
            diff1 = self._shift(first, tokens - lag)  # (its first step's parts less its form's)
            if any(d for d in diff1):
                self.first_next[rid] = (first, diff1)
                self._moved(0)  # (counted from the next clock on)
                corr = self.first_next_corr
                for i in range(self.width):
                    corr[i] = corr[i] + diff1[i]
        if processed != formed:
            self.fresh[rid] = (processed, diff)
            self._moved(diff[0] if self._blocks_clock == clock else 0)
            corr = self.fresh_corr
            for i in range(self.width):
                corr[i] = corr[i] + diff[i]

    def leave(self, rid: int, clock: int) -> None:
        self._rotate(clock)
        rec = self.recs[rid]
        del self.recs[rid]  # (not `pop`: compiled, a generic method call)
        self._add(rid, rec, -1)
        self.rid_at[rec.slot] = -1
        self.form_at[rec.slot] = None
        self.free_slots.append(rec.slot)
        if self.fresh:
            self._drop(self.fresh, self.fresh_corr, rid, self.fresh_clock)
        # (`in`, then `del`: compiled, `dict.pop` is a generic method call, several times the
        # cost, and most decoders leaving are in neither)
        if self.prev_fresh and rid in self.prev_fresh:
            del self.prev_fresh[rid]
        if self.prev_first and rid in self.prev_first:
            del self.prev_first[rid]
        # (what its step into this clock freed no longer counts as just freed: it left)
        if self.arrived:
            self.arrived.discard(rid)
        if self.switched_clock == clock:
            for group in self.switched:
                group.discard(rid)
        if self.freed_clock == clock:
            self.chunk_freed.discard(rid)
        if self.first_next:
            self._drop(self.first_next, self.first_next_corr, rid, -1)
        if self.first_now:
            self._drop(self.first_now, self.first_now_corr, rid, self.first_clock)

    def _drop(self, pending: dict[int, tuple[int, list[int]]], corr: list[int],
              rid: int, at: int) -> None:
        """Take a decoder's correction out of a pending one's, if it has one (`at`: the clock
        whose figures that one corrects; -1: a later clock's)."""
        if rid in pending:  # (not `pop`: compiled, a generic method call)
            diff = pending[rid][1]
            del pending[rid]
            self._moved(-diff[0] if at == self._blocks_clock else 0)
            for i in range(self.width):
                corr[i] = corr[i] - diff[i]

    def stepped(self, clock: int) -> None:
        """The clock is `clock`: rebuild the decoders whose event it has reached."""
        self._rotate(clock)
        rid_at, form_at = self.rid_at, self.form_at
        end = clock << SLOT_BITS | SLOT_MASK
        while self.events and self.events[0] <= end:  # (`_enter` may rebuild the heap)
            entry = heappop(self.events)
            rec = form_at[entry & SLOT_MASK]
            key = entry >> SLOT_BITS
            if rec is None or rec.event != key:
                continue
            rid = rid_at[entry & SLOT_MASK]
            if rec.light:
                self._final_block(rid, rec, clock)
                continue
            self._add(rid, rec, -1)
            new = self._build(rid, rec.c, rec.final, clock)[0]
            new.slot = rec.slot
            self._enter(rid, new)
            tokens = rec.c + clock
            if key == clock:
                for k, w, _ in self.sliding:
                    if tokens - self.lag == w:  # (its skipped blocks' term starts at 0 now)
                        if self.switched_clock != clock:
                            self.switched_clock = clock
                            self.switched = [set() for _ in self.mods]
                        self.switched[k].add(rid)
                p = tokens - 1 - self.lag
                if self._frees_between(self.chunked_ix, p, p - 1):
                    if self.freed_clock != clock:
                        self.freed_clock = clock
                        self.chunk_freed = set()
                    self.chunk_freed.add(rid)

    def add_fixed(self, parts: Figures, sign: int) -> None:
        """A request outside the cohort holds `parts` (sign 1) or no longer (-1)."""
        self.fixed.add(parts, sign)
        keep = self._memo_changes == self._changes  # (the figures just before: kept valid)
        if keep:
            self._memo.add(parts, sign)
        if self._blocks_changes == self._changes:
            self._blocks_memo += times(sign, parts.f0)
            self._blocks_changes += 1
        self._changes += 1
        if keep:
            self._memo_changes = self._changes

    def figures(self, clock: int) -> Figures:
        """Every live request's figures at `clock`: the cohort's and the others' (one
        `Figures`, made anew in place at each change: read it before the next)."""
        if self._memo_clock == clock and self._memo_changes == self._changes:
            return self._memo
        out = self.totals(clock, self.fixed, self._memo)
        self._memo_clock = clock
        self._memo_changes = self._changes
        return out

    def blocks_now(self, clock: int) -> int:
        """Block ids every live request holds at `clock` (asked several times an event, and
        between changes that void the figures: counted alone, not with them)."""
        if self._memo_clock == clock and self._memo_changes == self._changes:
            return self._memo.f0
        if self._blocks_clock != clock or self._blocks_changes != self._changes:
            self._blocks_memo = self.blocks(clock) + self.fixed.f0
            self._blocks_clock = clock
            self._blocks_changes = self._changes
        return self._blocks_memo

    def totals(self, clock: int, plus: Figures | None = None,
               out: Figures | None = None) -> Figures:
        """The cohort's figures at `clock` (plus `plus`, where given), in `out` where given.
        Native figures (`Figures`), not a list: compiled, every store into a list makes an
        int object, and the terms, the corrections and `plus` add figure after figure."""
        if out is None:
            out = Figures(self.width)
        out.set_to(self.A)
        out.add_times(self.slope_sum(), clock)
        vecf = self.vecf
        for k, fs in enumerate(self.sums):
            if fs.nonzero or fs.q:
                val = fs.value(clock)
                if val:
                    out.add_times(vecf[k], val)
        if plus is not None:
            out.add(plus, 1)
        if self.fresh_clock == clock and self.fresh:
            out.add_list(self.fresh_corr)
        if self.first_clock == clock and self.first_now:
            out.add_list(self.first_now_corr)
        return out

    def blocks(self, clock: int) -> int:
        total = self.A.f0 + times(self.slope_sum().f0, clock)
        for k, fs in enumerate(self.sums):
            b = self.blocks_vec[k]
            if b and (fs.nonzero or fs.q):
                total += times(b, fs.value(clock))
        if self.fresh_clock == clock and self.fresh:
            total += self.fresh_corr[0]
        if self.first_clock == clock and self.first_now:
            total += self.first_now_corr[0]
        return total

    def _rec_blocks(self, rec: Form, clock: int) -> int:
        """Blocks by the record's form at `clock` (what the running sums count for it)."""
        total = rec.f0 + times(rec.s.f0, clock)
        for kind, x in rec.terms:
            total += times(self.blocks_vec[kind], (x + clock) // self.mods[kind])
        return total

    def first_due(self) -> int:
        """The first clock at which a decoder's blocks leave its form (`Form.bev`; NEVER:
        none)."""
        heap = self.bevents
        while heap:  # (entries of decoders gone or rebuilt since: dropped from the top)
            key = heap[0] >> SLOT_BITS
            found = self._at(heap[0])
            if found is not None and found.bev == key:
                return key
            heappop(heap)
        return NEVER

    def _ending_by(self, clock: int, blocks: bool = False) -> list[int]:
        """Decoders with an event at or before `clock` (their forms change by then); with
        `blocks`, only those whose blocks leave their form by then (`Form.bev`)."""
        heap, rid_at = (self.bevents if blocks else self.events), self.rid_at
        while heap:  # (entries of decoders gone or rebuilt since: dropped from the top)
            key = heap[0] >> SLOT_BITS
            found = self._at(heap[0])
            if found is not None and (found.bev if blocks else found.event) == key:
                break
            heappop(heap)
        end = clock << SLOT_BITS | SLOT_MASK
        if not heap or heap[0] > end:
            return []
        out: dict[int, None] = {}
        todo = [0]
        while todo:
            i = todo.pop()
            entry = heap[i]
            rec = self._at(entry)
            if rec is not None and (rec.bev if blocks else rec.event) == entry >> SLOT_BITS:
                out[rid_at[entry & SLOT_MASK]] = None
            j = 2 * i + 1  # (its two children, written out: a loop over a tuple is generic)
            if j < len(heap) and heap[j] <= end:
                todo.append(j)
            if j + 1 < len(heap) and heap[j + 1] <= end:
                todo.append(j + 1)
        return list(out)

    def integrals(self, clock: int, n: int, w0: float, w1: float) -> list[float]:
        """sum over j = 1..n of (w0 + w1 (j - 1)) x the first six figures at clock + j."""
        weight = n * w0 + w1 * n * (n - 1) / 2
        jw = w0 * n * (n + 1) / 2 + w1 * (n - 1) * n * (n + 1) / 3  # sum_j j * w_j
        kw = clock * weight + jw  # sum_j (clock + j) * w_j
        S = self.slope_sum()
        sums = [self.A.get(i) * weight + S.get(i) * kw for i in range(6)]
        for k, fs in enumerate(self.sums):
            if fs.nonzero or fs.q:
                val = fs.integrate(clock, n, w0, w1, weight)
                v = self.vecs[k]
                for i in range(6):
                    sums[i] = sums[i] + v[i] * val
        for rid in self._ending_by(clock + n):
            self._walk_events(rid, clock, n, w0, w1, sums)
        if n and self.fresh_clock == clock and self.first_next:  # (their first step: j = 1)
            corr = self.first_next_corr
            for i in range(6):
                sums[i] = sums[i] + w0 * corr[i]
        return sums

    def _walk_events(self, rid: int, clock: int, n: int, w0: float, w1: float,
                     sums: list[float]) -> None:
        """Add to `sums` what a decoder's events within the stretch change: from each event
        on, its new form less the one the running sums count."""
        old = self.recs[rid]
        cur = old
        end = clock + n
        while cur.event <= end:
            start = cur.event
            new = (self._after_light(cur) if cur.light
                   else self._build(rid, old.c, old.final, start)[0])
            stop = min(new.event - 1, end)
            _piece(self, new, 1, clock, start, stop, w0, w1, sums)
            _piece(self, old, -1, clock, start, stop, w0, w1, sums)
            cur = new

    # ------------------------------------------------------------------ look-ahead
    def steps_until_full(self, clock: int, done: int, free: int,
                         order: Callable[[int], int], walk: int = NEVER,
                         gauge: lookahead.Gauge | None = None) -> int:
        """(`kvfrag.sim.hybrid.lookahead.steps_until_full`; `gauge`: the pool whose `free`
        blocks these are, default every block id)"""
        return lookahead.steps_until_full(self, clock, done, free, order, walk,
                                          self.gauge if gauge is None else gauge)

    def steps_until_shrink(self, clock: int, done: int | None) -> int | None:
        """(`kvfrag.sim.hybrid.lookahead.steps_until_shrink`)"""
        return lookahead.steps_until_shrink(self, clock, done)


def _piece(co: Cohort, rec: Form, sign: int, clock: int, start: int, stop: int,
           w0: float, w1: float, sums: list[float]) -> None:
    """Add sign x sum over clocks k in [start, stop] of w_(k - clock) x the record's form at
    k (w_j = w0 + w1 (j - 1)), to the first six figures."""
    if stop < start:
        return
    m = stop - start + 1
    a0 = w0 + w1 * (start - clock - 1)  # the weight at `start`
    weight = m * a0 + w1 * m * (m - 1) / 2
    kw = start * weight + (a0 * m * (m - 1) / 2 + w1 * (m - 1) * m * (2 * m - 1) / 6)
    for i in range(6):
        sums[i] = sums[i] + sign * (rec.get(i) * weight + rec.s.get(i) * kw)
    for kind, x in rec.terms:
        fs = FloorSum(co.mods[kind])
        fs.add(x, 1)
        val = fs.integrate(start - 1, m, a0, w1, weight)
        v = co.vecs[kind]
        for i in range(6):
            sums[i] = sums[i] + sign * v[i] * val
