"""Prefix caching across requests: paged blocks found again by the hash chain of their tokens.

Wraps the paged allocator the way vLLM's prefix-caching allocator wraps the naive one. A
request's full prompt blocks are identified by the hash chain of the tokens up to their end:
traces give it as per-chunk hashes (`hash_ids`, e.g. 512-token chunks in the Mooncake trace),
mapped here onto any engine block size (block j of bs tokens is identified by the chain of
chunks covering tokens [0, (j+1)*bs), plus j). At admission the longest run of leading blocks
already cached is reused by reference instead of being allocated and prefilled again (at least
one prompt token is always computed, as vLLM does); the request's own full prompt blocks join
the cache as they are filled. When the last user of a cached block finishes, the block stays
cached but idle: it counts as usable free memory, and is evicted least recently used first
when free blocks run out (a request's tail blocks before its head).

Accounting: a cached block in use is allocated once, holds bs tokens once, however many
requests use it; idle cached blocks are free. A request's own blocks past its cached ones are
counted as in the paged allocator.

Sample groups and beams (n sequences): the cache knows the prompt's full blocks only. A
group looks them up and registers them exactly as a single request does (its sequences share
them anyway), and counts once in their reference counts; past them its sequences fork as in
the paged allocator, and their blocks (the partial prompt block copied on write, generated
tokens, a beam trunk) are the group's own, never cached: generated tokens are not in the
trace's hash chain. With S = P // bs the prompt's full blocks, C <= S of them cached
(`live.cached` = C*bs; `live.shared` = S*bs, the paged allocator's blocks kept once) and L
tokens a sequence, the request's own blocks are
    ceil(L/bs) - C                                   while its prompt is prefilled (L <= P),
    n*ceil(L/bs) - (n-1)*S - C                       samples past the prompt,
    n*ceil(L/bs) - (n-1)*floor(L/bs) - C             beams past the prompt,
the paged counts less the cached blocks; so the prompt's full blocks the hash chain does not
name are still kept once for all sequences, by the request. Its distinct tokens are the paged
ones less C*bs (the cache holds those). `saved_by_sharing` adds both savings, each once: the
copies a group's sequences do not make ((n-1)*S samples, (n-1)*floor(L/bs) beams, as paged)
and the copies the cache spares (users - 1 per cached block in use, a group one user).

Block ids: a cached block keeps the id of the block that first held its tokens (the request's
own block joins the cache when it fills; a request that fills a block someone cached since
gives its own back and shares the cached one). Idle cached blocks keep their id and bytes until
evicted, when the id goes back to the free stack. `block_table` lists a request's cached blocks
first, then its own; a group's `block_tables` (one per sequence, as paged) each start with its
cached blocks, then name its own as the paged allocator does, copies on write included.
`prefix_keys` gives one digest per full prompt block its hash chain names, so that a replay can
write (and check) the same bytes for the same tokens.

Evictions change what a waiting request would need without a free: a group past its prompt
that finds fewer tokens cached is admitted with fewer, n blocks less per block of them, so
`steps_until_evict` tells the engine when the next idle block goes.
"""

from __future__ import annotations

from collections import OrderedDict

from sim.allocators.base import Grant, Live, Reason, Refusal, Request
from sim.allocators.paged import PagedAllocator

Key = tuple[int, int]  # (hash chain up to the block's last chunk, block index)


