"""The `two-level` allocator's plan (`kvfrag.sim.allocators.two_level`): its layer types, its
large page, and its managers' kinds as plain ints for the walk's hot path."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from kvfrag.sim.hybrid.managers import (
    ChunkedLocalManager,
    MambaManager,
    Manager,
    SlidingWindowManager,
)
from kvfrag.sim.hybrid.planner import layer_kind, layer_window
from kvfrag.sim.layers import LayerStack
from mypy_extensions import i64, mypyc_attr

#: The most a large page may be, in largest small pages, before the fallback (see the module).
MAX_LCM_RATIO = 64
#: The fewest large pages the budget must hold, else the fallback (a large page is at most
#: this fraction of the budget: what one type strands stays small beside it).
MIN_LARGE_PAGES = 64


#: Bits of an event's key that name the decoder's slot (`TwoLevelAllocator._slots`); the
#: rank above them orders a bucket's events by admission.
SLOT_BITS: Final = 24
SLOT_MASK: Final = (1 << 24) - 1

#: Manager kinds as codes (`manager_code`; Final: the compiled walk reads them as constants).
FULL: Final = 0
SLIDING: Final = 1
CHUNKED: Final = 2
MAMBA: Final = 3


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class Decoder:
    """A decoder as the walk reads it at each of its events, found by its admission rank in
    one lookup: set when it joins the cohort (its length's base and the clock it joined
    change only then), dropped when it leaves."""

    def __init__(self, rid: int, base: int, joined: int, done: int,
                 tables: list[list[list[int]]], starts: list[int]) -> None:
        self.rid = rid
        self.base = base  # its length: base + clock
        self.joined = joined
        self.done = done  # the clock it is done at
        self.tables = tables  # its small pages per manager and group (the allocator's lists)
        self.starts = starts  # per manager, its blocks skipped
        self.at = -1  # the clock of its next event (-1: none before it is done)
        self.key = -1  # its events' key: admission rank << SLOT_BITS | its slot


def manager_code(m: Manager) -> int:
    """The kind of a manager (`sim.hybrid.managers`' four classes) as a code."""
    if isinstance(m, SlidingWindowManager):
        return SLIDING
    if isinstance(m, ChunkedLocalManager):
        return CHUNKED
    if isinstance(m, MambaManager):
        return MAMBA
    assert type(m) is Manager, type(m)
    return FULL


def skipped_blocks(kind: i64, bs: i64, window: i64, processed: i64) -> i64:
    """`Manager.skipped_blocks` of a manager of that kind, block size and window: its
    formulas, on plain ints (tests/sim/test_two_level_walk.py checks them the same; i64:
    machine ints in the compiled code, as `two_level_pool` says)."""
    if kind == SLIDING:
        x = processed - window + 1
        return x // bs if x > 0 else 0
    if kind == CHUNKED:
        return processed // window * window // bs
    if kind == MAMBA:
        return (processed - 1) // bs if processed > 1 else 0
    return 0


def next_step(kinds: list[int], sizes: list[int], windows: list[int], max_model_len: i64,
              tokens: i64, processed: i64) -> i64:
    """Steps from now to the next at which the counts of a settled decoder of `tokens` and
    `processed` tokens now may change: the nearest block boundary of its length, window
    edge or chunk start of its processed tokens."""
    step: i64 = 1 << 60  # (none)
    for mi in range(len(kinds)):
        bs: i64 = sizes[mi]
        kind: i64 = kinds[mi]
        window: i64 = windows[mi]
        if bs < max_model_len:
            d = -tokens % bs + 1
            if d < step:
                step = d
        if kind == SLIDING:
            x = processed - window + 1
            d = -x % bs
            if d == 0:
                d = bs
            if x + d < bs:
                d = bs - x
            if d < step:
                step = d
        elif kind == CHUNKED:
            d = -processed % window
            if d == 0:
                d = window
            if d < step:
                step = d
    return step


def count_takes(kinds: list[int], sizes: list[int], windows: list[int], ptype: list[int],
                tables: list[list[list[int]]], starts: list[int], tokens: int, processed: int,
                need: list[int]) -> bool:
    """Add to `need` (per pool type) the small pages a request placed at (`tables`,
    `starts`) takes to reach its counts at (tokens, processed), as `TwoLevelAllocator._place`
    would; False (`need` part done) if it would give one back first."""
    for mi in range(len(kinds)):
        bs, kind = sizes[mi], kinds[mi]
        want = -(-tokens // bs)
        if kind != FULL:
            skip = skipped_blocks(kind, bs, windows[mi], processed)
            if skip > starts[mi]:
                return False
            want -= skip
        t = ptype[mi]
        for ids in tables[mi]:
            if want > len(ids):
                need[t] = need[t] + want - len(ids)
    return True


def weights(a: int, b: int, w0: float, w1: float) -> float:
    """Sum over j = a..b of w0 + w1 (j - 1)."""
    if b < a:
        return 0.0
    n = b - a + 1
    return n * w0 + w1 * (n * (a - 1) + n * (n - 1) / 2)


def layer_types(stack: LayerStack) -> list[tuple[str, int, list[int]]]:
    """(kind, window or chunk (0: none), layer indices) per distinct layer type, in order of
    first appearance."""
    types: dict[tuple[str, int], list[int]] = {}
    for i, layer in enumerate(stack.layers):
        key = (layer_kind(layer), layer_window(layer) or 0)
        types.setdefault(key, []).append(i)
    return [(kind, window, layers) for (kind, window), layers in types.items()]


def large_page(small: Sequence[int], budget: int) -> tuple[int, list[int], bool]:
    """(large page bytes, small pages per large page per type, whether the fallback is used):
    the LCM of the small pages, or where it exceeds MAX_LCM_RATIO x the largest small page or
    budget / MIN_LARGE_PAGES, that largest small page, each type fitting floor(large /
    small) padded pages."""
    lcm = math.lcm(*small)
    largest = max(small)
    if lcm <= MAX_LCM_RATIO * largest and lcm * MIN_LARGE_PAGES <= budget:
        return lcm, [lcm // s for s in small], False
    return largest, [largest // s for s in small], True
