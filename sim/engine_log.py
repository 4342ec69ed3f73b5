"""The allocation log: every admission, growth, move, copy, eviction and free of a run, with the
block ids and offsets each took, and after every event the model's view of the memory (a check
row), for `kvfrag validate` to replay on real memory and compare (validate/).

Kept only when asked (`EngineConfig.log_allocations`): naming block ids costs O(running) per
event. The engine calls `op`, `free` and `sync` as it goes and sets `now` as its clock moves.
Compiled with the engine (sim/_native.py).
"""

from __future__ import annotations

import math

import pandas as pd
from kvfrag.sim.allocators.base import Allocator, Request
from kvfrag.sim.engine_records import LOG_COLUMNS
from kvfrag.sim.engine_requests import _Req


class AllocationLog:
    """The rows of one run's allocation log (`LOG_COLUMNS`)."""

    def __init__(self, alloc: Allocator, requests: dict[int, _Req]) -> None:
        self.alloc = alloc
        self.requests = requests  # rid -> engine state of the requests in flight (the engine's)
        self.rows: list[tuple] = []
        self.now = 0.0  # the engine's clock
        # rid -> (tokens, blocks, bytes, ids) when last logged; ids: the block ids of a request
        # logged with its whole tables (None: its blocks are only ever appended)
        self.logged: dict[int, tuple[int, int, int, tuple[int, ...] | None]] = {}

    def op(
        self, op: str, rid: int, nbytes: int, offset: int | None, blocks=(), from_offset=-1,
        processed: int = 0,
    ) -> None:
        """Log one operation of the allocator's on request `rid` (and the evictions, copies and
        renames it made, first)."""
        alloc = self.alloc
        prompt, tables, offsets, keys = -1, [], [], []
        if op == "free":
            tokens = processed
            self.logged.pop(rid, None)
        elif op == "move":
            tokens = alloc.tokens(rid)
        else:
            tokens = alloc.tokens(rid)
            req = self.requests[rid].req
            ids = None
            held: tuple[int, ...] | None
            if op == "admit":
                prompt, keys = req.prompt, list(alloc.prefix_keys(rid))
                whole, held = req.n > 1 or bool(keys), ()
            else:
                held = self.logged[rid][3]
                whole = held is not None
            table = alloc.block_table(rid)  # names its blocks; block_tables reuses them
            if whole:
                tables = [list(t) for t in alloc.block_tables(rid)]
                ids = table
                before = set(held or ())
                blocks = [b for b in ids if b not in before]
            if req.n > 1:
                offsets = list(alloc.slab_offsets(rid))
            self.logged[rid] = (tokens, len(table), alloc.allocated_bytes(rid), ids)
            self.evictions()
            copies = alloc.take_copies()  # made by this operation: they come first
            for other in alloc.take_renamed():  # it took back blocks beams had pruned: first
                if other != rid:
                    self.grow(other)
            for copy in copies:
                self.row("copy", copy[0], tokens=alloc.tokens(copy[0]), blocks=copy[1:])
        off = -1 if offset is None else offset
        self.row(op, rid, tokens, nbytes, off, blocks, from_offset=from_offset,
                 prompt=prompt, tables=tables, offsets=offsets, keys=keys)

    def row(
        self, op: str, rid: int, tokens: int = 0, nbytes: int = 0, offset: int = -1, blocks=(),
        token_states: int = 0, held_unwritten: int = 0, free: int = 0, from_offset: int = -1,
        prompt: int = -1, tables=(), offsets=(), keys=(),
    ) -> None:
        rows = self.rows
        rows.append(
            (len(rows), self.now, op, rid, tokens, nbytes, offset, list(blocks),
             token_states, held_unwritten, free, from_offset, prompt, list(tables),
             list(offsets), list(keys))
        )

    def evictions(self) -> None:
        evicted = self.alloc.take_evictions()
        if evicted:
            self.row("evict", -1, blocks=evicted)

    def free(self, r: _Req, processed: int = 0) -> None:
        """Log `r`'s free; `processed`: see `free_preempted` (0: all its tokens)."""
        alloc, rid = self.alloc, r.req.rid
        if alloc.tokens(rid) != self.logged[rid][0]:
            self.grow(rid)  # it stepped since its last entry (preempted mid-iteration)
        offset = None if math.isnan(r.offset) else int(r.offset)
        self.op("free", rid, alloc.allocated_bytes(rid), offset, alloc.block_table(rid),
                processed=processed)

    def grow(self, rid: int) -> None:
        alloc = self.alloc
        _, nblocks, nbytes, ids = self.logged[rid]
        new = alloc.block_table(rid)[nblocks:] if ids is None else ()
        self.op("grow", rid, alloc.allocated_bytes(rid) - nbytes, None, new)

    def sync(self, probe: Request) -> None:
        """Log the growth of every live request since its last entry, then the model's view
        (free space judged for `probe`)."""
        alloc = self.alloc
        self.evictions()
        for rid in alloc.rids():
            if alloc.tokens(rid) != self.logged[rid][0]:
                self.grow(rid)
        acc = alloc.account(probe)
        self.row("check", -1, alloc.total_tokens(), acc.allocated, blocks=(),
                 token_states=acc.token_states,
                 held_unwritten=acc.reserved + acc.internal, free=acc.free)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=list(LOG_COLUMNS))
