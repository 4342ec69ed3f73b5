"""vLLM 0.33's prefix caching under the hybrid KV-cache manager: the block pool shared by every
KV-cache group (`v1/core/block_pool.py`) and the cache-hit rules of the coordinator and its
single-type managers (`kv_cache_coordinator.py`, `single_type_kv_cache_manager.py`), kept
apart from the allocator (`sim.allocators.hybrid`) as vLLM keeps its block pool apart from its
managers.

- Keys. A block is cached under (its hash, its group): groups are cached, found and evicted
  independently. Block j's hash is the request's prefix hash chain through the chunk holding
  the block's last token (the blocks the workload's prefix ids name, as `prefix-caching`
  keys them), and the request's own key (rid, j) past them (generated tokens, and prompt
  tokens the prefix ids do not name): only the request itself, resumed after a preemption,
  finds those again.
- The free queue. Every block id nobody holds is free, cached or not: uncached ones are
  reused first (freed ones go to the queue's front), cached ones last, least recently freed
  first (they join its back); taking a cached block evicts it (its keys are dropped). A
  request's blocks are freed last first, group after group, so a prefix's tail goes first.
- Hits. Full attention matches left to right; a sliding window W right to left, needing
  ceil((W - 1) / bs) contiguous cached blocks that end at the hit (or a run from block 0);
  chunked local attention C hits every chunk before the last one of the lookup's length
  without looking (no layer reads them), then matches left to right from that chunk; Mamba
  state (mode "align") matches right to left the one state block that ends at the hit;
  the coordinator asks each kind in turn (full attention first) until every kind accepts the
  same length (one pass when there are two kinds, full and one other), capped at the
  request's tokens less one. A hit block nobody holds is revived: taken off the free queue,
  so an admission counts it against the free blocks as it counts a new one.
- Caching. Each allocation caches the blocks it filled (every kind's table up to the tokens
  computed). Sliding-window groups, with `prefix_cache_retention_interval` 0 (vLLM's
  default), cache only the blocks a later hit can use: the ceil((W - 1) / bs) blocks that
  end at the replay boundary (the prompt less its last token, aligned down to the scheduler
  block) and at a shared-prefix junction the lookup found (a prefix another kind had cached
  longer than the agreed hit); the rest are freed uncached as the window passes them. Mamba
  groups likewise cache only the state block ending at those two positions (one per R tokens
  too with R > 0; every one with None).
- Mamba "align" (`MambaManager`): a request's table per Mamba group is null but for its
  current state block (index ceil(P / bs) - 1 for P tokens computed) and, until its next
  allocation, the previous one; an allocation that enters a new block takes exactly one
  block (the ones between stay null), and the next allocation frees the old one
  (`remove_skipped_blocks`: the blocks before (P - 1) // bs, and `last_state_block_idx`).

`PrefixState` is the whole mutable state (pool, tables), so the allocator can copy it to look
ahead: decode steps are applied block by block, in the running order, as vLLM's scheduler
applies them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvfrag.sim.hybrid.overlay import Overlay

if TYPE_CHECKING:
    from kvfrag.sim.allocators.values import Live, Request

Key = tuple  # (hash or ("own", rid), j, group)


class BlockPool:
    """Block ids 1..n, their reference counts, the cache (key -> ids, oldest first) and the
    free queue (uncached ids first, then cached ones least recently freed first)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ref: dict[int, int] = {}  # id -> requests holding it (ids in use, idle cached)
        self.keys: dict[int, list[Key]] = {}  # cached id -> its keys
        # key -> ids cached under it, oldest first (None in a `light_copy`)
        self.cache: dict[Key, dict[int, None]] | None = {}
        self.fresh: list[int] = []  # uncached ids freed, not taken again; the end is the front
        self.unused = 1  # ids unused..n were never taken (they follow `fresh` in the queue)
        self.idle: dict[int, None] = {}  # cached free ids, least recently freed first
        self.evictions = 0
        self.evicted: list[int] = []  # ids evicted since the allocator last handed them out

    def light_copy(self) -> BlockPool:
        """A pool that counts, takes and frees ids as this one would but keeps no cache
        (`cache` None): what a look-ahead needs, which looks nothing up (`AheadPool`: this
        pool's dicts are read, not copied, so it must not change while the other is used)."""
        return AheadPool(self)

    def free_count(self) -> int:
        return len(self.fresh) + self.n + 1 - self.unused + len(self.idle)

    def take(self, n: int) -> list[int]:
        """n ids off the queue's front (vLLM's `get_new_blocks`): uncached first, then the
        least recently freed cached ones, evicted."""
        out, left = self._take_free(n)
        ref = self.ref
        for b in out:
            ref[b] = 1
        if left:
            idle, keys, cache, evicted = self.idle, self.keys, self.cache, self.evicted
            for _ in range(left):
                b = next(iter(idle))
                del idle[b]
                gone = keys.pop(b, ())  # (`_uncache`, inlined)
                if cache is not None:
                    for key in gone:
                        ids = cache[key]
                        del ids[b]
                        if not ids:
                            del cache[key]
                evicted.append(b)
                ref[b] = 1
                out.append(b)
            self.evictions += left
        return out

    def _take_free(self, n: int) -> tuple[list[int], int]:
        """Up to n uncached free ids off the queue's front (freed ones, the last freed
        first, then never-used ones), and how many are still wanted."""
        fresh = self.fresh
        k = min(n, len(fresh))
        out = fresh[:-k - 1:-1] if k else []
        if k:
            del fresh[-k:]
        left = n - k
        if left:
            m = min(left, self.n + 1 - self.unused)
            if m > 0:
                out.extend(range(self.unused, self.unused + m))
                self.unused += m
                left -= m
        return out, left

    def free(self, blocks: list[int]) -> int:
        """Drop one reference to each id (in eviction order, first evicted first); returns
        how many became free."""
        front: list[int] = []
        freed = 0
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                freed += 1
                if b in self.keys:
                    self.idle[b] = None
                else:
                    del self.ref[b]
                    front.append(b)
        self.fresh.extend(reversed(front))
        return freed

    def touch(self, blocks: list[int]) -> None:
        """A hit: one more reference to each id, reviving the idle ones."""
        for b in blocks:
            if b:
                if self.ref[b] == 0:
                    del self.idle[b]
                self.ref[b] += 1  # (a hit id is cached: it has a count, maybe 0)

    def lookup(self, key: Key) -> int:
        """The oldest id cached under `key`, or 0."""
        assert self.cache is not None
        ids = self.cache.get(key)
        return next(iter(ids)) if ids else 0

    def insert(self, key: Key, b: int) -> None:
        assert self.cache is not None
        ids = self.cache.setdefault(key, {})
        if b not in ids:
            ids[b] = None
            self.keys.setdefault(b, []).append(key)

    def _uncache(self, b: int) -> None:
        self.ref.pop(b, None)
        keys = self.keys.pop(b, ())
        if self.cache is None:
            return
        for key in keys:
            ids = self.cache[key]
            del ids[b]
            if not ids:
                del self.cache[key]


