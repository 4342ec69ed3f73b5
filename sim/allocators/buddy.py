"""A binary buddy allocator over token slots: the Orca baselines of the PagedAttention paper.

The unit is the token slot (one token's keys and values). A reservation of R tokens takes a
block of 2^k slots, k = ceil(log2 R): the rounding is internal fragmentation. Free blocks are
kept per order; allocation splits the smallest free block that fits (lowest address first),
freeing merges a block with its buddy while the buddy is free.

A budget need not be a power of two: its slots are covered by power-of-two top blocks, largest
first, so each top block is aligned to its own size and buddies never cross top blocks. Bytes
beyond the last whole slot can never be allocated and count as external fragmentation.
"""

from __future__ import annotations

from bisect import bisect_right

from kvfrag.sim.allocators.base import Request
from kvfrag.sim.allocators.slab import Reserve, SlabAllocator
from mypy_extensions import mypyc_attr
from sortedcontainers import SortedList


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class BuddyAllocator(SlabAllocator):
    """Power-of-two blocks of token slots with split and merge."""

    kind = "buddy"

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        reserve: Reserve | str = Reserve.MAX_MODEL_LEN,
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len, reserve)
        slots = self.capacity // self.bytes_per_token
        self.slots = slots
        self._top_starts: list[int] = []  # slot offset of each top block
        self._top_orders: list[int] = []
        self._free: list[SortedList] = [SortedList() for _ in range(max(slots.bit_length(), 1))]
        start = 0
        for order in reversed(range(slots.bit_length())):
            if slots >> order & 1:
                self._top_starts.append(start)
                self._top_orders.append(order)
                self._free[order].add(start)
                start += 1 << order

    @staticmethod
    def order(tokens: int) -> int:
        """The block order (log2 of slots) that holds `tokens` tokens."""
        return (tokens - 1).bit_length()

    def slab_bytes(self, tokens: int) -> int:
        return (1 << self.order(tokens)) * self.bytes_per_token

    def _max_slab(self) -> int:
        return (1 << self._top_orders[0]) * self.bytes_per_token if self._top_orders else 0

    def free_blocks(self) -> list[tuple[int, int]]:
        """(slot offset, order) of every free block, by address."""
        return sorted((off, k) for k, offs in enumerate(self._free) for off in offs)

    def _place(self, nbytes: int) -> int | None:
        k = (nbytes // self.bytes_per_token).bit_length() - 1
        for j in range(k, len(self._free)):
            if self._free[j]:
                offset = self._free[j].pop(0)
                while j > k:  # split, keeping the lower half
                    j -= 1
                    self._free[j].add(offset + (1 << j))
                return offset * self.bytes_per_token
        return None

    def _unplace(self, offset: int, nbytes: int) -> None:
        slot = offset // self.bytes_per_token
        k = (nbytes // self.bytes_per_token).bit_length() - 1
        top = self._top_orders[bisect_right(self._top_starts, slot) - 1]
        while k < top:
            buddy = slot ^ (1 << k)
            if buddy not in self._free[k]:
                break
            self._free[k].remove(buddy)
            slot = min(slot, buddy)
            k += 1
        self._free[k].add(slot)

    def _usable_free(self, probe: Request | None) -> int:
        k = self.order(self.reservation_tokens(probe)) if probe is not None else 0
        slots = sum(len(offs) << j for j, offs in enumerate(self._free) if j >= k)
        return slots * self.bytes_per_token

    def _largest_hole(self) -> int:
        for j in reversed(range(len(self._free))):
            if self._free[j]:
                return (1 << j) * self.bytes_per_token
        return 0
