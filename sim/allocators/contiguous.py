"""Contiguous slabs in a real address space of `capacity` bytes, with real holes.

Each request gets one slab of (reservation x bytes_per_token) bytes at some offset. Freeing
leaves a hole that coalesces with free neighbours; later requests may not fit any single hole
even when the holes add up to more than they need. That is external fragmentation, and the
placement policy decides how much of it builds up:
- first-fit: the lowest-addressed hole that fits;
- best-fit: the smallest hole that fits (lowest address on ties);
- worst-fit: the largest hole (lowest address on ties);
- next-fit: first-fit, starting where the previous placement ended, wrapping around.
The free list is kept twice, by address (to coalesce) and by size (for best/worst fit).
"""

from __future__ import annotations

from enum import Enum

from sortedcontainers import SortedDict, SortedList

from sim.allocators.base import Request
from sim.allocators.slab import Reserve, SlabAllocator, parse_enum


class Placement(str, Enum):
    FIRST_FIT = "first-fit"
    BEST_FIT = "best-fit"
    WORST_FIT = "worst-fit"
    NEXT_FIT = "next-fit"


class ContiguousAllocator(SlabAllocator):
    """One contiguous slab per request, placed in a byte address space by a fit policy."""

    kind = "contiguous"

    def __init__(
        self,
        capacity: int,
        bytes_per_token: int,
        max_model_len: int,
        reserve: Reserve | str = Reserve.MAX_MODEL_LEN,
        placement: Placement | str = Placement.FIRST_FIT,
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len, reserve)
        self.placement = parse_enum(Placement, placement, "placement policy")
        self._holes = SortedDict({0: capacity})  # offset -> size
        self._by_size = SortedList([(capacity, 0)])  # (size, offset)
        self._rover = 0  # next-fit: where the last placement ended
        self._usable: tuple[int, int] = (0, 0)  # (unit, usable bytes) while the holes stay

    def slab_bytes(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def _max_slab(self) -> int:
        return self.capacity

    def holes(self) -> list[tuple[int, int]]:
        """(offset, size) of every free hole, by address."""
        return list(self._holes.items())

    def _place(self, nbytes: int) -> int | None:
        hole = self._find(nbytes)
        if hole is None:
            return None
        offset, size = hole
        self._take_hole(offset, size)
        if size > nbytes:
            self._add_hole(offset + nbytes, size - nbytes)
        self._rover = offset + nbytes
        return offset

    def _find(self, nbytes: int) -> tuple[int, int] | None:
        if self.placement is Placement.BEST_FIT:
            i = self._by_size.bisect_left((nbytes, -1))
            if i == len(self._by_size):
                return None
            size, offset = self._by_size[i]
            return offset, size
        if self.placement is Placement.WORST_FIT:
            if not self._by_size or self._by_size[-1][0] < nbytes:
                return None
            largest = self._by_size[-1][0]
            size, offset = self._by_size[self._by_size.bisect_left((largest, -1))]
            return offset, size
        start = self._rover if self.placement is Placement.NEXT_FIT else 0
        # Holes at or after `start` first (the one containing `start` included), then wrap.
        first = max(self._holes.bisect_right(start) - 1, 0)
        if first < len(self._holes) and sum(self._holes.peekitem(first)) <= start:
            first += 1  # that hole ends before the rover
        for i in (*range(first, len(self._holes)), *range(first)):
            offset, size = self._holes.peekitem(i)
            if size >= nbytes:
                return offset, size
        return None

    def _unplace(self, offset: int, nbytes: int) -> None:
        end = offset + nbytes
        i = self._holes.bisect_left(offset)
        if i > 0:
            prev_off, prev_size = self._holes.peekitem(i - 1)
            if prev_off + prev_size == offset:
                self._take_hole(prev_off, prev_size)
                offset, nbytes = prev_off, nbytes + prev_size
        nxt = self._holes.get(end)
        if nxt is not None:
            self._take_hole(end, nxt)
            nbytes += nxt
        self._add_hole(offset, nbytes)

    def _take_hole(self, offset: int, size: int) -> None:
        self._usable = (0, 0)
        del self._holes[offset]
        self._by_size.remove((size, offset))

    def _add_hole(self, offset: int, size: int) -> None:
        self._usable = (0, 0)
        self._holes[offset] = size
        self._by_size.add((size, offset))

    def _usable_free(self, probe: Request | None) -> int:
        unit = self._unit(probe)
        if self._usable[0] != unit:  # recount only when the holes or the unit changed
            self._usable = (unit, sum(size - size % unit for size in self._holes.values()))
        return self._usable[1]

    def _largest_hole(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0
