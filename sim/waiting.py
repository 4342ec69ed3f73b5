"""The waiting queue of `engine.policy: priority`, in vLLM 0.33's order.

vLLM's `PriorityRequestQueue` is a heap of requests ordered by (priority, arrival time,
request id): a lower priority value is served first, and a preempted request goes back in by
that key, not to the front. `PriorityQueue` keeps the same order, with the workload's order
(the engine's `idx`) breaking ties of arrival time, as the FCFS queue does.

It is a deque as far as the engine is concerned (`queue[0]` the head, `del queue[0]`,
`append` for an arrival, `appendleft` for a preemption, `len`), so the engine's FCFS code
paths stay as they are. It holds one deque per priority value, kept in key order: an arrival
comes after every request of its priority already waiting (arrivals are released in time
order), and a preempted request before them (it was admitted as the head, and whoever came
since arrived later), so each insertion is O(1) but for a walk over the few requests it must
pass where that does not hold (ties of arrival time released out of workload order). This
module is not compiled (`sim/_native.py`): a compiled class cannot subclass `deque`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterator
from typing import Any, SupportsIndex


def _key(r: Any) -> tuple[int, float, int]:
    """vLLM's order: priority, then arrival time, then (for ties) workload order."""
    return (r.priority, r.arrival, r.idx)


class PriorityQueue(deque):  # type: ignore[type-arg]
    """Waiting requests in (priority, arrival, workload order); the deque itself stays empty."""

    def __init__(self) -> None:
        super().__init__()
        self.levels: dict[int, deque[Any]] = {}
        self.order: list[int] = []  # priorities with someone waiting, ascending
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __iter__(self) -> Iterator[Any]:
        for p in self.order:
            yield from self.levels[p]

    def __getitem__(self, i: SupportsIndex) -> Any:  # type: ignore[override]
        i = int(i)
        if i == 0 and self.n:
            return self.levels[self.order[0]][0]
        if not 0 <= i < self.n:
            raise IndexError("waiting queue index out of range")
        for p in self.order:
            level = self.levels[p]
            if i < len(level):
                return level[i]
            i -= len(level)
        raise IndexError("waiting queue index out of range")  # (unreachable)

    def __delitem__(self, i: SupportsIndex) -> None:  # type: ignore[override]
        i = int(i)
        if not 0 <= i < self.n:
            raise IndexError("waiting queue index out of range")
        for at, p in enumerate(self.order):
            level = self.levels[p]
            if i < len(level):
                del level[i]
                self.n -= 1
                if not level:
                    del self.levels[p]
                    del self.order[at]
                return
            i -= len(level)

    def _level(self, p: int) -> deque[Any]:
        level = self.levels.get(p)
        if level is None:
            level = self.levels[p] = deque()
            self.order.insert(bisect_left(self.order, p), p)
        return level

    def append(self, r: Any) -> None:
        """An arrival: after the requests of its priority with a smaller key."""
        level = self._level(r.priority)
        key = _key(r)
        at = len(level)
        while at and _key(level[at - 1]) > key:
            at -= 1
        level.insert(at, r)
        self.n += 1

    def appendleft(self, r: Any) -> None:
        """A preempted request: back in by its key (vLLM's heap push), before later arrivals."""
        level = self._level(r.priority)
        key = _key(r)
        at = 0
        while at < len(level) and _key(level[at]) < key:
            at += 1
        level.insert(at, r)
        self.n += 1
