"""The torch caching allocator's self-check, for tests: every block chained and tiled into its
segment, the pools holding exactly the free blocks, the stats agreeing with the blocks (torch's
own identity reserved = active + inactive split + whole free segments among them), the pools'
running unit counts agreeing with a recount, and each live request holding its block. Kept out
of the compiled allocator (`torch_caching`), whose `verify` calls it: nothing on the hot path
needs it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kvfrag.sim.allocators.torch_blocks import Pool, kMinBlockSize

if TYPE_CHECKING:
    from kvfrag.sim.allocators.torch_caching import TorchCachingAllocator


def verify(self: TorchCachingAllocator) -> None:
    """Check the structures against each other and the stats; raise AssertionError."""
    blocks = self.all_blocks()
    by_pool = {self.small_pool.name: 0, self.large_pool.name: 0}
    for a, b in itertools.pairwise(blocks):
        assert a.ptr + a.size <= b.ptr, f"overlap: {a} {b}"
    for b in blocks:
        assert b.size > 0 and b.ptr % kMinBlockSize == 0 and b.size % kMinBlockSize == 0
        if b.next is not None:
            assert b.next.prev is b and b.ptr + b.size == b.next.ptr, f"broken chain at {b}"
            if not b.allocated and not b.next.allocated:
                assert b.mapped != b.next.mapped, f"unmerged free neighbours {b} {b.next}"
        if b.prev is not None:
            assert b.prev.next is b
        if b.allocated:
            assert self._active[b.ptr] is b and b.mapped
        else:
            assert b.requested == 0
            assert b in (b.pool.blocks if b.mapped else b.pool.unmapped)
    free_in_pools = sum(
        len(p.blocks) + len(p.unmapped) for p in (self.small_pool, self.large_pool)
    )
    assert free_in_pools + len(self._active) == len(blocks)
    # segments tile exactly
    reserved = 0
    for ptr, (size, pool) in self._segments.items():
        members = [b for b in blocks if ptr <= b.ptr < ptr + size]
        assert members and members[0].ptr == ptr and members[0].prev is None
        assert members[-1].next is None and sum(b.size for b in members) == size
        assert all(b.pool is pool and b.seg is None for b in members)
        reserved += size
        by_pool[pool.name] += size
    for seg in self._expandable:
        members = [b for b in blocks if b.seg is seg]
        assert members[0].ptr == seg.ptr and members[0].prev is None
        assert sum(b.size for b in members) == seg.size
        for b in members:
            if b.mapped:
                reserved += b.size
                by_pool[b.pool.name] += b.size
                assert (b.ptr - seg.ptr) % seg.page == 0 or b.prev is not None
            else:
                assert (b.ptr - seg.ptr) % seg.page == 0 and b.size % seg.page == 0
    st = self._stats
    assert st["reserved_bytes", "all"].current == reserved
    for name, value in by_pool.items():
        assert st["reserved_bytes", name].current == value
    allocated = sum(b.size for b in self._active.values())
    assert st["allocated_bytes", "all"].current == allocated
    assert st["active_bytes", "all"].current == allocated
    assert st["allocation", "all"].current == len(self._active)
    assert st["requested_bytes", "all"].current == sum(
        b.requested for b in self._active.values()
    )
    assert st["segment", "all"].current == len(self._segments)
    split_free = [b for b in blocks if not b.allocated and b.seg is None and b.is_split()]
    assert st["inactive_split", "all"].current == len(split_free)
    assert st["inactive_split_bytes", "all"].current == sum(b.size for b in split_free)
    if not self.expandable_segments:
        # torch's self-check: reserved = active + inactive_split + whole free segments
        assert reserved == (
            allocated
            + st["inactive_split_bytes", "all"].current
            + self.whole_free_segment_bytes()
        )
    # the pools' running counts of what their free blocks serve
    for pool in (self.small_pool, self.large_pool):
        if pool.unit:
            tally = Pool(pool.is_small)
            for b in pool.blocks:
                tally.blocks.add(b)
            tally.count_units(pool.unit, self.units)
            assert (pool.served, pool.whole_serving) == (tally.served, tally.whole_serving)
    # live requests hold exactly their blocks
    for live in self._live.values():
        assert self._active[live.offset].size == live.nbytes
