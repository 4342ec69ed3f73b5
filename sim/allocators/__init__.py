"""Modeled KV-cache allocators: one protocol (`base`), one allocator per module, a registry.

`make_allocator(kind, capacity=..., bytes_per_token=..., max_model_len=..., **options)` builds
one by name; an unknown kind or option gets an error that lists the valid ones.
"""

from __future__ import annotations

import inspect

from sim.allocators.base import (
    PARTS,
    Accounting,
    Allocator,
    Grant,
    Reason,
    Refusal,
    Request,
)
from sim.allocators.buddy import BuddyAllocator
from sim.allocators.contiguous import ContiguousAllocator, Placement
from sim.allocators.paged import PagedAllocator
from sim.allocators.slab import Reserve
from sim.allocators.torch_caching import TorchCachingAllocator

REGISTRY: dict[str, type[Allocator]] = {
    cls.kind: cls
    for cls in (ContiguousAllocator, BuddyAllocator, PagedAllocator, TorchCachingAllocator)
}

_COMMON = ("capacity", "bytes_per_token", "max_model_len")


def options_of(kind: str) -> list[str]:
    """The options (beyond capacity, bytes_per_token, max_model_len) an allocator kind takes."""
    params = inspect.signature(allocator_class(kind).__init__).parameters
    return [p for p in params if p not in ("self", *_COMMON)]


def allocator_class(kind: str) -> type[Allocator]:
    try:
        return REGISTRY[kind]
    except KeyError:
        raise ValueError(
            f"unknown allocator kind {kind!r} (valid: {', '.join(sorted(REGISTRY))})"
        ) from None


def make_allocator(
    kind: str, *, capacity: int, bytes_per_token: int, max_model_len: int, **options: object
) -> Allocator:
    """Build an allocator by registry name, checking its options by name first."""
    cls = allocator_class(kind)
    valid = options_of(kind)
    for name in options:
        if name not in valid:
            raise ValueError(
                f"allocator {kind!r} has no option {name!r} (valid: {', '.join(valid) or 'none'})"
            )
    return cls(capacity, bytes_per_token, max_model_len, **options)


__all__ = [
    "PARTS",
    "REGISTRY",
    "Accounting",
    "Allocator",
    "BuddyAllocator",
    "ContiguousAllocator",
    "Grant",
    "PagedAllocator",
    "Placement",
    "Reason",
    "Refusal",
    "Request",
    "Reserve",
    "TorchCachingAllocator",
    "allocator_class",
    "make_allocator",
    "options_of",
]
