"""A decoder's form in the hybrid allocator's decode cohort (`kvfrag.sim.hybrid.cohort`): its
figures as a closed form of the decode clock K between its events, and its parts at any length.

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
reserved slots stop at it: a *light* event, two constants move and the blocks keep their form).
At an event a decoder's form is rebuilt from its exact parts (`parts_of`), so a and s are the
allocator's own figures, not a second derivation. A request meets a few events in its life,
not one per block. The slope s depends only on the windows passed: measured once per count of
windows passed, and shared (`slopes`).

Async scheduling (lag 1): vLLM frees by the tokens processed, its last token in flight: a
decoder of L tokens has processed L - 1 - lag (the cohort's corrections handle its first step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvfrag.sim.floor_sum import times
from kvfrag.sim.hybrid.managers import Manager
from kvfrag.sim.model_view import ModelView
from mypy_extensions import mypyc_attr

#: No event (a decoder's form holds to its end). Final and below 2**62: compiled, a constant
#: inlined and a native int (1 << 62 was a module lookup and a boxed int at each comparison).
NEVER: Final = (1 << 62) - 1

#: A decoder's heap keys in the cohort: clock << SLOT_BITS | its slot (`Cohort.rid_at`).
SLOT_BITS: Final = 32
SLOT_MASK: Final = (1 << SLOT_BITS) - 1

#: `Figures.rest` of a model with at most three managers (empty: one list for all)
_NO_REST: Final[list[int]] = []

#: Manager classes whose skipped blocks the cohort computes itself (`Forms._skipped`).
_CODES = {"Manager": 1, "SlidingWindowManager": 2, "ChunkedLocalManager": 3}


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class Figures:
    """A running sum of figure vectors (blocks, token_states, reserved, internal, padding,
    out_of_window, then each manager's held blocks): the cohort's constants, its decoders'
    forms, the requests' outside it. Native int attributes, which compiled stay unboxed: a
    list's item is an int object, made anew at every store, and these sums move at every
    decoder joining, leaving or rebuilt, every request admitted or grown. The first three
    managers' figures are attributes too (`h0`-`h2`, zero where the model has fewer), the
    others a list (`rest`); `get(6 + m)` reads manager m's."""

    def __init__(self, width: int) -> None:
        self.n = width - 6  # managers
        self.f0 = 0
        self.f1 = 0
        self.f2 = 0
        self.f3 = 0
        self.f4 = 0
        self.f5 = 0
        self.h0 = 0
        self.h1 = 0
        self.h2 = 0
        self.rest = [0] * (width - 9) if width > 9 else _NO_REST  # (never stored into)

    def get(self, i: int) -> int:
        """Figure i."""
        if i >= 6:
            if i >= 9:
                return self.rest[i - 9]
            return self.h0 if i == 6 else self.h1 if i == 7 else self.h2
        if i < 3:
            return self.f0 if i == 0 else self.f1 if i == 1 else self.f2
        return self.f3 if i == 3 else self.f4 if i == 4 else self.f5

    def add(self, v: Figures, sign: int) -> None:
        """Add (sign 1) or take out (-1) a vector (a decoder's constants). Two branches rather
        than `sign * v[i]`: compiled, the multiplies cost 5 % of a gemma-3-27b event's
        instructions (bench/instructions.py)."""
        rest, vr = self.rest, v.rest
        if sign > 0:
            self.f0 += v.f0
            self.f1 += v.f1
            self.f2 += v.f2
            self.f3 += v.f3
            self.f4 += v.f4
            self.f5 += v.f5
            self.h0 += v.h0
            self.h1 += v.h1
            self.h2 += v.h2
            for i in range(len(rest)):
                rest[i] = rest[i] + vr[i]
        else:
            self.f0 -= v.f0
            self.f1 -= v.f1
            self.f2 -= v.f2
            self.f3 -= v.f3
            self.f4 -= v.f4
            self.f5 -= v.f5
            self.h0 -= v.h0
            self.h1 -= v.h1
            self.h2 -= v.h2
            for i in range(len(rest)):
                rest[i] = rest[i] - vr[i]

    def add_times(self, v: Figures, q: int) -> None:
        """Add q x `v`. Compiled, a product stays native only where both operands are in
        [0, 2**30) (`times`): the signs are taken out here, q's once, not in a call per
        figure (a call each was most of this method's cost)."""
        neg = q < 0
        if neg:
            q = -q
        c = v.f0
        p = c * q if c >= 0 else -(-c * q)
        self.f0 = self.f0 - p if neg else self.f0 + p
        c = v.f1
        p = c * q if c >= 0 else -(-c * q)
        self.f1 = self.f1 - p if neg else self.f1 + p
        c = v.f2
        p = c * q if c >= 0 else -(-c * q)
        self.f2 = self.f2 - p if neg else self.f2 + p
        c = v.f3
        p = c * q if c >= 0 else -(-c * q)
        self.f3 = self.f3 - p if neg else self.f3 + p
        c = v.f4
        p = c * q if c >= 0 else -(-c * q)
        self.f4 = self.f4 - p if neg else self.f4 + p
        c = v.f5
        p = c * q if c >= 0 else -(-c * q)
        self.f5 = self.f5 - p if neg else self.f5 + p
        c = v.h0
        p = c * q if c >= 0 else -(-c * q)
        self.h0 = self.h0 - p if neg else self.h0 + p
        c = v.h1
        p = c * q if c >= 0 else -(-c * q)
        self.h1 = self.h1 - p if neg else self.h1 + p
        c = v.h2
        p = c * q if c >= 0 else -(-c * q)
        self.h2 = self.h2 - p if neg else self.h2 + p
        rest, vr = self.rest, v.rest
        for i in range(len(rest)):
            p = times(vr[i], q)
            rest[i] = rest[i] - p if neg else rest[i] + p

    def add_list(self, v: list[int]) -> None:
        """Add a vector kept as a list (a correction)."""
        self.f0 += v[0]
        self.f1 += v[1]
        self.f2 += v[2]
        self.f3 += v[3]
        self.f4 += v[4]
        self.f5 += v[5]
        m = self.n
        if m:
            self.h0 += v[6]
            if m > 1:
                self.h1 += v[7]
                if m > 2:
                    self.h2 += v[8]
                    rest = self.rest
                    for i in range(len(rest)):
                        rest[i] = rest[i] + v[9 + i]

    def set_held(self, m: int, value: int) -> None:
        """Set manager m's figure."""
        if m == 0:
            self.h0 = value
        elif m == 1:
            self.h1 = value
        elif m == 2:
            self.h2 = value
        else:
            self.rest[m - 3] = value

    def set_to(self, v: Figures) -> None:
        """Become a copy of `v` (a scratch vector reused, not made anew)."""
        self.f0, self.f1, self.f2 = v.f0, v.f1, v.f2
        self.f3, self.f4, self.f5 = v.f3, v.f4, v.f5
        self.h0, self.h1, self.h2 = v.h0, v.h1, v.h2
        rest, vr = self.rest, v.rest
        for i in range(len(rest)):
            rest[i] = vr[i]

    def copy(self) -> Figures:
        out = Figures(6 + self.n)
        out.set_to(self)
        return out

    def as_list(self) -> list[int]:
        """The figures in order, as a list."""
        out = [self.f0, self.f1, self.f2, self.f3, self.f4, self.f5, self.h0, self.h1,
               self.h2][:6 + self.n]
        out.extend(self.rest)
        return out


def figures_of(v: list[int]) -> Figures:
    """A vector kept as a list (a term's, a slope) as `Figures`."""
    out = Figures(len(v))
    out.add_list(v)
    return out


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class Form(Figures):
    """One decoder: its phase, final length, form and terms, and its heap keys. Its
    constants are its own figures (a `Figures`: one object made per form, not two)."""

    def __init__(self, width: int, c: int, final: int, terms: list[tuple[int, int]],
                 s: Figures, sid: int) -> None:
        super().__init__(width)
        self.c = c
        self.final = final
        self.s = s
        self.sid = sid  # its slope's index in `Forms.slopes` (-1: a slope of zeros)
        self.terms = terms  # (term kind, x)
        self.event = NEVER  # clock of its next event
        self.light = False  # whether that event only ends its reserved slots at its final
        self.bev = NEVER  # clock of its next event that moves its blocks (past light ones)
        self.nf = NEVER  # clock of its next free that no term counts (in-window, chunked)
        self.last = -1  # clock of its last free before its final length
        self.slot = -1  # its slot in the cohort (`Cohort.rid_at`): its heap keys' low bits


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class Forms:
    """The model's terms and figures per manager, and a decoder's form and parts from them
    (what `Cohort` sums; see the module)."""

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
        self.vecf = [figures_of(v) for v in self.vecs]  # (`vecs`, unboxed)
        # per term kind, the figures its vector moves (about half: the sums skip the rest)
        self.moved_ix = [[i for i in range(width) if v[i]] for v in self.vecs]
        # Per manager, what `parts_of` reads for every request it counts (kept flat: an
        # attribute read per manager per figure cost about as much as the arithmetic)
        self.m_bs = [m.block_size for m in self.managers]
        self.m_groups = [m.groups for m in self.managers]
        self.m_tb = [m.token_bytes for m in self.managers]
        self.m_state = [m.state_bytes for m in self.managers]
        self.m_window = [m.window for m in self.managers]
        self.m_pad = [m.groups * page - m.block_size * m.token_bytes for m in self.managers]
        # windows passed -> the index of a decoder's slope then in `slopes` (`_build`)
        self._slopes: dict[int, int] = {}
        self.slopes: list[Figures] = []
        self.slope_n: list[int] = []  # per slope, the decoders with it
        self.slope_counted: list[int] = []  # per slope, those `S` counts
        self.zeros = Figures(width)  # (the slope of a phase of one length)

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
                blocks -= times(groups[i], d)  # (`times`: d < 0 is common)
                padding -= times(d, pads[i])
                unread -= times(d, bss[i] * tbs[i])
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

    def parts_of(self, tokens: int, processed: int, final: int) -> Figures:
        """(blocks, token_states, reserved, internal, padding, out_of_window, then each
        manager's held blocks per group) of one request: internal = padding + out_of_window +
        rounding (slots past F)."""
        blocks = token_states = reserved = padding = out = 0
        n = len(self.m_bs)
        got = Figures(6 + n)  # (native figures: a tuple's made each an int object)
        bss, tbs, groups, states = self.m_bs, self.m_tb, self.m_groups, self.m_state
        pads, views = self.m_pad, self.views
        for i in range(n):
            bs, tb = bss[i], tbs[i]
            ceil = -(-tokens // bs)
            skipped = self._skipped(i, processed)
            held = ceil - skipped  # (`m.held`)
            got.set_held(i, held)
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
        got.f0, got.f1, got.f2 = blocks, token_states, reserved
        got.f3 = blocks * self.page - token_states - reserved  # internal
        got.f4, got.f5 = padding, out
        return got

    def _term_value(self, terms: list[tuple[int, int]], k: int) -> list[int]:
        """Sum over these terms of v x floor((x + k) / mod)."""
        out = [0] * self.width
        mods, vecs, moved = self.mods, self.vecs, self.moved_ix
        for kind, x in terms:
            q = (x + k) // mods[kind]
            if q:
                v = vecs[kind]
                for i in moved[kind]:
                    out[i] = out[i] + times(v[i], q)  # (sliding kinds' v < 0)
        return out

    def _build(self, rid: int, c: int, final: int, clock: int,
               now: Figures | None = None) -> tuple[Form, Figures]:
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
            tv = self._term_value(terms, clock)
            tv1 = self._term_value(terms, clock + 1)
            s = figures_of([after.get(i) - now.get(i) - tv1[i] + tv[i] for i in range(width)])
            sid = self._slopes[passed] = len(self.slopes)
            self.slopes.append(s)
            self.slope_n.append(0)
            self.slope_counted.append(0)
        else:  # (a phase of one length: any slope, the constant makes it exact, and
            s = self.zeros  # the next event rebuilds it)
            light = False
        # Its constant: its parts now less the slope's and the terms' values now (native
        # figures: a list's every store makes an int object)
        rec = Form(width, c, final, terms, s, sid)
        rec.set_to(now)
        rec.add_times(s, -clock)
        vecf = self.vecf
        for kind, x in terms:
            q = (x + clock) // mods[kind]
            if q:
                rec.add_times(vecf[kind], -q)
        rec.light = light
        rec.event = NEVER if nxt == NEVER else nxt - c
        while light:  # (light events keep the blocks' form: the next one that moves them)
            nxt, light = self._next_event(nxt, final)
        rec.bev = NEVER if nxt == NEVER else nxt - c
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

    def _final_shift(self, rec: Form) -> int:
        """What a decoder's reserved slots gain (its internal bytes lose) at its light
        event, entering its final length's block."""
        length = rec.c + rec.event
        final = rec.final
        d = 0
        bss, tbs = self.m_bs, self.m_tb
        for i in range(len(bss)):
            b, tb = bss[i], tbs[i]
            if tb and final % b and final // b * b + 1 == length:
                d += times(tb, final - b * (final // b + 1))
        return d

    def _after_light(self, rec: Form) -> Form:
        """The decoder's form from its light event on (`_final_block` on a copy): only two
        constants and the next event move, so it is not built afresh."""
        d = self._final_shift(rec)
        new = Form(self.width, rec.c, rec.final, rec.terms, rec.s, rec.sid)
        new.set_to(rec)
        new.f2 += d
        new.f3 -= d
        new.nf, new.last, new.bev = rec.nf, rec.last, rec.bev
        nxt, new.light = self._next_event(rec.c + rec.event, rec.final)
        new.event = NEVER if nxt == NEVER else nxt - rec.c
        return new
