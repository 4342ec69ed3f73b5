"""vLLM 0.33's hybrid KV-cache manager for full, MLA, sliding-window and chunked-local
attention and Mamba state (`mamba_cache_mode` "none"). This class models it without prefix
caching; with `prefix_caching=True`, `make_allocator` builds its subclass
`kvfrag.sim.hybrid.caching.HybridPrefixCaching` (vLLM's block pool kept block by block; Mamba
groups there run in mode "align"). (mypyc compiles this class: it has no `__new__` to choose.)

The plan (`kvfrag.sim.hybrid.planner.plan`) cuts the budget into `num_blocks` block ids of one
page size; block 0 is the pool's null block, the other `usable_blocks` are shared by every
KV-cache group. A block id belongs to one group of one request at a time. Per request and per
group there is a block table, kept by one single-type manager per kind of group
(vLLM's `single_type_kv_cache_manager.py`):

- full attention and MLA: ceil(L / bs) blocks for L stored tokens;
- sliding window W: the blocks wholly before token P - W + 1 are skipped (replaced by the null
  block and freed), P being the tokens *processed* when the request last asked for slots
  (`get_num_skipped_tokens` / `remove_skipped_blocks`; freeing runs inside `allocate_slots`,
  before new blocks are counted);
- chunked local C: every block of the chunks before floor(P / C) x C is freed;
- Mamba state, mode "none": one block per request per group for its whole life (vLLM's Mamba
  block size is max_model_len; the state of the last token is all a layer reads).

The managers are `kvfrag.sim.hybrid.managers`' classes, one per kind of group; this class is
their coordinator. Mamba's "align" mode (the current state block, the previous one until the
next step, chunks scheduled on block boundaries) is what vLLM 0.33 runs with prefix caching,
and only then (`MambaModelConfig.verify_and_update_config` turns "align" into "none" without
it): `HybridPrefixCaching` models it; here "align" is refused. (vLLM 0.33 turns prefix
caching on by default for hybrid models, so "none" is a server run with
`--no-enable-prefix-caching`.)

P is what vLLM's `allocate_slots` frees by: the tokens computed before this allocation. An
admission of T tokens holds every block of them (P = 0) until the request's next allocation;
`grow(old -> new)` frees by P = old then takes blocks up to `new`; a decode step from L to L + 1
frees by P = L. So a decoder of L tokens holds ceil(L / bs) - floor(max(0, L - W) / bs) blocks
per sliding group, except right after it joins the cohort, when its prefill's blocks are still
held (vLLM frees them at the first decode step: issue #30166).

Async scheduling (`set_async`, vLLM's AsyncScheduler): vLLM frees by the tokens *processed*,
computed less those in flight (`allocate_slots` passes `num_computed_tokens -
num_in_flight_tokens` to `remove_skipped_blocks`): the tokens scheduled for the request in the
previous step, whose output is not applied yet. A chunk grows by P = old - the previous chunk
(`grow`'s `in_flight`, from the engine: 0 when the request was not scheduled then); a decoder's
first step frees by the tokens before its final chunk, every later one by P = L - 1 (its last
token in flight): the cohort's `lag`; one that took no token in a step (`unscheduled`) frees
by all its tokens at its next.

The coordinator (vLLM's `kv_cache_coordinator.py` / `kv_cache_manager.py`) sums over groups:
an allocation is granted when the blocks it takes, less the blocks it frees first, fit in the
free pool. A decode step of the cohort is checked as vLLM's scheduler walks its running queue:
request after request in admission order (`_live`'s order, the engine's running order), each
freeing its skipped blocks and then taking its new ones, so the step is refused
(`steps_until_full` 0, and the engine preempts the last admitted) when an earlier decoder
finds too few free even though a later one's frees would cover it. Where the decoders' most
possible blocks fit, the closed-form bound answers without walking. The admission gate
(`admission_bytes`) is vLLM's `scheduler_reserve_full_isl` check (on by default): the whole
sequence (a resumed request's generated tokens too) must fit in the free block ids, sliding
and chunked groups capped at their `max_admission_blocks_per_request`; `bytes_for` is that
capped count, the most a chunked prefill ever holds.

Accounting (exact integers; `page` the bytes of one block id, tb the bytes per token of a
group's real layers, bs its block size, F the request's final length):
- token_states: per full/MLA layer every stored token, per sliding layer the last min(W, L)
  tokens, per chunked layer the tokens of the chunk of its last token, per Mamba layer its
  state (unpadded); by each layer's real kind, also where the manager is off and its group
  is promoted to full attention (the tokens it keeps past its window are out of window);
- reserved: per group, the slots in held blocks the request will still write
  (min(F, ceil(L / bs) x bs) - L tokens, x tb);
- internal: everything else held: out-of-window tokens still in held blocks, padding (a
  block's page less bs x tb, or less the Mamba state: padding layers, pages padded to the one
  page size), slots past F;
- external: the budget beyond the usable pool (the null block and the remainder of
  budget // page), as paged.py counts its budget's tail;
- usable_free: free block ids x page.
The running totals carry padding and out_of_window too, so `waste_parts()` and
`waste_integrals()` give the split exactly, as `parts()` and `integrals()` the five parts
(rounding, the slots past F, is the rest); `waste_breakdown()` walks the live requests afresh
for checks.

Cost: the decode cohort's figures are running sums in the decode clock, counts per residue of
each kind of term (`sim.hybrid.cohort`), so the figures, `integrate`, `steps_until_full` and
`steps_until_shrink` cost about the same however many requests decode: a decoder is rebuilt
only at a few lengths in its life (window edges, chunk starts, its last block), and only the
steps where blocks taken could overrun the pool before blocks freed come back walk their
decoders, in running order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvfrag.sim.allocators.base import (
    Allocator,
    Grant,
    Live,
    Reason,
    Refusal,
    Request,
    positive_int,
)
from kvfrag.sim.allocators.paged import FreeIds
from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.hybrid.cohort import Cohort
from kvfrag.sim.hybrid.forms import NEVER, Figures
from kvfrag.sim.hybrid.managers import Manager, managers_for
from kvfrag.sim.hybrid.planner import MAMBA_CACHE_MODES, Plan, plan
from kvfrag.sim.layers import FullAttention, LayerStack
from kvfrag.sim.model_view import ModelView
from mypy_extensions import mypyc_attr


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class HybridAllocator(Allocator):
    """vLLM's hybrid KV-cache manager: one shared pool of block ids, one table per group."""

    kind = "hybrid"

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        block_size: object = 16,
        hybrid_kv_cache_manager: object = True,
        stack: object = None,
        max_num_batched_tokens: object = 8192,
        concurrent_batches: object = 2,
        prefix_caching: object = False,
        mamba_cache_mode: object = "none",
        prefix_cache_retention_interval: object = 0,
        geometry: KVGeometry | None = None,
    ) -> None:
        super().__init__(capacity, bytes_per_token, max_model_len)
        if stack is None and geometry is not None and geometry.token_bytes is None:
            # A plain full-attention model: its stack is `layers` alike layers.
            layer = FullAttention(geometry.kv_heads, geometry.head_dim, geometry.dtype_bytes)
            stack = LayerStack(geometry.name, (layer,) * geometry.layers)
        if not isinstance(stack, LayerStack):
            raise ValueError("the hybrid allocator needs the model's layers (a LayerStack)")
        if not isinstance(hybrid_kv_cache_manager, bool):
            raise ValueError(
                f"hybrid_kv_cache_manager must be true or false, not {hybrid_kv_cache_manager!r}"
            )
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be true or false, not {prefix_caching!r}")
        if prefix_caching and type(self) is HybridAllocator:
            raise ValueError("prefix caching is modelled by HybridPrefixCaching "
                             "(make_allocator builds it)")
        retention = prefix_cache_retention_interval
        if retention is not None and (not isinstance(retention, int) or isinstance(retention, bool)
                                      or retention < 0):
            raise ValueError("prefix_cache_retention_interval must be a whole number of tokens "
                             f"(0 or more) or null, not {retention!r}")
        if retention != 0 and not prefix_caching:
            raise ValueError("prefix_cache_retention_interval needs prefix_caching true")
        self.retention: int | None = retention
        if mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, not "
                f"{mamba_cache_mode!r}"
            )
        if mamba_cache_mode == "align" and not prefix_caching:
            raise ValueError(
                "mamba_cache_mode 'align' needs prefix caching (prefix_caching: true; vLLM "
                "0.33 turns it into 'none' without it, and runs it whenever prefix caching is on)"
            )
        if self.bytes_per_token != stack.full_bytes_per_token:
            raise ValueError(
                f"bytes_per_token is {self.bytes_per_token}, but model {stack.name!r} keeps "
                f"{stack.full_bytes_per_token} bytes per token with every layer full"
            )
        bs = positive_int("block_size", block_size)
        in_flight = positive_int("max_num_batched_tokens", max_num_batched_tokens)
        in_flight *= positive_int("concurrent_batches", concurrent_batches)
        self.stack = stack
        self.plan: Plan = plan(
            stack, self.capacity, bs, hybrid_kv_cache_manager, max_model_len=self.max_model_len,
            mamba_cache_mode="none", prefix_caching=prefix_caching,
            max_num_batched_tokens=positive_int(
                "max_num_batched_tokens", max_num_batched_tokens),
            concurrent_batches=positive_int("concurrent_batches", concurrent_batches),
        )
        # One manager per kind of group; plan group -> its manager's index.
        managers, manager_of = managers_for(self.plan, stack, in_flight, self.max_model_len)
        self._setup(bs, managers, manager_of, self._manager_views(managers, manager_of),
                    self.plan.page_bytes, self.plan.usable_blocks)

    def _setup(self, block_size: int, managers: tuple[Manager, ...], manager_of: list[int],
               reads: list[ModelView | None], page: int, num_blocks: int) -> None:
        """The state every coordinator over these managers keeps (`static-partition` builds
        its own managers and pools, then this): `page` the bytes of one block id of the
        running totals, `num_blocks` the ids requests can hold."""
        self.block_size = block_size
        self.block_bytes = self.page = page
        self.num_blocks = num_blocks  # block ids requests can hold
        self.managers, self._manager_of = managers, manager_of
        self._stack_ids = FreeIds(num_blocks + 1)
        self._stack_ids.pop()  # block 0: the null block
        self._proc: dict[int, int] = {}  # rid -> tokens processed at its last allocation
        # Async scheduling: a decoder's last token is in flight when it steps (1; 0: not async)
        self._lag = 0
        self._last_n: dict[int, int] = {}  # async: rid -> tokens its last allocation scheduled
        self._first: dict[int, int] = {}  # async: decoder rid -> processed at its first step
        # rid -> the parts (`_parts_of`) a request outside the cohort adds to the running
        # totals, as added: taken out again as they are, not recounted
        self._held: dict[int, Figures] = {}
        self._joined: dict[int, int] = {}  # decoder rid -> clock when it joined the cohort
        # rid -> per manager, per group: (skipped blocks named so far, ids of held blocks)
        self._tables: dict[int, list[list[list[int]]]] = {}
        self._named_start: dict[int, list[int]] = {}
        self._deferred = False
        self._freeing = -1  # the rid `free` is releasing, while it does
        self._version = 0
        # What each manager's real layers read: promoted groups (the manager off) keep every
        # token, but their sliding and chunked layers read only their window; None where
        # every layer of the manager reads every token.
        self._reads = reads
        self.waste_split = True
        # Running totals of (blocks, token_states, reserved, internal, padding,
        # out_of_window, then each manager's held blocks per group): over the
        # requests outside the decode cohort (each at its (tokens, processed)), the cohort's
        # in `_cohort` (`sim.hybrid.cohort`: sums in the decode clock).
        self._width = 6 + len(self.managers)
        self._cohort = Cohort(self.managers, self._reads, self.page, self.max_model_len)
        self._rank: dict[int, int] = {}  # rid -> its admission's rank (the running order)
        self._admissions = 0
        # `_integrals6`'s last answer: the engine asks the parts, then the waste, of a stretch
        # (each key kept as plain attributes: a tuple made and compared per question cost
        # about as much as a short answer)
        self._integrals_clock = self._integrals_version = self._integrals_n = -1
        self._integrals_w0 = self._integrals_w1 = 0.0
        self._integrals_sums: list[float] = []
        # `steps_until_full`'s and `steps_until_shrink`'s last answers (clock, version)
        self._full_clock = self._full_version = -1
        self._full_result: int | None = None
        self._shrink_clock = self._shrink_version = -1
        self._shrink_result: int | None = None
        # (an admission is refused only for more blocks than are free: `Allocator`'s flag;
        # not so for the subclasses that cache prefixes or place large pages)
        self.refusal_by_free = type(self) is HybridAllocator
        # (`parts` reads the cohort's figures itself where `_totals` is this class's)
        self._cohort_parts = type(self) is HybridAllocator

    # ------------------------------------------------------------- per request
    def _state(self, live: Live) -> tuple[int, int]:
        """(tokens, processed) of a request now."""
        rid = live.req.rid
        tokens = self._tokens_of(live)
        if live.decoding and self._joined[rid] != self._clock:
            if self._lag and self._joined[rid] == self._clock - 1:
                return tokens, self._first[rid]
            return tokens, tokens - 1 - self._lag
        return tokens, self._proc[rid]

    def _blocks(self, tokens: int, processed: int) -> int:
        return self._cohort.blocks_of(tokens, processed)

    def _manager_views(self, managers: tuple[Manager, ...],
                       manager_of: list[int]) -> list[ModelView | None]:
        """Per manager, the model view of its groups' real layers (`sim.model_view`)."""
        layers: list[list] = [[] for _ in managers]
        for g, mi in zip(self.plan.groups, manager_of, strict=True):
            layers[mi].extend(self.stack.layers[i] for i in g.layers)
        return [ModelView.of(LayerStack(self.stack.name, tuple(ls))) if ls else None
                for ls in layers]

    def _parts_of(self, tokens: int, processed: int, final: int) -> Figures:
        """(blocks, token_states, reserved, internal, padding, out_of_window, then each
        manager's held blocks per group) of one request (`Cohort.parts_of`)."""
        return self._cohort.parts_of(tokens, processed, final)

    def waste_breakdown(self) -> dict[str, int]:
        """Internal bytes now, split: padding (a block's page beyond its groups' real slots
        or Mamba state), out_of_window (written tokens in held blocks that no layer reads any
        more), and rounding (slots no token will fill); no over-reservation. Walks the live
        requests afresh, apart from the running totals: what checks hold those to."""
        padding = out = 0
        for live in self._live.values():
            tokens, processed = self._state(live)
            for m, view in zip(self.managers, self._reads, strict=True):
                held = m.held(tokens, processed)
                padding += (held * (m.groups * self.page - m.block_size * m.token_bytes)
                            - m.state_bytes)
                written = tokens - m.skipped_blocks(processed) * m.block_size
                tb = m.token_bytes
                # bytes its layers read: by the manager's kind, or promoted layers' real kinds
                read = (m.needed(tokens) * tb if m.kind != "full" or view is None
                        else tokens * tb - view.out_of_window(tokens))
                out += written * tb - read
        internal = self._totals()[3]
        return {"overreservation": 0, "padding": padding, "out_of_window": out,
                "rounding": internal - padding - out}

    def waste_parts(self) -> tuple[int, int]:
        totals = self._cohort.figures(self._clock)  # (`_totals`, native figures)
        return totals.f4, totals.f5

    def waste_integrals(self, n: int, w0: float, w1: float) -> tuple[float, float]:
        sums = self._integrals6(n, w0, w1)
        return sums[4], sums[5]

    def group_kinds(self) -> tuple[str, ...]:
        return tuple(g.kind for g in self.plan.groups)

    def _totals(self) -> Sequence[int]:
        """(blocks, token_states, reserved, internal, padding, out_of_window, then each
        manager's held blocks per group) over live requests: the running totals."""
        return self._cohort.figures(self._clock).as_list()

    def _add_fixed(self, parts: Figures, sign: int) -> None:
        self._cohort.add_fixed(parts, sign)

    def _stepped(self) -> None:
        self._cohort.stepped(self._clock)

    # ----------------------------------------------------------------- queries
    def free_blocks(self) -> int:
        return self.num_blocks - self._cohort.blocks_now(self._clock)

    def group_blocks(self) -> tuple[int, ...]:
        """Blocks held per KV-cache group, in the plan's group order (vLLM's single-type
        managers' tables, nulls left out), summed over live requests."""
        figures = self._cohort.figures(self._clock)
        # (each manager's count made an int object once, not once per group: `object`
        # items are not unboxed and boxed again)
        held: list[object] = [figures.get(6 + mi) for mi in range(len(self.managers))]
        return cast(tuple[int, ...], tuple([held[mi] for mi in self._manager_of]))

    def blocks_of(self, rid: int) -> int:
        held = self._held.get(rid)  # (outside the cohort: its parts as counted)
        if held is not None:
            return held.f0
        return self._blocks(*self._state(self._get(rid)))

    def allocated_bytes(self, rid: int) -> int:
        return self.blocks_of(rid) * self.page

    def admit_shortfall(self, tokens: int) -> int:
        """Blocks an admission of `tokens` tokens would need beyond the free ones (0: it would
        be granted); nothing changes (see `grow_shortfall`)."""
        return max(0, self._blocks(tokens, 0) - self.free_blocks())

    def grow_shortfall(self, rid: int, n: int, in_flight: int = 0) -> int:
        """Blocks `grow(rid, n, in_flight)` would need beyond the free ones (0: it would be
        granted); nothing changes. A coordinator of several pools (`static-partition`) asks
        each before it grows any, so that a refusal leaves every pool as it was."""
        live = self._get(rid)
        old = self._tokens_of(live)
        proc = max(0, old - in_flight) if self._lag else old
        return max(0, self._blocks(old + n, proc) - self.blocks_of(rid) - self.free_blocks())

    def bytes_for(self, req: Request, tokens: int) -> int:
        """The most the request holds while its first `tokens` are prefilled: every group's
        blocks for them, sliding and chunked groups capped at their admission cap (vLLM's
        `max_admission_blocks_per_request`: chunks of at most the in-flight tokens free the
        blocks behind the window as they go). What `admit(req, tokens)` takes whenever
        `tokens` fit in one step's token budget, as every admission the engine makes does;
        the engine's gate asks it whether a prompt can ever be prefilled in this pool."""
        blocks = 0
        for m in self.managers:
            need = -(-tokens // m.block_size)
            blocks += m.groups * (need if m.cap is None else min(need, m.cap))
        return blocks * self.page

    def admission_bytes(self, req: Request, tokens: int, hit: int) -> int:
        """vLLM's full-sequence gate (`scheduler_reserve_full_isl`): every group's blocks for
        the whole sequence (a resumed request's generated tokens too), sliding and chunked
        groups capped at their admission cap. Plus the whole pages of the pool's unusable
        tail (the null block, the remainder of budget // page), which `free_bytes()` counts
        but no request can take: the engine's `need + keep > free_bytes()` then compares
        block counts, as vLLM compares with its free block queue."""
        tail = (self.capacity - self.num_blocks * self.page) // self.page
        return self.bytes_for(req, tokens) + tail * self.page

    def watermark_bytes(self, fraction: float) -> int:
        return int(fraction * self.num_blocks) * self.page

    def too_large(self, req: Request) -> bool:
        """Whether the request, decoding one token at a time to its final length, ever needs
        more blocks than exist (its most, over the last block-size periods)."""
        final = min(req.final, self.max_model_len)
        lo = max(1, final - max(m.peak_span() for m in self.managers))
        # Full groups only grow; sliding/chunked counts repeat with the block size, and are
        # largest by the end unless the request ends inside its first window; Mamba's hold.
        peak = max(self._blocks(t, max(0, t - 1 - self._lag)) for t in range(lo, final + 1))
        return peak > self.num_blocks

    def summary_stats(self) -> dict[str, float | int]:
        p = self.plan
        return {
            "hybrid_groups": len(p.groups),
            "hybrid_padding_layers": p.padding_layers,
            "hybrid_page_bytes": p.page_bytes,
            "hybrid_num_blocks": p.num_blocks,
            "hybrid_scheduler_block_size": p.scheduler_block_size,
        }

    def defer_block_ids(self) -> None:
        self._deferred = True

    def unscheduled(self, rid: int) -> None:
        """Its next step frees by all its tokens: it joins the cohort again with nothing in
        flight (its first step's correction)."""
        live = self._get(rid)
        if self._lag and live.decoding:
            self._set_decoding(live, False)
            self._last_n[rid] = 0
            self._set_decoding(live, True)

    def set_async(self) -> None:
        """Async scheduling: free by the tokens processed (see the module)."""
        if self._live:
            raise ValueError("set_async before any request is admitted")
        super().set_async()
        self._lag = 1
        self._cohort.set_lag(1)

    # ------------------------------------------------------------------ block ids
    def group_tables(self, rid: int) -> list[tuple[int, ...]]:
        """vLLM's `req_to_blocks` per group, in the plan's group order: 0 (the null block) for
        each skipped block, then the held ids."""
        live = self._get(rid)
        self._name(live)
        tables = self._tables[rid]
        starts = self._named_start[rid]
        out: list[tuple[int, ...]] = []
        for mi in range(len(self.managers)):
            for ids in tables[mi]:
                out.append((0,) * starts[mi] + tuple(ids))
        return out

    def block_table(self, rid: int) -> tuple[int, ...]:
        """Every block id the request holds, group after group (nulls left out)."""
        live = self._get(rid)
        self._name(live)
        return tuple(b for groups in self._tables[rid] for ids in groups for b in ids)

    def block_tables(self, rid: int) -> list[tuple[int, ...]]:
        return [self.block_table(rid)]

    def _name(self, live: Live, state: tuple[int, int] | None = None) -> tuple[int, ...]:
        """Bring the request's named ids to its counts (`state`: its (tokens, processed),
        default now): skipped ones given back, new ones taken."""
        rid = live.req.rid
        tokens, processed = self._state(live) if state is None else state
        tables = self._tables.setdefault(rid, [[[] for _ in range(m.groups)]
                                              for m in self.managers])
        self._named_start.setdefault(rid, [0] * len(self.managers))
        self._trim(rid, tokens, processed)
        need = 0
        for mi, m in enumerate(self.managers):
            need += m.groups * (m.held(tokens, processed) - len(tables[mi][0]))
        if need > len(self._stack_ids):
            for other in list(self._tables):
                if other != rid:
                    self._trim(other, *self._state(self._live[other]))
        new: list[int] = []
        for mi, m in enumerate(self.managers):
            for ids in tables[mi]:
                take = m.held(tokens, processed) - len(ids)
                if take > 0:
                    got = self._stack_ids.take(take)
                    ids.extend(got)
                    new.extend(got)
        return tuple(new)

    def _trim(self, rid: int, tokens: int, processed: int) -> None:
        tables, starts = self._tables[rid], self._named_start[rid]
        for mi, m in enumerate(self.managers):
            skip = m.skipped_blocks(processed)
            drop = skip - starts[mi]
            if drop > 0:
                for ids in tables[mi]:
                    gone = ids[:drop]
                    del ids[:drop]
                    self._stack_ids.give(gone)
                starts[mi] = skip

    def _name_new(self, live: Live, tokens: int, processed: int) -> tuple[int, ...]:
        if self._deferred:
            return ()
        return self._name(live, (tokens, processed))

    # -------------------------------------------------------------------- hooks
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        rid = live.req.rid
        if live.req.n > 1:
            raise ValueError(
                f"request {rid}: the hybrid allocator does not model sample groups (n > 1) yet"
            )
        need = self._blocks(tokens, 0)
        if need > self.num_blocks:
            return Refusal(rid, Reason.TOO_LARGE, need * self.page, self.free_bytes(),
                           "needs more blocks than exist")
        if need > self.free_blocks():
            return Refusal(rid, Reason.OUT_OF_MEMORY, need * self.page, self.free_bytes())
        ids = self._name_new(live, tokens, 0)
        self._admitted(live, tokens)
        return Grant(rid, need * self.page, live.cap, blocks=ids)

    def _admitted(self, live: Live, tokens: int) -> Figures:
        """Count an admission of `tokens` granted (its parts, made only then: refusals are
        common), in running order; its parts."""
        rid = live.req.rid
        self._proc[rid] = 0
        self._last_n[rid] = tokens
        self._admissions += 1
        self._rank[rid] = self._admissions
        parts = self._parts_of(tokens, 0, live.final)
        self._held[rid] = parts
        self._add_fixed(parts, 1)
        self._changed()
        return parts

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        rid = live.req.rid
        held = self._held[rid]  # (its parts at (old, processed), as added)
        proc = max(0, old - self.in_flight_now) if self._lag else old
        want = self._blocks(new, proc)
        if want - held.f0 > self.free_blocks():
            return Refusal(rid, Reason.OUT_OF_MEMORY, (want - held.f0) * self.page,
                           self.free_bytes())
        ids = self._name_new(live, new, proc)
        return Grant(rid, self._grown(live, old, new, proc) * self.page, live.cap, blocks=ids)

    def _grown(self, live: Live, old: int, new: int, proc: int) -> int:
        """Count a chunk from `old` to `new` tokens granted, freed by `proc` processed; the
        blocks it took (those it freed not netted out: vLLM's count of new blocks)."""
        rid = live.req.rid
        parts = self._parts_of(new, proc, live.final)
        self._add_fixed(self._held[rid], -1)
        self._add_fixed(parts, 1)
        self._held[rid] = parts
        self._proc[rid] = proc
        self._last_n[rid] = new - old
        self._changed()
        return sum(m.groups * (-(-new // m.block_size) - -(-old // m.block_size))
                   for m in self.managers)

    def free(self, rid: int) -> int:
        """(`Allocator.free`.) A decoder freed leaves the cohort without its parts counted
        outside it: they would be taken out again at once (`_cohort_changed`)."""
        self._freeing = rid
        try:
            return super().free(rid)
        finally:
            self._freeing = -1

    def _release(self, live: Live) -> None:
        rid = live.req.rid
        if rid in self._held:  # (not: a decoder, freed as it left the cohort)
            self._add_fixed(self._held[rid], -1)
            del self._held[rid]
        if self._tables:  # (block ids named: not while the engine defers them)
            for groups in self._tables.pop(rid, []):
                for ids in groups:
                    self._stack_ids.give(ids)
            self._named_start.pop(rid, None)
        # (`in`, then `del`: compiled, `dict.pop` is a generic method call, several times
        # the cost, and every request released goes through these)
        if rid in self._rank:
            del self._rank[rid]
        if rid in self._proc:
            del self._proc[rid]
        if rid in self._joined:
            del self._joined[rid]
        if rid in self._last_n:
            del self._last_n[rid]
        if rid in self._first:
            del self._first[rid]
        self._changed()

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        rid = live.req.rid
        if decoding:
            held = self._held[rid]
            del self._held[rid]
            self._add_fixed(held, -1)
            self._joined[rid] = self._clock
            first = -1
            if self._lag:  # its first step frees by the tokens before its last allocation
                first = self._first[rid] = live.base + self._clock - self._last_n.get(rid, 1)
            self._cohort.join(rid, live.base, live.final, self._proc[rid], self._clock, held,
                              first)
        else:
            self._cohort.leave(rid, self._clock)
            joined = self._joined[rid]
            del self._joined[rid]
            if joined != self._clock:  # stepped since joining: processed all but the last
                tokens = live.base
                self._proc[rid] = (self._first[rid] if self._lag and joined == self._clock - 1
                                   else tokens - 1 - self._lag)
                self._last_n[rid] = 1
            if rid != self._freeing:
                parts = self._parts_of(live.base, self._proc[rid], live.final)
                self._held[rid] = parts
                self._add_fixed(parts, 1)
        self._changed()

    def _changed(self) -> None:
        self._version += 1

    def _allocated_total(self) -> int:
        return self._cohort.blocks_now(self._clock) * self.page  # (blocks alone: `free_bytes`)

    def _internal_total(self) -> int:
        return self._totals()[3]

    def _usable_free(self, probe: Request | None) -> int:
        return self.free_blocks() * self.page

    def _largest_hole(self) -> int:
        return self._usable_free(None)

    def parts(self, probe: Request | None = None) -> tuple[int, int, int, int, int]:
        if self._cohort_parts:  # (`_totals` read as native figures, not made a list)
            f = self._cohort.figures(self._clock)
            blocks, token_states, reserved, internal = f.f0, f.f1, f.f2, f.f3
        else:
            t = self._totals()
            blocks, token_states, reserved, internal = t[0], t[1], t[2], t[3]
        usable = (self.num_blocks - blocks) * self.page
        return (token_states, reserved, internal,
                self.capacity - self.num_blocks * self.page, usable)

    # ------------------------------------------------------------ the cohort
    def steps_until_full(self) -> int | None:
        if self._full_clock == self._clock and self._full_version == self._version:
            return self._full_result
        done = self.steps_until_done()
        result = None if done is None else self._steps_fit(done, NEVER)
        self._full_clock, self._full_version, self._full_result = (
            self._clock, self._version, result)
        return result

    def _steps_fit(self, done: int, walk: int) -> int:
        """Decode steps (at most `done`) before a decoder, in running order, finds too few
        free blocks: the cohort's look-ahead on the one pool (`walk`: the most steps walked
        where its bound does not settle it; `Cohort.steps_until_full`)."""
        return self._cohort.steps_until_full(self._clock, done, self.free_blocks(),
                                             self._rank.__getitem__, walk)

    def can_step(self) -> bool:
        """(`Allocator.can_step`.) Where the closed-form bound does not settle it, only the
        next step is walked: the engine asks before each iteration, and asks the whole stretch
        (`steps_until_full`) after the admissions that change the free pool."""
        if self._full_clock == self._clock and self._full_version == self._version:
            return self._full_result != 0
        done = self.steps_until_done()
        if done is None:
            return True
        got = self._steps_fit(done, 1)
        if got == 0 or got == done:  # (exact: `steps_until_full`'s answer)
            self._full_clock, self._full_version, self._full_result = (
                self._clock, self._version, got)
        return got != 0

    def steps_until_shrink(self) -> int | None:
        """Steps until a decode step frees a block of a sliding or chunked group: a decoder's
        first step after joining (its prefill's out-of-window blocks), or a window crossing a
        block boundary. 1 too when the step just taken freed one of a decoder in the cohort
        since (one that left, or left and joined again, has not stepped since it joined): the
        engine asks after a step whether memory may have come back since a refusal (a decoder
        at its final length, whose last step freed, is freed only at the iteration's end,
        after the admissions that its blocks may let in). Exact up to the first decoder's
        end; past it a lower bound, None when no decoder frees again (`sim.hybrid.cohort`)."""
        if self._shrink_clock == self._clock and self._shrink_version == self._version:
            return self._shrink_result
        result = self._cohort.steps_until_shrink(self._clock, self.steps_until_done())
        self._shrink_clock, self._shrink_version, self._shrink_result = (
            self._clock, self._version, result)
        return result

    def integrals(
        self, n: int, probe: Request | None, w0: float, w1: float
    ) -> tuple[float, float, float, float, float, float]:
        weight = n * w0 + w1 * n * (n - 1) / 2
        sums = self._integrals6(n, w0, w1)
        allocated = sums[0] * self.page
        external = (self.capacity - self.num_blocks * self.page) * weight
        usable = self.num_blocks * self.page * weight - allocated
        return (sums[1], sums[2], sums[3], external, usable, 0.0)

    def _integrals6(self, n: int, w0: float, w1: float) -> list[float]:
        """Weighted sums over the next n steps of the running totals' six figures (blocks,
        token_states, reserved, internal, padding, out_of_window), as `integrals` weighs."""
        if (self._integrals_clock == self._clock and self._integrals_version == self._version
                and self._integrals_n == n and self._integrals_w0 == w0
                and self._integrals_w1 == w1):
            return self._integrals_sums
        weight = n * w0 + w1 * n * (n - 1) / 2
        sums = (self._cohort.integrals(self._clock, n, w0, w1) if n and self._joined
                else [0.0] * 6)
        for k in range(6):
            sums[k] = sums[k] + self._cohort.fixed.get(k) * weight
        self._integrals_clock, self._integrals_version = self._clock, self._version
        self._integrals_n, self._integrals_w0, self._integrals_w1 = n, w0, w1
        self._integrals_sums = sums
        return sums
