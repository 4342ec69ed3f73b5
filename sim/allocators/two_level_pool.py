"""The `two-level` allocator's pool (`kvfrag.sim.allocators.two_level`): Jenga's two levels
(SOSP'25, arXiv 2503.18292).

The budget is cut into *large pages* of one size (the LCM of the layer types' small pages, or
the fallback's size); a large page taken by a type is split into that type's *small pages*
(`per[t]` of them) and goes back to the shared pool once every small page of it is free, so
memory moves between types as the requests' needs do, without one page size for all.

- Free large pages are a `FreeIds` stack, so that with one small page per large page (vLLM's
  constraints: the large page is the block id) ids come out in exactly the order of the
  `hybrid` allocator's pool.
- A small page of type t is the id `large * per[t] + slot`; a large page's free slots are a
  bit mask, the lowest free slot taken first.
- Placement (`take`, request-aware): into the large page of the request's own last small page
  of that type when it has a free slot; else the lowest-numbered large page of that type with
  a free slot (whoever holds the rest: a heap per type); else a fresh large page. Every choice
  is a function of the pool's state by value (no insertion order, whatever the heaps hold), so
  that `undo` restores a state that places exactly as before: the allocator tries a step, an
  admission or a stretch of decode steps, and takes it back (`mark` / `undo`).
- So a take of type t uses a free slot of its type while there is one (`free_small[t]`), else a
  fresh large page: how many fresh pages n takes need is a count (`large_needed`), whatever
  the order.
"""

from __future__ import annotations

import heapq

from kvfrag.sim.allocators.paged import FreeIds
from mypy_extensions import mypyc_attr

