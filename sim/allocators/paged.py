"""Paged KV cache (vLLM's PagedAttention): fixed-size blocks, a free list, a block table.

The budget is cut into `capacity // (block_size * bytes_per_token)` blocks. A request takes
blocks as it grows, one per `block_size` tokens, from any place in the pool: no reservation,
no holes. Its only waste is the unfilled tail of its last block (internal fragmentation, at
most block_size - 1 tokens) and the budget's tail too small for one block (external).

Speed: the decode cohort advances together, so per-request block counts are never updated
one by one. A decoder with phase c holds ceil((c + K)/bs) blocks at clock K; writing
c + bs - 1 = q*bs + r, that is q + floor((r + K)/bs), so the cohort's total is kept as
sum(q) plus a count of decoders per residue r: O(block_size) per query, however many run.
Block ids are handed out lazily (at admission, `grow`, and `block_table`), from a LIFO free
stack; the free-block count is always exact, and ids are fungible until someone asks for them.
"""

from __future__ import annotations

import math

from sortedcontainers import SortedList

from sim.allocators.base import Allocator, Grant, Live, Reason, Refusal, Request


def _p1(y: int, bs: int) -> int:
    """sum of floor(t/bs) for t in [0, y)."""
    q, m = divmod(y, bs)
    return bs * q * (q - 1) // 2 + m * q


