"""`two-level` with prefix caching in its own layout (`prefix_caching: true`, `vllm_groups`
false): Jenga's layer-aware caching (SOSP'25, arXiv 2503.18292) with vLLM 0.33's hit rules.

The layout is two-level's own (`two_level`): one unpadded group per layer type (full attention,
MLA, each sliding window, each chunk, the Mamba state), a small page per type (block_size x the
type's bytes per token; Mamba: its layers' state, as is), large pages of their LCM (or the
fallback of `two_level_plan.large_page`). The pages are kept by the two-level cache pool
(`two_level_cache_pool`: reference counts, a cache per type, eviction large page by large
page); the hit rules, caching and decode steps are vLLM's, as `hybrid` with prefix caching has
them (`kvfrag.sim.hybrid.caching.HybridPrefixCaching`, which this class specialises): keys per
group (here per type), hits agreed across the types (full attention left to right; sliding
windows right to left, needing the blocks of their last window; Mamba right to left, needing
the state that ends at the hit), blocks cached as they fill, decode steps applied decoder
after decoder in the running order. What differs:

- **pages**: each type takes small pages of its own size, placed next to the request's last
  page of that type (`TwoLevelCachePool.take`'s hint); a block id names (type, small page) as
  small page x types + type + 1 (0 stays the null block);
- **Mamba** runs in vLLM's mode "align" at the attention block size (a state page per block of
  tokens, at most the current and the previous one held; only the states a hit can use are
  cached: the replay boundary's and a shared-prefix junction's), each state in a page of its
  own size, not grown to an attention block of 544 tokens as vLLM's single page size makes it
  on Qwen3-Next;
- **fits** are counted in large pages (`TwoLevelCachePool.large_needed`, exact): an admission's
  hit pages nobody holds are revived first (an idle page inside a large page its type holds
  costs one of that type's local pages; one inside an evictable large page makes that whole
  large page its type's again), then its new pages;
- **async scheduling** frees by the tokens *processed*, as vLLM does (unlike two-level
  without caching, which frees by the tokens computed): a freed block becomes cached-idle, and
  the hit and caching rules stay vLLM's, step for step, and the sliding admission caps allow
  `concurrent_batches` chunks in flight as vLLM's.

Accounting, to the byte: held small pages are in use (token_states, reserved and internal split
as `HybridPrefixCaching._figures` splits them, each type's page its own size); free and
evictable large pages are usable free memory (an idle cached page in an evictable large page
counts as free, as `hybrid` and `prefix-caching` count idle cached blocks); free slots and idle
cached pages inside large pages a type holds are external (only that type can use them, as
two-level's stranded slots), and so is the remainder of budget // large page.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import replace

from kvfrag.sim.allocators.base import Grant, Live, Reason, Refusal, Request
from kvfrag.sim.allocators.hybrid import HybridAllocator
from kvfrag.sim.allocators.two_level_cache_pool import TwoLevelCachePool
from kvfrag.sim.allocators.two_level_plan import large_page, layer_types
from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.hybrid.caching import HybridPrefixCaching
from kvfrag.sim.hybrid.managers import (
    ChunkedLocalManager,
    MambaManager,
    Manager,
    SlidingWindowManager,
)
from kvfrag.sim.hybrid.planner import Group
from kvfrag.sim.hybrid.prefix import Kind, PrefixState
from kvfrag.sim.hybrid.prefix_figures import held_figures
from kvfrag.sim.layers import MambaState


class _Refs:
    """Reference counts by block id (`TypedPool.ref`): 0 for an idle cached page."""

    def __init__(self, pool: TypedPool) -> None:
        self._pool = pool

    def __getitem__(self, b: int) -> int:
        t, sid = self._pool.decode(b)
        return self._pool.pool.ref[t].get(sid, 0)


class TypedPool:
    """What `PrefixState` and `HybridPrefixCaching` call on a block pool, over a
    `TwoLevelCachePool` of several types: block id b names type (b - 1) % types and small page
    (b - 1) // types. `freed` counts the small pages left without holders so far (the decode
    steps' "freed" of the look-ahead, in small pages)."""

    def __init__(self, pool: TwoLevelCachePool) -> None:
        self.pool = pool
        self.types = len(pool.per)
        self.freed = 0

    def light_copy(self) -> TypedPool:
        other = TypedPool(self.pool.light_copy())
        other.freed = self.freed
        return other

    def encode(self, t: int, sid: int) -> int:
        return sid * self.types + t + 1

    def decode(self, b: int) -> tuple[int, int]:
        sid, t = divmod(b - 1, self.types)
        return t, sid

    @property
    def cache(self) -> list[dict[Hashable, dict[int, None]]] | None:
        return self.pool.cache

    @property
    def ref(self) -> _Refs:
        return _Refs(self)

    @property
    def evictions(self) -> int:
        return self.pool.evictions

    @property
    def evicted(self) -> list[int]:
        return [self.encode(t, sid) for t, sid in self.pool.evicted]

    @evicted.setter
    def evicted(self, ids: list[int]) -> None:
        self.pool.evicted = [self.decode(b) for b in ids]

    def take(self, t: int, n: int, hint: int) -> list[int]:
        """n small pages of type t, the first next to block id `hint` (0: none)."""
        sids: list[int] = []
        ok = self.pool.take_many(t, n, self.decode(hint)[1] if hint else -1, sids)
        assert ok, "a take past the fit check"
        return [self.encode(t, sid) for sid in sids]

    def free(self, blocks: list[int]) -> int:
        """One holder fewer of each block, in the order given (runs of one type at a time)."""
        freed = i = 0
        while i < len(blocks):
            t = (blocks[i] - 1) % self.types
            j = i
            while j < len(blocks) and (blocks[j] - 1) % self.types == t:
                j += 1
            freed += self.pool.free(t, [(b - 1) // self.types for b in blocks[i:j]])
            i = j
        self.freed += freed
        return freed

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if b:
                t, sid = self.decode(b)
                self.pool.touch(t, [sid])

    def lookup(self, key: tuple) -> int:
        t = key[2]  # (a key names its group: here its type)
        sid = self.pool.lookup(t, key)
        return 0 if sid < 0 else self.encode(t, sid)

    def insert(self, key: tuple, b: int) -> None:
        t, sid = self.decode(b)
        assert t == key[2], ("a block cached under another type's key", key, b)
        self.pool.insert(t, key, sid)


class TwoLevelOwnCaching(HybridPrefixCaching):
    """`two-level` in its own layout with prefix caching (`make_allocator` builds it for
    `prefix_caching: true` without `vllm_groups`): see the module."""

    _row_width = 7  # (`_step_row`: the usable bytes too)

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
        prefix_caching: object = True,
        vllm_groups: object = False,
        geometry: KVGeometry | None = None,
    ) -> None:
        assert prefix_caching is True and vllm_groups is False, "built by make_allocator"
        # (vLLM's plan as two-level plans it without caching: its checks, its memory check;
        # then the types replace its groups)
        HybridAllocator.__init__(self, capacity, bytes_per_token, max_model_len, block_size,
                                 True, stack, max_num_batched_tokens, concurrent_batches,
                                 False, "none", 0, geometry)
        self.vllm_groups = False
        # (frees by the tokens processed, as vLLM: its sliding caps, `concurrent_batches`
        # chunks in flight; the values were checked above)
        self._plan_types(int(max_num_batched_tokens) * int(concurrent_batches))  # type: ignore[call-overload]
        self._init_caching()

    def _plan_types(self, in_flight: int) -> None:
        """One group and manager per layer type, each type's small page, the large page;
        `in_flight`: the tokens a step may have in flight (the sliding and chunked caps)."""
        stack, bs, mml = self.stack, self.block_size, self.max_model_len
        types = layer_types(stack)
        small, tbs, states = [], [], []
        for kind, _window, layers in types:
            tb = sum(stack.layers[i].bytes_per_token for i in layers)
            state = sum(layer.state_bytes for i in layers
                        if isinstance(layer := stack.layers[i], MambaState))
            tbs.append(tb)
            states.append(state)
            small.append(state if kind == "mamba" else bs * tb)
        large, per, fallback = large_page(small, self.capacity)
        pages = [large // p for p in per]
        managers: list[Manager] = []
        groups: list[Group] = []
        for (kind, window, layers), tb, state, page in zip(types, tbs, states, pages,
                                                           strict=True):
            if kind == "sliding_window":
                cap = -(-min(window - 1 + in_flight, mml) // bs) + 1
                managers.append(SlidingWindowManager(bs, window, 1, tb, cap))
            elif kind == "chunked_local":
                cap = -(-min(window + in_flight, mml) // bs)
                managers.append(ChunkedLocalManager(bs, window, 1, tb, cap))
            elif kind == "mamba":  # (mode "align" at the attention block size)
                managers.append(MambaManager(bs, 0, 1, 0, None, state))
            else:
                managers.append(Manager(bs, 0, 1, tb, None))
            groups.append(Group(kind, tuple(layers), 0, bs, page // max(1, len(layers)), page,
                                window or None))
        mamba = any(k == "mamba" for k, _w, _l in types)
        self.types = types
        self.small_pages = pages
        self.large = large
        self.fallback = fallback
        self.num_large = self.capacity // large
        self.managers = tuple(managers)
        self._manager_of = list(range(len(managers)))
        self.page = self.block_bytes = math.gcd(*pages)
        self.num_blocks = self.num_large * large // self.page  # (units: a bound)
        self.plan = replace(self.plan, groups=tuple(groups), group_size=0, padding_warnings=(),
                            prefix_caching=True, mamba_cache_mode="align" if mamba else "none",
                            block_size=bs, mamba_block_size=bs if mamba else None,
                            page_bytes=large, num_blocks=self.num_large,
                            scheduler_block_size=bs, hash_block_size=bs)

    def _init_caching(self) -> None:
        """`HybridPrefixCaching`'s state, over the types (its constructor reads vLLM's plan)."""
        self._kinds = [Kind(m.kind, (g,), m.block_size, m.window)
                       for g, m in enumerate(self.managers)]
        self._order = sorted(range(len(self._kinds)),
                             key=lambda i: self._kinds[i].kind != "full")
        self._tb = [m.token_bytes for m in self.managers]
        self._sb = [m.state_bytes if m.kind == "mamba" else 0 for m in self.managers]
        self._mamba = any(k.kind == "mamba" for k in self._kinds)
        # (every kind: `_quiet_step` also tells a sliding or chunked table that frees nothing)
        self._quiet = [(g, k.block_size, k.kind == "mamba") for g, k in enumerate(self._kinds)]
        self._hash_bs = self.block_size
        self._fresh = set()
        self._grown = set()
        self._admitted = False
        self._waited = False
        per = [self.large // p for p in self.small_pages]
        self._st = PrefixState(0, len(self.managers))
        self._st.pool = TypedPool(TwoLevelCachePool(self.num_large, per, False))  # type: ignore[assignment]
        self._sim_clock = 0
        self._lookup = None
        self._boundary = {}
        self._chains = {}
        self._freed_last = False
        self._ahead = None
        self._totals_memo = None
        self._pending = []
        self._room = -1
        self._leaving = set()
        self._preempting = False
        self.waste_split = True
        self._sums_memo = None
        self._decoders_memo = None
        self.lookups = 0
        self.hit_blocks = 0

    # ------------------------------------------------------------ the pool
    @property
    def pool(self) -> TwoLevelCachePool:
        return self._st.pool.pool  # type: ignore[attr-defined]

    def _needed(self, pool: TwoLevelCachePool, new: list[int],
                revive: list[tuple[int, int]]) -> tuple[int, int]:
        """(fresh or evictable large pages the `new` pages per type need once the idle hit
        pages `revive` ((type, small page)) are held again, evictable large pages those
        revive): exact, as `TwoLevelCachePool.large_needed`."""
        local = [pool.free_small[t] + pool.npinned[t] for t in range(len(new))]
        woken: dict[int, int] = {}
        for t, sid in revive:
            lid = sid // pool.per[t]
            if pool.held[lid]:
                local[t] -= 1
            else:
                woken[lid] = woken.get(lid, 0) + 1
        for lid, n in woken.items():
            t = pool.owner[lid]
            local[t] += bin(pool.mask[lid]).count("1") + bin(pool.idle_slots[lid]).count("1") - n
        large = 0
        for t, n in enumerate(new):
            short = n - local[t]
            if short > 0:
                large += -(-short // pool.per[t])
        return large, len(woken)

    def _fits(self, st: PrefixState, need: list[int]) -> bool:
        pool: TwoLevelCachePool = st.pool.pool  # type: ignore[attr-defined]
        return pool.large_needed(need) <= pool.usable_large_pages()

    def _bytes_of(self, need: list[int]) -> int:
        return sum(n * p for n, p in zip(need, self.small_pages, strict=True))

    # ------------------------------------------------------------ admission
    def _admission_need(self, req: Request, tokens: int, ids: list[list[int]], hit: int,
                        cap: bool) -> tuple[list[int], list[tuple[int, int]]] | None:
        """(new pages per type, idle hit pages to revive) of an admission to `tokens` with
        the hit `ids`; None where a Mamba hit on a state cached in this step must wait a
        step (`HybridPrefixCaching._need_new`)."""
        typed: TypedPool = self._st.pool  # type: ignore[assignment]
        refs = typed.pool.ref
        new = [0] * len(self.managers)
        revive: list[tuple[int, int]] = []
        for g, found in enumerate(ids):
            m, k = self.managers[g], self._kinds[g]
            required = -(-tokens // m.block_size)
            if k.kind == "mamba":
                if found and self._key(req, self._chain(req), len(found) - 1,
                                       g) in self._fresh:
                    self._waited = True
                    return None
                new[g] += min(required - len(found), 1)
                kept = found
            else:
                if cap and m.cap is not None:
                    required = min(required, m.cap)
                skipped = k.skipped(hit)
                new[g] += max(required - max(skipped, len(found)), 0)
                kept = found[skipped:]
            for b in kept:
                if b:
                    t, sid = typed.decode(b)
                    if sid not in refs[t]:
                        revive.append((t, sid))
        return new, revive

    def admission_bytes(self, req: Request, tokens: int, hit: int) -> int:
        """vLLM's full-sequence gate with the hit, in large pages: the ones every type's pages
        for the whole sequence (sliding ones capped) past the hit would take beyond its local
        pages, the idle hit pages revived first, plus the budget's remainder (`free_bytes`
        counts it)."""
        self._flush()
        found, ids, _ = self._looked_up(req, hit + 1)
        tail = (self.capacity - self.num_large * self.large) // self.large
        got = self._admission_need(req, min(tokens, self.max_model_len), ids, found, True)
        if got is None:
            return (self.num_large + 1 + tail) * self.large
        large, woken = self._needed(self.pool, *got)
        return (large + woken + tail) * self.large

    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        req = live.req
        rid = req.rid
        if req.n > 1:
            raise ValueError(
                f"request {rid}: the two-level allocator does not model sample groups (n > 1) yet"
            )
        most = self.bytes_for(req, tokens)
        if most > self.num_large * self.large:
            return Refusal(rid, Reason.TOO_LARGE, most, self.free_bytes(),
                           "needs more large pages than exist")
        self._flush()
        self._admitted = True
        hit, ids, boundary = self._looked_up(req, tokens)
        pool = self.pool
        got = self._admission_need(req, tokens, ids, hit, False)
        if got is None:
            return Refusal(rid, Reason.OUT_OF_MEMORY, (self.num_large + 1) * self.large,
                           self.free_bytes())
        new_pages, revive = got
        large, woken = self._needed(pool, new_pages, revive)
        if large + woken > pool.usable_large_pages():
            return Refusal(rid, Reason.OUT_OF_MEMORY, (large + woken) * self.large,
                           self.free_bytes())
        new = self._install(live, tokens, hit, ids, boundary)
        taken = self._bytes_of(new_pages) + sum(self.small_pages[t] for t, _ in revive)
        return Grant(rid, taken, live.cap, blocks=tuple(new))

    # ------------------------------------------------------------ taking
    def _take(self, st: PrefixState, rid: int, tokens: int) -> list[int]:
        """Each type's table grown to `tokens` slots, each new page placed next to the
        request's last one of its type; the takes have the room the fit leaves (the pool's
        `allow`: large pages opened before idle pages are evicted in place)."""
        typed: TypedPool = st.pool  # type: ignore[assignment]
        pool = typed.pool
        pool.allow(self._wanted_typed(st, rid, tokens))
        new: list[int] = []
        for g, table in enumerate(st.writable(rid)):
            k = self._kinds[g]
            required = -(-tokens // k.block_size)
            if k.kind == "mamba":
                got = self._mamba_take(typed, g, table, st.mamba[rid], required)
            else:
                more = required - len(table)
                if more <= 0:
                    continue
                got = typed.take(g, more, _last(table))
                table.extend(got)
            new.extend(got)
        pool.room = 0
        evictions = self._st.pool.evictions
        if evictions != self.evictions and self._mamba:
            # (as `HybridPrefixCaching._take`: an eviction may let a waiting request's first
            # chunk stop earlier: a free for the engine's FCFS head)
            self.frees += 1
        self.evictions = evictions
        return new

    @staticmethod
    def _mamba_take(typed: TypedPool, g: int, table: list[int], mamba: list[int],
                    required: int) -> list[int]:
        """`PrefixState.mamba_take` on type g's pages."""
        if required <= len(table):
            mamba[2] = 1
            return []
        prev = len(table)
        if mamba[2] or prev > 0:
            mamba[1] = prev - 1
        hint = _last(table)
        if prev < required - 1:
            table.extend([0] * (required - 1 - prev))
        got = typed.take(g, 1, hint)
        table.extend(got)
        mamba[2] = 1
        return got

    def _wanted_typed(self, st: PrefixState, rid: int, tokens: int) -> list[int]:
        """Small pages per type that growing the request's tables to `tokens` takes."""
        need = [0] * len(self._kinds)
        for g, t in enumerate(st.tables[rid]):
            k = self._kinds[g]
            more = -(-tokens // k.block_size) - len(t)
            if more > 0:
                need[g] = 1 if k.kind == "mamba" else more
        return need

    def _grow_bytes(self, st: PrefixState, rid: int, tokens: int) -> tuple[int, int]:
        """(`HybridPrefixCaching._grow`'s check, in large pages: the large pages it lacks as
        bytes; else the small pages it takes.)"""
        need = self._wanted_typed(st, rid, tokens)
        if not self._fits(st, need):
            return self.pool.large_needed(need) * self.large, 0
        return 0, self._bytes_of(need)

    def _step(self, st: PrefixState, clock: int,
              victims: list[tuple[int, list[list[int]], int]] | None = None) -> int:
        """`HybridPrefixCaching._step`, each decoder's pages fitted in large pages; `st.freed`
        counts the small pages the step left without holders."""
        queue = list(victims or ())
        typed: TypedPool = st.pool  # type: ignore[assignment]
        before = typed.freed
        quiet = self._quiet
        decoders = self._decoders()
        for rank in st.due(decoders, clock):  # (skipping those known quiet: most are)
            rid, live = decoders[rank]
            tokens = live.base + clock
            processed = tokens - 1
            if self._lag:
                processed = (self._first[rid] if self._joined[rid] == clock - 1
                             else tokens - 2)
            if quiet is not None and self._quiet_step(st, rid, tokens, quiet, processed):
                st.note_quiet(rid, tokens, processed, quiet, self._kinds, self._manager_of,
                              self._lag)
                continue
            st.remove_skipped(rid, self._kinds, self._manager_of, processed)
            need = self._wanted_typed(st, rid, tokens)
            while not self._fits(st, need):
                if not queue:
                    st.freed = typed.freed - before
                    return rank
                st.free_tables(queue.pop(0)[1])
            self._take(st, rid, tokens)
            if typed.cache is not None:
                self._cache(st, live.req, tokens - self._lag)
        st.victims_turn(queue, self._kinds, self._manager_of)
        st.freed = typed.freed - before
        return -1

    def _surely_fits(self, steps: int) -> bool:
        """(Not told without walking: a decoder's takes may open large pages beyond its
        need, within the room its own fit leaves.)"""
        return False

    # ------------------------------------------------------------ questions
    def _type_need(self, tokens: int, processed: int, capped: bool) -> list[int]:
        """Small pages per type a request of `tokens` holds after freeing by `processed`
        (capped: sliding and chunked at their admission caps; Mamba: two states at most)."""
        need = []
        for m in self.managers:
            if m.kind == "mamba":
                need.append(min(-(-tokens // m.block_size), 2))
                continue
            n = m.held(tokens, processed)
            need.append(min(n, m.cap) if capped and m.cap is not None else n)
        return need

    def _large_empty(self, need: list[int]) -> int:
        return sum(-(-n // (self.large // p)) for n, p in zip(need, self.small_pages,
                                                                strict=True))

    def bytes_for(self, req: Request, tokens: int) -> int:
        return self._large_empty(self._type_need(tokens, 0, True)) * self.large

    def too_large(self, req: Request) -> bool:
        final = min(req.final, self.max_model_len)
        lo = max(1, final - max(2 * m.block_size for m in self.managers))
        peak = max(self._large_empty(self._type_need(t, max(0, t - 1 - self._lag), False))
                   for t in range(lo, final + 1))
        return peak > self.num_large

    def watermark_bytes(self, fraction: float) -> int:
        return int(fraction * self.num_large) * self.large

    def admit_shortfall(self, tokens: int) -> int:
        """Large pages an admission of `tokens` with no hit would need beyond the usable
        ones; nothing changes."""
        self._flush()
        pool = self.pool
        return max(0, pool.large_needed(self._type_need(tokens, 0, False))
                   - pool.usable_large_pages())

    def grow_shortfall(self, rid: int, n: int, in_flight: int = 0) -> int:
        """Large pages `grow(rid, n, in_flight)` would need beyond the usable ones, tried on a
        copy of the state; nothing changes."""
        self._flush()
        live = self._get(rid)
        old = self._tokens_of(live)
        proc = max(0, old - in_flight) if self._lag else old
        st = self._st.light_copy()
        st.remove_skipped(rid, self._kinds, self._manager_of, proc)
        pool: TwoLevelCachePool = st.pool.pool  # type: ignore[attr-defined]
        need = self._wanted_typed(st, rid, old + n)
        return max(0, pool.large_needed(need) - pool.usable_large_pages())

    def free_blocks(self) -> int:
        self._flush()
        return self.pool.usable_large_pages()

    def allocated_bytes(self, rid: int) -> int:
        self._get(rid)
        return sum((len(t) - t.count(0)) * self.small_pages[g]
                   for g, t in enumerate(self._st.tables.get(rid, ())))

    def idle_cached_blocks(self) -> int:
        self._flush()
        return sum(len(s) for s in self.pool.stamp)

    # ------------------------------------------------------------ figures
    def _figures(self, st: PrefixState, clock: int) -> tuple[int, int, int, int, int]:
        """(bytes of held small pages, token_states, reserved, padding, out_of_window) of `st`
        at `clock`: `sim.hybrid.prefix_figures` with a page size per type."""
        pool: TwoLevelCachePool = st.pool.pool  # type: ignore[attr-defined]
        held = sum(len(pool.ref[g]) * page for g, page in enumerate(self.small_pages))
        return (held, *held_figures(st, self._live, clock, self._kinds, self._manager_of,
                                    self._tb, self._sb, self.small_pages, self._apart(st)))

    def _totals_at(self, st: PrefixState, clock: int) -> tuple[int, ...]:
        held, token_states, reserved, padding, out = self._figures(st, clock)
        return held, token_states, reserved, held - token_states - reserved, padding, out

    def _step_row(self, st: PrefixState, clock: int) -> tuple[int, ...]:
        """The totals (held bytes first), then the usable bytes: free and evictable large
        pages, which the held small pages do not tell."""
        pool: TwoLevelCachePool = st.pool.pool  # type: ignore[attr-defined]
        return (*self._totals_at(st, clock), pool.usable_large_pages() * self.large)

    def _allocated_total(self) -> int:
        """Bytes of the large pages held (what `free_bytes` leaves out: the usable large
        pages and the budget's remainder are free)."""
        return self.pool.held_large_pages() * self.large

    def parts(self, probe: Request | None = None) -> tuple[int, int, int, int, int]:
        held, token_states, reserved, internal = self._totals()[:4]
        usable = self.pool.usable_large_pages() * self.large
        return token_states, reserved, internal, self.capacity - held - usable, usable

    def integrals(
        self, n: int, probe: Request | None, w0: float, w1: float
    ) -> tuple[float, float, float, float, float, float]:
        sums = self._sums(n, w0, w1)
        weight = n * w0 + w1 * n * (n - 1) / 2
        external = self.capacity * weight - sums[0] - sums[6]
        return (sums[1], sums[2], sums[3], external, sums[6], 0.0)

    def summary_stats(self) -> dict[str, float | int]:
        self._flush()
        pool = self.pool
        return {
            "two_level_types": len(self.managers),
            "two_level_large_page_bytes": self.large,
            "two_level_large_pages": self.num_large,
            "two_level_fallback": int(self.fallback),
            "prefix_lookup_blocks": self.lookups,
            "prefix_hit_blocks": self.hit_blocks,
            "prefix_hit_rate_blocks": self.hit_blocks / self.lookups if self.lookups else 0.0,
            "prefix_evictions": self.evictions,
            "prefix_cached_blocks": sum(len(k) for k in pool.keys),
        }

    def check_pages(self) -> None:
        """The pool's invariants, and every table's pages held and of its type (tests)."""
        pool = self.pool
        pool.check()
        typed: TypedPool = self._st.pool  # type: ignore[assignment]
        tables = list(self._st.tables.values()) + [ts for _r, ts, _p in self._pending]
        holders: list[dict[int, int]] = [{} for _ in self._kinds]
        for ts in tables:
            for g, table in enumerate(ts):
                for b in table:
                    if b:
                        t, sid = typed.decode(b)
                        assert t == g, ("a page of another type", g, b)
                        holders[t][sid] = holders[t].get(sid, 0) + 1
        for t in range(len(self._kinds)):
            assert holders[t] == pool.ref[t], ("held pages and tables disagree", t)


def _last(table: list[int]) -> int:
    """The table's last page (0: none), the hint for the next take."""
    for b in reversed(table):
        if b:
            return b
    return 0


__all__ = ["TwoLevelOwnCaching", "TypedPool"]
