"""The allocator protocol: admit / grow / step / free / account, with explicit results.

An allocator manages a KV budget of `capacity` bytes for requests that store one token's keys
and values (`bytes_per_token` bytes) per token. Every operation returns a `Grant` (truthy:
what was allocated) or a `Refusal` (falsy: why not), the way vLLM's `allocate_slots` returns
blocks or None (those values, with `Request`, `Accounting` and the per-request `Live`, are in
`sim.allocators.values`, re-exported here). Allocators are plain Python: the engine in
`sim.engine` drives them.

Continuous batching grows every running request by one token per iteration. Doing that one
request at a time would make the simulation cost grow with tokens, so the protocol has a batch
operation: `step(n)` advances every *decoding* request by `n` tokens at once. A decoding
request's length is stored as a phase `c` against a shared decode clock `K` (length = c + K),
so a step is O(1) for slab allocators and O(block_size) for the paged one, however many
requests run. `integrate(n, ...)` returns the exact weighted sum of the accounting over the
next `n` steps, so time averages stay exact without visiting each token.

Accounting (exact, to the byte; b = bytes per token, per live request with L tokens stored,
final length F and A bytes allocated):
- token_states = b*L
- reserved     = min(A, b*F) - b*L   (held for tokens it will still write)
- internal     = A - min(A, b*F)     (held, never written)
- free         = capacity - sum(A)
- usable_free  = the free bytes that can hold whole placement units of the next request (the
  head of the waiting queue, or a reference request): hole by hole for slab allocators, every
  free block for the paged one
- external     = free - usable_free
and token_states + reserved + internal + external + usable_free == capacity, always.

On a hybrid model (`view_model`), an allocator that keeps every token in every layer holds
bytes its sliding-window and chunked-local layers no longer read: those move from
token_states into internal (out of window), so that token_states is what the model needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from heapq import heappop, heappush
from typing import TYPE_CHECKING, ClassVar

from kvfrag.sim.allocators.values import (
    PARTS,
    Accounting,
    Grant,
    Live,
    Reason,
    Refusal,
    Request,
    positive_int,
)
from kvfrag.sim.floor_sum import times
from kvfrag.sim.model_view import ModelView
from mypy_extensions import mypyc_attr

if TYPE_CHECKING:
    from kvfrag.sim.layers import LayerStack


def push_clock(heap: list[int], pushed: dict[int, list[int]], clock: int, rid: int) -> None:
    """Push `rid` at `clock` onto the decode cohort's heaps by clock (`Allocator._done`, the
    paged allocator's `_pending`): the heap holds each clock once, and `pushed` the rids pushed
    with it (decoders seldom share a clock, and comparing ints costs less than tuples)."""
    rids = pushed.get(clock)
    if rids is None:
        pushed[clock] = [rid]
        heappush(heap, clock)
    else:
        rids.append(rid)


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see _native.py)
class Allocator(ABC):
    """Common bookkeeping: live requests, the decode clock, and the protocol's checks.

    Subclasses implement placement (`_admit`, `_grow`, `_release`), the free-space view
    (`_usable_free`, `_largest_hole`) and how allocated bytes evolve under `step`.
    """

    kind: ClassVar[str]
    # Compaction totals; only allocators that move live data (contiguous) change them.
    compactions: int = 0
    bytes_moved: int = 0
    stall_s: float = 0.0
    evictions: int = 0  # prefix caching: idle cached blocks evicted so far

    def __init__(self, capacity: object, bytes_per_token: object, max_model_len: object) -> None:
        # (Constructors take `object` where a user's value is checked: compiled, a parameter
        # typed `int` would turn True into 1 and reject 1.5 with a TypeError before the check.)
        self.capacity = positive_int("capacity", capacity)
        self.bytes_per_token = positive_int("bytes_per_token", bytes_per_token)
        self.max_model_len = positive_int("max_model_len", max_model_len)
        self._live: dict[int, Live] = {}
        # The request last looked up by rid: the engine asks several things of one request
        # in a row, and a dict lookup boxes the rid each time (compiled, a new int object).
        self._last: Live | None = None
        self._clock = 0  # decode steps taken so far
        self._fixed_tokens = 0  # stored tokens of non-decoding requests
        self._phase_sum = 0  # sum of stored(c) over decoding requests: n*c less shared
        self._dec_weight = 0  # sequences decoding: stored tokens gained per step
        self._fixed_seq = 0  # sum of n*L over non-decoding requests
        self._seq_phase_sum = 0  # sum of n*c over decoding requests
        # When each decoder is done: the clock value final - c. A heap of those clocks, each
        # once, and the rids pushed with each, with lazy deletion (a rid counts while
        # `_done_at[rid]` still says that clock): cheaper than a sorted list for the engine's
        # push / peek / leave pattern, and than a heap of (clock, rid) pairs, whose every
        # comparison compares tuples (decoders seldom share a clock).
        self._done: list[int] = []
        self._done_rids: dict[int, list[int]] = {}
        self._done_at: dict[int, int] = {}
        # `_done_top`'s answer while `_top_ok` (the engine asks several times between changes)
        self._top: tuple[int, int] | None = None
        self._top_ok = True
        self.frees = 0  # how many frees so far: memory can only come back through one
        # Async scheduling (`set_async`): whether a decoder's last token is in flight when it
        # steps, and the tokens in flight of the request `grow` is growing now
        self.asynchronous = False
        self.in_flight_now = 0
        # A hybrid model's layers, where it has sliding or chunked ones (`view_model`): the
        # out-of-window bytes of the tokens kept, moved from token_states into internal.
        self._view: ModelView | None = None
        #: Whether `waste_parts` / `waste_integrals` can be other than 0 (the engine asks them
        #: only then: full-attention runs pay nothing for the split).
        self.waste_split = False
        #: Whether a memory refusal of an admission holds, for the same request and tokens,
        #: while the free bytes do not grow (a pool of interchangeable blocks, nothing cached):
        #: the engine then asks again only once they have (`Engine._try_admit`).
        self.refusal_by_free = False

    # ----------------------------------------------------------------- queries
    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def n_decoding(self) -> int:
        return len(self._done_at)

    def rids(self) -> list[int]:
        return list(self._live)

    def tokens(self, rid: int) -> int:
        """Tokens request `rid` stores now."""
        return self._tokens_of(self._get(rid))

    def _tokens_of(self, live: Live) -> int:
        return live.base + self._clock if live.decoding else live.base

    def final_tokens(self, rid: int) -> int:
        """Tokens request `rid` will store when done (after truncation at its reservation)."""
        return self._get(rid).final

    @property
    def decoding_weight(self) -> int:
        """Sequences in the decode cohort (a request with n samples counts n)."""
        return self._dec_weight

    def total_tokens(self) -> int:
        """Distinct tokens stored by every live request (shared ones once)."""
        return self._linear_tokens() + self._token_terms()

    def sequence_tokens(self) -> int:
        """Tokens over every sequence, shared ones once per sequence: what attention reads."""
        return self._fixed_seq + self._seq_phase_sum + self._dec_weight * self._clock

    def decoding_sequence_tokens(self) -> int:
        """Tokens over every decoding sequence: what decode attention reads this step."""
        return self._seq_phase_sum + self._dec_weight * self._clock

    def _linear_tokens(self) -> int:
        return self._fixed_tokens + self._phase_sum + self._dec_weight * self._clock

    def stored_tokens(self, rid: int) -> int:
        live = self._get(rid)
        return self._stored(live, self.tokens(rid))

    def _stored(self, live: Live, tokens: int) -> int:
        """Distinct tokens a request stores when each of its sequences holds `tokens`.

        Slabs cannot share: n sequences store n copies. Paged allocators count shared
        tokens once."""
        return live.req.n * tokens

    def _linear(self, live: Live, phase: int) -> int:
        """The part of `_stored(live, phase + K)` that is linear in K, at K = 0; the rest
        (floor terms of shared blocks) is the allocator's `_token_terms`."""
        return self._stored(live, phase)

    def _token_terms(self) -> int:
        """Stored tokens of decoders that are not linear in the clock (paged beams)."""
        return 0

    def _integrate_token_terms(self, n: int, w0: float, w1: float, weight: float) -> float:
        return self._token_terms() * weight

    def _integrate_saved(self, n: int, w0: float, w1: float, weight: float) -> float:
        return self.saved_by_sharing() * weight

    def steps_until_done(self) -> int | None:
        """Steps until the first decoding request reaches its final length (None: no decoder)."""
        top = self._done_top()
        return None if top is None else top[0] - self._clock

    def _done_top(self) -> tuple[int, int] | None:
        if self._top_ok:
            return self._top
        heap, valid, pushed = self._done, self._done_at, self._done_rids
        top = None
        while heap:
            done = heap[0]
            rids = pushed[done]
            first, found, stale = 0, False, False
            for rid in rids:  # (the lowest that counts: a loop, compiled, costs less than min())
                at = valid.get(rid)
                if at is not None and at == done:
                    if not found or rid < first:
                        first, found = rid, True
                else:
                    stale = True
            if found:
                if stale:
                    pushed[done] = [rid for rid in rids if valid.get(rid) == done]
                top = (done, first)
                break
            del pushed[done]  # all left the cohort since they were pushed
            heappop(heap)
        self._top, self._top_ok = top, True
        return top

    def is_decoding(self, rid: int) -> bool:
        return self._get(rid).decoding

    def first_done(self) -> int | None:
        """The decoder that reaches its final length first (ties: lowest rid), if any."""
        top = self._done_top()
        return None if top is None else top[1]

    def block_table(self, rid: int) -> tuple[int, ...]:
        """Block ids of request `rid` in token order; slab allocators have none."""
        self._get(rid)
        return ()

    def block_tables(self, rid: int) -> list[tuple[int, ...]]:
        """One block table per sequence of request `rid`; slab allocators have none."""
        self._get(rid)
        return []

    def slab_offsets(self, rid: int) -> tuple[int, ...]:
        """Byte offset of each sequence's slab (slab allocators: one per sample); else ()."""
        self._get(rid)
        return ()

    def prefix_keys(self, rid: int) -> tuple[int, ...]:
        """Prefix caching: one digest per block the request caches once it is full (the
        prompt blocks its hash chain names, then its own); blocks with equal digests hold the
        same tokens. Others: ()."""
        self._get(rid)
        return ()

    def steps_until_full(self) -> int | None:
        """Steps every decoder can take before an allocation fails (None: never)."""
        return None

    def can_step(self) -> bool:
        """Whether every decoder can store its next token (`steps_until_full()` is not 0):
        what the engine asks before each iteration. An allocator whose look-ahead walks steps
        may answer it for the next step alone."""
        return self.steps_until_full() != 0

    def steps_until_full_within(self, limit: int) -> int | None:
        """min(steps_until_full(), limit): what the engine needs when it will not step past
        `limit` anyway (an allocator that must walk the steps to answer walks no further)."""
        full = self.steps_until_full()
        return full if full is None or full < limit else limit

    def steps_until_shrink(self) -> int | None:
        """Steps until a step gives memory back without a free (None: steps never do)."""
        return None

    def steps_until_evict(self) -> int | None:
        """Prefix caching: steps until a step evicts an idle cached block (None: none will)."""
        return None

    @abstractmethod
    def allocated_bytes(self, rid: int) -> int:
        """Bytes request `rid` holds now."""

    @abstractmethod
    def bytes_for(self, req: Request, tokens: int) -> int:
        """Bytes `admit(req, tokens)` would allocate (for watermarks and what-ifs)."""

    def too_large(self, req: Request) -> bool:
        """Whether `req` could never be held to its final length, even alone (what `admit`
        refuses as TOO_LARGE): an admission gate that looks at its prompt alone asks this
        first, so that its verdict does not depend on the free memory of the moment."""
        final = min(req.final, self.reservation_tokens(req), self.max_model_len)
        return self.bytes_for(req, final) > self.pool_bytes()

    def pool_bytes(self) -> int:
        """The most one request could ever hold (an empty pool's usable bytes): the whole
        budget as the watermark counts it, less a paged pool's null block."""
        return self.watermark_bytes(1.0)

    def defer_block_ids(self) -> None:
        """The caller will not read the block ids of grants (`Grant.blocks`) nor of evictions
        (`take_evictions`): an allocator that names block ids may leave a request's unnamed
        until `block_table` asks for them, and need not list what it evicts (the engine says
        so when it keeps no allocation log: ids are fungible, and nobody looks)."""
        return

    def watermark_bytes(self, fraction: float) -> int:
        """The free memory an admission must leave for a watermark of `fraction` (vLLM keeps
        int(fraction x blocks) whole blocks; a slab allocator that share of its bytes)."""
        return int(fraction * self.capacity)

    def reservation_tokens(self, req: Request) -> int:
        """Tokens this allocator would set aside for `req` at admission (its placement unit)."""
        return self.max_model_len

    # --------------------------------------------------------------- operations
    def admit(
        self, req: Request, tokens: int | None = None, decoding: bool = True
    ) -> Grant | Refusal:
        """Allocate room for a new request storing `tokens` tokens (default: its prompt)."""
        if req.rid in self._live:
            raise ValueError(f"request {req.rid} is already live")
        if req.prompt >= self.max_model_len:
            need = req.prompt * self.bytes_per_token
            return Refusal(
                req.rid,
                Reason.PROMPT_TOO_LONG,
                need,
                self.free_bytes(),
                f"prompt of {req.prompt} tokens leaves no room under max_model_len "
                f"{self.max_model_len}",
            )
        cap = min(self.reservation_tokens(req), self.max_model_len)
        live = Live(req=req, final=min(req.final, cap), cap=cap, base=0, decoding=False)
        tokens = req.prompt if tokens is None else tokens
        if not 1 <= tokens <= live.final:
            raise ValueError(f"request {req.rid}: cannot store {tokens} of {live.final} tokens")
        if decoding:
            self._check_can_decode(live, tokens)  # before anything is allocated
        result = self._admit(live, tokens)
        if result:
            live.base = tokens
            self._live[req.rid] = live
            self._fixed_tokens += self._stored(live, tokens)
            self._fixed_seq += live.weight * tokens
            view = self._view
            if view is not None:
                view.enter(req.rid, self._view_mult(live), tokens)
            if decoding:
                self.set_decoding(req.rid, True)
        return result

    def grow(self, rid: int, n: int = 1, in_flight: int = 0) -> Grant | Refusal:
        """Add `n` tokens to one request, allocating if it needs more room. `in_flight` (async
        scheduling): its tokens scheduled in the previous step, whose output is not applied
        yet; vLLM frees a sliding window's blocks over the tokens processed, computed less
        those (`in_flight_now`, read by the hybrid allocator)."""
        live = self._get(rid)
        self.in_flight_now = in_flight
        old = self.tokens(rid)
        if n < 1 or old + n > live.final:
            raise ValueError(f"request {rid}: cannot grow {old} by {n} past {live.final} tokens")
        was_decoding = live.decoding
        if was_decoding:
            self.set_decoding(rid, False)
        before = self._stored(live, old)  # before `_grow`, which may share some of it
        result = self._grow(live, old, old + n)
        if result:
            self._fixed_tokens += self._stored(live, old + n) - before
            self._fixed_seq += live.weight * n
            live.base += n
            view = self._view
            if view is not None:
                view.exit(rid)
                view.enter(rid, self._view_mult(live), live.base)
        if was_decoding:
            self.set_decoding(rid, True)
        return result

    def set_decoding(self, rid: int, decoding: bool) -> None:
        """Enter or leave the decode cohort that `step` advances together."""
        self._set_decoding(self._get(rid), decoding)

    def _set_decoding(self, live: Live, decoding: bool) -> None:
        rid = live.req.rid
        if live.decoding == decoding:
            return
        if decoding:
            tokens = live.base
            self._check_can_decode(live, tokens)
            live.base = tokens - self._clock
            live.decoding = True
            self._fixed_tokens -= self._stored(live, tokens)
            self._fixed_seq -= live.weight * tokens
            self._phase_sum += self._linear(live, live.base)
            self._seq_phase_sum += times(live.weight, live.base)
            self._dec_weight += live.weight
            view = self._view
            if view is not None:
                view.exit(rid)
                view.join(rid, self._view_mult(live), live.base, self._clock)
            done = live.final - live.base
            self._done_at[rid] = done
            push_clock(self._done, self._done_rids, done, rid)
            if self._top_ok:  # the first to be done is this one or the same as before
                top = self._top
                if top is None or done < top[0] or (done == top[0] and rid < top[1]):
                    self._top = (done, rid)
        else:
            del self._done_at[rid]
            top = self._top
            if self._top_ok and top is not None and top[1] == rid:  # (another leaving: no change)
                self._top_ok = False
            self._phase_sum -= self._linear(live, live.base)
            self._seq_phase_sum -= times(live.weight, live.base)
            self._dec_weight -= live.weight
            live.base += self._clock
            live.decoding = False
            self._fixed_tokens += self._stored(live, live.base)
            self._fixed_seq += live.weight * live.base
            view = self._view
            if view is not None:
                view.leave(rid)
                view.enter(rid, self._view_mult(live), live.base)
        self._cohort_changed(live, decoding)

    @staticmethod
    def _check_can_decode(live: Live, tokens: int) -> None:
        """A group's sequences fork at its first output token, and the decode cohort's closed
        forms count n sequences: a group joins once that token's slot is taken."""
        req = live.req
        if req.n > 1 and tokens <= req.prompt:
            raise ValueError(
                f"request {req.rid}: a group of {req.n} sequences decodes once it stores more "
                f"than its {req.prompt} prompt tokens (it stores {tokens}); admit it with "
                "prompt + 1 tokens"
            )

    def step(self, n: int = 1) -> Grant | Refusal:
        """Every decoding request gains `n` tokens; all or nothing."""
        if n < 0:
            raise ValueError("cannot step backwards")
        done = self.steps_until_done()
        if done is not None and n > done:
            raise ValueError(f"step of {n} takes a request past its final length ({done} left)")
        full = self.steps_until_full()
        if full is not None and n > full:
            return Refusal(-1, Reason.OUT_OF_MEMORY, 0, self.free_bytes(), "no block for a decoder")
        before = self.capacity - self.free_bytes()
        self.advance(n)
        return Grant(-1, self.capacity - self.free_bytes() - before, 0)

    def advance(self, n: int) -> None:
        """`step(n)` without its checks, for a caller that has made them (the engine's loop:
        it knows steps_until_done and steps_until_full already)."""
        self._clock += n
        if self._view is not None:
            self._view.stepped(self._clock)
        self._stepped()

    def set_async(self) -> None:
        """The engine schedules asynchronously (vLLM's AsyncScheduler): each allocation of a
        request scheduled in the previous step comes with that step's tokens in flight (a
        decode step: one; `grow`'s `in_flight` otherwise). Only where what is freed depends
        on the tokens processed (the hybrid allocator's windows) does it change anything."""
        self.asynchronous = True

    def unscheduled(self, rid: int) -> None:
        """Async scheduling: decoder `rid` took no token this step (a prompt ahead took the
        token budget), so nothing of it is in flight at its next step. By default nothing
        depends on it."""
        return

    def evict_idle(self) -> None:
        """Evict every idle cached block (its id becomes a plain free block): decoders that
        run out of blocks take every free one, idle cached ones included, before vLLM
        preempts a victim (whose blocks only those after them then take). By default nothing
        is cached."""
        return

    def free_preempted(self, rid: int, processed: int) -> int:
        """Release a preempted request whose KV holds only its first `processed` tokens (async
        scheduling: a token whose step is in flight is computed, not yet processed); an
        allocator that caches blocks by their tokens caches only full blocks within them.
        Returns the bytes freed. By default `free`: what the KV holds does not matter."""
        return self.free(rid)

    def free(self, rid: int) -> int:
        """Release everything request `rid` holds; returns the bytes freed."""
        live = self._get(rid)
        self._set_decoding(live, False)
        nbytes = self.allocated_bytes(rid)
        self._release(live)
        self._fixed_tokens -= self._stored(live, live.base)
        self._fixed_seq -= live.weight * live.base
        if self._view is not None:
            self._view.exit(rid)
        del self._live[rid]
        if self._last is live:
            self._last = None
        self.frees += 1
        return nbytes

    def free_bytes(self) -> int:
        """Capacity less what requests hold (a paged pool: less its null block too)."""
        return self.capacity - self._allocated_total()

    def saved_by_sharing(self) -> int:
        """Bytes separate copies of the shared tokens would need on top of what is held."""
        return 0

    def cached_prefix_tokens(self, req: Request, tokens: int | None = None) -> int:
        """Tokens `admit(req)` would find cached and not need to compute again, for a request
        with `tokens` tokens to prefill (default: its prompt; a request resumed after a
        preemption prefills its generated tokens too, and may find them cached)."""
        return 0

    def aligned_chunk(self, req: Request, start: int, chunk: int, total: int,
                      limit: int) -> int:
        """The prefill chunk the scheduler runs from token `start` when it could run `chunk`
        (`total`: the tokens the prefill runs to, a resumed request's output included;
        `limit`: the most tokens one chunk may take). vLLM's hybrid manager in Mamba "align"
        mode ends chunks where a Mamba state must be kept (`HybridPrefixCaching`); 0 means
        none this step. Every other layout runs the chunk as it is."""
        return chunk

    def admission_bytes(self, req: Request, tokens: int, hit: int) -> int:
        """Free memory `admit(req, tokens)` takes when its first `hit` tokens are found cached
        (`cached_prefix_tokens`): what an admission gate checks before taking a first chunk."""
        return self.bytes_for(req, tokens) - (self.bytes_for(req, hit) if hit else 0)

    def overreserved_bytes(self) -> int:
        """The part of `internal` that is over-reservation: room a slab set aside for tokens
        its request will never reach (a reservation longer than its final length). The rest
        of `internal` is rounding: allocation granularity past what was asked for (a buddy
        block's power of two, a paged block's tail, a page, a caching allocator's size class).
        The PagedAttention paper files rounding under "external fragmentation & others" and
        shows Oracle with 0 % internal: `internal - overreserved_bytes()` is what moves.
        Constant between admissions and frees. Paged allocators reserve nothing: 0."""
        return 0

    # ------------------------------------------------------- a hybrid model's waste
    def view_model(self, stack: LayerStack) -> None:
        """Count token states as `stack`'s layers read them: this allocator keeps every token
        in every layer (`bytes_per_token` is the stack's all-full figure), and the tokens that
        its sliding-window and chunked-local layers no longer read are held but not needed:
        internal, out of window (`sim.model_view`). Nothing changes for a stack whose layers
        all read every token. Call it on a fresh allocator."""
        if self._live:
            raise ValueError("view_model needs a fresh allocator (nothing live)")
        if stack.full_bytes_per_token != self.bytes_per_token:
            raise ValueError(
                f"model {stack.name!r} keeps {stack.full_bytes_per_token} bytes per token with "
                f"every layer full, but this allocator stores {self.bytes_per_token}"
            )
        self._view = ModelView.of(stack)
        self.waste_split = self._view is not None

    @staticmethod
    def _view_mult(live: Live) -> int:
        """Sequences whose tokens the model view counts for a request: all n when each keeps
        its own copy, none when some are shared (cached blocks, a group's prompt blocks,
        beams): which shared token a sequence still reads differs per sequence."""
        req = live.req
        if live.cached or (req.n > 1 and (live.shared or req.beam)):
            return 0
        return req.n

    def waste_parts(self) -> tuple[int, int]:
        """(padding, out_of_window) bytes now: the parts of `internal` that are padding (a
        block's page beyond its layers' real slots; the hybrid allocator's) and bytes of
        written tokens that no layer reads again (a hybrid model's sliding and chunked
        layers). 0 unless `waste_split`."""
        view = self._view
        return (0, 0) if view is None else (0, view.total(self._clock))

    def waste_integrals(self, n: int, w0: float, w1: float) -> tuple[float, float]:
        """`waste_parts` summed as `integrals` sums the parts over the next n steps."""
        view = self._view
        return (0.0, 0.0) if view is None else (0.0, view.integral(n, w0, w1, self._clock))

    def waste_breakdown(self) -> dict[str, int]:
        """`internal` now, split four ways that sum to it: overreservation
        (`overreserved_bytes`), padding and out_of_window (`waste_parts`), rounding (the
        rest). Walks the live requests afresh rather than reading the running totals: what
        the checks hold `waste_parts` to."""
        view = self._view
        out = 0
        if view is not None:
            for live in self._live.values():
                out += self._view_mult(live) * view.out_of_window(self._tokens_of(live))
        over = self.overreserved_bytes()
        internal = self._internal_total() + out
        return {"overreservation": over, "padding": 0, "out_of_window": out,
                "rounding": internal - over - out}

    def group_kinds(self) -> tuple[str, ...]:
        """The kind of each KV-cache group (full, sliding_window, chunked_local, mla, mamba)
        of an allocator that keeps per-group block tables; () for the rest."""
        return ()

    def group_blocks(self) -> tuple[int, ...]:
        """Blocks held per KV-cache group, in `group_kinds` order; () for the rest."""
        return ()

    def summary_stats(self) -> dict[str, float | int]:
        """Allocator-specific figures for the run's summary."""
        return {}

    def take_stall(self) -> float:
        """Seconds of stall (moving live data) since last asked; the engine charges them."""
        return 0.0

    def take_moves(self) -> list[tuple[int, int, int, int]]:
        """(rid, old offset, new offset, bytes) of slabs moved since last asked."""
        return []

    def take_copies(self) -> list[tuple[int, int, int]]:
        """(rid, source block, destination block) of copies on write since last asked."""
        return []

    def take_evictions(self) -> list[int]:
        """Prefix caching: ids of idle cached blocks evicted since last asked."""
        return []

    def take_renamed(self) -> list[int]:
        """Requests whose block ids changed since last asked without a call for them."""
        return []

    def account(self, probe: Request | None = None) -> Accounting:
        """The budget's five parts now. `probe` is the request the free space is judged by."""
        token_states, reserved, internal, external, usable = self.parts(probe)
        return Accounting(
            capacity=self.capacity,
            token_states=token_states,
            reserved=reserved,
            internal=internal,
            external=external,
            usable_free=usable,
            largest_hole=self._largest_hole(),
            live=len(self._live),
        )

    def parts(self, probe: Request | None = None) -> tuple[int, int, int, int, int]:
        """`account(probe)`'s five parts in PARTS order, as a plain tuple: the engine asks
        this at every event, and building an Accounting costs more than computing it."""
        allocated = self._allocated_total()
        token_states = self.bytes_per_token * self.total_tokens()
        internal = self._internal_total()
        view = self._view
        if view is not None:  # bytes of tokens no layer reads again: held, not needed
            out = view.total(self._clock)
            token_states -= out
            internal += out
        usable = self._usable_free(probe)
        return (
            token_states,
            allocated - internal - token_states,
            internal,
            self.capacity - allocated - usable,
            usable,
        )

    def largest_hole(self) -> int:
        """Bytes of the largest free hole (the paged pool counts as one hole)."""
        return self._largest_hole()

    def integrate(
        self, n: int, probe: Request | None = None, w0: float = 1.0, w1: float = 0.0
    ) -> dict[str, float]:
        """Sum over the next `n` steps of account(after step j) x (w0 + w1*(j-1)), j=1..n.

        With w = step durations this is the exact time integral of each part while the batch
        stays the same; nothing is changed. Slab allocators hold their bytes fixed between
        admissions, so only token_states and reserved move, linearly.
        """
        return dict(zip((*PARTS, "saved"), self.integrals(n, probe, w0, w1), strict=True))

    def integrals(
        self, n: int, probe: Request | None, w0: float, w1: float
    ) -> tuple[float, float, float, float, float, float]:
        """`integrate`'s figures as a tuple, the parts in PARTS order and then saved (what the
        engine asks at every decode stretch: a dict of names costs more than the sums)."""
        b = self.bytes_per_token
        weight = n * w0 + w1 * n * (n - 1) / 2
        # sum_j j * w_j for j = 1..n
        jw = w0 * n * (n + 1) / 2 + w1 * (n - 1) * n * (n + 1) / 3
        tokens = b * (
            self._linear_tokens() * weight
            + self._dec_weight * jw
            + self._integrate_token_terms(n, w0, w1, weight)
        )
        allocated, internal = self._integrate_held(n, w0, w1, weight)
        view = self._view
        if view is not None:
            out = view.integral(n, w0, w1, self._clock)
            tokens -= out
            internal += out
        usable, external = self._integrate_free(probe, weight, allocated)
        return (
            tokens,
            allocated - internal - tokens,
            internal,
            external,
            usable,
            self._integrate_saved(n, w0, w1, weight),
        )

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal: ...

    @abstractmethod
    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal: ...

    @abstractmethod
    def _release(self, live: Live) -> None: ...

    @abstractmethod
    def _allocated_total(self) -> int: ...

    @abstractmethod
    def _internal_total(self) -> int: ...

    @abstractmethod
    def _usable_free(self, probe: Request | None) -> int: ...

    @abstractmethod
    def _largest_hole(self) -> int: ...

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        """A request joined (or left) the decode cohort; its phase is `live.base`."""
        return

    def _stepped(self) -> None:
        """The decode clock moved."""
        return

    def _integrate_held(self, n: int, w0: float, w1: float, weight: float) -> tuple[float, float]:
        """Weighted sums of allocated and internal bytes over the next n steps."""
        return self._allocated_total() * weight, self._internal_total() * weight

    def _integrate_free(
        self, probe: Request | None, weight: float, allocated: float
    ) -> tuple[float, float]:
        """Weighted sums of usable free and external bytes (the free space is fixed here)."""
        usable = self._usable_free(probe)
        return usable * weight, (self.capacity - self._allocated_total() - usable) * weight

    def _get(self, rid: int) -> Live:
        last = self._last
        if last is not None and last.req.rid == rid:
            return last
        try:
            live = self._live[rid]
        except KeyError:
            raise ValueError(f"request {rid} is not live") from None
        self._last = live
        return live

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self.capacity}, bytes_per_token="
            f"{self.bytes_per_token}, live={len(self._live)})"
        )
