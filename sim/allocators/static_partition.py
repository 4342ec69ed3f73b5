"""Static partition: one pool per layer type, each a fixed share of the budget (the baseline
Jenga compares against, and what an engine with one KV-cache manager per layer type does).

A model's layers fall into types: `full` (full attention), `sliding` (sliding window),
`chunked` (chunked-local attention), `mla` and `mamba`. Each type present gets its own pool of
`partition[type]` x the budget, its own paged blocks of `block_size` tokens holding every
layer of that type together (a page of block_size x the bytes per token of the type's
layers: the plan of the hybrid manager over that type's layers alone, null block included),
and a block table per request. Sliding and chunked blocks are freed as vLLM frees them. A
`mamba` pool holds one state block per request (the states of every Mamba layer together: no
padding, no attention block aligned to it).

This is the `hybrid` allocator's coordinator over vLLM's single-type managers (vLLM v1's
shape: one manager per kind of layer, a coordinator over them), every type's managers under
one decode cohort, with the pools kept apart: each manager's blocks are counted in its own
pool. The running totals count bytes in units of the greatest common divisor of the pools'
pages (a manager's block of a pool of page P is P / unit units), so that one set of figures
is exact to the byte for every pool together, and each decoder's form is built once, not
once per pool. A pool's blocks are a weighted sum of its managers' held-block figures (a
`Gauge`), what its admissions, chunks and look-ahead are checked against: an admission or a
chunk is granted when every pool has the blocks it takes, and none is changed otherwise; a
decode step is refused when any pool is short (`steps_until_full` is the least of the
pools', each walked in running order as vLLM's scheduler walks it); a preemption frees the
request in every pool.

Accounting (exact to the byte): token_states per layer as the hybrid allocator counts them
(the need: `sim.allocators.floor`); reserved and internal within pools (padding is 0 within a
type: its layers share one page; out-of-window bytes in blocks not yet freed are internal);
external: each pool's null block and the tail of its share that is not a whole page, and the
bytes the shares leave over; usable_free: every pool's free blocks. A free block of one pool
cannot hold another type's tokens, so a request can be refused while the budget has free
blocks: the cost of a fixed ratio.

`partition`: a mapping from type to share, each share above 0, summing to 1 within 1e-9,
naming every type of the model and no other. Left out, each type's share is its bytes for one
request at max_model_len as vLLM's memory check counts them (full and MLA: every token; a
sliding window: the window and the tokens in flight, max_num_batched_tokens x concurrent
batches; chunked: the chunk and those; Mamba: the states) over the sum of them, so that a
budget that holds one such request in each pool gives every pool its own.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvfrag.sim.allocators.base import (
    Allocator,
    Grant,
    Live,
    Reason,
    Refusal,
    Request,
    positive_int,
)
from kvfrag.sim.allocators.floor import stack_of
from kvfrag.sim.allocators.hybrid import HybridAllocator
from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.hybrid.forms import NEVER, Figures
from kvfrag.sim.hybrid.lookahead import Gauge
from kvfrag.sim.hybrid.managers import MambaManager, Manager, managers_for
from kvfrag.sim.hybrid.planner import layer_kind, plan
from kvfrag.sim.layers import Layer, LayerStack
from kvfrag.sim.model_view import ModelView
from mypy_extensions import mypyc_attr

#: The layer types a partition names, in the order pools are kept.
TYPES = ("full", "sliding", "chunked", "mla", "mamba")


#: A partition's name for each layer kind of vLLM's (`planner.layer_kind`).
_NAMES = {"full": "full", "sliding_window": "sliding", "chunked_local": "chunked", "mla": "mla",
          "mamba": "mamba"}


def type_of(layer: Layer) -> str:
    """A layer's type in a partition."""
    return _NAMES[layer_kind(layer)]


def layers_by_type(stack: LayerStack) -> dict[str, LayerStack]:
    """The stack's layers of each type present, as sub-stacks, in `TYPES` order."""
    found: dict[str, list] = {}
    for layer in stack.layers:
        found.setdefault(type_of(layer), []).append(layer)
    return {t: LayerStack(f"{stack.name}:{t}", tuple(found[t])) for t in TYPES if t in found}


