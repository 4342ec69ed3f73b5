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
  a free slot (whoever holds the rest); else a fresh large page. Every choice is a function of
  the pool's state by value (no insertion order), so that `undo` restores a state that
  places exactly as before: the allocator tries a step, an admission or a stretch of decode
  steps, and takes it back (`mark` / `undo`).
"""

from __future__ import annotations

from kvfrag.sim.allocators.paged import FreeIds
from mypy_extensions import mypyc_attr

# Journal entries: (op, large page, slot or type); ops below.
_FRESH = 0  # a fresh large page taken by type `arg`
_TAKE = 1  # slot `arg` of the large page taken
_GIVE = 2  # slot `arg` of the large page given back
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
        self.owner: dict[int, int] = {}  # large page -> its type (absent: in the shared pool)
        self.mask: dict[int, int] = {}  # large page -> bit mask of its free slots
        self.used: dict[int, int] = {}  # large page -> its small pages held
        self.partly: list[set[int]] = [set() for _ in per]  # per type: used, with a free slot
        self.free_small = [0] * len(per)  # per type: free small pages in its large pages
        self.journal: list[tuple[int, int, int]] = []
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
        """Fresh large pages `need[t]` more small pages of each type would take."""
        total = 0
        for t, n in enumerate(need):
            short = n - self.free_small[t]
            if short > 0:
                per = self.per[t]
                total += (short + per - 1) // per
        return total

    # ------------------------------------------------------------------ changes
    def take(self, t: int, hint: int) -> int:
        """One small page of type t (request-aware: `hint`, the small page id of the
        request's last page of this type, or -1); -1 when none is free."""
        per = self.per[t]
        lid = -1
        if hint >= 0:
            h = hint // per
            if self.mask.get(h, 0) and self.owner.get(h, -1) == t:
                lid = h
        if lid < 0:
            partly = self.partly[t]
            if partly:
                lid = min(partly)
            elif len(self.free_large):
                lid = self.free_large.pop()
                self.owner[lid] = t
                self.mask[lid] = (1 << per) - 1
                self.used[lid] = 0
                self.free_small[t] += per
                if self.journaling:
                    self.journal.append((_FRESH, lid, t))
            else:
                return -1
        mask = self.mask[lid]
        bit = mask & -mask
        slot = bit.bit_length() - 1
        mask ^= bit
        self.mask[lid] = mask
        used = self.used[lid] + 1
        self.used[lid] = used
        self.free_small[t] -= 1
        if mask:
            self.partly[t].add(lid)
        else:
            self.partly[t].discard(lid)
        if self.journaling:
            self.journal.append((_TAKE, lid, slot))
        return lid * per + slot

    def take_many(self, t: int, n: int, hint: int, out: list[int]) -> bool:
        """`n` small pages of type t onto `out`, exactly as n `take`s in a row, each hinted
        by the one before (`hint` first), but a large page at a time. False, part done, when
        the pool runs short (the caller undoes its trial)."""
        per = self.per[t]
        full = (1 << per) - 1
        while n > 0:
            lid = -1
            if hint >= 0:
                h = hint // per
                if self.mask.get(h, 0) and self.owner.get(h, -1) == t:
                    lid = h
            if lid < 0:
                partly = self.partly[t]
                if partly:
                    lid = min(partly)
                elif len(self.free_large):
                    lid = self.free_large.pop()
                    self.owner[lid] = t
                    self.mask[lid] = full
                    self.used[lid] = 0
                    self.free_small[t] += per
                    if self.journaling:
                        self.journal.append((_FRESH, lid, t))
                else:
                    return False
            mask = self.mask[lid]
            taken = 0
            base = lid * per
            while n > 0 and mask:
                bit = mask & -mask
                mask ^= bit
                taken |= bit
                out.append(base + bit.bit_length() - 1)
                n -= 1
            count = bin(taken).count("1")
            self.mask[lid] = mask
            self.used[lid] += count
            self.free_small[t] -= count
            if mask:
                self.partly[t].add(lid)
            else:
                self.partly[t].discard(lid)
            if self.journaling:
                self.journal.append((_TAKEN, lid, taken))
            hint = out[-1]
        return True

    def give(self, t: int, ids: list[int]) -> None:
        """Small pages of type t back; large pages left empty go back to the shared pool, in
        the order they empty (one `FreeIds.give`, as the hybrid allocator gives a list)."""
        per = self.per[t]
        emptied: list[int] = []
        for sid in ids:
            lid, slot = divmod(sid, per)
            self.mask[lid] |= 1 << slot
            used = self.used[lid] - 1
            self.used[lid] = used
            self.free_small[t] += 1
            if self.journaling:
                self.journal.append((_GIVE, lid, slot))
            if used:
                self.partly[t].add(lid)
            else:
                self.partly[t].discard(lid)
                self._drop(lid)
                self.free_small[t] -= per
                emptied.append(lid)
        if emptied:
            if self.journaling:  # (undone last first: popped in the order given)
                for lid in reversed(emptied):
                    self.journal.append((_EMPTY, lid, t))
            self.free_large.give(emptied)

    # ---------------------------------------------------------------- trials
    def mark(self) -> int:
        """Start (or nest in) a trial: changes from here on can be undone."""
        self.journaling = True
        return len(self.journal)

    def undo(self, mark: int) -> None:
        """Take back every change since `mark`, restoring the state by value."""
        journal = self.journal
        while len(journal) > mark:
            op, lid, arg = journal.pop()
            if op == _EMPTY:
                t = arg
                back = self.free_large.pop()
                assert back == lid, (back, lid)
                self.owner[lid] = t
                self.mask[lid] = (1 << self.per[t]) - 1
                self.used[lid] = 0
                self.free_small[t] += self.per[t]
            elif op == _GIVE:
                t = self.owner[lid]
                self.mask[lid] &= ~(1 << arg)
                self.used[lid] += 1
                self.free_small[t] -= 1
                self._file(lid, t)
            elif op == _TAKEN:
                t = self.owner[lid]
                count = bin(arg).count("1")
                self.mask[lid] |= arg
                self.used[lid] -= count
                self.free_small[t] += count
                self._file(lid, t)
            elif op == _TAKE:
                t = self.owner[lid]
                self.mask[lid] |= 1 << arg
                self.used[lid] -= 1
                self.free_small[t] += 1
                self._file(lid, t)
            else:  # _FRESH
                t = arg
                self._drop(lid)
                self.free_small[t] -= self.per[t]
                self.partly[t].discard(lid)
                self.free_large.give([lid])

    def commit(self, mark: int) -> None:
        """Keep the changes since `mark` (the outermost trial ends journaling)."""
        if mark == 0:
            self.journal.clear()
            self.journaling = False

    def _drop(self, lid: int) -> None:
        del self.owner[lid]
        del self.mask[lid]
        del self.used[lid]

    def _file(self, lid: int, t: int) -> None:
        if self.used[lid] and self.mask[lid]:
            self.partly[t].add(lid)
        else:
            self.partly[t].discard(lid)

    # ----------------------------------------------------------------- checks
    def check(self) -> None:
        """The pool's own invariants (tests): counts agree with the masks."""
        free_small = [0] * len(self.per)
        for lid, t in self.owner.items():
            per = self.per[t]
            mask = self.mask[lid]
            assert 0 < self.used[lid] <= per or self.journaling
            assert bin(mask).count("1") + self.used[lid] == per
            free_small[t] += per - self.used[lid]
            assert (lid in self.partly[t]) == bool(self.used[lid] and mask)
        assert free_small == self.free_small, (free_small, self.free_small)
        assert len(self.owner) + len(self.free_large) == self.usable
        assert not set(self.owner) & set(self.free_large)
