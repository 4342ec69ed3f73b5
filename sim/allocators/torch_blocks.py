"""PyTorch's caching allocator's size rules and structures (`c10/cuda/CUDACachingAllocator.cpp`),
apart from the allocator that uses them (`torch_caching`): the rounding and segment sizes, the
blocks of a segment, the pools of free blocks, expandable segments and the stats, plus the items
on which the expandable free-space view replays torch's malloc path in bulk.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from mypy_extensions import mypyc_attr
from sortedcontainers import SortedKeyList

KiB = 1024
MiB = 1024 * KiB
kMinBlockSize = 512
kSmallSize = 1 * MiB
kSmallBuffer = 2 * MiB
kMinLargeAlloc = 10 * MiB
kRoundLarge = 2 * MiB
kLargeBuffer = 20 * MiB
ADDRESS_BASE = 0x7F00_0000_0000  # first segment address (virtual, never reused)
SEGMENT_ALIGN = 2 * MiB
ALLOC, FREE, UNMAPPED, SEP = range(4)  # item kinds of the expandable free-space replay

STAT_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
POOL_NAMES = ("all", "small_pool", "large_pool")


# ------------------------------------------------------------------------- size rules
def roundup_power2_next_division(size: int, divisions: int) -> int:
    """torch's `roundup_power2_next_division`: up to the next (power-of-2 floor)/divisions step."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(size: int, divisions: int = 1) -> int:
    """torch's `round_size` with one roundup_power2_divisions value for every bucket."""
    if size < kMinBlockSize:
        return kMinBlockSize
    if divisions > 1 and size > kMinBlockSize * divisions:
        return roundup_power2_next_division(size, divisions)
    return kMinBlockSize * -(-size // kMinBlockSize)


def is_small(rounded: int) -> bool:
    """`get_pool`: True for the small pool (rounded size <= 1 MiB)."""
    return rounded <= kSmallSize


def get_allocation_size(rounded: int) -> int:
    """The segment size cudaMalloc'd for a rounded request."""
    if rounded <= kSmallSize:
        return kSmallBuffer
    if rounded < kMinLargeAlloc:
        return kLargeBuffer
    return kRoundLarge * -(-rounded // kRoundLarge)


# ------------------------------------------------------------------------ structures
@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class Block:
    """A range of one segment: allocated, free (cached) or unmapped (expandable only)."""

    __slots__ = ("allocated", "mapped", "next", "pool", "prev", "ptr", "requested", "seg", "size")

    def __init__(
        self, ptr: int, size: int, pool: Pool, seg: ExpandableSegment | None = None
    ) -> None:
        self.ptr = ptr
        self.size = size
        self.pool = pool
        self.seg = seg
        self.requested = 0
        self.allocated = False
        self.mapped = True
        self.prev: Block | None = None
        self.next: Block | None = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after

    def __repr__(self) -> str:
        state = "alloc" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"Block({self.ptr:#x}, {self.size}, {state})"


def _size_then_address(b: Block) -> tuple[int, int]:
    return b.size, b.ptr


def _address(b: Block) -> int:
    return b.ptr


def _no_units(size: int, unit: int) -> int:
    return 0


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class Pool:
    """A BlockPool: free blocks by (size, address); unmapped expandable blocks by address.

    Once asked to (`count_units`), it also keeps what its free blocks serve allocations of
    one size, as blocks come and go, so that the allocator's free-space view does not scan
    them at every event (without expandable segments a free block's size and neighbours do
    not change while it is in the pool)."""

    def __init__(self, small: bool) -> None:
        self.is_small = small
        self.name = "small_pool" if small else "large_pool"
        # (module-level keys, not lambdas: compiled lambdas do not deep-copy)
        self.blocks = SortedKeyList(key=_size_then_address)
        self.unmapped = SortedKeyList(key=_address)
        self.unit = 0  # the allocation size counted (0: none)
        self._units: Callable[[int, int], int] = _no_units
        self.served = 0  # sum over the free blocks of the units each serves, x unit
        self.whole_serving = 0  # bytes of those serving any that are whole segments

    def add(self, block: Block) -> None:
        self.blocks.add(block)
        if self.unit:
            self._count(block, 1)

    def remove(self, block: Block) -> None:
        self.blocks.remove(block)
        if self.unit:
            self._count(block, -1)

    def count_units(self, unit: int, units: Callable[[int, int], int]) -> None:
        """Count from now on what the free blocks serve allocations of `unit` bytes, by
        `units(block size, unit)` (0 for blocks smaller than unit)."""
        self.unit, self._units = unit, units
        self.served = self.whole_serving = 0
        for block in self.blocks.islice(self.blocks.bisect_key_left((unit, -1))):
            self._count(block, 1)

    def _count(self, block: Block, sign: int) -> None:
        n = self._units(block.size, self.unit)
        if n:
            self.served += sign * n * self.unit
            if not block.is_split():
                self.whole_serving += sign * block.size


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
@dataclass
class ExpandableSegment:
    ptr: int
    page: int  # bytes per physical page (2 MiB small pool, 20 MiB large pool)
    npages: int  # virtual size in pages

    @property
    def size(self) -> int:
        return self.page * self.npages


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class Stat:
    __slots__ = ("allocated", "current", "freed", "peak")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def inc(self, amount: int) -> None:
        self.current += amount
        self.peak = max(self.peak, self.current)
        self.allocated += amount

    def dec(self, amount: int) -> None:
        self.current -= amount
        assert self.current >= 0, "negative allocator stat"
        self.freed += amount


# ----------------------------------------------------- the expandable free-space replay
def expandable_items(pool: Pool) -> list[list[int]]:
    """The pool's expandable segments by address as [kind, ptr, size, segment ptr] items,
    each segment opened by a SEP item (a barrier, like an allocated block)."""
    heads: dict[int, Block] = {}
    for b in itertools.chain(pool.blocks, pool.unmapped):
        seg = b.seg
        if seg is not None and seg.ptr not in heads:
            while b.prev is not None:
                b = b.prev
            heads[seg.ptr] = b
    items: list[list[int]] = []
    for segptr in sorted(heads):
        items.append([SEP, segptr, 0, segptr])
        cur: Block | None = heads[segptr]
        while cur is not None:
            kind = ALLOC if cur.allocated else (FREE if cur.mapped else UNMAPPED)
            items.append([kind, cur.ptr, cur.size, segptr])
            cur = cur.next
    return items


def find_expandable(items: list[list[int]], start: int, s: int) -> int | None:
    """find_expandable_block: the index where the first hole from `start` whose run (from
    its free predecessor on, free and unmapped bytes up to a barrier) holds s begins."""
    n = len(items)
    for j in range(start, n):
        if items[j][0] != UNMAPPED:
            continue
        c = j - 1 if items[j - 1][0] == FREE else j
        total, i = 0, c
        while total < s and i < n and items[i][0] in (FREE, UNMAPPED):
            total += items[i][2]
            i += 1
        if total >= s:
            return c
    return None


def unmap_free_pages(items: list[list[int]], page: int) -> tuple[list[list[int]], int]:
    """release_blocks on the items: unmap the whole pages of every free block (merging
    holes), drop segments left with nothing mapped; returns (items, bytes unmapped)."""
    if not any(
        kind == FREE and (ptr + size - sp) // page > -(-(ptr - sp) // page)
        for kind, ptr, size, sp in items
    ):
        return items, 0
    out: list[list[int]] = []
    unmapped = 0
    for kind, ptr, size, sp in items:
        pieces = [(kind, ptr, size)]
        if kind == FREE:
            first, last = -(-(ptr - sp) // page), (ptr + size - sp) // page
            if last > first:
                uptr, usize = sp + first * page, (last - first) * page
                unmapped += usize
                end = ptr + size
                pieces = [(FREE, ptr, uptr - ptr), (UNMAPPED, uptr, usize)]
                pieces.append((FREE, uptr + usize, end - uptr - usize))
        for k, p, n in pieces:
            if n == 0 and k != SEP:
                continue
            if k == UNMAPPED and out and out[-1][0] == UNMAPPED:
                out[-1][2] += n
            else:
                out.append([k, p, n, sp])
    # a segment with nothing allocated is now one hole: release_expandable_segment
    kept: list[list[int]] = []
    seg_start = 0
    for i, it in enumerate([*out, [SEP, 0, 0, 0]]):
        if it[0] == SEP and i > 0:
            segment = out[seg_start:i]
            if any(x[0] == ALLOC for x in segment):
                kept += segment
            seg_start = i
    return kept, unmapped


def whole_pages(block: Block, start: int) -> int:
    """Bytes of whole pages of an expandable free block from `start` to its end."""
    seg = block.seg
    assert seg is not None
    first = -(-(start - seg.ptr) // seg.page)
    last = (block.ptr + block.size - seg.ptr) // seg.page
    return max(0, last - first) * seg.page

def expandable_units(
    pool: Pool, other: Pool, s: int, g: int, cap: int, reserved: int, next_addr: int,
    max_split_size: int | None,
) -> int | None:
    """Probe units with expandable segments: the malloc path replayed on a light copy of
    the pool's segments (address-ordered [kind, ptr, size, segment ptr] items), in bulk.

    With no max_split_size every free block >= s serves floor(B/s) first (best fit takes
    them all before anything is mapped), leaving B mod s at its end. Then each
    alloc_block: the cap check (reserved + g <= cap, else release_cached_blocks unmaps
    whole free pages in both pools and the check is retried once, failing -> OOM), the
    first hole (by address) whose run from its free predecessor holds s, pages mapped
    from the hole's start until the merged block reaches s, and that block serves
    floor(C/s) with C mod s left free before the rest of the hole. With s <= page every
    map is one page in the same hole, so a hole is mapped as far as the headroom allows
    in one go. max_split_size changes none of this unless get_free_block could meet a block
    it refuses: an initial free block >= M (s < M) or >= s + 20 MiB (s >= M), or a mapped
    block's leftover (< s + page) reaching M; then the probe allocations are replayed one
    by one on a copy of the pools instead (exact, linear in their number): None says so, and
    the allocator replays (`TorchCachingAllocator._units_by_replay`). `cap`, `reserved` and
    `next_addr` are the allocator's capacity, reserved bytes and next segment address."""
    page = kSmallBuffer if pool.is_small else kLargeBuffer
    M = max_split_size
    if M is not None:
        largest = pool.blocks[-1].size if pool.blocks else 0
        if (s < M and (s + page > M or largest >= M)) or (
            s >= M and largest >= s + kLargeBuffer
        ):
            return None
    units = 0
    items: list[list[int]] = []
    for it in expandable_items(pool):
        if it[0] == FREE and it[2] >= s:
            k, rem = divmod(it[2], s)
            units += k
            items.append([ALLOC, it[1], k * s, it[3]])
            if rem:
                items.append([FREE, it[1] + k * s, rem, it[3]])
        else:
            items.append(it)
    other_pages = sum(whole_pages(b, b.ptr) for b in other.blocks)
    start = 0  # holes before this index lack space (until pages are unmapped)
    while True:
        if reserved + g > cap:  # the OOM path: release_cached_blocks, then one retry
            items, unmapped = unmap_free_pages(items, page)
            reserved -= unmapped + other_pages
            other_pages, start = 0, 0
            if reserved + g > cap:
                return units
        pos = find_expandable(items, start, s)
        if pos is None:  # a new segment
            size = -(-(cap + cap // 8) // page) * page
            ptr, next_addr = next_addr, -(-(next_addr + size) // SEGMENT_ALIGN) * SEGMENT_ALIGN
            pos = len(items) + 1
            items += [[SEP, ptr, 0, ptr], [UNMAPPED, ptr, size, ptr]]
        start = pos
        base, segptr = items[pos][1], items[pos][3]
        j, cur = pos, 0
        if items[j][0] == FREE:
            cur, j = items[j][2], j + 1
        rest = None
        while True:
            hole = items[j]
            assert hole[0] == UNMAPPED
            # s <= page: one page per malloc, while the cap check passes
            n = (cap - reserved - g) // page + 1 if s <= page else -(-(s - cur) // page)
            m = min(n * page, hole[2])
            reserved += m
            cur += m
            j += 1
            if m < hole[2]:
                rest = [UNMAPPED, hole[1] + m, hole[2] - m, segptr]
                break
            if j < len(items) and items[j][0] == FREE:  # merges with the next free block
                cur, j = cur + items[j][2], j + 1
            if cur >= s:
                break
        k, rem = divmod(cur, s)
        units += k
        new = [[ALLOC, base, k * s, segptr]]
        if rem:
            new.append([FREE, base + k * s, rem, segptr])
        if rest is not None:
            new.append(rest)
        items[pos:j] = new
