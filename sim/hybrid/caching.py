"""The `hybrid` allocator with prefix caching on (`prefix_caching: true`): vLLM 0.33's hybrid
KV-cache manager with its block pool caching full blocks per KV-cache group
(`kvfrag.sim.hybrid.prefix` has the pool and the hit rules).

With prefix caching a block id may be held by several requests (a hit), and a block freed by
one request stays cached until the pool takes it back: which blocks are free, cached or
shared depends on every request's history, so this allocator keeps vLLM's state itself (each
request's table per group, the pool's reference counts and free queue) and applies each
allocation block by block as vLLM does: an admission looks up its hit (`cached_prefix_tokens`,
the coordinator's fixed point), revives the hit blocks nobody holds, takes new ones and caches
what it filled; a prefill chunk and each decode step first free the blocks their window left
(cached ones go idle, the others are reused first), then take and cache; a free gives back
every table last first. Decode steps are applied in the running order (admission order),
one step after the other, a decoder's steps between its block boundaries, blocks to cache
and window edges skipped (they change nothing: `PrefixState.quiet`); `steps_until_full`,
`steps_until_shrink` and `integrals` look ahead on a copy of the state (overlays on its pool,
tables copied as they change), at most `HORIZON` steps (the engine's decode stretches are
then no longer than that, which costs it more events but changes no figure), and no further
than the question asked needs (`sim.hybrid.caching_ahead`).

Accounting: blocks in use are the ids some request holds (a shared id once); idle cached
blocks are usable free memory, as in `prefix-caching`. token_states counts each held id's
tokens once, those a layer of its group reads for some holder (full attention: every stored
token; sliding window W: the last W tokens of its holder); reserved the slots of each table's
last block its request will still write; internal the rest of the held ids' pages, split as
the hybrid allocator splits it (`_figures`): padding (each held id's page beyond its group's
real slots or Mamba state), out of window (tokens written in held ids that no holder reads,
Mamba states held beside a request's current one) and rounding.

Mamba hybrids run in vLLM's `mamba_cache_mode` "align", which prefix caching forces: the
attention and Mamba groups share one block size (Qwen3-Next: 544 tokens, Jamba: 80), a
request holds per Mamba group its current state block and, until its next allocation, the
previous one (`sim.hybrid.prefix`), and its state blocks are cached only at block boundaries
that a hit can use (the replay boundary and shared-prefix junctions, with retention 0). The
scheduler ends prefill chunks where a state must be kept (`aligned_chunk`, vLLM's
`_mamba_block_aligned_split`), so a prompt is prefilled in two steps or more even without
chunked prefill. A hit on a state block cached in the same scheduler step waits a step, as
vLLM's `cached_blocks_this_step` makes it (the allocator tells steps apart by the engine's
calls: a decode step, a free, a request's second chunk, a chunk after an admission).

Async scheduling (`set_async`): each allocation frees by the tokens processed, computed less
those in flight, as `HybridAllocator` does (a Mamba group's previous state block too), and a
decode step caches the blocks its known tokens fill: vLLM's `allocate_slots` caches up to
`request.num_tokens`, which lacks the token in flight, so a decoder's block is cached a step
later (`update_from_output` caches no further), and a finished request's last block as it
is freed (a preempted one's never).

Modelled: full attention, MLA, sliding-window, chunked-local and Mamba ("align") groups with
the hybrid manager on, one block size (the hash block size), and
`prefix_cache_retention_interval` (0, vLLM's default; a multiple of the block size; or None,
every block kept). Not modelled: Mamba prefill-checkpoint blocks (FlashInfer's gated delta
net on Hopper), partial (sub-block) hits. Refused (one line): the manager off, sample groups
(n > 1).
"""

from __future__ import annotations

from kvfrag.sim.allocators.base import Grant, Live, Reason, Refusal, Request
from kvfrag.sim.allocators.hybrid import HybridAllocator
from kvfrag.sim.hybrid.caching_ahead import HORIZON, LookAhead, surely_fits
from kvfrag.sim.hybrid.prefix import (
    Kind,
    PrefixState,
    aligned_split,
    block_key,
    find_kind,
    reachable,
    state_kept,
)
from kvfrag.sim.hybrid.prefix_figures import held_figures


