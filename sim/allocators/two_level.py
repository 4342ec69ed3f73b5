"""A Jenga-style two-level allocator for models with layer types (SOSP'25, arXiv 2503.18292;
vLLM RFC vllm-project/vllm#11382): `two-level`.

vLLM's hybrid manager (the `hybrid` allocator) makes every KV-cache group the same size,
padding with empty layers, and gives every group one page size, growing attention blocks to
it (Qwen3-Next: 544 tokens, a Mamba state's page). Here instead:

- **one group per layer type, unpadded**: full attention, MLA, each sliding window W, each
  chunk C and the Mamba state are a type each, holding all their layers. A type's *small page*
  is block_size x its layers' bytes per token (Mamba: its layers' state per request, as is);
- **two levels** (`kvfrag.sim.allocators.two_level_pool`): the budget is cut into *large
  pages* of the LCM of the small pages; a large page taken by a type is split into its small
  pages, and goes back to the shared pool when all of them are free. Where the LCM is more than
  `MAX_LCM_RATIO` times the largest small page, or the budget holds fewer than
  `MIN_LARGE_PAGES` of it (`two_level_plan`), the large page is that largest small page and
  each type's small page is padded up to large // floor(large / small) (counted as padding,
  and what no slot fills of a large page as stranded: see below);
- **request-aware placement**: a request's next small page of a type goes into the large page
  of its last one of that type if it has room, else into a partly used large page of that
  type, else a fresh one, so that large pages empty as requests finish.

Freeing and admission are vLLM's, as the `hybrid` allocator has them (this class is its
coordinator and managers, `kvfrag.sim.hybrid.managers`, over another plan and pool): sliding
blocks freed as they leave the window, chunked ones per chunk, Mamba state for the request's
life (mode "none"), vLLM's admission gate with the sliding caps. Except, on purpose, under
async scheduling (tests pin both): vLLM frees by the tokens *processed*, so a block that the
step in flight reads is held one more step, and its sliding caps allow `concurrent_batches`
chunks in flight; two-level frees by the tokens *computed* before the allocation, as without
async scheduling (a step that reads a freed block is ahead of the step that takes it, and the
GPU runs them in that order), and caps at one chunk in flight. On Gemma-3-27B at 32K this
is the difference between 85 % and 99 % of the floor's capacity (`bench/layouts.py`). Prefix
caching: `two_level_own_caching` in this layout (vLLM's hit rules on the two-level cache pool,
a page size per type), `two_level_caching` with `vllm_groups`; `make_allocator` builds them.

`vllm_groups: true` plans as vLLM does (its groups with padding layers and one page size):
the LCM is the page, a large page is one block id, and the records are the `hybrid`
allocator's, exactly (tests/sim/test_two_level_vllm.py): what makes any gain of the default
layout come from the layout alone.

Accounting, exact to the byte. The cohort (`sim.hybrid.cohort`) counts every type's small pages
in a unit of gcd(small pages) bytes (a type of k units is k "groups" of a manager), so that
token_states (what each layer type needs: the hybrid allocator's definition), reserved and
internal (out-of-window tokens, the fallback's padding, slots past the final length) are its
closed forms. The new waste is *stranded* memory: free small pages inside large pages held by
a type, which only more pages of that type can use; the next request, whose pages of every
type must fit, cannot count on them, so they are **external**, not usable_free. So:
usable_free = free large pages x large page; external = the rest of the budget (stranded
slots, the remainder of budget // large page, vLLM's null block with `vllm_groups`).

Decode steps: placement depends on the order of takes and frees, so the decoders' small pages
are placed eagerly, at the steps where a decoder's counts may change (block boundaries, window
and chunk edges: events, not tokens), in vLLM's order (step by step, decoders in admission
order, each freeing then taking); a decoder's next event waits in a bucket of its clock.
`steps_until_full_within(limit)` answers at once where a bound on the decoders' most pages
over the stretch fits (`two_level_bounds`: the events' count over a few steps, or the
cohort's sums), or where the next step alone is asked and gives no page back (its takes
counted), else walks those events on the pool, no further than `limit`, and undoes them (the
pool's journal); the integrals (of the free large pages) walk the stretch likewise. When the
decoders then step as far as a look walked, nothing having changed since, its journals are
applied again (`_redo`: the pool's and the tables' changes, no placement chosen twice). Cost:
in proportion to the decoders' block-boundary events, never to tokens; near fullness, to the
events of the stretches walked.
"""

from __future__ import annotations

import math
from typing import Final

