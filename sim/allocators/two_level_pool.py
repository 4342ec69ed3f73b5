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
from mypy_extensions import i64, mypyc_attr

# (A list item's `x[i] += y` is spelled `x[i] = x[i] + y` on the hot paths: the compiled code
# does the first as a generic in-place operation on objects, the second on ints. `i64`: where
# the compiled code should do machine arithmetic, with no check for Python's big ints; every
# such value here is far below 2**62 (masks are ints: a type may have more than 64 slots a
# large page), and no constant is shifted by one (mypyc shifts it as a C int). To Python it
# is int.)

# Journal entries: op, large page, slot or type (three ints in a row of one flat list: no
# object per entry); ops below (Final: constants in the compiled code, not global lookups).
_FRESH: Final = 0  # a fresh large page taken by type `arg`
_TAKE: Final = 1  # slot `arg` of the large page taken
_GIVE: Final = 2  # the slots of bit mask `arg` of the large page given back
_EMPTY: Final = 3  # the large page, all free, went back to the shared pool (arg: its type)
_TAKEN: Final = 4  # the slots of bit mask `arg` of the large page taken

#: Large pages per word of the partly-used bitmaps (a power of two: `WORD_BITS` its log).
#: 32: an int the compiled code holds unboxed (in a `Bits`), few words to scan for the lowest.
WORD_BITS: Final = 5
WORD: Final = 1 << 5


def _slot(bit: int) -> int:
    """The index of a mask's one bit set."""
    return bit.bit_length() - 1


def _bit(lid: int) -> int:
    """Large page `lid`'s bit in its word of a partly-used bitmap. (An int: compiled, the
    i64 `1 << 31` of a machine-int `lid` is a C int's shift, and comes out negative.)"""
    return 1 << (lid & (WORD - 1))


