"""Contiguous slabs in a real address space of `capacity` bytes, with real holes.

Each request gets one slab of (reservation x bytes_per_token) bytes at some offset. Freeing
leaves a hole that coalesces with free neighbours; later requests may not fit any single hole
even when the holes add up to more than they need. That is external fragmentation, and the
placement policy decides how much of it builds up:
- first-fit: the lowest-addressed hole that fits;
- best-fit: the smallest hole that fits (lowest address on ties);
- worst-fit: the largest hole (lowest address on ties);
- next-fit: first-fit, starting where the previous placement ended, wrapping around.
The free list is kept twice, by address (to coalesce) and by size (for best/worst fit), as
plain sorted lists searched with `bisect`: holes number at most the live slabs + 1, so an
insertion's memmove costs less than a sorted container's interpreted bookkeeping.

Compaction (`compaction=True`): when an admission would be refused as FRAGMENTED (enough bytes
free, no hole fits), every live slab is moved down to the lowest addresses, in address order,
so all free space becomes one hole at the top, and the placement is retried. Moving costs
time: the bytes moved (sizes of the slabs whose offset changed) / `bandwidth`, the copy rate
(default "4.8TB/s", H200's HBM bandwidth: optimistic, since a device copy reads and writes each
byte, so half that is more realistic). The allocator keeps totals
(`compactions`, `bytes_moved`, `stall_s`); the engine takes the stall accrued since it last
asked (`take_stall`) and adds it to the iteration, and the moves (`take_moves`) to update
offsets and log them.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from enum import Enum

from kvfrag.sim.allocators.base import Grant, Live, Reason, Refusal, Request
from kvfrag.sim.allocators.slab import Reserve, SlabAllocator, parse_enum
from kvfrag.sim.units import parse_rate
from mypy_extensions import mypyc_attr

#: Fitting holes up to which `_find` picks among them rather than walking holes by address.
_FEW = 32


class Placement(str, Enum):
    FIRST_FIT = "first-fit"
    BEST_FIT = "best-fit"
    WORST_FIT = "worst-fit"
    NEXT_FIT = "next-fit"


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class ContiguousAllocator(SlabAllocator):
    """One contiguous slab per request, placed in a byte address space by a fit policy."""

    kind = "contiguous"

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        reserve: Reserve | str = Reserve.MAX_MODEL_LEN,
        placement: Placement | str = Placement.FIRST_FIT,
        compaction: object = False,
        bandwidth: float | str = "4.8TB/s",
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len, reserve)
        self.placement = parse_enum(Placement, placement, "placement policy")
        if not isinstance(compaction, bool):
            raise ValueError(f"compaction must be true or false, got {compaction!r}")
        self.compaction = compaction
        self.bandwidth = parse_rate(bandwidth)  # bytes per second a compaction copies
        self.compactions = 0
        self.bytes_moved = 0
        self.stall_s = 0.0
        self._stall = 0.0  # stall accrued since the engine last took it
        self._moves: list[tuple[int, int, int, int]] = []  # (rid, old, new, bytes) not yet taken
        self._offsets: list[int] = [0]  # every hole's offset, ascending
        self._sizes: dict[int, int] = {0: self.capacity}  # offset -> size
        self._by_size: list[tuple[int, int]] = [(self.capacity, 0)]  # (size, offset), ascending
        self._rover = 0  # next-fit: where the last placement ended
        self._usable: tuple[int, int] = (0, 0)  # (unit, usable bytes), kept as holes change

    def slab_bytes(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def _max_slab(self) -> int:
        return self.capacity

    def holes(self) -> list[tuple[int, int]]:
        """(offset, size) of every free hole, by address."""
        return [(offset, self._sizes[offset]) for offset in self._offsets]

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

    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        result = super()._admit(live, tokens)
        if isinstance(result, Refusal) and result.reason is Reason.FRAGMENTED and self.compaction:
            self._compact()  # all free bytes become one hole: now it fits
            result = super()._admit(live, tokens)
        return result

    def _compact(self) -> None:
        """Slide every live slab down, in address order, and merge the free space at the top."""
        slabs = []  # (offset, size, live, index): index 0 is live.offset, i > 0 extra[i - 1]
        for lv in self._live.values():
            extra = lv.extra or ()
            one = lv.nbytes // (1 + len(extra))
            slabs.append((lv.offset, one, lv, 0))
            slabs.extend((off, one, lv, i) for i, off in enumerate(extra, 1))
        slabs.sort(key=lambda s: s[0])
        at = moved = 0
        for offset, size, lv, i in slabs:
            if offset != at:
                if i == 0:
                    lv.offset = at
                else:
                    assert lv.extra is not None  # (i > 0: it has extra slabs)
                    lv.extra[i - 1] = at
                self._moves.append((lv.req.rid, offset, at, size))
                moved += size
            at += size
        self._offsets.clear()
        self._sizes.clear()
        self._by_size.clear()
        self._usable = (0, 0)
        if at < self.capacity:
            self._add_hole(at, self.capacity - at)
        self._rover = at
        stall = moved / self.bandwidth
        self.compactions += 1
        self.bytes_moved += moved
        self.stall_s += stall
        self._stall += stall

    def take_stall(self) -> float:
        """Seconds of compaction stall accrued since the last call (then reset to 0)."""
        stall, self._stall = self._stall, 0.0
        return stall

    def take_moves(self) -> list[tuple[int, int, int, int]]:
        """Slab moves (rid, old offset, new offset, bytes) since the last call, in order."""
        moves, self._moves = self._moves, []
        return moves

    def _find(self, nbytes: int) -> tuple[int, int] | None:
        by_size = self._by_size
        if self.placement is Placement.BEST_FIT:
            i = bisect_left(by_size, (nbytes, -1))
            if i == len(by_size):
                return None
            size, offset = by_size[i]
            return offset, size
        if self.placement is Placement.WORST_FIT:
            if not by_size or by_size[-1][0] < nbytes:
                return None
            size, offset = by_size[bisect_left(by_size, (by_size[-1][0], -1))]
            return offset, size
        offsets, sizes = self._offsets, self._sizes
        start = self._rover if self.placement is Placement.NEXT_FIT else 0
        # Holes at or after `start` first (the one containing `start` included), then wrap.
        first = max(bisect_right(offsets, start) - 1, 0)
        if first < len(offsets) and offsets[first] + sizes[offsets[first]] <= start:
            first += 1  # that hole ends before the rover
        fit = bisect_left(by_size, (nbytes, -1))  # the holes large enough: by_size[fit:]
        if fit == len(by_size):
            return None
        if len(by_size) - fit <= _FEW:
            # Few fit (as among the many small holes oracle slabs leave): the first of them
            # from `first` on by address, else the first of them.
            fitting = [offset for _, offset in by_size[fit:]]
            if first < len(offsets):
                after = offsets[first]
                fitting = [offset for offset in fitting if offset >= after] or fitting
            offset = min(fitting)
            return offset, sizes[offset]
        for k in range(len(offsets)):
            offset = offsets[(first + k) % len(offsets)]
            if sizes[offset] >= nbytes:
                return offset, sizes[offset]
        return None

    def _unplace(self, offset: int, nbytes: int) -> None:
        end = offset + nbytes
        i = bisect_left(self._offsets, offset)
        if i > 0:
            prev_off = self._offsets[i - 1]
            prev_size = self._sizes[prev_off]
            if prev_off + prev_size == offset:
                self._take_hole(prev_off, prev_size)
                offset, nbytes = prev_off, nbytes + prev_size
        nxt = self._sizes.get(end)
        if nxt is not None:
            self._take_hole(end, nxt)
            nbytes += nxt
        self._add_hole(offset, nbytes)

    def _take_hole(self, offset: int, size: int) -> None:
        unit, usable = self._usable
        if unit:
            self._usable = (unit, usable - (size - size % unit))
        del self._sizes[offset]
        del self._offsets[bisect_left(self._offsets, offset)]
        del self._by_size[bisect_left(self._by_size, (size, offset))]

    def _add_hole(self, offset: int, size: int) -> None:
        unit, usable = self._usable
        if unit:
            self._usable = (unit, usable + size - size % unit)
        self._sizes[offset] = size
        insort(self._offsets, offset)
        insort(self._by_size, (size, offset))

    def _usable_free(self, probe: Request | None) -> int:
        unit = self._unit(probe)
        if self._usable[0] != unit:  # count anew only for another unit
            # (holes smaller than a unit hold none: only those from the unit's size up count)
            fit = self._by_size[bisect_left(self._by_size, (unit, -1)) :]
            self._usable = (unit, sum(size - size % unit for size, _ in fit))
        return self._usable[1]

    def _largest_hole(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0
