"""A dict's changes kept apart from it, the dict itself left as it is: what a look-ahead's copy
of a block pool needs of the pool's large dicts (reference counts, idle stamps, keys), which
it reads far more than it changes, so that a copy costs its changes, not the pool's size
(`BlockPool.light_copy`, `TwoLevelCachePool.light_copy`). The base must not change while the
overlay is used."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class _Gone:
    """The mark of a key the overlay deleted."""


_GONE = _Gone()
_MISSING = _Gone()


class Overlay(Generic[K, V]):
    """The mapping operations the pools use (item access, `in`, `get`, `pop`, `len`,
    iteration) over `base` with this overlay's changes."""

    __slots__ = ("base", "changed", "size")

    def __init__(self, base: dict[K, V] | Overlay[K, V]) -> None:
        self.base = base
        self.changed: dict[K, V | _Gone] = {}
        self.size = len(base)

    def __getitem__(self, key: K) -> V:
        got = self.changed.get(key, _MISSING)
        if got is _MISSING:
            return self.base[key]
        if got is _GONE:
            raise KeyError(key)
        return got  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        got = self.changed.get(key, _MISSING)  # type: ignore[call-overload]
        if got is _MISSING:
            return key in self.base
        return got is not _GONE

    def get(self, key: K, default: V | None = None) -> V | None:
        got = self.changed.get(key, _MISSING)
        if got is _MISSING:
            return self.base.get(key, default)
        return default if got is _GONE else got  # type: ignore[return-value]

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self:
            self.size += 1
        self.changed[key] = value

    def __delitem__(self, key: K) -> None:
        if key not in self:
            raise KeyError(key)
        self.changed[key] = _GONE
        self.size -= 1

    def pop(self, key: K, *default: V) -> V:
        if key in self:
            value = self[key]
            del self[key]
            return value
        if default:
            return default[0]
        raise KeyError(key)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[K]:
        changed = self.changed
        for key in self.base:
            if key not in changed:
                yield key
        for key, value in changed.items():
            if value is not _GONE:
                yield key

    def items(self) -> Iterator[tuple[K, V]]:
        for key in self:
            yield key, self[key]