class AheadPool(BlockPool):
    """`BlockPool.light_copy`: a look-ahead's pool over a base pool that stays as it is. Ids
    are counted, taken and freed as the base would (the same order: its uncached freed ids,
    its never-used ones, its idle cached ones least recently freed first, then those freed
    here), with no copy of its dicts: what changes is kept here (`ref` as an overlay, `gone`
    the ids evicted here, `idle` those made idle here); nothing is cached."""

    def __init__(self, base: BlockPool) -> None:
        self.n, self.unused, self.evictions = base.n, base.unused, base.evictions
        self.ref = Overlay(base.ref)  # type: ignore[assignment]
        self.keys = base.keys  # (read only: an id in `gone` has lost its keys)
        self.gone: set[int] = set()
        self.cache = None
        self.fresh = list(base.fresh)
        self.idle = {}
        self.evicted = []
        self._old_idle = iter(base.idle)  # the base's idle ids not evicted here, in order
        self._old_left = len(base.idle)

    def light_copy(self) -> BlockPool:
        raise NotImplementedError("a look-ahead's pool is not copied")

    def free_count(self) -> int:
        return (len(self.fresh) + self.n + 1 - self.unused + self._old_left
                + len(self.idle))

    def take(self, n: int) -> list[int]:
        out, left = self._take_free(n)
        ref = self.ref
        if out:  # (ids no count names: the overlay's size grows by them)
            ref.changed.update(dict.fromkeys(out, 1))  # type: ignore[attr-defined]
            ref.size += len(out)  # type: ignore[attr-defined]
        for _ in range(left):
            if self._old_left:
                b = next(self._old_idle)
                self._old_left -= 1
            else:
                b = next(iter(self.idle))
                del self.idle[b]
            self.gone.add(b)  # (its count, 0, is overwritten below)
            self.evictions += 1
            self.evicted.append(b)
            ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> int:
        front: list[int] = []
        freed = 0
        ref = self.ref
        for b in blocks:
            count = ref[b] - 1
            ref[b] = count
            if count == 0:
                freed += 1
                if b in self.keys and b not in self.gone:
                    self.idle[b] = None
                else:
                    del ref[b]
                    front.append(b)
        self.fresh.extend(reversed(front))
        return freed

    def touch(self, blocks: list[int]) -> None:
        raise NotImplementedError("a look-ahead revives no hit")


