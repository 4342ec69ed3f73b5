"""Modeled KV-cache allocators: one protocol (`base`), one allocator per module, a registry.

`make_allocator(kind, capacity=..., bytes_per_token=..., max_model_len=..., **options)` builds
one by name; an unknown kind or option gets an error that lists the valid ones. Allocators that
need the model's KV shape (a `geometry` constructor argument) get `geometry=` passed through.
"""

from __future__ import annotations

from kvfrag.sim.allocators.base import (
    PARTS,
    Accounting,
    Allocator,
    Grant,
    Reason,
    Refusal,
    Request,
)
from kvfrag.sim.allocators.buddy import BuddyAllocator
from kvfrag.sim.allocators.contiguous import ContiguousAllocator, Placement
from kvfrag.sim.allocators.floor import FloorAllocator
from kvfrag.sim.allocators.hybrid import HybridAllocator
from kvfrag.sim.allocators.paged import PagedAllocator
from kvfrag.sim.allocators.prefix_caching import PrefixCachingAllocator
from kvfrag.sim.allocators.slab import Reserve
from kvfrag.sim.allocators.static_partition import StaticPartitionAllocator
from kvfrag.sim.allocators.torch_caching import TorchCachingAllocator
from kvfrag.sim.allocators.two_level import TwoLevelAllocator
from kvfrag.sim.allocators.vattention import VAttentionAllocator
from kvfrag.sim.geometry import KVGeometry

REGISTRY: dict[str, type[Allocator]] = {
    cls.kind: cls
    for cls in (
        ContiguousAllocator,
        BuddyAllocator,
        PagedAllocator,
        PrefixCachingAllocator,
        TorchCachingAllocator,
        VAttentionAllocator,
        HybridAllocator,
        FloorAllocator,
        StaticPartitionAllocator,
        TwoLevelAllocator,
    )
}

#: Each kind's options (its constructor's keyword arguments beyond capacity, bytes_per_token
#: and max_model_len), in their order there. Written out rather than read from the signature:
#: compiled classes (setup.py) have none to read. tests/sim/test_allocators_registry.py holds
#: them to the constructors in the source.
OPTIONS: dict[str, tuple[str, ...]] = {
    "contiguous": ("reserve", "placement", "compaction", "bandwidth"),
    "buddy": ("reserve",),
    "paged": ("block_size",),
    "prefix-caching": ("block_size", "cache_generated"),
    "torch-caching": (
        "reserve", "expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
    ),
    "vattention": ("page_size",),
    "hybrid": (
        "block_size", "hybrid_kv_cache_manager", "stack", "max_num_batched_tokens",
        "concurrent_batches", "prefix_caching", "mamba_cache_mode",
        "prefix_cache_retention_interval",
    ),
    "floor": ("stack", "max_num_batched_tokens"),
    "static-partition": (
        "block_size", "partition", "stack", "max_num_batched_tokens", "concurrent_batches",
    ),
    "two-level": (
        "block_size", "stack", "max_num_batched_tokens", "concurrent_batches", "prefix_caching",
        "vllm_groups",
    ),
}
#: Kinds whose constructor also takes the model's KV shape (`geometry=`).
TAKES_GEOMETRY = frozenset({"vattention", "hybrid", "floor", "static-partition", "two-level"})


def options_of(kind: str) -> list[str]:
    """The options (beyond capacity, bytes_per_token, max_model_len) an allocator kind takes."""
    allocator_class(kind)  # (an unknown kind: the error that lists the valid ones)
    return list(OPTIONS[kind])


def allocator_class(kind: str) -> type[Allocator]:
    try:
        return REGISTRY[kind]
    except KeyError:
        raise ValueError(
            f"unknown allocator kind {kind!r} (valid: {', '.join(sorted(REGISTRY))})"
        ) from None


def make_allocator(
    kind: str,
    *,
    capacity: int,
    bytes_per_token: int,
    max_model_len: int,
    geometry: KVGeometry | None = None,
    **options: object,
) -> Allocator:
    """Build an allocator by registry name, checking its options by name first.

    `geometry` (the model's KV shape) is passed on to allocators whose constructor takes one
    and ignored by the rest; it must agree with `bytes_per_token`."""
    cls = allocator_class(kind)
    if geometry is not None and geometry.bytes_per_token != bytes_per_token:
        raise ValueError(
            f"geometry {geometry.name!r} stores {geometry.bytes_per_token} bytes per token, "
            f"but bytes_per_token is {bytes_per_token}"
        )
    valid = options_of(kind)
    for name in options:
        if name not in valid:
            raise ValueError(
                f"allocator {kind!r} has no option {name!r} (valid: {', '.join(valid) or 'none'})"
            )
    if kind in TAKES_GEOMETRY:
        options["geometry"] = geometry
    if cls is HybridAllocator and options.get("prefix_caching") is True:
        # (vLLM's block pool kept block by block: `sim.hybrid.caching`)
        from kvfrag.sim.hybrid.caching import HybridPrefixCaching

        cls = HybridPrefixCaching
    if cls is TwoLevelAllocator and options.get("prefix_caching") is True:
        if options.get("vllm_groups") is True:
            # (vLLM's caching on the two-level cache pool: `two_level_caching`)
            from kvfrag.sim.allocators.two_level_caching import TwoLevelVllmCaching

            cls = TwoLevelVllmCaching
        elif options.get("vllm_groups", False) is False:
            # (its own layout, vLLM's hit rules on the cache pool: `two_level_own_caching`)
            from kvfrag.sim.allocators.two_level_own_caching import TwoLevelOwnCaching

            cls = TwoLevelOwnCaching
    return cls(capacity, bytes_per_token, max_model_len, **options)


__all__ = [
    "OPTIONS",
    "PARTS",
    "REGISTRY",
    "TAKES_GEOMETRY",
    "Accounting",
    "Allocator",
    "BuddyAllocator",
    "ContiguousAllocator",
    "FloorAllocator",
    "Grant",
    "HybridAllocator",
    "PagedAllocator",
    "Placement",
    "PrefixCachingAllocator",
    "Reason",
    "Refusal",
    "Request",
    "Reserve",
    "StaticPartitionAllocator",
    "TorchCachingAllocator",
    "TwoLevelAllocator",
    "VAttentionAllocator",
    "allocator_class",
    "make_allocator",
    "options_of",
]
