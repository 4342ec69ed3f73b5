"""The `two-level` allocator's bounds (`kvfrag.sim.allocators.two_level`): what settles
`steps_until_full_within` without walking the decoders' events on the pool. Each says "fits"
only where every step does (a bound on the pages taken, or an exact count), so the answer
is the walk's; the engine asks before every decode step, and before each preemption near
fullness."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfrag.sim.allocators.two_level_plan import CHUNKED, SLIDING, SLOT_MASK, count_takes

if TYPE_CHECKING:
    from kvfrag.sim.allocators.two_level import TwoLevelAllocator


def few_fit(a: TwoLevelAllocator, steps: int) -> bool:
    """Whether the next `steps` decode steps fit on a bound cheaper than `most_extra`'s
    where few decoders' counts change: over no more steps than a block, a decoder takes
    at most a block per group, and each change of its counts is one of its events (one
    entry each; stale entries only loosen it). False: not settled."""
    if steps > a._min_bs:
        return False
    clocks, buckets, n = a._clocks, a._buckets, 0
    last = a._clock + steps
    i = len(clocks)  # (descending: the next clocks last)
    while i > 0 and clocks[i - 1] <= last:
        i -= 1
        n += len(buckets[i])
    return a.pool.large_needed([w * n for w in a._tw]) <= a.pool.free_large_pages()


def next_step_fits(a: TwoLevelAllocator) -> int:
    """Whether the next decode step fits (1) or not (0), counted without a walk where none
    of its events gives a page back (-1 where one does: walk it). Takes alone fit exactly
    when the fresh large pages their count needs do (`TwoLevelPool.large_needed`), in any
    order; the engine asks this of every step near fullness, before each preemption."""
    need = next_step_need(a)
    if need is None:
        return -1
    return 1 if a.pool.large_needed(need) <= a.pool.free_large_pages() else 0


def next_step_need(a: TwoLevelAllocator) -> list[int] | None:
    """The small pages per pool type that the next decode step's events take, or None where
    one of them gives a page back first (or a rank is due twice): only a walk knows then."""
    clock = a._clock + 1
    need = [0] * len(a.pool.per)
    clocks = a._clocks  # (none before `clock`: the walks took them)
    if not clocks or clocks[-1] != clock:
        return need
    bucket = a._buckets[-1]
    if len(set(bucket)) != len(bucket):
        return None
    kinds, sizes, windows, ptype = a._mkind, a._mbs, a._mwin, a._ptype
    slots = a._slots
    for key in bucket:
        dec = slots[key & SLOT_MASK]
        if dec.key != key or dec.at != clock:
            continue
        rid, tables, starts = dec.rid, dec.tables, dec.starts
        tokens = dec.base + clock
        joined = dec.joined
        processed = a._processed_at(rid, tokens, clock, joined)
        if not count_takes(kinds, sizes, windows, ptype, tables, starts, tokens,
                           processed, need):
            return None
    return need


def most_extra(a: TwoLevelAllocator, steps: int) -> list[int]:
    """Per pool type, a bound on how many more small pages than now the decoders hold at
    any moment of the next `steps` decode steps. If fresh large pages for that many fit,
    every step fits: a type takes a fresh large page only when its own are full, so it
    never owns more than its most pages need (see `two_level`'s module).

    Per manager, the blocks its ceil terms take over the stretch (the cohort's sums:
    every decoder's length's blocks, frees ignored); for a sliding or chunked manager at
    most, besides, each settled decoder's room under its window's most blocks (cap less
    what it holds: the decoders' held blocks are the cohort's figures) and each decoder
    still in its first steps (`_fresh`, walked) its blocks taken."""
    extra = [0] * len(a.pool.per)
    co = a._cohort
    clock, lag = a._clock, a._lag
    figures = co.figures(clock)
    fresh = a._fresh
    for rid in [r for r, j in fresh.items() if clock >= j + 1 + lag]:
        del fresh[rid]
    n_dec = len(a._joined)
    for mi in range(len(a._mkind)):
        kind, bs, window = a._mkind[mi], a._mbs[mi], a._mwin[mi]
        if bs >= a.max_model_len:
            continue  # (Mamba: one state page for its life)
        k = co.mods.index(bs)  # (its ceil term kind: the first of that block size)
        taken = co.sums[k].value(clock + steps) - co.sums[k].value(clock)
        if kind in (SLIDING, CHUNKED):
            cap = ((window + lag + 2 * bs - 2) // bs if kind == SLIDING
                   else (window + 1 + lag) // bs + 2)
            held = figures.get(6 + mi) - co.fixed.get(6 + mi)  # (per group, over the decoders)
            room = 0
            for rid in fresh:
                tokens = a._live[rid].base + clock
                room += -(-(tokens + steps) // bs) - -(-tokens // bs)
                held -= len(a._tables[rid][mi][0])
            room += (n_dec - len(fresh)) * cap - held
            taken = min(taken, room)
        if taken > 0:
            extra[a._ptype[mi]] += a._lists[mi] * taken
    return extra