def _bits(x: int) -> int:
    """The bits set in x (`int.bit_count`, a generic method call in the compiled code; a
    journal entry's mask has few)."""
    n = 0
    while x:
        x &= x - 1
        n += 1
    return n


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class LargePage:
    """A large page handed out: its type (-1: in the shared pool) and the bit mask of its free
    slots (its small pages held: per[t] less the mask's bits; none held is the type's `full`
    mask). An object of its own, not two lists of ints: a list holds its ints as objects, so
    each store of a mask above 256 (a 26-slot page's) would allocate one; a compiled object's
    int attribute is stored as is below 2**62. (The mask is an int, not an i64: a type may
    have more than 64 slots a large page.)"""

    def __init__(self) -> None:
        self.owner: i64 = -1
        self.mask = 0


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class Bits:
    """A word of a partly-used bitmap (`WORD` large pages), an object for the reason
    `LargePage` is: a list of ints would allocate each store of a word above 256."""

    def __init__(self) -> None:
        self.bits = 0


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
        # first: the list grows with the pages in use, not with the budget)
        self.pages: list[LargePage] = []
        self.full = [(1 << n) - 1 for n in per]  # per type: a large page's slots all free
        # Per type, its large pages used and with a free slot ("partly" used) as a bitmap:
        # words of WORD pages, as many as `pages` needs; and the lowest word that may be
        # nonzero (every word below it is zero)
        self.partly: list[list[Bits]] = [[] for _ in per]
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
        total: i64 = 0
        free_small, pers = self.free_small, self.per
        for t in range(len(need)):
            short: i64 = need[t] - free_small[t]
            if short > 0:
                per: i64 = pers[t]
                total += (short + per - 1) // per
        return total

    def is_partly(self, lid: int, t: int) -> bool:
        """Whether large page `lid` is type t's, used, with a free slot."""
        page = self.pages[lid]
        return page.owner == t and page.mask != 0 and page.mask != self.full[t]

    def lowest_partly(self, t: int) -> int:
        """The lowest-numbered partly used large page of type t (-1: none)."""
        words = self.partly[t]
        i, n = self.first[t], len(words)
        while i < n and words[i].bits == 0:
            i += 1
        self.first[t] = i
        if i == n:
            return -1
        w = words[i].bits
        return (i << WORD_BITS) + _slot(w & -w)

    def _sync(self, lid: int, t: int) -> None:
        """Large page `lid` of type t changed: its bit in the type's partly-used bitmap set
        if it is partly used now, else cleared."""
        i = lid >> WORD_BITS
        word = self.partly[t][i]
        bit = _bit(lid)
        mask = self.pages[lid].mask
        if mask != 0 and mask != self.full[t]:
            word.bits = word.bits | bit
            if i < self.first[t]:
                self.first[t] = i
        else:
            word.bits = word.bits & ~bit

    def state(self) -> tuple[dict[int, int], dict[int, int], dict[int, int], list[int],
                             list[set[int]]]:
        """The pool by value (tests): per large page held its type, free slots' mask and
        small pages held; per type its free small pages and its partly used large pages."""
        pages = self.pages
        held = [lid for lid, page in enumerate(pages) if page.owner >= 0]
        return ({lid: pages[lid].owner for lid in held}, {lid: pages[lid].mask for lid in held},
                {lid: self.per[pages[lid].owner] - pages[lid].mask.bit_count()
                 for lid in held},
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
            if self.pages[h].owner == t and self.pages[h].mask != 0:
                lid = h
        if lid < 0:
            lid = self.lowest_partly(t)
            if lid < 0:
                if not len(self.free_large):
                    return -1
                lid = self._fresh(t)
                fresh = True
        page = self.pages[lid]
        mask = page.mask
        bit = mask & -mask
        slot = _slot(bit)
        mask ^= bit
        page.mask = mask
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
        # (`lowest_partly`, `_sync` and `_slot` inline, the type's `first` and free slots read
        # once and stored once: a take is mostly of one page, where each call and list access
        # shows; the hint's mask asked first: its page is mostly full)
        per: i64 = self.per[t]
        tt: i64 = t
        pages = self.pages
        words = self.partly[t]
        first: i64 = self.first[t]
        start = first
        journaling = self.journaling
        left: i64 = n
        after: i64 = hint
        took: i64 = 0
        ok = True
        while left > 0:
            lid: i64 = -1
            fresh = False
            if after >= 0:
                h = after // per
                page = pages[h]
                if page.mask != 0 and page.owner == tt:
                    lid = h
                after = -1  # (n left after this page: it is full, so its hint would fail)
            if lid < 0:
                nw: i64 = len(words)
                while first < nw and words[first].bits == 0:
                    first += 1
                if first < nw:
                    w = words[first].bits
                    lid = (first << WORD_BITS) + _slot(w & -w)
                elif not len(self.free_large):
                    ok = False
                    break
                else:
                    lid = self._fresh(t)
                    fresh = True
            page = pages[lid]
            mask = page.mask
            base = lid * per
            count: i64 = 1
            taken = 0  # (an int, as the mask)
            if fresh:  # (its lowest slots, in order)
                count = left if left < per else per
                out.extend(range(base, base + count))
                taken = (1 << int(count)) - 1
                mask ^= taken
            elif mask & (mask - 1) == 0 or left == 1:  # (one slot: the page's lowest free one)
                taken = mask & -mask
                mask ^= taken
                out.append(base + taken.bit_length() - 1)
            else:
                count = 0
                while left > count and mask:
                    bit = mask & -mask
                    mask ^= bit
                    taken |= bit
                    out.append(base + bit.bit_length() - 1)
                    count += 1
            left -= count
            took += count
            page.mask = mask
            if not mask:  # (full now: out of the partly used bitmap)
                word = words[lid >> WORD_BITS]
                word.bits = word.bits & ~_bit(lid)
            elif fresh:  # (a fresh page partly used now)
                i = lid >> WORD_BITS
                word = words[i]
                word.bits = word.bits | _bit(lid)
                if i < first:
                    first = i
            if journaling:
                journal = self.journal
                journal.append(_TAKEN)
                journal.append(lid)
                journal.append(taken)
        if first != start:
            self.first[t] = first
        self.free_small[t] = self.free_small[t] - took
        return ok

    def give(self, t: int, ids: list[int]) -> None:
        """Small pages of type t back; large pages left empty go back to the shared pool, in
        the order they empty (one `FreeIds.give`, as the hybrid allocator gives a list)."""
        per: i64 = self.per[t]
        full = self.full[t]  # (masks: ints, see `LargePage`)
        pages = self.pages
        words = self.partly[t]
        emptied: list[int] = []
        journaling = self.journaling
        freed: i64 = 0
        first: i64 = self.first[t]  # (read once, stored once)
        start = first
        # a run of ids in one large page at a time (placement keeps a request's pages
        # together where it can), as slot by slot; the id that ends a run starts the next
        i: i64 = 0
        n: i64 = len(ids)
        sid: i64 = ids[0] if n else 0
        while i < n:
            lid = sid // per
            base = lid * per
            top = base + per
            bits = 1 << int(sid - base)
            count: i64 = 1
            i += 1
            while i < n:
                sid = ids[i]
                if sid < base or sid >= top:
                    break
                bits |= 1 << int(sid - base)
                count += 1
                i += 1
            page = pages[lid]
            before = page.mask
            after = before | bits
            if journaling:
                journal = self.journal
                journal.append(_GIVE)
                journal.append(lid)
                journal.append(bits)
            w = lid >> WORD_BITS
            if after != full:
                page.mask = after
                freed += count
                if not before:  # (it was full: partly used now)
                    word = words[w]
                    word.bits = word.bits | _bit(lid)
                    if w < first:
                        first = w
            else:  # (all free: back to the shared pool; `_drop` inline)
                page.owner = -1
                page.mask = 0
                self.owned[t] = self.owned[t] - 1
                word = words[w]
                word.bits = word.bits & ~_bit(lid)
                freed += count - per
                emptied.append(lid)
        self.free_small[t] = self.free_small[t] + freed
        if first != start:
            self.first[t] = first
        if emptied:
            if journaling:  # (undone last first: popped in the order given)
                for gone in reversed(emptied):
                    self._log(_EMPTY, gone, t)
            self.free_large.give(emptied)

    # ---------------------------------------------------------------- trials
    def mark(self) -> int:
        """Start (or nest in) a trial: changes from here on can be undone."""
        self.journaling = True
        return len(self.journal)

    def undo(self, mark: int) -> None:
        """Take back every change since `mark`, restoring the state by value."""
        journal = self.journal
        pages = self.pages
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
                page = pages[lid]
                t = page.owner
                if op == _GIVE:
                    count = _bits(arg)
                    page.mask = page.mask & ~arg
                    self.free_small[t] = self.free_small[t] - count
                else:  # _TAKEN, _TAKE
                    bits = arg if op == _TAKEN else 1 << arg
                    count = _bits(bits)
                    page.mask = page.mask | bits
                    self.free_small[t] = self.free_small[t] + count
                self._sync(lid, t)

    def redo(self, journal: list[int]) -> None:
        """Apply again, in order, the changes of a trial's journal (entries from its mark on)
        that `undo` took back: the state it reached, from the state it started in."""
        pages = self.pages
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
                page = pages[lid]
                t = page.owner
                if op == _GIVE:
                    count = _bits(arg)
                    after = page.mask | arg
                    page.mask = after
                    self.free_small[t] = self.free_small[t] + count
                    if after == self.full[t]:  # (emptied: its _EMPTY entry gives it back)
                        self._drop(lid, t)
                        self.free_small[t] = self.free_small[t] - self.per[t]
                        continue
                else:  # _TAKEN, _TAKE
                    bits = arg if op == _TAKEN else 1 << arg
                    count = _bits(bits)
                    page.mask = page.mask & ~bits
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
        while lid >= len(self.pages):
            self.pages.append(LargePage())
            if len(self.pages) > len(self.partly[0]) << WORD_BITS:  # (a word more per type)
                for words in self.partly:
                    words.append(Bits())
        self._own(lid, t)
        if self.journaling:
            self._log(_FRESH, lid, t)
        return lid

    def _own(self, lid: int, t: int) -> None:
        """(All its slots free, none used: not partly used, its bit clear already.)"""
        per = self.per[t]
        page = self.pages[lid]
        page.owner = t
        page.mask = self.full[t]
        self.free_small[t] = self.free_small[t] + per
        self.owned[t] = self.owned[t] + 1

    def _drop(self, lid: int, t: int) -> None:
        page = self.pages[lid]
        page.owner = -1
        page.mask = 0
        self.owned[t] = self.owned[t] - 1
        self._sync(lid, t)

    # ----------------------------------------------------------------- checks
    def check(self) -> None:
        """The pool's own invariants (tests): counts agree with the masks, the partly-used
        bitmaps hold exactly the partly used pages, no word below a type's `first` set."""
        free_small = [0] * len(self.per)
        owned = [0] * len(self.per)
        for page in self.pages:
            t, mask = page.owner, page.mask
            if t < 0:
                assert mask == 0
                continue
            assert 0 <= mask <= self.full[t]
            assert mask != self.full[t] or self.journaling  # (a page held holds a slot)
            free_small[t] += mask.bit_count()
            owned[t] += 1
        for t, words in enumerate(self.partly):
            assert len(words) << WORD_BITS >= len(self.pages)
            assert not any(word.bits for word in words[:self.first[t]]), (t, self.first[t])
            assert all(0 <= word.bits < 1 << WORD for word in words), t
            for lid in range(len(self.pages)):
                on = bool(words[lid >> WORD_BITS].bits >> (lid & (WORD - 1)) & 1)
                assert on == self.is_partly(lid, t), (lid, t)
        assert free_small == self.free_small, (free_small, self.free_small)
        assert owned == self.owned, (owned, self.owned)
        held = {lid for lid, page in enumerate(self.pages) if page.owner >= 0}
        assert len(held) + len(self.free_large) == self.usable
        assert not held & set(self.free_large)
