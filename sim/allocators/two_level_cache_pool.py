"""The `two-level` pool with prefix caching: Jenga's layer-aware caching (SOSP'25, arXiv
2503.18292) over `two_level_pool`'s two levels, with vLLM 0.33's block-pool rules
(`kvfrag.sim.hybrid.prefix.BlockPool`) where a large page is one block.

A small page of type t (id `large * per[t] + slot`, as in `TwoLevelPool`) is, at any time,
*held* (a reference count > 0: one per request whose table has it; a hit shares it), *idle
cached* (no holder, kept under its keys for a later hit) or *free* (a bit of its large page's
mask). Keys are the allocator's (a type's blocks are cached, found and evicted apart from the
other types'), each key naming ids of its own type, oldest first. A large page goes back to
the shared pool only once all its small pages are free and uncached; a large page that no
request holds a page of but that keeps idle cached ones is *evictable*: all of it can be given
to any type, its idle pages evicted at once.

Eviction order (`take` of type t, request-aware as `TwoLevelPool.take`):

1. a free slot of the large page of the request's own last page of type t (`hint`), if held;
2. else a free slot of the lowest-numbered held large page of type t;
3. else the least recently freed idle cached page of type t in a held large page, evicted
   (its large page cannot go back to the shared pool while another page of it is held, so
   its idle pages are the cheapest to lose: reusing them strands nothing);
4. else a free slot of the lowest-numbered evictable large page of type t (no eviction);
5. else a fresh large page off the shared pool (`FreeIds`, as `TwoLevelPool`);
6. else the evictable large page least recently made evictable (its last held page freed),
   every idle page of it evicted (in slot order), handed to type t whole.

Steps 1-3 use what only type t can use before any large page, so that `large_needed` is
exact: a need of n_t pages per type fits iff sum_t ceil((n_t - local_t) / per_t) large pages,
local_t = free slots and idle pages of type t in held large pages, are at most the free and
evictable large pages together (whichever order the types take in). With one small page per
large page (vLLM's constraints: `vllm_groups`), steps 1-4 never apply and steps 5-6 are
exactly vLLM's free queue: uncached ids freed last first, never-used ids in order, then
cached ids least recently freed first.

Room: that order loses hits while memory is plentiful where a large page holds several small
pages of a type (a shared prompt's pages evicted in place, fresh large pages free). So an
allocation that fits says what it needs (`allow`): its *room* is the usable large pages it
leaves over. While the room is r > 0, a type whose idle pages in held large pages are fewer
than r large pages hold (0 < idle_t < r * per_t) runs steps 4-5 before step 3, each such
large page spending one of the room; past that, or with no spare or fresh large page, step 3
comes first again. Fits stay exact: a step 4-5 taken before step 3 costs at most one large
page beyond `large_needed` (none where the type needs a large page anyway), the room counts
it, so the allocation still fits. The bound keeps the idle pages a type strands in large pages
that a few held pages pin (only its type can use them) below the memory left over: as the
pool fills, the room shrinks and the order is the one above (an attention type whose large
page holds 201 pages, left free to open large pages, would strand what a Mamba type needs).
Without `allow` (room 0, as with `vllm_groups`) the order is the one above.

Accounting (for the allocator): held small pages are in use; a free or evictable large page is
usable free memory (any type of the next request can have it whole); free slots and idle
cached pages inside held large pages are usable by their type alone, so external, as the
stranded slots of `TwoLevelPool`.

No journal: a look-ahead works on a `light_copy` (as `HybridPrefixCaching` copies its state),
whose small pages' dicts are overlays on this pool's.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Hashable

from kvfrag.sim.allocators.paged import FreeIds
from kvfrag.sim.hybrid.overlay import Overlay


class TwoLevelCachePool:
    """Large pages split into small pages per type, with reference counts, per-type caches and
    eviction (see the module)."""

    def __init__(self, large_pages: int, per: list[int], null_page: bool) -> None:
        self.large_pages = large_pages
        self.per = list(per)
        self.free_large = FreeIds(large_pages)
        if null_page:  # (vLLM's null block)
            self.free_large.pop()
        self.usable = len(self.free_large)
        n = len(per)
        self.owner: dict[int, int] = {}  # large page -> its type (absent: in the shared pool)
        self.mask: dict[int, int] = {}  # large page -> bit mask of its free slots
        self.held: dict[int, int] = {}  # large page -> its held small pages
        self.idle_slots: dict[int, int] = {}  # large page -> bit mask of its idle cached slots
        self.partly: list[set[int]] = [set() for _ in per]  # held, with a free slot
        self.spare: list[set[int]] = [set() for _ in per]  # evictable, with a free slot
        self.free_small = [0] * n  # per type: free slots in its held large pages
        self.npinned = [0] * n  # per type: idle cached pages in its held large pages
        # per type: a heap of (stamp, small page) over its idle pages in held large pages,
        # stale entries skipped (valid while `stamp[t][sid]` is that stamp and the large
        # page is held)
        self.pinned: list[list[tuple[int, int]]] = [[] for _ in per]
        self.evictable: dict[int, None] = {}  # large pages, least recently made evictable first
        self.ref: list[dict[int, int]] = [{} for _ in per]  # small page -> holders (held ones)
        self.stamp: list[dict[int, int]] = [{} for _ in per]  # idle small page -> when freed
        self.keys: list[dict[int, list[Hashable]]] = [{} for _ in per]  # cached page -> keys
        # per type: key -> small pages cached under it, oldest first (None: `light_copy`)
        self.cache: list[dict[Hashable, dict[int, None]]] | None = [{} for _ in per]
        # large pages the allocation under way may spend beyond its need (`allow`)
        self.room = 0
        self.clock = 0  # stamps
        self.evictions = 0
        self.evicted: list[tuple[int, int]] = []  # (type, small page) evicted, oldest first

    def copy(self) -> TwoLevelCachePool:
        """An independent copy."""
        return copy.deepcopy(self)

    def light_copy(self) -> TwoLevelCachePool:
        """A copy that takes, frees and evicts as this pool does but keeps no cache (`cache`
        None: nothing is looked up or inserted in it): what a look-ahead needs, at the cost
        of copying the large pages' states, not the keys' tables; the small pages' counts,
        stamps and keys are overlays (`sim.hybrid.overlay`: this pool must not change while
        the copy is used)."""
        other = TwoLevelCachePool.__new__(TwoLevelCachePool)
        other.__dict__.update(self.__dict__)
        other.free_large = copy.copy(self.free_large)
        # (every chunk copied: `FreeIds.give` trims the top chunk in place)
        other.free_large.chunks = [list(c) for c in self.free_large.chunks]
        for name in ("owner", "mask", "held", "idle_slots", "evictable"):
            setattr(other, name, dict(getattr(self, name)))
        for name in ("ref", "stamp", "keys"):  # (large: their changes kept apart)
            setattr(other, name, [Overlay(d) for d in getattr(self, name)])
        other.partly = [set(s) for s in self.partly]
        other.spare = [set(s) for s in self.spare]
        other.pinned = [list(h) for h in self.pinned]
        other.free_small, other.npinned = list(self.free_small), list(self.npinned)
        other.cache, other.evicted = None, []
        return other

    # ----------------------------------------------------------------- queries
    def free_large_pages(self) -> int:
        return len(self.free_large)

    def usable_large_pages(self) -> int:
        """Large pages any type can have whole: free and evictable ones."""
        return len(self.free_large) + len(self.evictable)

    def held_large_pages(self) -> int:
        """Large pages holding a held small page."""
        return len(self.owner) - len(self.evictable)

    def local(self, t: int) -> int:
        """Small pages only type t can take: free slots and idle pages of its held large
        pages."""
        return self.free_small[t] + self.npinned[t]

    def large_needed(self, need: list[int]) -> int:
        """Large pages `need[t]` more small pages of each type would take (exact: see the
        module)."""
        total = 0
        for t, n in enumerate(need):
            short = n - self.free_small[t] - self.npinned[t]
            if short > 0:
                per = self.per[t]
                total += (short + per - 1) // per
        return total

    def fits(self, need: list[int]) -> bool:
        return self.large_needed(need) <= self.usable_large_pages()

    def allow(self, need: list[int]) -> None:
        """Room for an allocation of `need[t]` pages per type that fits: the usable large
        pages it leaves over, which its takes may spend instead of evicting in place (reset
        to 0 once it is done: `take` then keeps the module's order)."""
        self.room = self.usable_large_pages() - self.large_needed(need)
        assert self.room >= 0, ("room for an allocation that does not fit", need)

    def is_cached(self, t: int, sid: int) -> bool:
        return sid in self.keys[t]

    def lookup(self, t: int, key: Hashable) -> int:
        """The oldest small page of type t cached under `key`, or -1."""
        assert self.cache is not None
        ids = self.cache[t].get(key)
        return next(iter(ids)) if ids else -1

    # ------------------------------------------------------------------ changes
    def take(self, t: int, hint: int) -> int:
        """One small page of type t, held once (the eviction order of the module); -1 when
        none can be had."""
        per = self.per[t]
        lid = -1
        if hint >= 0:
            h = hint // per
            if self.mask.get(h, 0) and self.owner.get(h, -1) == t and self.held[h]:
                lid = h
        if lid < 0 and self.partly[t]:
            lid = min(self.partly[t])
        if lid < 0 and self._opens(t):  # (room: steps 4-5 before step 3)
            self.room -= 1
        elif lid < 0:
            sid = self._pinned_lru(t)
            if sid >= 0:  # step 3: evicted and reused in place
                h = sid // per
                self._uncache(t, sid)
                self.evictions += 1
                self.evicted.append((t, sid))
                self.idle_slots[h] &= ~(1 << (sid % per))
                self.npinned[t] -= 1
                self.held[h] += 1
                self.ref[t][sid] = 1
                return sid
        if lid < 0 and self.spare[t]:  # step 4: an evictable page of type t, held again
            lid = min(self.spare[t])
            self._hold(lid)
        if lid < 0:
            if len(self.free_large):  # step 5
                lid = self.free_large.pop()
            elif self.evictable:  # step 6
                lid = next(iter(self.evictable))
                self._evict_large(lid)
            else:
                return -1
            self.owner[lid] = t
            self.mask[lid] = (1 << per) - 1
            self.held[lid] = 0
            self.idle_slots[lid] = 0
            self.free_small[t] += per
        mask = self.mask[lid]
        bit = mask & -mask
        mask ^= bit
        self.mask[lid] = mask
        self.held[lid] += 1
        self.free_small[t] -= 1
        if mask:
            self.partly[t].add(lid)
        else:
            self.partly[t].discard(lid)
        sid = lid * per + bit.bit_length() - 1
        self.ref[t][sid] = 1
        return sid

    def take_many(self, t: int, n: int, hint: int, out: list[int]) -> bool:
        """`n` small pages of type t onto `out`, each hinted by the one before; False, part
        done, when the pool runs short."""
        for _ in range(n):
            sid = self.take(t, hint)
            if sid < 0:
                return False
            out.append(sid)
            hint = sid
        return True

    def touch(self, t: int, ids: list[int]) -> None:
        """A hit: one more holder of each small page (cached ones), reviving idle ones."""
        per = self.per[t]
        ref, stamp = self.ref[t], self.stamp[t]
        for sid in ids:
            if sid < 0:
                continue
            if sid in ref:
                ref[sid] += 1
                continue
            assert sid in stamp, ("a hit on a page that is neither held nor idle", t, sid)
            lid, slot = divmod(sid, per)
            del stamp[sid]
            self.idle_slots[lid] &= ~(1 << slot)
            if self.held[lid]:
                self.npinned[t] -= 1  # (it was pinned)
            else:
                self._hold(lid)  # (pins the other idle pages of its large page)
            self.held[lid] += 1
            ref[sid] = 1

    def free(self, t: int, ids: list[int]) -> int:
        """One holder fewer of each small page (in the order given, as vLLM frees a table
        last first); a page left without holders goes idle if cached, else its slot is free;
        a large page left with neither held nor idle pages goes back to the shared pool (in
        the order they empty, one `FreeIds.give`). Returns the pages left without holders."""
        per = self.per[t]
        ref, stamp = self.ref[t], self.stamp[t]
        emptied: list[int] = []
        freed = 0
        for sid in ids:
            left = ref[sid] - 1
            if left:
                ref[sid] = left
                continue
            del ref[sid]
            freed += 1
            lid, slot = divmod(sid, per)
            held = self.held[lid] - 1
            self.held[lid] = held
            if sid in self.keys[t]:
                self.clock += 1
                stamp[sid] = self.clock
                self.idle_slots[lid] |= 1 << slot
                self.npinned[t] += 1
                if held:
                    heapq.heappush(self.pinned[t], (self.clock, sid))
                else:
                    self._release(lid)
            else:
                mask = self.mask[lid] | 1 << slot
                self.mask[lid] = mask
                if held:
                    self.free_small[t] += 1
                    self.partly[t].add(lid)
                elif self.idle_slots[lid]:
                    self.free_small[t] += 1  # (taken off again by `_release`)
                    self._release(lid)
                else:
                    self.free_small[t] -= per - 1  # (its other slots were counted free)
                    self.partly[t].discard(lid)
                    self._drop(lid)
                    emptied.append(lid)
        if emptied:
            self.free_large.give(emptied)
        return freed

    def insert(self, t: int, key: Hashable, sid: int) -> None:
        """Cache small page `sid` of type t (held) under `key`."""
        assert sid in self.ref[t], ("only a held page is cached", t, sid)
        assert self.cache is not None
        ids = self.cache[t].setdefault(key, {})
        if sid not in ids:
            ids[sid] = None
            self.keys[t].setdefault(sid, []).append(key)

    # ---------------------------------------------------------------- internals
    def _opens(self, t: int) -> bool:
        """Whether type t, out of free slots, takes a spare or fresh large page (steps 4-5)
        before evicting in place (step 3): while the allocation has room and its idle pages in
        held large pages are fewer than `room` large pages hold (see the module)."""
        return (0 < self.npinned[t] < self.per[t] * self.room
                and bool(self.spare[t] or len(self.free_large)))

    def _pinned_lru(self, t: int) -> int:
        """The least recently freed idle page of type t in a held large page, or -1 (stale
        heap entries dropped on the way)."""
        heap, stamp, per = self.pinned[t], self.stamp[t], self.per[t]
        while heap:
            when, sid = heap[0]
            lid = sid // per
            if stamp.get(sid) == when and self.owner.get(lid) == t and self.held[lid]:
                heapq.heappop(heap)
                del stamp[sid]
                return sid
            heapq.heappop(heap)
        return -1

    def _hold(self, lid: int) -> None:
        """An evictable large page held again: its free slots and idle pages become its
        type's own."""
        t = self.owner[lid]
        del self.evictable[lid]
        mask = self.mask[lid]
        if mask:
            self.spare[t].discard(lid)
            self.partly[t].add(lid)
            self.free_small[t] += bin(mask).count("1")
        idle = self.idle_slots[lid]
        self.npinned[t] += bin(idle).count("1")
        per, stamp, heap = self.per[t], self.stamp[t], self.pinned[t]
        while idle:
            bit = idle & -idle
            idle ^= bit
            sid = lid * per + bit.bit_length() - 1
            heapq.heappush(heap, (stamp[sid], sid))

    def _release(self, lid: int) -> None:
        """A held large page whose last held page was just freed, idle pages left in it:
        evictable (its free slots and idle pages leave its type's own)."""
        t = self.owner[lid]
        self.evictable[lid] = None
        mask = self.mask[lid]
        if mask:
            self.partly[t].discard(lid)
            self.spare[t].add(lid)
            self.free_small[t] -= bin(mask).count("1")
        self.npinned[t] -= bin(self.idle_slots[lid]).count("1")

    def _evict_large(self, lid: int) -> None:
        """Every idle page of an evictable large page evicted; it leaves its type."""
        t = self.owner[lid]
        per = self.per[t]
        del self.evictable[lid]
        self.spare[t].discard(lid)
        idle = self.idle_slots[lid]
        while idle:
            bit = idle & -idle
            idle ^= bit
            sid = lid * per + bit.bit_length() - 1
            del self.stamp[t][sid]
            self._uncache(t, sid)
            self.evictions += 1
            self.evicted.append((t, sid))
        self._drop(lid)

    def _uncache(self, t: int, sid: int) -> None:
        keys = self.keys[t].pop(sid, ())
        if self.cache is None:
            return
        cache = self.cache[t]
        for key in keys:
            ids = cache[key]
            del ids[sid]
            if not ids:
                del cache[key]

    def _drop(self, lid: int) -> None:
        del self.owner[lid], self.mask[lid], self.held[lid], self.idle_slots[lid]

    # ----------------------------------------------------------------- checks
    def check(self) -> None:
        """The pool's invariants (tests): every count agrees with the pages' states."""
        n = len(self.per)
        free_small, npinned = [0] * n, [0] * n
        for lid, t in self.owner.items():
            per = self.per[t]
            mask, idle = self.mask[lid], self.idle_slots[lid]
            assert not mask & idle and (mask | idle) < 1 << per
            held = [s for s in range(per) if lid * per + s in self.ref[t]]
            assert len(held) == self.held[lid], (lid, held, self.held[lid])
            for s in held:
                assert not (mask | idle) >> s & 1
            assert len(held) + bin(mask).count("1") + bin(idle).count("1") == per
            for s in range(per):
                sid = lid * per + s
                assert (sid in self.stamp[t]) == bool(idle >> s & 1)
                if idle >> s & 1:
                    assert sid in self.keys[t]
            assert held or idle, ("an empty large page not given back", lid)
            evictable = not held
            assert (lid in self.evictable) == evictable
            assert (lid in self.spare[t]) == (evictable and bool(mask))
            assert (lid in self.partly[t]) == (not evictable and bool(mask))
            if not evictable:
                free_small[t] += bin(mask).count("1")
                npinned[t] += bin(idle).count("1")
                valid = {sid for when, sid in self.pinned[t] if self.stamp[t].get(sid) == when}
                for s in range(per):
                    if idle >> s & 1:
                        assert lid * per + s in valid, ("an idle page lost to eviction", t, lid)
        assert free_small == self.free_small, (free_small, self.free_small)
        assert npinned == self.npinned, (npinned, self.npinned)
        assert len(self.owner) + len(self.free_large) == self.usable
        assert not set(self.owner) & set(self.free_large)
        for t in range(n):
            for sid in self.ref[t]:
                assert self.ref[t][sid] > 0 and self.owner.get(sid // self.per[t]) == t
            for sid in self.keys[t]:
                assert sid in self.ref[t] or sid in self.stamp[t]
            if self.cache is None:
                continue
            for key, ids in self.cache[t].items():
                for sid in ids:
                    assert key in self.keys[t][sid]
            for sid, keys in self.keys[t].items():
                assert all(sid in self.cache[t][k] for k in keys)
