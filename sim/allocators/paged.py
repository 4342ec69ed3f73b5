"""Paged KV cache (vLLM's PagedAttention): fixed-size blocks, a free list, a block table.

The budget is cut into `capacity // (block_size * bytes_per_token)` blocks, vLLM's
`num_gpu_blocks`. As vLLM's `BlockPool` does, block 0 is the pool's null block (a placeholder
no request holds: never handed out, never free), so requests share `usable_blocks`, one fewer;
the watermark is int(w x num_blocks), the null block counted, as vLLM rounds it. A request
takes blocks as it grows, one per `block_size` tokens, from any place in the pool: no
reservation, no holes. Its only waste is the unfilled tail of its last block (internal
fragmentation, at most block_size - 1 tokens); the null block and the budget's tail too small
for one block are bytes no request can take (external).

Sharing (a request with n sequences, generated in lockstep):
- parallel sampling keeps the prompt's S full blocks once, by reference; each sample copies
  the partial last prompt block (copy on write at its first token) and grows its own blocks:
  n*ceil(L/bs) - (n-1)*S blocks;
- beam search shares more: beams keep one trunk of full blocks and a private copy of the
  current partial block each. When the partial blocks fill, the beams are pruned back to one
  trunk (the model's simplification of beam genealogy: beams coalesce within a block):
  n*ceil(L/bs) - (n-1)*floor(L/bs) blocks, n*L - (n-1)*bs*floor(L/bs) distinct tokens.
Shared tokens count once in token_states; `saved_by_sharing` is what copies would add.
Internal fragmentation is each sequence's unfilled last block at its final length.

Speed: the decode cohort advances together, so per-request block counts are never updated
one by one. Every count above is a sum of terms coef * floor((c + K + o)/bs) in the decode
clock K (c a request's phase, o an offset); writing c + o = q*bs + r that is
q + floor((r + K)/bs), so each sum is kept as sum(coef*q) plus signed counts per residue r
in use (`FloorSum`): O(log) per query and O(min(block_size, decoders)) per integral, however
many requests run.
Block ids are handed out lazily (at admission, `grow`, and `block_table`; after
`defer_block_ids`, a single sequence's only when `block_table` asks), from a LIFO free stack;
the free-block count is always exact, and ids are fungible until someone asks for them.
When they are named, a group's ids follow its sequences from the tokens of its last naming
(`block_tables`: one table per sequence): the prompt is prefilled through one table; at the
fork sequences 1..n-1 take a block each that is a copy of the partial prompt block (the
(src, dst) pairs wait in `take_copies`, as vLLM's block manager returns copy-on-write pairs
for its copy_blocks kernel); beams pruned at a boundary keep beam 0's blocks as the trunk and
give the others' back. Ids pruning gave back while nobody asked are taken back when the stack
runs short (`take_renamed` says whose tables changed so). A subclass may hold a group's leading
rows by reference (`_head`: prefix caching's cached blocks): every table starts with them, and
they are not among the group's counted blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from heapq import heappop
from typing import ClassVar

from kvfrag.sim.allocators.base import (
    Allocator,
    Grant,
    Live,
    Reason,
    Refusal,
    Request,
    positive_int,
    push_clock,
    times,
)
from kvfrag.sim.floor_sum import FloorSum
from mypy_extensions import mypyc_attr

#: Largest block (tokens) modeled: larger is more likely a typo than a block size. (vattention's
#: 2 MiB pages of 1-byte token rows are 2**21-token blocks.)
MAX_BLOCK_SIZE = 2**22


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class FreeIds:
    """The free block ids as a LIFO stack whose memory does not grow with the pool: ids never
    handed out are the range [fresh, size) under the ids given back (pop() gives 0 first), so a
    pool of 2**46 blocks costs what one of 16 does; ids come out exactly as from
    `list(range(size - 1, -1, -1))` with the same pushes and pops. Ids given back are kept as
    the lists they came in (`give`: a freed table, an evicted run), each in the order pop()
    takes them, so that giving a list back and taking it again copies no id (a long context
    frees and takes hundreds at a time)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fresh = 0  # lowest id never handed out
        self.chunks: list[list[int]] = []  # ids given back, the top chunk last, each in pop order
        self.head = 0  # ids of the top chunk taken already
        self.given = 0  # ids given back and not taken again

    def __len__(self) -> int:
        return self.size - self.fresh + self.given

    def __iter__(self) -> Iterator[int]:
        """Bottom to top, as the list would hold them."""
        yield from range(self.size - 1, self.fresh - 1, -1)
        last = len(self.chunks) - 1
        for i, chunk in enumerate(self.chunks):
            yield from reversed(chunk[self.head :] if i == last else chunk)

    def __radd__(self, other: list[int]) -> list[int]:
        return other + list(self)

    def pop(self) -> int:
        if self.chunks:
            chunk = self.chunks[-1]
            block = chunk[self.head]
            self.head += 1
            self.given -= 1
            if self.head == len(chunk):
                self.chunks.pop()
                self.head = 0
            return block
        if self.fresh >= self.size:
            raise IndexError("pop from an empty free list")
        self.fresh += 1
        return self.fresh - 1

    def take(self, n: int) -> list[int]:
        """The top `n` ids, in the order pop() would give them."""
        if n > len(self):
            raise IndexError(f"{n} ids asked of a free list of {len(self)}")
        chunks = self.chunks
        out: list[int] | None = None
        need = n
        while need and chunks:
            chunk, head = chunks[-1], self.head
            left = len(chunk) - head
            if left > need:  # (part of the top chunk)
                part = chunk[head : head + need]
                self.head = head + need
                need = 0
            else:  # (all the rest of it: the list itself when none of it was taken)
                part = chunk[head:] if head else chunk
                chunks.pop()
                self.head = 0
                need -= left
            if out is None:
                out = part
            else:
                out += part
        self.given -= n - need
        if out is None:
            out = []
        if need:
            start = self.fresh
            self.fresh += need
            out.extend(range(start, self.fresh))
        return out

    def give(self, blocks: list[int]) -> None:
        """Push `blocks` so that pop() gives them back in this order; the list is the stack's
        now (not to be changed by the caller)."""
        if not blocks:
            return
        if self.head:  # (the top chunk keeps only what is left of it)
            del self.chunks[-1][: self.head]
            self.head = 0
        self.chunks.append(blocks)
        self.given += len(blocks)


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class PagedAllocator(Allocator):
    """Fixed-size KV blocks taken on demand."""

    kind = "paged"
    #: Blocks the pool keeps for itself: vLLM's null block (block 0). A subclass that models
    #: another pool (vAttention's pages) keeps none.
    null_blocks: ClassVar[int] = 1

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        block_size: object = 16,
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len)
        bs = positive_int("block_size", block_size)
        if bs > MAX_BLOCK_SIZE:
            raise ValueError(
                f"blocks of {bs} tokens are larger than kvfrag models "
                f"(at most {MAX_BLOCK_SIZE} tokens a block)"
            )
        self.block_size = bs
        self._set_pool(bs * self.bytes_per_token)
        self._fixed_blocks = 0  # blocks of non-decoding requests, and decoders' constants
        self._fixed_internal = 0  # internal fragmentation of non-decoding requests, bytes
        self._fixed_saved = 0  # blocks sharing saves that do not move with the clock
        self._blocks = FloorSum(bs)  # decoders' blocks
        self._tokens = FloorSum(bs)  # decoders' stored tokens beyond n*(c + K)
        self._saved = FloorSum(bs)  # decoders' saved blocks that move (beams)
        self._dec_internal = 0  # internal bytes of decoders already in their last block
        # Decoders not yet in their last block, by the clock at which each enters it: a heap
        # of those clocks, each once, and the rids pushed with each, with lazy deletion (a rid
        # counts while `_pending_at[rid]` still says that clock), as for `_done` (see base).
        self._pending: list[int] = []
        self._pending_rids: dict[int, list[int]] = {}
        self._pending_at: dict[int, int] = {}
        self._groups: dict[int, tuple[int, list[list[int]]]] = {}  # rid -> (tokens, tables)
        self._copies: dict[int, list[tuple[int, int]]] = {}  # rid -> (src, dst) not yet taken
        self._renamed: dict[int, None] = {}  # beams named again to take back pruned ids
        self._deferred = False  # `defer_block_ids`: a single sequence's ids wait to be asked

    def _set_pool(self, block_bytes: int) -> None:
        """Cut the budget into blocks of `block_bytes`, all free but the null block(s)."""
        self.block_bytes = block_bytes
        self.num_blocks = self.capacity // block_bytes  # vLLM's num_gpu_blocks
        null = min(self.null_blocks, self.num_blocks)
        self.usable_blocks = self.num_blocks - null  # what requests can hold
        self._stack = FreeIds(self.num_blocks)  # free ids; pop() gives 0 first
        for _ in range(null):
            self._stack.pop()  # block 0: the null block, never handed out

    def defer_block_ids(self) -> None:
        self._deferred = True

    # ----------------------------------------------------------------- queries
    def free_blocks(self) -> int:
        """vLLM's `get_num_free_blocks()`: usable blocks nobody holds (never the null block)."""
        return self.usable_blocks - self._blocks_total()

    def blocks_of(self, rid: int) -> int:
        live = self._get(rid)
        return self._blocks_at(live, self._tokens_of(live))

    def allocated_bytes(self, rid: int) -> int:
        return self.blocks_of(rid) * self.block_bytes

    def bytes_for(self, req: Request, tokens: int) -> int:
        return self._count_blocks(req, tokens, req.prompt // self.block_size) * self.block_bytes

    def watermark_bytes(self, fraction: float) -> int:
        # vLLM: int(watermark x KVCacheConfig.num_blocks), a count that includes the null block.
        return int(fraction * self.num_blocks) * self.block_bytes

    def pool_bytes(self) -> int:
        return self.usable_blocks * self.block_bytes

    def free_bytes(self) -> int:
        """Capacity less what requests hold and the null block (never free, as in vLLM's
        free block queue): whole free blocks and the budget's tail."""
        null = self.num_blocks - self.usable_blocks
        return self.capacity - self._allocated_total() - null * self.block_bytes

    def saved_by_sharing(self) -> int:
        saved = self._fixed_saved + self._saved.value(self._clock)
        return saved * self.block_bytes

    def block_table(self, rid: int) -> tuple[int, ...]:
        """The request's block ids (a group's shared ones first), handing out any not yet named."""
        live = self._get(rid)
        self._materialize(live, self.blocks_of(rid), self.tokens(rid))
        return tuple(live.table or ())

    def block_tables(self, rid: int) -> list[tuple[int, ...]]:
        """One block table per sequence, in token order (one while a group's prompt is
        prefilled); blocks shared by several sequences appear in each of their tables."""
        table = self.block_table(rid)
        group = self._groups.get(rid)
        return [table] if group is None else [tuple(t) for t in group[1]]

    def take_copies(self) -> list[tuple[int, int, int]]:
        """(rid, source block, destination block) of the copies on write since last asked:
        the destination must receive the source's bytes before the sequences write on."""
        copies = [(rid, src, dst) for rid, pairs in self._copies.items() for src, dst in pairs]
        self._copies.clear()
        return copies

    def take_renamed(self) -> list[int]:
        """Requests whose block tables were named again since last asked, not by a call for
        them: beams pruned while nobody asked, whose freed ids another request needed."""
        renamed = list(self._renamed)
        self._renamed.clear()
        return renamed

    def grow_within(self, rids: list[int], more: list[int]) -> None:
        """`grow(rids[j], more[j])` for each j, where the caller knows the blocks they take
        are free: speculative decoding's block crossings, many a step (sim/spec_steps.py),
        without a Grant each. Single sequences outside the decode cohort, no model view."""
        bs, deferred = self.block_size, self._deferred
        blocks = internal = tokens = 0
        for j, rid in enumerate(rids):  # (checked before anything changes)
            live = self._live[rid]
            old = live.base
            new = old + more[j]
            if live.decoding or live.req.n != 1 or self._view is not None or new > live.final:
                raise ValueError(f"request {rid}: not grown within (see `grow`)")
            blocks += -(-new // bs) - -(-old // bs)
        if blocks > self.free_blocks():
            raise AssertionError("grow_within: more blocks than are free")
        for j, rid in enumerate(rids):
            live = self._live[rid]
            old = live.base
            new = old + more[j]
            if not deferred:
                self._materialize(live, -(-new // bs), new)
            internal += self._tail_waste(live, new) - self._tail_waste(live, old)
            live.base = new
            tokens += new - old
        self._fixed_blocks += blocks
        self._fixed_internal += internal
        self._fixed_tokens += tokens
        self._fixed_seq += tokens

    def steps_until_full(self) -> int | None:
        return self._blocks.steps_within(self._clock, self.free_blocks())

    def steps_until_shrink(self) -> int | None:
        # Beams are pruned back to one trunk when their length reaches a multiple of bs.
        if not self._saved.nonzero:
            return None
        bs, k = self.block_size, self._clock
        return min((-(r + k) % bs) or bs for r in self._saved.res)

    # ------------------------------------------------------------ group counts
    def _count_blocks(self, req: Request, tokens: int, shared_blocks: int) -> int:
        n, bs = self._sequences(req, tokens), self.block_size
        kept = tokens // bs if req.beam else shared_blocks
        return n * -(-tokens // bs) - (n - 1) * kept

    @staticmethod
    def _sequences(req: Request, tokens: int) -> int:
        """A group is one sequence while its prompt is prefilled; it forks after."""
        return req.n if tokens > req.prompt else 1

    def _blocks_at(self, live: Live, tokens: int) -> int:
        """Blocks a request holds when each of its sequences stores `tokens` tokens."""
        if live.req.n == 1:  # the common case, kept short: it runs at every event
            return -(-tokens // self.block_size)
        return self._count_blocks(live.req, tokens, live.shared // self.block_size)

    def _saved_at(self, live: Live, tokens: int) -> int:
        if live.req.n == 1:
            return 0
        n, bs = self._sequences(live.req, tokens), self.block_size
        return (n - 1) * (tokens // bs if live.req.beam else live.shared // bs)

    def _stored(self, live: Live, tokens: int) -> int:
        if live.req.n == 1:
            return tokens
        n, bs = self._sequences(live.req, tokens), self.block_size
        kept = tokens // bs * bs if live.req.beam else live.shared
        return n * tokens - (n - 1) * kept

    def _linear(self, live: Live, phase: int) -> int:
        n = live.req.n
        linear = times(n, phase)  # (phase: negative once the clock has passed it)
        return linear if live.req.beam else linear - (n - 1) * live.shared

    def _token_terms(self) -> int:
        return self._tokens.value(self._clock)

    def _integrate_token_terms(self, n: int, w0: float, w1: float, weight: float) -> float:
        return self._tokens.integrate(self._clock, n, w0, w1, weight)

    def _integrate_saved(self, n: int, w0: float, w1: float, weight: float) -> float:
        moving = self._saved.integrate(self._clock, n, w0, w1, weight)
        return (self._fixed_saved * weight + moving) * self.block_bytes

    # ---------------------------------------------------------------- internals
    def _blocks_total(self) -> int:
        return self._fixed_blocks + self._blocks.value(self._clock)

    def _waste(self, live: Live) -> int:
        """Bytes of the last blocks a request's sequences will never fill."""
        return live.req.n * (-live.final % self.block_size) * self.bytes_per_token

    def _tail_waste(self, live: Live, tokens: int) -> int:
        """Internal fragmentation of a request holding `tokens` tokens (only its last block)."""
        held = -(-tokens // self.block_size) * self.block_size
        if held <= live.final:
            return 0
        return self._sequences(live.req, tokens) * (held - live.final) * self.bytes_per_token

    def _materialize(self, live: Live, blocks: int, tokens: int) -> tuple[int, ...]:
        """Name the `blocks` blocks a request storing `tokens` tokens holds; returns new ids."""
        if live.req.n > 1:
            return self._materialize_group(live, blocks, tokens)
        table = live.table if live.table is not None else []
        live.table = table
        need = blocks - len(table)
        if need < 0:
            raise AssertionError(f"request {live.req.rid}: its named blocks outnumber its count")
        if need == 0:
            return ()
        if need > len(self._stack):
            self._reclaim(need, live.req.rid)
        new = self._stack.take(need)
        table.extend(new)
        return tuple(new)

    def _name_new(self, live: Live, blocks: int, tokens: int) -> tuple[int, ...]:
        """`_materialize` at an admission or growth: the new ids, or none yet when ids are
        deferred (a group's are always named: its tables follow its forks)."""
        if self._deferred and live.req.n == 1:
            return ()
        return self._materialize(live, blocks, tokens)

    def _materialize_group(self, live: Live, blocks: int, tokens: int) -> tuple[int, ...]:
        """Bring a group's block tables from the tokens of its last naming to `tokens`, as the
        sequences would have: the prompt is prefilled as one sequence; at the fork every
        sequence shares the full prompt blocks and sequences 1..n-1 copy the partial one
        (copy on write, recorded for `take_copies`); samples then grow their own blocks, while
        beams keep one trunk (beam 0's blocks, which survive each pruning) and a private
        partial block each. Blocks dropped by pruning go back before new ones are taken."""
        req, bs, rid = live.req, self.block_size, live.req.rid
        was, old = self._groups.get(rid, (0, [[]]))
        if tokens == was and live.table is not None:
            return ()
        head = self._head(live)  # leading rows held by reference (prefix caching), not counted
        seqs = [list(t) for t in old]
        for t in seqs:  # rows that joined the cache since: the cached block's id
            t[: len(head)] = head
        fresh: list[int] = []  # placeholders -1, -2, ... for blocks to take, in order

        def take() -> int:
            fresh.append(-1 - len(fresh))
            return fresh[-1]

        copies = []
        at = was
        if at <= req.prompt:  # one sequence: prefill, then fork at the prompt's end
            first = seqs[0]
            at = min(tokens, req.prompt)
            first.extend(take() for _ in range(-(-at // bs) - len(first)))
            if tokens > req.prompt:
                shared, partial = divmod(req.prompt, bs)
                # Beams that fill the partial prompt block within this call are pruned back
                # to beam 0's copy of it: their own copies would be dropped at once.
                copy = partial and (not req.beam or tokens // bs == shared)
                seqs = [first]
                for _ in range(req.n - 1):
                    seqs.append(first[:shared])
                    if copy:
                        copies.append((first[shared], take()))
                        seqs[-1].append(copies[-1][1])
        if tokens > at:  # every sequence advances from `at` to `tokens`
            need = -(-tokens // bs)
            if req.beam and tokens // bs > at // bs:  # pruned to beam 0's trunk
                trunk = seqs[0][: tokens // bs]
                trunk.extend(take() for _ in range(tokens // bs - len(trunk)))
                seqs = [list(trunk) for _ in range(req.n)]
            for t in seqs:
                t.extend(take() for _ in range(need - len(t)))
        named = dict.fromkeys(b for t in seqs for b in t)
        for b in head:
            del named[b]
        if len(named) != blocks:
            raise AssertionError(
                f"request {rid}: {len(named)} blocks named for {tokens} tokens, {blocks} counted"
            )
        dropped = [b for b in (live.table or ()) if b not in named]
        self._stack.give(dropped)
        if len(fresh) > len(self._stack):
            self._reclaim(len(fresh), rid)
        ids = {ph: self._stack.pop() for ph in fresh}
        seqs = [[ids.get(b, b) for b in t] for t in seqs]
        live.table = [ids.get(b, b) for b in named]
        self._groups[rid] = (tokens, seqs)
        if copies:
            pairs = ((ids.get(src, src), ids[dst]) for src, dst in copies)
            self._copies.setdefault(rid, []).extend(pairs)
        return tuple(ids.values())

    def _head(self, live: Live) -> list[int]:
        """Ids of the leading rows of every table of a group that the request holds by
        reference and does not count among its blocks (prefix caching's cached blocks)."""
        return []

    def _reclaim(self, need: int, asking: int) -> None:
        """Beams pruned since their blocks were last named still hold the ids pruning gave
        back: name them now, until the free stack holds `need` ids."""
        for rid in list(self._groups):
            if len(self._stack) >= need:
                return
            live = self._live[rid]
            table = live.table
            if rid != asking and live.req.beam and table and len(table) > self.blocks_of(rid):
                self._materialize_group(live, self.blocks_of(rid), self.tokens(rid))
                self._renamed[rid] = None
        if len(self._stack) < need:
            raise AssertionError(f"request {asking}: no free block id left to name")

    def _refusal(self, rid: int, blocks: int, detail: str = "") -> Refusal:
        return Refusal(
            rid, Reason.OUT_OF_MEMORY, blocks * self.block_bytes, self.free_bytes(), detail
        )

    # -------------------------------------------------------------------- hooks
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        rid, bs = live.req.rid, self.block_size
        live.shared = live.req.prompt // bs * bs  # full prompt blocks, kept once
        most = self._peak_blocks(live, tokens)
        if most > self.usable_blocks:
            need = most * self.block_bytes
            return Refusal(
                rid, Reason.TOO_LARGE, need, self.free_bytes(), "needs more blocks than exist"
            )
        need = self._blocks_at(live, tokens)
        if need > self.free_blocks():
            return self._refusal(rid, need)
        ids = self._name_new(live, need, tokens)
        self._fixed_blocks += need
        self._fixed_internal += self._tail_waste(live, tokens)
        self._fixed_saved += self._saved_at(live, tokens)
        return Grant(rid, need * self.block_bytes, live.cap, blocks=ids)

    def _peak_blocks(self, live: Live, tokens: int) -> int:
        """Most blocks the request holds at once from `tokens` tokens to its final length."""
        if live.req.n == 1:  # (its count only grows)
            return self._count_blocks(live.req, live.final, 0)
        bs, kept = self.block_size, live.shared // self.block_size
        at = [tokens, live.final]
        if live.req.beam:  # beams peak just after their last block boundary
            at.append(max(tokens, (live.final - 1) // bs * bs + 1))
        return max(self._count_blocks(live.req, t, kept) for t in at)

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        have, want = self._blocks_at(live, old), self._blocks_at(live, new)
        if want - have > self.free_blocks():
            return self._refusal(live.req.rid, want - have)
        ids = self._name_new(live, want, new)
        self._fixed_blocks += want - have
        self._fixed_internal += self._tail_waste(live, new) - self._tail_waste(live, old)
        self._fixed_saved += self._saved_at(live, new) - self._saved_at(live, old)
        return Grant(live.req.rid, max(0, want - have) * self.block_bytes, live.cap, blocks=ids)

    def _release(self, live: Live) -> None:
        tokens = live.base
        self._fixed_blocks -= self._blocks_at(live, tokens)
        self._fixed_internal -= self._tail_waste(live, tokens)
        self._fixed_saved -= self._saved_at(live, tokens)
        if live.table:
            self._stack.give(live.table)
        live.table = None
        self._groups.pop(live.req.rid, None)
        self._copies.pop(live.req.rid, None)
        self._renamed.pop(live.req.rid, None)

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        bs, rid, n = self.block_size, live.req.rid, live.req.n
        phase = live.base if decoding else live.base - self._clock
        tokens = phase + self._clock
        sign = 1 if decoding else -1
        # Move the request between the fixed counts and the clocked ones. (Signs by branches:
        # see `times`.)
        blocks, tail = self._blocks_at(live, tokens), self._tail_waste(live, tokens)
        self._fixed_blocks -= blocks if decoding else -blocks
        self._fixed_internal -= tail if decoding else -tail
        self._add_block_terms(phase, n if decoding else -n)
        if n > 1:
            self._fixed_saved -= sign * self._saved_at(live, tokens)
            if live.req.beam:
                self._blocks.add(phase, -sign * (n - 1))  # - (n-1) * floor((c + K)/bs)
                self._tokens.add(phase, -sign * (n - 1) * bs)
                self._saved.add(phase, sign * (n - 1))
            else:
                shared = live.shared // bs
                self._fixed_blocks -= sign * (n - 1) * shared
                self._fixed_saved += sign * (n - 1) * shared
        reach = self._last_block_at(live.final) - phase  # clock of entering the last block
        # Pending: the decoders that have not reached their last block (`_stepped` moves the
        # others on as the clock passes them).
        if reach > self._clock:
            if decoding:
                self._pending_at[rid] = reach  # (a rid that left and came back counts once)
                push_clock(self._pending, self._pending_rids, reach, rid)
            else:
                del self._pending_at[rid]
        else:
            waste = self._waste(live)
            self._dec_internal += waste if decoding else -waste

    def _add_block_terms(self, phase: int, coef: int) -> None:
        """Add coef x the blocks one sequence of phase c holds at clock K: ceil((c + K)/bs)."""
        self._blocks.add(phase + self.block_size - 1, coef)

    def _last_block_at(self, final: int) -> int:
        """Fewest tokens at which a sequence of `final` tokens holds all its blocks."""
        bs = self.block_size
        return bs * (-(-final // bs) - 1) + 1

    def _stepped(self) -> None:
        pending, valid, pushed = self._pending, self._pending_at, self._pending_rids
        while pending and pending[0] <= self._clock:
            reach = heappop(pending)
            for rid in pushed.pop(reach):
                if valid.get(rid) == reach:
                    del valid[rid]
                    self._dec_internal += self._waste(self._live[rid])

    def _pending_until(self, k: int) -> list[tuple[int, int]]:
        """(clock, rid) of the pending decoders entering their last block by clock `k`, in
        that order, each once: the heap's clocks within reach of `k` (a pruned walk)."""
        pending, valid, out = self._pending, self._pending_at, []
        todo = [0] if pending and pending[0] <= k else []
        while todo:
            i = todo.pop()
            reach = pending[i]
            for rid in self._pending_rids[reach]:
                if valid.get(rid) == reach:
                    out.append((reach, rid))
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(pending) and pending[c] <= k:
                    todo.append(c)
        out.sort()
        return [entry for i, entry in enumerate(out) if not i or entry != out[i - 1]]

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
        k = self._clock
        blocks = self._fixed_blocks * weight + self._blocks.integrate(k, n, w0, w1, weight)
        internal = (self._fixed_internal + self._dec_internal) * weight
        for reach, rid in self._pending_until(k + n):
            j0 = reach - k  # first step (1-based) spent in the last block
            steps = n - j0 + 1
            tail = steps * w0 + w1 * (steps * (j0 - 1) + steps * (steps - 1) / 2)
            internal += self._waste(self._live[rid]) * tail
        return blocks * self.block_bytes, internal

    def _integrate_free(
        self, probe: Request | None, weight: float, allocated: float
    ) -> tuple[float, float]:
        pool = self.usable_blocks * self.block_bytes
        return pool * weight - allocated, (self.capacity - pool) * weight