# Journal entries: op, large page, slot or type (three ints in a row of one flat list: no
# object per entry); ops below.
_FRESH = 0  # a fresh large page taken by type `arg`
_TAKE = 1  # slot `arg` of the large page taken
_GIVE = 2  # the slots of bit mask `arg` of the large page given back
_EMPTY = 3  # the large page, all free, went back to the shared pool (arg: its type)
_TAKEN = 4  # the slots of bit mask `arg` of the large page taken


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class TwoLevelPool:
    """Large pages shared by the types, each split into small pages of the type holding it."""

    def __init__(self, large_pages: int, per: list[int], null_page: bool) -> None:
        self.large_pages = large_pages
        self.per = list(per)
        self.free_large = FreeIds(large_pages)
        if null_page:  # (vLLM's null block: the hybrid allocator's block 0)
            self.free_large.pop()
        self.usable = len(self.free_large)
        # Per large page id, for the ids handed out so far (FreeIds hands out the lowest
        # first: the lists grow with the pages in use, not with the budget): its type (-1: in
        # the shared pool), the bit mask of its free slots, its small pages held
        self.owner: list[int] = []
        self.mask: list[int] = []
        self.used: list[int] = []
        # Per type, a heap holding every large page of it used and with a free slot ("partly"
        # used), and maybe pages no longer so, dropped when they come to the top: the lowest
        # partly used page at the cost of a heap, where a set's min would visit them all
        self.partly: list[list[int]] = [[] for _ in per]
        self.owned = [0] * len(per)  # per type: large pages it holds (the heaps' compaction)
        self.free_small = [0] * len(per)  # per type: free small pages in its large pages
        self.journal: list[int] = []  # (op, large page, arg) after (op, large page, arg)
        self.journaling = False

    # ----------------------------------------------------------------- queries
    def free_large_pages(self) -> int:
        return len(self.free_large)

    def used_large_pages(self) -> int:
        return self.usable - len(self.free_large)

    def fits(self, need: list[int]) -> bool:
        """Whether `need[t]` more small pages of each type fit now."""
        return self.large_needed(need) <= len(self.free_large)

    def large_needed(self, need: list[int]) -> int:
        """Fresh large pages `need[t]` more small pages of each type would take (a take uses
        a free slot of its type while there is one: see `take`)."""
        total = 0
        for t, n in enumerate(need):
            short = n - self.free_small[t]
            if short > 0:
                per = self.per[t]
                total += (short + per - 1) // per
        return total

    def is_partly(self, lid: int, t: int) -> bool:
        """Whether large page `lid` is type t's, used, with a free slot."""
        return self.owner[lid] == t and self.used[lid] > 0 and self.mask[lid] != 0

    def lowest_partly(self, t: int) -> int:
        """The lowest-numbered partly used large page of type t (-1: none)."""
        heap = self.partly[t]
        owner, used, mask = self.owner, self.used, self.mask
        while heap:
            lid = heap[0]
            if owner[lid] == t and used[lid] > 0 and mask[lid] != 0:
                return lid
            heapq.heappop(heap)
        return -1

    def state(self) -> tuple[dict[int, int], dict[int, int], dict[int, int], list[int],
                             list[set[int]]]:
        """The pool by value (tests): per large page held its type, free slots' mask and
        small pages held; per type its free small pages and its partly used large pages."""
        held = [lid for lid, t in enumerate(self.owner) if t >= 0]
        return ({lid: self.owner[lid] for lid in held}, {lid: self.mask[lid] for lid in held},
                {lid: self.used[lid] for lid in held}, list(self.free_small),
                [{lid for lid in held if self.is_partly(lid, t)} for t in range(len(self.per))])

    # ------------------------------------------------------------------ changes
    def take(self, t: int, hint: int) -> int:
        """One small page of type t (request-aware: `hint`, the small page id of the
        request's last page of this type, or -1); -1 when none is free."""
        per = self.per[t]
        lid = -1
        fresh = False
        if hint >= 0:
            h = hint // per
            if self.owner[h] == t and self.mask[h] != 0:
                lid = h
        if lid < 0:
            lid = self.lowest_partly(t)
            if lid < 0:
                if not len(self.free_large):
                    return -1
                lid = self._fresh(t)
                fresh = True
        mask = self.mask[lid]
        bit = mask & -mask
        slot = bit.bit_length() - 1
        mask ^= bit
        self.mask[lid] = mask
        self.used[lid] += 1
        self.free_small[t] -= 1
        if fresh and mask:
            self._push(t, lid)
        if self.journaling:
            self._log(_TAKE, lid, slot)
        return lid * per + slot

    def take_many(self, t: int, n: int, hint: int, out: list[int]) -> bool:
        """`n` small pages of type t onto `out`, each into the large page of the one before
        (`hint` first) if it has a free slot, else the lowest-numbered partly used page of the
        type, else a fresh one, the lowest free slot first; a large page at a time. False,
        part done, when the pool runs short (the caller undoes its trial)."""
        per = self.per[t]
        owner, mask_of, used_of = self.owner, self.mask, self.used
        while n > 0:
            lid = -1
            fresh = False
            if hint >= 0:
                h = hint // per
                if owner[h] == t and mask_of[h] != 0:
                    lid = h
            if lid < 0:
                lid = self.lowest_partly(t)
                if lid < 0:
                    if not len(self.free_large):
                        return False
                    lid = self._fresh(t)
                    fresh = True
            mask = mask_of[lid]
            base = lid * per
            if fresh and n >= per:  # (the whole page, its slots in order)
                out.extend(range(base, base + per))
                taken, count, mask = mask, per, 0
            else:
                taken = 0
                count = 0
                while n > count and mask:
                    bit = mask & -mask
                    mask ^= bit
                    taken |= bit
                    out.append(base + bit.bit_length() - 1)
                    count += 1
            n -= count
            mask_of[lid] = mask
            used_of[lid] += count
            self.free_small[t] -= count
            if fresh and mask:
                self._push(t, lid)
            if self.journaling:
                self._log(_TAKEN, lid, taken)
            hint = out[-1]
        return True

    def give(self, t: int, ids: list[int]) -> None:
        """Small pages of type t back; large pages left empty go back to the shared pool, in
        the order they empty (one `FreeIds.give`, as the hybrid allocator gives a list)."""
        per = self.per[t]
        mask_of, used_of = self.mask, self.used
        emptied: list[int] = []
        journaling = self.journaling
        # a run of ids in one large page at a time (a table's ids mostly are: placement keeps
        # a request's pages together), as slot by slot
        i, n = 0, len(ids)
        while i < n:
            lid = ids[i] // per
            base = lid * per
            bits = 0
            count = 0
            while i < n and base <= ids[i] < base + per:
                bits |= 1 << (ids[i] - base)
                count += 1
                i += 1
            before = mask_of[lid]
            mask_of[lid] = before | bits
            used = used_of[lid] - count
            used_of[lid] = used
            if journaling:
                self._log(_GIVE, lid, bits)
            self.free_small[t] += count
            if used:
                if not before:  # (it was full: partly used now)
                    self._push(t, lid)
            else:
                self._drop(lid, t)
                self.free_small[t] -= per
                emptied.append(lid)
        if emptied:
            if journaling:  # (undone last first: popped in the order given)
                for lid in reversed(emptied):
                    self._log(_EMPTY, lid, t)
            self.free_large.give(emptied)

    # ---------------------------------------------------------------- trials
    def mark(self) -> int:
        """Start (or nest in) a trial: changes from here on can be undone."""
        self.journaling = True
        return len(self.journal)

    def undo(self, mark: int) -> None:
        """Take back every change since `mark`, restoring the state by value."""
        journal = self.journal
        owner, mask_of, used_of = self.owner, self.mask, self.used
        while len(journal) > mark:
            arg = journal.pop()
            lid = journal.pop()
            op = journal.pop()
            if op == _EMPTY:
                t = arg
                back = self.free_large.pop()
                assert back == lid, (back, lid)
                self._own(lid, t)
            elif op == _FRESH:
                t = arg
                self._drop(lid, t)
                self.free_small[t] -= self.per[t]
                self.free_large.give([lid])
            else:
                t = owner[lid]
                was = used_of[lid] > 0 and mask_of[lid] != 0
                if op == _GIVE:
                    count = arg.bit_count()
                    mask_of[lid] &= ~arg
                    used_of[lid] += count
                    self.free_small[t] -= count
                else:  # _TAKEN, _TAKE
                    bits = arg if op == _TAKEN else 1 << arg
                    count = bits.bit_count()
                    mask_of[lid] |= bits
                    used_of[lid] -= count
                    self.free_small[t] += count
                if not was and used_of[lid] > 0 and mask_of[lid] != 0:
                    self._push(t, lid)

    def commit(self, mark: int) -> None:
        """Keep the changes since `mark` (the outermost trial ends journaling)."""
        if mark == 0:
            self.journal.clear()
            self.journaling = False

    def _log(self, op: int, lid: int, arg: int) -> None:
        journal = self.journal
        journal.append(op)
        journal.append(lid)
        journal.append(arg)

    def _fresh(self, t: int) -> int:
        """A fresh large page from the shared pool for type t (all its slots free)."""
        lid = self.free_large.pop()
        while lid >= len(self.owner):
            self.owner.append(-1)
            self.mask.append(0)
            self.used.append(0)
        self._own(lid, t)
        if self.journaling:
            self._log(_FRESH, lid, t)
        return lid

    def _own(self, lid: int, t: int) -> None:
        per = self.per[t]
        self.owner[lid] = t
        self.mask[lid] = (1 << per) - 1
        self.used[lid] = 0
        self.free_small[t] += per
        self.owned[t] += 1

    def _drop(self, lid: int, t: int) -> None:
        self.owner[lid] = -1
        self.mask[lid] = 0
        self.used[lid] = 0
        self.owned[t] -= 1

    def _push(self, t: int, lid: int) -> None:
        """Large page `lid` became partly used: onto its type's heap (rebuilt from the pages
        still partly used when stale entries outnumber the pages it could hold)."""
        heap = self.partly[t]
        heapq.heappush(heap, lid)
        if len(heap) > 2 * self.owned[t] + 64:
            heap[:] = sorted({x for x in heap if self.is_partly(x, t)})

    # ----------------------------------------------------------------- checks
    def check(self) -> None:
        """The pool's own invariants (tests): counts agree with the masks, every partly used
        page is on its type's heap."""
        free_small = [0] * len(self.per)
        owned = [0] * len(self.per)
        for lid, t in enumerate(self.owner):
            if t < 0:
                assert self.mask[lid] == 0 and self.used[lid] == 0
                continue
            per = self.per[t]
            mask = self.mask[lid]
            assert 0 < self.used[lid] <= per or self.journaling
            assert mask.bit_count() + self.used[lid] == per
            free_small[t] += per - self.used[lid]
            owned[t] += 1
            if self.is_partly(lid, t):
                assert lid in self.partly[t], (lid, t)
        assert free_small == self.free_small, (free_small, self.free_small)
        assert owned == self.owned, (owned, self.owned)
        held = {lid for lid, t in enumerate(self.owner) if t >= 0}
        assert len(held) + len(self.free_large) == self.usable
        assert not held & set(self.free_large)
