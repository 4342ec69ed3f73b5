"""Prefix caching across requests: paged blocks found again by the hash chain of their tokens.

Wraps the paged allocator the way vLLM's (v1) prefix caching wraps its block pool, and follows
vLLM 0.33's rules (checked step by step against its scheduler in tests/oracle):
- Keys. A block is identified by the hash chain of the tokens up to its end. Traces give it for
  the prompt as per-chunk hashes (`hash_ids`, e.g. 512-token chunks in the Mooncake trace),
  mapped here onto any engine block size (block j of bs tokens is identified by the chain of
  chunks covering tokens [0, (j+1)*bs), plus j). The chain names no other block: generated
  tokens, and prompt blocks past the trace's hashes, hold tokens of the request's own, so
  their keys are the request's own: (rid, j) (`cache_generated`).
- Every full block is cached as soon as it is filled, generated tokens included (vLLM hashes
  every full block of a request's tokens). `cache_generated=False` caches only the blocks the
  trace's hash chain names (the prompt's), kvfrag's earlier model.
- Hits are looked up only when a request is admitted (or resumed after a preemption): whole
  blocks, the longest leading run of keys found cached, capped at `tokens - 1` tokens where
  `tokens` counts what the request has to prefill (`cached_prefix_tokens(req, tokens)`: a
  resumed request's generated tokens included, so it finds its own output again). At least one
  token is always computed, so a request whose every block is cached (a prompt that is an exact
  multiple of the block size, asked again) recomputes its last block.
- Block tables are append-only: a block filled by a request is its own and joins the cache
  under its key even when that key is cached already (the duplicate stays: both are cached
  under the key, and a lookup finds the oldest). So the recomputed last block of a fully
  cached prompt is a fresh block, and two requests prefilling the same tokens at once each
  keep theirs.
- When its last user frees it, a cached block stays cached but idle: it counts as usable free
  memory, and idle blocks are evicted least recently freed first when blocks run out (a
  request's blocks are freed last first, so a prefix's tail goes before its head). Reusing an
  idle block found by a lookup takes it back from the free memory (`admission_bytes`).

Accounting: a cached block in use is allocated once, holds bs tokens once, however many
requests use it; idle cached blocks are free. A request's table starts with cached blocks it
holds by reference (`live.cached` tokens): those it found at admission, then the blocks the
hash chain names that it filled itself (they must be found by requests admitted while it
runs). Its other blocks are its own and counted as in the paged allocator, whether full or
not: the full ones join the cache only when the request is freed (or preempted). Nobody else
can find them before: their keys are its own (a request does not look up while it runs). So
decode stretches advance in closed form as in the paged allocator, and a free costs one
operation per block the request held, as vLLM's does.

Sample groups and beams (n sequences): the cache knows the prompt's named blocks only. A
group looks them up (capped at prompt - 1 tokens, even when resumed) and caches them exactly
as a single request does (its sequences share them anyway), and counts once in their
reference counts; past them its sequences fork as in the paged allocator, and their blocks
(the partial prompt block copied on write, generated tokens, a beam trunk) are the group's
own, never cached: kvfrag models a group as one request whose sequences fork from one prompt
(vLLM v1 runs n samples as n requests and has no beams), and a block shared by several
sequences or pruned with its beam has no single owner whose output it holds. With S = P // bs
the prompt's full blocks, C <= S of them cached (`live.cached` = C*bs; `live.shared` = S*bs,
the paged allocator's blocks kept once) and L tokens a sequence, the request's own blocks are
    ceil(L/bs) - C                                   while its prompt is prefilled (L <= P),
    n*ceil(L/bs) - (n-1)*S - C                       samples past the prompt,
    n*ceil(L/bs) - (n-1)*floor(L/bs) - C             beams past the prompt,
the paged counts less the cached blocks; so the prompt's full blocks the hash chain does not
name are still kept once for all sequences, by the request. Its distinct tokens are the paged
ones less C*bs (the cache holds those). `saved_by_sharing` adds both savings, each once: the
copies a group's sequences do not make ((n-1)*S samples, (n-1)*floor(L/bs) beams, as paged)
and the copies the cache spares (users - 1 per cached block in use, a group one user).

Block ids: a cached block is the block that was filled with its tokens, under the same id
(the request's own block joins the cache when it fills, or when the request is freed). Idle
cached blocks keep their id and bytes until evicted, when the id goes back to the free stack.
`block_table` lists a request's cached blocks first, then its own; a group's `block_tables`
(one per sequence, as paged) each start with its cached blocks, then name its own as the paged
allocator does, copies on write included. `prefix_keys` gives one digest per block the request
caches when full (named prompt blocks, then, with `cache_generated`, its own up to its final
length), so that a replay can write (and check) the same bytes for the same tokens.

Evictions change what a waiting request would need without a free: a group past its prompt
that finds fewer tokens cached is admitted with fewer, n blocks less per block of them, so
`steps_until_evict` tells the engine when the next idle block goes.

Speed: on long contexts nearly every block is filled, cached, freed and evicted, hundreds per
engine event, so no pass makes or looks up a key per block, and next to nothing is written per
block. A block's key follows from its position in its request's chain: the blocks of one chunk
of the hash chain (or a request's own blocks) are one segment, with consecutive keys, and
sequences of keys are described by runs within segments (`Keys`). The cache keeps, per
segment, the oldest id under each of its keys in a list indexed by block (`Seg`; younger
duplicates apart, in `_dups`), so that caching, looking up and evicting a chunk's blocks are
slice operations on lists. A chunk's blocks are as a rule in one state, all in use by the same
requests or all idle in the run one free gave back, so a segment keeps that state once
(`Seg.idle`, `Seg.extra`); only a segment whose blocks disagree (a lookup that took part of
it, a duplicate) keeps it by id (`_idle_of`, `_shared`). Idle blocks are kept as the runs that
frees gave back, each in its request's table order (`Run`), which evictions consume from the
oldest run's end (a request's blocks are freed last first); a run's keys are its request's key
runs, or a slice of their list, and evicted runs go back to the free stack as they are
(`FreeIds.give`). `_refs`, `_idle`, `_cached` and `_key` assemble the per-block maps, for checks.

Measured and replaced (counted instructions, Mooncake sample, 16-token blocks): a map by id to
each idle block's run, written when it was freed and cleared when it was evicted (~60
instructions a block each way), and a map by id of every shared block's users: keeping the
state per segment took 228k instructions an event to 178k (with the free stack's lists, the
hash chain's keys kept small and runs found by block index: 159k; with segment bases kept
boxed, `Base`, 144k; with fewer calls and dictionary probes per chunk, 137k). Tried and not
kept: a list of runs beside each segment's ids (+1 %: a list write costs ~30 instructions an
element even as a slice), an earlier per-segment idle state without the by-id fallback (+15 %
with 512-token blocks, where a chunk is one block), and runs that keep their segments, to
evict without looking them up (-1.5 %, but each idle segment and its run then make a
reference cycle, left to the collector the engine pauses).
"""

