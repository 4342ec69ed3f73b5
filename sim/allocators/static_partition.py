"""Static partition: one pool per layer type, each a fixed share of the budget (the baseline
Jenga compares against, and what an engine with one KV-cache manager per layer type does).

A model's layers fall into types: `full` (full attention), `sliding` (sliding window),
`chunked` (chunked-local attention), `mla` and `mamba`. Each type present gets its own pool of
`partition[type]` x the budget, its own paged blocks of `block_size` tokens holding every
layer of that type together (a page of block_size x the bytes per token of the type's
layers), and a block table per request. Sliding and chunked blocks are freed as vLLM frees
them: each attention type's pool is a `HybridAllocator` over the sub-stack of that type's
layers with the hybrid manager on (vLLM v1's shape: one single-type manager per type, a
coordinator over them; here the pools do not share block ids). A `mamba` pool holds one state
block per request (the states of every Mamba layer together: no padding, no attention block
aligned to it).

The coordinator (this class) keeps the requests' lengths and the decode clock as any
allocator does and forwards every operation to every pool: an admission or a chunk is granted
when every pool grants it, and none is changed otherwise (each pool is asked what it lacks
first); a decode step is refused when any pool is short (`steps_until_full` is the least of
the pools'); a preemption frees the request in every pool.

Accounting: each pool's own parts, summed (exact to the byte): token_states per layer as the
hybrid allocator counts them (the need: `sim.allocators.floor`); reserved and internal within
pools (padding is 0 within a type: its layers share one page; out-of-window bytes in blocks
not yet freed are internal); external: each pool's null block and the tail of its share that
is not a whole page, and the bytes the shares leave over; usable_free: every pool's free
blocks. A free block of one pool cannot hold another type's tokens, so a request can be
refused while the budget has free blocks: the cost of a fixed ratio.

`partition`: a mapping from type to share, each share above 0, summing to 1 within 1e-9,
naming every type of the model and no other. Left out, each type's share is its bytes for one
request at max_model_len as vLLM's memory check counts them (full and MLA: every token; a
sliding window: the window and the tokens in flight, max_num_batched_tokens x concurrent
batches; chunked: the chunk and those; Mamba: the states) over the sum of them, so that a
budget that holds one such request in each pool gives every pool its own.
"""

from __future__ import annotations

import math

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
from kvfrag.sim.hybrid.planner import layer_kind, plan
from kvfrag.sim.layers import Layer, LayerStack
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
class StatePool:
    """The `mamba` type's pool: one block per request holding every Mamba layer's state."""

    def __init__(self, capacity: int, page: int) -> None:
        self.capacity = capacity
        self.page = page
        self.num_blocks = capacity // page
        self.held = 0

    def parts(self) -> tuple[int, int, int, int, int]:
        return (self.held * self.page, 0, 0, self.capacity - self.num_blocks * self.page,
                (self.num_blocks - self.held) * self.page)


