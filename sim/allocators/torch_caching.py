"""PyTorch's CUDA caching allocator, modelled operation by operation (no torch import).

Each request's slab (reservation x bytes_per_token bytes, as for the other slab allocators)
is one `torch.empty(nbytes, dtype=torch.uint8)` on a device whose allocator is capped at
`capacity` bytes, the way `torch.cuda.set_per_process_memory_fraction` caps it: a cudaMalloc
(or an expandable-segment map) that would take reserved memory past the cap fails without
calling CUDA. The rules follow `DeviceCachingAllocator` in `c10/cuda/CUDACachingAllocator.cpp`
(see ../shared/docs/torch-caching-allocator.md), with one stream, no CUDA graphs, no stream
events and no garbage collection:

- `round_size`: < 512 B -> 512; with roundup_power2_divisions d > 1 and n > 512*d, up to the
  next (largest power of 2 <= n)/d step (torch divides by the largest power of 2 <= d; d must
  be a power of 2, as torch's config parser demands); else up to a multiple of 512. One d
  applies to every size bucket (torch allows one per power-of-2 MiB bucket).
- pools: rounded size <= 1 MiB -> small, else large. `get_allocation_size`: 2 MiB for the small
  pool, 20 MiB below 10 MiB, else the size rounded up to 2 MiB.
- `get_free_block`: best fit in the pool's free set ordered by (size, address); with
  M = max_split_size a request < M never takes a block >= M, a request >= M never takes a block
  >= size + 20 MiB. `should_split`: small pool or expandable -> remainder >= 512; large pool ->
  size < M and remainder > 1 MiB. The allocation takes the low-address front.
- `free`: merge with free neighbours in the same segment; never cudaFree.
- nothing fits: cudaMalloc(get_allocation_size) if reserved + that <= cap; else (M finite)
  release cached oversize blocks and retry; else `release_cached_blocks` (cudaFree every whole
  free segment, unmap whole free pages) and retry (num_alloc_retries += 1); else OOM
  (an `oom` trace entry, num_ooms += 1) and the admission is refused.
- expandable_segments: one growing virtual segment per pool (1.125 x capacity of address
  space, torch sizes it from the device's total memory), pages of 2 MiB (small) / 20 MiB (large)
  mapped on demand from the lowest free address; the cap check uses get_allocation_size, as
  torch's does, while whole pages get mapped, so reserved may pass the cap by under a page (the
  device's physical memory is assumed larger than the cap: mapping itself never fails).

Segment addresses are virtual: each new segment starts at the next 2 MiB boundary after the
previous one's end, from ADDRESS_BASE, and is never reused. A request's offset is its block's
address. `events` records the trace (action, addr, size) as torch's memory history does
(alloc/free sizes are requested sizes; an oom's addr is the device's free bytes, modelled as
cap - reserved, its size the rounded request).

Accounting (per the protocol in `base`; b = bytes per token):
- A, a request's allocated bytes, is its block's size: rounded, or the whole unsplit block
  (a 13.5 MiB request in a fresh 14 MiB segment holds 14 MiB: the tail is internal waste).
- free = capacity - sum(A): cached-but-unallocated blocks plus memory not reserved.
- usable_free, judged by the probe's rounded size s (pool P, segment size g = get_allocation_
  size(s)): whole units of s that repeated probe allocations would place before an OOM:
  * every free block of pool P contributes s x the units it would serve under the split and
    max_split rules (small pool / expandable: floor(B/s); large pool: split while the
    remainder exceeds 1 MiB, the last unit takes the unsplit tail; a block torch would refuse
    for the probe serves none);
  * the headroom H = (capacity - reserved) + the whole free cached segments that serve no
    unit (the OOM path would cudaFree them first) serves floor(H/g) fresh segments, each with
    the units a fresh g-byte segment gives. This is exact: it equals s x the number of probe
    allocations that would succeed in a row (the tests check it by simulation).
  * expandable: the malloc path is replayed in bulk on a light copy of pool P's segments: free
    blocks serve floor(B/s); then each map goes to the lowest unmapped hole whose run (from the
    free block before it) holds s, maps pages from the hole's start while reserved + g <= cap,
    and the merged block serves floor(C/s), its leftover staying free before the rest of the
    hole; when the cap check fails the whole free pages of both pools are unmapped (the OOM
    path) and mapping goes on. Exact as well (with max_split_size set the probe allocations
    are replayed one by one on a copy of the pools: exact, but linear in their number).
  The result is capped at `free` (expandable mapping may pass the cap by under a page).
- external = free - usable_free: reserved-but-unallocated memory that fits no probe (split
  remainders, the other pool's cached blocks, segment tails) plus headroom that cannot hold a
  whole segment. It is the figure torch reports as "reserved by PyTorch but unallocated" when it
  raises an OOM, restricted to what cannot serve the next request.

Refused admissions are not side-effect free, unlike the other allocators: torch's failing
malloc still releases cached segments (and counts num_alloc_retries / num_ooms), so `reserved`
and the free-space view may change while the allocated bytes do not.
"""