from __future__ import annotations

from collections import deque
from typing import cast

from kvfrag.sim.allocators import prefix_checks
from kvfrag.sim.allocators.base import Grant, Live, Reason, Refusal, Request
from kvfrag.sim.allocators.paged import PagedAllocator
from kvfrag.sim.allocators.prefix_keys import Base, Key, Keys, Run, Seg, own_base, pack
from mypy_extensions import mypyc_attr


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class PrefixCachingAllocator(PagedAllocator):
    """Paged blocks plus a cache of full blocks keyed by their token hash chain."""

    kind = "prefix-caching"

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        block_size: int = 16,
        cache_generated: object = True,
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len, block_size)
        if not isinstance(cache_generated, bool):
            raise ValueError(f"cache_generated must be true or false, got {cache_generated!r}")
        self.cache_generated = cache_generated
        # tokens a request being freed has processed (`free_preempted`; -1: all it holds)
        self._processed = -1
        self._segs: dict[Base, Seg] = {}  # segment base -> its cached blocks' oldest ids
        self._dups: dict[Key, list[int]] = {}  # key -> younger ids cached under it, oldest first
        self._in_use = 0  # cached blocks in use (held by a live request)
        self._shared: dict[int, int] = {}  # id -> users beyond one, in use in a mixed segment
        self._idle_of: dict[int, Run] = {}  # id -> run of an idle block of a mixed segment
        self._idle_blocks = 0  # cached blocks nobody uses
        self._runs: deque[Run] = deque()  # the runs holding idle blocks, LRU first
        self._dead = 0  # runs in there left with none (all found again): dropped in bulk
        self._held: dict[int, list[int]] = {}  # rid -> cached blocks its table starts with
        self._keys_of: dict[int, Keys] = {}  # rid -> keys of its named prompt blocks
        self._evicted: dict[int, None] = {}  # ids of idle blocks evicted since last asked
        self._last_keys: tuple[Request | None, Keys] = (None, Keys([]))  # block_keys' last
        self._version = 0  # counts blocks joining or leaving the cache, for `_found`
        self._last_walk: tuple[Request | None, int, int, list[int]] = (None, 0, 0, [])
        self._uses = 0  # users summed over the cached blocks in use
        self._asked: dict[int, int] = {}  # rid -> tokens to prefill it was last looked up with
        self.lookups = 0  # full blocks looked up at admissions (up to the cap)
        self.hits = 0  # of them found cached
        self.evictions = 0
        self._stepped_at = 0  # the decode clock when steps last evicted

    # ------------------------------------------------------------------ keys
    def block_keys(self, req: Request) -> Keys:
        """Keys of the request's full prompt blocks that its hash chain identifies."""
        if not req.prefix or req.prefix_tokens < 1:
            return Keys([])
        if self._last_keys[0] is req:  # the waiting head is looked up, gated, then admitted
            return self._last_keys[1]
        bs, chunk = self.block_size, req.prefix_tokens
        blocks = req.prompt // bs
        runs: list[tuple[Base, int, int]] = []
        h: Base = 0
        prefix: tuple[object, ...] = req.prefix  # (its values are hashed: no unboxing)
        # Blocks j whose last token is in chunk c: (j + 1)*bs - 1 in [c*chunk, (c+1)*chunk),
        # i.e. from c*chunk // bs (where the previous chunk's blocks end) to (c+1)*chunk // bs.
        start, end = 0, 0
        for value in prefix:
            if start >= blocks:  # (chunks past the prompt's full blocks name none)
                break
            h = cast(Base, hash((h, value)))  # (kept boxed: not narrowed to an int)
            end += chunk
            n = min(end // bs, blocks) - start
            if n > 0:
                runs.append((h, start, n))
                start += n
        keys = Keys(runs, start, 0)  # (start: min(len(prefix)*chunk // bs, blocks) now)
        self._last_keys = (req, keys)
        return keys

    def _caches_own(self, req: Request) -> bool:
        """Whether the request's blocks the hash chain does not name are cached too."""
        return self.cache_generated and req.n == 1

    @staticmethod
    def _keys_between(rid: int, named: Keys, start: int, end: int) -> Keys:
        """Keys of the request's blocks start..end-1: its named ones, then its own."""
        keys = named.slice(start, end)
        first = max(start, len(named))
        if end > first:
            offset = start if named.offset == 0 else -1
            return Keys([*keys.runs, (own_base(rid), first, end - first)], end - start, offset)
        return keys

    def _walk(self, req: Request, named: Keys, cap: int) -> list[int]:
        """Ids of the leading run of the request's first `cap` blocks found cached (for each,
        the oldest block cached under its key, as vLLM's lookup finds)."""
        found: list[int] = []
        segs = self._segs
        runs = named.runs
        if cap > len(named):
            runs = [*runs, (own_base(req.rid), len(named), cap - len(named))]  # (no slice)
        for base, j, n in runs:
            n = min(n, cap - len(found))
            seg = segs.get(base)
            if n <= 0 or seg is None or j < seg.lo:
                break
            part = seg.ids[j - seg.lo : j - seg.lo + n]
            if seg.count == len(seg.ids):  # (no hole in it: the usual, with no scan)
                k = len(part)
            else:
                k = part.index(-1) if -1 in part else len(part)
            found.extend(part[:k])
            if k < n:
                break
        return found

    def _found(self, req: Request, named: Keys, cap: int) -> list[int]:
        """`_walk`, remembered while no block joins or leaves the cache: the engine asks the
        same of the waiting head three times (its hits, the bytes it needs, its admission).
        The list is shared: not to be changed."""
        last_req, last_cap, version, found = self._last_walk
        if last_req is req and version == self._version:
            if cap <= len(found):  # (a leading part of what it found)
                return found if cap == len(found) else found[:cap]
            if len(found) < last_cap:  # the block it did not find ends any longer walk too
                return found
        found = self._walk(req, named, cap)
        self._last_walk = (req, cap, self._version, found)
        return found

    def _cap(self, req: Request, named: Keys, tokens: int) -> int:
        """Blocks a lookup may find for a request with `tokens` tokens to prefill: whole
        blocks of at most tokens - 1 (the last token is always computed); a group's capped
        at its prompt, whose named blocks alone it caches."""
        if req.n > 1:
            tokens = min(tokens, req.prompt)
        cap = (tokens - 1) // self.block_size
        return cap if self._caches_own(req) else min(cap, len(named))

    def cached_prefix_tokens(self, req: Request, tokens: int | None = None) -> int:
        named = self.block_keys(req)
        tokens = req.prompt if tokens is None else tokens
        # Remembered for the admission's count of blocks looked up (a first chunk stores
        # fewer tokens than the request has to prefill).
        self._asked[req.rid] = tokens
        return len(self._found(req, named, self._cap(req, named, tokens))) * self.block_size

    def admission_bytes(self, req: Request, tokens: int, hit: int) -> int:
        """The paged blocks past the cached prefix, and the idle cached blocks of the prefix
        (taken back from the free memory, as vLLM counts them)."""
        named = self.block_keys(req)
        found = self._found(req, named, hit // self.block_size)
        revived = self._idle_found(req, named, found)
        return super().admission_bytes(req, tokens, hit) + revived * self.block_bytes

    def idle_cached_blocks(self) -> int:
        """Cached blocks nobody uses (they count as free)."""
        return self._idle_blocks

    def block_table(self, rid: int) -> tuple[int, ...]:
        """The request's cached blocks (shared with whoever else holds them), then its own
        blocks."""
        own = super().block_table(rid)
        return tuple(self._held.get(rid, ())) + own

    def take_evictions(self) -> list[int]:
        """Ids of the idle cached blocks evicted since last asked (their bytes dropped)."""
        evicted = list(self._evicted)
        self._evicted.clear()
        return evicted

    def prefix_keys(self, rid: int) -> tuple[int, ...]:
        live = self._get(rid)
        named = self._keys_of.get(rid)
        keys: list[tuple[object, ...]] = [*named.pairs()] if named else []
        if self._caches_own(live.req):
            keys += [(rid, j, -1) for j in range(len(keys), live.final // self.block_size)]
        return tuple(hash(key) for key in keys)

    def summary_stats(self) -> dict[str, float | int]:
        return {
            "prefix_lookup_blocks": self.lookups,
            "prefix_hit_blocks": self.hits,
            "prefix_hit_rate_blocks": self.hits / self.lookups if self.lookups else 0.0,
            "prefix_evictions": self.evictions,
            "prefix_cached_blocks": self._in_use + self._idle_blocks,
        }

    # ------------------------------------------------------------ the counts
    # The paged counts (a group's sequences sharing its prompt's full blocks) less the cached
    # blocks, which the cache counts once for all their users.
    def _blocks_at(self, live: Live, tokens: int) -> int:
        return super()._blocks_at(live, tokens) - live.cached // self.block_size

    def _stored(self, live: Live, tokens: int) -> int:
        return super()._stored(live, tokens) - live.cached

    def _linear(self, live: Live, phase: int) -> int:
        return super()._linear(live, phase) - live.cached

    def allocated_bytes(self, rid: int) -> int:
        """Bytes the request holds, its cached blocks included (shared with others)."""
        live = self._get(rid)
        return super()._blocks_at(live, self._tokens_of(live)) * self.block_bytes

    def _head(self, live: Live) -> list[int]:
        return list(self._held.get(live.req.rid, ()))

    def _cache_saved(self) -> int:
        """Blocks the cache spares: one copy per further request using a cached block."""
        return self._uses - self._in_use

    def saved_by_sharing(self) -> int:
        return super().saved_by_sharing() + self._cache_saved() * self.block_bytes

    def _integrate_saved(self, n: int, w0: float, w1: float, weight: float) -> float:
        within = super()._integrate_saved(n, w0, w1, weight)
        return within + self._cache_saved() * self.block_bytes * weight

    def _blocks_total(self) -> int:
        return super()._blocks_total() + self._in_use

    def _token_terms(self) -> int:
        return super()._token_terms() + self._in_use * self.block_size

    def _integrate_token_terms(self, n: int, w0: float, w1: float, weight: float) -> float:
        cached = self._in_use * self.block_size * weight
        return super()._integrate_token_terms(n, w0, w1, weight) + cached

    def _integrate_held(self, n: int, w0: float, w1: float, weight: float) -> tuple[float, float]:
        allocated, internal = super()._integrate_held(n, w0, w1, weight)
        return allocated + self._in_use * self.block_bytes * weight, internal

    # ------------------------------------------------------------ operations
    def _filled(self, live: Live, tokens: int) -> int:
        """Named prompt blocks the request filled since it last held cached blocks: they join
        the cache now (each a block of its own, even when its key is cached already)."""
        named = self._keys_of[live.req.rid]
        held = len(self._held[live.req.rid])
        return max(0, min(len(named), tokens // self.block_size) - held)

    # ------------------------------------------------------------ the cache
    def _cache(self, blocks: list[int], keys: Keys, start: int = 0) -> None:
        """Blocks join the cache under their keys (distinct), each after any cached already.
        The blocks' keys are those at positions start.. of `keys`."""
        segs = self._segs
        r, skip = keys.first_run(start)
        skip = start - skip  # (keys of the first run before `start`)
        at, count, runs = 0, len(blocks), keys.runs
        self._version += 1
        while at < count:  # (keys.spans(start, count), without the list or a call a run)
            base, j, n = runs[r]
            j, n = j + skip, min(n - skip, count - at)
            r, skip = r + 1, 0
            # One dictionary probe: as a rule the segment is new (a chunk found cached is
            # not cached again), and the one made for nothing otherwise costs less.
            part = blocks[at : at + n] if n > 1 else [blocks[at]]
            new = Seg(j, part, n)
            seg = segs.setdefault(base, new)
            if seg is new:
                at += n
                continue
            if n == 1:  # (a chunk of one block: large blocks)
                self._cache_one(seg, seg.span(j, 1), base, j, part[0])
                at += 1
                continue
            at += n
            a = seg.span(j, n)
            ids = seg.ids
            if ids[a : a + n].count(-1) == n:  # the rule: none of them cached yet
                if seg.idle is not None or seg.extra:  # (blocks with one user join others)
                    self._mix(seg)
                ids[a : a + n] = part
                seg.count += n
                continue
            for i in range(n):
                self._cache_one(seg, a + i, base, j + i, part[i])

    def _cache_one(self, seg: Seg, a: int, base: Base, j: int, block: int) -> None:
        """Block j of segment `base` (at ids[a]) joins the cache: the one found under its key
        if none is cached there yet, else a younger duplicate."""
        ids = seg.ids
        if ids[a] == block:
            return
        if not seg.mixed and (seg.idle is not None or seg.extra or ids[a] != -1):
            self._mix(seg)  # blocks with one user join others, or a duplicate joins
        if ids[a] == -1:
            ids[a] = block
            seg.count += 1
        else:
            self._dups.setdefault(pack(base, j), []).append(block)
            seg.dups += 1

    def _mix(self, seg: Seg) -> None:
        """The segment's blocks no longer agree: the state of each is kept by id (once)."""
        if seg.mixed:
            return
        if seg.idle is not None:
            run, idle_of = seg.idle, self._idle_of
            for block in seg.ids:
                if block != -1:
                    idle_of[block] = run
            seg.idle = None
        elif seg.extra:
            extra, shared = seg.extra, self._shared
            for block in seg.ids:
                if block != -1:
                    shared[block] = extra
            seg.extra = 0
        seg.mixed = True

    def _uncache(self, blocks: list[int], keys: Keys, start: int = 0) -> None:
        """Blocks leave the cache (evicted); a younger duplicate becomes the one found. The
        blocks' keys are those at positions start.. of `keys`."""
        segs, dups, idle_of = self._segs, self._dups, self._idle_of
        r, skip = keys.first_run(start)
        skip = start - skip  # (keys of the first run before `start`)
        at, count, runs = 0, len(blocks), keys.runs
        self._version += 1
        while at < count:  # (keys.spans(start, count), without the list or a call a run)
            base, j, n = runs[r]
            j, n = j + skip, min(n - skip, count - at)
            r, skip = r + 1, 0
            seg = segs[base]
            a = j - seg.lo
            ids = seg.ids
            if seg.mixed:  # (idle blocks kept by id: these are idle)
                for i in range(at, at + n):
                    del idle_of[blocks[i]]
            if not seg.dups:  # each the only one under its key: the blocks are ids[a : a + n]
                if n == seg.count:  # (the usual: a chunk's blocks all go at once)
                    del segs[base]
                    at += n
                    continue
                if n == 1:  # (a chunk of one block: large blocks)
                    ids[a] = -1
                else:
                    ids[a : a + n] = [-1] * n
                seg.count -= n
            else:
                part = blocks[at : at + n]
                for i in range(n):
                    key, block = pack(base, j + i), part[i]
                    younger = dups.get(key)
                    if ids[a + i] == block:
                        if younger:
                            ids[a + i] = younger.pop(0)
                            seg.dups -= 1
                        else:
                            ids[a + i] = -1
                            seg.count -= 1
                    else:
                        assert younger is not None  # (not the first under its key: a duplicate)
                        younger.remove(block)
                        seg.dups -= 1
                    if younger is not None and not younger:
                        del dups[key]
            at += n
            if not seg.count:
                del segs[base]

    def _go_idle(self, blocks: list[int], keys: Keys, walked: list[Seg]) -> None:
        """Cached blocks nobody uses any more join the LRU order, in this order. A chunk's
        blocks go together as a rule: their segment says it once. `walked`: the segments of
        the first runs of `keys`, as far as the caller has them (not kept: a run that held
        its segments would make a reference cycle with each, which names its run)."""
        if not blocks:
            return
        run = Run(blocks, keys)
        self._runs.append(run)
        segs, idle_of, at, count = self._segs, self._idle_of, 0, len(blocks)
        for r, (base, _j, n) in enumerate(keys.runs):
            if at >= count:
                break
            n = min(n, count - at)
            seg = walked[r] if r < len(walked) else segs[base]
            if n == seg.count and not seg.mixed:  # (all its blocks, in use till now)
                seg.idle = run
            else:
                self._mix(seg)
                for i in range(at, at + n):
                    idle_of[blocks[i]] = run
            at += n
        self._idle_blocks += count

    def _idle_at(self, block: int, base: Base, j: int) -> Run | None:
        """The run of a cached block, block j of segment `base`, that is idle; None for one in
        use (or not cached)."""
        seg = self._segs.get(base)
        if seg is None:
            return None
        if seg.mixed:
            return self._idle_of.get(block)
        a = j - seg.lo
        return seg.idle if 0 <= a < len(seg.ids) and seg.ids[a] == block else None

    def _idle_found(self, req: Request, named: Keys, found: list[int]) -> int:
        """How many of the blocks a lookup found (the oldest under their keys) are idle."""
        segs, idle_of, idle, at = self._segs, self._idle_of, 0, 0
        for base, _j, n in self._keys_between(req.rid, named, 0, len(found)).runs:
            seg = segs[base]
            if seg.mixed:
                for i in range(at, at + n):
                    if found[i] in idle_of:
                        idle += 1
            elif seg.idle is not None:
                idle += n
            at += n
        return idle

    def _revived(self, run: Run, n: int) -> None:
        """n idle blocks of `run` found by a lookup are in use again (the run no longer holds
        them)."""
        self._idle_blocks -= n
        self._in_use += n
        run.gone += n
        if not run.live():
            self._dead += 1
            if 2 * self._dead > len(self._runs) + 64:  # (evictions may never reach them)
                self._runs = deque(r for r in self._runs if r.live())
                self._dead = 0

    # (the per-block maps, assembled for checks: `prefix_checks`)
    @property
    def _idle(self) -> dict[int, None]:
        return prefix_checks.idle(self)

    @property
    def _refs(self) -> dict[int, int]:
        return prefix_checks.refs(self)

    @property
    def _cached(self) -> dict[Key, list[int]]:
        return prefix_checks.cached(self)

    @property
    def _key(self) -> dict[int, Key]:
        return prefix_checks.keys(self)

    def _name(self, live: Live, k: int, private: int, tokens: int) -> tuple[int, ...]:
        """Block ids after `_evict`: the k named prompt blocks the request just filled join
        the cache under the ids it held them by (or fresh ones, when they were not named
        yet); the request's other blocks are named as the paged allocator does."""
        rid = live.req.rid
        table = live.table if live.table is not None else []
        live.table = table
        own = table[:k]
        del table[:k]
        if k - len(own) > len(self._stack):
            self._reclaim(k - len(own), rid)  # ids beams pruned while nobody asked
        fresh = self._stack.take(k - len(own))
        held, named = self._held[rid], self._keys_of[rid]
        blocks = own + fresh if own else fresh  # (own: mostly none while ids are deferred)
        self._cache(blocks, named, len(held))
        held.extend(blocks)
        self._in_use += k
        self._uses += k
        named_now = () if self._deferred else tuple(fresh)  # (nobody asks otherwise)
        return named_now + self._name_new(live, private, tokens)

    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        req, bs = live.req, self.block_size
        live.shared = req.prompt // bs * bs  # full prompt blocks, kept once by a group
        most = self._peak_blocks(live, tokens)
        if most > self.usable_blocks:
            need = most * self.block_bytes
            return Refusal(
                req.rid, Reason.TOO_LARGE, need, self.free_bytes(), "needs more blocks than exist"
            )
        named = self.block_keys(req)
        # `tokens` <= the tokens to prefill, and > the hits the engine found with that cap:
        # capping at tokens - 1 finds them again.
        cap = self._cap(req, named, tokens)
        found = self._found(req, named, cap)
        revived = self._idle_found(req, named, found)
        need = super()._blocks_at(live, tokens) - len(found) + revived
        if need > self.free_blocks():
            return self._refusal(req.rid, need)
        asked = self._asked.pop(req.rid, 0)
        self.lookups += self._cap(req, named, asked) if asked > tokens else cap
        self.hits += len(found)
        self._uses += len(found)
        shared, segs, idle_of, at = self._shared, self._segs, self._idle_of, 0
        for base, _j, n in self._keys_between(req.rid, named, 0, len(found)).runs:
            seg = segs[base]
            # Idle blocks counted as free are taken back; the others gain a user.
            if not seg.mixed and n == seg.count:  # (all of them, in one state)
                if seg.idle is not None:
                    self._revived(seg.idle, n)
                    seg.idle = None
                else:
                    seg.extra += 1
                at += n
                continue
            self._mix(seg)
            for i in range(at, at + n):
                block = found[i]
                run = idle_of.pop(block, None)
                if run is not None:
                    self._revived(run, 1)
                else:
                    shared[block] = shared.get(block, 0) + 1
            at += n
        self._keys_of[req.rid] = named
        self._held[req.rid] = list(found)  # (a copy: `_found` may hand out the same list)
        k = self._filled(live, tokens)
        live.cached = (len(found) + k) * bs
        private = self._blocks_at(live, tokens)
        self._fixed_blocks += private
        self._fixed_internal += self._tail_waste(live, tokens)
        self._fixed_saved += self._saved_at(live, tokens)
        self._evict(extra=k)  # before naming: evicted blocks give their ids back
        ids = self._name(live, k, private, tokens)
        return Grant(req.rid, need * self.block_bytes, live.cap, blocks=ids)

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        need = super()._blocks_at(live, new) - super()._blocks_at(live, old)
        if need > self.free_blocks():
            return self._refusal(live.req.rid, need)
        before = self._blocks_at(live, old)
        k = self._filled(live, new)
        live.cached += k * self.block_size
        after = self._blocks_at(live, new)
        self._fixed_blocks += after - before
        self._fixed_internal += self._tail_waste(live, new) - self._tail_waste(live, old)
        self._fixed_saved += self._saved_at(live, new) - self._saved_at(live, old)
        self._evict(extra=k)
        ids = self._name(live, k, after, new)
        return Grant(live.req.rid, max(0, need) * self.block_bytes, live.cap, blocks=ids)

    def evict_idle(self) -> None:
        self._evict(over=self._idle_blocks)

    def free_preempted(self, rid: int, processed: int) -> int:
        self._processed = processed
        try:
            return self.free(rid)
        finally:
            self._processed = -1

    def _release(self, live: Live) -> None:
        rid, bs, tokens = live.req.rid, self.block_size, live.base
        held = self._held.pop(rid, [])
        named = self._keys_of.pop(rid, Keys([]))
        # Its own full blocks join the cache now, idle (nobody else could have found them).
        own: list[int] = []
        if live.req.n == 1:
            # (a block whose tokens are in flight is not cached: `free_preempted`)
            known = tokens if self._processed < 0 else min(tokens, self._processed)
            full = known // bs if self._caches_own(live.req) else min(known // bs, len(named))
            if full > len(held):
                self._materialize(live, self._blocks_at(live, tokens), tokens)
                table = live.table
                assert table is not None  # (materialised just now)
                own = table[: full - len(held)]
                del table[: len(own)]
        super()._release(live)
        # vLLM frees a request's blocks last first, so that eviction (least recently freed
        # first) takes a prefix's tail before its head, which later requests are likelier to
        # share.
        own_keys = self._keys_between(rid, named, len(held), len(held) + len(own))
        self._cache(own, own_keys)
        self._uses -= len(held)
        # Its blocks others hold too stay in use: as usual a leading run of them (a common
        # prefix), so that the others form a tail of its table, whose keys are one range.
        shared, segs, end = self._shared, self._segs, len(held)
        lead = -1  # position of the first block that goes, while those that go are a tail
        blocks: list[int] | None = None  # once they are not: those that go so far,
        runs: list[tuple[Base, int, int]] = []  # and their keys
        walked: list[Seg] = []  # the segment of each run walked
        at, r0 = 0, 0  # (r0: the run of `lead`)
        for base, j, n in self._keys_between(rid, named, 0, end).runs:
            seg = segs[base]
            walked.append(seg)
            if not seg.mixed and n == seg.count:  # (all of them: it holds them in use)
                if seg.extra:  # they stay
                    seg.extra -= 1
                    if lead >= 0 and blocks is None:
                        blocks, runs = self._gone(rid, named, held, lead, at)
                elif blocks is not None:
                    blocks += held[at : at + n]
                    runs.append((base, j, n))
                elif lead < 0:
                    lead, r0 = at, len(walked) - 1
                at += n
                continue
            self._mix(seg)
            for i in range(at, at + n):
                block = held[i]
                extra = shared.get(block)
                if extra is None:  # it goes
                    if blocks is not None:
                        blocks.append(block)
                        runs.append((base, j + i - at, 1))
                    elif lead < 0:
                        lead, r0 = i, len(walked) - 1
                    continue
                if extra > 1:
                    shared[block] = extra - 1
                else:
                    del shared[block]
                if lead >= 0 and blocks is None:
                    blocks, runs = self._gone(rid, named, held, lead, i)
            at += n
        if blocks is None:  # (the usual)
            if lead < 0:
                lead, r0 = end, len(walked)
            self._in_use -= end - lead
            if lead:
                del held[:lead]
            held += own
            # Its keys' runs are those of the walk from run r0 on (then its own blocks').
            keys = self._keys_between(rid, named, lead, end + len(own))
            self._go_idle(held, keys, walked[r0:] if r0 else walked)
        else:
            self._in_use -= len(blocks)
            blocks += own
            self._go_idle(blocks, Keys(runs + own_keys.runs, len(blocks)), [])

    def _gone(
        self, rid: int, named: Keys, held: list[int], lead: int, at: int
    ) -> tuple[list[int], list[tuple[Base, int, int]]]:
        """The blocks at positions lead..at-1 of a request's table, and their keys (a free's
        blocks that go, once a block that stays follows them)."""
        return held[lead:at], [*self._keys_between(rid, named, lead, at).runs]

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        super()._cohort_changed(live, decoding)
        # The cohort counts all of the group's blocks; the cached ones are not the request's.
        cached = live.cached // self.block_size
        self._fixed_blocks -= cached if decoding else -cached

    def steps_until_evict(self) -> int | None:
        if not self._idle_blocks:
            return None
        # Idle blocks count as free; one goes when the blocks in use outgrow the rest.
        steps = self._blocks.steps_within(self._clock, self.free_blocks() - self._idle_blocks)
        return None if steps is None else steps + 1

    def _stepped(self) -> None:
        super()._stepped()
        start, self._stepped_at = self._stepped_at, self._clock
        if self._blocks.negative:
            # Beams give blocks back at block boundaries: the steps since `start` may have
            # needed more blocks than the last, and idle blocks went at that peak.
            total = self._blocks_total() - self._blocks.value(self._clock)
            while self._idle_blocks:
                room = self.usable_blocks - self._idle_blocks - total - self._blocks.value(start)
                fits = self._blocks.steps_within(start, room)
                if fits is None or start + fits >= self._clock:
                    break
                self._evict(1)
        self._evict()

    def _evict(self, over: int | None = None, extra: int = 0) -> None:
        """Drop least recently freed idle blocks until the ones in use (and `extra` blocks
        about to join the cache) fit, or `over` of them."""
        if over is None:
            over = self._blocks_total() + extra + self._idle_blocks - self.usable_blocks
        runs, evicted = self._runs, self._evicted
        while over > 0:
            run = runs[0]
            if not run.live():  # every block of it was found again
                runs.popleft()
                self._dead -= 1
                continue
            ids = run.ids
            top = len(ids) - run.pos  # (its blocks not taken yet: ids[:top])
            if not run.gone:  # the run's next `over` blocks
                end = max(top - over, 0)
                blocks = ids[end:top]  # (in table order: the order they are taken again in)
                self._uncache(blocks, run.keys, end)
            else:  # skipping the ones found again since
                lru: list[int] = []
                end = top
                picked: list[tuple[Base, int, int]] = []
                while len(lru) < over and end > 0:
                    end -= 1
                    at = run.keys.at(end)
                    if self._idle_at(ids[end], at[0], at[1]) is run:
                        lru.append(ids[end])
                        picked.append(at)
                    else:
                        run.gone -= 1
                self._uncache(lru, Keys(picked, len(picked)))
                blocks = lru[::-1]
            run.pos = len(ids) - end
            if not run.live():
                runs.popleft()
            if not self._deferred:  # (nobody takes them otherwise)
                evicted.update(dict.fromkeys(reversed(blocks)))  # least recently freed first
            self._idle_blocks -= len(blocks)
            self.evictions += len(blocks)
            over -= len(blocks)
            self._stack.give(blocks)  # their bytes are dropped
