"""The look-ahead of the `hybrid` allocator with prefix caching (and of two-level's caching
layouts, which share its decode steps): decode steps applied to a light copy of the state
(`PrefixState.light_copy`) until a decoder finds too few free blocks, kept while the clock and
the state stay, and walked only as far as the question asked needs: whether the next step
fits (`can_step`), whether the steps up to the engine's next event fit
(`steps_until_full_within`), the first step that frees (`steps_until_shrink`), or the whole
stretch (`steps_until_full`). Each answer is the one a walk of the whole stretch gives."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfrag.sim.hybrid.caching import HybridPrefixCaching
    from kvfrag.sim.hybrid.prefix import PrefixState

#: The most decode steps looked ahead on a copy of the state.
HORIZON = 32


class LookAhead:
    """The steps walked from (`clock`, `version`): `walked` fit; `full` the steps that fit once
    known (a step did not fit, or `limit` were walked; None before), `shrink` the first walked
    that freed an id, or with Mamba groups evicted a cached one (None: none so far). `done`
    is the allocator's `steps_until_done` (None: nobody decodes: nothing is walked)."""

    __slots__ = (
        "clock",
        "done",
        "evictions",
        "full",
        "limit",
        "pending",
        "shrink",
        "st",
        "version",
        "walked",
    )

    def __init__(self, alloc: HybridPrefixCaching) -> None:
        self.clock, self.version = alloc._clock, alloc._version
        self.done = done = alloc.steps_until_done()
        self.limit = 0 if done is None else min(done, HORIZON)
        self.walked = 0
        self.full: int | None = None
        self.shrink: int | None = None
        self.st: PrefixState | None = None  # (made at the first step walked)
        self.pending: list[tuple[int, list[list[int]], int]] = []
        self.evictions = 0
        if done is not None and not self.limit:
            self.full = 0

    def __reduce__(self) -> tuple[object, tuple[()]]:
        """A copy (or pickle) of the allocator asks again: a walk under way, on overlays of
        the state, is not copied."""
        return _stale, ()

    def walk(self, alloc: HybridPrefixCaching, steps: int, shrink: bool) -> None:
        """Walk on until `steps` steps are known to fit, or (with `shrink`) the first that
        frees is known, or `full` is."""
        if self.full is not None or self.done is None:
            return
        st = self.st
        if st is None:
            st = self.st = alloc._st.light_copy()
            # (the requests preempted for the next step: their tables copied, freed in
            # step 1)
            self.pending = [(rid, [list(t) for t in ts], p) for rid, ts, p in alloc._pending]
            self.evictions = st.pool.evictions
        while st is not None and (self.walked < steps or (shrink and self.shrink is None)):
            s = self.walked + 1
            if alloc._step(st, self.clock + s, self.pending if s == 1 else None) >= 0:
                self.full = s - 1
            else:
                self.walked = s
                if self.shrink is None and (st.freed or (
                        alloc._mamba and st.pool.evictions != self.evictions)):
                    self.shrink = s
                if s < self.limit:
                    continue
                self.full = s
            self.st = st = None  # (known: the copy let go)
            self.pending = []

    def until_shrink(self, alloc: HybridPrefixCaching) -> int | None:
        """The first step that frees (see the class), else the one past `full` where that
        is before the first decoder's end (not looked at: the stretch ends there anyway)."""
        if self.done is None:
            return None
        self.walk(alloc, 0, True)
        if self.shrink is not None:
            return self.shrink
        assert self.full is not None
        return self.full + 1 if self.full < self.done else None


def _stale() -> LookAhead:
    """A look-ahead that matches no clock (`HybridPrefixCaching._look_ahead` makes anew)."""
    ahead = LookAhead.__new__(LookAhead)
    ahead.clock = ahead.version = -1
    ahead.done = ahead.full = ahead.shrink = ahead.st = None
    ahead.limit = ahead.walked = ahead.evictions = 0
    ahead.pending = []
    return ahead


def surely_fits(alloc: HybridPrefixCaching, steps: int) -> bool:
    """Whether the next `steps` decode steps fit without walking them: a decoder whose steps
    stay quiet through them (`PrefixState.quiet`) takes nothing, any other at most
    steps // block size + 1 blocks per group (its tables cover its tokens; every group has
    one block size), and a step's frees only add to the free blocks."""
    st = alloc._st
    per = len(alloc._manager_of) * (steps // alloc._hash_bs + 1)
    free = st.pool.free_count()
    until, reach = st.quiet, alloc._clock + steps
    need = 0
    for rid, live in alloc._decoders():
        if until.get(rid, 0) <= live.base + reach:
            need += per
            if need > free:
                return False
    return True