def type_bytes(sub: LayerStack, block_size: int, max_model_len: int, max_num_batched_tokens: int,
               concurrent_batches: int) -> int:
    """Bytes one request at max_model_len needs in a pool of this type's layers, as vLLM's
    memory check counts it (`hybrid.planner`): full and MLA every token, a sliding window its
    window and the tokens in flight (max_num_batched_tokens x concurrent batches), a chunk
    likewise, in whole blocks; a Mamba type its states."""
    if sub.mamba_layers:
        return sub.state_bytes_per_request
    p = plan(sub, 1 << 60, block_size, True, max_model_len=max_model_len,
             max_num_batched_tokens=max_num_batched_tokens,
             concurrent_batches=concurrent_batches)
    return p.max_request_blocks * p.page_bytes


def shares_of(partition: object, sizes: dict[str, int]) -> dict[str, float]:
    """The share of the budget of each type: `partition` checked, or by default each type's
    `sizes` (`type_bytes`) over their sum. Raises ValueError naming the problem in one line."""
    types = sizes
    names = ", ".join(types)
    if partition is None:
        whole = sum(sizes.values())
        return {t: size / whole for t, size in sizes.items()}
    if not isinstance(partition, dict):
        raise ValueError(f"partition must map each layer type ({names}) to its share of the "
                         f"budget, e.g. {{full: 0.3, sliding: 0.7}}; not {partition!r}")
    shares: dict[str, float] = {}
    for name, share in partition.items():
        if name not in types:
            kind = "layer type" if name in TYPES else "name"
            raise ValueError(f"partition: unknown {kind} {name!r} for this model (its types: "
                             f"{names})")
        if (not isinstance(share, int | float) or isinstance(share, bool)
                or not math.isfinite(share) or not 0 < share <= 1):
            raise ValueError(f"partition.{name} must be a share above 0 and at most 1, "
                             f"not {share!r}")
        shares[name] = float(share)
    missing = [t for t in types if t not in shares]
    if missing:
        raise ValueError(f"partition: no share for {', '.join(missing)} (the model's types: "
                         f"{names})")
    total = 0.0
    for part in shares.values():
        total += part
    if abs(total - 1.0) > 1e-9:
        raise ValueError(f"partition: the shares sum to {total:.12g}, not 1")
    return {t: shares[t] for t in types}


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class Pool:
    """One layer type's share of the budget: its page and usable blocks, its managers (as
    its plan makes them, one group's blocks of `page` each), and, once the coordinator counts
    them among its own (`attach`), which of those are its and its gauge."""

    #: per manager of the coordinator's, this pool's blocks per held block of a group
    gauge: Gauge

    def __init__(self, kind: str, size: int, page: int, num_blocks: int,
                 max_request_blocks: int, group_kinds: tuple[str, ...],
                 managers: list[Manager], reads: list[ModelView | None],
                 manager_of: list[int]) -> None:
        self.kind = kind  # its layer type (`TYPES`)
        self.size = size  # its share of the budget, bytes
        self.page = page
        self.num_blocks = num_blocks  # blocks requests can hold (less the null block)
        self.max_request_blocks = max_request_blocks  # one max_model_len request's (plan's)
        self.group_kinds = group_kinds  # its plan's groups (vLLM's kinds), in order
        self.own = managers  # its plan's managers, unscaled
        self.reads = reads  # what each one's layers read (`sim.model_view`)
        self.manager_of = manager_of  # per plan group, its manager (the coordinator's, attached)

    def attach(self, start: int, gauge: Gauge) -> None:
        """Its managers are the coordinator's from `start` on."""
        self.manager_of = [start + mi for mi in self.manager_of]
        self.gauge = gauge

    def blocks(self, figures: Figures) -> int:
        """This pool's blocks in a vector of figures (a request's, or the totals)."""
        return self.gauge.of(figures)


