"""The serving engine: a workload replayed against one allocator, continuously batched.

A thin SimPy layer. The serving loop is a chain of SimPy timeouts, each calling the loop back
when it fires; SimPy keeps the clock. Each turn of the loop is one *segment*: either a single
iteration in which something other than decoding happens (admissions, prefill chunks), or a
stretch of decode-only iterations that ends at the next event: a completion, an arrival that
could be admitted (not one queueing behind a waiting FCFS head), or the moment a decoder needs
a block and none is free (prefix caching with sample groups waiting: also the next eviction of
an idle cached block, see `_released`).
Inside a stretch every running request gains one token per iteration, so the allocator's
`step(n)` and `integrate(n, ...)` advance token counts, block counts, step times and the
accounting integrals in closed form: the cost grows with requests, never with tokens.

Iteration semantics (the reference the tests hold the fast path to):
1. Decoders claim their next token's slot first: if a block cannot be had, the most recently
   admitted request is preempted by recomputation (its memory freed, requeued at the head,
   its stored tokens to prefill again), as vLLM does. Then the prompts partway through take
   their next chunks, oldest first. Where a prompt partway runs ahead of a decoder in
   admission order (FCFS), the running requests take their tokens, chunks and
   blocks in admission order instead, as vLLM walks its running list: a decoder past the
   token budget takes no token in that iteration (`engine_walk.walk_running`).
2. Waiting requests are admitted in arrival order while `max_num_seqs`, the token budget
   (`max_num_batched_tokens` less one token per decoder) and the allocator allow. Strict FCFS
   stops at the first refusal; `admission="skip"` lets later requests that fit jump ahead
   (within `lookahead`). Slots follow vLLM: a slot holds a token the model has read, so a
   request is admitted with its prompt's P slots, each decode step takes one more, and it ends
   holding P + O - 1 (its last sampled token is never read; sample groups and beams keep one
   slot ahead, see `slot_request`). With chunked prefill the prompt arrives chunk by chunk.
3. The iteration takes base + a x batched_tokens + c x KV tokens read seconds, where every
   sequence reads its whole context (n samples of a request read a shared prompt n times).
4. At its end, prefilled requests start decoding; a request that stored its final token is
   done and frees its memory (static batching: the batch frees together when all are done).

Async scheduling (`async_scheduling`, vLLM's AsyncScheduler and its server's default; continuous
batching): vLLM schedules step k before step k-1's output is back, so for requests that end by
their output length (kvfrag's) four things differ from the synchronous scheduler, and nothing
else (tests/oracle/test_async_match.py):
- A request that stored its final token is done (its finish time is unchanged) but keeps its
  memory and its seat through the next iteration's scheduling (vLLM skips it: its last token is
  in flight), and is freed right after it. A pass that only frees such requests takes no time.
- It is still the newest running request to a shortage: preempted then, it is counted as
  preempted, freed, and finishes all the same (its token in flight is delivered).
- A preempted decoder's KV holds its processed tokens only (computed less the one in flight):
  prefix caching keeps only the full blocks within them (`Allocator.free_preempted`).
- The hybrid allocator's windows free by the tokens processed, computed less those in flight
  (`Allocator.set_async`, the in-flight tokens passed to `grow`: a decoder's token, a prompt's
  previous chunk; tests/oracle/test_hybrid_async_match.py).
A preempted decoder resumes with the same tokens as in the synchronous scheduler (its token in
flight is delivered before it is resumed).

With `policy="priority"` (vLLM's `SchedulingPolicy.PRIORITY`) the queue is ordered by (priority,
arrival, workload order), a lower value first, and a preempted request goes back in by that
key; the victim of a shortage is the running request with the largest (priority, arrival), the
first of them in admission order (it may have been scheduled already in this iteration: its
tokens go back to the budget). A stretch then ends at every arrival, which may jump the head.

Speculative decoding (`speculative`, sim/speculative.py): a decode step carries the token
sampled last and k drafts and gives 1 + the accepted drafts; every allocation reserves the
method's lookahead. Each decoder grows by its own draws, out of the allocator's decode cohort.
With a paged allocator the running requests' state lives in arrays (sim/spec_steps.py): an
iteration whose decoders go first is vectorised, and decode-only iterations join into one
segment as plain decoding's do, every step of every decoder following its draws as cumulative
sums (the allocator told a request's slots at its block crossings). Anything else (a prompt
partway, a binding budget, a shortage, policy priority, the allocation log, another allocator)
walks the running list, one iteration a segment (sim/engine_walk.py).

Requests that can never run (prompt over max_model_len, too large for an empty allocator,
or more sequences than max_num_seqs) are rejected with the reason, and counted per reason
(`REJECT_REASONS`). A static batch ends when its last running member finishes or is
preempted; its finished members free then.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import pandas as pd
import simpy
from kvfrag.sim.allocators.base import Allocator, Reason, Refusal, Request
from kvfrag.sim.allocators.paged import PagedAllocator
from kvfrag.sim.engine_config import EngineConfig, async_modelled
from kvfrag.sim.engine_log import AllocationLog
from kvfrag.sim.engine_preempt import preempt, release_held, rid_of, victim_of
from kvfrag.sim.engine_recording import record, record_stretch, result
from kvfrag.sim.engine_records import (
    TOO_MANY_SEQUENCES,
    RunResult,
    _Rows,
)
from kvfrag.sim.engine_requests import _Arrivals, _Inputs, _Outcomes, _Req
from kvfrag.sim.engine_timing import iteration_time, stretch
from kvfrag.sim.engine_walk import (
    continue_prefills,
    spec_schedule,
    spec_stretch,
    spec_unload,
    walk_decoders,
    walk_running,
)
from kvfrag.sim.interrupts import poll
from kvfrag.sim.spec_steps import SpecSteps, verify_objects
from kvfrag.sim.speculative import acceptance_for
from kvfrag.sim.units import check_size
from kvfrag.sim.waiting import PriorityQueue

_NEVER = {Reason.PROMPT_TOO_LONG, Reason.TOO_LARGE}
#: Allocators speculative decoding is not modelled with: EAGLE's block hashes cover one token
#: more (prefix caching), and vLLM's hybrid manager places draft layers in groups of their own
#: (as the layouts by layer type would: the floor, static-partition, two-level).
SPEC_NOT_MODELLED = frozenset({"prefix-caching", "hybrid", "floor", "static-partition",
                               "two-level"})
#: `run`'s progress callback is called at most once in this many turns of the serving loop
#: (the wall clock is read no more often), and this many seconds of wall time apart.
PROGRESS_TURNS = 256
PROGRESS_S = 0.2


class Engine:
    """Drives one allocator through one workload. Use `run()`; an Engine is single-use."""

    def __init__(
        self,
        workload: pd.DataFrame,
        allocator: Allocator,
        config: EngineConfig,
        progress: Callable[[int, int], None] | None = None,
    ):
        if allocator.live or allocator.total_tokens():
            raise ValueError("the allocator must be fresh (nothing live)")
        # (the time series' byte counts: int64, or float64 beside time averages, exact only
        # below 2**53)
        check_size(allocator.capacity, "the allocator's capacity")
        if not config.chunked_prefill and config.max_num_batched_tokens < allocator.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
                f"max_model_len ({allocator.max_model_len}) unless chunked_prefill is on"
            )
        self.alloc = allocator
        self.cfg = config
        if not config.log_allocations:
            allocator.defer_block_ids()  # block ids are read only to log them
        # A compacting allocator moves slabs: each request's placements are then recorded
        # (`_Req.moves`), so that its slab can be drawn where it was at each moment.
        self.track_moves = bool(getattr(allocator, "compaction", False))
        self.st = config.step_time
        self.chunk_cost = self.st.decode_kv_only  # prefill chunks' attention is timed apart
        self.prefill_attn_s = 0.0  # this iteration's prefill chunks' attention
        self.env = simpy.Environment()
        # SimPy's clock, read once after each timeout (`env.now` is a property: a Python call
        # at each of the several reads an event makes).
        self.now = 0.0
        # Speculative decoding (sim/speculative.py): each decoder takes its own tokens and
        # the accepted counts apply at the iteration's end.
        spec = self.spec = config.speculative
        self.acceptance = acceptance_for(spec, workload) if spec is not None else None
        self.lookahead = spec.lookahead if spec is not None else 0
        self.draft_slots = spec.draft_slots if spec is not None else 0
        self.spec_decode_tokens = 0  # this iteration's decoders' tokens (drafts included)
        # The running requests' speculative state as arrays (sim/spec_steps.py), and whether
        # an iteration whose decoders go first may take them vectorised: a paged allocator
        # (told a request's slots at its block crossings only), FCFS, continuous batching,
        # nothing logged. Block crossings are then counted in `block_bytes`.
        self.paged = allocator if isinstance(allocator, PagedAllocator) else None
        self.block_bytes = 0
        if self.paged is not None:
            self.block_bytes = self.paged.block_size * allocator.bytes_per_token
        self.specs: SpecSteps | None = None
        if spec is not None and self.acceptance is not None:
            self.specs = SpecSteps(spec, self.acceptance, allocator.max_model_len,
                                   async_modelled(config, allocator),
                                   self.block_bytes // allocator.bytes_per_token)
        self.spec_fast = (self.specs is not None and allocator.kind == "paged"
                          and self.block_bytes > 0 and not config.log_allocations
                          and config.policy != "priority" and config.batching != "static"
                          and not allocator.waste_split)
        # Requests as columns; engine state (`_Req`) exists only from arrival to retirement,
        # when its figures move into the result columns: memory follows the requests in
        # flight, not the workload's length.
        self.inputs = _Inputs(workload, spec, allocator.max_model_len,
                              async_modelled(config, allocator))
        if spec is not None and self.inputs.groups:
            raise ValueError("speculative decoding: sample groups and beams (n > 1) are not "
                             "modelled")
        if spec is not None and allocator.kind in SPEC_NOT_MODELLED:
            raise ValueError(f"speculative decoding with the {allocator.kind} allocator is not "
                             "modelled")
        self.made: dict[int, _Req] = {}  # idx -> state of requests arrived and not retired
        self.by_rid: dict[int, _Req] = {}  # rid -> state, for the requests made
        self.out = _Outcomes(self.inputs)
        self.reference = self.inputs.reference_request()
        # Waiting requests: FCFS, or vLLM's priority order (`sim.waiting`)
        self.by_priority = config.policy == "priority"
        self.queue: deque[_Req] = PriorityQueue() if self.by_priority else deque()
        # policy priority: prefill chunks granted this iteration (tokens, attention seconds),
        # which a later preemption of their request gives back
        self.granted: dict[_Req, tuple[int, float]] = {}
        self.walked = False  # policy priority: decoders took their slots one by one (a shortage)
        # This iteration's decoding sequences that took no token (a prefill chunk ahead of
        # them in admission order used the token budget: `engine_walk.walk_running`), and
        # their tokens.
        self.tokenless = 0
        self.tokenless_kv = 0
        # Running requests in admission order (the last one is the victim): a dict, so that a
        # completion leaves in O(1).
        self.running: dict[_Req, None] = {}
        self.seqs = 0  # sequences running (a request with n samples counts n)
        self.prefilling: list[_Req] = []  # admitted, prompt not fully stored yet
        self.long_cap = 0  # this iteration's long-prefill cap (0: none)
        self.dropped = 0  # decoders preempted by this iteration's prefill chunks (weight)
        # A memory refusal of the FCFS head holds until something is freed (`blocked_head`)
        self.head_stays = config.reserve_full_isl or not (
            config.chunked_prefill or config.long_prefill_token_threshold
        )
        self.prefilled: list[_Req] = []  # prompt fully stored this iteration
        # Async scheduling: requests done at the last iteration's end, still holding memory and
        # seat through this iteration's scheduling; those whose prefill ended then (their
        # last step did not decode); whether this turn freed any of the held.
        self.asynchronous = async_modelled(config, allocator)
        if self.asynchronous:
            allocator.set_async()
        # async: rid -> prefill tokens scheduled this iteration, and in the previous one (in
        # flight: a windowed group frees by the tokens processed, `Allocator.grow`)
        self.chunks_now: dict[int, int] = {}
        self.chunks_prev: dict[int, int] = {}
        self.held: list[_Req] = []
        self.fresh: list[_Req] = []
        self.released_now = False
        self.batch_done: list[_Req] = []  # static batching: finished, still holding memory
        self.held_done_tokens = 0
        self.next_of_user: dict[int, deque[int]] = {}
        self.arrivals = self._init_arrivals()
        self.rows = _Rows()  # the time series' rows
        # Time integral of each part (byte-seconds), in PARTS order (`_integrate`).
        self.area0 = self.area1 = self.area2 = self.area3 = self.area4 = 0.0
        self.busy_running = 0.0  # integral of running requests over time
        self.saved = 0.0  # integral of bytes saved by sharing
        self.overreserved = 0.0  # integral of internal bytes that are over-reservation
        # Integrals of internal's padding and out-of-window bytes, asked of the allocator
        # only where it has them (`Allocator.waste_split`: a hybrid model or allocator).
        self.waste_split = allocator.waste_split
        self.padding = 0.0
        self.out_of_window = 0.0
        # Blocks held per KV-cache group kind at each row, for an allocator with groups: the
        # kinds in first-appearance order, and each plan group's index among them.
        kinds = allocator.group_kinds()
        self.group_names: list[str] = list(dict.fromkeys(kinds))
        self.group_of: list[int] = [self.group_names.index(k) for k in kinds]
        self.rows.group_of = self.group_of
        self.prompt_lookups = 0  # tokens to prefill at every admission (resumptions too)
        self.prefix_hits = 0  # of them found in the prefix cache
        self.first_lookups = 0  # prompt tokens looked up at first admissions
        self.first_hits = 0  # of them found cached (re-admissions after a preemption apart)
        self.max_running = 0
        self.preemptions = 0
        self.preempted_now = False  # a request was preempted in this iteration
        self.recomputed = 0
        self.frag_blocked_s = 0.0
        self.head_reason: Reason | None = None
        # (request, frees, evictions) at a memory refusal of the FCFS head
        self.blocked_head: tuple[int, int, int] | None = None
        # The last memory refusal's request, its (tokens, whole sequence, cached, kept free,
        # gated) and the free bytes then, where `Allocator.refusal_by_free` (`_try_admit`)
        self.refused: _Req | None = None
        self.refused_key: tuple[int, int, int, int, bool] = (0, 0, 0, 0, False)
        self.refused_free = 0
        self.groups = self.inputs.groups
        self.stopped = False
        # every allocation, for `validate` (sim/engine_log.py); None unless asked
        self.log: AllocationLog | None = None
        if config.log_allocations:
            self.log = AllocationLog(allocator, self.by_rid)
        # progress(requests finished or rejected, requests): see `run`
        self.progress = progress
        self.turns = 0  # turns of the serving loop, and when progress was last reported
        self.reported = time.monotonic()
        self.retired = 0  # requests retired (completed and released, or rejected)

    # ------------------------------------------------------------------ set-up
    def _init_arrivals(self) -> _Arrivals:
        inp = self.inputs
        arrival = np.frombuffer(inp.arrival, dtype=np.float64)
        later = (np.frombuffer(inp.users, dtype=np.int64) >= 0) & np.isnan(arrival)
        for idx in np.flatnonzero(later).tolist():  # closed loop: sent after the user's last
            self.next_of_user.setdefault(inp.users[idx], deque()).append(idx)
        return _Arrivals(arrival, np.flatnonzero(~later))

    def _req(self, idx: int) -> _Req:
        """The engine state of request `idx`, made on its first use."""
        r = self.made.get(idx)
        if r is None:
            r = self.made[idx] = self.inputs.make(idx)
            self.by_rid[r.req.rid] = r
        return r

    def _retire(self, r: _Req) -> None:
        """`r` is over (completed and released, or rejected): its figures go to the result."""
        self.out.store(r)
        if self.acceptance is not None:
            self.acceptance.forget(r.req.rid)
        self.retired += 1
        del self.made[r.idx]
        del self.by_rid[r.req.rid]

    # -------------------------------------------------------------------- loop
    def run(self) -> RunResult:
        # The serving loop is a chain of SimPy timeouts, each calling back into the loop when
        # it fires (`_turn`): as a process, every event would also go through SimPy's
        # interpreted `_resume` and a generator's send (a bare loop of timeouts here: 0.85-1.2
        # us per event as a process, 0.69-0.88 us as callbacks).
        #
        # The cyclic garbage collector is paused for the run (and its previous state restored):
        # the run makes next to no cyclic garbage (8 objects, whatever its length and allocator:
        # tests/sim/test_engine.py holds it), but a long queue keeps hundreds of thousands of
        # requests alive, which every full collection walks again (1,000,000 requests on
        # worst-case slabs: 12 full collections, 18 % of the run). Reference counting still
        # frees everything else as it goes; the cycles wait for the next collection after it.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.env.timeout(0).callbacks.append(self._waited)
            self.env.run()
            if self.progress is not None:
                self.progress(len(self.inputs), len(self.inputs))
            spec_unload(self)  # (every slot held told to the allocator)
            return result(self)
        finally:
            if collecting:
                gc.enable()

    def _waited(self, _event: object) -> None:
        """A wait for the next arrival ended (or the run starts)."""
        self.now = self.env.now
        if self.log is not None:
            self.log.now = self.now
        self._turn()

    def _iterated(self, _event: object) -> None:
        """An iteration, or a decode stretch, ended."""
        self.now = self.env.now
        if self.log is not None:
            self.log.now = self.now
        self._sync_log()
        self._end_iteration()
        self._turn()

    def _turn(self) -> None:
        """The serving loop from now to its next timeout (which calls back when it fires), or
        to the end of the run."""
        env, cfg, progress = self.env, self.cfg, self.progress
        while True:
            self.turns += 1
            if not self.turns % PROGRESS_TURNS:
                poll()  # a pending signal's handler runs here (see sim/interrupts.py)
                # (the clock is read once in PROGRESS_TURNS turns only)
                if progress is not None and time.monotonic() - self.reported >= PROGRESS_S:
                    progress(self.retired, len(self.inputs))
                    self.reported = time.monotonic()
            self._release_arrivals(self.now)
            if cfg.max_time_s is not None and self.now >= cfg.max_time_s:
                self.stopped = True
                return
            if not self.running and not self.queue:
                if not self.arrivals.left:
                    return
                wait = self.arrivals.next_s - self.now
                if cfg.max_time_s is not None:
                    wait = min(wait, cfg.max_time_s - self.now)
                record(self, wait, 0)
                env.timeout(wait).callbacks.append(self._waited)
                return
            self.preempted_now = False
            if self.asynchronous:
                self.chunks_prev, self.chunks_now = self.chunks_now, {}
            self.prefill_attn_s = 0.0
            self.tokenless = self.tokenless_kv = 0
            if self.spec is not None:
                prefill_tokens, decoders = spec_schedule(self)
            elif self._prefill_ahead():
                decoders, chunks = walk_running(self)
                prefill_tokens = self._schedule(decoders, chunks)
            else:
                self._ensure_decode_room()
                decoders = self.alloc.decoding_weight  # sequences: n samples count n
                if decoders and not self.walked:
                    self.alloc.advance(1)  # _ensure_decode_room made room; nobody is done
                prefill_tokens = self._schedule(decoders)
            decoders -= self.dropped  # decoders a prefill chunk preempted take no token
            self.released_now = bool(self.held)
            if self.held:
                release_held(self)  # (async: the previous iteration's output applied)
            if self.specs is not None and self.asynchronous:
                # (the previous step's rejected drafts, known now)
                if self.specs.arrayed:
                    self.specs.roll_back()
                else:
                    for r in self.running:
                        st = r.spec
                        assert st is not None
                        st.computed -= st.rollback
                        st.rollback = 0
            if not prefill_tokens and not decoders:
                if (self.running or self.queue) and not (self.preempted_now or self.released_now):
                    raise RuntimeError("engine stalled: requests wait but none can run")
                continue  # every waiting request was rejected, or the step only preempted
            if prefill_tokens or self.spec is not None:
                # A compaction during admission stalls every running request. (Speculative
                # decoding: decode-only iterations joined where nothing happens between them.)
                dt, per_kv = iteration_time(self, decoders + prefill_tokens)
                dt += self.alloc.take_stall()
                if not prefill_tokens and self.specs is not None and spec_stretch(self, dt, per_kv):
                    return
                record(self, dt, 1)
                env.timeout(dt).callbacks.append(self._iterated)
                return
            # Decode only: this iteration and as many more as nothing happens.
            n, w0, w1, duration = stretch(self, decoders)
            record_stretch(self, n, w0, w1, duration)
            if n > 1:
                self.alloc.advance(n - 1)  # n is within steps_until_done and _full
            env.timeout(duration).callbacks.append(self._iterated)
            return

    # -------------------------------------------------------------- arrivals
    def _release_arrivals(self, now: float) -> None:
        arrivals = self.arrivals
        while arrivals.next_s <= now:
            r = self._req(arrivals.pop())
            r.status = "waiting"
            self.queue.append(r)

    def _next_of(self, r: _Req, now: float) -> None:
        """Closed loop: the user's next request comes `think` seconds after this one ends."""
        pending = self.next_of_user.get(r.user)
        if pending:
            nxt = self._req(pending.popleft())
            nxt.arrival = now + nxt.think
            self.arrivals.push(nxt.arrival, nxt.idx)

    # ------------------------------------------------------------- scheduling
    def _ensure_decode_room(self) -> None:
        """Preempt the newest requests until every decoder can store its next token."""
        alloc = self.alloc
        self.walked = False
        if self.by_priority and alloc.n_decoding and not alloc.can_step():
            walk_decoders(self)
            return
        while alloc.n_decoding and not alloc.can_step():
            # The decoders before the shortage took every free block, idle cached ones
            # (evicted) included, before the victim's blocks come back.
            alloc.evict_idle()
            preempt(self, victim_of(self))

    def _spec_leave(self, r: _Req) -> None:
        """`r` is freed: its slot in the arrays (if it has one) goes back."""
        if r.spec is not None and r.spec.slot >= 0 and self.specs is not None:
            self.specs.leave(r)

    def _set_long_cap(self) -> int:
        """This iteration's long-prefill cap: vLLM waives it when one request runs or waits
        (nobody to starve)."""
        cap = self.cfg.long_prefill_token_threshold
        if cap and len(self.running) + len(self.queue) < 2:
            cap = 0
        self.long_cap = cap
        return cap

    def _schedule(self, decoders: int, chunks: int | None = None) -> int:
        """Admit and prefill for this iteration; returns the prefill tokens it processes.
        `chunks`: the running requests' prefill tokens, when `walk_running` gave them."""
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens - decoders
        if chunks is None:
            cap = self._set_long_cap()
            used = continue_prefills(self, budget)
        else:
            cap, used = self.long_cap, chunks
        if self.preempted_now:
            return used  # as vLLM: no admissions in a step that had to preempt
        if cfg.batching == "static" and (self.running or self.batch_done):
            return used  # a static batch admits nobody until it has finished
        queue = self.queue
        if (queue and self.blocked_head == (queue[0].idx, *self._released())
                and self.alloc.steps_until_shrink() is None):
            return used  # FCFS head refused for memory and nothing was freed since
        self.head_reason = None
        i = 0
        # the token budget a request can still take; speculative decoding with a draft model:
        # one input slot more for each request scheduled (`draft_slots`)
        ds = self.draft_slots
        scheduled = 0
        if ds and self.specs is not None and self.specs.arrayed:
            scheduled = self.specs.n_scheduled
        elif ds:
            scheduled = sum(1 for r in self.running if r.spec is not None and r.spec.scheduled)
        while (i < len(self.queue) and self.seqs < cfg.max_num_seqs
               and (room := budget - used - ds * (scheduled + 1)) > 0):
            r = self.queue[i]
            if r.req.n > cfg.max_num_seqs:  # more sequences than a batch may ever hold
                del self.queue[i]
                self._reject(r, TOO_MANY_SEQUENCES)
                continue
            if self.seqs + r.req.n > cfg.max_num_seqs:
                break  # its samples do not fit in the batch
            # Prefix caching: not computed again (a resumed request's output included).
            hit = self.alloc.cached_prefix_tokens(r.req, r.prefill)
            work = r.prefill - hit
            if 0 < cap < work:
                work = cap  # (vLLM caps before it checks the budget: it chunks even unchunked)
            chunk = min(work, room) if cfg.chunked_prefill else work
            if chunk <= room and not (chunk := self.alloc.aligned_chunk(
                    r.req, hit, chunk, r.prefill, cfg.prefill_chunk_limit)):
                break  # (Mamba "align" mode: no block boundary in reach this step)
            reason: Reason | None
            if chunk > room and r.req.prompt >= self.alloc.max_model_len:
                reason = Reason.PROMPT_TOO_LONG  # (it would wait for a token budget forever)
            else:
                reason = self._try_admit(r, hit, chunk) if chunk <= room else None
            if reason is None and chunk <= room:
                del self.queue[i]
                used += chunk
                if self.asynchronous:
                    self.chunks_now[r.req.rid] = chunk
                scheduled += 1
                continue
            if reason is not None and reason in _NEVER:
                del self.queue[i]
                self._reject(r, reason.value)
                continue
            if i == 0:
                self.head_reason = reason  # None: waiting for token budget, not memory
                # (What it needs must not shrink by itself: a first chunk alone, as the
                # gate counts it without reserve_full_isl, shrinks with the budget left.)
                if reason is not None and cfg.admission == "fcfs" and self.head_stays:
                    self.blocked_head = (r.idx, *self._released())
            i += 1
            if cfg.admission == "fcfs" or i >= cfg.lookahead:
                break
        return used

    def _released(self) -> tuple[int, int]:
        """What lets a request refused for memory in, short of a step that shrinks memory: a
        free and, when the workload has sample groups, an eviction (prefix caching). A block
        evicted from a waiting group's cached prefix shortens what it finds cached, so the same
        token budget admits it with fewer tokens; past its prompt all n sequences hold each
        block's worth of them, so it may need up to n blocks less while the decoders took one.
        (A single request needs at most one block less: evictions alone never let it in,
        except on a Mamba hybrid with prefix caching, where an eviction can move the junction
        its first chunk stops at: the hybrid allocator counts such an eviction as a free.)"""
        return self.alloc.frees, self.alloc.evictions if self.groups else 0

    def _prefill_ahead(self) -> bool:
        """Whether a request partway through its prompt runs ahead of a decoder (admitted
        before it): vLLM then schedules that chunk before the decoder's token (continuous
        batching, FCFS or priority; otherwise every decoder goes first, as vLLM's order gives
        when no chunk is ahead)."""
        if not self.prefilling:
            return False
        if self.cfg.batching == "static":
            return False
        head, alloc = self.prefilling[0], self.alloc
        for r in reversed(self.running):
            if r is head:
                return False
            if alloc.is_decoding(r.req.rid):
                return True
        return False

    def _decodes(self, r: _Req) -> bool:
        """Whether `r` is past its prefill (speculative decoding: kept by the engine)."""
        st = r.spec
        return st.decoding if st is not None else self.alloc.is_decoding(r.req.rid)

    def _try_admit(self, r: _Req, hit: int, chunk: int) -> Reason | None:
        """Admit `r` with its first chunk; returns the refusal reason, or None if admitted."""
        alloc, cfg = self.alloc, self.cfg
        whole = hit + chunk == r.prefill
        tokens = hit + chunk + (r.lead if whole else 0)
        if r.spec is not None:  # (and the lookahead's slots)
            tokens = min(hit + chunk + self.lookahead, alloc.max_model_len)
        # vLLM's admission gate: the whole prompt (less its cached prefix) must fit, with the
        # watermark kept free while anybody else runs, even when only a first chunk is taken
        # (`reserve_full_isl`; off, only the first chunk and the watermark must fit).
        keep = alloc.watermark_bytes(cfg.watermark) if cfg.watermark and self.running else 0
        gated = bool(cfg.chunked_prefill or keep or self.long_cap)
        full = r.prefill + r.lead if cfg.reserve_full_isl else tokens
        # Refused for memory with as many bytes free or more: refused again (a hybrid model's
        # head is tried at every step that frees a block of a window, most of them too few)
        key = (tokens, full, hit, keep, gated)
        if (alloc.refusal_by_free and self.refused is r and self.refused_key == key
                and alloc.free_bytes() <= self.refused_free):
            return Reason.OUT_OF_MEMORY
        if gated:
            pool = alloc.pool_bytes()  # (all of it a request can take)
            if alloc.too_large(r.req) or alloc.bytes_for(r.req, r.prefill + r.lead) > pool:
                return Reason.TOO_LARGE  # (beams hold more at their fork than at their end)
            need = alloc.admission_bytes(r.req, full, hit)
            if need + keep > alloc.free_bytes():
                return self._refused_for_memory(r, key)
        grant = alloc.admit(r.req, tokens, decoding=False)
        self._apply_moves()
        if isinstance(grant, Refusal):
            if grant.reason is Reason.OUT_OF_MEMORY:
                return self._refused_for_memory(r, key)
            if grant.reason is Reason.FRAGMENTED:
                r.frag_refused = True
            return grant.reason
        if self.chunk_cost:
            self.prefill_attn_s += self.st.prefill_s(chunk, hit)
        self._log_op("admit", r.req.rid, grant.nbytes, grant.offset, grant.blocks)
        if math.isnan(r.admitted):
            r.admitted = self.now
        r.status = "running"
        r.prefill_left = r.prefill - hit - chunk
        if r.spec is not None:
            r.spec.computed, r.spec.scheduled, r.spec.drafts = hit + chunk, chunk, 0
        self.prompt_lookups += r.prefill  # tokens looked up (vLLM's prefix cache queries)
        self.prefix_hits += hit
        if not r.preemptions:  # a first admission: what reuse across requests gave
            self.first_lookups += r.prefill
            self.first_hits += hit
            r.hits = hit
        r.final = alloc.final_tokens(r.req.rid)
        if self.specs is not None and self.specs.arrayed:
            self.specs.enter(r, tokens)
        if grant.offset is not None:
            r.offset = float(grant.offset)
            if self.track_moves:
                if r.moves is None:
                    r.moves = []
                r.moves.append((self.now, grant.offset))
            if self.groups:
                r.offsets = alloc.slab_offsets(r.req.rid)
        self.running[r] = None
        self.seqs += r.req.n
        self.max_running = max(self.max_running, len(self.running))
        (self.prefilled if whole else self.prefilling).append(r)
        return None

    def _refused_for_memory(self, r: _Req, key: tuple[int, int, int, int, bool]) -> Reason:
        """An admission refused for memory; where `Allocator.refusal_by_free`, remembered, so
        that the same ask is not made again before more bytes are free (`_try_admit`)."""
        if self.alloc.refusal_by_free:
            self.refused, self.refused_key = r, key
            self.refused_free = self.alloc.free_bytes()
        return Reason.OUT_OF_MEMORY

    def _reject(self, r: _Req, reason: str) -> None:
        r.status = "rejected"
        r.reason = reason
        r.finished = self.now
        if r.user >= 0:
            self._next_of(r, self.now)
        self._retire(r)

    # -------------------------------------------------------------- iteration end
    def _end_iteration(self) -> None:
        alloc, now = self.alloc, self.now
        if self.asynchronous:
            self.fresh = [r for r in self.prefilled if r.status == "running"]
        for r in self.prefilled:
            if r.status == "running":
                if r.spec is not None:
                    r.spec.decoding = True
                else:
                    alloc.set_decoding(r.req.rid, True)
                if math.isnan(r.first_token):
                    r.first_token = now
        if self.specs is not None:
            if self.specs.arrayed:
                done = self.specs.verify(self.prefilled)
            else:
                verify_objects(self.running, self.prefilled, self.specs)
                done = sorted([r for r in self.running if r.spec is not None
                               and r.spec.decoding and r.spec.delivered >= r.output],
                              key=rid_of)
            self.prefilled.clear()
            for r in done:  # (together: in rid order, as the reference)
                self._complete(r)
            return
        self.prefilled.clear()
        while alloc.n_decoding and alloc.steps_until_done() == 0:
            first = alloc.first_done()
            assert first is not None  # (a decoder is done)
            self._complete(self.by_rid[first])
        if self.cfg.batching == "static" and not self.running:
            self._release_batch()

    def _release_batch(self) -> None:
        """Static batching: the finished members of a batch free their memory together."""
        alloc = self.alloc
        for r in self.batch_done:
            r.peak = max(r.peak, alloc.allocated_bytes(r.req.rid))
            r.released = self.now
            self._log_free(r)
            alloc.free(r.req.rid)
            self._retire(r)
        self.batch_done.clear()
        self.held_done_tokens = 0

    def _complete(self, r: _Req) -> None:
        alloc, rid, now = self.alloc, r.req.rid, self.now
        r.status = "completed"
        r.finished = now
        r.generated = r.req.n * (alloc.tokens(rid) - r.req.prompt + 1 - r.lead)
        if r.spec is not None:  # (its slots ran ahead of its tokens)
            r.generated = r.output
        if self.asynchronous:  # it keeps memory and seat through the next scheduling
            if self.specs is not None:
                self.specs.done_async(r)
            else:
                alloc.set_decoding(rid, False)
            self.held.append(r)
            if r.user >= 0:
                self._next_of(r, now)
            return
        del self.running[r]
        self.seqs -= r.req.n
        if self.cfg.batching == "static":
            alloc.set_decoding(rid, False)
            self.batch_done.append(r)
            self.held_done_tokens += r.req.n * alloc.tokens(rid)
        else:
            r.peak = max(r.peak, alloc.allocated_bytes(rid))
            r.released = now
            self._log_free(r)
            self._spec_leave(r)
            alloc.free(rid)
        if r.user >= 0:
            self._next_of(r, now)
        if self.cfg.batching != "static":
            self._retire(r)

    # ---------------------------------------------------------- allocation log
    def _log_op(self, op: str, rid: int, nbytes: int, offset: int | None, blocks=(),
                from_offset=-1) -> None:
        if self.log is not None:
            self.log.op(op, rid, nbytes, offset, blocks, from_offset)

    def _log_free(self, r: _Req, processed: int = 0) -> None:
        """Log `r`'s free; `processed`: see `free_preempted` (0: all its tokens)."""
        if self.log is not None:
            self.log.free(r, processed)

    def _sync_log(self) -> None:
        """Log the growth of every live request since its last entry, then the model's view."""
        if self.log is not None:
            self.log.sync(self._probe())

    def _apply_moves(self) -> None:
        """Slabs the allocator moved (compaction): update their offsets and log the moves."""
        for rid, old, new, nbytes in self.alloc.take_moves():
            r = self.by_rid[rid]
            if r.offset == old:  # its first slab (other samples' copies have no record here)
                r.offset = float(new)
                if r.moves is not None:
                    r.moves.append((self.now, new))
            self._log_op("move", rid, nbytes, new, from_offset=old)

    # --------------------------------------------------------------- recording
    def _probe(self) -> Request:
        return self.queue[0].req if self.queue else self.reference


def run(
    workload: pd.DataFrame,
    allocator: Allocator,
    config: EngineConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
):
    """Replay `workload` against a fresh `allocator`; returns records, writes nothing.

    `progress(done, total)`, if given, hears how many of the workload's requests are retired
    (finished or rejected): at most once in `PROGRESS_TURNS` turns of the serving loop and
    `PROGRESS_S` seconds of wall time apart while the run goes, and (total, total) at its end.
    It costs nothing per event; an exception it raises (KeyboardInterrupt) stops the run."""
    return Engine(workload, allocator, config or EngineConfig(), progress).run()
