"""The prefix-caching allocator's per-block maps, assembled from its segments and runs for
checks (tests/sim/test_prefix_caching.py): the allocator keeps its state per segment and per
run, not per block (`prefix_caching`'s module docstring says why), and exposes these as the
properties `_idle`, `_refs`, `_cached` and `_key`. Nothing on the hot path uses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfrag.sim.allocators.prefix_keys import Key, pack

if TYPE_CHECKING:
    from kvfrag.sim.allocators.prefix_caching import PrefixCachingAllocator


def idle(a: PrefixCachingAllocator) -> dict[int, None]:
    """The idle cached blocks in LRU order (assembled, for checks)."""
    idle: dict[int, None] = {}
    for run in a._runs:
        pairs = run.keys.pairs()
        for p in reversed(range(len(run.ids) - run.pos)):
            if a._idle_at(run.ids[p], *pairs[p]) is run:
                idle[run.ids[p]] = None
    return idle


def refs(a: PrefixCachingAllocator) -> dict[int, int]:
    """id -> users of every cached block in use (assembled, for checks)."""
    refs: dict[int, int] = {}
    for held in a._held.values():
        for block in held:
            refs[block] = refs.get(block, 0) + 1
    return refs


def cached(a: PrefixCachingAllocator) -> dict[Key, list[int]]:
    """key -> every id cached under it, oldest first (assembled, for checks)."""
    cached: dict[Key, list[int]] = {}
    for base, seg in a._segs.items():
        for i, b in enumerate(seg.ids):
            if b != -1:
                key = pack(base, seg.lo + i)
                cached[key] = [b, *a._dups.get(key, ())]
    return cached


def keys(a: PrefixCachingAllocator) -> dict[int, Key]:
    """id -> key of every cached block, in use or idle (assembled, for checks): a block
    in use is at the same position in every table that holds it."""
    keys: dict[int, Key] = {}
    for rid, held in a._held.items():
        named = a._keys_between(rid, a._keys_of[rid], 0, len(held)).listed()
        keys.update(zip(held, named, strict=True))
    for run in a._runs:
        left = len(run.ids) - run.pos
        for block, (base, j) in zip(run.ids[:left], run.keys.pairs()[:left], strict=True):
            if a._idle_at(block, base, j) is run:
                keys[block] = pack(base, j)
    return keys