@mypyc_attr(allow_interpreted_subclasses=True, serializable=True)  # (see sim/_native.py)
class StaticPartitionAllocator(Allocator):
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
        super().__init__(capacity, bytes_per_token, max_model_len)
        self.stack = stack_of(stack, geometry, self.bytes_per_token)
        self.block_size = positive_int("block_size", block_size)
        types = layers_by_type(self.stack)
        tokens = positive_int("max_num_batched_tokens", max_num_batched_tokens)
        batches = positive_int("concurrent_batches", concurrent_batches)
        self.shares = shares_of(partition, {
            t: type_bytes(sub, self.block_size, self.max_model_len, tokens, batches)
            for t, sub in types.items()})
        self.types: tuple[str, ...] = tuple(t for t in types if t != "mamba")
        self.pools: list[HybridAllocator] = []
        used = 0
        for t in self.types:
            sub = types[t]
            size = int(self.shares[t] * self.capacity)
            used += size
            try:
                pool = HybridAllocator(
                    size, sub.full_bytes_per_token, self.max_model_len, self.block_size, True,
                    sub, tokens, batches)
            except ValueError as exc:
                raise ValueError(f"partition.{t} ({self.shares[t]:.4g} of the budget): "
                                 f"{exc}") from None
            self.pools.append(pool)
        self.state: StatePool | None = None
        if "mamba" in types:
            size = int(self.shares["mamba"] * self.capacity)
            used += size
            self.state = StatePool(size, types["mamba"].state_bytes_per_request)
            if self.state.num_blocks < 1:
                raise ValueError(f"partition.mamba ({self.shares['mamba']:.4g} of the budget) "
                                 "holds no request's state")
        self.left_over = self.capacity - used  # (the shares' rounding: external)
        self.waste_split = True
        # `parts()` as of (clock, changes): the engine asks the free bytes and the parts several
        # times between two changes, and each asks every pool
        self._changes = 0
        self._parts_memo: tuple[int, int, tuple[int, int, int, int, int]] | None = None

    # ------------------------------------------------------------- per request
    def allocated_bytes(self, rid: int) -> int:
        self._get(rid)
        out = sum(p.allocated_bytes(rid) for p in self.pools)
        return out + (self.state.page if self.state is not None else 0)

    def bytes_for(self, req: Request, tokens: int) -> int:
        out = sum(p.bytes_for(req, tokens) for p in self.pools)
        return out + (self.state.page if self.state is not None else 0)

    def too_large(self, req: Request) -> bool:
        return any(p.too_large(req) for p in self.pools)

    def pool_bytes(self) -> int:
        out = sum(p.pool_bytes() for p in self.pools)
        return out + (self.state.num_blocks * self.state.page if self.state is not None else 0)

    def watermark_bytes(self, fraction: float) -> int:
        out = sum(p.watermark_bytes(fraction) for p in self.pools)
        state = self.state
        return out + (int(fraction * state.num_blocks) * state.page if state is not None else 0)

    def admission_bytes(self, req: Request, tokens: int, hit: int) -> int:
        """Every pool's admission gate (vLLM's, per pool): their figures summed when each
        pool's fits in its own free blocks; else more than the whole budget's free bytes (a
        free block of one pool cannot hold another's)."""
        need = 0
        for p in self.pools:
            one = p.admission_bytes(req, tokens, hit)
            if one > p.free_bytes():
                return self.free_bytes() + 1
            need += one
        state = self.state
        if state is not None:
            if state.held >= state.num_blocks:
                return self.free_bytes() + 1
            need += state.page
        return need

    # -------------------------------------------------------------------- hooks
    def _admit(self, live: Live, tokens: int) -> Grant | Refusal:
        req, rid = live.req, live.req.rid
        state = self.state
        if state is not None and state.held >= state.num_blocks:
            reason = Reason.TOO_LARGE if state.num_blocks == 0 else Reason.OUT_OF_MEMORY
            return Refusal(rid, reason, state.page, self.free_bytes(), "no free state block")
        for i, p in enumerate(self.pools):  # (not zip: no tuple per pool on this path)
            if p.admit_shortfall(tokens) > 0:  # (its refusal, which changes nothing)
                got = p.admit(req, tokens, decoding=False)
                assert isinstance(got, Refusal)
                return Refusal(rid, got.reason, got.needed, self.free_bytes(),
                               f"{self.types[i]} pool: {got.detail}".rstrip(": "))
        self._changes += 1  # (a refusal changes nothing: the parts memo stands)
        nbytes = 0
        for p in self.pools:
            granted = p.admit(req, tokens, decoding=False)
            assert isinstance(granted, Grant)  # (its shortfall was 0)
            nbytes += granted.nbytes
        if state is not None:
            state.held += 1
            nbytes += state.page
        return Grant(rid, nbytes, live.cap)

    def _grow(self, live: Live, old: int, new: int) -> Grant | Refusal:
        rid = live.req.rid
        for i, p in enumerate(self.pools):
            short = p.grow_shortfall(rid, new - old, self.in_flight_now)
            if short > 0:
                return Refusal(rid, Reason.OUT_OF_MEMORY, short * p.page, self.free_bytes(),
                               f"{self.types[i]} pool")
        self._changes += 1
        nbytes = 0
        for p in self.pools:
            got = p.grow(rid, new - old, self.in_flight_now)
            assert isinstance(got, Grant)  # (its shortfall was 0)
            nbytes += got.nbytes
        return Grant(rid, nbytes, live.cap)

    def _release(self, live: Live) -> None:
        self._changes += 1
        for p in self.pools:
            p.free(live.req.rid)
        if self.state is not None:
            self.state.held -= 1

    def _cohort_changed(self, live: Live, decoding: bool) -> None:
        self._changes += 1
        for p in self.pools:
            p.set_decoding(live.req.rid, decoding)

    def advance(self, n: int) -> None:
        super().advance(n)
        for p in self.pools:
            p.advance(n)

    def set_async(self) -> None:
        if self._live:
            raise ValueError("set_async before any request is admitted")
        super().set_async()
        for p in self.pools:
            p.set_async()

    def unscheduled(self, rid: int) -> None:
        self._changes += 1
        for p in self.pools:
            p.unscheduled(rid)

    def defer_block_ids(self) -> None:
        for p in self.pools:
            p.defer_block_ids()

    def view_model(self, stack: LayerStack) -> None:
        raise ValueError("static-partition lays out its model's layers itself (`stack`)")

    # ----------------------------------------------------------------- totals
    def parts(self, probe: Request | None = None) -> tuple[int, int, int, int, int]:
        memo = self._parts_memo
        if memo is not None and memo[0] == self._clock and memo[1] == self._changes:
            return memo[2]
        # (unpacked, not iterated: each pool's parts come back as a native tuple, unboxed)
        tokens, reserved, internal, external, usable = 0, 0, 0, self.left_over, 0
        for p in self.pools:
            a, b, c, d, e = p.parts()
            tokens, reserved, internal = tokens + a, reserved + b, internal + c
            external, usable = external + d, usable + e
        if self.state is not None:
            a, b, c, d, e = self.state.parts()
            tokens, reserved, internal = tokens + a, reserved + b, internal + c
            external, usable = external + d, usable + e
        out = (tokens, reserved, internal, external, usable)
        self._parts_memo = (self._clock, self._changes, out)
        return out

    def _allocated_total(self) -> int:
        """The pools' blocks held, as each counts them (`free_bytes` on every admission
        asks it: their blocks, not all their parts)."""
        out = 0
        for p in self.pools:
            out += p._allocated_total()
        state = self.state
        return out + (state.held * state.page if state is not None else 0)

    def _internal_total(self) -> int:
        return self.parts()[2]

    def _usable_free(self, probe: Request | None) -> int:
        return self.parts()[4]

    def _largest_hole(self) -> int:
        return self.parts()[4]

    def integrals(
        self, n: int, probe: Request | None, w0: float, w1: float
    ) -> tuple[float, float, float, float, float, float]:
        weight = n * w0 + w1 * n * (n - 1) / 2
        sums = [0.0, 0.0, 0.0, self.left_over * weight, 0.0, 0.0]
        for p in self.pools:
            for i, x in enumerate(p.integrals(n, probe, w0, w1)):
                sums[i] += x
        if self.state is not None:
            for i, y in enumerate(self.state.parts()):
                sums[i] += y * weight
        return (sums[0], sums[1], sums[2], sums[3], sums[4], 0.0)

    def waste_parts(self) -> tuple[int, int]:
        padding = out = 0
        for p in self.pools:
            a, b = p.waste_parts()
            padding += a
            out += b
        return padding, out

    def waste_integrals(self, n: int, w0: float, w1: float) -> tuple[float, float]:
        padding = out = 0.0
        for p in self.pools:
            a, b = p.waste_integrals(n, w0, w1)
            padding += a
            out += b
        return padding, out

    def waste_breakdown(self) -> dict[str, int]:
        sums = {"overreservation": 0, "padding": 0, "out_of_window": 0, "rounding": 0}
        for p in self.pools:
            for key, x in p.waste_breakdown().items():
                sums[key] += x
        return sums

    def group_kinds(self) -> tuple[str, ...]:
        kinds = tuple(k for p in self.pools for k in p.group_kinds())
        return kinds + (("mamba",) if self.state is not None else ())

    def group_blocks(self) -> tuple[int, ...]:
        blocks = tuple(b for p in self.pools for b in p.group_blocks())
        return blocks + ((self.state.held,) if self.state is not None else ())

    def summary_stats(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        for t, p in zip(self.types, self.pools, strict=True):
            out[f"partition_{t}_share"] = self.shares[t]
            out[f"partition_{t}_blocks"] = p.num_blocks
            out[f"partition_{t}_page_bytes"] = p.page
        if self.state is not None:
            out["partition_mamba_share"] = self.shares["mamba"]
            out["partition_mamba_blocks"] = self.state.num_blocks
            out["partition_mamba_page_bytes"] = self.state.page
        return out

    # ------------------------------------------------------------- the cohort
    def steps_until_full(self) -> int | None:
        out: int | None = None
        for p in self.pools:
            full = p.steps_until_full()
            if full is not None and (out is None or full < out):
                out = full
        return out

    def can_step(self) -> bool:
        """(Each pool's own answer for the next step, which walks no further.)"""
        return all(p.can_step() for p in self.pools)

    def steps_until_shrink(self) -> int | None:
        out: int | None = None
        for p in self.pools:
            shrink = p.steps_until_shrink()
            if shrink is not None and (out is None or shrink < out):
                out = shrink
        return out
