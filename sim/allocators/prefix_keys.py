"""The keys of prefix caching's blocks and the structures the cache keeps them in
(`prefix_caching`'s module docstring, "Speed", says why they look as they do): a block's key
as (segment base, index), sequences of keys as runs (`Keys`), the cache per segment (`Seg`)
and the runs of idle blocks that frees give back (`Run`).
"""

from __future__ import annotations

from typing import cast

from mypy_extensions import mypyc_attr

#: A block's key: (segment base, block index j), the base being the hash chain up to the
#: block's last chunk h for the blocks a trace's hash chain names, and `own_base(rid)` for a
#: request's blocks of its own (generated tokens). Where a key is needed whole (younger
#: duplicates, checks) the pair is packed into one int, base*J + j: equal exactly when the
#: pairs are (0 <= j < J). Ints, not tuples: every tuple is an object the garbage collector
#: tracks. Segments are keyed by the base alone, an int of the hash's size: the dictionary
#: hashes it at every lookup, and a product of two large ints cost a multiplication besides
#: (9 % of a run on the Mooncake sample at 16-token blocks). `prefix_keys` gives the digest
#: of the pair.
Key = int
#: A segment base, typed as an object so that compiled code keeps the int boxed: half the
#: hashes fit a native int, and one unboxed would be boxed again (a new int object) at every
#: dictionary lookup, which then compares values instead of finding the very object it holds.
Base = object
#: Over 2**64, and odd, so that keys hash apart: an int hashes to itself mod 2**61 - 1, and a
#: power of two would give (base, j + 8) the hash of (base + 1, j).
J = 2**64 + 0x9E3779B97F4A7C15
#: Own bases lie above every hash (a hash is in [-2**63, 2**63)): 2**64 + rid, for |rid| < 2**63.
OWN = 2**64


def own_base(rid: int) -> Base:
    """The segment base of request `rid`'s own blocks."""
    return OWN + rid