@dataclass
class Kind:
    """One attention kind of the plan (vLLM's attention group: groups of one spec), as the
    lookup walks it: its plan groups, block size and window (0: full attention)."""

    kind: str  # "full", "sliding_window", "chunked_local" or "mamba"
    groups: tuple[int, ...]
    block_size: int
    window: int

    def need(self) -> int:
        """Contiguous cached blocks a sliding-window hit needs."""
        return -(-(self.window - 1) // self.block_size)

    def skipped(self, processed: int) -> int:
        """Leading blocks a request no longer needs once `processed` tokens are computed."""
        if self.kind == "sliding_window":
            return max(0, processed - self.window + 1) // self.block_size
        if self.kind == "chunked_local":
            return processed // self.window * self.window // self.block_size
        if self.kind == "mamba":  # (only the last token's state is read)
            return max(0, processed - 1) // self.block_size
        return 0

    def next_skip(self, processed: int) -> int:
        """The fewest tokens processed past `processed` that may skip more blocks (sliding
        and chunked kinds; at worst early)."""
        if self.kind == "sliding_window":
            skip = max(0, processed - self.window + 1) // self.block_size
            return (skip + 1) * self.block_size + self.window - 1
        if self.kind == "chunked_local":
            return (processed // self.window + 1) * self.window
        return processed + 1

    def read_from(self, tokens: int) -> int:
        """The first token a request of `tokens` tokens still reads in these groups."""
        if self.kind == "sliding_window":
            return max(0, tokens - self.window)
        if self.kind == "chunked_local":
            return max(0, tokens - 1) // self.window * self.window
        if self.kind == "mamba":
            return tokens  # (a state, no tokens: `HybridPrefixCaching._figures` counts it)
        return 0


def block_key(req: Request, chain: list[object], j: int, g: int) -> Key:
    """Block j's key in plan group g: its prefix hash chain's, or the request's own past it."""
    return (chain[j] if j < len(chain) else ("own", req.rid), j, g)


class Lookup(Protocol):
    """What a hit's lookup asks of a pool: the oldest id cached under a key, or 0."""

    def lookup(self, key: Key) -> int: ...


def find_kind(pool: Lookup, req: Request, chain: list[object], k: Kind,
              max_len: int) -> tuple[list[list[int]], int]:
    """One kind's hit within `max_len` tokens (see the module's Hits): per group of the kind
    its hit's ids (0 where no layer reads a block), and the hit's tokens."""
    bs = k.block_size
    if k.kind in ("full", "chunked_local"):
        # Left to right. Chunked local attention: the chunks before max_len's are past every
        # window, hit without a lookup (null blocks), then the blocks of its chunk.
        start = 0 if k.kind == "full" else max(0, max_len) // k.window * k.window // bs
        out: list[list[int]] = [[0] * start for _ in k.groups]
        for j in range(start, max_len // bs):
            ids = [pool.lookup(block_key(req, chain, j, g)) for g in k.groups]
            if not all(ids):
                break
            for lst, b in zip(out, ids, strict=True):
                lst.append(b)
        return out, len(out[0]) * bs
    if k.kind == "mamba":
        # Right to left: the state block ending at the hit (the blocks before are null).
        for i in range(max_len // bs - 1, -1, -1):
            ids = [pool.lookup(block_key(req, chain, i, g)) for g in k.groups]
            if all(ids):
                return [[0] * i + [b] for b in ids], (i + 1) * bs
        return [[] for _ in k.groups], 0
    need, top = k.need(), max_len // bs
    comp = [[0] * top for _ in k.groups]
    run, found = 0, False
    for i in range(top - 1, -1, -1):
        ids = [pool.lookup(block_key(req, chain, i, g)) for g in k.groups]
        if all(ids):
            for lst, b in zip(comp, ids, strict=True):
                lst[i] = b
            run += 1
            if run >= need:
                for lst in comp:
                    del lst[i + run:]
                found = True
                break
        else:
            run = 0
    if not found:
        for lst in comp:
            del lst[run:]
    return comp, len(comp[0]) * bs


def reachable(req: Request, k: Kind, j: int, retention: int | None, scheduler_bs: int,
              junction: int) -> bool:
    """Whether a sliding-window block can serve a hit (vLLM's `reachable_block_mask`): it
    is among the blocks a hit at the end of a retained segment needs (every scheduler
    block with retention None, every R tokens with R > 0, none with 0), or, unless
    retention is None, a hit at the replay boundary or at the request's shared-prefix
    junction."""
    need, bs, a = k.need(), k.block_size, scheduler_bs
    segment = a if retention is None else retention
    if segment:
        per = segment // bs
        if need >= per or j % per >= per - need:
            return True
        if retention is None:
            return False
    bounds = [req.prompt - 1]
    if junction:
        bounds.append(junction)
    for x in bounds:
        end = x // a * a // bs
        if end - need <= j < end:
            return True
    return False


def state_kept(req: Request, k: Kind, j: int, retention: int | None, scheduler_bs: int,
               junction: int) -> bool:
    """Whether Mamba state block j is cached (vLLM's `MambaManager.reachable_block_mask`):
    every block with retention None; with R > 0 the last block of each R tokens; and the
    block ending at the replay boundary (the prompt less its last token) or the request's
    shared-prefix junction, aligned down to the scheduler block."""
    if retention is None:
        return True
    if retention:
        per = retention // k.block_size
        if per <= 1 or j % per == per - 1:
            return True
    a = scheduler_bs
    bounds = [req.prompt - 1]
    if junction:
        bounds.append(junction)
    return any(x // a * a // k.block_size - 1 == j for x in bounds)


def aligned_split(prompt: int, start: int, chunk: int, total: int, limit: int, bs: int,
                  junction: int) -> int:
    """vLLM's `_mamba_block_aligned_split` (mode "align"): a prefill chunk from `start` of a
    request of `prompt` prompt tokens and `total` tokens to prefill ends on a block boundary
    (blocks of `bs` tokens) unless it ends the prefill (a block wider than `limit`, the most
    one chunk may take, may end inside it when no boundary is in reach), and it stops at the
    first of these inside it: the next boundary when it starts inside a block, the last
    boundary before the sequence's last token (the state a hit can use), the shared-prefix
    `junction` (aligned down from `start`; 0: none). 0: not this step."""
    prefill_end = max(prompt, total - 1)
    if start >= prefill_end:
        return chunk
    end = start + chunk
    if end < prefill_end:
        aligned = end // bs * bs
        if aligned > start or bs <= limit:
            end = aligned
    stops = ((start // bs + 1) * bs if start % bs else 0,
             max(0, (total - 1) // bs * bs),
             start + (junction - start) // bs * bs if start < junction < end else 0)
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def leading_nulls(table: list[int]) -> int:
    """The nulls a table starts with, found by bisection: where its nulls are a prefix
    (an attention table's), the table's nulls."""
    return bisect_left(table, True, key=bool)


class PrefixState:
    """The pool and every live request's block tables (0: the null block) and cached-block
    counts, per plan group."""

    def __init__(self, n: int, groups: int) -> None:
        self.pool = BlockPool(n)
        self.groups = groups
        self.tables: dict[int, list[list[int]]] = {}
        self.ncached: dict[int, list[int]] = {}
        self.boundary: dict[int, int] = {}  # rid -> shared-prefix junction its lookup found
        self.freed = 0  # ids the last decode step freed
        # rid -> Mamba "align" bookkeeping, alike for every Mamba group: [blocks retired
        # (vLLM's `_num_retired_blocks`), `last_state_block_idx` (-1: none), whether it was
        # allocated for (`_allocated_block_reqs`)]; `parked`: a detached request's
        self.mamba: dict[int, list[int]] = {}
        self.parked: dict[int, list[int]] = {}
        # rid -> the leading positions of its tables its admission's hit filled, where that
        # hit took ids other requests held: an id held by two requests or more is in one of
        # these (its last holder took it so)
        self.hits: dict[int, int] = {}
        # rid -> tokens before which its decode steps free, take and cache nothing
        # (`note_quiet`; absent: ask each step)
        self.quiet: dict[int, int] = {}
        # a light copy: the requests whose tables (and Mamba bookkeeping) it copied, the
        # others' shared with the state it was copied from (`writable`); None: not a copy
        self.own: set[int] | None = None

    def light_copy(self) -> PrefixState:
        """A copy to look ahead with (`BlockPool.light_copy`: nothing is cached in it, so
        the cached-block counts are shared). A request's tables are copied when first
        changed (`writable`): a look-ahead changes few of them."""
        other = PrefixState.__new__(PrefixState)
        other.pool, other.groups, other.freed = self.pool.light_copy(), self.groups, 0
        other.tables = dict(self.tables)
        other.own = set()
        other.ncached = dict(self.ncached)
        other.boundary = dict(self.boundary)
        other.mamba = dict(self.mamba)
        other.parked = {rid: list(m) for rid, m in self.parked.items()}
        other.hits = dict(self.hits)
        other.quiet = dict(self.quiet)
        return other

    def writable(self, rid: int) -> list[list[int]]:
        """The request's tables, to change: in a light copy, copied first (once)."""
        own = self.own
        if own is not None and rid not in own:
            own.add(rid)
            self.tables[rid] = [list(t) for t in self.tables[rid]]
            mamba = self.mamba.get(rid)
            if mamba is not None:
                self.mamba[rid] = list(mamba)
        return self.tables[rid]

    def due(self, decoders: Sequence[tuple[int, Live]], clock: int) -> Sequence[int]:
        """The ranks of `decoders` ((rid, live) in running order) whose step at `clock` is not
        known quiet (`note_quiet`): the ones a decode step looks at."""
        if not self.quiet:
            return range(len(decoders))
        wake = self.quiet.get
        return [i for i, (rid, live) in enumerate(decoders) if wake(rid, 0) <= live.base + clock]

    def note_quiet(self, rid: int, tokens: int, processed: int,
                   quiet: list[tuple[int, int, bool]], kinds: list[Kind], kind_of: list[int],
                   lag: int) -> None:
        """After a decode step to `tokens` that freed, took and cached nothing for the request
        (`HybridPrefixCaching._quiet_step`, judged on `quiet`'s groups: (first group of a
        kind, block size, Mamba?)), the tokens up to which its steps stay so, kept in `quiet`:
        its next block boundary, block to cache, window edge or Mamba state to retire,
        whichever comes first. A later change of its tables only moves these later (a
        window's blocks freed, more cached) or comes with leaving the cohort (a chunk), which
        forgets it, as an admission does. Not kept for an async decoder's first step (it
        frees by other tokens than `tokens - 1 - lag`)."""
        if processed != tokens - 1 - lag:
            return
        tables, ncached = self.tables[rid], self.ncached[rid]
        caching = self.pool.cache is not None
        until = 1 << 62
        for g, bs, mamba in quiet:
            table = tables[g]
            until = min(until, len(table) * bs + 1)
            if caching:
                until = min(until, (ncached[g] + 1) * bs + lag)
            # (the tokens at which `processed` reaches p: p + 1 + lag)
            if mamba:
                retired, last_state = self.mamba[rid][0], self.mamba[rid][1]
                until = min(until, (retired + 1) * bs + 2 + lag)
                if last_state >= 0 and table[last_state]:
                    until = min(until, (last_state + 1) * bs + 2 + lag)
                continue
            k = kinds[kind_of[g]]
            if k.kind != "full":
                until = min(until, k.next_skip(processed) + 1 + lag)
        self.quiet[rid] = until

    def blocks_per_group(self, kind_of: list[int],
                         prefix_nulls: Sequence[bool] = ()) -> tuple[int, ...]:
        """Per group (`kind_of[g]`: its kind), the ids in the tables (an id two requests hold
        counts twice). A request's tables of one kind are alike: one of them is counted for
        all. `prefix_nulls[ki]`: kind ki's nulls are a prefix of each table (attention kinds:
        a window frees from the front; not Mamba), counted by bisection, not by a scan."""
        first: dict[int, int] = {}
        for g, ki in enumerate(kind_of):
            first.setdefault(ki, g)
        counts = dict.fromkeys(first, 0)
        reps = [(ki, g, ki < len(prefix_nulls) and prefix_nulls[ki])
                for ki, g in first.items()]
        for tables in self.tables.values():
            for ki, g, prefix in reps:
                table = tables[g]
                if prefix:
                    if table and not table[0]:
                        counts[ki] += len(table) - leading_nulls(table)
                    else:
                        counts[ki] += len(table)
                else:
                    counts[ki] += len(table) - table.count(0)
        return tuple(counts[ki] for ki in kind_of)

    def held(self) -> int:
        """Ids in use (held by some request)."""
        return self.pool.n - self.pool.free_count()

    def remove_skipped(self, rid: int, kinds: list[Kind], kind_of: list[int],
                       processed: int) -> int:
        """vLLM's `remove_skipped_blocks`: each group's blocks before the window freed (last
        first) and replaced by the null block. Returns the ids that became free."""
        freed = 0
        skips = [k.skipped(processed) for k in kinds]
        tables = self.writable(rid)
        mamba = self.mamba.get(rid)
        retired = -1
        for g, table in enumerate(tables):
            k = kinds[kind_of[g]]
            if k.kind == "mamba":
                assert mamba is not None
                got, retired = self._mamba_trim(table, mamba, k.block_size, processed)
                freed += got
                continue
            skip = min(skips[kind_of[g]], len(table))
            if not skip or not table[skip - 1]:
                continue  # (nothing left to free: the usual)
            gone = []
            for i in range(skip - 1, -1, -1):
                if table[i] == 0:
                    break
                gone.append(table[i])
                table[i] = 0
            if gone:
                freed += self.pool.free(gone)
        if retired >= 0:
            assert mamba is not None
            mamba[0] = retired
        return freed

    def _mamba_trim(self, table: list[int], mamba: list[int], bs: int,
                    processed: int) -> tuple[int, int]:
        """One Mamba group's `remove_skipped_blocks` in mode "align": the blocks before
        (P - 1) // bs not yet retired (last first, nulls passed over), then the state block
        of the allocation before last once P is past it. Returns (ids freed, blocks retired)."""
        freed = 0
        retired = mamba[0]
        if processed > 1:  # (vLLM's base returns early when it skips no token)
            first, last = mamba[0], min((processed - 1) // bs, len(table))
            if first < last:
                gone = [table[i] for i in range(last - 1, first - 1, -1) if table[i]]
                for i in range(first, last):
                    table[i] = 0
                if gone:
                    freed += self.pool.free(gone)
                retired = last
        last_state = mamba[1]
        if 0 <= last_state < -(-processed // bs) - 1 and table[last_state]:
            freed += self.pool.free([table[last_state]])
            table[last_state] = 0
        return freed, retired

    def mamba_take(self, table: list[int], mamba: list[int], bs: int, tokens: int) -> list[int]:
        """One Mamba group's `allocate_new_blocks` in mode "align": entering a new block takes
        one block at index ceil(tokens / bs) - 1 (nulls before it), and the previous last
        block becomes the state to free at the next allocation."""
        required = -(-tokens // bs)
        if required <= len(table):
            mamba[2] = 1
            return []
        prev = len(table)
        if mamba[2] or prev > 0:
            mamba[1] = prev - 1
        if prev < required - 1:
            table.extend([0] * (required - 1 - prev))
        got = self.pool.take(1)
        table.extend(got)
        mamba[2] = 1
        return got

    def victims_turn(self, queue: list[tuple[int, list[list[int]], int]], kinds: list[Kind],
                     kind_of: list[int]) -> None:
        """The requests preempted for a decode step (rid, tables, tokens processed; newest
        first) that no decoder's shortage freed: the oldest of them reaches its turn, frees
        what its window left, finds too few free and frees the others, then itself (vLLM
        preempts the newest first)."""
        if not queue:
            return
        rid, tables, processed = queue[-1]
        self.tables[rid] = tables
        if self.own is not None:  # (its tables are the queue's, changed in place below)
            self.own.add(rid)
        if rid in self.parked:
            self.mamba[rid] = self.parked.pop(rid)
        self.remove_skipped(rid, kinds, kind_of, processed)
        del self.tables[rid]
        self.mamba.pop(rid, None)
        for other, tables, _ in queue:
            self.free_tables(tables)
            self.parked.pop(other, None)

    def release(self, rid: int) -> None:
        """Free every block of the request, group after group, each table last first."""
        self.free_tables(self.detach(rid))
        self.parked.pop(rid, None)

    def detach(self, rid: int) -> list[list[int]]:
        """The request's tables, taken out of the state (their ids still held)."""
        self.ncached.pop(rid, None)
        self.boundary.pop(rid, None)
        self.hits.pop(rid, None)
        self.quiet.pop(rid, None)
        mamba = self.mamba.pop(rid, None)
        if mamba is not None:
            self.parked[rid] = mamba
        return self.tables.pop(rid, [])

    def free_tables(self, tables: list[list[int]]) -> None:
        for table in tables:
            self.pool.free([b for b in reversed(table) if b])