from __future__ import annotations

import itertools

from kvfrag.sim.allocators.base import Grant, Live, Reason, Refusal, Request
from kvfrag.sim.allocators.slab import Reserve, SlabAllocator
from kvfrag.sim.allocators.torch_blocks import (
    ADDRESS_BASE,
    POOL_NAMES,
    SEGMENT_ALIGN,
    STAT_NAMES,
    Block,
    ExpandableSegment,
    MiB,
    Pool,
    Stat,
    expandable_units,
    get_allocation_size,
    is_small,
    kLargeBuffer,
    kMinBlockSize,
    kSmallBuffer,
    kSmallSize,
    round_size,
)
from kvfrag.sim.allocators.torch_verify import verify
from mypy_extensions import mypyc_attr


# ------------------------------------------------------------------------ the allocator
@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class TorchCachingAllocator(SlabAllocator):
    """PyTorch's CUDA caching allocator under a per-process memory cap of `capacity` bytes."""

    kind = "torch-caching"

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        reserve: Reserve | str = Reserve.MAX_MODEL_LEN,
        expandable_segments: object = False,
        max_split_size_mb: object = None,
        roundup_power2_divisions: object = 1,
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len, reserve)
        if not isinstance(expandable_segments, bool):
            raise ValueError(f"expandable_segments must be a bool, got {expandable_segments!r}")
        if max_split_size_mb is None:
            self.max_split_size: int | None = None
        else:
            if isinstance(max_split_size_mb, bool) or not isinstance(
                max_split_size_mb, (int, float)
            ):
                raise ValueError(f"max_split_size_mb must be a number, got {max_split_size_mb!r}")
            if not max_split_size_mb > kLargeBuffer // MiB:
                raise ValueError(
                    f"max_split_size_mb must be > {kLargeBuffer // MiB} (as torch requires), "
                    f"got {max_split_size_mb!r}"
                )
            self.max_split_size = int(max_split_size_mb * MiB)
        d = roundup_power2_divisions
        if isinstance(d, bool) or not isinstance(d, int) or d < 1 or d & (d - 1):
            raise ValueError(f"roundup_power2_divisions must be a power of 2 >= 1, got {d!r}")
        self.expandable_segments = expandable_segments
        self.max_split_size_mb: object = max_split_size_mb  # as given (512 stays an int)
        self.roundup_power2_divisions = d
        self.small_pool = Pool(small=True)
        self.large_pool = Pool(small=False)
        self._active: dict[int, Block] = {}  # ptr -> allocated block
        self._segments: dict[int, tuple[int, Pool]] = {}  # non-expandable: ptr -> (size, pool)
        self._expandable: list[ExpandableSegment] = []
        self._next_addr = ADDRESS_BASE
        self.events: list[tuple[str, int, int]] = []
        self._stats = {(n, p): Stat() for n in STAT_NAMES for p in POOL_NAMES}
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.num_sync_all_streams = 0
        self._version = 0  # bumped on every change of the free structures
        self._usable_cache: tuple[int, int, int] = (-1, 0, 0)  # (version, unit, usable)

    # ------------------------------------------------------------ size helpers
    def round_size(self, nbytes: int) -> int:
        return round_size(nbytes, self.roundup_power2_divisions)

    def slab_bytes(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def bytes_for(self, req: Request, tokens: int) -> int:
        """The rounded size (an unsplit block handed out may be larger)."""
        return self.round_size(super().bytes_for(req, tokens))

    def _max_slab(self) -> int:
        return self.capacity

    @property
    def reserved_bytes(self) -> int:
        return self._stats["reserved_bytes", "all"].current

    @property
    def allocated_total(self) -> int:
        return self._stats["allocated_bytes", "all"].current

    def _pool(self, rounded: int) -> Pool:
        return self.small_pool if is_small(rounded) else self.large_pool

    def _inc(self, name: str, pool: Pool, amount: int) -> None:
        self._stats[name, "all"].inc(amount)
        self._stats[name, pool.name].inc(amount)

    def _dec(self, name: str, pool: Pool, amount: int) -> None:
        self._stats[name, "all"].dec(amount)
        self._stats[name, pool.name].dec(amount)

    def _trace(self, action: str, addr: int, size: int) -> None:
        self.events.append((action, addr, size))

    def _new_address(self, size: int) -> int:
        ptr = self._next_addr
        self._next_addr = -(-(ptr + size) // SEGMENT_ALIGN) * SEGMENT_ALIGN
        return ptr

    # ------------------------------------------------------------ slab hooks
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        rid = live.req.rid
        if live.req.n > 1:
            raise ValueError("torch-caching models one allocation per request, not n > 1 samples")
        nbytes = self.slab_bytes(live.cap)
        free = self.capacity - self._held
        offset = self._place(nbytes)
        if offset is not None and self._active[offset].size > free:
            # Expandable segments can map the last page past the fraction's cap, and torch
            # grants the allocation. The model hands it straight back and refuses, so that
            # allocated memory never exceeds the budget it accounts (a known divergence).
            # Like every refusal, it ends in an `oom` trace entry and counts in num_ooms.
            size = self._active[offset].size
            self._unplace(offset, size)
            self._trace("oom", max(0, self.capacity - self.reserved_bytes), size)
            self.num_ooms += 1
            return Refusal(rid, Reason.OUT_OF_MEMORY, size, free, "maps past the memory cap")
        if offset is None:
            rounded = self.round_size(nbytes)
            if get_allocation_size(rounded) > self.capacity:
                return Refusal(rid, Reason.TOO_LARGE, rounded, free, "segment larger than the cap")
            if rounded > free:
                return Refusal(rid, Reason.OUT_OF_MEMORY, rounded, free, "CUDA out of memory")
            return Refusal(
                rid, Reason.FRAGMENTED, rounded, free, "CUDA out of memory (reserved but unusable)"
            )
        size = self._active[offset].size
        live.offset, live.nbytes = offset, size
        self._held += size
        self._written += min(size, self.bytes_per_token * live.final)
        self._over += self._overreserved(size, live)
        return Grant(rid, size, live.cap, offset=offset)

    def _place(self, nbytes: int) -> int | None:
        block = self.malloc(nbytes)
        return None if block is None else block.ptr

    def _unplace(self, offset: int, nbytes: int) -> None:
        self.free_block(self._active[offset])

    # ------------------------------------------------------------ raw interface
    def raw_malloc(self, nbytes: int) -> int | None:
        """One torch allocation outside the request bookkeeping (trace replay): its address."""
        return self._place(nbytes)

    def raw_free(self, addr: int) -> None:
        """Free a block allocated by `raw_malloc`."""
        self.free_block(self._active[addr])

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): cudaFree whole free segments, unmap whole free pages."""
        self.release_cached_blocks()

    # ------------------------------------------------------------ malloc
    def malloc(self, orig_size: int) -> Block | None:
        """DeviceCachingAllocator::malloc: the block handed out, or None after an OOM."""
        if orig_size < 1:
            raise ValueError("allocation size must be positive")
        self._version += 1
        size = self.round_size(orig_size)
        pool = self._pool(size)
        alloc_size = get_allocation_size(size)
        block = self.get_free_block(pool, size)
        if block is None:
            block = self.alloc_block(pool, size, alloc_size, False)
        if block is None and self.release_available_cached_blocks(pool, size):
            block = self.alloc_block(pool, size, alloc_size, False)
        if block is None and self.release_cached_blocks():
            block = self.alloc_block(pool, size, alloc_size, True)
        if not block:
            self._trace("oom", max(0, self.capacity - self.reserved_bytes), size)
            self.num_ooms += 1
            return None
        return self.alloc_found_block(block, size, orig_size, self.should_split(block, size))

    def get_free_block(self, pool: Pool, size: int) -> Block | None:
        blocks = pool.blocks
        i = blocks.bisect_key_left((size, -1))
        if i == len(blocks):
            return None
        if blocks[i].seg is not None:
            # Expandable: a block that can grow into the unmapped space after it counts as
            # that big, so a later block of smaller expandable size is preferred.
            def esize(b: Block) -> int:
                nxt = b.next
                return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

            j = i + 1
            while j < len(blocks) and esize(blocks[j]) < esize(blocks[i]):
                i, j = j, j + 1
        block = blocks[i]
        M = self.max_split_size
        if M is not None:
            if size < M and block.size >= M:
                return None
            if size >= M and block.size >= size + kLargeBuffer:
                return None
        pool.remove(block)
        return block

    def should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.is_small or self.expandable_segments:
            return remaining >= kMinBlockSize
        M = self.max_split_size
        return (M is None or size < M) and remaining > kSmallSize

    def alloc_block(self, pool: Pool, size: int, alloc_size: int, is_retry: bool) -> Block | None:
        if is_retry:
            self.num_alloc_retries += 1
        if self.reserved_bytes + alloc_size > self.capacity:
            return None
        if self.expandable_segments:
            return self.try_allocate_expandable_block(pool, size)
        ptr = self._new_address(alloc_size)
        block = Block(ptr, alloc_size, pool)
        self._segments[ptr] = (alloc_size, pool)
        self._inc("segment", pool, 1)
        self._inc("reserved_bytes", pool, alloc_size)
        self.num_device_alloc += 1
        self._trace("segment_alloc", ptr, alloc_size)
        return block

    def alloc_found_block(self, block: Block, size: int, orig_size: int, split: bool) -> Block:
        pool = block.pool
        already_split = block.is_split()
        if split:
            remaining = block
            block = Block(remaining.ptr, size, pool, remaining.seg)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            pool.add(remaining)
            if remaining.seg is None:
                if already_split:
                    self._dec("inactive_split_bytes", pool, block.size)
                else:
                    self._inc("inactive_split_bytes", pool, remaining.size)
                    self._inc("inactive_split", pool, 1)
        elif already_split and block.seg is None:
            self._dec("inactive_split_bytes", pool, block.size)
            self._dec("inactive_split", pool, 1)
        block.allocated = True
        block.requested = orig_size
        self._trace("alloc", block.ptr, orig_size)
        self._active[block.ptr] = block
        self._inc("allocation", pool, 1)
        self._inc("allocated_bytes", pool, block.size)
        self._inc("active", pool, 1)
        self._inc("active_bytes", pool, block.size)
        self._inc("requested_bytes", pool, orig_size)
        return block

    # ------------------------------------------------------------ free
    def free_block(self, block: Block) -> None:
        """DeviceCachingAllocator::free (no stream uses: free_block at once)."""
        assert block.allocated and self._active.get(block.ptr) is block
        self._version += 1
        pool = block.pool
        block.allocated = False
        self._dec("allocation", pool, 1)
        self._dec("allocated_bytes", pool, block.size)
        self._trace("free_requested", block.ptr, block.requested)
        self._trace("free_completed", block.ptr, block.requested)
        del self._active[block.ptr]
        original_size, requested = block.size, block.requested
        net_blocks = net_bytes = 0
        for candidate in (block.prev, block.next):
            subsumed = self.try_merge_blocks(block, candidate, pool)
            if subsumed:
                net_blocks -= 1
                net_bytes -= subsumed
        block.requested = 0
        pool.add(block)
        if block.is_split():
            net_blocks += 1
            net_bytes += block.size
        if block.seg is None:
            if net_blocks > 0:
                self._inc("inactive_split", pool, net_blocks)
            elif net_blocks < 0:
                self._dec("inactive_split", pool, -net_blocks)
            if net_bytes > 0:
                self._inc("inactive_split_bytes", pool, net_bytes)
            elif net_bytes < 0:
                self._dec("inactive_split_bytes", pool, -net_bytes)
        self._dec("active", pool, 1)
        self._dec("active_bytes", pool, original_size)
        self._dec("requested_bytes", pool, requested)

    def try_merge_blocks(self, dst: Block, src: Block | None, pool: Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            pool.remove(src)
        else:
            pool.unmapped.remove(src)
        dst.size += src.size
        return src.size

    # ------------------------------------------------------------ release
    def release_available_cached_blocks(self, pool: Pool, size: int) -> bool:
        """With a finite max_split_size: cudaFree cached oversize blocks (smallest that covers
        the request, else the largest ones until they add up). Skipped with expandable
        segments, where torch would hit an internal assert."""
        M = self.max_split_size
        if M is None or self.expandable_segments:
            return False
        key = max(size, M)
        blocks = pool.blocks
        i = blocks.bisect_key_left((key, -1))
        if i == len(blocks):
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key and blocks[i].size >= M:
                released += blocks[i].size
                self.release_block(blocks[i])
                if i == 0:
                    break
                i -= 1
            if released < key:
                return False
        else:
            self.release_block(blocks[i])
        return True

    def release_cached_blocks(self) -> bool:
        self._version += 1
        self.num_sync_all_streams += 1
        self.release_blocks(self.large_pool)
        self.release_blocks(self.small_pool)
        return True

    def release_blocks(self, pool: Pool) -> None:
        to_unmap = []
        for block in list(pool.blocks):
            if block.seg is not None:
                to_unmap.append(block)
            elif not block.is_split():
                self.release_block(block)
        for block in to_unmap:
            self.unmap_block(block)
            if not block.mapped and not block.is_split():
                self.release_expandable_segment(block)

    def release_block(self, block: Block) -> None:
        assert block.seg is None and not block.is_split() and not block.allocated
        pool = block.pool
        self.num_device_free += 1
        self._trace("segment_free", block.ptr, block.size)
        del self._segments[block.ptr]
        self._dec("segment", pool, 1)
        self._dec("reserved_bytes", pool, block.size)
        pool.remove(block)

    # ------------------------------------------------------------ expandable segments
    def find_expandable_block(self, pool: Pool, size: int) -> Block:
        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated

        def has_space(b: Block | None) -> bool:
            total = 0
            while total < size and b is not None and not b.allocated:
                total += b.size
                b = b.next
            return total >= size

        for c in list(pool.unmapped):
            if allocatable(c.prev):
                c = c.prev
            if has_space(c):
                return c
        page = kSmallBuffer if pool.is_small else kLargeBuffer
        space = self.capacity + self.capacity // 8
        npages = -(-space // page)
        ptr = self._new_address(npages * page)
        seg = ExpandableSegment(ptr, page, npages)
        block = Block(ptr, npages * page, pool, seg)
        block.mapped = False
        self._expandable.append(seg)
        pool.unmapped.add(block)
        return block

    def map_block(self, to_map: Block, size: int) -> None:
        seg = to_map.seg
        assert seg is not None and not to_map.mapped and size <= to_map.size
        begin = (to_map.ptr - seg.ptr) // seg.page
        end = -(-(to_map.ptr + size - seg.ptr) // seg.page)
        assert seg.ptr + begin * seg.page == to_map.ptr
        mapped_ptr, mapped_size = to_map.ptr, (end - begin) * seg.page
        pool = to_map.pool
        pool.unmapped.remove(to_map)
        to_map.mapped = True
        if mapped_size < to_map.size:
            remaining = Block(to_map.ptr + mapped_size, to_map.size - mapped_size, pool, seg)
            remaining.mapped = False
            remaining.splice(to_map, to_map.next)
            pool.unmapped.add(remaining)
            to_map.size = mapped_size
        self.try_merge_blocks(to_map, to_map.prev, pool)
        self.try_merge_blocks(to_map, to_map.next, pool)
        pool.add(to_map)
        self._inc("reserved_bytes", pool, mapped_size)
        self.num_device_alloc += 1
        self._trace("segment_map", mapped_ptr, mapped_size)

    def try_allocate_expandable_block(self, pool: Pool, size: int) -> Block:
        candidate = self.find_expandable_block(pool, size)
        if not candidate.mapped:
            self.map_block(candidate, min(candidate.size, size))
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            self.map_block(nxt, min(size - candidate.size, nxt.size))
            candidate = nxt
        pool.remove(candidate)
        return candidate

    def unmap_block(self, block: Block) -> None:
        seg = block.seg
        assert seg is not None
        begin = -(-(block.ptr - seg.ptr) // seg.page)
        end = (block.ptr + block.size - seg.ptr) // seg.page
        if begin >= end:
            return
        pool = block.pool
        pool.remove(block)
        uptr, usize = seg.ptr + begin * seg.page, (end - begin) * seg.page
        before = uptr - block.ptr
        if before > 0:
            before_free = Block(block.ptr, before, pool, seg)
            before_free.splice(block.prev, block)
            pool.add(before_free)
        after = block.size - before - usize
        if after > 0:
            after_free = Block(uptr + usize, after, pool, seg)
            after_free.splice(block, block.next)
            pool.add(after_free)
        block.ptr, block.size, block.mapped = uptr, usize, False
        self.try_merge_blocks(block, block.prev, pool)
        self.try_merge_blocks(block, block.next, pool)
        pool.unmapped.add(block)
        self._dec("reserved_bytes", pool, usize)
        self.num_device_free += 1
        self._trace("segment_unmap", uptr, usize)

    def release_expandable_segment(self, block: Block) -> None:
        seg = block.seg
        assert seg is not None and block.size == seg.size and not block.mapped
        self._expandable.remove(seg)
        block.pool.unmapped.remove(block)

    # ------------------------------------------------------------ views
    def stats(self) -> dict[str, int]:
        """torch.cuda.memory_stats()-style flat dict (one device, no oversize tracking)."""
        out: dict[str, int] = {}
        for (name, pool), st in self._stats.items():
            for metric in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{pool}.{metric}"] = getattr(st, metric)
        out["num_alloc_retries"] = self.num_alloc_retries
        out["num_ooms"] = self.num_ooms
        out["num_device_alloc"] = self.num_device_alloc
        out["num_device_free"] = self.num_device_free
        out["num_sync_all_streams"] = self.num_sync_all_streams
        out["max_split_size"] = -1 if self.max_split_size is None else self.max_split_size
        return out

    def all_blocks(self) -> list[Block]:
        """Every block (allocated, free, unmapped), by address."""
        blocks = list(self._active.values())
        for pool in (self.small_pool, self.large_pool):
            blocks.extend(pool.blocks)
            blocks.extend(pool.unmapped)
        return sorted(blocks, key=lambda b: b.ptr)

    def segments(self) -> list[list[Block]]:
        """Segments as torch's snapshot reports them: lists of mapped blocks by address (an
        expandable segment gives one entry per contiguous mapped range)."""
        out: list[list[Block]] = []
        for block in self.all_blocks():
            if not block.mapped:
                continue
            if block.prev is not None and block.prev.mapped:
                out[-1].append(block)
            else:
                out.append([block])
        return out

    def whole_free_segment_bytes(self) -> int:
        """Bytes of cached non-expandable segments with nothing allocated (empty_cache frees)."""
        return sum(
            b.size
            for pool in (self.small_pool, self.large_pool)
            for b in pool.blocks
            if b.seg is None and not b.is_split()
        )

    def verify(self) -> None:
        """Check the structures against each other and the stats; raise AssertionError
        (`torch_verify`: a check for tests, kept out of the compiled allocator)."""
        verify(self)

    # ------------------------------------------------------------ free-space view
    def units(self, block_size: int, rounded: int, fresh: bool = False) -> int:
        """How many allocations of `rounded` bytes a free block of `block_size` serves in a row
        (fresh: a block straight from cudaMalloc, which skips the max_split checks)."""
        s, size, m = rounded, block_size, self.max_split_size
        if size < s:
            return 0
        if (
            not fresh
            and m is not None
            and ((s < m <= size) or (s >= m and size >= s + kLargeBuffer))
        ):
            return 0
        if is_small(s) or self.expandable_segments:
            return size // s
        if m is not None and s >= m:
            return 1  # never split
        n_split = max(0, (size - kSmallSize - 1) // s)
        return n_split + (1 if size - n_split * s >= s else 0)

    def _usable_free(self, probe: Request | None) -> int:
        s = self.round_size(self._unit(probe))
        version, unit, usable = self._usable_cache
        if version == self._version and unit == s:
            return usable
        pool = self._pool(s)
        other = self.large_pool if pool is self.small_pool else self.small_pool
        g = get_allocation_size(s)
        if self.expandable_segments:
            units = expandable_units(
                pool, other, s, g, self.capacity, self.reserved_bytes, self._next_addr,
                self.max_split_size,
            )
            usable = (self._units_by_replay(s) if units is None else units) * s
        else:
            # What the pool's free blocks serve is kept as they change (`Pool.count_units`);
            # the whole free segments that serve none (cudaFree'd first on the OOM path) are
            # the pools' whole free segments less those that do.
            if pool.unit != s:
                pool.count_units(s, self.units)
            usable = pool.served
            reclaim = self._whole_free_segments(pool) + self._whole_free_segments(other)
            reclaim -= pool.whole_serving
            headroom = max(0, self.capacity - self.reserved_bytes) + reclaim
            usable += headroom // g * self.units(g, s, fresh=True) * s
        usable = min(usable, self.capacity - self._held)
        self._usable_cache = (self._version, s, usable)
        return usable

    def _whole_free_segments(self, pool: Pool) -> int:
        """Bytes of the pool's free blocks that are whole segments, from torch's identity
        reserved = allocated + inactive split + whole free segments (no expandable ones)."""
        stats = self._stats
        return (
            stats["reserved_bytes", pool.name].current
            - stats["allocated_bytes", pool.name].current
            - stats["inactive_split_bytes", pool.name].current
        )

    def _units_by_replay(self, s: int) -> int:
        """Probe allocations of s bytes that succeed in a row, replayed on a copy of the
        pools (one malloc each: exact, linear in the answer)."""
        clone = TorchCachingAllocator(
            self.capacity,
            self.bytes_per_token,
            self.max_model_len,
            self.reserve,
            self.expandable_segments,
            self.max_split_size_mb,
            self.roundup_power2_divisions,
        )
        assert not self._segments  # expandable segments only
        copies: dict[int, Block] = {}
        pairs = ((self.small_pool, clone.small_pool), (self.large_pool, clone.large_pool))
        for pool, cpool in pairs:
            for b in itertools.chain(pool.blocks, pool.unmapped):
                head = b
                while head.prev is not None:
                    head = head.prev
                prev: Block | None = None
                cur: Block | None = head
                while cur is not None and id(cur) not in copies:
                    c = Block(cur.ptr, cur.size, cpool, cur.seg)
                    c.allocated, c.mapped = cur.allocated, cur.mapped
                    if not c.allocated and c.mapped:
                        cpool.add(c)
                    elif not c.allocated:
                        cpool.unmapped.add(c)
                    c.splice(prev, None)
                    copies[id(cur)] = c
                    prev, cur = c, cur.next
        clone._expandable = list(self._expandable)
        clone._next_addr = self._next_addr
        for name in POOL_NAMES:
            stat = self._stats["reserved_bytes", name]
            clone._stats["reserved_bytes", name].current = stat.current
        n = 0
        while clone.malloc(s) is not None:
            n += 1
        return n

    def _largest_hole(self) -> int:
        largest = max(0, self.capacity - self.reserved_bytes)
        for pool in (self.small_pool, self.large_pool):
            if pool.blocks:
                largest = max(largest, pool.blocks[-1].size)
        return min(largest, self.capacity - self._held)