def pack(base: Base, j: int) -> Key:
    """The key of block j of segment `base`, as one int."""
    return cast(int, base) * J + j


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class Keys:
    """A sequence of keys described by runs, not listed: (base, j, n) stands for the keys
    (base, j + i), i < n, of blocks j + i of one segment (`base`: a hash chain's h, or
    a request's own `own_base(rid)`). A long context's keys come in runs of a chunk's
    blocks, so a key is never made for a block: the cache is kept by segment (`Seg`) and
    every pass over a request's blocks is a few slice operations per run."""

    __slots__ = ("_ends", "offset", "runs", "size")

    def __init__(self, runs: list[tuple[Base, int, int]], size: int = -1, offset: int = -1) -> None:
        self.runs = runs
        if size < 0:  # (not known to the caller)
            size = 0
            for run in runs:
                size += run[2]
        self.size = size
        # `offset` >= 0: each run's block index is its position + offset (a request's keys
        # from some position on, the usual), so runs are found by position without a table.
        self.offset = offset
        self._ends: list[int] | None = None  # position after each run, once asked

    def __len__(self) -> int:
        return self.size

    def first_run(self, start: int) -> tuple[int, int]:
        """(index, position) of the run holding position `start` (or of none, at the end)."""
        if not start:  # (the usual case: no table of run ends made for it)
            return 0, 0
        runs, off = self.runs, self.offset
        if off >= 0:  # (bisect on the runs' block indices)
            if start >= self.size:
                return len(runs), self.size
            lo, hi = 0, len(runs)
            while lo < hi:
                mid = (lo + hi) // 2
                if runs[mid][1] - off > start:
                    hi = mid
                else:
                    lo = mid + 1
            _, j, _ = runs[lo - 1]
            return lo - 1, j - off
        ends = self._ends
        if ends is None:
            ends, at = [], 0
            for run in self.runs:
                at += run[2]
                ends.append(at)
            self._ends = ends
        lo, hi = 0, len(ends)  # (bisect_right, inline: compiled, no call)
        while lo < hi:
            mid = (lo + hi) // 2
            if ends[mid] > start:
                hi = mid
            else:
                lo = mid + 1
        return lo, ends[lo - 1] if lo else 0

    def slice(self, start: int, end: int) -> Keys:
        """Keys at positions start..end-1 (those of them there are)."""
        if end >= self.size:  # (a tail from a run's start is a slice of the runs: usual)
            if not start:
                return self  # (runs are never changed in place)
            r, at = self.first_run(start)
            if at == start:
                return Keys(self.runs[r:], self.size - start, self._moved(start))
        count = min(end, self.size) - start
        return Keys(self.spans(start, count) if count > 0 else [], -1, self._moved(start))

    def _moved(self, start: int) -> int:
        """The offset of the keys from position `start` on."""
        return self.offset + start if self.offset >= 0 else -1

    def __getitem__(self, pos: int) -> Key:
        base, j, _ = self.at(pos)
        return pack(base, j)

    def at(self, pos: int) -> tuple[Base, int, int]:
        """The run of the one key at position `pos`."""
        r, start = self.first_run(pos)
        if r >= len(self.runs):
            raise IndexError("key position out of range")
        base, j, _ = self.runs[r]
        return base, j + pos - start, 1

    def span(self, r: int, skip: int, most: int) -> tuple[Base, int, int]:
        """Run r less its first `skip` keys, `most` keys at the most."""
        base, j, n = self.runs[r]
        return base, j + skip, min(n - skip, most)

    def spans(self, start: int, count: int) -> list[tuple[Base, int, int]]:
        """The keys at positions start..start+count-1, as runs (a pass that has no use for the
        list steps through the runs itself: making it is 7 % of a run on Mooncake at 16-token
        blocks, and a call per run to `span` 1 %)."""
        out: list[tuple[Base, int, int]] = []
        r, skip = self.first_run(start)
        skip = start - skip  # (keys of the first run before `start`)
        at = 0
        while at < count:
            run = self.span(r, skip, count - at)
            r, skip = r + 1, 0
            out.append(run)
            at += run[2]
        return out

    def pairs(self) -> list[tuple[Base, int]]:
        """(segment base, block index) of each key, in order (for the rare per-block paths)."""
        return [(b, j + i) for b, j, n in self.runs for i in range(n)]

    def listed(self) -> list[Key]:
        return [pack(b, j) for b, j in self.pairs()]


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class Seg:
    """The cached blocks of one segment: ids[j - lo] is the oldest id cached under the key of
    block j (-1: none); `count` of them are ids, and `dups` younger ids wait under its keys.
    Their state is kept for them all while they agree, as a chunk's blocks do: all in use by
    1 + `extra` requests (`idle` None), or all idle in one run (`idle`). Once they disagree,
    or a duplicate joins, the segment is `mixed`: the run of each of its idle blocks, and the
    users beyond one of each block in use, are found by id (`PrefixCachingAllocator._idle_of`
    and `_shared`)."""

    __slots__ = ("count", "dups", "extra", "idle", "ids", "lo", "mixed")

    def __init__(self, lo: int, ids: list[int], count: int) -> None:
        self.lo = lo
        self.ids = ids
        self.count = count
        self.dups = 0
        self.idle: Run | None = None
        self.extra = 0
        self.mixed = False

    def span(self, j: int, n: int) -> int:
        """Make room for blocks j..j+n-1; returns the index of block j."""
        if j < self.lo:
            self.ids[0:0] = [-1] * (self.lo - j)
            self.lo = j
        end = j + n - self.lo
        if end > len(self.ids):
            self.ids.extend([-1] * (end - len(self.ids)))
        return j - self.lo


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class Run:
    """Idle blocks that one free gave back, with their keys, in the order of the request's
    table: the LRU order is from the last (a request's blocks are freed last first).
    Evictions take them from the end, `pos` of them taken; a block found again by a lookup
    leaves the run (`gone` counts those not taken yet, which the idle map no longer sends to
    this run)."""

    __slots__ = ("gone", "ids", "keys", "pos")

    def __init__(self, ids: list[int], keys: Keys) -> None:
        self.ids = ids
        self.keys = keys
        self.pos = 0
        self.gone = 0

    def live(self) -> int:
        return len(self.ids) - self.pos - self.gone
