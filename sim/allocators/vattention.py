"""Virtual-memory KV pages (vAttention, Prabhu et al. 2024): contiguous in virtual memory,
backed by physical pages mapped on demand.

Each request reserves a virtually contiguous range for its K and V buffer of every layer
(2 x layers buffers); virtual address space costs nothing, so only mapped physical pages are
counted. A page holds `page_size` bytes (P) of one buffer; one token appends
t = `bytes_per_buffer_token` bytes to every buffer at once, so all 2 x layers buffers of a
request need a new page at the same token counts. When P is a multiple of t this is exactly a
paged allocator whose block is P // t tokens and 2 x layers x P bytes (one page per buffer):
it is implemented as one, and everything (block counts, the closed-form decode steps, the
accounting) is inherited.

Waste: internal fragmentation is the unfilled part of the last page of each buffer, up to
2 x layers x (P - t) bytes per request (a 2 MiB page holds 1,024 tokens of llama-3-8b's
2,048-byte buffer rows but only 2,048 of qwen2.5-7b's 1,024-byte rows); external is the
budget's tail too small for one page per buffer. Physical pages are fungible, as paged
blocks are, so there are no holes.

Limitation: a page size that is not a multiple of t (a token row straddling two pages) is
refused with a ValueError; real vAttention lets rows straddle pages, which this model does not
represent. The model geometry is required (`make_allocator` passes it to allocators that take
a `geometry` argument; scenarios always do).
"""

from __future__ import annotations

from sim.allocators.base import Allocator
from sim.allocators.paged import PagedAllocator
from sim.geometry import KVGeometry
from sim.units import format_size, parse_size


class VAttentionAllocator(PagedAllocator):
    """Per-buffer physical pages of `page_size` bytes mapped on demand (vAttention-style)."""

    kind = "vattention"

    def __init__(
        self,
        capacity: int,
        bytes_per_token: int,
        max_model_len: int,
        page_size: int | str = "2MiB",
        geometry: KVGeometry | None = None,
    ) -> None:
        # Check the common sizes first, so a bad one is reported as such.
        Allocator.__init__(self, capacity, bytes_per_token, max_model_len)
        if geometry is None:
            raise ValueError(
                "vattention needs the model geometry (geometry=KVGeometry or a preset): pages "
                "are per K/V buffer of every layer"
            )
        if geometry.bytes_per_token != bytes_per_token:
            raise ValueError(
                f"geometry {geometry.name!r} stores {geometry.bytes_per_token} bytes per token, "
                f"but bytes_per_token is {bytes_per_token}"
            )
        page = parse_size(page_size)
        row = geometry.bytes_per_buffer_token
        if page < 1 or page % row:
            raise ValueError(
                f"page_size {page} bytes ({format_size(page)}) is not a positive multiple of the "
                f"{row} bytes one token takes in one K/V buffer of {geometry.name!r}; pages "
                "whose token rows straddle two pages are not modelled"
            )
        self.page_size = page
        self.geometry = geometry
        self.buffers = 2 * geometry.layers  # K and V of every layer, one page each per block
        super().__init__(capacity, bytes_per_token, max_model_len, block_size=page // row)
        assert self.block_bytes == self.buffers * page

    @property
    def tokens_per_page(self) -> int:
        return self.block_size

    def pages_mapped(self) -> int:
        """Physical pages mapped now, over all buffers of all live requests."""
        return self._blocks_total() * self.buffers
