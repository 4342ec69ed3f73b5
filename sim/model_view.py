"""What a hybrid model's layers still read of the tokens an allocator keeps for all of them.

An allocator without a hybrid KV-cache manager keeps every token in every layer (vLLM's
fallback promotes sliding-window and chunked-local layers to full attention), so counting
its stored tokens as token states would call bytes that no layer reads again "needed". The
model view counts those bytes, out of window, per live request of L tokens:

- a sliding-window layer of window W reads the last min(W, L) tokens: max(0, L - W) are out;
- a chunked-local layer of chunk C reads the tokens of the current chunk: the (L - 1) // C x C
  before it are out;
- full attention and MLA read every token (a Mamba layer keeps no tokens: none of its state
  is ever out of window, and stacks with Mamba layers need a hybrid manager anyway).

`Allocator.view_model` attaches one; the base class then reports token_states less the out of
window bytes and internal plus them, exact in `parts()` and `integrals()`. The bytes are kept
as running totals, as the hybrid allocator keeps its parts: a sum over the requests outside
the decode cohort, and for each decoder a linear segment in the decode clock K (its figure is
linear in its length between the window edge L = W and the chunk starts L = kC + 1), summed
over the cohort; a heap renews the segments the clock passes. A stretch of n steps walks
only the decoders whose segment ends inside it, piece by piece.

Requests whose stored tokens are shared (sample groups that share prompt blocks, beams,
cached prefixes) are not counted (`mult` 0): which shared token a sequence still reads
differs per sequence, and their tokens stay token states whole. A prefix cache's block is
counted by the request that wrote it, by that request's own length.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Final

from kvfrag.sim.layers import ChunkedLocal, LayerStack, SlidingWindow
from mypy_extensions import mypyc_attr

#: A segment that never ends (a decoder past every sliding window, no chunked layers). Final
#: and below 2**62: compiled, an inlined native int (see `kvfrag.sim.hybrid.forms.NEVER`).
NEVER: Final = (1 << 62) - 1


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class ModelView:
    """Out-of-window bytes of the live requests, as running totals (see the module)."""

    def __init__(self, stack: LayerStack) -> None:
        sliding: dict[int, int] = {}
        chunked: dict[int, int] = {}
        for layer in stack.layers:
            if isinstance(layer, SlidingWindow):
                sliding[layer.window] = sliding.get(layer.window, 0) + layer.bytes_per_token
            elif isinstance(layer, ChunkedLocal):
                chunked[layer.chunk] = chunked.get(layer.chunk, 0) + layer.bytes_per_token
        #: (window, bytes per token of the layers with it), and likewise (chunk, bytes)
        self.sliding = tuple(sorted(sliding.items()))
        self.chunked = tuple(sorted(chunked.items()))
        self._fixed = 0  # over requests outside the decode cohort
        # the cohort's segments: offset + slope x K (not `_const`: mypyc names a field `__const`,
        # which C compilers read as the keyword)
        self._offset = 0
        self._slope = 0
        self._rec: dict[int, tuple[int, int]] = {}  # rid -> (mult, tokens), outside the cohort
        # rid -> (hi, const, slope, mult, phase): valid for K <= hi, tokens = phase + K
        self._seg: dict[int, tuple[int, int, int, int, int]] = {}
        self._heap: list[tuple[int, int]] = []  # (hi + 1, rid), lazily pruned

    @staticmethod
    def of(stack: LayerStack | None) -> ModelView | None:
        """A view of `stack`, or None where every layer reads every token (nothing to do)."""
        if stack is None:
            return None
        view = ModelView(stack)
        return view if view.sliding or view.chunked else None

    # ------------------------------------------------------------------ one request
    def out_of_window(self, tokens: int) -> int:
        """Bytes of a sequence of `tokens` tokens that no layer reads again."""
        out = 0
        for w, b in self.sliding:
            if tokens > w:
                out += (tokens - w) * b
        for c, b in self.chunked:
            if tokens > c:
                out += (tokens - 1) // c * c * b
        return out

    def starts(self, lo: int, hi: int) -> list[int]:
        """Lengths in [lo, hi] where a new linear piece of `out_of_window` starts, and lo."""
        points = {lo}
        for w, _ in self.sliding:
            if lo <= w <= hi:
                points.add(w)
        for c, _ in self.chunked:
            points.update(range(lo + (1 - lo) % c, hi + 1, c))
        return sorted(points)

    def end(self, tokens: int) -> int:
        """The longest length up to which `out_of_window` stays linear from `tokens`."""
        end = NEVER
        for w, _ in self.sliding:
            if tokens < w:
                end = min(end, w)
        for c, _ in self.chunked:
            end = min(end, tokens + (-tokens) % c)
        return end

    # ------------------------------------------------------------------ running totals
    def enter(self, rid: int, mult: int, tokens: int) -> None:
        """Request `rid` (outside the cohort) stores `tokens` per sequence, `mult` sequences."""
        if mult:
            self._rec[rid] = (mult, tokens)
            self._fixed += mult * self.out_of_window(tokens)

    def exit(self, rid: int) -> None:
        """Request `rid` leaves the sums of requests outside the cohort (if it is in them)."""
        rec = self._rec.pop(rid, None)
        if rec is not None:
            self._fixed -= rec[0] * self.out_of_window(rec[1])

    def join(self, rid: int, mult: int, phase: int, clock: int) -> None:
        """Request `rid` joins the decode cohort: it stores phase + K tokens at clock K."""
        if not mult:
            return
        tokens = phase + clock
        end = self.end(tokens)
        base = mult * self.out_of_window(tokens)
        slope = mult * self.out_of_window(tokens + 1) - base if end > tokens else 0
        hi = NEVER if end == NEVER else clock + end - tokens
        const = base - slope * clock
        self._seg[rid] = (hi, const, slope, mult, phase)
        self._offset += const
        self._slope += slope
        if hi != NEVER:
            heapq.heappush(self._heap, (hi + 1, rid))

    def leave(self, rid: int) -> None:
        """Request `rid` leaves the decode cohort (if it is in it)."""
        seg = self._seg.pop(rid, None)
        if seg is not None:
            self._offset -= seg[1]
            self._slope -= seg[2]

    def stepped(self, clock: int) -> None:
        """The decode clock is `clock`: renew the segments it has passed."""
        heap, segs = self._heap, self._seg
        while heap and heap[0][0] <= clock:
            key, rid = heapq.heappop(heap)
            seg = segs.get(rid)
            if seg is not None and seg[0] + 1 == key:
                self.leave(rid)
                self.join(rid, seg[3], seg[4], clock)

    def total(self, clock: int) -> int:
        """Out-of-window bytes of every live request now."""
        return self._fixed + self._offset + self._slope * clock

    def integral(self, n: int, w0: float, w1: float, clock: int) -> float:
        """Sum over the next n steps of `total` after step j x (w0 + w1 (j - 1)), j = 1..n."""
        if n <= 0:
            return 0.0
        weight = n * w0 + w1 * n * (n - 1) / 2
        jw = w0 * n * (n + 1) / 2 + w1 * (n - 1) * n * (n + 1) / 3  # sum_j j * w_j
        const, slope, walked = self._offset, self._slope, 0.0
        for rid in self._ending_by(clock + n):
            _, c, sl, mult, phase = self._seg[rid]
            const -= c
            slope -= sl
            tokens = phase + clock
            starts = self.starts(tokens + 1, tokens + n)
            for si, a in enumerate(starts):
                b = starts[si + 1] - 1 if si + 1 < len(starts) else tokens + n
                count = b - a + 1
                fa = mult * self.out_of_window(a)
                step = mult * self.out_of_window(a + 1) - fa if count > 1 else 0
                alpha = w0 + w1 * (a - tokens - 1)
                s1 = count * (count - 1) / 2
                s2 = (count - 1) * count * (2 * count - 1) / 6
                walked += alpha * fa * count + (alpha * step + w1 * fa) * s1 + w1 * step * s2
        return (self._fixed + const + slope * clock) * weight + slope * jw + walked

    def at(self, clock: int) -> tuple[int, int]:
        """(`total`, growth per step) at a later `clock` with nothing entering or leaving
        before it, without renewing anything: the segments that end before it evaluated
        afresh. The growth is the slope of the segments valid then (0 for a decoder inside
        its window or chunk, a sliding layer's bytes past the window), which later steps
        only raise: out of window stays at or above total + growth x steps (`sim.allocators
        .floor`'s bound)."""
        const, slope = self._offset, self._slope
        for rid in self._ending_by(clock):
            _, c, sl, mult, phase = self._seg[rid]
            tokens = phase + clock
            now = mult * self.out_of_window(tokens)
            grows = mult * self.out_of_window(tokens + 1) - now if self.end(tokens) > tokens else 0
            const += now - grows * clock - c
            slope += grows - sl
        return self._fixed + const + slope * clock, slope

    def next_end(self, clock: int) -> int | None:
        """The earliest clock past `clock` at which a decoder's segment ends (its figure
        turns: a window edge or a chunk start), or None: stale heap entries dropped."""
        heap, segs = self._heap, self._seg
        while heap:
            key, rid = heap[0]
            seg = segs.get(rid)
            if seg is not None and seg[0] + 1 == key:
                return max(key, clock + 1)
            heapq.heappop(heap)
        return None

    def _ending_by(self, k: int) -> list[int]:
        return segments_ending_by(self._heap, self._seg, k)

    def walk_total(self, requests: list[tuple[int, int]]) -> int:
        """Out-of-window bytes of (mult, tokens) requests, summed afresh (what the running
        totals must equal: for checks)."""
        return sum(mult * self.out_of_window(tokens) for mult, tokens in requests)


def segments_ending_by(heap: list[tuple[int, int]], segs: Mapping[int, tuple], k: int) -> list[int]:
    """The requests whose linear segment ends before clock `k`, from a heap of (last clock + 1,
    rid) entries kept lazily (an entry counts while `segs[rid][0]` is still its last clock):
    a walk of the heap pruned at keys past `k`, so a stretch costs only the segments it ends."""
    out: dict[int, None] = {}
    todo = [0] if heap and heap[0][0] <= k else []
    while todo:
        i = todo.pop()
        key, rid = heap[i]
        seg = segs.get(rid)
        if seg is not None and seg[0] + 1 == key:
            out[rid] = None
        for c in (2 * i + 1, 2 * i + 2):
            if c < len(heap) and heap[c][0] <= k:
                todo.append(c)
    return list(out)