def _p2(y: int, bs: int) -> int:
    """sum of t*floor(t/bs) for t in [0, y)."""
    q, m = divmod(y, bs)
    full = bs * bs * (q - 1) * q * (2 * q - 1) // 6 + bs * (bs - 1) * q * (q - 1) // 4
    return full + q * (m * q * bs + m * (m - 1) // 2)


class PagedAllocator(Allocator):
    """Fixed-size KV blocks taken on demand."""

    kind = "paged"

    def __init__(
        self, capacity: int, bytes_per_token: int, max_model_len: int, block_size: int = 16
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.block_bytes = block_size * bytes_per_token
        self.num_blocks = capacity // self.block_bytes
        self._stack = list(range(self.num_blocks - 1, -1, -1))  # free ids; pop() gives 0 first
        self._fixed_blocks = 0  # blocks of non-decoding requests
        self._fixed_internal = 0  # their internal fragmentation, bytes
        self._cnt = [0] * block_size  # decoders per residue r
        self._gq = 0  # sum of q over decoders
        self._dec_internal = 0  # internal bytes of decoders already in their last block
        self._pending = SortedList()  # (clock at which a decoder reaches its last block, rid)

    # ----------------------------------------------------------------- queries
    def free_blocks(self) -> int:
        return self.num_blocks - self._blocks_total()

    def blocks_of(self, rid: int) -> int:
        return -(-self.tokens(rid) // self.block_size)

    def allocated_bytes(self, rid: int) -> int:
        return self.blocks_of(rid) * self.block_bytes

    def bytes_for(self, req: Request, tokens: int) -> int:
        return -(-tokens // self.block_size) * self.block_bytes

    def block_table(self, rid: int) -> tuple[int, ...]:
        """The request's block ids, in token order (handing out any not yet named)."""
        live = self._get(rid)
        self._materialize(live, self.blocks_of(rid))
        return tuple(live.table or ())

    def steps_until_full(self) -> int | None:
        n_dec = self.n_decoding
        if not n_dec:
            return None
        bs = self.block_size
        free = self.free_blocks()
        periods, left = divmod(free, n_dec)  # every bs steps each decoder takes one block
        base = self._clock + periods * bs
        taken = 0
        for t in range(1, bs + 1):
            taken += self._cnt[-(base + t) % bs]
            if taken > left:
                return periods * bs + t - 1
        raise AssertionError("unreachable: a full period takes one block per decoder")

    # ---------------------------------------------------------------- internals
    def _blocks_total(self) -> int:
        bs, k = self.block_size, self._clock
        q, m = divmod(k, bs)
        crossed = sum(self._cnt[bs - m :]) if m else 0
        return self._fixed_blocks + self._gq + self.n_decoding * q + crossed

    def _waste(self, live: Live) -> int:
        """Bytes of the last block a request will never fill."""
        return (-live.final % self.block_size) * self.bytes_per_token

    def _tail_waste(self, live: Live, tokens: int) -> int:
        """Internal fragmentation of a request holding `tokens` tokens (only its last block)."""
        bs = self.block_size
        held = -(-tokens // bs) * bs
        return max(0, held - live.final) * self.bytes_per_token

    def _materialize(self, live: Live, blocks: int) -> tuple[int, ...]:
        table = live.table if live.table is not None else []
        live.table = table
        need = blocks - len(table)
        if need <= 0:
            return ()
        new = self._stack[-need:][::-1]
        del self._stack[-need:]
        table.extend(new)
        return tuple(new)

    def _refusal(self, rid: int, blocks: int, detail: str = "") -> Refusal:
        return Refusal(
            rid, Reason.OUT_OF_MEMORY, blocks * self.block_bytes, self.free_bytes(), detail
        )

    # -------------------------------------------------------------------- hooks
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        rid, bs = live.req.rid, self.block_size
        if -(-live.final // bs) > self.num_blocks:
            need = -(-live.final // bs) * self.block_bytes
            return Refusal(
                rid, Reason.TOO_LARGE, need, self.free_bytes(), "needs more blocks than exist"
            )
        need = -(-tokens // bs)
        if need > self.free_blocks():
            return self._refusal(rid, need)
        ids = self._materialize(live, need)
        self._fixed_blocks += need
        self._fixed_internal += self._tail_waste(live, tokens)
        return Grant(rid, need * self.block_bytes, live.cap, blocks=ids)

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        bs = self.block_size
        have, want = -(-old // bs), -(-new // bs)
        if want - have > self.free_blocks():
            return self._refusal(live.req.rid, want - have)
        ids = self._materialize(live, want)
        self._fixed_blocks += want - have
        self._fixed_internal += self._tail_waste(live, new) - self._tail_waste(live, old)
        return Grant(live.req.rid, (want - have) * self.block_bytes, live.cap, blocks=ids)

    def _release(self, live: Live) -> None:
        tokens = live.base
        self._fixed_blocks -= -(-tokens // self.block_size)
        self._fixed_internal -= self._tail_waste(live, tokens)
        if live.table:
            self._stack.extend(reversed(live.table))
        live.table = None

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        bs, rid = self.block_size, live.req.rid
        phase = live.base if decoding else live.base - self._clock
        tokens = phase + self._clock
        q, r = divmod(phase + bs - 1, bs)
        reach = bs * (-(-live.final // bs) - 1) + 1 - phase  # clock of entering the last block
        sign = 1 if decoding else -1
        self._cnt[r] += sign
        self._gq += sign * q
        self._fixed_blocks -= sign * -(-tokens // bs)
        self._fixed_internal -= sign * self._tail_waste(live, tokens)
        if decoding:
            if reach <= self._clock:
                self._dec_internal += self._waste(live)
            else:
                self._pending.add((reach, rid))
        elif (reach, rid) in self._pending:
            self._pending.remove((reach, rid))
        else:
            self._dec_internal -= self._waste(live)

    def _stepped(self) -> None:
        pending = self._pending
        while pending and pending[0][0] <= self._clock:
            _, rid = pending.pop(0)
            self._dec_internal += self._waste(self._live[rid])

    def _allocated_total(self) -> int:
        return self._blocks_total() * self.block_bytes

    def _internal_total(self) -> int:
        return self._fixed_internal + self._dec_internal

    def _usable_free(self, probe: Request | None) -> int:
        return self.free_blocks() * self.block_bytes

    def _largest_hole(self) -> int:
        # Block tables make the free pool one hole: any free block serves any request.
        return self._usable_free(None)

    def _integrate_held(self, n: int, w0: float, w1: float, weight: float) -> tuple[float, float]:
        bs, k = self.block_size, self._clock
        # sum_j w_j * decoder blocks at clock k+j, j = 1..n, per residue class.
        blocks = (self._fixed_blocks + self._gq) * weight
        for r, count in enumerate(self._cnt):
            if not count:
                continue
            whole, m0 = divmod(r + k + 1, bs)
            u1 = _p1(m0 + n, bs) - _p1(m0, bs)
            u2 = _p2(m0 + n, bs) - _p2(m0, bs) - m0 * u1
            blocks += count * (whole * weight + w0 * u1 + w1 * u2)
        internal = (self._fixed_internal + self._dec_internal) * weight
        for reach, rid in self._pending.irange(maximum=(k + n, math.inf)):
            j0 = reach - k  # first step (1-based) spent in the last block
            steps = n - j0 + 1
            tail = steps * w0 + w1 * (steps * (j0 - 1) + steps * (steps - 1) / 2)
            internal += self._waste(self._live[rid]) * tail
        return blocks * self.block_bytes, internal

    def _integrate_free(
        self, probe: Request | None, weight: float, allocated: float
    ) -> tuple[float, float]:
        pool = self.num_blocks * self.block_bytes
        return pool * weight - allocated, (self.capacity - pool) * weight
