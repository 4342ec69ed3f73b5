"""Speculative decoding in the fast engine: the running requests' progress as arrays.

Under speculative decoding every decoder takes its own tokens at each step (1 + its drafts,
then 1 + the accepted ones), so the allocator's decode cohort, which advances every decoder one
token a step, does not apply. Walking the running list in Python at every iteration costs
about a microsecond per decoder (compiled); at a heavy load (hundreds decoding) that is the
whole cost of an event. `SpecSteps` keeps each running request's speculative state in numpy
arrays indexed by a slot, so that an iteration in which the decoders go first (no prompt
partway ahead of one, no token budget cut, no block shortage: `plan`) is a handful of
vectorised operations: tokens, slots wanted, block crossings, accepted counts (a gather from
the draws made when the request entered), delivered tokens, completions, KV tokens read.

Block crossings are the only allocations: a paged allocator is told a request's slots when it
needs a new block, and not between. Its blocks are then the same as if it had been told every
step (ceil(told / bs) == ceil(held / bs)), and so are its internal bytes (past the request's
final length, a function of the blocks); only token_states is short of the slots held by
`lag` tokens, which `reserved` holds instead. The engine moves those bytes back when it
records the parts (`engine_recording.parts_now`). Any other iteration (a prompt partway, a
binding budget, a shortage, policy priority, static batching, the allocation log) runs the
per-request walk on the `SpecState` objects: `store` writes the arrays back to them and tells
the allocator every slot held first, and `load` takes them up again when the fast path
applies once more.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from kvfrag.sim.engine_requests import _Req
from kvfrag.sim.speculative import Acceptance, SpecState, Speculative

_I64 = np.int64
#: A free slot's output length: never reached.
_NEVER = 1 << 62


class SpecSteps:
    """The running requests' speculative state, one slot each (see the module's docstring),
    and the run's verification counts (the summary's spec_* figures).

    Every array spans the whole capacity and a free slot holds zeros, so a step works on
    whole arrays (no slicing, no gathers by index: at a few hundred slots the cost of a numpy
    call is its overhead, not its length); `decoding` and `live` are 0/1 integers, so that a
    masked sum is a dot product."""

    #: Most iterations a stretch looks ahead (a window of decoders x WINDOW counts).
    WINDOW = 256

    def __init__(self, spec: Speculative, acceptance: Acceptance, max_model_len: int,
                 asynchronous: bool, block_size: int) -> None:
        self.k = spec.num_tokens
        self.look = spec.lookahead
        self.ds = spec.draft_slots
        self.acceptance = acceptance
        self.mml = max_model_len
        # A plan needs every decoder's 1 + k tokens and their lookahead within max_model_len
        # (vLLM keeps room for the token it samples): its computed tokens at most this.
        self.limit = max_model_len - 1 - self.k - max(1, self.look)
        self.asynchronous = asynchronous
        self.bs = block_size  # (0: the allocator is not paged; the arrays are not used)
        # decode steps that verified drafts, their drafts and those accepted (the summary)
        self.steps = self.drafts_total = self.accepted_total = 0
        self.arrayed = False  # whether the arrays hold the running requests' state now
        # turns the arrays wait after a return to the walk, and the next such wait
        # (`engine_walk.spec_schedule`)
        self.wait = self.backoff = 0
        # slots held, and of them what the allocator stores: `lag` is the difference
        self.held_sum = self.told_sum = 0
        self.n_live = 0  # slots in use
        self.free: list[int] = []
        self.reqs: list[_Req | None] = []
        self._alloc_arrays(64)
        self.acc = np.zeros(1024, dtype=_I64)  # accepted counts, a segment per slot
        self.acc_used = 0
        self.acc_live = 0
        # this iteration's plan (`plan`): slots held after it, blocks it adds, block crossings
        self.p_new = np.zeros(0, dtype=_I64)
        self.p_blocks = np.zeros(0, dtype=_I64)
        self.p_cross = np.zeros(0, dtype=_I64)
        self.p_tokens = np.zeros(0, dtype=_I64)
        self.n_scheduled = 0
        self.planned = 0  # iterations whose decoders were scheduled here (not walked)
        self.stretched = 0  # of them, those that began a stretch of several (`stretch`)

    @property
    def lag(self) -> int:
        """Slots held that the allocator is not told of yet, over every slot."""
        return self.held_sum - self.told_sum

    def _alloc_arrays(self, cap: int) -> None:
        """The state as rows of one matrix (`_FIELDS` order), each field a view of its row: a
        slot's column is written in one call when a request enters, leaves or is stored."""
        self.cap = cap
        self.state = np.zeros((len(_FIELDS), cap), dtype=_I64)
        rows = self.state
        self.computed = rows[0]
        self.delivered = rows[1]
        self.drafts = rows[2]
        self.verified = rows[3]
        self.rollback = rows[4]
        self.inflight = rows[5]
        self.scheduled = rows[6]
        self.decoding = rows[7]  # (0/1)
        self.extra = rows[8]  # (0/1)
        self.output = rows[9]
        self.final = rows[10]  # slots its allocator request holds at most
        self.held = rows[11]  # slots held (a high-water mark)
        self.told = rows[12]  # of them, what the allocator stores (`lag`)
        self.blocks = rows[13]  # blocks held: ceil(told / bs), ceil(held / bs)
        self.rid = rows[14]
        self.accoff = rows[15]  # acc[accoff + verified]: its next accepted count
        self.accstart = rows[16]  # its segment: acclen counts from accstart
        self.acclen = rows[17]
        self.live = rows[18]  # (0/1)
        self.output[:] = _NEVER

    def _grow_arrays(self) -> None:
        old, state = self.cap, self.state
        self._alloc_arrays(2 * old)
        self.state[:, :old] = state
        self.free.extend(range(2 * old - 1, old - 1, -1))
        self.reqs.extend([None] * old)

    # ---------------------------------------------------------- slots in and out
    def enter(self, r: _Req, told: int) -> None:
        """`r` runs with its state in the arrays (from its SpecState); the allocator stores
        `told` tokens of it, all the slots it holds."""
        st = r.spec
        assert st is not None
        if not self.free:
            if not self.reqs:
                self.free.extend(range(self.cap - 1, -1, -1))
                self.reqs.extend([None] * self.cap)
            else:
                self._grow_arrays()
        i = self.free.pop()
        self.reqs[i] = r
        st.slot = i
        # Accepted counts for every step it may still verify (each delivers a token; async:
        # one more step after its last), from its next one on; none when it has its prefill
        # to finish and that gives its last token (a column may then have none to give).
        n = 0
        if st.decoding or r.output > st.delivered + 1:
            n = max(r.output + 2 - st.verified, 1)
        if self.acc_used + n > len(self.acc):
            self._compact(n)  # (over the live slots: not this one yet)
        at = self.acc_used
        if n:
            self.acc[at:at + n] = np.minimum(
                self.acceptance.counts(r.req.rid, st.verified, n), self.k)
        self.acc_used += n
        self.acc_live += n
        self.held_sum += told
        self.told_sum += told
        blocks = -(-told // self.bs) if self.bs else 0
        self.state[:, i] = (st.computed, st.delivered, st.drafts, st.verified, st.rollback,
                            st.inflight, st.scheduled, st.decoding, st.extra, r.output, r.final,
                            told, told, blocks, r.req.rid, at - st.verified, at, n, 1)
        self.n_live += 1

    def _compact(self, need: int) -> None:
        """Make room for `need` more counts: keep only the live slots' segments."""
        size = max(2 * (self.acc_live + need), 1024)
        acc = np.zeros(size, dtype=_I64)
        used = 0
        for i in self.live.nonzero()[0].tolist():
            n, start = int(self.acclen[i]), int(self.accstart[i])
            acc[used:used + n] = self.acc[start:start + n]
            self.accoff[i] += used - start
            self.accstart[i] = used
            used += n
        self.acc, self.acc_used = acc, used

    def leave(self, r: _Req) -> None:
        """`r` no longer runs (freed): its slot goes back, zeroed."""
        st = r.spec
        assert st is not None
        i = st.slot
        self.held_sum -= int(self.held[i])
        self.told_sum -= int(self.told[i])
        self.acc_live -= int(self.acclen[i])
        self.state[:, i] = 0
        self.output[i] = _NEVER
        self.n_live -= 1
        self.reqs[i] = None
        self.free.append(i)
        st.slot = -1

    def load(self, running: Iterable[_Req], tokens_of: list[int]) -> None:
        """Take up the running requests' state (`tokens_of`: what the allocator stores of
        each, every slot it holds)."""
        for r, told in zip(running, tokens_of, strict=True):
            self.enter(r, told)
        self.arrayed = True

    def store(self) -> list[tuple[int, int]]:
        """Write the arrays back to the SpecState objects and empty them; returns (rid, slots)
        the allocator must be told of (grown by) first."""
        tell: list[tuple[int, int]] = []
        for i in self.live.nonzero()[0].tolist():
            r = self.reqs[i]
            assert r is not None
            st = r.spec
            assert st is not None
            st.computed = int(self.computed[i])
            st.delivered = int(self.delivered[i])
            st.drafts = int(self.drafts[i])
            st.verified = int(self.verified[i])
            st.rollback = int(self.rollback[i])
            st.inflight = int(self.inflight[i])
            st.scheduled = int(self.scheduled[i])
            st.decoding = bool(self.decoding[i])
            st.extra = bool(self.extra[i])
            st.slot = -1
            more = int(self.held[i] - self.told[i])
            if more:
                tell.append((r.req.rid, more))
        self.state[:] = 0
        self.output[:] = _NEVER
        self.held_sum = self.told_sum = self.acc_used = self.acc_live = self.n_live = 0
        self.free.clear()
        self.reqs.clear()
        self.arrayed = False
        return tell

    # ------------------------------------------------------------------ a step
    def plan(self, budget: int, free_blocks: int) -> bool:
        """The decoders' tokens and slots for this iteration, when they go first and none is
        cut nor short of a block: each takes 1 + k tokens (it has sampled, so it carries k
        drafts), within the token budget and its input slots and max_model_len (`limit`).
        False (nothing changed) when the walk must take the iteration."""
        dec, bs = self.decoding, self.bs
        decoders = int(dec.sum())
        step = 1 + self.k
        if decoders:
            if (step + self.ds) * decoders > budget:
                return False
            comp = self.computed * dec
            if int(comp.max()) > self.limit:
                return False
        tokens = dec * step
        new = self.computed + (step + self.look)
        new *= dec
        np.maximum(new, self.held, out=new)
        blocks = new + (bs - 1)
        blocks //= bs
        blocks -= self.blocks
        if int(blocks.sum()) > free_blocks:
            return False
        self.p_tokens, self.p_new, self.p_blocks = tokens, new, blocks
        self.p_cross = blocks.nonzero()[0]
        self.n_scheduled = decoders
        return True

    def crossings(self) -> tuple[list[int], list[int]]:
        """(rids, slots to grow each by) of the plan's block crossings: the allocations."""
        cross = self.p_cross
        return self.rid[cross].tolist(), (self.p_new[cross] - self.told[cross]).tolist()

    def commit(self, told: int) -> int:
        """Apply the plan, its crossings granted (`told`: the slots they added); returns the
        decoders' tokens."""
        tokens, new, cross = self.p_tokens, self.p_new, self.p_cross
        self.computed += tokens
        self.scheduled[:] = tokens
        self.held[:] = new
        self.held_sum = int(new.sum())
        if len(cross):
            self.told[cross] = new[cross]
            self.blocks += self.p_blocks
            self.told_sum += told
        self.planned += 1
        return self.n_scheduled * (1 + self.k)

    def roll_back(self) -> None:
        """Async: the previous step's rejected drafts, known after this scheduling."""
        self.computed -= self.rollback
        self.rollback[:] = 0

    def kv_read(self, chunk_cost: bool) -> int:
        """The KV read after a plan: the decoders' contexts (all scheduled), and, when the
        step time counts every token held, the prompts' too."""
        return int(self.computed.dot(self.decoding if chunk_cost else self.live))

    def verify(self, prefilled: list[_Req]) -> list[_Req]:
        """The iteration's output after a plan (`verify_objects`', vectorised): every decoder
        verified k drafts; returns those done, in rid order."""
        first: list[int] = []
        for r in prefilled:  # a final prefill chunk samples the first token
            st = r.spec
            if st is not None and st.slot >= 0 and r.status == "running":
                first.append(st.slot)
        dec, k = self.decoding, self.k
        decoders = int(dec.sum())  # (async: less those done and freed since the plan)
        a = self.acc.take(self.accoff + self.verified, mode="clip")  # (clipped to k)
        a *= dec
        self.verified += dec
        self.steps += decoders
        self.drafts_total += k * decoders
        self.accepted_total += int(a.sum())
        if self.asynchronous:  # (vLLM rolls back after the next scheduling)
            np.subtract(dec * k, a, out=self.rollback)
        else:
            self.computed -= dec * k - a
        a += dec
        self.delivered += a
        self.inflight[:] = a
        for i in first:
            self.decoding[i] = 1
            self.delivered[i] += 1
            self.inflight[i] = 1
            self.drafts[i] = k
        # (a free slot's output is _NEVER; a slot done and not decoding was freed before)
        done = (self.delivered >= self.output).nonzero()[0]
        if not len(done):
            return []
        order = done[self.rid[done].argsort(kind="stable")]
        out: list[_Req] = []
        for i in order.tolist():
            r = self.reqs[i]
            assert r is not None
            out.append(r)
        return out

    def all_decoding(self) -> bool:
        """Whether every slot in use was a decoder at this iteration's plan (and there was
        one): nobody admitted nor released since, the caller knows."""
        return 0 < self.n_scheduled == self.n_live

    def stretch(self, delta: float, w0: float, per_kv: float, free_blocks: int, b: int
                ) -> tuple[int, float, float, float, float, list[int], list[int]] | None:
        """This decode-only iteration (planned, every slot decoding) and the ones after it,
        up to the first that completes a request, that reaches `delta` seconds (the next
        arrival), or before the first that would need more than `free_blocks` blocks or come
        near max_model_len. Every step of every decoder follows its draws: tokens as
        cumulative sums over a (decoders x steps) window. Applies all but the last step's
        verification (`verify` does it at the stretch's end) and returns (steps, seconds,
        and, integrated over them against the first step, b x the slots held, the blocks held
        and b x their tail past each request's final length; the (rids, slots) the allocator
        is told now); None when the stretch would be one iteration. `w0`, `per_kv`: the first
        step's seconds and the step time's cost per KV token read."""
        most = self.WINDOW
        if delta < math.inf:  # (every step takes w0 seconds at least)
            most = min(most, math.ceil(delta / w0))
        if most < 3:
            return None
        idx = self.decoding.nonzero()[0]
        k, look, bs = self.k, self.look, self.bs
        comp, dl, out = self.computed[idx], self.delivered[idx], self.output[idx]
        most = min(most, int((out - dl).min()) + 1)  # (each step delivers a token at least)
        if most < 3:
            return None
        at = (self.accoff[idx] + self.verified[idx])[:, None] + np.arange(most)
        acc = self.acc.take(at, mode="clip")
        cum = (acc + 1).cumsum(axis=1)  # tokens given by steps 0..j
        before = np.zeros(cum.shape, dtype=_I64)  # by steps 0..j-1
        before[:, 1:] = cum[:, :-1]
        read = comp[:, None] + before  # computed at step j's KV read (`comp`: step 0's)
        # step j's computed tokens at its scheduling, and the slots it wants
        if self.asynchronous:  # (step j-1's rejected drafts rolled back after it)
            planned = np.zeros(cum.shape, dtype=_I64)
            planned[:, 2:] = cum[:, :-2]
            planned += comp[:, None]
            want = planned + (k + 1 + look)
        else:
            planned = read - (k + 1)
            want = read + look
        held = np.maximum(want, self.held[idx][:, None])
        held[:, 0] = self.held[idx]
        blocks = held + (bs - 1)
        blocks //= bs
        per_step = blocks.sum(axis=0)
        kv = read.sum(axis=0)
        dt = w0 + per_kv * (kv - kv[0])
        ok = (per_step - per_step[0] <= free_blocks) & (planned.max(axis=0) <= self.limit)
        ok[0] = True
        n = most if bool(ok.all()) else int(ok.argmin())
        done = ((dl[:, None] + cum) >= out[:, None]).any(axis=0)
        if bool(done.any()):
            n = min(n, int(done.argmax()) + 1)
        if delta < math.inf:
            reach = dt.cumsum() >= delta
            if bool(reach.any()):
                n = min(n, int(reach.argmax()) + 1)
        if n < 2:
            return None
        dt = dt[:n]
        duration = float(dt.sum())
        h = held[:, :n]
        tail = np.maximum(blocks[:, :n] * bs - self.final[idx][:, None], 0).sum(axis=0) * b
        slots = (h.sum(axis=0) - h[:, 0].sum()) * b
        more_blocks = per_step[:n] - per_step[0]
        # steps 0 .. n-2 verified, step n-1 scheduled
        last = n - 1
        self.computed[idx] = read[:, last]
        self.delivered[idx] += before[:, last]
        self.verified[idx] += last
        self.steps += len(idx) * last
        self.drafts_total += k * len(idx) * last
        self.accepted_total += int(acc[:, :last].sum())
        told = held[:, last]
        grow = (told > self.told[idx]).nonzero()[0]
        rids = self.rid[idx[grow]].tolist()
        more = (told[grow] - self.told[idx[grow]]).tolist()
        self.held[idx] = told
        self.told[idx] = told
        self.blocks[idx] = blocks[:, last]
        self.held_sum = int(self.held.sum())
        self.told_sum = int(self.told.sum())
        self.stretched += 1
        return (n, duration, float(slots.dot(dt)), float(more_blocks.dot(dt)),
                float((tail - tail[0]).dot(dt)), rids, more)

    def done_async(self, r: _Req) -> None:
        """Async: `r` is done; vLLM schedules it once more unless the one token its step in
        flight surely gives reaches the output's length."""
        st = r.spec
        assert st is not None
        if st.slot >= 0:
            i = st.slot
            extra = bool(self.delivered[i] - self.inflight[i] + 1 < r.output)
            self.extra[i] = self.decoding[i] = int(extra)
        else:
            extra = st.delivered - st.inflight + 1 < r.output
        st.extra = st.decoding = extra


#: The state's rows (`SpecSteps._alloc_arrays`): a column is a slot.
_FIELDS = ("computed", "delivered", "drafts", "verified", "rollback", "inflight", "scheduled",
           "decoding", "extra", "output", "final", "held", "told", "blocks", "rid", "accoff",
           "accstart", "acclen", "live")


# ------------------------------------------------------------------ the walk's helpers
def verify_objects(running: Iterable[_Req], prefilled: list[_Req], steps: SpecSteps) -> None:
    """The iteration's output after a walk, on the SpecState objects: a decode step of d
    drafts with a accepted gives 1 + a tokens and rolls its computed tokens back by d - a
    (async: after the next scheduling); a final prefill chunk gives the first token. Each
    that sampled carries k drafts into its next step."""
    acceptance = steps.acceptance
    done = set(prefilled)
    for r in running:
        st = r.spec
        assert st is not None
        st.inflight = 0
        if not st.scheduled:
            continue
        if r in done:
            st.delivered += 1
            st.inflight = 1
        elif st.decoding:
            d = st.scheduled - 1
            a = 0
            if d:
                a = min(acceptance.count(r.req.rid, st.verified), d)
                st.verified += 1
                steps.steps += 1
                steps.drafts_total += d
                steps.accepted_total += a
            if steps.asynchronous:
                st.rollback = d - a
            else:
                st.computed -= d - a
            st.delivered += 1 + a
            st.inflight = 1 + a
        else:
            continue  # a chunk partway through its prompt samples nothing
        st.drafts = steps.k


def kv_read_objects(running: Iterable[_Req], chunk_cost: bool) -> int:
    """`SpecSteps.kv_read` on the SpecState objects."""
    total = 0
    for r in running:
        st = r.spec
        assert st is not None
        if (st.scheduled and st.decoding) or not (chunk_cost or st.decoding):
            total += st.computed
    return total


def slots_wanted(st: SpecState, tokens: int, lookahead: int, max_model_len: int) -> int:
    """The slots a request holds to store `tokens` more past its computed ones and the
    lookahead (a high-water mark: rejected drafts free nothing)."""
    return min(st.computed + tokens + lookahead, max_model_len)