class HybridPrefixCaching(HybridAllocator):
    """`HybridAllocator` with vLLM's prefix caching (`make_allocator` builds it for
    `prefix_caching=True`)."""

    #: The figures in a row of `_step_row`.
    _row_width = 6

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        p = self.plan
        retention = self.retention  # (its type checked by the base)
        if retention and retention % p.scheduler_block_size:
            raise ValueError(f"prefix_cache_retention_interval ({retention}) must be a multiple "
                             f"of the scheduler block size ({p.scheduler_block_size})")
        if retention and not any(g.kind in ("sliding_window", "mamba") for g in p.groups):
            raise ValueError("prefix_cache_retention_interval has no effect without sliding "
                             "window or Mamba groups: leave it 0")
        # (`retention`, vLLM's `prefix_cache_retention_interval`: 0 keeps a sliding group's
        # blocks only at replay boundaries and junctions, R > 0 also one window's blocks per
        # R tokens, None every block a hit can use)
        if not p.hybrid_manager:
            raise ValueError("the hybrid allocator models prefix caching only with "
                             "hybrid_kv_cache_manager true")
        kinds: list[Kind] = []
        for m in self.managers:
            if m.kind not in ("full", "sliding_window", "chunked_local", "mamba"):
                raise ValueError(f"the hybrid allocator does not model prefix caching with "
                                 f"{m.kind} groups yet")
            if m.block_size != p.hash_block_size or m.block_size != p.scheduler_block_size:
                raise ValueError("the hybrid allocator models prefix caching only where "
                                 "every group has one block size")
            groups = tuple(g for g, mi in enumerate(self._manager_of) if mi == len(kinds))
            kinds.append(Kind(m.kind, groups, m.block_size, m.window))
        self._kinds = kinds
        # The lookup's order: full attention first (vLLM sorts its attention groups so).
        self._order = sorted(range(len(kinds)), key=lambda i: kinds[i].kind != "full")
        self._tb = [sum(self.stack.layers[i].bytes_per_token for i in g.layers)
                    for g in p.groups]
        # Per plan group, its real layers' Mamba state (0 for attention groups).
        self._sb = [sum(getattr(self.stack.layers[i], "state_bytes", 0) for i in g.layers)
                    if g.kind == "mamba" else 0 for g in p.groups]
        self._pages = [self.page] * len(p.groups)  # (each group's id: one page size)
        self._mamba = any(k.kind == "mamba" for k in kinds)
        # Per kind, (its first group, block size, Mamba?): a decode step between block
        # boundaries and window edges changes nothing (`_quiet_step`), most steps.
        self._quiet: list[tuple[int, int, bool]] | None = [
            (k.groups[0], k.block_size, k.kind == "mamba") for k in kinds]
        self._hash_bs = p.hash_block_size
        # vLLM's `cached_blocks_this_step`: Mamba keys cached in this scheduler step (a hit on
        # one waits a step); `_grown` the requests given a chunk in it, `_admitted` whether an
        # admission came last, `_waited` whether a hit was told to wait (the engine is told
        # memory came back once the step is over).
        self._fresh: set[tuple] = set()
        self._grown: set[int] = set()
        self._admitted = False
        self._waited = False
        self._st = PrefixState(self.num_blocks, len(p.groups))
        self._sim_clock = 0  # the clock the state's decode steps have reached
        # (rid, cache version, hit, per group the hit's ids, shared-prefix junction)
        self._lookup: tuple[int, int, int, list[list[int]], int] | None = None
        self._boundary: dict[int, int] = {}  # rid -> junction its last lookup found
        self._chains: dict[int, tuple[Request, list[object]]] = {}
        self._freed_last = False  # whether the last decode step freed an id
        self._ahead: LookAhead | None = None
        self._totals_memo: tuple[int, int, tuple[int, ...]] | None = None
        # Requests preempted to make room for the next decode step, newest first, their
        # ids still held: vLLM frees each when a decoder of that step finds too few free
        # (rid, tables, tokens computed). `_room`: the state's version when the engine
        # last heard that the next step does not fit.
        self._pending: list[tuple[int, list[list[int]], int]] = []
        self._room = -1
        self._leaving: set[int] = set()  # async: decoders out of the cohort for a grow
        self._preempting = False  # async: `free_preempted` is freeing
        self.waste_split = True
        self._sums_memo: tuple[tuple[int, int, int, float, float], list[float]] | None = None
        self._decoders_memo: tuple[int, list[tuple[int, Live]]] | None = None
        self.lookups = 0
        self.hit_blocks = 0

    # ------------------------------------------------------------------ keys
    def _chain(self, req: Request) -> list[object]:
        """Per full prompt block the workload's prefix ids name: its hash chain."""
        got = self._chains.get(req.rid)
        if got is not None and got[0] is req:
            return got[1]
        bs, chunk = self._hash_bs, req.prefix_tokens
        blocks = req.prompt // bs
        out: list[object] = []
        if req.prefix and chunk >= 1:
            h: object = 0
            end = 0
            for value in req.prefix:
                if len(out) >= blocks:
                    break
                h = hash((h, value))
                end += chunk
                out.extend([h] * (min(end // bs, blocks) - len(out)))
        self._chains[req.rid] = (req, out)
        return out

    def _key(self, req: Request, chain: list[object], j: int, g: int) -> tuple:
        return block_key(req, chain, j, g)

    # ---------------------------------------------------------------- lookup
    def _find(self, req: Request, max_len: int) -> tuple[int, list[list[int]], int]:
        """vLLM's `find_longest_cache_hit` over the kinds: (hit tokens, per plan group the
        hit's ids (0 where a sliding window skips), the shared-prefix junction or 0)."""
        chain = self._chain(req)
        kinds = self._kinds
        blocks: list[list[list[int]] | None] = [None] * len(kinds)
        lengths = [0] * len(kinds)
        hit, longest = max(0, max_len), 0
        simple = len(kinds) == 2 and kinds[self._order[0]].kind == "full"
        while True:
            curr = hit
            for ki in self._order:
                k = kinds[ki]
                if k.kind == "full" and blocks[ki] is not None:
                    curr = min(curr, lengths[ki])
                    continue
                blocks[ki], curr = find_kind(self._st.pool, req, chain, k, curr)
                lengths[ki] = curr
                longest = max(longest, curr)
            if curr >= hit:
                break
            hit = curr
            if simple:
                break
        per_group: list[list[int]] = [[] for _ in self.plan.groups]
        for ki, k in enumerate(kinds):
            found = blocks[ki]
            assert found is not None
            keep = -(-hit // k.block_size) if k.kind == "full" else len(found[0])
            for g, lst in zip(k.groups, found, strict=True):
                per_group[g] = lst[:keep]
        uncached = longest - hit
        return hit, per_group, hit + uncached if uncached else 0

    def cached_prefix_tokens(self, req: Request, tokens: int | None = None) -> int:
        """vLLM's `get_computed_blocks`: the hit every kind agrees on, capped at the tokens
        to prefill less one (a resumed request's output included)."""
        self._flush()
        tokens = req.prompt if tokens is None else tokens
        hit, ids, boundary = self._find(req, tokens - 1)
        self._lookup = (req.rid, self._version, hit, ids, boundary)
        self._boundary[req.rid] = boundary
        return hit

    def _looked_up(self, req: Request, tokens: int) -> tuple[int, list[list[int]], int]:
        got = self._lookup
        if got is not None and got[0] == req.rid and got[1] == self._version and got[2] < tokens:
            return got[2], got[3], got[4]
        hit, ids, boundary = self._find(req, tokens - 1)
        self._boundary[req.rid] = boundary
        return hit, ids, boundary

    def _need_new(self, req: Request, tokens: int, ids: list[list[int]], hit: int,
                  cap: bool) -> int:
        """vLLM's `get_num_blocks_to_allocate` for a request not running yet: blocks past
        the hit (and past a sliding window's skipped ones), plus hit ids nobody holds."""
        ref, need = self._st.pool.ref, 0
        for g, found in enumerate(ids):
            m = self.managers[self._manager_of[g]]
            k = self._kinds[self._manager_of[g]]
            required = -(-tokens // m.block_size)
            if k.kind == "mamba":
                # One new state block at most, plus the hit's if idle; a hit on a state
                # cached in this step waits a step (vLLM asks for more blocks than exist).
                if found and self._key(req, self._chain(req), len(found) - 1,
                                       g) in self._fresh:
                    self._waited = True
                    return self.num_blocks + 1
                need += min(required - len(found), 1)
                need += sum(1 for b in found if b and not ref[b])
                continue
            if cap and m.cap is not None:
                required = min(required, m.cap)
            skipped = k.skipped(hit)
            need += max(required - max(skipped, len(found)), 0)
            need += sum(1 for b in found[skipped:] if b and not ref[b])
        return need

    def admission_bytes(self, req: Request, tokens: int, hit: int) -> int:
        """vLLM's full-sequence gate with the hit: each group's blocks for the whole sequence
        (sliding ones capped) past the hit, the idle hit blocks revived, plus the pool's
        unusable tail (see `HybridAllocator.admission_bytes`)."""
        self._flush()
        found, ids, _ = self._looked_up(req, hit + 1)
        tail = (self.capacity - self.num_blocks * self.page) // self.page
        need = self._need_new(req, min(tokens, self.max_model_len), ids, found, True)
        return (need + tail) * self.page

    def bytes_for(self, req: Request, tokens: int) -> int:
        """`HybridAllocator.bytes_for`, a Mamba group in mode "align" holding two state blocks
        at most (the current one and, until the next allocation, the previous one)."""
        if not self._mamba:
            return super().bytes_for(req, tokens)
        blocks = 0
        for m in self.managers:
            need = -(-tokens // m.block_size)
            if m.kind == "mamba":
                need = min(need, 2)
            elif m.cap is not None:
                need = min(need, m.cap)
            blocks += m.groups * need
        return blocks * self.page

    def aligned_chunk(self, req: Request, start: int, chunk: int, total: int,
                      limit: int) -> int:
        """vLLM's `_mamba_block_aligned_split` in mode "align" (`prefix.aligned_split`), at
        the shared-prefix junction `req`'s lookup found; 0: not this step."""
        if not self._mamba:
            return chunk
        return aligned_split(req.prompt, start, chunk, total, limit, self.plan.block_size,
                             self._boundary.get(req.rid, 0))

    def idle_cached_blocks(self) -> int:
        self._flush()
        return len(self._st.pool.idle)

    def take_evictions(self) -> list[int]:
        self._flush()
        evicted = self._st.pool.evicted
        self._st.pool.evicted = []
        return evicted

    def _cache(self, st: PrefixState, req: Request, tokens: int) -> None:
        """vLLM's `cache_blocks`: each group's newly full blocks join the cache. Blocks the
        prefix ids name count as a free for the engine (`frees`): a waiting request refused
        for memory may now find more cached and need fewer blocks."""
        rid = req.rid
        chain = self._chain(req)
        done = st.ncached[rid]
        named = False
        # (what a hit can use: the retention, the scheduler block, the lookup's junction)
        where = (self.retention, self.plan.scheduler_block_size, st.boundary.get(rid, 0))
        # kind -> (first block, the blocks from it a hit can use: alike for its groups)
        kept: dict[int, tuple[int, list[int]]] = {}
        insert, kinds, kind_of = st.pool.insert, self._kinds, self._manager_of
        chained, own = len(chain), ("own", rid)  # (`block_key`, inlined)
        for g, table in enumerate(st.tables[rid]):
            ki = kind_of[g]
            k = kinds[ki]
            full = tokens // k.block_size
            start = done[g]
            if start >= full:
                continue
            mamba = k.kind == "mamba"
            got = kept.get(ki)
            if got is None or got[0] != start:  # (sliding and Mamba: the blocks a hit uses)
                usable = (state_kept if mamba else reachable
                          if k.kind == "sliding_window" else None)
                got = kept[ki] = (start, list(range(start, full)) if usable is None else
                                  [j for j in range(start, full) if usable(req, k, j, *where)])
            for j in got[1]:
                b = table[j]
                if not b:
                    continue
                key = (chain[j] if j < chained else own, j, g)
                insert(key, b)
                named = named or j < chained
                if mamba and st is self._st:
                    self._fresh.add(key)
            done[g] = full
        if named and st is self._st:
            self.frees += 1

    # ------------------------------------------------------------ operations
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        req = live.req
        rid = req.rid
        if req.n > 1:
            raise ValueError(
                f"request {rid}: the hybrid allocator does not model sample groups (n > 1) yet"
            )
        most = (self.bytes_for(req, tokens) // self.page if self._mamba
                else self._blocks(tokens, 0))
        if most > self.num_blocks:
            return Refusal(rid, Reason.TOO_LARGE, most * self.page,
                           self.free_bytes(), "needs more blocks than exist")
        self._flush()
        self._admitted = True
        hit, ids, boundary = self._looked_up(req, tokens)
        st = self._st
        need = self._need_new(req, tokens, ids, hit, False)
        if need > st.pool.free_count():
            return Refusal(rid, Reason.OUT_OF_MEMORY, need * self.page, self.free_bytes())
        new = self._install(live, tokens, hit, ids, boundary)
        return Grant(rid, need * self.page, live.cap, blocks=tuple(new))

    def _install(self, live: Live, tokens: int, hit: int, ids: list[list[int]],
                 boundary: int) -> list[int]:
        """An admission that fits: its tables start with the hit's ids (revived, the blocks
        its windows skip null), grow to `tokens` slots and cache what they filled; the new
        ids."""
        req, st = live.req, self._st
        rid = req.rid
        self.lookups += (tokens - 1) // self._hash_bs
        self.hit_blocks += hit // self._hash_bs
        st.boundary[rid] = boundary
        tables: list[list[int]] = []
        ref = st.pool.ref
        shares = False  # (whether it hit an id some request holds)
        for g, found in enumerate(ids):
            skipped = self._kinds[self._manager_of[g]].skipped(hit)
            kept = found[skipped:]
            shares = shares or any(b and ref[b] for b in kept)
            st.pool.touch(kept)
            tables.append([0] * skipped + kept)
        st.tables[rid] = tables
        st.ncached[rid] = [len(t) for t in tables]
        st.quiet.pop(rid, None)
        if shares:
            st.hits[rid] = max(map(len, ids))
        else:
            st.hits.pop(rid, None)
        if self._mamba:
            st.mamba[rid] = [0, -1, 0]
        new = self._take(st, rid, tokens)
        self._cache(st, req, tokens)
        self._proc[rid] = hit
        self._last_n[rid] = tokens - hit
        live.cached = hit
        self._changed()
        return new

    def _take(self, st: PrefixState, rid: int, tokens: int) -> list[int]:
        """Each group's table grown to `tokens` slots (vLLM's `allocate_new_blocks`)."""
        new: list[int] = []
        sizes = [-(-tokens // k.block_size) for k in self._kinds]
        if not self._mamba:  # (one take for every group: the same ids in the same order)
            kind_of = self._manager_of
            grown = []
            for g, table in enumerate(st.writable(rid)):
                more = sizes[kind_of[g]] - len(table)
                if more > 0:
                    grown.append((table, more))
            if grown:
                new = st.pool.take(sum(more for _, more in grown))
                i = 0
                for table, more in grown:
                    table.extend(new[i:i + more])
                    i += more
            self.evictions = self._st.pool.evictions
            return new
        for g, table in enumerate(st.writable(rid)):
            k = self._kinds[self._manager_of[g]]
            if k.kind == "mamba":
                got = st.mamba_take(table, st.mamba[rid], k.block_size, tokens)
            else:
                more = sizes[self._manager_of[g]] - len(table)
                if more <= 0:
                    continue
                got = st.pool.take(more)
                table.extend(got)
            new.extend(got)
        evictions = self._st.pool.evictions
        if evictions != self.evictions and self._mamba:
            # An eviction can shorten a waiting request's hit and move the junction its
            # first chunk stops at (`aligned_chunk`): a smaller chunk may fit where the
            # longer hit did not. For the engine's FCFS head it counts as a free.
            self.frees += 1
        self.evictions = evictions
        return new

    def _wanted(self, st: PrefixState, rid: int, tokens: int) -> int:
        sizes = [-(-tokens // k.block_size) for k in self._kinds]
        kind_of = self._manager_of
        need = 0
        for g, t in enumerate(st.tables[rid]):
            more = sizes[kind_of[g]] - len(t)
            if more > 0:
                need += 1 if self._kinds[kind_of[g]].kind == "mamba" else more
        return need

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        self._flush()
        rid, st = live.req.rid, self._st
        if self._admitted or rid in self._grown:  # a chunk of the next scheduler step
            self._next_step()
        self._grown.add(rid)
        # vLLM frees the skipped blocks before it checks, refused or not (async: by the tokens
        # processed).
        proc = max(0, old - self.in_flight_now) if self._lag else old
        st.remove_skipped(rid, self._kinds, self._manager_of, proc)
        self._changed()
        short, nbytes = self._grow_bytes(st, rid, new)
        if short:
            return Refusal(rid, Reason.OUT_OF_MEMORY, short, self.free_bytes())
        ids = self._take(st, rid, new)
        # (a decoder's new token is in flight: not known, not cached yet)
        self._cache(st, live.req, new - self._lag if rid in self._leaving else new)
        self._proc[rid] = proc
        self._last_n[rid] = new - old
        return Grant(rid, nbytes, live.cap, blocks=tuple(ids))

    def _grow_bytes(self, st: PrefixState, rid: int, tokens: int) -> tuple[int, int]:
        """Growing `rid`'s tables to `tokens` slots: (the bytes it lacks, 0 if it fits; the
        bytes it takes)."""
        need = self._wanted(st, rid, tokens)
        if need > st.pool.free_count():
            return need * self.page, 0
        return 0, need * self.page

    def free_preempted(self, rid: int, processed: int) -> int:
        self._preempting = True  # (async: its tokens in flight are never cached)
        try:
            return self.free(rid)
        finally:
            self._preempting = False

    def _release(self, live: Live) -> None:
        rid = live.req.rid
        if self._lag and not self._preempting and live.base >= live.final:
            # Async: done, its last step's output applied: vLLM's `update_from_output` caches
            # the blocks of all its tokens before it frees them.
            self._cache(self._st, live.req, live.base)
        self._next_step()
        if self._room == self._version and live.base < live.final:
            # A preemption that makes room for the next decode step: vLLM frees it within
            # that step, when a decoder first finds too few free blocks.
            # (the tokens its allocation in that step would free by: async, those processed)
            processed = live.base
            if self._lag:
                processed = self._proc.get(rid, live.base) if rid in self._leaving else max(
                    0, live.base - self._last_n.get(rid, 0))
            self._pending.append((rid, self._st.detach(rid), processed))
        else:
            self._flush()
            self._st.release(rid)
        self._proc.pop(rid, None)
        self._joined.pop(rid, None)
        self._boundary.pop(rid, None)
        self._last_n.pop(rid, None)
        self._first.pop(rid, None)
        self._leaving.discard(rid)
        self._changed()

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        rid = live.req.rid
        self._st.quiet.pop(rid, None)  # (async: its first step frees by other tokens)
        if decoding:
            self._joined[rid] = self._clock
            if self._lag:  # its first step frees by the tokens before its last allocation
                self._first[rid] = live.base + self._clock - self._last_n.get(rid, 1)
                self._leaving.discard(rid)
        else:
            joined = self._joined.pop(rid, None)
            if self._lag and joined is not None:
                # what its next allocation frees by (`_release`'s victims; a grow is told)
                self._proc[rid] = (self._first[rid] if joined == self._clock
                                   else live.base - 1)
                if joined != self._clock:
                    self._last_n[rid] = 1
                self._leaving.add(rid)
            if self._room == self._version:  # (a free follows: the room is still wanted)
                self._room += 1
        self._changed()

    # ------------------------------------------------------------ decode steps
    def _step(self, st: PrefixState, clock: int,
              victims: list[tuple[int, list[list[int]], int]] | None = None) -> int:
        """Apply the decode step that brings the clock to `clock` to `st`, decoder after
        decoder in the running order, as vLLM's scheduler does: each frees the blocks its
        window left, then takes its new ones; one that finds too few free frees the next
        of `victims` (preempted for this step, newest first) and tries again. Returns -1,
        or the rank of a decoder that found too few free with no victim left (the step
        stops there). Counts the ids it freed in `st`."""
        queue = list(victims or ())
        before = st.pool.free_count()
        taken = 0
        quiet = self._quiet
        decoders = self._decoders()
        for rank in st.due(decoders, clock):  # (skipping those known quiet: most are)
            rid, live = decoders[rank]
            tokens = live.base + clock
            processed = tokens - 1  # (async: less the token in flight; the first step, the
            if self._lag:  # final chunk)
                processed = (self._first[rid] if self._joined[rid] == clock - 1
                             else tokens - 2)
            if quiet is not None and self._quiet_step(st, rid, tokens, quiet, processed):
                st.note_quiet(rid, tokens, processed, quiet, self._kinds, self._manager_of,
                              self._lag)
                continue
            st.remove_skipped(rid, self._kinds, self._manager_of, processed)
            need = self._wanted(st, rid, tokens)
            while need > st.pool.free_count():
                if not queue:
                    st.freed = st.pool.free_count() + taken - before
                    return rank
                st.free_tables(queue.pop(0)[1])
            taken += need
            self._take(st, rid, tokens)
            if st.pool.cache is not None:
                self._cache(st, live.req, tokens - self._lag)
        st.victims_turn(queue, self._kinds, self._manager_of)
        st.freed = st.pool.free_count() + taken - before
        return -1

    def _quiet_step(self, st: PrefixState, rid: int, tokens: int,
                    quiet: list[tuple[int, int, bool]], processed: int) -> bool:
        """Whether a decode step to `tokens` frees, takes and caches nothing for the request
        (most steps), judged on each kind's first group (the others' tables are alike): no
        new block, none newly full, no Mamba state retired, and a sliding or chunked table
        whose last skipped block is already the null block (what
        `PrefixState.remove_skipped` checks first). A look-ahead's copy caches nothing, so
        there a newly full block does not count."""
        tables, ncached = st.tables[rid], st.ncached[rid]
        lag = self._lag
        caching = st.pool.cache is not None
        for g, bs, mamba in quiet:
            table = tables[g]
            if -(-tokens // bs) > len(table) or (caching and (tokens - lag) // bs > ncached[g]):
                return False
            if mamba:
                retired, last_state = st.mamba[rid][0], st.mamba[rid][1]
                if (processed - 1) // bs > retired or (
                        0 <= last_state < -(-processed // bs) - 1 and table[last_state]):
                    return False
                continue
            k = self._kinds[self._manager_of[g]]
            if k.kind != "full":
                skip = min(k.skipped(processed), len(table))
                if skip and table[skip - 1]:
                    return False
        return True

    def _decoders(self) -> list[tuple[int, Live]]:
        """The decoding requests in the running order (kept while the version stays)."""
        memo = self._decoders_memo
        if memo is not None and memo[0] == self._version:
            return memo[1]
        got = [(rid, live) for rid, live in self._live.items() if live.decoding]
        self._decoders_memo = (self._version, got)
        return got

    def _flush(self) -> None:
        """Free the preempted requests no decode step freed (every decoder was preempted)."""
        if self._pending:
            pending, self._pending = self._pending, []
            self._st.victims_turn(pending, self._kinds, self._manager_of)
            self.evictions = self._st.pool.evictions
            self._changed()

    def _next_step(self) -> None:
        """A new scheduler step began: no Mamba state was cached in it yet (a hit told to wait
        may go now: counted as a free, for the engine's FCFS head)."""
        self._fresh.clear()
        self._grown.clear()
        self._admitted = False
        if self._waited:
            self._waited = False
            self.frees += 1

    def _stepped(self) -> None:
        if self._sim_clock < self._clock:
            self._next_step()
        while self._sim_clock < self._clock:
            self._sim_clock += 1
            pending, self._pending = self._pending, []
            failed = self._step(self._st, self._sim_clock, pending)
            assert failed < 0, "a decode step past steps_until_full"
            self._freed_last = bool(self._st.freed)
        self.evictions = self._st.pool.evictions
        self._changed()

    def _look_ahead(self) -> LookAhead:
        """The look-ahead from the clock and state of now (`sim.hybrid.caching_ahead`)."""
        memo = self._ahead
        if memo is None or memo.clock != self._clock or memo.version != self._version:
            memo = self._ahead = LookAhead(self)
        return memo

    def _full(self, steps: int) -> int | None:
        """steps_until_full once it is at most `steps` (else None: more), walking no
        further; 0 tells the engine's preemptions that the next step wants room."""
        ahead = self._look_ahead()
        ahead.walk(self, steps, False)
        if ahead.full == 0:
            self._room = self._version
        return ahead.full

    def can_step(self) -> bool:
        return self._surely_fits(1) or self._full(1) != 0

    def steps_until_full(self) -> int | None:
        return self._full(HORIZON)

    def steps_until_full_within(self, limit: int) -> int | None:
        done = self.steps_until_done()
        if done is None:
            return None
        if limit <= min(done, HORIZON) and self._surely_fits(max(limit, 1)):
            return limit
        full = self._full(max(limit, 1))
        return limit if full is None or full >= limit else full

    def _surely_fits(self, steps: int) -> bool:
        """Whether the next `steps` decode steps fit, told without walking them (False: not
        told; `caching_ahead.surely_fits`)."""
        return surely_fits(self, steps)

    def steps_until_shrink(self) -> int | None:
        if (self._freed_last and self._joined) or self._waited:
            return 1
        return self._look_ahead().until_shrink(self)

    # --------------------------------------------------------------- figures
    def _figures(self, st: PrefixState, clock: int) -> tuple[int, int, int, int, int]:
        """(ids in use, token_states, reserved, padding, out_of_window) of `st` at `clock`
        (`sim.hybrid.prefix_figures`)."""
        return (st.held(), *held_figures(st, self._live, clock, self._kinds, self._manager_of,
                                         self._tb, self._sb, self._pages, self._apart(st)))

    def _apart(self, st: PrefixState) -> bool:
        """Whether requests preempted for the next step hold ids outside `st`'s tables."""
        return st is self._st and bool(self._pending)

    def _totals_at(self, st: PrefixState, clock: int) -> tuple[int, ...]:
        """(blocks, token_states, reserved, internal, padding, out_of_window) of `st` at
        `clock`."""
        blocks, token_states, reserved, padding, out = self._figures(st, clock)
        internal = blocks * self.page - token_states - reserved
        return blocks, token_states, reserved, internal, padding, out

    def _step_row(self, st: PrefixState, clock: int) -> tuple[int, ...]:
        """What `_sums` weighs at each step it looks ahead: the totals."""
        return self._totals_at(st, clock)

    def _totals(self) -> tuple[int, ...]:
        # (no flush: `step` asks the bytes in use between the engine's preemptions for a
        # step and the step, which frees them; kept while the state and clock stay: the
        # engine asks the parts, then the waste, of one instant)
        memo = self._totals_memo
        if memo is not None and memo[0] == self._clock and memo[1] == self._version:
            return memo[2]
        totals = self._totals_at(self._st, self._clock)
        self._totals_memo = (self._clock, self._version, totals)
        return totals

    def _allocated_total(self) -> int:
        return self._st.held() * self.page  # (`_figures`' first: no flush, no walk)

    def free_blocks(self) -> int:
        self._flush()
        return self._st.pool.free_count()

    def group_blocks(self) -> tuple[int, ...]:
        """Per plan group, the ids in the requests' tables (an id two requests hold counts
        twice, as vLLM's managers count their tables)."""
        self._flush()
        return self._st.blocks_per_group(self._manager_of,
                                         [k.kind != "mamba" for k in self._kinds])

    def blocks_of(self, rid: int) -> int:
        self._get(rid)
        return sum(len(t) - t.count(0) for t in self._st.tables.get(rid, ()))

    def group_tables(self, rid: int) -> list[tuple[int, ...]]:
        self._get(rid)
        return [tuple(t) for t in self._st.tables.get(rid, ())]

    def block_table(self, rid: int) -> tuple[int, ...]:
        self._get(rid)
        return tuple(b for t in self._st.tables.get(rid, ()) for b in t if b)

    def waste_breakdown(self) -> dict[str, int]:
        _, _, _, internal, padding, out = self._totals()
        return {"overreservation": 0, "padding": padding, "out_of_window": out,
                "rounding": internal - padding - out}

    def waste_parts(self) -> tuple[int, int]:
        totals = self._totals()
        return totals[4], totals[5]

    def waste_integrals(self, n: int, w0: float, w1: float) -> tuple[float, float]:
        sums = self._sums(n, w0, w1)
        return sums[4], sums[5]

    def _sums(self, n: int, w0: float, w1: float) -> list[float]:
        """Over the next n decode steps (each weighed w0 + w1 (j - 1)), the weighted sums of
        each step's row (`_step_row`: blocks, token_states, reserved, internal, padding,
        out_of_window), stepped on a copy of the state; the last answer kept (the engine asks
        the parts, then the waste, of one stretch)."""
        key = (self._clock, self._version, n, w0, w1)
        memo = self._sums_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        self._flush()
        st = self._st.light_copy()
        sums = [0.0] * self._row_width
        for j in range(1, n + 1):
            failed = self._step(st, self._clock + j)
            assert failed < 0, "integrals past steps_until_full"
            w = w0 + w1 * (j - 1)
            for i, x in enumerate(self._step_row(st, self._clock + j)):
                sums[i] += x * w
        self._sums_memo = (key, sums)
        return sums

    def integrals(
        self, n: int, probe: Request | None, w0: float, w1: float
    ) -> tuple[float, float, float, float, float, float]:
        sums = self._sums(n, w0, w1)
        weight = n * w0 + w1 * n * (n - 1) / 2
        external = (self.capacity - self.num_blocks * self.page) * weight
        usable = self.num_blocks * self.page * weight - sums[0] * self.page
        return (sums[1], sums[2], sums[3], external, usable, 0.0)

    def summary_stats(self) -> dict[str, float | int]:
        self._flush()
        stats = super().summary_stats()
        stats.update({
            "prefix_lookup_blocks": self.lookups,
            "prefix_hit_blocks": self.hit_blocks,
            "prefix_hit_rate_blocks": self.hit_blocks / self.lookups if self.lookups else 0.0,
            "prefix_evictions": self.evictions,
            "prefix_cached_blocks": len(self._st.pool.keys),
        })
        return stats


__all__ = ["HORIZON", "HybridPrefixCaching"]
