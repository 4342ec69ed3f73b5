"""Arena and paged replays: a simulated run's allocation log acted out on real bytes.

The whole KV budget is one uint8 tensor on the device. Every byte is in one of three states,
told apart by its value:
- FREE (0): nobody holds it;
- HELD (255): allocated but not (yet) holding a token: written over a slab (or a block) when
  it is handed out;
- anything else: a token's keys and values. Token i of request r is written as the value
  1 + (131*r + i) % 253, never 0 or 255, so a byte written at the wrong place or overwritten
  by a neighbour shows up both in the counts and in the request's own bytes.

Arena mode (contiguous, buddy): a request's slab is the view [offset, offset + nbytes) the
modeled allocator chose; token i sits at offset + i*b. Paged mode: the first
num_blocks*block_bytes bytes are the block pool [num_blocks, block_size, b]; token i sits in
block table[i // block_size], slot i % block_size; the tail beyond the pool stays FREE.

At each checkpoint (the log's `check` rows, optionally thinned) the bytes in each state are
counted on the device and must equal the model's token_states, held_unwritten (reserved +
internal) and free exactly. Before a request's memory is freed its bytes are compared with its
pattern (and its unwritten bytes with HELD); then the freed bytes are set to FREE again.
Compaction `move` rows copy a slab's bytes to its new offset, as a real compaction would.
Scratch memory is bounded: counts and comparisons work in pieces of at most `SCRATCH` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from validate.outcome import Outcome

FREE, HELD = 0, 255
SCRATCH = 64 << 20  # the most temporary device memory a count or a comparison takes
#: Arena and paged figures must match the model to the byte.
TOLERANCES = {"token_states": 0, "held_unwritten": 0, "free": 0, "allocated": 0}


@dataclass
class _Live:
    tokens: int = 0
    offset: int = -1
    nbytes: int = 0
    table: list[int] = field(default_factory=list)


def pick_checks(n: int, limit: int | None) -> set[int]:
    """Indices of the checks to measure: all of them, or `limit` spread evenly (last kept)."""
    if limit is None or limit >= n:
        return set(range(n))
    if limit <= 0:
        return set()
    return {int(i) for i in np.linspace(0, n - 1, limit).round()}


class MemoryReplay:
    """Replays one allocation log on a byte tensor of `capacity` bytes on `device`."""

    def __init__(
        self,
        capacity: int,
        bytes_per_token: int,
        device: str = "cpu",
        block_size: int | None = None,
    ) -> None:
        import torch

        self.torch = torch
        self.capacity = capacity
        self.b = bytes_per_token
        self.device = torch.device(device)
        self.buf = torch.zeros(capacity, dtype=torch.uint8, device=self.device)
        self.paged = block_size is not None
        self.block_size = block_size or 0
        if self.paged:
            self.num_blocks = capacity // (self.block_size * self.b)
            pool = self.buf[: self.num_blocks * self.block_size * self.b]
            self.pool = pool.view(self.num_blocks, self.block_size, self.b)
        self.live: dict[int, _Live] = {}

    # ------------------------------------------------------------ byte patterns
    def pattern(self, rid: int, t0: int, t1: int):
        """The values of tokens [t0, t1) of request `rid` (one per token)."""
        torch = self.torch
        idx = torch.arange(t0, t1, dtype=torch.int64, device=self.device)
        return ((131 * rid + idx) % 253 + 1).to(torch.uint8)

    def _pieces(self, t0: int, t1: int):
        """Token ranges of at most SCRATCH bytes covering [t0, t1)."""
        step = max(1, SCRATCH // max(self.b, 64))  # bounds index tensors (int64) too
        for a in range(t0, t1, step):
            yield a, min(t1, a + step)

    def _slots(self, table: list[int], t0: int, t1: int):
        """(block index, slot index) tensors for tokens [t0, t1) of a block table."""
        torch = self.torch
        tok = torch.arange(t0, t1, dtype=torch.int64, device=self.device)
        ids = torch.as_tensor(table, dtype=torch.int64, device=self.device)
        return ids[tok // self.block_size], tok % self.block_size

    def _write(self, rid: int, live: _Live, t0: int, t1: int) -> None:
        for a, z in self._pieces(t0, t1):
            vals = self.pattern(rid, a, z)[:, None]
            if self.paged:
                blk, slot = self._slots(live.table, a, z)
                self.pool[blk, slot] = vals.expand(z - a, self.b)
            else:
                start = live.offset + a * self.b
                self.buf[start : start + (z - a) * self.b].view(z - a, self.b).copy_(
                    vals.expand(z - a, self.b)
                )

    def intact(self, rid: int, live: _Live) -> int:
        """Bytes of `rid` that differ from what it should hold (tokens, then HELD)."""
        bad = 0
        for a, z in self._pieces(0, live.tokens):
            vals = self.pattern(rid, a, z)[:, None]
            if self.paged:
                blk, slot = self._slots(live.table, a, z)
                got = self.pool[blk, slot]
            else:
                start = live.offset + a * self.b
                got = self.buf[start : start + (z - a) * self.b].view(z - a, self.b)
            bad += int(self.torch.count_nonzero(got != vals))
        for region in self._unwritten(live):
            bad += int(self.torch.count_nonzero(region != HELD))
        return bad

    def _unwritten(self, live: _Live):
        """Views of the bytes `live` holds but has not written."""
        if self.paged:
            if live.table and live.tokens % self.block_size:
                yield self.pool[live.table[live.tokens // self.block_size]][
                    live.tokens % self.block_size :
                ]
            full = -(-live.tokens // self.block_size)
            for blk in live.table[full:]:
                yield self.pool[blk]
        else:
            start = live.offset + live.tokens * self.b
            end = live.offset + live.nbytes
            for a in range(start, end, SCRATCH):
                yield self.buf[a : min(end, a + SCRATCH)]

    def count(self) -> tuple[int, int, int]:
        """(token bytes, HELD bytes, FREE bytes) over the whole budget, counted on the device."""
        torch, free, held = self.torch, 0, 0
        for a in range(0, self.capacity, SCRATCH):
            piece = self.buf[a : a + SCRATCH]
            free += int(torch.count_nonzero(piece == FREE))
            held += int(torch.count_nonzero(piece == HELD))
        return self.capacity - free - held, held, free

    def _take_blocks_for(self, rid: int, live: _Live, blocks: list[int], tokens: int) -> str:
        """Add `blocks` to the request's table; a problem if they or its tokens do not fit."""
        problem = self._take_blocks(live, blocks)
        if not problem and len(live.table) * self.block_size < tokens:
            problem = f"request {rid}: {tokens} tokens do not fit {len(live.table)} blocks"
        return problem

    # -------------------------------------------------------------- operations
    def admit(self, rid: int, tokens: int, nbytes: int, offset: int, blocks: list[int]) -> str:
        """Hand out memory and write the first `tokens` tokens; returns a problem or ''."""
        if rid in self.live:
            return f"admit of request {rid}, which is already live"
        live = _Live(tokens=tokens, offset=offset, nbytes=nbytes)
        if self.paged:
            problem = self._take_blocks_for(rid, live, blocks, tokens)
            if problem:
                return problem
        else:
            if offset < 0 or offset + nbytes > self.capacity:
                return f"request {rid}: slab [{offset}, {offset + nbytes}) outside the arena"
            if tokens * self.b > nbytes:
                return f"request {rid}: {tokens} tokens do not fit a slab of {nbytes} bytes"
            self.buf[offset : offset + nbytes].fill_(HELD)
        self.live[rid] = live
        live.tokens = 0
        self._write(rid, live, 0, tokens)
        live.tokens = tokens
        return ""

    def grow(self, rid: int, tokens: int, nbytes: int, blocks: list[int]) -> str:
        live = self.live.get(rid)
        if live is None:
            return f"grow of request {rid}, which is not live"
        if self.paged:
            problem = self._take_blocks_for(rid, live, blocks, tokens)
            if problem:
                return problem
        elif nbytes or tokens * self.b > live.nbytes:
            return f"request {rid}: a slab cannot grow ({tokens} tokens, +{nbytes} bytes)"
        if tokens < live.tokens:
            return f"request {rid}: tokens went down from {live.tokens} to {tokens}"
        self._write(rid, live, live.tokens, tokens)
        live.tokens = tokens
        return ""

    def free(self, rid: int, nbytes: int, offset: int, blocks: list[int]) -> tuple[int, str]:
        """Check the request's bytes, then release them; returns (bad bytes, problem)."""
        live = self.live.pop(rid, None)
        if live is None:
            return 0, f"free of request {rid}, which is not live"
        bad = self.intact(rid, live)
        problem = ""
        if self.paged:
            if list(blocks[: len(live.table)]) != live.table:
                problem = f"request {rid}: freed blocks differ from its block table"
            ids = sorted(set(live.table) | {b for b in blocks if 0 <= b < self.num_blocks})
            if ids:
                self.pool[self.torch.as_tensor(ids, device=self.device)] = FREE
        else:
            if (offset, nbytes) != (live.offset, live.nbytes):
                problem = (
                    f"request {rid}: freed slab ({offset}, {nbytes}) differs from its admission "
                    f"({live.offset}, {live.nbytes})"
                )
            self.buf[live.offset : live.offset + live.nbytes].fill_(FREE)
        return bad, problem

    def move(self, rid: int, nbytes: int, offset: int, from_offset: int) -> str:
        """Compaction: copy a slab's bytes to `offset` (piece by piece, safe when the two
        overlap), then mark what the old place no longer shares with the new one FREE."""
        live = self.live.get(rid)
        if live is None or self.paged:
            return f"move of request {rid}, which is not a live slab"
        old, n = live.offset, live.nbytes
        problem = ""
        if (from_offset, nbytes) != (old, n):
            problem = f"request {rid}: moved from ({from_offset}, {nbytes}), held ({old}, {n})"
        if offset < 0 or offset + n > self.capacity:
            return f"request {rid}: slab moved to [{offset}, {offset + n}) outside the arena"
        starts = range(0, n, SCRATCH)
        for a in starts if offset <= old else reversed(starts):
            z = min(n, a + SCRATCH)
            self.buf[offset + a : offset + z].copy_(self.buf[old + a : old + z].clone())
        if offset < old:
            self.buf[max(old, offset + n) : old + n].fill_(FREE)
        else:
            self.buf[old : min(old + n, offset)].fill_(FREE)
        live.offset = offset
        return problem

    def _take_blocks(self, live: _Live, blocks: list[int]) -> str:
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            return f"block ids {bad[:3]} outside the pool of {self.num_blocks}"
        if blocks:
            self.pool[self.torch.as_tensor(list(blocks), device=self.device)] = HELD
        live.table.extend(int(b) for b in blocks)
        return ""

    def release(self) -> None:
        """Drop the device memory."""
        self.live.clear()
        self.buf = self.pool = None  # type: ignore[assignment]