from kvfrag.sim.allocators.base import (
    Allocator,
    Grant,
    Live,
    Reason,
    Refusal,
    Request,
    positive_int,
)
from kvfrag.sim.allocators.hybrid import HybridAllocator
from kvfrag.sim.allocators.two_level_bounds import (
    few_fit,
    most_extra,
    next_step_fits,
    next_step_need,
)
from kvfrag.sim.allocators.two_level_plan import (
    FULL,
    SLOT_BITS,
    SLOT_MASK,
    Decoder,
    large_page,
    layer_types,
    manager_code,
    next_step,
    skipped_blocks,
    weights,
)
from kvfrag.sim.allocators.two_level_pool import TwoLevelPool
from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.hybrid.cohort import Cohort
from kvfrag.sim.hybrid.managers import (
    ChunkedLocalManager,
    MambaManager,
    Manager,
    SlidingWindowManager,
)
from kvfrag.sim.layers import LayerStack, MambaState
from kvfrag.sim.model_view import ModelView
from mypy_extensions import i64, mypyc_attr

#: The most admissions the decoders' event order counts (`_walk`: admission ranks).
RANK_MASK: Final = (1 << 32) - 1


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class TwoLevelAllocator(HybridAllocator):
    """Large pages shared by the layer types, split into small pages per type (see the
    module)."""

    kind = "two-level"

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        block_size: object = 16,
        stack: object = None,
        max_num_batched_tokens: object = 8192,
        concurrent_batches: object = 2,
        prefix_caching: object = False,
        vllm_groups: object = False,
        geometry: KVGeometry | None = None,
    ) -> None:
        if not isinstance(vllm_groups, bool):
            raise ValueError(f"vllm_groups must be true or false, not {vllm_groups!r}")
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be true or false, not {prefix_caching!r}")
        if prefix_caching:
            raise ValueError("prefix caching is modelled by TwoLevelOwnCaching and, with "
                             "vllm_groups, TwoLevelVllmCaching (make_allocator builds them)")
        super().__init__(capacity, bytes_per_token, max_model_len, block_size, True, stack,
                         max_num_batched_tokens, concurrent_batches, False, "none", 0,
                         geometry)
        self.vllm_groups = vllm_groups
        self.fallback = False
        self.types: list[tuple[str, int, list[int]]] = []
        if vllm_groups:  # vLLM's plan: one page, every group's block one large page
            self.large = self.page
            self.small_pages = [self.page]
            self._ptype = [0] * len(self.managers)
            self._lists = [m.groups for m in self.managers]
            self.pool = TwoLevelPool(self.plan.num_blocks, [1], True)
        else:
            # (one chunk in flight, whatever concurrent_batches: see `set_async`)
            self._plan_types(positive_int("max_num_batched_tokens", max_num_batched_tokens))
        self.num_large = self.pool.usable
        # Each manager's kind (FULL...MAMBA), block size and window as plain ints: the walk's
        # hot path (`_place`, `_walk`) reads no attribute and calls no method of the
        # managers (dataclasses the compiler leaves interpreted)
        self._mkind = [manager_code(m) for m in self.managers]
        self._mbs = [m.block_size for m in self.managers]
        self._mwin = [m.window for m in self.managers]
        self._mcap = [-1 if m.cap is None else m.cap for m in self.managers]  # (-1: none)
        self._min_bs = min([b for b in self._mbs if b < self.max_model_len], default=1 << 60)
        # per pool type, the groups of its managers that take blocks as tokens come (`few_fit`)
        self._tw = [0] * len(self.pool.per)
        for mi, m in enumerate(self.managers):
            if m.block_size < self.max_model_len:
                self._tw[self._ptype[mi]] += self._lists[mi]
        # The decoders' next events: the clocks with one in descending order, the next last
        # (an insertion per clock, not per event: a step's events mostly share it; a short
        # list, the clocks of the next block boundaries and window edges, where a heap's pop
        # is a generic call), and beside each its bucket: the keys (`Decoder.key`) of the
        # decoders due then, sorted when its clock comes (admission order). Lists, not dicts
        # by clock and rank: a lookup by an int key boxes it. An entry is valid while the
        # decoder in its slot has its key and says that clock (`Decoder.at`)
        self._clocks: list[int] = []
        self._buckets: list[list[int]] = []
        self._decoders: dict[int, Decoder] = {}  # rank -> the decoder's record
        self._dead = Decoder(-1, 0, 0, -1, [], [])  # (a free slot's)
        self._slots: list[Decoder] = []  # slot -> the decoder in it (`_dead`: none)
        self._free_slots: list[int] = []
        # the tables' journal (trials): (op, the list changed, index, arg, ids), the list
        # itself, not the request's id: undone or redone with no lookup (see `_undo`)
        self._tj: list[tuple[int, list[int], int, int, list[int]]] = []
        self._taken: list[int] = []  # small pages the last placement took (`_try_place`)
        self._collect = False  # whether `_place` keeps them (not in the walks)
        # decoders in their first steps (rid -> clock it joined), whose processed tokens do
        # not follow their length yet (`two_level_bounds.most_extra`)
        self._fresh: dict[int, int] = {}
        # the last look-ahead: (clock, version, horizon, steps that fit, [(clock, free
        # large pages after its events)])
        self._walk_memo: tuple[int, int, int, int, list[tuple[int, int]]] | None = None
        # steps_until_full's exact answer: (clock, version, steps)
        self._full_exact: tuple[int, int, int] | None = None
        # the last look-ahead's walk, to replay if the decoders then step as far (`_redo`):
        # (clock, version, horizon, the pool's journal, the tables' journal, the events after)
        # (and the decoders whose next event the walk moved, with that clock)
        self._replay: tuple[int, int, int, list[int],
                            list[tuple[int, list[int], int, int, list[int]]],
                            list[list[int]], list[int],
                            list[tuple[Decoder, int]]] | None = None
        self._atj: list[tuple[Decoder, int]] = []  # a look's walk: (decoder, its clock before)

    def set_async(self) -> None:
        """Async scheduling. With `vllm_groups`, vLLM's freeing by the tokens processed (the
        hybrid allocator's); otherwise by the tokens computed, as without async scheduling:
        a block a step in flight still reads is taken only by a later step, which the GPU runs
        after it (one stream), so holding it a step longer, as vLLM does, buys nothing."""
        if self.vllm_groups:
            super().set_async()
        else:
            Allocator.set_async(self)

    def _plan_types(self, in_flight: int) -> None:
        """One manager per layer type, its small page in gcd units (see the module);
        `in_flight`: the tokens a step may have in flight (the sliding and chunked caps)."""
        stack = self.stack
        bs = self.block_size
        types = layer_types(stack)
        small: list[int] = []
        tbs: list[int] = []
        states: list[int] = []
        for kind, _window, layers in types:
            tb = sum(stack.layers[i].bytes_per_token for i in layers)
            state = sum(layer.state_bytes for i in layers
                        if isinstance(layer := stack.layers[i], MambaState))
            tbs.append(tb)
            states.append(state)
            small.append(state if kind == "mamba" else bs * tb)
        large, per, fallback = large_page(small, self.capacity)
        padded = [large // p for p in per]  # (the small page itself, unless the fallback)
        unit = math.gcd(*padded)
        managers: list[Manager] = []
        for (kind, window, _layers), tb, state, page in zip(types, tbs, states, padded,
                                                            strict=True):
            groups = page // unit
            if kind == "sliding_window":
                cap = -(-min(window - 1 + in_flight, self.max_model_len) // bs) + 1
                managers.append(SlidingWindowManager(bs, window, groups, tb, cap))
            elif kind == "chunked_local":
                cap = -(-min(window + in_flight, self.max_model_len) // bs)
                managers.append(ChunkedLocalManager(bs, window, groups, tb, cap))
            elif kind == "mamba":
                managers.append(MambaManager(self.max_model_len, 0, groups, 0, None, state))
            else:
                managers.append(Manager(bs, 0, groups, tb, None))
        self.types = types
        self.small_pages = padded
        self.large = large
        self.fallback = fallback
        self.managers = tuple(managers)
        self._manager_of = list(range(len(managers)))
        self._ptype = list(range(len(managers)))
        self._lists = [1] * len(managers)
        self.page = self.block_bytes = unit
        self.num_blocks = (self.capacity // large) * large // unit  # (units: a bound)
        self._reads = [ModelView.of(LayerStack(stack.name,
                                               tuple(stack.layers[i] for i in layers)))
                       for _kind, _window, layers in types]
        self._width = 6 + len(managers)
        self._cohort = Cohort(self.managers, self._reads, unit, self.max_model_len)
        self.pool = TwoLevelPool(self.capacity // large, per, False)

    # ------------------------------------------------------------ placement
    def _tables_of(self, rid: int) -> list[list[list[int]]]:
        tables = self._tables.get(rid)
        if tables is None:
            tables = self._tables[rid] = [[[] for _ in range(n)] for n in self._lists]
            self._named_start[rid] = [0] * len(self.managers)
        return tables

    def _place(self, rid: int, tokens: int, processed: int) -> bool:
        """Bring the request's small pages to its counts at (tokens, processed): its skipped
        ones given back, then new ones taken, manager by manager (vLLM's order). False, part
        done, when a take finds no page (the caller undoes the trial)."""
        tables = self._tables.get(rid)
        if tables is None:
            tables = self._tables_of(rid)
        return self._place_in(rid, tables, self._named_start[rid], tokens, processed)

    def _place_in(self, rid: int, tables: list[list[list[int]]], starts: list[int],
                  tokens: int, processed: int) -> bool:
        """`_place` on the request's tables and starts."""
        # (i64: machine ints in the compiled code, as `two_level_pool` says)
        pool, journaling = self.pool, self.pool.journaling
        kinds, sizes, windows, ptype = self._mkind, self._mbs, self._mwin, self._ptype
        nm: i64 = len(kinds)
        tok: i64 = tokens
        proc: i64 = processed
        for mi in range(nm):
            kind: i64 = kinds[mi]
            if kind == FULL:
                continue  # (nothing skipped, ever)
            skip = skipped_blocks(kind, sizes[mi], windows[mi], proc)
            drop: i64 = skip - starts[mi]
            if drop > 0:
                for ids in tables[mi]:
                    gone = ids[:drop]
                    del ids[:drop]
                    pool.give(ptype[mi], gone)
                    if journaling:
                        self._tj.append((0, ids, 0, 0, gone))
                if journaling:
                    self._tj.append((1, starts, mi, drop, starts))  # (ids: unread)
                starts[mi] = skip
        for mi in range(nm):
            bs: i64 = sizes[mi]
            kind = kinds[mi]
            want = -(-tok // bs)
            if kind != FULL:
                want -= skipped_blocks(kind, bs, windows[mi], proc)
            t = ptype[mi]
            groups = tables[mi]
            for gi in range(len(groups)):
                ids = groups[gi]
                n0: i64 = len(ids)
                if want > n0:
                    ok = pool.take_many(t, want - n0, ids[-1] if n0 else -1, ids)
                    if self._collect:
                        self._taken.extend(ids[n0:])
                    if journaling:
                        self._tj.append((2, ids, 0, 0, ids[n0:]))
                    if not ok:
                        return False
        return True

    def _mark(self) -> tuple[int, int]:
        return self.pool.mark(), len(self._tj)

    def _undo(self, mark: tuple[int, int]) -> None:
        pmark, tmark = mark
        tj = self._tj
        while len(tj) > tmark:
            op, table, mi, arg, ids = tj.pop()
            if op == 0:  # ids given back from the head of the table
                table[:0] = ids
            elif op == 1:  # manager `mi`'s start (`table`: the starts) moved on by `arg`
                table[mi] -= arg
            else:  # ids appended to the table (mostly one: popped, no slice made)
                for _ in range(len(ids)):
                    table.pop()
        self.pool.undo(pmark)
        self._commit(mark)

    def _commit(self, mark: tuple[int, int]) -> None:
        self.pool.commit(mark[0])
        if mark[0] == 0:
            self._tj.clear()

    def _redo(self, replay: tuple[int, int, int, list[int],
                                  list[tuple[int, list[int], int, int, list[int]]],
                                  list[list[int]], list[int],
                                  list[tuple[Decoder, int]]]) -> None:
        """The decoders' events up to the clock, as the look-ahead walked them from this very
        state and undid: its journals applied again, its events taken over (a walk's cost
        without its choices: which page, where an event goes)."""
        self.pool.redo(replay[3])
        for op, table, mi, arg, ids in replay[4]:
            if op == 0:  # ids given back from the head of the table
                del table[:len(ids)]
            elif op == 1:  # manager `mi`'s start (`table`: the starts) moved on by `arg`
                table[mi] += arg
            else:  # ids appended to the table
                table.extend(ids)
        self._buckets, self._clocks = replay[5], replay[6]
        for dec, at in replay[7]:
            dec.at = at

    def _place_taking(self, rid: int, tokens: int, processed: int) -> bool:
        """`_place`, the small pages it takes kept in `_taken` (a walk keeps none)."""
        self._taken = []
        self._collect = not self._deferred  # (deferred: no grant names them)
        ok = self._place(rid, tokens, processed)
        self._collect = False
        return ok

    def _try_place(self, rid: int, tokens: int, processed: int) -> bool:
        """Place for real if it all fits; else leave everything as it was. The ids taken
        are in `_taken`."""
        mark = self._mark()
        ok = self._place_taking(rid, tokens, processed)
        if ok:
            self._commit(mark)
        else:
            self._undo(mark)
        return ok

    # ------------------------------------------------------- decoders' events
    def _processed_at(self, rid: int, tokens: int, clock: int, joined: int) -> int:
        """The processed tokens of decoder `rid` of `tokens` at `clock`, which joined the
        cohort at `joined` (`HybridAllocator._state`'s rule)."""
        if joined != clock:
            if self._lag and joined == clock - 1:
                return self._first[rid]
            return tokens - 1 - self._lag
        return self._proc[rid]

    def _push(self, dec: Decoder, clock: int) -> None:
        """Decoder `dec`'s next event at `clock`, unless it is done by then."""
        if self.pool.journaling:  # (a look's walk: undone)
            self._atj.append((dec, dec.at))
        if clock <= dec.done:
            dec.at = clock
            # (the clock's place: a bisection of the descending clocks)
            clocks = self._clocks
            at: i64 = clock
            lo: i64 = 0
            hi: i64 = len(clocks)
            while lo < hi:
                mid = (lo + hi) >> 1
                if clocks[mid] >= at:
                    lo = mid + 1
                else:
                    hi = mid
            if lo > 0 and clocks[lo - 1] == at:
                self._buckets[lo - 1].append(dec.key)
            else:
                clocks.insert(lo, clock)
                self._buckets.insert(lo, [dec.key])
        else:
            dec.at = -1

    def _walk(self, limit: int, timeline: list[tuple[int, int]] | None) -> int:
        """Apply the decoders' events up to clock `limit`, in order (step, then admission
        order). Returns the clock of the first event that finds no page (-1: none); with a
        `timeline`, appends (clock, free large pages) after each event clock."""
        clocks, buckets, slots = self._clocks, self._buckets, self._slots
        lag, mml = self._lag, self.max_model_len
        kinds, sizes, windows = self._mkind, self._mbs, self._mwin
        while clocks and clocks[-1] <= limit:
            clock = clocks.pop()
            bucket = buckets.pop()
            if len(bucket) > 1:
                bucket.sort()  # (admission order)
            placed = False  # (whether an event of this clock was applied)
            for key in bucket:
                dec = slots[key & SLOT_MASK]
                if dec.key != key or dec.at != clock:
                    continue  # (stale: the decoder left, or its event moved)
                rid = dec.rid
                tokens = dec.base + clock
                joined = dec.joined
                processed = self._processed_at(rid, tokens, clock, joined)
                if not self._place_in(rid, dec.tables, dec.starts, tokens, processed):
                    if timeline is not None and placed:
                        timeline.append((clock, self.pool.free_large_pages()))
                    return clock
                placed = True
                # its next event: every step until its processed count follows its length,
                # then where a count may change next (`two_level_plan.next_step`)
                if clock < joined + 1 + lag:
                    self._push(dec, clock + 1)
                else:
                    self._push(dec, clock + next_step(kinds, sizes, windows, mml, tokens,
                                                      tokens - 1 - lag))
            if timeline is not None and placed:
                timeline.append((clock, self.pool.free_large_pages()))
        return -1

    def _look(self, horizon: int) -> tuple[int, list[tuple[int, int]]]:
        """(steps that fit, at most `horizon`; timeline of free large pages) of the next
        `horizon` decode steps, walked on the pool and undone."""
        memo = self._walk_memo
        if (memo is not None and memo[0] == self._clock and memo[1] == self._version
                and (memo[2] >= horizon or memo[3] < memo[2])):
            return min(memo[3], horizon), memo[4]
        buckets = [list(bucket) for bucket in self._buckets]
        clocks, amark = list(self._clocks), len(self._atj)
        mark = self._mark()
        timeline: list[tuple[int, int]] = []
        failed = self._walk(self._clock + horizon, timeline)
        if failed < 0 and mark[0] == 0:  # (for `_stepped`: the journals, the events after)
            self._replay = (self._clock, self._version, horizon, self.pool.journal[mark[0]:],
                            self._tj[mark[1]:], self._buckets, self._clocks,
                            [(dec, dec.at) for dec, _at in self._atj[amark:]])
        self._undo(mark)
        self._buckets, self._clocks = buckets, clocks
        atj = self._atj
        while len(atj) > amark:
            dec, at = atj.pop()
            dec.at = at
        fit = horizon if failed < 0 else failed - self._clock - 1
        self._walk_memo = (self._clock, self._version, horizon, fit, timeline)
        return fit, timeline

    # -------------------------------------------------------------- hooks
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        rid = live.req.rid
        if live.req.n > 1:
            raise ValueError(f"request {rid}: the two-level allocator does not model sample "
                             "groups (n > 1) yet")
        need = self._need(tokens, 0)
        most = self._large_for(need, empty=True)
        if most > self.num_large:
            return Refusal(rid, Reason.TOO_LARGE, most * self.large, self.free_bytes(),
                           "needs more large pages than exist")
        # (an admission only takes: it fits exactly when the fresh large pages it needs do,
        # and is then placed outright, with no trial to journal)
        fresh = self.pool.large_needed(need)
        if fresh > self.pool.free_large_pages():
            return Refusal(rid, Reason.OUT_OF_MEMORY, fresh * self.large, self.free_bytes())
        placed = self._place_taking(rid, tokens, 0)
        assert placed, "an admission's takes did not fit the free large pages counted"
        parts = self._admitted(live, tokens)
        assert self._admissions <= RANK_MASK, "more admissions than event keys order"
        return Grant(rid, parts.f0 * self.page, live.cap, blocks=self._new_ids())

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        rid = live.req.rid
        proc = max(0, old - self.in_flight_now) if self._lag else old
        if not self._try_place(rid, new, proc):
            short = self._need(new, proc)  # (less what it holds: the pages it must take)
            for mi, groups in enumerate(self._tables[rid]):
                short[self._ptype[mi]] -= sum(len(ids) for ids in groups)
            return Refusal(rid, Reason.OUT_OF_MEMORY,
                           self.pool.large_needed([max(0, n) for n in short]) * self.large,
                           self.free_bytes())
        taken = self._grown(live, old, new, proc)
        return Grant(rid, taken * self.page, live.cap, blocks=self._new_ids())

    def _release(self, live: Live) -> None:
        rid = live.req.rid
        # (`in`, then `del`: compiled, `dict.pop` is a generic method call, as the hybrid
        # allocator's `_release` says)
        if rid in self._tables:
            for mi, groups in enumerate(self._tables[rid]):
                for ids in groups:
                    self.pool.give(self._ptype[mi], ids)
            del self._tables[rid]
        if rid in self._held:
            self._add_fixed(self._held[rid], -1)
            del self._held[rid]
        if rid in self._named_start:
            del self._named_start[rid]
        rank = self._rank.get(rid, -1)
        for d in (self._rank, self._proc, self._joined, self._last_n, self._first):
            if rid in d:
                del d[rid]
        self._drop_decoder(rank)
        self._changed()

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        super()._cohort_changed(live, decoding)
        rid = live.req.rid
        if decoding:
            rank = self._rank[rid]
            dec = Decoder(rid, live.base, self._joined[rid], self._done_at[rid],
                          self._tables_of(rid), self._named_start[rid])
            self._drop_decoder(rank)  # (its record anew)
            free = self._free_slots
            slot = free.pop() if free else len(self._slots)
            assert slot <= SLOT_MASK, "more decoders at once than event keys name"
            if slot == len(self._slots):
                self._slots.append(dec)
            else:
                self._slots[slot] = dec
            dec.key = rank << SLOT_BITS | slot
            self._decoders[rank] = dec
            self._push(dec, self._clock + 1)
            self._fresh[rid] = self._clock
        else:
            rank = self._rank.get(rid, -1)
            if rid in self._fresh:
                del self._fresh[rid]
            self._drop_decoder(rank)

    def _drop_decoder(self, rank: int) -> None:
        """The decoder of admission `rank` out of its slot, if it has one."""
        if rank in self._decoders:
            slot = self._decoders[rank].key & SLOT_MASK
            self._slots[slot] = self._dead
            self._free_slots.append(slot)
            del self._decoders[rank]

    def _stepped(self) -> None:
        super()._stepped()
        replay, self._replay = self._replay, None
        if (replay is not None and replay[1] == self._version
                and replay[0] + replay[2] == self._clock):
            self._redo(replay)  # (the look-ahead walked these very steps: nothing changed)
        else:
            failed = self._walk(self._clock, None)
            assert failed < 0, "a decode step past steps_until_full"
        self._changed()

    def _new_ids(self) -> tuple[int, ...]:
        """The small pages the last placement took, for the grant (none where the engine
        defers block ids: they are placed all the same, the pool needs them)."""
        return () if self._deferred else tuple(self._taken)

    # ------------------------------------------------------------- queries
    def _need(self, tokens: int, processed: int, capped: bool = False) -> list[int]:
        """Small pages per pool type a request of `tokens` holds (capped: at the sliding
        and chunked groups' admission caps)."""
        need = [0] * len(self.pool.per)
        kinds, sizes, windows, caps = self._mkind, self._mbs, self._mwin, self._mcap
        tok: i64 = tokens
        proc: i64 = processed
        for mi in range(len(kinds)):
            bs: i64 = sizes[mi]  # (`Manager.held`, on machine ints)
            held = -(-tok // bs) - skipped_blocks(kinds[mi], bs, windows[mi], proc)
            if capped:
                cap: i64 = caps[mi]
                if 0 <= cap < held:
                    held = cap
            t = self._ptype[mi]
            need[t] = need[t] + self._lists[mi] * held
        return need

    def _large_for(self, need: list[int], empty: bool = False) -> int:
        if empty:  # (a loop on machine ints: a list summed is a generic call)
            per = self.pool.per
            total: i64 = 0
            for t in range(len(per)):
                n: i64 = need[t]
                p: i64 = per[t]
                total += -(-n // p)
            return total
        return self.pool.large_needed(need)

    def free_blocks(self) -> int:
        return self.pool.free_large_pages()

    def _allocated_total(self) -> int:
        return self.pool.used_large_pages() * self.large

    def _usable_free(self, probe: Request | None) -> int:
        return self.pool.free_large_pages() * self.large

    def _largest_hole(self) -> int:
        return self._usable_free(None)

    def parts(self, probe: Request | None = None) -> tuple[int, int, int, int, int]:
        blocks, token_states, reserved, internal = self._totals()[:4]
        usable = self.pool.free_large_pages() * self.large
        external = self.capacity - blocks * self.page - usable
        return token_states, reserved, internal, external, usable

    def integrals(
        self, n: int, probe: Request | None, w0: float, w1: float
    ) -> tuple[float, float, float, float, float, float]:
        if self.vllm_groups:  # (a large page is a block: the hybrid allocator's sums)
            return super().integrals(n, probe, w0, w1)
        weight = n * w0 + w1 * n * (n - 1) / 2
        sums = self._integrals6(n, w0, w1)
        free = float(self.pool.free_large_pages()) * weight
        if n and any(dec.at >= 0 for dec in self._decoders.values()):
            free = self._free_integral(n, w0, w1)
        usable = free * self.large
        external = self.capacity * weight - sums[0] * self.page - usable
        return (sums[1], sums[2], sums[3], external, usable, 0.0)

    def _free_integral(self, n: int, w0: float, w1: float) -> float:
        """Sum over steps j = 1..n of the free large pages after step j x (w0 + w1 (j - 1))."""
        free = self.pool.free_large_pages()
        if n == 1:  # (one step that gives no page back: its takes counted, no walk)
            need = next_step_need(self)
            short = -1 if need is None else self.pool.large_needed(need)
            if 0 <= short <= free:  # (0.0 +: the sum below, to the sign of a zero)
                return 0.0 + (free - short) * weights(1, 1, w0, w1)
        _fit, timeline = self._look(n)
        total = 0.0
        j = 1  # the first step whose figure `free` is
        for clock, after in timeline:
            step = clock - self._clock
            if step > n:
                break
            if step > j:  # steps j .. step - 1 at `free`
                total += free * weights(j, step - 1, w0, w1)
            free, j = after, step
        total += free * weights(j, n, w0, w1)
        return total

    def steps_until_full(self) -> int | None:
        done = self.steps_until_done()
        return None if done is None else self.steps_until_full_within(done)

    def can_step(self) -> bool:
        """(`Allocator.can_step`: the next step alone, walked if the bound does not settle
        it; the hybrid allocator's answer counts one pool of blocks.)"""
        return self.steps_until_full_within(1) != 0

    def steps_until_full_within(self, limit: int) -> int | None:
        """Exact up to `limit`: at once where the decoders' most pages over the stretch fit
        (`two_level_bounds`), else the stretch walked on the pool up to its first refusal."""
        done = self.steps_until_done()
        if done is None:
            return None
        memo = self._full_exact
        if memo is not None and memo[0] == self._clock and memo[1] == self._version:
            return min(memo[2], limit)
        horizon = min(limit, done)
        if few_fit(self, horizon):
            return horizon
        if self.pool.large_needed(most_extra(self, horizon)) <= self.pool.free_large_pages():
            return horizon
        fit = next_step_fits(self) if horizon == 1 else -1
        if fit < 0:
            fit = self._look(horizon)[0]
        if fit < horizon or horizon == done:  # (exact: memo it)
            self._full_exact = (self._clock, self._version, fit)
        return fit

    def admit_shortfall(self, tokens: int) -> int:
        """Fresh large pages an admission of `tokens` would need beyond the free ones (0: it
        would be granted); nothing changes."""
        return max(0, self.pool.large_needed(self._need(tokens, 0))
                   - self.pool.free_large_pages())

    def grow_shortfall(self, rid: int, n: int, in_flight: int = 0) -> int:
        """Fresh large pages `grow(rid, n, in_flight)` would need beyond the free ones (0: it
        would be granted), tried on the pool and undone; nothing changes."""
        live = self._get(rid)
        old = self._tokens_of(live)
        proc = max(0, old - in_flight) if self._lag else old
        mark = self._mark()
        ok = self._place(rid, old + n, proc)
        self._undo(mark)
        if ok:
            return 0
        short = self._need(old + n, proc)
        for mi, groups in enumerate(self._tables[rid]):
            short[self._ptype[mi]] -= sum(len(ids) for ids in groups)
        return max(1, self.pool.large_needed([max(0, k) for k in short])
                   - self.pool.free_large_pages())

    def bytes_for(self, req: Request, tokens: int) -> int:
        return self._large_for(self._need(tokens, 0, capped=True), empty=True) * self.large

    def admission_bytes(self, req: Request, tokens: int, hit: int) -> int:
        """vLLM's full-sequence gate, in large pages: the ones a fresh large page would have
        to supply for every type's capped pages beyond its free small pages now, plus the
        budget's whole large pages no request can take (the null block with vllm_groups)."""
        tail = (self.capacity - self.num_large * self.large) // self.large
        need = self._need(tokens, 0, capped=True)
        return (self.pool.large_needed(need) + tail) * self.large

    def watermark_bytes(self, fraction: float) -> int:
        return int(fraction * self.num_large) * self.large

    def too_large(self, req: Request) -> bool:
        final = min(req.final, self.max_model_len)
        lo = max(1, final - max(m.peak_span() for m in self.managers))
        peak = max(self._large_for(self._need(t, max(0, t - 1 - self._lag)), empty=True)
                   for t in range(lo, final + 1))
        return peak > self.num_large

    def summary_stats(self) -> dict[str, float | int]:
        if self.vllm_groups:
            return super().summary_stats()
        return {
            "two_level_types": len(self.managers),
            "two_level_large_page_bytes": self.large,
            "two_level_large_pages": self.num_large,
            "two_level_fallback": int(self.fallback),
        }

    def group_kinds(self) -> tuple[str, ...]:
        if self.vllm_groups:
            return super().group_kinds()
        return tuple(kind for kind, _window, _layers in self.types)

    # ------------------------------------------------------------ block ids
    def group_tables(self, rid: int) -> list[tuple[int, ...]]:
        """Small page ids per group (vllm_groups: per planned group, block ids), 0 for each
        skipped one with vllm_groups (vLLM's null block); without it, skipped ones left out
        (no null page)."""
        self._get(rid)
        tables, starts = self._tables_of(rid), self._named_start[rid]
        lead = 1 if self.vllm_groups else 0
        return [(0,) * (starts[mi] * lead) + tuple(ids)
                for mi in range(len(self.managers)) for ids in tables[mi]]

    def block_table(self, rid: int) -> tuple[int, ...]:
        self._get(rid)
        return tuple(b for groups in self._tables_of(rid) for ids in groups for b in ids)

    def check_pages(self) -> None:
        """Every held small page once, inside a large page of its type (tests)."""
        self.pool.check()
        seen: set[tuple[int, int]] = set()
        held = [0] * len(self.pool.per)
        for rid, tables in self._tables.items():
            assert rid in self._live
            for mi, groups in enumerate(tables):
                t = self._ptype[mi]
                for ids in groups:
                    for sid in ids:
                        assert (t, sid) not in seen, (t, sid)
                        seen.add((t, sid))
                        assert self.pool.pages[sid // self.pool.per[t]].owner == t
                        held[t] += 1
        for t, per in enumerate(self.pool.per):
            assert self.pool.owned[t] * per - self.pool.free_small[t] == held[t]