def type_pool(kind: str, sub: LayerStack, size: int, share: float, block_size: int,
              max_model_len: int, max_num_batched_tokens: int, concurrent_batches: int) -> Pool:
    """The pool of one type's layers (`sub`) on `size` bytes: the hybrid manager's plan over
    them (vLLM's memory check included), or a Mamba pool of whole states."""
    if kind == "mamba":
        page = sub.state_bytes_per_request
        if size // page < 1:
            raise ValueError(f"partition.mamba ({share:.4g} of the budget) holds no "
                             "request's state")
        state = MambaManager(max_model_len, 0, 1, 0, None, page)
        return Pool(kind, size, page, size // page, 1, ("mamba",), [state], [None], [0])
    try:
        p = plan(sub, size, block_size, True, max_model_len=max_model_len,
                 mamba_cache_mode="none", prefix_caching=False,
                 max_num_batched_tokens=max_num_batched_tokens,
                 concurrent_batches=concurrent_batches)
    except ValueError as exc:
        raise ValueError(f"partition.{kind} ({share:.4g} of the budget): {exc}") from None
    managers, manager_of = managers_for(p, sub, max_num_batched_tokens * concurrent_batches,
                                        max_model_len)
    layers: list[list[Layer]] = [[] for _ in managers]
    for g, mi in zip(p.groups, manager_of, strict=True):
        layers[mi].extend(sub.layers[i] for i in g.layers)
    reads: list[ModelView | None] = [ModelView.of(LayerStack(sub.name, tuple(ls))) if ls
                                     else None for ls in layers]
    return Pool(kind, size, p.page_bytes, p.usable_blocks, p.max_request_blocks,
                tuple(g.kind for g in p.groups), list(managers), reads, manager_of)


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class StaticPartitionAllocator(HybridAllocator):
    """One pool per layer type, each a fixed share of the budget (see the module)."""

    kind = "static-partition"

    def __init__(
        self,
        capacity: object,
        bytes_per_token: object,
        max_model_len: object,
        block_size: object = 16,
        partition: object = None,
        stack: object = None,
        max_num_batched_tokens: object = 8192,
        concurrent_batches: object = 2,
        geometry: KVGeometry | None = None,
    ) -> None:
        Allocator.__init__(self, capacity, bytes_per_token, max_model_len)
        self.stack = stack_of(stack, geometry, self.bytes_per_token)
        bs = positive_int("block_size", block_size)
        types = layers_by_type(self.stack)
        tokens = positive_int("max_num_batched_tokens", max_num_batched_tokens)
        batches = positive_int("concurrent_batches", concurrent_batches)
        self.shares = shares_of(partition, {
            t: type_bytes(sub, bs, self.max_model_len, tokens, batches)
            for t, sub in types.items()})
        self.retention = 0
        self.pools = [type_pool(t, sub, int(self.shares[t] * self.capacity), self.shares[t],
                                bs, self.max_model_len, tokens, batches)
                      for t, sub in types.items()]
        self.left_over = self.capacity - sum(p.size for p in self.pools)  # (external)
        # Every pool's managers under one cohort, counted in units of the pages' gcd: a block
        # of a pool of page P is P / unit units
        unit = math.gcd(*[p.page for p in self.pools])
        managers: list[Manager] = []
        reads: list[ModelView | None] = []
        manager_of: list[int] = []
        starts: list[int] = []
        for p in self.pools:
            starts.append(len(managers))
            manager_of.extend(len(managers) + mi for mi in p.manager_of)
            managers.extend(replace(m, groups=m.groups * (p.page // unit)) for m in p.own)
            reads.extend(p.reads)
        self._setup(bs, tuple(managers), manager_of, reads, unit,
                     sum(p.num_blocks * (p.page // unit) for p in self.pools))
        for p, start in zip(self.pools, starts, strict=True):
            weights = [0] * len(managers)
            for mi, m in enumerate(p.own):
                weights[start + mi] = m.groups
            p.attach(start, self._cohort.pool_gauge(weights))
        # (attention pools: the ones decoders take blocks of; the state pool, if any)
        self._growing = [p for p in self.pools if p.kind != "mamba"]
        self._state_pool: Pool | None = None
        for p in self.pools:
            if p.kind == "mamba":
                self._state_pool = p
        self.types: tuple[str, ...] = tuple(p.kind for p in self._growing)
        self._cohort_parts = True  # (`_totals` is the hybrid allocator's)

    def view_model(self, stack: LayerStack) -> None:
        raise ValueError("static-partition lays out its model's layers itself (`stack`)")

    # (its pools' block ids are not named: their counts are what is modelled)
    def block_table(self, rid: int) -> tuple[int, ...]:
        return Allocator.block_table(self, rid)

    def block_tables(self, rid: int) -> list[tuple[int, ...]]:
        return Allocator.block_tables(self, rid)

    def group_tables(self, rid: int) -> list[tuple[int, ...]]:
        raise ValueError("static-partition names no block ids (its pools' counts are modelled)")

    # ---------------------------------------------------------------- the pools
    def held_in(self, pool: Pool) -> int:
        """Blocks of `pool` the live requests hold."""
        return pool.blocks(self._cohort.figures(self._clock))

    def free_in(self, pool: Pool) -> int:
        """Free blocks of `pool`."""
        return pool.num_blocks - self.held_in(pool)

    def _need(self, pool: Pool, tokens: int, processed: int) -> int:
        """Blocks of `pool` a request holds with `tokens` slots, freed by `processed`."""
        return pool.gauge.blocks_of(self._cohort, tokens, processed)

    def pool_bytes(self) -> int:
        return self.num_blocks * self.page

    def watermark_bytes(self, fraction: float) -> int:
        out = 0
        for p in self.pools:
            out += int(fraction * p.num_blocks) * p.page
        return out

    def admission_bytes(self, req: Request, tokens: int, hit: int) -> int:
        """Every pool's admission gate (vLLM's, per pool: the whole sequence, sliding and
        chunked groups capped; the pool's unusable tail), summed when each fits in its own
        free blocks; else more than the whole budget's free bytes (a free block of one pool
        cannot hold another's)."""
        need = 0
        figures = self._cohort.figures(self._clock)
        managers = self.managers
        for p in self.pools:
            blocks = 0
            for mi in p.gauge.ix:
                m = managers[mi]
                want = -(-tokens // m.block_size)
                blocks += p.gauge.w[mi] * (want if m.cap is None else min(want, m.cap))
            tail = (p.size - p.num_blocks * p.page) // p.page
            one = (blocks + tail) * p.page
            if one > p.size - p.blocks(figures) * p.page:
                return self.free_bytes() + 1
            need += one
        return need

    def too_large(self, req: Request) -> bool:
        """Whether some pool holds fewer blocks than the request, decoding to its final
        length, ever needs of it."""
        final = min(req.final, self.max_model_len)
        lo = max(1, final - max(m.peak_span() for m in self.managers))
        lag = self._lag
        for p in self._growing:
            peak = max(self._need(p, t, max(0, t - 1 - lag)) for t in range(lo, final + 1))
            if peak > p.num_blocks:
                return True
        return False

    # -------------------------------------------------------------------- hooks
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        rid = live.req.rid
        if live.req.n > 1:
            raise ValueError(
                f"request {rid}: the hybrid allocator does not model sample groups (n > 1) yet"
            )
        state = self._state_pool
        if state is not None and self.free_in(state) <= 0:
            return Refusal(rid, Reason.OUT_OF_MEMORY, state.page, self.free_bytes(),
                           "no free state block")
        for p in self._growing:
            need = self._need(p, tokens, 0)
            if need > p.num_blocks:
                return Refusal(rid, Reason.TOO_LARGE, need * p.page, self.free_bytes(),
                               f"{p.kind} pool: needs more blocks than exist")
            if need > self.free_in(p):
                return Refusal(rid, Reason.OUT_OF_MEMORY, need * p.page, self.free_bytes(),
                               f"{p.kind} pool")
        return Grant(rid, self._admitted(live, tokens).f0 * self.page, live.cap)

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        rid = live.req.rid
        held = self._held[rid]  # (its parts at (old, processed), as added)
        proc = max(0, old - self.in_flight_now) if self._lag else old
        for p in self._growing:
            short = self._need(p, new, proc) - p.blocks(held) - self.free_in(p)
            if short > 0:
                return Refusal(rid, Reason.OUT_OF_MEMORY, short * p.page, self.free_bytes(),
                               f"{p.kind} pool")
        return Grant(rid, self._grown(live, old, new, proc) * self.page, live.cap)

    # ----------------------------------------------------------------- totals
    def group_kinds(self) -> tuple[str, ...]:
        return tuple(k for p in self.pools for k in p.group_kinds)

    def group_blocks(self) -> tuple[int, ...]:
        figures = self._cohort.figures(self._clock)
        return tuple(figures.get(6 + mi) for p in self.pools for mi in p.manager_of)

    def summary_stats(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        for p in self.pools:
            out[f"partition_{p.kind}_share"] = self.shares[p.kind]
            out[f"partition_{p.kind}_blocks"] = p.num_blocks
            out[f"partition_{p.kind}_page_bytes"] = p.page
        return out

    # ------------------------------------------------------------- the cohort
    def _pool_full(self, p: Pool, done: int, walk: int) -> int:
        """Steps (at most `done`) before a decoder finds too few free blocks of pool `p`."""
        return self._cohort.steps_until_full(self._clock, done, self.free_in(p),
                                             self._rank.__getitem__, walk, p.gauge)

    def pool_steps_until_full(self, p: Pool) -> int | None:
        """`steps_until_full` of pool `p` alone (None: no decoder ends)."""
        done = self.steps_until_done()
        return None if done is None else self._pool_full(p, done, NEVER)

    def _steps_fit(self, done: int, walk: int) -> int:
        """(`HybridAllocator._steps_fit`.) The least of the pools': each asked up to the
        answer of the ones before (a step refused in one is refused)."""
        for p in self._growing:
            done = self._pool_full(p, done, walk)
            if done == 0:
                break
        return done
