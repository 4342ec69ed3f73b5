"""`two-level` with prefix caching under vLLM's constraints (`vllm_groups: true`,
`prefix_caching: true`): vLLM 0.33's hybrid KV-cache manager with prefix caching
(`kvfrag.sim.hybrid.caching.HybridPrefixCaching`: its hit rules, caching and decode steps),
its block pool replaced by the two-level cache pool (`two_level_cache_pool`) with one small
page per large page, so a large page is one block id.

The records are the `hybrid` allocator's with prefix caching, exactly
(tests/sim/test_two_level_caching.py): the cache pool's eviction order reduces to vLLM's free
queue there. Two-level's own layout (one unpadded group per layer type, large pages of the LCM
of the small pages) with prefix caching is `two_level_own_caching`.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvfrag.sim.allocators.two_level_cache_pool import TwoLevelCachePool
from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.hybrid.caching import HybridPrefixCaching


class _Refs:
    """`BlockPool.ref` read-only: a cached id nobody holds counts 0."""

    def __init__(self, ref: dict[int, int]) -> None:
        self._ref = ref

    def __getitem__(self, b: int) -> int:
        return self._ref.get(b, 0)


class BlockPoolView:
    """What `HybridPrefixCaching` calls on vLLM's block pool (`sim.hybrid.prefix.BlockPool`:
    ids 1..n, 0 the null block), over a `TwoLevelCachePool` of one type and one small page
    per large page (large page 0 the null block)."""

    def __init__(self, n: int, pool: TwoLevelCachePool | None = None) -> None:
        self.n = n
        self.pool = pool if pool is not None else TwoLevelCachePool(n + 1, [1], True)

    @property
    def cache(self) -> dict[Hashable, dict[int, None]] | None:
        return None if self.pool.cache is None else self.pool.cache[0]

    @property
    def ref(self) -> _Refs:
        return _Refs(self.pool.ref[0])

    @property
    def keys(self) -> dict[int, list[Hashable]]:
        return self.pool.keys[0]

    @property
    def idle(self) -> dict[int, int]:
        return self.pool.stamp[0]

    @property
    def evictions(self) -> int:
        return self.pool.evictions

    @property
    def evicted(self) -> list[int]:
        return [sid for _t, sid in self.pool.evicted]

    @evicted.setter
    def evicted(self, ids: list[int]) -> None:
        self.pool.evicted = [(0, b) for b in ids]

    def light_copy(self) -> BlockPoolView:
        return BlockPoolView(self.n, self.pool.light_copy())

    def free_count(self) -> int:
        return self.pool.usable_large_pages()

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        if not self.pool.take_many(0, n, -1, out):
            raise IndexError(f"{n} blocks asked of a pool of {len(out)} free")
        return out

    def free(self, blocks: list[int]) -> int:
        return self.pool.free(0, blocks)

    def touch(self, blocks: list[int]) -> None:
        self.pool.touch(0, [b for b in blocks if b])

    def lookup(self, key: Hashable) -> int:
        return max(self.pool.lookup(0, key), 0)

    def insert(self, key: Hashable, b: int) -> None:
        self.pool.insert(0, key, b)


class TwoLevelVllmCaching(HybridPrefixCaching):
    """`two-level` with `vllm_groups` and prefix caching (`make_allocator` builds it): see the
    module."""

    kind = "two-level"

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        block_size: object = 16,
        stack: object = None,
        max_num_batched_tokens: object = 8192,
        concurrent_batches: object = 2,
        prefix_caching: object = True,
        vllm_groups: object = True,
        geometry: KVGeometry | None = None,
    ) -> None:
        assert prefix_caching is True and vllm_groups is True, "built by make_allocator"
        super().__init__(capacity, bytes_per_token, max_model_len, block_size, True, stack,
                         max_num_batched_tokens, concurrent_batches, True, geometry=geometry)
        self.vllm_groups = True
        self._st.pool = BlockPoolView(self.num_blocks)  # type: ignore[assignment]


__all__ = ["BlockPoolView", "TwoLevelVllmCaching"]
