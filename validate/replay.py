"""Arena and paged replays: a simulated run's allocation log acted out on real bytes.

The whole KV budget is one uint8 tensor on the device. Every byte is in one of three states,
told apart by its value:
- FREE (0): nobody holds it;
- HELD (255): allocated but not (yet) holding a token: written over a slab (or a block) when
  it is handed out;
- anything else: a token's keys and values. Token i of sequence s of request r is written as
  1 + (131*r + i + 97*s*[i >= prompt]) % 253, never 0 or 255: a request's sequences (n
  samples, beams) hold the same prompt and different generated tokens, so a byte written at
  the wrong place, overwritten by a neighbour or not copied shows up both in the counts and in
  the request's own bytes. With prefix caching a full block whose key digest is d (the log's
  `keys`: the prompt blocks a hash chain names, then, when its generated blocks are cached
  too, the request's own up to its final length) holds 1 + (d % 253 + (1 + d // 253 % 252) *
  i) % 253 at token i: whoever computes those tokens writes the same bytes (a request resumed
  after a preemption writes its own output's again), so a cache hit can be checked by value.

Arena mode (contiguous, buddy): a request's slab is the view [offset, offset + nbytes) the
modeled allocator chose; token i sits at offset + i*b. A request with n sequences has one slab
per sequence (the log's `offsets`): its prompt is written into the first and copied on the
device into the others, then each writes its own tokens. Paged mode: the first
num_blocks*block_size*b bytes are the block pool [num_blocks, block_size, b]; token i of a
sequence sits in block table[i // block_size], slot i % block_size; the tail beyond the pool
stays FREE. A block in several tables (a group's shared prompt blocks, a beam trunk, a cached
prefix block) holds the tokens of the first sequence that names it, and is written once.

Paged groups: the log gives every sequence's block table on each admit and grow (`tables`).
The prompt is written through the first sequence's table; `copy` rows before the operation
are then done on the device (the whole block, like vLLM's copy_blocks: copy on write of the
partial prompt block at the fork); then every sequence writes its new tokens. Blocks that
leave a request's tables (beams pruned back to one trunk) are checked, then set FREE.

Prefix caching: the first min(#keys, tokens // block_size) rows of a request's table are
cached blocks (every full block, with keys for its generated tokens too). A block it joins
that another request holds as cached, or that is idle-cached (its own, freed at a preemption,
included), already holds its tokens: it is checked, not written. When its last user frees it,
a cached block keeps its bytes (idle) and counts as free, as the model counts it; `evict` rows
check an idle block against what it held, then set it FREE.

At each checkpoint (the log's `check` rows, optionally thinned) the bytes in each state are
counted on the device and must equal the model's token_states, held_unwritten (reserved +
internal) and free exactly. Before a request's memory is freed its bytes are compared with its
pattern (and its unwritten bytes with HELD); then the freed bytes are set to FREE again.
Compaction `move` rows copy a slab's bytes to its new offset, as a real compaction would.
Scratch memory is bounded: counts and comparisons work in pieces of at most `SCRATCH` bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from kvfrag.validate.outcome import Outcome

FREE, HELD = 0, 255
SCRATCH = 64 << 20  # the most temporary device memory a count or a comparison takes
PROGRESS_ROWS = 32  # `replay_log` reports its progress once in this many rows of the log
#: Arena and paged figures must match the model to the byte.
TOLERANCES = {"token_states": 0, "held_unwritten": 0, "free": 0, "allocated": 0}

Item = tuple[int, int, int]  # (block id, row in the tables, sequence whose tokens it holds)


@dataclass
class _Live:
    tokens: int = 0
    prompt: int = -1  # -1: unknown (a single sequence needs no prompt length)
    nbytes: int = 0  # arena: the bytes of all its slabs
    offsets: list[int] = field(default_factory=list)  # arena: each sequence's slab
    tables: list[list[int]] = field(default_factory=lambda: [[]])  # paged: each sequence's
    keys: list[int] = field(default_factory=list)  # prefix caching: digest per prompt block
    terms: Any = None  # the keys' pattern terms on the device

    @property
    def offset(self) -> int:
        return self.offsets[0] if self.offsets else -1

    @property
    def table(self) -> list[int]:
        return self.tables[0]


def pick_checks(n: int, limit: int | None) -> set[int]:
    """Indices of the checks to measure: all of them, or `limit` spread evenly (last kept)."""
    if limit is None or limit >= n:
        return set(range(n))
    if limit <= 0:
        return set()
    return {int(i) for i in np.linspace(0, n - 1, limit).round()}


def roles(tables: list[list[int]]) -> dict[int, tuple[int, int]]:
    """block id -> (row, first sequence whose table holds it)."""
    out: dict[int, tuple[int, int]] = {}
    for s, table in enumerate(tables):
        for row, b in enumerate(table):
            out.setdefault(b, (row, s))
    return out


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
        self.users: dict[int, int] = {}  # cached block -> live requests holding it as cached
        self.idle: dict[int, Any] = {}  # idle cached block -> the token values it holds

    # ------------------------------------------------------------ byte patterns
    def pattern(self, rid: int, t0: int, t1: int):
        """The values of tokens [t0, t1) of request `rid`'s first sequence (one per token)."""
        torch = self.torch
        idx = torch.arange(t0, t1, dtype=torch.int64, device=self.device)
        return self.values(rid, _Live(), idx)

    def values(self, rid: int, live: _Live, pos, seq: Any = 0):
        """Token values at positions `pos` (int64 tensor) of sequence(s) `seq` of `rid`."""
        torch = self.torch
        v = 131 * rid + pos
        if not isinstance(seq, int) or seq:
            v = v + 97 * seq * (pos >= live.prompt)
        if live.keys:
            if live.terms is None:
                keys = [int(k) for k in live.keys]
                live.terms = (
                    torch.as_tensor([k % 253 for k in keys], device=self.device),
                    torch.as_tensor([1 + k // 253 % 252 for k in keys], device=self.device),
                )
            add, mul = live.terms
            row = pos // self.block_size
            keyed = row < len(live.keys)
            row = row.clamp(max=len(live.keys) - 1)
            v = torch.where(keyed, add[row] + mul[row] * pos, v)
        return (v % 253 + 1).to(torch.uint8)

    def _pieces(self, t0: int, t1: int):
        """Token ranges of at most SCRATCH bytes covering [t0, t1)."""
        step = max(1, SCRATCH // max(self.b, 64))  # bounds index tensors (int64) too
        for a in range(t0, t1, step):
            yield a, min(t1, a + step)

    # ------------------------------------------------------------------ blocks
    def _chunks(self, items: list[Item]):
        per = max(1, SCRATCH // (self.block_size * max(self.b, 64)))
        for i in range(0, len(items), per):
            yield items[i : i + per]

    def _expect(self, rid: int, live: _Live, items: list[Item]):
        """(block ids, token positions [k, block_size], token values) of `items`."""
        torch, dev = self.torch, self.device
        ids = torch.as_tensor([it[0] for it in items], dtype=torch.int64, device=dev)
        rows = torch.as_tensor([it[1] for it in items], dtype=torch.int64, device=dev)
        seqs = torch.as_tensor([it[2] for it in items], dtype=torch.int64, device=dev)
        slot = torch.arange(self.block_size, dtype=torch.int64, device=dev)
        pos = rows[:, None] * self.block_size + slot[None, :]
        return ids, pos, self.values(rid, live, pos, seqs[:, None])

    def _write_blocks(self, rid: int, live: _Live, items: list[Item], t0: int, t1: int) -> None:
        """Write tokens [t0, t1) into the blocks `items` (their other bytes stay)."""
        bs = self.block_size
        items = [it for it in items if it[1] * bs < t1 and (it[1] + 1) * bs > t0]
        for part in self._chunks(items):
            ids, pos, vals = self._expect(rid, live, part)
            mask = ((pos >= t0) & (pos < t1))[..., None]
            self.pool[ids] = self.torch.where(mask, vals[..., None], self.pool[ids])

    def _bad_blocks(self, rid: int, live: _Live, items: list[Item], tokens: int) -> int:
        """Bytes of the blocks `items` that do not hold tokens [0, tokens), then HELD."""
        bad = 0
        for part in self._chunks(items):
            ids, pos, vals = self._expect(rid, live, part)
            want = self.torch.where(pos < tokens, vals, HELD)
            bad += int(self.torch.count_nonzero(self.pool[ids] != want[..., None]))
        return bad

    def _set(self, ids, value: int) -> None:
        if ids:
            self.pool[self.torch.as_tensor(sorted(ids), device=self.device)] = value

    def _cached(self, live: _Live, tokens: int) -> int:
        """Leading rows of a prefix-caching request's table that are cached blocks."""
        return min(len(live.keys), tokens // self.block_size) if self.paged else 0

    def _items(self, live: _Live) -> list[Item]:
        return [(b, row, s) for b, (row, s) in roles(live.tables).items()]

    # -------------------------------------------------------------------- slabs
    def _one(self, live: _Live) -> int:
        return live.nbytes // max(1, len(live.offsets))

    def _write_slab(self, rid: int, live: _Live, s: int, t0: int, t1: int) -> None:
        for a, z in self._pieces(t0, t1):
            pos = self.torch.arange(a, z, dtype=self.torch.int64, device=self.device)
            vals = self.values(rid, live, pos, s)[:, None]
            start = live.offsets[s] + a * self.b
            self.buf[start : start + (z - a) * self.b].view(z - a, self.b).copy_(
                vals.expand(z - a, self.b)
            )

    def _write_slabs(self, rid: int, live: _Live, t0: int, t1: int) -> None:
        """Tokens [t0, t1) of every sequence: the prompt written once, copied to the others."""
        if len(live.offsets) == 1:
            self._write_slab(rid, live, 0, t0, t1)
            return
        end = min(t1, live.prompt)
        self._write_slab(rid, live, 0, t0, end)
        if end > t0:
            first = live.offsets[0]
            for off in live.offsets[1:]:
                for a in range(t0 * self.b, end * self.b, SCRATCH):
                    z = min(end * self.b, a + SCRATCH)
                    self.buf[off + a : off + z].copy_(self.buf[first + a : first + z])
        for s in range(len(live.offsets)):
            self._write_slab(rid, live, s, max(t0, live.prompt), t1)

    # ----------------------------------------------------------------- checks
    def intact(self, rid: int, live: _Live) -> int:
        """Bytes of `rid` that differ from what it should hold (tokens, then HELD)."""
        if self.paged:
            return self._bad_blocks(rid, live, self._items(live), live.tokens)
        bad, one = 0, self._one(live)
        for s, offset in enumerate(live.offsets):
            for a, z in self._pieces(0, live.tokens):
                pos = self.torch.arange(a, z, dtype=self.torch.int64, device=self.device)
                vals = self.values(rid, live, pos, s)[:, None]
                start = offset + a * self.b
                got = self.buf[start : start + (z - a) * self.b].view(z - a, self.b)
                bad += int(self.torch.count_nonzero(got != vals))
            start, end = offset + live.tokens * self.b, offset + one
            for a in range(start, end, SCRATCH):
                region = self.buf[a : min(end, a + SCRATCH)]
                bad += int(self.torch.count_nonzero(region != HELD))
        return bad

    def count(self) -> tuple[int, int, int]:
        """(token bytes, HELD bytes, FREE bytes) over the whole budget, counted on the device;
        idle cached blocks hold tokens but count as free, as the model counts them."""
        torch, free, held = self.torch, 0, 0
        for a in range(0, self.capacity, SCRATCH):
            piece = self.buf[a : a + SCRATCH]
            free += int(torch.count_nonzero(piece == FREE))
            held += int(torch.count_nonzero(piece == HELD))
        idle = len(self.idle) * self.block_size * self.b
        return self.capacity - free - held - idle, held, free + idle

    def _check_tables(self, rid: int, tables: list[list[int]], tokens: int) -> str:
        bad = sorted({b for t in tables for b in t if not 0 <= b < self.num_blocks})
        if bad:
            return f"block ids {bad[:3]} outside the pool of {self.num_blocks}"
        for t in tables:
            if len(t) * self.block_size < tokens:
                return f"request {rid}: {tokens} tokens do not fit {len(t)} blocks"
        rows: dict[int, int] = {}
        for t in tables:
            for row, b in enumerate(t):
                if rows.setdefault(b, row) != row:
                    return f"request {rid}: block {b} sits at two places of its tables"
        return ""

    # -------------------------------------------------------------- operations
    def admit(
        self, rid: int, tokens: int, nbytes: int, offset: int, blocks: list[int],
        tables: list[list[int]] | None = None, offsets: list[int] | None = None,
        prompt: int = -1, keys: list[int] | None = None, copies: list[tuple[int, int]] = (),
    ) -> tuple[int, str]:
        """Hand out memory and write the first `tokens` tokens; returns (bad bytes, problem)."""
        if rid in self.live:
            return 0, f"admit of request {rid}, which is already live"
        live = _Live(prompt=prompt, nbytes=nbytes, keys=list(keys or ()))
        if self.paged:
            live.tables = [[]]
            self.live[rid] = live
            return self._paged(rid, live, tables or [list(blocks)], tokens, copies)
        live.offsets = list(offsets or [offset])
        one = self._one(live)
        for off in live.offsets:
            if off < 0 or off + one > self.capacity:
                return 0, f"request {rid}: slab [{off}, {off + one}) outside the arena"
        if tokens * self.b > one:
            return 0, f"request {rid}: {tokens} tokens do not fit a slab of {one} bytes"
        for off in live.offsets:
            self.buf[off : off + one].fill_(HELD)
        self.live[rid] = live
        self._write_slabs(rid, live, 0, tokens)
        live.tokens = tokens
        return 0, ""

    def grow(
        self, rid: int, tokens: int, nbytes: int, blocks: list[int],
        tables: list[list[int]] | None = None, copies: list[tuple[int, int]] = (),
    ) -> tuple[int, str]:
        live = self.live.get(rid)
        if live is None:
            return 0, f"grow of request {rid}, which is not live"
        if tokens < live.tokens:
            return 0, f"request {rid}: tokens went down from {live.tokens} to {tokens}"
        if self.paged:
            return self._paged(rid, live, tables or [live.table + list(blocks)], tokens, copies)
        if nbytes or tokens * self.b > self._one(live):
            return 0, f"request {rid}: a slab cannot grow ({tokens} tokens, +{nbytes} bytes)"
        self._write_slabs(rid, live, live.tokens, tokens)
        live.tokens = tokens
        return 0, ""

    def _paged(
        self, rid: int, live: _Live, tables: list[list[int]], tokens: int,
        copies: list[tuple[int, int]],
    ) -> tuple[int, str]:
        """Bring a request to `tables` and `tokens`: the blocks it leaves are checked and
        freed, those it joins taken (or checked, when they hold cached tokens already), the
        prompt written through the first table, the copies made, then the new tokens of every
        sequence written. Returns (bad bytes found, problem)."""
        tables = [[int(b) for b in t] for t in tables]
        problem = self._check_tables(rid, tables, tokens)
        if problem:
            return 0, problem
        old, new = roles(live.tables), roles(tables)
        t0, t1 = live.tokens, tokens
        was, now = self._cached(live, t0), self._cached(live, t1)
        bad = 0
        left = [(b, *old[b]) for b in old if new.get(b) != old[b]]
        if left:
            bad += self._bad_blocks(rid, live, left, t0)
            if any(row < was for _, row, _ in left):
                problem = f"request {rid}: a cached block left its table"
            self._set([b for b, _, _ in left], FREE)
        joined = [(b, *new[b]) for b in new if old.get(b) != new[b]]
        hits, fresh = [], []
        for it in joined:  # cached rows whose block holds their tokens already
            cached = it[1] < now and (it[0] in self.idle or it[0] in self.users)
            (hits if cached else fresh).append(it)
        if hits:
            bad += self._bad_blocks(rid, live, hits, t1)
            for b, _, _ in hits:
                self.idle.pop(b, None)
        if any(b in self.idle for b, _, _ in fresh):
            problem = f"request {rid}: an idle cached block handed out without its eviction"
        self._set([b for b, _, _ in fresh], HELD)
        live.tables = tables
        hit = {b for b, _, _ in hits}
        items = [(b, *new[b]) for b in new if b not in hit]
        # The prompt is prefilled as one sequence; the other sequences get it by copying.
        self._write_blocks(rid, live, [it for it in items if it[2] == 0], t0, min(t1, live.prompt))
        ours = {b for b, _, _ in fresh}
        for src, dst in copies:
            if src not in new or dst not in ours:
                problem = problem or f"request {rid}: copy {src} -> {dst} outside its new blocks"
                continue
            self.pool[dst] = self.pool[src]
        self._write_blocks(rid, live, items, max(t0, live.prompt), t1)
        for row in range(was, now):
            b = tables[0][row]
            self.users[b] = self.users.get(b, 0) + 1
        live.tokens = tokens
        return bad, problem

    def free(
        self, rid: int, nbytes: int, offset: int, blocks: list[int], processed: int = 0
    ) -> tuple[int, str]:
        """Check the request's bytes, then release them; returns (bad bytes, problem).
        `processed` (> 0): the tokens whose full blocks stay cached (async scheduling: a
        preempted decoder's token in flight is not processed); 0: all it holds."""
        live = self.live.pop(rid, None)
        if live is None:
            return 0, f"free of request {rid}, which is not live"
        bad = self.intact(rid, live)
        problem = ""
        if self.paged:
            items = self._items(live)
            if {int(b) for b in blocks} != {it[0] for it in items}:
                problem = f"request {rid}: freed blocks differ from its block tables"
            full = self._cached(live, live.tokens)
            cached = self._cached(live, min(live.tokens, processed or live.tokens))
            gone = []
            for b, row, s in items:
                if row < full and s == 0:  # a cached block: idle once nobody holds it
                    self.users[b] -= 1
                    if not self.users[b]:
                        del self.users[b]
                        if row < cached:
                            self.idle[b] = self._expect(rid, live, [(b, row, s)])[2][0]
                        else:  # (its last token was not processed: not kept)
                            gone.append(b)
                else:
                    gone.append(b)
            self._set(gone, FREE)
        else:
            if (offset, nbytes) != (live.offset, live.nbytes):
                problem = (
                    f"request {rid}: freed slab ({offset}, {nbytes}) differs from its admission "
                    f"({live.offset}, {live.nbytes})"
                )
            one = self._one(live)
            for off in live.offsets:
                self.buf[off : off + one].fill_(FREE)
        return bad, problem

    def evict(self, blocks: list[int]) -> tuple[int, str]:
        """Idle cached blocks dropped: checked against what they held, then set FREE."""
        bad, gone = 0, []
        for b in blocks:
            held = self.idle.pop(b, None)
            if held is None:
                return bad, f"eviction of block {b}, which is not idle-cached"
            bad += int(self.torch.count_nonzero(self.pool[b] != held[:, None]))
            gone.append(b)
        self._set(gone, FREE)
        return bad, ""

    def move(self, rid: int, nbytes: int, offset: int, from_offset: int) -> str:
        """Compaction: copy a slab's bytes to `offset` (piece by piece, safe when the two
        overlap), then mark what the old place no longer shares with the new one FREE."""
        live = self.live.get(rid)
        if live is None or self.paged:
            return f"move of request {rid}, which is not a live slab"
        n = self._one(live)
        s = live.offsets.index(from_offset) if from_offset in live.offsets else 0
        old = live.offsets[s]
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
        live.offsets[s] = offset
        return problem

    def release(self) -> None:
        """Drop the device memory."""
        self.live.clear()
        self.idle.clear()
        self.buf = self.pool = None  # type: ignore[assignment]


def replay_log(
    log: pd.DataFrame,
    outcome: Outcome,
    bytes_per_token: int,
    device: str = "cpu",
    block_size: int | None = None,
    checkpoints: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Outcome:
    """Replay `log` (arena when block_size is None, else paged) and fill in `outcome`;
    `progress(rows done, rows)` every `PROGRESS_ROWS` rows of the log, and at its end."""
    mem = MemoryReplay(outcome.capacity, bytes_per_token, device, block_size)
    try:
        _replay(mem, log, outcome, checkpoints, progress)
    finally:
        mem.release()
    return outcome.finish(TOLERANCES)


def _listed(row: Any, name: str) -> list:
    value = getattr(row, name, None)
    return [] if value is None or (isinstance(value, float) and value != value) else list(value)


def _replay(
    mem: MemoryReplay,
    log: pd.DataFrame,
    out: Outcome,
    limit: int | None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    checks = pick_checks(int((log["op"] == "check").sum()), limit)
    rows: list[dict[str, Any]] = []
    n_check = 0
    copies: list[tuple[int, int, int]] = []  # (rid, src, dst) waiting for their operation
    for i, row in enumerate(log.itertuples(index=False)):
        if progress is not None and i and not i % PROGRESS_ROWS:
            progress(i, len(log))
        op, rid, seq = row.op, int(row.rid), int(row.seq)
        blocks = [int(b) for b in _listed(row, "blocks")]
        if op == "check":
            if n_check in checks:
                rows.append(_measure(mem, row, out))
            n_check += 1
            continue
        out.ops += 1
        if op == "copy":
            copies.append((rid, *blocks[:2]))
            continue
        bad, problem = 0, ""
        mine = [(src, dst) for r, src, dst in copies if r == rid]
        if len(mine) < len(copies) or (copies and op not in ("admit", "grow")):
            problem = f"copies of request {copies[0][0]} not followed by its operation"
        copies = []
        tables = _listed(row, "tables")
        if op == "admit":
            prompt = getattr(row, "prompt", -1)
            bad, problem2 = mem.admit(
                rid, int(row.tokens), int(row.nbytes), int(row.offset), blocks, tables,
                [int(o) for o in _listed(row, "offsets")], int(prompt), _listed(row, "keys"),
                mine,
            )
        elif op == "grow":
            bad, problem2 = mem.grow(rid, int(row.tokens), int(row.nbytes), blocks, tables, mine)
        elif op == "move":
            frm = int(getattr(row, "from_offset", -1))
            problem2 = mem.move(rid, int(row.nbytes), int(row.offset), frm)
        elif op == "free":
            bad, problem2 = mem.free(rid, int(row.nbytes), int(row.offset), blocks,
                                     int(row.tokens))
        elif op == "evict":
            bad, problem2 = mem.evict(blocks)
        else:
            problem2 = f"unknown log operation {op!r}"
        if bad and op == "evict":
            out.corrupt += 1
            out.fail(seq, f"{bad} bytes of idle cached blocks {blocks[:3]} changed")
        elif bad:
            out.corrupt += 1
            what = "before its free" if op == "free" else f"found at its {op}"
            out.fail(seq, f"request {rid}: {bad} of its bytes changed ({what})")
        if problem or problem2:
            out.fail(seq, problem or problem2)
    for rid, live in list(mem.live.items()):  # still live when the run stopped
        bad = mem.intact(rid, live)
        if bad:
            out.corrupt += 1
            out.fail(int(log["seq"].max()) + 1, f"request {rid}: {bad} of its bytes changed")
    if progress is not None:
        progress(len(log), len(log))
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