class PrefixCachingAllocator(PagedAllocator):
    """Paged blocks plus a cache of full prompt blocks keyed by their token hash chain."""

    kind = "prefix-caching"

    def __init__(
        self, capacity: int, bytes_per_token: int, max_model_len: int, block_size: int = 16
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len, block_size)
        self._refs: dict[Key, int] = {}  # cached blocks in use: key -> users
        self._idle: OrderedDict[Key, None] = OrderedDict()  # unused cached blocks, LRU first
        self._held: dict[int, list[Key]] = {}  # rid -> keys of its cached prompt blocks
        self._keys_of: dict[int, list[Key]] = {}  # rid -> keys of all its full prompt blocks
        self._id_of: dict[Key, int] = {}  # block id of every cached block, in use or idle
        self._evicted: dict[int, None] = {}  # ids of idle blocks evicted since last asked
        self.lookups = 0  # full prompt blocks looked up at admissions
        self.hits = 0  # of them found cached
        self.evictions = 0
        self._stepped_at = 0  # the decode clock when steps last evicted

    # ------------------------------------------------------------------ keys
    def block_keys(self, req: Request) -> list[Key]:
        """Keys of the request's full prompt blocks that its hash chain identifies."""
        if not req.prefix or req.prefix_tokens < 1:
            return []
        bs, chunk = self.block_size, req.prefix_tokens
        chain, h = [], 0
        for value in req.prefix:
            h = hash((h, value))
            chain.append(h)
        keys = []
        for j in range(req.prompt // bs):
            c = -(-(j + 1) * bs // chunk) - 1  # the chunk holding the block's last token
            if c >= len(chain):
                break
            keys.append((chain[c], j))
        return keys

    def _hit_blocks(self, keys: list[Key], req: Request) -> int:
        limit = (req.prompt - 1) // self.block_size  # always compute the last prompt token
        hits = 0
        for key in keys[:limit]:
            if key not in self._refs and key not in self._idle:
                break
            hits += 1
        return hits

    def cached_prefix_tokens(self, req: Request) -> int:
        return self._hit_blocks(self.block_keys(req), req) * self.block_size

    def block_table(self, rid: int) -> tuple[int, ...]:
        """The request's cached prompt blocks (shared with whoever else holds them), then its
        own blocks."""
        own = super().block_table(rid)
        return tuple(self._id_of[key] for key in self._held.get(rid, ())) + own

    def take_evictions(self) -> list[int]:
        """Ids of the idle cached blocks evicted since last asked (their bytes dropped)."""
        evicted = list(self._evicted)
        self._evicted.clear()
        return evicted

    def prefix_keys(self, rid: int) -> tuple[int, ...]:
        self._get(rid)
        return tuple(hash(key) for key in self._keys_of.get(rid, ()))

    def summary_stats(self) -> dict[str, float | int]:
        return {
            "prefix_lookup_blocks": self.lookups,
            "prefix_hit_blocks": self.hits,
            "prefix_hit_rate_blocks": self.hits / self.lookups if self.lookups else 0.0,
            "prefix_evictions": self.evictions,
            "prefix_cached_blocks": len(self._refs) + len(self._idle),
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
        """Bytes the request holds, its cached prompt blocks included (shared with others)."""
        live = self._get(rid)
        return super()._blocks_at(live, self.tokens(rid)) * self.block_bytes

    def _head(self, live: Live) -> list[int]:
        return [self._id_of[key] for key in self._held.get(live.req.rid, ())]

    def _cache_saved(self) -> int:
        """Blocks the cache spares: one copy per further request using a cached block."""
        return sum(users - 1 for users in self._refs.values())

    def saved_by_sharing(self) -> int:
        return super().saved_by_sharing() + self._cache_saved() * self.block_bytes

    def _integrate_saved(self, n: int, w0: float, w1: float, weight: float) -> float:
        within = super()._integrate_saved(n, w0, w1, weight)
        return within + self._cache_saved() * self.block_bytes * weight

    def _blocks_total(self) -> int:
        return super()._blocks_total() + len(self._refs)

    def _token_terms(self) -> int:
        return super()._token_terms() + len(self._refs) * self.block_size

    def _integrate_token_terms(self, n: int, w0: float, w1: float, weight: float) -> float:
        cached = len(self._refs) * self.block_size * weight
        return super()._integrate_token_terms(n, w0, w1, weight) + cached

    def _integrate_held(self, n: int, w0: float, w1: float, weight: float) -> tuple[float, float]:
        allocated, internal = super()._integrate_held(n, w0, w1, weight)
        return allocated + len(self._refs) * self.block_bytes * weight, internal

    # ------------------------------------------------------------ operations
    def _register(self, live: Live, tokens: int) -> list[tuple[Key, bool]]:
        """Put the request's newly full prompt blocks in the cache; returns their keys, each
        with whether it was cached already (then the request shares that block)."""
        bs, rid = self.block_size, live.req.rid
        keys = self._held.setdefault(rid, [])
        full = min(len(self._keys_of[rid]), tokens // bs, live.req.prompt // bs)
        new = []
        for key in self._keys_of[rid][len(keys) : full]:
            new.append((key, key in self._refs or key in self._idle))
            if key in self._refs:
                self._refs[key] += 1
            else:
                self._idle.pop(key, None)  # an idle block counted as free is taken back
                self._refs[key] = 1
            keys.append(key)
        live.cached = len(keys) * bs
        return new

    def _name(self, live: Live, new: list[tuple[Key, bool]], private: int, tokens: int):
        """Block ids after `_register` and `_evict`: a newly full block of the request's own
        becomes the cached one (same id, same bytes), or goes back when the same tokens were
        cached already; the request's other blocks are named as the paged allocator does."""
        table = live.table if live.table is not None else []
        live.table = table
        own = table[: len(new)]  # its blocks for the rows that just joined the cache
        del table[: len(own)]
        taken = []
        for i, (key, cached) in enumerate(new):
            if cached:
                if i < len(own):
                    self._stack.append(own[i])
            elif i < len(own):
                self._id_of[key] = own[i]
            else:
                taken.append(key)
        if len(taken) > len(self._stack):
            self._reclaim(len(taken), live.req.rid)  # ids beams pruned while nobody asked
        for key in taken:
            self._id_of[key] = self._stack.pop()
        fresh = tuple(self._id_of[key] for key in taken)
        return fresh + self._materialize(live, private, tokens)

    def _need(self, live: Live, tokens: int, old: int = 0) -> int:
        """Blocks admitting (old = 0) or growing from `old` to `tokens` takes from the free
        pool (no change made): its own blocks' change, and the blocks it caches anew."""
        keys = self._keys_of[live.req.rid]
        held = len(self._held.get(live.req.rid, ()))
        full = min(len(keys), tokens // self.block_size, live.req.prompt // self.block_size)
        taken = sum(1 for key in keys[held:full] if key not in self._refs)
        after = super()._blocks_at(live, tokens) - full
        return after - (self._blocks_at(live, old) if old else 0) + taken

    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        req, bs = live.req, self.block_size
        live.shared = req.prompt // bs * bs  # full prompt blocks, kept once by a group
        most = self._peak_blocks(live, tokens)
        if most > self.num_blocks:
            need = most * self.block_bytes
            return Refusal(
                req.rid, Reason.TOO_LARGE, need, self.free_bytes(), "needs more blocks than exist"
            )
        self._keys_of[req.rid] = self.block_keys(req)
        need = self._need(live, tokens)
        if need > self.free_blocks():
            del self._keys_of[req.rid]
            return self._refusal(req.rid, need)
        full = min(len(self._keys_of[req.rid]), req.prompt // bs)
        self.lookups += full
        self.hits += min(self._hit_blocks(self._keys_of[req.rid], req), tokens // bs)
        new = self._register(live, tokens)
        private = self._blocks_at(live, tokens)
        self._fixed_blocks += private
        self._fixed_internal += self._tail_waste(live, tokens)
        self._fixed_saved += self._saved_at(live, tokens)
        self._evict()  # before naming: evicted blocks give their ids back
        ids = self._name(live, new, private, tokens)
        return Grant(req.rid, need * self.block_bytes, live.cap, blocks=ids)

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        need = self._need(live, new, old)
        if need > self.free_blocks():
            return self._refusal(live.req.rid, need)
        before = self._blocks_at(live, old)
        joined = self._register(live, new)
        after = self._blocks_at(live, new)
        self._fixed_blocks += after - before
        self._fixed_internal += self._tail_waste(live, new) - self._tail_waste(live, old)
        self._fixed_saved += self._saved_at(live, new) - self._saved_at(live, old)
        self._evict()
        ids = self._name(live, joined, after, new)
        return Grant(live.req.rid, max(0, need) * self.block_bytes, live.cap, blocks=ids)

    def _release(self, live: Live) -> None:
        super()._release(live)
        rid = live.req.rid
        # Tail blocks first, so that eviction (least recently used first) takes a prefix's
        # tail before its head, which later requests are likelier to share (as vLLM does).
        for key in reversed(self._held.pop(rid, ())):
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]
                self._idle[key] = None
        self._keys_of.pop(rid, None)

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        super()._cohort_changed(live, decoding)
        # The cohort counts all of the group's blocks; the cached ones are not the request's.
        self._fixed_blocks -= (1 if decoding else -1) * (live.cached // self.block_size)

    def steps_until_evict(self) -> int | None:
        if not self._idle:
            return None
        # Idle blocks count as free; one goes when the blocks in use outgrow the rest.
        steps = self._blocks.steps_within(self._clock, self.free_blocks() - len(self._idle))
        return None if steps is None else steps + 1

    def _stepped(self) -> None:
        super()._stepped()
        start, self._stepped_at = self._stepped_at, self._clock
        if self._blocks.negative:
            # Beams give blocks back at block boundaries: the steps since `start` may have
            # needed more blocks than the last, and idle blocks went at that peak.
            total = self._blocks_total() - self._blocks.value(self._clock)
            while self._idle:
                room = self.num_blocks - len(self._idle) - total - self._blocks.value(start)
                fits = self._blocks.steps_within(start, room)
                if fits is None or start + fits >= self._clock:
                    break
                self._evict(1)
        self._evict()

    def _evict(self, over: int | None = None) -> None:
        """Drop least recently used idle blocks until the ones in use fit (or `over` ones)."""
        if over is None:
            over = self._blocks_total() + len(self._idle) - self.num_blocks
        for _ in range(max(0, over)):
            key, _ = self._idle.popitem(last=False)
            block = self._id_of.pop(key)
            self._stack.append(block)  # its bytes are dropped
            self._evicted[block] = None
            self.evictions += 1
