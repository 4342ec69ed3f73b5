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
  the pool's state by value (no insertion order), so that `undo` restores a state that places
  exactly as before: the allocator tries a step, an admission or a stretch of decode steps,
  and takes it back (`mark` / `undo`).
- The partly used large pages of a type are a bitmap (a list of `WORD`-bit words, kept exact
  at every change of a page: `_sync`) with the index of its lowest word that may be nonzero:
  the lowest one is a short scan and a lowest-bit, where a heap costs a push and a pop per
  page that fills or frees a slot.
- So a take of type t uses a free slot of its type while there is one (`free_small[t]`), else a
  fresh large page: how many fresh pages n takes need is a count (`large_needed`), whatever
  the order.
"""

from __future__ import annotations

from typing import Final

from kvfrag.sim.allocators.paged import FreeIds
from mypy_extensions import mypyc_attr

# (A list item's `x[i] += y` is spelled `x[i] = x[i] + y` on the hot paths: the compiled code
# does the first as a generic in-place operation on objects, the second on ints.)

# Journal entries: op, large page, slot or type (three ints in a row of one flat list: no
# object per entry); ops below (Final: constants in the compiled code, not global lookups).
_FRESH: Final = 0  # a fresh large page taken by type `arg`
_TAKE: Final = 1  # slot `arg` of the large page taken
_GIVE: Final = 2  # the slots of bit mask `arg` of the large page given back
_EMPTY: Final = 3  # the large page, all free, went back to the shared pool (arg: its type)
_TAKEN: Final = 4  # the slots of bit mask `arg` of the large page taken

#: Large pages per word of the partly-used bitmaps (a power of two: `WORD_BITS` its log).
#: Eight: a word is below 256, an int Python never allocates (a list holds ints as objects).
WORD_BITS: Final = 3
WORD: Final = 1 << 3


def _bits(x: int) -> int:
    """The bits set in x (`int.bit_count`, a generic method call in the compiled code; a
    journal entry's mask has few)."""
    n = 0
    while x:
        x &= x - 1
        n += 1
    return n


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
        # the shared pool) and the bit mask of its free slots (its small pages held: per[t]
        # less the mask's bits; none held is the type's `full` mask)
        self.owner: list[int] = []
        self.mask: list[int] = []
        self.full = [(1 << n) - 1 for n in per]  # per type: a large page's slots all free
        # Per type, its large pages used and with a free slot ("partly" used) as a bitmap:
        # words of WORD pages, as many as `owner` needs; and the lowest word that may be
        # nonzero (every word below it is zero)
        self.partly: list[list[int]] = [[] for _ in per]
        self.first = [0] * len(per)
        self.owned = [0] * len(per)  # per type: large pages it holds
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
        return self.owner[lid] == t and self.mask[lid] != 0 and self.mask[lid] != self.full[t]

    def lowest_partly(self, t: int) -> int:
        """The lowest-numbered partly used large page of type t (-1: none)."""
        words = self.partly[t]
        i, n = self.first[t], len(words)
        while i < n and words[i] == 0:
            i += 1
        self.first[t] = i
        if i == n:
            return -1
        w = words[i]
        return (i << WORD_BITS) + (w & -w).bit_length() - 1

    def _sync(self, lid: int, t: int) -> None:
        """Large page `lid` of type t changed: its bit in the type's partly-used bitmap set
        if it is partly used now, else cleared."""
        words = self.partly[t]
        i = lid >> WORD_BITS
        bit = 1 << (lid & (WORD - 1))
        mask = self.mask[lid]
        if mask != 0 and mask != self.full[t]:
            words[i] = words[i] | bit
            if i < self.first[t]:
                self.first[t] = i
        else:
            words[i] = words[i] & ~bit

    def state(self) -> tuple[dict[int, int], dict[int, int], dict[int, int], list[int],
                             list[set[int]]]:
        """The pool by value (tests): per large page held its type, free slots' mask and
        small pages held; per type its free small pages and its partly used large pages."""
        held = [lid for lid, t in enumerate(self.owner) if t >= 0]
        return ({lid: self.owner[lid] for lid in held}, {lid: self.mask[lid] for lid in held},
                {lid: self.per[self.owner[lid]] - self.mask[lid].bit_count() for lid in held},
                list(self.free_small),
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
        self.free_small[t] = self.free_small[t] - 1
        if fresh or not mask:
            self._sync(lid, t)
        if self.journaling:
            self._log(_TAKE, lid, slot)
        return lid * per + slot

    def take_many(self, t: int, n: int, hint: int, out: list[int]) -> bool:
        """`n` small pages of type t onto `out`, each into the large page of the one before
        (`hint` first) if it has a free slot, else the lowest-numbered partly used page of the
        type, else a fresh one, the lowest free slot first; a large page at a time. False,
        part done, when the pool runs short (the caller undoes its trial)."""
        # (`lowest_partly` and `_sync` inline, the type's free slots counted once at the end:
        # the walk's takes are mostly of one page, where each call and list store shows)
        per = self.per[t]
        owner, mask_of = self.owner, self.mask
        words = self.partly[t]
        took = 0
        while n > 0:
            lid = -1
            fresh = False
            if hint >= 0:
                h = hint // per
                if owner[h] == t and mask_of[h] != 0:
                    lid = h
            if lid < 0:
                first = i = self.first[t]
                nw = len(words)
                while i < nw and words[i] == 0:
                    i += 1
                if i != first:
                    self.first[t] = i
                if i < nw:
                    w = words[i]
                    lid = (i << WORD_BITS) + (w & -w).bit_length() - 1
                else:
                    if not len(self.free_large):
                        self.free_small[t] = self.free_small[t] - took
                        return False
                    lid = self._fresh(t)
                    fresh = True
            mask = mask_of[lid]
            base = lid * per
            if fresh:  # (its lowest slots, in order)
                count = min(n, per)
                for sid in range(base, base + count):
                    out.append(sid)
                taken = (1 << count) - 1
                mask ^= taken
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
            took += count
            mask_of[lid] = mask
            if not mask:  # (full now: out of the partly used bitmap)
                i = lid >> WORD_BITS
                words[i] = words[i] & ~(1 << (lid & (WORD - 1)))
            elif fresh:  # (a fresh page partly used now)
                i = lid >> WORD_BITS
                words[i] = words[i] | 1 << (lid & (WORD - 1))
                if i < self.first[t]:
                    self.first[t] = i
            if self.journaling:
                journal = self.journal
                journal.append(_TAKEN)
                journal.append(lid)
                journal.append(taken)
            hint = -1  # (n left: this page is full, so its hint would fail)
        self.free_small[t] = self.free_small[t] - took
        return True

    def give(self, t: int, ids: list[int]) -> None:
        """Small pages of type t back; large pages left empty go back to the shared pool, in
        the order they empty (one `FreeIds.give`, as the hybrid allocator gives a list)."""
        per = self.per[t]
        mask_of, full = self.mask, self.full[t]
        words = self.partly[t]
        emptied: list[int] = []
        journaling = self.journaling
        freed = 0
        # a run of ids in one large page at a time (a table's ids mostly are: placement keeps
        # a request's pages together), as slot by slot
        i, n = 0, len(ids)
        while i < n:
            sid = ids[i]
            lid = sid // per
            base = lid * per
            top = base + per
            bits = 1 << (sid - base)
            count = 1
            i += 1
            while i < n:
                sid = ids[i]
                if sid < base or sid >= top:
                    break
                bits |= 1 << (sid - base)
                count += 1
                i += 1
            before = mask_of[lid]
            after = before | bits
            if journaling:
                journal = self.journal
                journal.append(_GIVE)
                journal.append(lid)
                journal.append(bits)
            w = lid >> WORD_BITS
            if after != full:
                mask_of[lid] = after
                freed += count
                if not before:  # (it was full: partly used now)
                    words[w] = words[w] | 1 << (lid & (WORD - 1))
                    if w < self.first[t]:
                        self.first[t] = w
            else:  # (all free: back to the shared pool; `_drop` inline)
                self.owner[lid] = -1
                mask_of[lid] = 0
                self.owned[t] = self.owned[t] - 1
                words[w] = words[w] & ~(1 << (lid & (WORD - 1)))
                freed += count - per
                emptied.append(lid)
        self.free_small[t] = self.free_small[t] + freed
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
        owner, mask_of = self.owner, self.mask
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
                self.free_small[t] = self.free_small[t] - self.per[t]
                self.free_large.give([lid])
            else:
                t = owner[lid]
                if op == _GIVE:
                    count = _bits(arg)
                    mask_of[lid] = mask_of[lid] & ~arg
                    self.free_small[t] = self.free_small[t] - count
                else:  # _TAKEN, _TAKE
                    bits = arg if op == _TAKEN else 1 << arg
                    count = _bits(bits)
                    mask_of[lid] = mask_of[lid] | bits
                    self.free_small[t] = self.free_small[t] + count
                # (`_sync`, inline)
                mask = mask_of[lid]
                words = self.partly[t]
                w = lid >> WORD_BITS
                if mask != 0 and mask != self.full[t]:
                    words[w] = words[w] | 1 << (lid & (WORD - 1))
                    if w < self.first[t]:
                        self.first[t] = w
                else:
                    words[w] = words[w] & ~(1 << (lid & (WORD - 1)))

    def redo(self, journal: list[int]) -> None:
        """Apply again, in order, the changes of a trial's journal (entries from its mark on)
        that `undo` took back: the state it reached, from the state it started in."""
        owner, mask_of = self.owner, self.mask
        emptied: list[int] = []
        i, n = 0, len(journal)
        while i < n:
            op, lid, arg = journal[i], journal[i + 1], journal[i + 2]
            i += 3
            if op == _EMPTY:  # (one give's emptied pages, logged last first: given together)
                emptied.append(lid)
                if i == n or journal[i] != _EMPTY:
                    emptied.reverse()
                    self.free_large.give(emptied)
                    emptied = []
            elif op == _FRESH:
                got = self._fresh(arg)
                assert got == lid, (got, lid)
            else:
                t = owner[lid]
                if op == _GIVE:
                    count = _bits(arg)
                    after = mask_of[lid] | arg
                    mask_of[lid] = after
                    self.free_small[t] = self.free_small[t] + count
                    if after == self.full[t]:  # (emptied: its _EMPTY entry gives it back)
                        self._drop(lid, t)
                        self.free_small[t] = self.free_small[t] - self.per[t]
                        continue
                else:  # _TAKEN, _TAKE
                    bits = arg if op == _TAKEN else 1 << arg
                    count = _bits(bits)
                    mask_of[lid] = mask_of[lid] & ~bits
                    self.free_small[t] = self.free_small[t] - count
                self._sync(lid, t)

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
            if len(self.owner) > len(self.partly[0]) << WORD_BITS:  # (a word more per type)
                for words in self.partly:
                    words.append(0)
        self._own(lid, t)
        if self.journaling:
            self._log(_FRESH, lid, t)
        return lid

    def _own(self, lid: int, t: int) -> None:
        """(All its slots free, none used: not partly used, its bit clear already.)"""
        per = self.per[t]
        self.owner[lid] = t
        self.mask[lid] = self.full[t]
        self.free_small[t] = self.free_small[t] + per
        self.owned[t] = self.owned[t] + 1

    def _drop(self, lid: int, t: int) -> None:
        self.owner[lid] = -1
        self.mask[lid] = 0
        self.owned[t] = self.owned[t] - 1
        self._sync(lid, t)

    # ----------------------------------------------------------------- checks
    def check(self) -> None:
        """The pool's own invariants (tests): counts agree with the masks, the partly-used
        bitmaps hold exactly the partly used pages, no word below a type's `first` set."""
        free_small = [0] * len(self.per)
        owned = [0] * len(self.per)
        for lid, t in enumerate(self.owner):
            if t < 0:
                assert self.mask[lid] == 0
                continue
            mask = self.mask[lid]
            assert 0 <= mask <= self.full[t]
            assert mask != self.full[t] or self.journaling  # (a page held holds a slot)
            free_small[t] += mask.bit_count()
            owned[t] += 1
        for t, words in enumerate(self.partly):
            assert len(words) << WORD_BITS >= len(self.owner)
            assert not any(words[:self.first[t]]), (t, self.first[t])
            for lid in range(len(self.owner)):
                on = bool(words[lid >> WORD_BITS] >> (lid & (WORD - 1)) & 1)
                assert on == self.is_partly(lid, t), (lid, t)
        assert free_small == self.free_small, (free_small, self.free_small)
        assert owned == self.owned, (owned, self.owned)
        held = {lid for lid, t in enumerate(self.owner) if t >= 0}
        assert len(held) + len(self.free_large) == self.usable
        assert not held & set(self.free_large)
