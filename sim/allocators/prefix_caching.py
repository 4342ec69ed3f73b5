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
requests use it (`saved_by_sharing` counts the copies it spares); idle cached blocks are free.
A request's own blocks past its cached ones are counted as in the paged allocator. Requests
with n > 1 samples are not combined with prefix caching here.

Block ids: a cached block keeps the id of the block that first held its tokens (the request's
own block joins the cache when it fills; a request that fills a block someone cached since
gives its own back and shares the cached one). Idle cached blocks keep their id and bytes until
evicted, when the id goes back to the free stack. `block_table` lists a request's cached blocks
first, then its own; `prefix_keys` gives one digest per full prompt block its hash chain names,
so that a replay can write (and check) the same bytes for the same tokens.
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
    def _blocks_at(self, live: Live, tokens: int) -> int:
        return -(-tokens // self.block_size) - live.shared // self.block_size

    def _stored(self, live: Live, tokens: int) -> int:
        return tokens - live.shared

    def _linear(self, live: Live, phase: int) -> int:
        return phase - live.shared

    def _saved_at(self, live: Live, tokens: int) -> int:
        return 0

    def allocated_bytes(self, rid: int) -> int:
        """Bytes the request holds, its cached prompt blocks included (shared with others)."""
        return -(-self.tokens(rid) // self.block_size) * self.block_bytes

    def saved_by_sharing(self) -> int:
        return sum(users - 1 for users in self._refs.values()) * self.block_bytes

    def _integrate_saved(self, n: int, w0: float, w1: float, weight: float) -> float:
        return self.saved_by_sharing() * weight

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
        live.shared = len(keys) * bs
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
            raise AssertionError(f"request {live.req.rid}: no free block id left to name")
        for key in taken:
            self._id_of[key] = self._stack.pop()
        fresh = tuple(self._id_of[key] for key in taken)
        return fresh + self._materialize(live, private, tokens)

    def _need(self, live: Live, tokens: int) -> int:
        """Blocks admitting or growing to `tokens` takes from the free pool (no change made)."""
        keys = self._keys_of[live.req.rid]
        held = len(self._held.get(live.req.rid, ()))
        full = min(len(keys), tokens // self.block_size, live.req.prompt // self.block_size)
        new = keys[held:full]
        taken = sum(1 for key in new if key not in self._refs)
        private = -(-tokens // self.block_size) - full
        return private + taken

    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        req, bs = live.req, self.block_size
        if req.n > 1:
            raise ValueError("prefix-caching does not model requests with n > 1 samples")
        if -(-live.final // bs) > self.num_blocks:
            need = -(-live.final // bs) * self.block_bytes
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
        self._evict()  # before naming: evicted blocks give their ids back
        ids = self._name(live, new, private, tokens)
        return Grant(req.rid, need * self.block_bytes, live.cap, blocks=ids)

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        need = self._need(live, new)
        if need > self.free_blocks():
            return self._refusal(live.req.rid, need)
        before = self._blocks_at(live, old)
        joined = self._register(live, new)
        after = self._blocks_at(live, new)
        self._fixed_blocks += after - before
        self._fixed_internal += self._tail_waste(live, new) - self._tail_waste(live, old)
        self._evict()
        ids = self._name(live, joined, after, new)
        return Grant(live.req.rid, need * self.block_bytes, live.cap, blocks=ids)

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
        # The cohort counts ceil((c + K)/bs) blocks; the cached ones are not the request's.
        self._fixed_blocks -= (1 if decoding else -1) * (live.shared // self.block_size)

    def _stepped(self) -> None:
        super()._stepped()
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used idle blocks until the ones in use fit."""
        over = self._blocks_total() + len(self._idle) - self.num_blocks
        for _ in range(max(0, over)):
            key, _ = self._idle.popitem(last=False)
            block = self._id_of.pop(key)
            self._stack.append(block)  # its bytes are dropped
            self._evicted[block] = None
            self.evictions += 1
