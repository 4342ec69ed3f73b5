"""The hybrid allocator's decode cohort as running sums in the decode clock K, so that an engine
event costs about the same however many requests decode (`kvfrag.sim.allocators.hybrid`).

A decoder of phase c holds L = c + K tokens at clock K and has processed L - 1 (vLLM frees by
the tokens computed before the step). Each of its figures (blocks, token_states, reserved,
internal, padding, out_of_window, then each manager's held blocks per group) is, between its
*events*, exactly

    a + s x K + sum over its terms of v_k x floor((x + K) / mod_k)

with two kinds of term: ceil(L / bs) for each block size (a block taken when L crosses a block
boundary), and, once L reaches a sliding manager's window W, the blocks it has skipped,
floor((L - W) / bs). Events are the lengths where that form changes: a window edge (of a
sliding manager or of a promoted sliding layer, whose out-of-window tokens then grow), a chunk
start (chunked-local groups free, and promoted chunked layers stop reading, a whole chunk at
once: a constant between chunk starts), and entering the block of the final length (the
reserved slots stop at it). At an event a decoder's form is rebuilt from its exact parts
(`parts_of`), so a and s are the allocator's own figures, not a second derivation. A request
meets a few events in its life, not one per block.

The terms are kept per kind as paged.py keeps its block counts (`FloorSum`: counts per residue),
with the decoders of each residue, so that:
- the figures now, and their weighted sums over a stretch (`integrals`), cost O(residues)
  plus the decoders with an event inside the stretch, walked piece by piece;
- `steps_until_full` walks steps, not decoders: a step's blocks taken and freed are the counts
  at its residues. vLLM allocates the running requests one after the other (each frees its
  skipped blocks, then takes its new ones), so a step where the blocks taken could exceed the
  free pool before the blocks freed come back is settled by walking that step's decoders in
  running order (admission order): only those steps, only those decoders;
- `steps_until_shrink` is the first step at which some residue of skipped blocks moves, or an
  in-window or chunked decoder reaches its next free (a heap), exact up to the first decoder's
  end (what the engine and the checks use); beyond it, a lower bound, or None when no decoder
  frees again before its end (a heap of each decoder's last free).

A decoder in the clock it joined holds its prefill's blocks (vLLM frees them at its first
decode step): its parts differ from the form above at that clock only, kept as a correction.

Async scheduling (`set_lag(1)`): vLLM frees by the tokens processed, its last token in flight:
a decoder of L tokens has processed L - 1 - lag, and its first step frees by the tokens before
its final chunk (that chunk in flight), a second correction, at the clock after it joined.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from kvfrag.sim.allocators.paged import FloorSum
from kvfrag.sim.hybrid.managers import Manager
from kvfrag.sim.model_view import ModelView
from mypy_extensions import mypyc_attr

#: No event (a decoder's form holds to its end).
NEVER = 1 << 62

#: Manager classes whose skipped blocks the cohort computes itself (`Cohort._skipped`).
_CODES = {"Manager": 1, "SlidingWindowManager": 2, "ChunkedLocalManager": 3}

@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class _Rec:
    """One decoder: its phase, final length, form and terms, and its heap keys."""

    def __init__(self, c: int, final: int, terms: list[tuple[int, int]], a: list[int],
                 s: list[int], sid: int) -> None:
        self.c = c
        self.final = final
        self.a = a
        self.s = s
        self.sid = sid  # its slope's index in `Cohort.slopes` (-1: a slope of zeros)
        self.terms = terms  # (term kind, x)
        self.event = NEVER  # clock of its next event
        self.light = False  # whether that event only ends its reserved slots at its final
        self.nf = NEVER  # clock of its next free that no term counts (in-window, chunked)
        self.last = -1  # clock of its last free before its final length


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class Cohort:
    """The decoders' figures as running sums (see the module)."""

    def __init__(self, managers: Sequence[Manager], views: Sequence[ModelView | None],
                 page: int, max_len: int) -> None:
        self.managers = tuple(managers)
        self.views = tuple(views)  # per manager: what its real layers read (None: all)
        # per manager: 1 full/MLA (nothing skipped), 2 sliding, 3 chunked, 0 another kind
        # (asked: `skipped_blocks`), for `_skipped`
        self.codes = [_CODES.get(type(m).__name__, 0) for m in self.managers]
        self.page = page
        self.width = 6 + len(self.managers)
        width = self.width
        # Term kinds: (mod, vector over the figures); ceil kinds first, one per block size.
        self.mods: list[int] = []
        self.vecs: list[list[int]] = []
        ceil_of: dict[int, int] = {}
        for mi, m in enumerate(self.managers):
            b, g, tb = m.block_size, m.groups, m.token_bytes
            if b >= max_len:  # (one block for every length: Mamba's; a constant)
                continue
            k = ceil_of.get(b)
            if k is None:
                k = ceil_of[b] = len(self.mods)
                self.mods.append(b)
                self.vecs.append([0] * width)
            v = self.vecs[k]
            v[0] += g
            v[2] += b * tb
            v[3] += g * page - b * tb
            v[4] += g * page - b * tb
            v[6 + mi] += 1
        self.n_ceil = len(self.mods)
        #: per sliding manager: (its term kind, window, manager index)
        self.sliding: list[tuple[int, int, int]] = []
        for mi, m in enumerate(self.managers):
            if m.kind == "sliding_window":
                b, g, tb = m.block_size, m.groups, m.token_bytes
                v = [0] * width
                v[0] -= g
                v[3] -= g * page
                v[4] -= g * page - b * tb
                v[5] -= b * tb
                v[6 + mi] -= 1
                self.sliding.append((len(self.mods), m.window, mi))
                self.mods.append(b)
                self.vecs.append(v)
        self.windowed = tuple(m for m in self.managers if m.frees)
        self.chunked = tuple(m for m in self.managers if m.kind == "chunked_local")
        # Their indices: the look-ahead reads their flat figures (`_skipped`, codes 2 and 3),
        # it does not call them
        self.windowed_ix = [i for i, m in enumerate(self.managers) if m.frees]
        self.chunked_ix = [i for i, m in enumerate(self.managers) if m.kind == "chunked_local"]
        if any(self.codes[i] not in (2, 3) for i in self.windowed_ix):
            raise ValueError("the cohort knows how sliding and chunked managers free, no other")
        self.lag = 0  # async scheduling: a decoder's last token in flight (`set_lag`)
        self._events_at()
        #: block sizes whose reserved slots stop at the final length's block
        self.reserving = tuple(sorted({m.block_size for m in self.managers if m.token_bytes}))
        self.blocks_vec = [v[0] for v in self.vecs]
        # Per manager, what `parts_of` reads for every request it counts (kept flat: an
        # attribute read per manager per figure cost about as much as the arithmetic)
        self.m_bs = [m.block_size for m in self.managers]
        self.m_groups = [m.groups for m in self.managers]
        self.m_tb = [m.token_bytes for m in self.managers]
        self.m_state = [m.state_bytes for m in self.managers]
        self.m_window = [m.window for m in self.managers]
        self.m_pad = [m.groups * page - m.block_size * m.token_bytes for m in self.managers]
        self.clear()

    def _events_at(self) -> None:
        """Event lengths: window edges and chunk starts, of managers and promoted layers (a
        manager's frees start `lag` tokens later than what its layers read)."""
        lag = self.lag
        windows = {m.window for m in self.managers if m.kind == "sliding_window"}
        windows.update(m.window + lag for m in self.managers if m.kind == "sliding_window")
        starts = {(m.window, 1) for m in self.chunked}
        starts.update((m.window, 1 + lag) for m in self.chunked)
        for view in self.views:
            if view is not None:
                windows.update(w for w, _ in view.sliding)
                starts.update((c, 1) for c, _ in view.chunked)
        self.windows = tuple(sorted(windows))
        self.chunk_starts = tuple(sorted(starts))

    def set_lag(self, lag: int) -> None:
        """Async scheduling (lag 1): decoders free by L - 1 - lag processed (see the module).
        Before any decoder joins."""
        assert not self.recs
        self.lag = lag
        self._slopes.clear()
        self.slopes.clear()
        self.slope_n.clear()
        self.slope_counted.clear()
        self._events_at()

    # ------------------------------------------------------------------ one request
    def _skipped(self, i: int, processed: int) -> int:
        """Manager i's `skipped_blocks(processed)` (its formula, without the call)."""
        code = self.codes[i]
        if code == 1:
            return 0
        if code == 2:
            over = processed - self.m_window[i] + 1
            return over // self.m_bs[i] if over > 0 else 0
        if code == 3:
            w = self.m_window[i]
            return processed // w * w // self.m_bs[i]
        return self.managers[i].skipped_blocks(processed)

    def _chunk_free(self, i: int, tokens: int, final: int) -> int:
        """The first length past `tokens` (up to `final`) whose step frees blocks of chunked
        manager i (`ChunkedLocalManager.next_free`, as a length; 0: none)."""
        c = self.m_window[i]
        base = self._skipped(i, tokens - 1)
        length = tokens + 1 + (1 - tokens - 1) % c  # the next chunk start: L - 1 = k C
        while length <= final:
            if self._skipped(i, length - 1) > base:
                return length
            length += c
        return 0

    def _last_chunk_free(self, i: int, tokens: int, final: int) -> int:
        """The last length up to `final` whose step frees chunked manager i's blocks (0:
        none)."""
        c = self.m_window[i]
        length = (final - 1) // c * c + 1
        while length > tokens and length > c:
            if self._skipped(i, length - 1) > self._skipped(i, length - 2):
                return length
            length -= c
        return 0

    def _frees_between(self, managers: list[int], after: int, before: int) -> bool:
        """Whether one of these managers (indices) skips more blocks with `after` tokens
        processed than with `before`."""
        return any(self._skipped(i, after) > self._skipped(i, before) for i in managers)

    def _shift(self, processed: int, other: int) -> list[int]:
        """`parts_of(L, processed, F)` less `parts_of(L, other, F)`, for any L and F: only
        the skipped blocks differ (held blocks, their padding, the out-of-window tokens in
        them, and internal with the blocks), so no model view is read."""
        out = [0] * self.width
        blocks = padding = unread = 0
        bss, tbs, groups, pads = self.m_bs, self.m_tb, self.m_groups, self.m_pad
        for i in range(len(bss)):
            d = self._skipped(i, processed) - self._skipped(i, other)  # blocks skipped more
            if d:
                out[6 + i] = -d
                blocks -= groups[i] * d
                padding -= d * pads[i]
                unread -= d * bss[i] * tbs[i]
        out[0] = blocks
        out[3] = blocks * self.page
        out[4] = padding
        out[5] = unread
        return out

    def blocks_of(self, tokens: int, processed: int) -> int:
        """Block ids a request holds with `tokens` slots, freed by `processed` computed."""
        total = 0
        bss, groups = self.m_bs, self.m_groups
        for i in range(len(bss)):
            total += groups[i] * (-(-tokens // bss[i]) - self._skipped(i, processed))
        return total

    def parts_of(self, tokens: int, processed: int, final: int) -> tuple[int, ...]:
        """(blocks, token_states, reserved, internal, padding, out_of_window, then each
        manager's held blocks per group) of one request: internal = padding + out_of_window +
        rounding (slots past F)."""
        blocks = token_states = reserved = padding = out = 0
        n = len(self.m_bs)
        per_manager = [0] * n
        bss, tbs, groups, states = self.m_bs, self.m_tb, self.m_groups, self.m_state
        pads, views = self.m_pad, self.views
        for i in range(n):
            bs, tb = bss[i], tbs[i]
            ceil = -(-tokens // bs)
            skipped = self._skipped(i, processed)
            held = ceil - skipped  # (`m.held`)
            per_manager[i] = held
            blocks += groups[i] * held
            # tokens its layers read: all, less those out of their window (`needed` for the
            # manager's own kind; promoted layers by their real kind)
            view = views[i]
            unread = 0 if view is None else view.out_of_window(tokens)
            token_states += tokens * tb - unread + states[i]
            if tb and final > tokens:  # slots it will still write: up to F in held blocks
                slots = ceil * bs
                reserved += ((final if final < slots else slots) - tokens) * tb
            padding += held * pads[i] - states[i]
            out += unread - skipped * bs * tb
        internal = blocks * self.page - token_states - reserved
        return (blocks, token_states, reserved, internal, padding, out, *per_manager)

    def clear(self) -> None:
        width = self.width
        self.fixed = [0] * width  # over the requests outside the cohort (`add_fixed`)
        self._changes = 0  # every change of the sums: `figures` keeps its last answer
        self._memo: list[int] = []
        self._memo_clock = -1  # (two ints, not a tuple: the check runs several times an event)
        self._memo_changes = -1
        self._blocks_memo = 0  # `blocks_now`'s last answer, at this clock and change
        self._blocks_clock = -1
        self._blocks_changes = -1
        self._terms = 0  # every change of the terms (`_add`): `steps_until_full` keeps its sum
        self._taken = 0
        self._taken_clock = self._taken_done = self._taken_terms = -1
        # windows passed -> the index of a decoder's slope then in `slopes` (`_build`)
        self._slopes: dict[int, int] = {}
        self.slopes: list[list[int]] = []
        self.slope_n: list[int] = []  # per slope, the decoders with it
        self.slope_counted: list[int] = []  # per slope, those `S` counts
        self.zeros = [0] * width  # (the slope of a phase of one length)
        self.recs: dict[int, _Rec] = {}
        self.A = [0] * width  # sum of a
        self.S = [0] * width  # sum of s: `slope_sum`, kept while `_S_ok`
        self._S_ok = True
        self.sums = [FloorSum(mod) for mod in self.mods]
        # per term kind: residue of x -> the decoders with that residue (each decoder has at
        # most one term of a kind: the set's size is the count a step at that residue moves)
        self.members: list[dict[int, set[int]]] = [{} for _ in self.mods]
        self.events: list[tuple[int, int]] = []  # (clock, rid), lazily pruned
        self.nf_heap: list[tuple[int, int]] = []  # (clock, rid)
        self.last_heap: list[tuple[int, int]] = []  # (-clock, rid)
        # decoders that joined at `fresh_clock` -> (processed, parts now less their form's)
        self.fresh: dict[int, tuple[int, list[int]]] = {}
        self.fresh_corr = [0] * width
        self.fresh_clock = -1
        self.prev_fresh: dict[int, int] = {}  # decoders that joined at clock - 1 -> processed
        # async: decoders that joined at `fresh_clock` -> (processed at their first step, its
        # parts less their form's then); those that joined at `first_clock` - 1, at it now
        self.first_next: dict[int, tuple[int, list[int]]] = {}
        self.first_next_corr = [0] * width
        self.first_now: dict[int, tuple[int, list[int]]] = {}
        self.first_now_corr = [0] * width
        self.first_clock = -1
        self.prev_first: dict[int, int] = {}  # those at their first step at clock - 1
        # every decoder that joined at `fresh_clock` (those in `fresh` and those that joined
        # with their form's tokens processed: a decoder that left since its step and joined
        # again has not stepped into this clock)
        self.arrived: set[int] = set()
        self.switched_clock = -1  # clock at which `switched` decoders reached their window
        self.switched: list[set[int]] = [set() for _ in self.mods]  # per sliding term kind
        # decoders still in the cohort whose step into `freed_clock` freed a chunked block
        self.freed_clock = -1
        self.chunk_freed: set[int] = set()

    # ------------------------------------------------------------------ one decoder
    def _term_value(self, terms: list[tuple[int, int]], k: int) -> list[int]:
        """Sum over these terms of v x floor((x + k) / mod)."""
        out = [0] * self.width
        mods, vecs = self.mods, self.vecs
        for kind, x in terms:
            q = (x + k) // mods[kind]
            if q:
                v = vecs[kind]
                for i in range(self.width):
                    out[i] = out[i] + v[i] * q
        return out

    def _build(self, rid: int, c: int, final: int, clock: int,
               now: tuple[int, ...] | None = None) -> tuple[_Rec, tuple[int, ...]]:
        """A decoder's form from clock `clock` (L = c + clock tokens, L - 1 - lag processed),
        and its parts then (`now`: those parts where the caller has them)."""
        tokens = c + clock
        lag = self.lag
        mods = self.mods
        terms = [(k, c + mods[k] - 1) for k in range(self.n_ceil)]
        for k, w, _ in self.sliding:
            if tokens - lag >= w:
                terms.append((k, c - w - lag))
        nxt, light = self._next_event(tokens, final)
        width = self.width
        if now is None:
            now = self.parts_of(tokens, max(0, tokens - 1 - lag), final)
        tv = self._term_value(terms, clock)
        # The slope depends only on the windows passed (out-of-window tokens grow by their
        # layers' bytes per token; every other figure moves by terms or stays): measured once,
        # and the running sums count decoders per slope (`slope_sum`), not add them.
        passed = 0
        for w in self.windows:
            if w <= tokens:
                passed += 1
        sid = self._slopes.get(passed, -1)
        if sid >= 0:
            s = self.slopes[sid]
        elif nxt > tokens + 1 and tokens < final:
            after = self.parts_of(tokens + 1, tokens - lag, final)
            tv1 = self._term_value(terms, clock + 1)
            s = [after[i] - now[i] - tv1[i] + tv[i] for i in range(width)]
            sid = self._slopes[passed] = len(self.slopes)
            self.slopes.append(s)
            self.slope_n.append(0)
            self.slope_counted.append(0)
        else:  # (a phase of one length: any slope, the constant makes it exact, and
            s = self.zeros  # the next event rebuilds it)
            light = False
        rec = _Rec(c, final, terms, [now[i] - s[i] * clock - tv[i] for i in range(width)], s,
                   sid)
        rec.light = light
        rec.event = NEVER if nxt == NEVER else nxt - c
        # frees no term counts: an in-window sliding decoder's first, a chunked one's next
        # (lag: a step to L frees as a synchronous one to L - lag: lengths shifted by lag)
        nf = NEVER
        last = 0
        at, end = max(1, tokens - lag), final - lag
        for i in self.windowed_ix:
            w, bs = self.m_window[i], self.m_bs[i]
            if self.codes[i] == 2:  # sliding (`SlidingWindowManager.next_free`, as a length)
                if at < w:
                    # skipped(L - 1) = (L - W) // bs for L >= W: up by one at L = W + k bs
                    length = max(w + bs, at + 1 + (w - at - 1) % bs)
                    if length <= end and tokens + length - at < nf:
                        nf = tokens + length - at
                k_last = (end - w) // bs
                if k_last >= 1 and w + k_last * bs + lag > last:
                    last = w + k_last * bs + lag
            else:  # chunked
                length = self._chunk_free(i, at, end)
                if length:
                    if tokens + length - at < nf:
                        nf = tokens + length - at
                    got = self._last_chunk_free(i, at, end)
                    if got and got + lag > last:
                        last = got + lag
        rec.nf = NEVER if nf == NEVER else nf - c
        rec.last = last - c if last > tokens else -1
        return rec, now

    def _next_event(self, tokens: int, final: int) -> tuple[int, bool]:
        """The first length past `tokens` (up to `final`) where a decoder's form changes: a
        window edge, a chunk start, its final length's block (NEVER: none); and whether only
        the last (its reserved slots then stop at the final length: a new constant)."""
        nxt = NEVER
        for w in self.windows:
            if w > tokens:
                nxt = w
                break
        for ch, r in self.chunk_starts:
            x = tokens + 1 + (r - tokens - 1) % ch
            if x < nxt:
                nxt = x
        light = False
        for b in self.reserving:
            x = final // b * b + 1
            if tokens < x <= nxt and final % b:
                light = x < nxt or light
                nxt = x
        if nxt > final:
            return NEVER, False
        return nxt, light

    def _final_block(self, rid: int, rec: _Rec, clock: int) -> None:
        """A decoder enters its final length's block (an event `_next_event` calls light):
        its reserved slots, tb x (bs x ceil(L / bs) - L) before, are tb x (F - L) from now."""
        d = self._final_shift(rec)
        rec.a[2] = rec.a[2] + d
        rec.a[3] = rec.a[3] - d
        self.A[2] = self.A[2] + d
        self.A[3] = self.A[3] - d
        self._changes += 1
        nxt, rec.light = self._next_event(rec.c + rec.event, rec.final)
        rec.event = NEVER if nxt == NEVER else nxt - rec.c
        if rec.event != NEVER:
            heapq.heappush(self.events, (rec.event, rid))

    def _final_shift(self, rec: _Rec) -> int:
        """What a decoder's reserved slots gain (its internal bytes lose) at its light
        event, entering its final length's block."""
        length = rec.c + rec.event
        final = rec.final
        d = 0
        bss, tbs = self.m_bs, self.m_tb
        for i in range(len(bss)):
            b, tb = bss[i], tbs[i]
            if tb and final % b and final // b * b + 1 == length:
                d += tb * (final - b * (final // b + 1))
        return d

    def _after_light(self, rec: _Rec) -> _Rec:
        """The decoder's form from its light event on (`_final_block` on a copy): only two
        constants and the next event move, so it is not built afresh."""
        d = self._final_shift(rec)
        a = list(rec.a)
        a[2] = a[2] + d
        a[3] = a[3] - d
        new = _Rec(rec.c, rec.final, rec.terms, a, rec.s, rec.sid)
        new.nf, new.last = rec.nf, rec.last
        nxt, new.light = self._next_event(rec.c + rec.event, rec.final)
        new.event = NEVER if nxt == NEVER else nxt - rec.c
        return new

    def _add(self, rid: int, rec: _Rec, sign: int) -> None:
        self._changes += 1
        self._terms += 1
        A, a = self.A, rec.a
        if sign > 0:
            for i in range(self.width):
                A[i] = A[i] + a[i]
        else:
            for i in range(self.width):
                A[i] = A[i] - a[i]
        if rec.sid >= 0:
            self.slope_n[rec.sid] += sign
            self._S_ok = False
        sums, mods, members = self.sums, self.mods, self.members
        for kind, x in rec.terms:
            sums[kind].add(x, sign)
            r = x % mods[kind]
            group = members[kind].get(r)
            if sign > 0:
                if group is None:
                    members[kind][r] = {rid}
                else:
                    group.add(rid)
            else:
                assert group is not None
                group.discard(rid)
                if not group:
                    del members[kind][r]

    def slope_sum(self) -> list[int]:
        """The sum of the decoders' slopes: per slope, the change in its decoders' count
        since the last sum, times it (a decoder joining and another leaving with the same
        slope move nothing)."""
        if not self._S_ok:
            S, counted, now = self.S, self.slope_counted, self.slope_n
            for sid in range(len(now)):
                d = now[sid] - counted[sid]
                if d:
                    s = self.slopes[sid]
                    for i in range(self.width):
                        S[i] = S[i] + d * s[i]
                    counted[sid] = now[sid]
            self._S_ok = True
        return self.S

    def _enter(self, rid: int, rec: _Rec) -> None:
        self.recs[rid] = rec
        self._add(rid, rec, 1)
        if rec.event != NEVER:
            if len(self.events) > 2 * len(self.recs) + 64:  # mostly stale: keep the live ones
                self.events = [(r.event, i) for i, r in self.recs.items() if r.event != NEVER]
                heapq.heapify(self.events)
            else:
                heapq.heappush(self.events, (rec.event, rid))
        if rec.nf != NEVER:
            heapq.heappush(self.nf_heap, (rec.nf, rid))
        if rec.last >= 0:
            heapq.heappush(self.last_heap, (-rec.last, rid))

    def _rotate(self, clock: int) -> None:
        """Forget the prefill corrections of an earlier clock (keeping the last clock's
        decoders, whose first step `steps_until_shrink` looks at)."""
        if self.fresh_clock != clock:
            # (the dicts and corrections are made anew only where they hold something: an
            # empty one's corrections are zeros, as decoders leaving take theirs out)
            self._changes += 1
            follows = self.fresh_clock == clock - 1
            if follows and self.fresh:
                self.prev_fresh = {rid: p for rid, (p, _) in self.fresh.items()}
            elif self.prev_fresh:
                self.prev_fresh = {}
            if self.fresh:
                self.fresh = {}
                self.fresh_corr = [0] * self.width
            if self.lag:
                if self.first_clock == clock - 1 and self.first_now:
                    self.prev_first = {rid: p for rid, (p, _) in self.first_now.items()}
                elif self.prev_first:
                    self.prev_first = {}
                if follows and self.first_next:
                    self.first_now = self.first_next
                    self.first_now_corr = self.first_next_corr
                    self.first_next = {}
                    self.first_next_corr = [0] * self.width
                else:
                    if self.first_now:
                        self.first_now = {}
                        self.first_now_corr = [0] * self.width
                    if self.first_next:
                        self.first_next = {}
                        self.first_next_corr = [0] * self.width
                self.first_clock = clock
            if self.arrived:
                self.arrived = set()
            self.fresh_clock = clock

    def join(self, rid: int, c: int, final: int, processed: int, clock: int,
             held: tuple[int, ...], first: int = -1) -> None:
        """A decoder joins at `clock` holding what its prefill left (`processed` computed;
        `held`: its parts then, `parts_of(c + clock, processed, final)`, as the coordinator
        counted them outside the cohort). `first` (lag): processed at its first step."""
        self._rotate(clock)
        tokens = c + clock
        lag = self.lag
        formed = tokens - 1 - lag
        if not self.windowed:  # (no group frees while a request runs: processed moves nothing)
            processed, first = formed, tokens - lag
        # Its parts by its form: what it holds less the blocks that its form's processed
        # tokens skip beyond its own (`_shift`: no parts counted afresh)
        diff: list[int] = []
        if processed == formed:
            now = held
        else:
            diff = self._shift(processed, max(0, formed))
            now = tuple([held[i] - diff[i] for i in range(self.width)])
        rec = self._build(rid, c, final, clock, now)[0]
        self._enter(rid, rec)
        self.arrived.add(rid)
        if lag and first != tokens - lag and tokens < final:
            diff1 = self._shift(first, tokens - lag)  # (its first step's parts less its form's)
            if any(diff1):
                self.first_next[rid] = (first, diff1)
                self._changes += 1
                corr = self.first_next_corr
                for i in range(self.width):
                    corr[i] = corr[i] + diff1[i]
        if processed != formed:
            self.fresh[rid] = (processed, diff)
            self._changes += 1
            corr = self.fresh_corr
            for i in range(self.width):
                corr[i] = corr[i] + diff[i]

    def leave(self, rid: int, clock: int) -> None:
        self._rotate(clock)
        rec = self.recs.pop(rid)
        self._add(rid, rec, -1)
        if self.fresh:
            self._drop(self.fresh, self.fresh_corr, rid)
        if self.prev_fresh:
            self.prev_fresh.pop(rid, None)
        if self.prev_first:
            self.prev_first.pop(rid, None)
        # (what its step into this clock freed no longer counts as just freed: it left)
        if self.arrived:
            self.arrived.discard(rid)
        if self.switched_clock == clock:
            for group in self.switched:
                group.discard(rid)
        if self.freed_clock == clock:
            self.chunk_freed.discard(rid)
        if self.first_next:
            self._drop(self.first_next, self.first_next_corr, rid)
        if self.first_now:
            self._drop(self.first_now, self.first_now_corr, rid)

    def _drop(self, pending: dict[int, tuple[int, list[int]]], corr: list[int],
              rid: int) -> None:
        """Take a decoder's correction out of a pending one's, if it has one."""
        got = pending.pop(rid, None)
        if got is not None:
            self._changes += 1
            diff = got[1]
            for i in range(self.width):
                corr[i] = corr[i] - diff[i]

    def stepped(self, clock: int) -> None:
        """The clock is `clock`: rebuild the decoders whose event it has reached."""
        self._rotate(clock)
        recs = self.recs
        while self.events and self.events[0][0] <= clock:  # (`_enter` may rebuild the heap)
            key, rid = heapq.heappop(self.events)
            rec = recs.get(rid)
            if rec is None or rec.event != key:
                continue
            if rec.light:
                self._final_block(rid, rec, clock)
                continue
            self._add(rid, rec, -1)
            new = self._build(rid, rec.c, rec.final, clock)[0]
            self._enter(rid, new)
            tokens = rec.c + clock
            if key == clock:
                for k, w, _ in self.sliding:
                    if tokens - self.lag == w:  # (its skipped blocks' term starts at 0 now)
                        if self.switched_clock != clock:
                            self.switched_clock = clock
                            self.switched = [set() for _ in self.mods]
                        self.switched[k].add(rid)
                p = tokens - 1 - self.lag
                if self._frees_between(self.chunked_ix, p, p - 1):
                    if self.freed_clock != clock:
                        self.freed_clock = clock
                        self.chunk_freed = set()
                    self.chunk_freed.add(rid)

    # ------------------------------------------------------------------ figures
    def add_fixed(self, parts: tuple[int, ...], sign: int) -> None:
        """A request outside the cohort holds `parts` (sign 1) or no longer (-1)."""
        f = self.fixed
        keep = self._memo_changes == self._changes  # (the figures just before: kept valid)
        memo = self._memo
        if sign > 0:
            for i in range(self.width):
                f[i] = f[i] + parts[i]
            if keep:
                for i in range(self.width):
                    memo[i] = memo[i] + parts[i]
        else:
            for i in range(self.width):
                f[i] = f[i] - parts[i]
            if keep:
                for i in range(self.width):
                    memo[i] = memo[i] - parts[i]
        if self._blocks_changes == self._changes:
            self._blocks_memo += sign * parts[0]
            self._blocks_changes += 1
        self._changes += 1
        if keep:
            self._memo_changes = self._changes

    def figures(self, clock: int) -> list[int]:
        """Every live request's figures at `clock`: the cohort's and the others'."""
        if self._memo_clock == clock and self._memo_changes == self._changes:
            return self._memo
        out = self.totals(clock)
        f = self.fixed
        for i in range(self.width):
            out[i] = out[i] + f[i]
        self._memo = out
        self._memo_clock = clock
        self._memo_changes = self._changes
        return out

    def blocks_now(self, clock: int) -> int:
        """Block ids every live request holds at `clock` (asked several times an event, and
        between changes that void the figures: counted alone, not with them)."""
        if self._memo_clock == clock and self._memo_changes == self._changes:
            return self._memo[0]
        if self._blocks_clock != clock or self._blocks_changes != self._changes:
            self._blocks_memo = self.blocks(clock) + self.fixed[0]
            self._blocks_clock = clock
            self._blocks_changes = self._changes
        return self._blocks_memo

    def totals(self, clock: int) -> list[int]:
        """The cohort's figures at `clock`."""
        S = self.slope_sum()
        out = [self.A[i] + S[i] * clock for i in range(self.width)]
        vecs = self.vecs
        for k, fs in enumerate(self.sums):
            if fs.nonzero or fs.q:
                val = fs.value(clock)
                if val:
                    v = vecs[k]
                    for i in range(self.width):
                        out[i] = out[i] + v[i] * val
        if self.fresh_clock == clock and self.fresh:
            corr = self.fresh_corr
            for i in range(self.width):
                out[i] = out[i] + corr[i]
        if self.first_clock == clock and self.first_now:
            corr = self.first_now_corr
            for i in range(self.width):
                out[i] = out[i] + corr[i]
        return out

    def blocks(self, clock: int) -> int:
        total = self.A[0] + self.slope_sum()[0] * clock
        for k, fs in enumerate(self.sums):
            b = self.blocks_vec[k]
            if b and (fs.nonzero or fs.q):
                total += b * fs.value(clock)
        if self.fresh_clock == clock and self.fresh:
            total += self.fresh_corr[0]
        if self.first_clock == clock and self.first_now:
            total += self.first_now_corr[0]
        return total

    def _rec_blocks(self, rec: _Rec, clock: int) -> int:
        """Blocks by the record's form at `clock` (what the running sums count for it)."""
        total = rec.a[0] + rec.s[0] * clock
        for kind, x in rec.terms:
            total += self.blocks_vec[kind] * ((x + clock) // self.mods[kind])
        return total

    def _ending_by(self, clock: int) -> list[int]:
        """Decoders with an event at or before `clock` (their forms change by then)."""
        out: dict[int, None] = {}
        heap, recs = self.events, self.recs
        while heap:  # (entries of decoders gone or rebuilt since: dropped from the top)
            key, rid = heap[0]
            found = recs.get(rid)
            if found is not None and found.event == key:
                break
            heapq.heappop(heap)
        todo = [0] if heap and heap[0][0] <= clock else []
        while todo:
            i = todo.pop()
            key, rid = heap[i]
            rec = recs.get(rid)
            if rec is not None and rec.event == key:
                out[rid] = None
            j = 2 * i + 1  # (its two children, written out: a loop over a tuple is generic)
            if j < len(heap) and heap[j][0] <= clock:
                todo.append(j)
            if j + 1 < len(heap) and heap[j + 1][0] <= clock:
                todo.append(j + 1)
        return list(out)

    def integrals(self, clock: int, n: int, w0: float, w1: float) -> list[float]:
        """sum over j = 1..n of (w0 + w1 (j - 1)) x the first six figures at clock + j."""
        weight = n * w0 + w1 * n * (n - 1) / 2
        jw = w0 * n * (n + 1) / 2 + w1 * (n - 1) * n * (n + 1) / 3  # sum_j j * w_j
        kw = clock * weight + jw  # sum_j (clock + j) * w_j
        S = self.slope_sum()
        sums = [self.A[i] * weight + S[i] * kw for i in range(6)]
        for k, fs in enumerate(self.sums):
            if fs.nonzero or fs.q:
                val = fs.integrate(clock, n, w0, w1, weight)
                v = self.vecs[k]
                for i in range(6):
                    sums[i] = sums[i] + v[i] * val
        for rid in self._ending_by(clock + n):
            self._walk_events(rid, clock, n, w0, w1, sums)
        if n and self.fresh_clock == clock and self.first_next:  # (their first step: j = 1)
            corr = self.first_next_corr
            for i in range(6):
                sums[i] = sums[i] + w0 * corr[i]
        return sums

    def _walk_events(self, rid: int, clock: int, n: int, w0: float, w1: float,
                     sums: list[float]) -> None:
        """Add to `sums` what a decoder's events within the stretch change: from each event
        on, its new form less the one the running sums count."""
        old = self.recs[rid]
        cur = old
        end = clock + n
        while cur.event <= end:
            start = cur.event
            new = (self._after_light(cur) if cur.light
                   else self._build(rid, old.c, old.final, start)[0])
            stop = min(new.event - 1, end)
            _piece(self, new, 1, clock, start, stop, w0, w1, sums)
            _piece(self, old, -1, clock, start, stop, w0, w1, sums)
            cur = new

    # ------------------------------------------------------------------ look-ahead
    def _hit(self, kind: int, clock: int) -> int:
        """Decoders whose term of this kind moves at the step into `clock`."""
        group = self.members[kind].get(-clock % self.mods[kind])
        return 0 if group is None else len(group)

    def steps_until_full(self, clock: int, done: int, free: int,
                         order: Callable[[int], int]) -> int:
        """Steps (at most `done`) the cohort can take before some decoder, in running order
        (`order`: its rank), finds too few of the `free` blocks (free now)."""
        n_ceil, sums, bv = self.n_ceil, self.sums, self.blocks_vec
        lag = self.lag
        # blocks the ceil terms take over the whole stretch: frees only lower it (async: and
        # what the first steps' corrections may add, `first_*`)
        taken = 0
        first_next = self.first_next if lag and self.fresh_clock == clock else {}
        first_now = self.first_now if lag and self.first_clock == clock else {}
        if lag:
            if self.fresh_clock == clock:
                taken += max(0, -self.fresh_corr[0]) + max(0, self.first_next_corr[0])
            if first_now:
                taken += max(0, -self.first_now_corr[0])
        # (the ceil terms' part is asked again as the free pool changes with the cohort as it
        # is: kept while the terms, clock and stretch stay)
        if (self._taken_clock != clock or self._taken_done != done
                or self._taken_terms != self._terms):
            ceil = 0
            for k in range(n_ceil):
                if bv[k]:
                    ceil += bv[k] * (sums[k].value(clock + done) - sums[k].value(clock))
            self._taken = ceil
            self._taken_clock, self._taken_done, self._taken_terms = clock, done, self._terms
        taken += self._taken
        if taken <= free:
            return done
        now = self.blocks_now(clock) - self.fixed[0]  # (`blocks`, as the caller just asked)
        limit = now + free
        # Decoders whose forms change by the step walked (their events up to `horizon`,
        # looked up a stretch at a time: the walk often stops at its first steps)
        slope = self.slope_sum()[0]
        horizon = min(done, 32)
        special = self._moving(self._ending_by(clock + horizon), clock + done)
        recs = self.recs
        cur = now
        for t in range(1, done + 1):
            k1 = clock + t
            if t > horizon:
                horizon = done
                special = self._moving(self._ending_by(clock + horizon), clock + done)
            up = 0
            for k in range(n_ceil):
                if bv[k]:
                    up += bv[k] * self._hit(k, k1)
            if t % 32 == 0:  # far from full: what the ceil terms take from here on fits
                rest = 0
                for k in range(n_ceil):
                    if bv[k]:
                        rest += bv[k] * (sums[k].value(clock + done) - sums[k].value(k1 - 1))
                if cur + rest <= limit:
                    return done
            delta = up + slope
            for k in range(n_ceil, len(self.mods)):
                delta += bv[k] * self._hit(k, k1)
            for rid in special:  # (their forms change within the stretch)
                rec = recs[rid]
                if rec.event <= k1:
                    tokens = rec.c + k1
                    p = max(0, tokens - 1 - lag)
                    delta += (self.blocks_of(tokens, p) - self._rec_blocks(rec, k1)
                              - self.blocks_of(tokens - 1, max(0, p - 1))
                              + self._rec_blocks(rec, k1 - 1))
            if t == 1 and self.fresh_clock == clock and self.fresh:
                delta -= self.fresh_corr[0]
            if t == 1 and first_now:
                delta -= self.first_now_corr[0]
            if first_next and t <= 2:
                delta += self.first_next_corr[0] * (1 if t == 1 else -1)
            if cur + up <= limit:
                cur += delta
                continue
            if delta == up:  # nothing freed at this step: its order cannot matter
                return t - 1
            # Blocks taken before others are freed could overrun: vLLM's order decides.
            cands: set[int] = set(special)
            for k in range(len(self.mods)):
                group = self.members[k].get(-k1 % self.mods[k])
                if group:
                    cands.update(group)
            if t == 1 and self.fresh_clock == clock:
                cands.update(self.fresh)
                cands.update(first_now)
            if t <= 2:
                cands.update(first_next)
            walked = cur
            for rid in sorted(cands, key=order):
                rec = recs[rid]
                tokens = rec.c + k1
                change = (self._exact(rid, rec, tokens, k1)
                          - self._exact(rid, rec, tokens - 1, k1 - 1))
                if change:
                    walked += change
                    if walked > limit:
                        return t - 1
            cur += delta
            assert walked == cur, (walked, cur)
        return done

    def _moving(self, rids: list[int], end: int) -> list[int]:
        """Those of these decoders whose blocks leave their forms by `end`: a light event
        (`_final_block`) moves reserved slots only, so only an event after it counts."""
        out: list[int] = []
        recs = self.recs
        for rid in rids:
            rec = recs[rid]
            if rec.light:
                nxt = self._next_event(rec.c + rec.event, rec.final)[0]
                if nxt == NEVER or nxt - rec.c > end:
                    continue
            out.append(rid)
        return out

    def _exact(self, rid: int, rec: _Rec, tokens: int, clock: int) -> int:
        """A decoder's blocks at `clock`, from its managers (its prefill's at its join)."""
        if clock == self.fresh_clock:
            got = self.fresh.get(rid)
            if got is not None:
                return self.blocks_of(tokens, got[0])
        if self.lag:
            got = None
            if clock == self.fresh_clock + 1:
                got = self.first_next.get(rid)
            elif clock == self.first_clock:
                got = self.first_now.get(rid)
            if got is not None:
                return self.blocks_of(tokens, got[0])
        return self.blocks_of(tokens, max(0, tokens - 1 - self.lag))

    def steps_until_shrink(self, clock: int, done: int | None) -> int | None:
        """See the module: exact up to `done`, a lower bound past it, None if no decoder
        frees again before its end."""
        if not self.windowed or not self.recs:
            return None
        wix = self.windowed_ix
        # The step just taken freed a block (the engine asks whether memory came back).
        if self.freed_clock == clock and self.chunk_freed:
            return 1
        fresh = self.fresh if self.fresh_clock == clock else {}
        lag = self.lag
        # async: the decoders at their first step and those that joined now (`first_*`)
        first_now = self.first_now if lag and self.first_clock == clock else {}
        first_next = self.first_next if lag and self.fresh_clock == clock else {}
        # (every decoder that joined now: one that left since its step and joined again has
        # not stepped into this clock)
        # (made where a step's frees are counted: most answers need it not)
        unformed: set[int] = set()
        made = False
        second = NEVER
        for k, _, _ in self.sliding:
            hit = self._hit(k, clock)
            if hit and self.switched_clock == clock:
                hit -= len(self.switched[k])
            if hit and not made:
                made = True
                if self.fresh_clock == clock:
                    unformed.update(self.arrived)
                if lag:
                    unformed.update(first_now)
                    unformed.update(first_next)
            if hit:  # (less the decoders that joined now: their step is still to come)
                mod = self.mods[k]
                for rid in unformed:
                    hit -= sum(1 for kind, x in self.recs[rid].terms
                               if kind == k and (x + clock) % mod == 0)
            if hit > 0:
                return 1
        for rid, processed in self.prev_fresh.items():
            rec = self.recs[rid]
            tokens = rec.c + clock
            got = first_now.get(rid)
            p = got[0] if got is not None else tokens - 1 - lag
            if self._frees_between(wix, p, processed):
                return 1
        if lag:
            for rid, p in self.prev_first.items():  # (their second step, just taken)
                tokens = self.recs[rid].c + clock
                if self._frees_between(wix, tokens - 1 - lag, p):
                    return 1
        for rid, (p, _) in first_now.items():  # (their step to come frees by the form)
            tokens = self.recs[rid].c + clock
            before = self.prev_fresh.get(rid, tokens - 2 - lag)
            if self._frees_between(wix, p, before):
                return 1
            if tokens < self.recs[rid].final and self._frees_between(wix, tokens - lag, p):
                return 1
        if fresh or first_next:
            for rid in set(fresh) | set(first_next):
                rec = self.recs[rid]
                tokens = rec.c + clock
                got = fresh.get(rid)
                processed = got[0] if got is not None else tokens - 1 - lag
                ahead = first_next.get(rid)
                p = ahead[0] if ahead is not None else tokens - lag
                if tokens < rec.final and self._frees_between(wix, p, processed):
                    return 1
                if (ahead is not None and tokens + 1 < rec.final
                        and self._frees_between(wix, tokens + 1 - lag, p)):
                    second = 2  # (its second step frees by the form: no term counts it)
        best = second
        for k, _, _ in self.sliding:  # the first step that moves a residue held
            mod, members = self.mods[k], self.members[k]
            if members:
                for t in range(1, min(mod, best - 1) + 1):
                    if (-(clock + t)) % mod in members:
                        best = t
                        break
        heap, recs = self.nf_heap, self.recs
        while heap:
            key, rid = heap[0]
            found = recs.get(rid)
            if found is None or found.nf != key or key <= clock:
                heapq.heappop(heap)
                continue
            best = min(best, key - clock)
            break
        if done is not None and best <= done:
            return best
        heap = self.last_heap
        while heap:
            key, rid = heap[0]
            found = recs.get(rid)
            if found is None or found.last != -key or -key <= clock:
                heapq.heappop(heap)
                continue
            return best if best != NEVER else (done or 0) + 1
        return None


def _piece(co: Cohort, rec: _Rec, sign: int, clock: int, start: int, stop: int,
           w0: float, w1: float, sums: list[float]) -> None:
    """Add sign x sum over clocks k in [start, stop] of w_(k - clock) x the record's form at
    k (w_j = w0 + w1 (j - 1)), to the first six figures."""
    if stop < start:
        return
    m = stop - start + 1
    a0 = w0 + w1 * (start - clock - 1)  # the weight at `start`
    weight = m * a0 + w1 * m * (m - 1) / 2
    kw = start * weight + (a0 * m * (m - 1) / 2 + w1 * (m - 1) * m * (2 * m - 1) / 6)
    for i in range(6):
        sums[i] = sums[i] + sign * (rec.a[i] * weight + rec.s[i] * kw)
    for kind, x in rec.terms:
        fs = FloorSum(co.mods[kind])
        fs.add(x, 1)
        val = fs.integrate(start - 1, m, a0, w1, weight)
        v = co.vecs[kind]
        for i in range(6):
            sums[i] = sums[i] + sign * v[i] * val