def replay_log(
    log: pd.DataFrame,
    outcome: Outcome,
    bytes_per_token: int,
    device: str = "cpu",
    block_size: int | None = None,
    checkpoints: int | None = None,
) -> Outcome:
    """Replay `log` (arena when block_size is None, else paged) and fill in `outcome`."""
    mem = MemoryReplay(outcome.capacity, bytes_per_token, device, block_size)
    try:
        _replay(mem, log, outcome, checkpoints)
    finally:
        mem.release()
    return outcome.finish(TOLERANCES)


def _replay(mem: MemoryReplay, log: pd.DataFrame, out: Outcome, limit: int | None) -> None:
    checks = pick_checks(int((log["op"] == "check").sum()), limit)
    rows: list[dict[str, Any]] = []
    n_check = 0
    for row in log.itertuples(index=False):
        op, rid, seq = row.op, int(row.rid), int(row.seq)
        blocks = list(row.blocks) if row.blocks is not None else []
        if op == "check":
            if n_check in checks:
                rows.append(_measure(mem, row, out))
            n_check += 1
            continue
        out.ops += 1
        if op == "admit":
            problem = mem.admit(rid, int(row.tokens), int(row.nbytes), int(row.offset), blocks)
        elif op == "grow":
            problem = mem.grow(rid, int(row.tokens), int(row.nbytes), blocks)
        elif op == "move":
            frm = int(getattr(row, "from_offset", -1))
            problem = mem.move(rid, int(row.nbytes), int(row.offset), frm)
        elif op == "free":
            bad, problem = mem.free(rid, int(row.nbytes), int(row.offset), blocks)
            if bad:
                out.corrupt += 1
                out.fail(seq, f"request {rid}: {bad} of its bytes changed before its free")
        else:
            problem = f"unknown log operation {op!r}"
        if problem:
            out.fail(seq, problem)
    for rid, live in list(mem.live.items()):  # still live when the run stopped
        bad = mem.intact(rid, live)
        if bad:
            out.corrupt += 1
            out.fail(int(log["seq"].max()) + 1, f"request {rid}: {bad} of its bytes changed")
    out.checks = len(rows)
    out.series = pd.DataFrame(rows)
    if not out.ops:
        out.note = "nothing to replay: the run admitted no request"


def _measure(mem: MemoryReplay, row: Any, out: Outcome) -> dict[str, Any]:
    tokens, held, free = mem.count()
    rec = {
        "seq": int(row.seq),
        "t": float(row.t),
        "op": "check",
        "live": len(mem.live),
        "pred_token_states": int(row.token_states),
        "meas_token_states": tokens,
        "pred_held_unwritten": int(row.held_unwritten),
        "meas_held_unwritten": held,
        "pred_free": int(row.free),
        "meas_free": free,
        "pred_allocated": int(row.nbytes),
        "meas_allocated": mem.capacity - free,
    }
    for q in ("token_states", "held_unwritten", "free"):
        if rec[f"pred_{q}"] != rec[f"meas_{q}"]:
            out.fail(
                rec["seq"],
                f"check: {q} predicted {rec[f'pred_{q}']:,} B, measured {rec[f'meas_{q}']:,} B",
            )
            break
    return rec
