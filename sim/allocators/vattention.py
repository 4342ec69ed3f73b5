"""Virtual-memory KV pages (vAttention, Prabhu et al. 2024): contiguous in virtual memory,
backed by physical pages mapped on demand.

Each request reserves a virtually contiguous range for its K and V buffer of every layer
(2 x layers buffers); virtual address space costs nothing, so only mapped physical pages are
counted. A page holds `page_size` bytes (P) of one buffer; one token appends
t = `bytes_per_buffer_token` bytes to every buffer at once, so all 2 x layers buffers of a
request need a new page at the same token counts: a request storing L tokens maps
ceil(L*t/P) pages in each buffer, whatever P is (a token row may straddle two pages).

It is a paged allocator whose allocation unit ("block", `block_bytes`) is one page in every
buffer, 2 x layers x P bytes. With g = gcd(t, P), a = t/g and p = P/g, every p tokens fill
exactly a pages per buffer (`block_size` = p tokens, `pages_per_block` = a), and with offsets
o_i = floor(i*p/a), i = 0..a-1:

    ceil(L*a/p) = sum_i ceil((L - o_i)/p)        (L >= 0)

(write L = q*p + r, 0 <= r < p: term i is q + [r > o_i], and #{i : r > o_i} = ceil(r*a/p)).
So a decoder's page count is a terms of the paged allocator's kind, registered at offsets o_i
in its `FloorSum`, and everything else (the closed-form decode steps, `steps_until_full`,
`integrate`, the accounting) is inherited. When P is a multiple of t (a = 1) this is exactly
a paged allocator with P // t-token blocks. Cost: O(a) per decode cohort change and O(p) per
query; power-of-two pages keep a at the odd part of t (5 for the 10 KiB rows of opt-13b and
llama-2-13b, 9 for opt-66b, 3 for opt-175b).

Waste: internal fragmentation is the unwritten part of the last page of each buffer at the
request's final length, under 2 x layers x P bytes per request (a 2 MiB page holds 1,024
tokens of llama-3-8b's 2,048-byte buffer rows but 2,048 of qwen2.5-7b's 1,024-byte rows);
external is the budget's tail too small for one page per buffer. Physical pages are
fungible, as paged blocks are, so there are no holes. Block ids (`block_table`) name pages:
one id is one page in every buffer.

Limitations: sample groups (n > 1 samples or beams) are modelled only when P is a multiple of
t (they share whole pages as paged blocks); with rows straddling pages they are refused with a
ValueError at admission. The model geometry is required (`make_allocator` passes it to
allocators that take a `geometry` argument; scenarios always do).
"""

from __future__ import annotations

from fractions import Fraction
from math import gcd

from kvfrag.sim.allocators.base import Allocator, Live, Request
from kvfrag.sim.allocators.paged import PagedAllocator
from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.units import format_size, parse_size
from mypy_extensions import mypyc_attr


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class VAttentionAllocator(PagedAllocator):
    """Per-buffer physical pages of `page_size` bytes mapped on demand (vAttention-style)."""

    kind = "vattention"
    null_blocks = 0  # a pool of mapped pages: no placeholder block

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
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
        if page < 1:
            raise ValueError(f"page_size must be a positive number of bytes, got {page_size!r}")
        row = geometry.bytes_per_buffer_token
        g = gcd(row, page)
        self.page_size = page
        self.row = row  # t: bytes one token takes in one buffer
        self.geometry = geometry
        self.buffers = 2 * geometry.layers  # K and V of every layer
        self.pages_per_block = row // g  # a: pages per buffer that block_size tokens fill
        super().__init__(capacity, bytes_per_token, max_model_len, block_size=page // g)
        self._set_pool(self.buffers * page)  # a block is one page in every buffer
        p, a = self.block_size, self.pages_per_block
        self._offsets = tuple(i * p // a for i in range(a))  # o_i: where page i of a block starts

    @property
    def tokens_per_page(self) -> Fraction:
        """P / t: tokens one page holds (not a whole number when rows straddle pages)."""
        return Fraction(self.page_size, self.row)

    def pages_mapped(self) -> int:
        """Physical pages mapped now, over all buffers of all live requests."""
        return self._blocks_total() * self.buffers

    def _pages(self, tokens: int) -> int:
        """Pages one buffer of a sequence storing `tokens` tokens maps: ceil(L*t/P)."""
        return -(-tokens * self.row // self.page_size)

    # ------------------------------------------------- paged counts, by the page
    def _blocks_at(self, live: Live, tokens: int) -> int:
        if live.req.n == 1:
            return self._pages(tokens)
        return super()._blocks_at(live, tokens)

    def _count_blocks(self, req: Request, tokens: int, shared_blocks: int) -> int:
        if req.n == 1:
            return self._pages(tokens)
        if self.pages_per_block > 1:
            raise ValueError(
                f"request {req.rid}: vattention with token rows straddling pages does not model "
                f"sample groups (n={req.n}): {self.geometry.name!r} rows of {self.row} bytes in "
                f"{format_size(self.page_size)} pages; use a page size that is a multiple of "
                f"{self.row} bytes"
            )
        return super()._count_blocks(req, tokens, shared_blocks)

    def _waste(self, live: Live) -> int:
        unwritten = self._pages(live.final) * self.page_size - live.final * self.row
        return live.req.n * self.buffers * unwritten

    def _tail_waste(self, live: Live, tokens: int) -> int:
        unwritten = self._pages(tokens) * self.page_size - live.final * self.row
        if unwritten <= 0:
            return 0
        return self._sequences(live.req, tokens) * self.buffers * unwritten

    def _add_block_terms(self, phase: int, coef: int) -> None:
        # ceil((c + K)*a/p) pages = sum_i ceil((c + K - o_i)/p)
        last = phase + self.block_size - 1
        for o in self._offsets:
            self._blocks.add(last - o, coef)

    def _last_block_at(self, final: int) -> int:
        # The last page is entered by the first token whose row ends past the other pages.
        return (self._pages(final) - 1) * self.page_size // self.row + 1
