"""Property-based tests: random admit / grow / step / set_decoding / free sequences on every
allocator config, checked after each operation against an independent model of the requests
(their tokens, reservations and bytes), the free structures and the accounting definitions.
Also: `integrate` equals the brute-force sum, and paged `steps_until_full` is exact."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import (
    PARTS,
    Allocator,
    Placement,
    Reason,
    Request,
    Reserve,
    make_allocator,
)
from kvfrag.sim.geometry import KVGeometry

# vattention: per-buffer rows of t bytes in pages of P bytes (b = 2 x layers x t).
T3 = KVGeometry("t3", layers=1, kv_heads=1, head_dim=3, dtype_bytes=1)  # t = 3, b = 6
T4 = KVGeometry("t4", layers=2, kv_heads=2, head_dim=1, dtype_bytes=2)  # t = 4, b = 16
PAGED = ("paged", "vattention")  # kinds whose memory is a pool of blocks

CONFIGS: list[tuple[str, dict]] = (
    [("contiguous", {"reserve": r.value, "placement": p.value}) for r in Reserve for p in Placement]
    + [("buddy", {"reserve": r.value}) for r in Reserve]
    + [("paged", {"block_size": bs}) for bs in (1, 16, 7, 3)]
    + [("contiguous", {"reserve": r, "placement": p, "compaction": True})
       for r in ("oracle", "max_tokens") for p in ("first-fit", "next-fit")]
    # Rows straddling pages (3 pages per 4 tokens; 2 per 3), and whole rows per page.
    + [("vattention", {"page_size": page, "geometry": geo}) for page, geo in
       ((4, T3), (6, T4), (6, T3))]
)


def config_id(kind: str, opts: dict) -> str:
    return f"{kind}-{'-'.join(str(getattr(v, 'name', v)) for v in opts.values())}"


CONFIG_IDS = [config_id(kind, opts) for kind, opts in CONFIGS]
by_config = pytest.mark.parametrize(("kind", "opts"), CONFIGS, ids=CONFIG_IDS)

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


# ---------------------------------------------------------------------- the shadow model
class Model:
    """What the test expects, computed without the allocator's bookkeeping."""

    def __init__(self, kind: str, opts: dict, capacity: int, b: int, mml: int) -> None:
        self.kind, self.opts = kind, opts
        self.capacity, self.b, self.mml = capacity, b, mml
        self.paged = kind in PAGED
        if kind == "vattention":  # a request of L tokens maps ceil(L*t/P) pages per buffer
            geo = opts["geometry"]
            self.row, self.page = geo.bytes_per_buffer_token, opts["page_size"]
            self.block_bytes = 2 * geo.layers * self.page
        else:  # paged: ceil(L/bs) blocks
            self.row, self.page = 1, opts.get("block_size")
            self.block_bytes = (self.page or 0) * b
        self.reqs: dict[int, Request] = {}
        self.tokens: dict[int, int] = {}
        self.decoding: dict[int, bool] = {}
        self.rover = 0  # next-fit: end of the last placement
        self.next_rid = 0

    # -- policy definitions
    def reservation(self, req: Request) -> int:
        policy = self.opts.get("reserve", "max_model_len")
        if self.paged or policy == "max_model_len":
            tokens = self.mml
        elif policy in ("pow2", "pow2_final"):
            tokens = next_pow2(req.final)
        elif policy == "pow2_output":
            tokens = req.prompt + (next_pow2(req.output) if req.output else 0)
        elif policy == "oracle":
            tokens = req.final
        else:
            tokens = req.prompt + req.max_tokens if req.max_tokens else self.mml
        return min(tokens, self.mml)

    def final(self, req: Request) -> int:
        return min(req.final, self.reservation(req))

    def slab_bytes(self, tokens: int) -> int:
        if self.kind == "contiguous":
            return tokens * self.b
        return next_pow2(tokens) * self.b

    def blocks(self, tokens: int) -> int:
        return -(-tokens * self.row // self.page)

    def tokens_in(self, blocks: int) -> int:
        """Most tokens a sequence stores in `blocks` blocks."""
        return blocks * self.page // self.row

    def held(self, rid: int) -> int:
        if self.paged:
            return self.blocks(self.tokens[rid]) * self.block_bytes
        return self.slab_bytes(self.reservation(self.reqs[rid]))

    # -- the free structure at rest
    def top_blocks(self) -> list[tuple[int, int]]:
        """Buddy: (slot offset, order) of the power-of-two blocks covering the slots."""
        slots, start, tops = self.capacity // self.b, 0, []
        for order in reversed(range(slots.bit_length())):
            if slots >> order & 1:
                tops.append((start, order))
                start += 1 << order
        return tops


def build(kind: str, opts: dict, capacity: int, b: int, mml: int) -> Allocator:
    return make_allocator(kind, capacity=capacity, bytes_per_token=b, max_model_len=mml, **opts)


def structure(a: Allocator) -> object:
    if a.kind == "contiguous":
        return (a.holes(), a.slabs())
    if a.kind == "buddy":
        return (a.free_blocks(), a.slabs())
    return (a.free_blocks(), {rid: a.block_table(rid) for rid in a.rids()})


def snapshot(a: Allocator, probe: Request | None) -> tuple:
    return (
        a.account(None),
        a.account(probe),
        {rid: (a.tokens(rid), a.allocated_bytes(rid)) for rid in a.rids()},
        a.steps_until_done(),
        a.steps_until_full(),
        a.n_decoding,
        structure(a),
    )


# ------------------------------------------------------------------------- invariants
def check_tiling(intervals: list[tuple[int, int]], end: int) -> None:
    """(offset, size) intervals, none empty, cover [0, end) exactly with no overlap."""
    at = 0
    for off, size in sorted(intervals):
        assert size > 0
        assert off == at, f"gap or overlap at {at}: {sorted(intervals)}"
        at = off + size
    assert at == end


def check_invariants(a: Allocator, m: Model, probe: Request | None, tables: bool) -> None:
    b, cap = m.b, m.capacity
    # The requests, against the shadow model.
    assert sorted(a.rids()) == sorted(m.reqs)
    assert a.live == len(m.reqs)
    assert a.n_decoding == sum(m.decoding.values())
    final = {rid: m.final(req) for rid, req in m.reqs.items()}
    held = {rid: m.held(rid) for rid in m.reqs}
    for rid, tokens in m.tokens.items():
        assert a.tokens(rid) == tokens
        assert a.final_tokens(rid) == final[rid]
        assert 1 <= tokens <= final[rid]
        assert a.allocated_bytes(rid) == held[rid] >= b * tokens
    left = [final[r] - m.tokens[r] for r in m.reqs if m.decoding[r]]
    assert a.steps_until_done() == (min(left) if left else None)
    assert a.total_tokens() == sum(m.tokens.values())

    # The accounting, from its definitions.
    written = {rid: min(held[rid], b * final[rid]) for rid in m.reqs}
    token_states = b * sum(m.tokens.values())
    internal = sum(held[r] - written[r] for r in m.reqs)
    reserved = sum(written.values()) - token_states
    free = cap - sum(held.values())
    # internal = over-reservation (room for tokens never reached) + rounding (granularity).
    over = 0 if m.paged else sum(
        min(held[r], b * m.reservation(m.reqs[r])) - written[r] for r in m.reqs
    )
    assert a.overreserved_bytes() == over and 0 <= over <= internal
    null = (a.num_blocks - a.usable_blocks) * a.block_bytes if m.paged else 0
    assert a.free_bytes() == free - null  # never the null block (paged's block 0)
    hole = largest_hole(a, m)
    for p in (None, probe):
        acc = a.account(p)
        acc.check()
        assert (acc.capacity, acc.live) == (cap, len(m.reqs))
        assert (acc.token_states, acc.reserved, acc.internal) == (token_states, reserved, internal)
        assert acc.free == free
        assert acc.usable_free == usable_free(a, m, p)
        assert acc.largest_hole == hole
        assert 0.0 <= acc.hole_index <= 1.0

    # The free structures and the placements.
    if m.kind == "contiguous":
        slabs = a.slabs()
        holes = a.holes()
        for off, size, rid in slabs:
            assert off >= 0 and off + size <= cap
            assert size == held[rid]
        check_tiling(holes + [(off, size) for off, size, _ in slabs], cap)
        for (o1, s1), (o2, _) in itertools.pairwise(holes):
            assert o1 + s1 < o2, "adjacent holes were not coalesced"
    elif m.kind == "buddy":
        slots = cap // b
        blocks = []
        for off, size, rid in a.slabs():
            assert size == held[rid]
            assert off % b == 0 and size % b == 0
            blocks.append((off // b, size // b))
        blocks += [(off, 1 << k) for off, k in a.free_blocks()]
        for off, size in blocks:
            assert size & (size - 1) == 0 and off % size == 0, "misaligned buddy block"
        check_tiling(blocks, slots)
        # Fully merged: no free block's buddy (inside the same top block) is also free.
        free = set(a.free_blocks())
        tops = m.top_blocks()
        for off, k in free:
            top_start, top_order = max(t for t in tops if t[0] <= off)
            assert off + (1 << k) <= top_start + (1 << top_order), "block crosses a top block"
            if k < top_order:
                assert (off ^ (1 << k), k) not in free, "two free buddies were not merged"
    else:
        assert a.free_blocks() == a.usable_blocks - sum(held.values()) // a.block_bytes
        assert a.free_blocks() >= 0
        if tables:
            seen: set[int] = set()
            for rid in m.reqs:
                table = a.block_table(rid)
                assert len(table) == m.blocks(m.tokens[rid])
                assert all(a.num_blocks - a.usable_blocks <= i < a.num_blocks for i in table)
                assert seen.isdisjoint(table), "two requests share a block"
                seen.update(table)


def usable_free(a: Allocator, m: Model, probe: Request | None) -> int:
    if m.paged:
        return a.free_blocks() * a.block_bytes
    if m.kind == "contiguous":
        unit = m.b if probe is None else m.slab_bytes(m.reservation(probe))
        return sum(size - size % unit for _, size in a.holes())
    k = 0 if probe is None else (m.reservation(probe) - 1).bit_length()
    return sum((1 << j) * m.b for _, j in a.free_blocks() if j >= k)


def largest_hole(a: Allocator, m: Model) -> int:
    if m.paged:
        return a.free_blocks() * a.block_bytes
    if m.kind == "contiguous":
        return max((size for _, size in a.holes()), default=0)
    return max(((1 << j) * m.b for _, j in a.free_blocks()), default=0)


def expected_offset(a: Allocator, m: Model, nbytes: int) -> int | None:
    """Where the placement policy must put a slab of `nbytes`, or None if nowhere."""
    if m.kind == "buddy":
        k = (nbytes // m.b).bit_length() - 1
        fits = [(j, off) for off, j in a.free_blocks() if j >= k]
        return min(fits)[1] * m.b if fits else None
    holes = [(off, size) for off, size in a.holes() if size >= nbytes]
    if not holes:
        return None
    placement = m.opts["placement"]
    if placement == "first-fit":
        return holes[0][0]
    if placement == "best-fit":
        return min(holes, key=lambda h: (h[1], h[0]))[0]
    if placement == "worst-fit":
        return min(holes, key=lambda h: (-h[1], h[0]))[0]
    # next-fit: holes reaching past the rover first (by address), then wrap around.
    return min(holes, key=lambda h: (h[0] + h[1] <= m.rover, h[0]))[0]


# ----------------------------------------------------------------------- brute force
def brute_integrate(a: Allocator, n: int, probe, w0: float, w1: float) -> dict[str, float]:
    c = copy.deepcopy(a)
    sums = dict.fromkeys((*PARTS, "saved"), 0.0)
    for j in range(1, n + 1):
        assert c.step(1)
        acc = c.account(probe)
        for part in PARTS:
            sums[part] += getattr(acc, part) * (w0 + w1 * (j - 1))
        sums["saved"] += c.saved_by_sharing() * (w0 + w1 * (j - 1))
    return sums


def check_integrate(a: Allocator, m: Model, x: int, w0: float, w1: float, probe) -> None:
    limits = [v for v in (a.steps_until_done(), a.steps_until_full()) if v is not None]
    n = x % (min([40, *limits]) + 1)
    before = snapshot(a, probe)
    got = a.integrate(n, probe, w0, w1)
    assert snapshot(a, probe) == before, "integrate changed the allocator"
    want = brute_integrate(a, n, probe, w0, w1)
    scale = m.capacity * n * (abs(w0) + abs(w1) * n + 1)
    assert set(got) == {*PARTS, "saved"}
    for part in (*PARTS, "saved"):
        assert got[part] == pytest.approx(want[part], rel=1e-9, abs=1e-12 * scale), part
    total = sum(got[part] for part in PARTS)
    assert total == pytest.approx(
        m.capacity * (n * w0 + w1 * n * (n - 1) / 2), rel=1e-9, abs=1e-12 * scale
    )


def check_steps_until_full(a: Allocator, m: Model) -> None:
    full, done = a.steps_until_full(), a.steps_until_done()
    if not m.paged:
        assert full is None
        return
    if done is None:
        assert full is None
        return
    assert full is not None and full >= 0
    if full >= done:
        c = copy.deepcopy(a)
        assert c.step(done)
        return
    # In one go.
    c = copy.deepcopy(a)
    assert c.step(full)
    assert c.steps_until_full() == 0
    before = snapshot(c, None)
    refused = c.step(1)
    assert not refused and refused.reason is Reason.OUT_OF_MEMORY
    assert snapshot(c, None) == before
    # One step at a time reaches the same point.
    c = copy.deepcopy(a)
    for _ in range(full):
        assert c.step(1)
    assert not c.step(1)
    # Why: the decoders whose last block is full each need a new one, and too few are free.
    crossing = [
        r for r in c.rids()
        if c._get(r).decoding and m.blocks(c.tokens(r) + 1) > m.blocks(c.tokens(r))
    ]
    assert len(crossing) > c.free_blocks()


# ------------------------------------------------------------------------ the driver
OPS = (
    "admit",
    "admit",
    "admit",
    "admit",
    "grow",
    "step",
    "step",
    "decoding",
    "free",
    "free",
    "integrate",
    "full",
    "probe",
)
# One op: its name, four integers that choose its arguments, and two weights (integrate).
OP = st.tuples(
    st.sampled_from(OPS),
    st.integers(0, 2**16),
    st.integers(0, 2**16),
    st.integers(0, 2**16),
    st.integers(0, 2**16),
    st.floats(0, 10),
    st.floats(-3, 3),
)


def only(name: str):
    return OP.map(lambda op: (name, *op[1:]))


# Random ops; or fill, free some, refill (the pattern that leaves holes behind).
OP_LISTS = st.lists(OP, min_size=10, max_size=60) | st.builds(
    lambda fill, free, refill, rest: fill + free + refill + rest,
    st.lists(only("admit"), min_size=4, max_size=20),
    st.lists(only("free"), min_size=1, max_size=8),
    st.lists(only("admit"), min_size=1, max_size=10),
    st.lists(OP, max_size=10),
)
GEOMETRY = st.tuples(
    st.integers(1, 4),  # bytes per token
    st.integers(2, 48),  # max_model_len
    st.integers(1, 8),  # whole token slots in the budget: max_model_len x this ...
    st.integers(0, 48),  # ... plus this
    st.integers(0, 3),  # tail bytes (taken modulo bytes per token)
)


def pick(x: int, lo: int, hi: int) -> int:
    """An integer in [lo, hi] chosen by x."""
    return lo + x % (hi - lo + 1)


def make_request(rid: int, mml: int, x: int, y: int, z: int) -> Request:
    """Prompts up to mml + 2 (so some are too long), outputs up to mml, limits up to 2 x mml."""
    max_tokens = None if z % 3 == 0 else pick(z // 3, 1, 2 * mml)
    return Request(rid, pick(x, 1, mml + 2), pick(y, 1, mml), max_tokens)


def run_ops(kind: str, opts: dict, geometry, tables: bool, ops) -> None:
    b, mml, times, extra, tail = geometry
    if kind == "vattention":
        b = opts["geometry"].bytes_per_token
    capacity = (mml * times + extra) * b + tail % b
    a = build(kind, opts, capacity, b, mml)
    m = Model(kind, opts, capacity, b, mml)
    fresh = build(kind, opts, capacity, b, mml)
    probe = None
    check_invariants(a, m, probe, tables)
    for op, x, y, z, u, w0, w1 in ops:
        live = sorted(m.reqs)
        if op == "admit":
            rid = m.next_rid
            req = make_request(rid, mml, x, y, z)
            p = req.prompt
            too_long = p >= mml
            final = None if too_long else m.final(req)
            tokens = None if too_long or u % 2 else pick(u // 2, 1, final)
            decoding = bool(u // 2 % 3)
            before = snapshot(a, probe)
            nbytes = (
                None
                if too_long
                else (
                    m.blocks(tokens or p) * m.block_bytes
                    if m.paged
                    else m.slab_bytes(m.reservation(req))
                )
            )
            where = None
            if nbytes is not None and not m.paged:
                where = expected_offset(a, m, nbytes)
                if where is None and m.opts.get("compaction") and nbytes <= a.free_bytes():
                    where = a.capacity - a.free_bytes()  # slabs packed below, then placed
            result = a.admit(req, tokens=tokens, decoding=decoding)
            if result:
                assert result.rid == rid and result.nbytes == nbytes
                assert result.capacity_tokens == m.reservation(req)
                if m.paged:
                    assert len(result.blocks) == m.blocks(tokens or p)
                else:
                    assert result.offset == where
                    m.rover = where + nbytes
                m.reqs[rid] = req
                m.tokens[rid] = tokens or p
                m.decoding[rid] = decoding
                m.next_rid += 1
            else:
                assert snapshot(a, probe) == before, "a refused admission changed state"
                free = a.free_bytes()
                if too_long:
                    assert result.reason is Reason.PROMPT_TOO_LONG
                elif m.paged:
                    if m.blocks(final) > a.usable_blocks:
                        assert result.reason is Reason.TOO_LARGE
                    else:
                        assert result.reason is Reason.OUT_OF_MEMORY
                        assert m.blocks(tokens or p) > a.free_blocks()
                else:
                    tops = m.top_blocks()
                    if kind == "contiguous":
                        biggest = capacity
                    else:
                        biggest = (1 << tops[0][1]) * b if tops else 0
                    if nbytes > biggest:
                        assert result.reason is Reason.TOO_LARGE
                    elif nbytes > free:
                        assert result.reason is Reason.OUT_OF_MEMORY
                    else:
                        assert result.reason is Reason.FRAGMENTED
                        assert where is None
                        assert largest_hole(a, m) < nbytes <= free
                        assert a.account(req).external > 0
        elif op == "grow" and live:
            growable = [r for r in live if m.tokens[r] < m.final(m.reqs[r])]
            if not growable:
                continue
            rid = growable[x % len(growable)]
            n = pick(y, 1, m.final(m.reqs[rid]) - m.tokens[rid])
            before = snapshot(a, probe)
            free_blocks = a.free_blocks() if m.paged else None
            result = a.grow(rid, n)
            if m.paged:
                need = m.blocks(m.tokens[rid] + n) - m.blocks(m.tokens[rid])
                if need > free_blocks:
                    assert not result and result.reason is Reason.OUT_OF_MEMORY
                    assert snapshot(a, probe) == before, "a refused grow changed state"
                    continue
                assert result and result.nbytes == need * a.block_bytes
                assert len(result.blocks) == need
            else:
                assert result and result.nbytes == 0
            m.tokens[rid] += n
        elif op == "step":
            done, full = a.steps_until_done(), a.steps_until_full()
            n = pick(x, 0, 30 if done is None else done)
            before = snapshot(a, probe)
            allocated = a.account().allocated
            result = a.step(n)
            if full is not None and n > full:
                assert not result and result.reason is Reason.OUT_OF_MEMORY
                assert snapshot(a, probe) == before, "a refused step changed state"
                continue
            assert result
            assert result.nbytes == a.account().allocated - allocated
            for rid in live:
                if m.decoding[rid]:
                    m.tokens[rid] += n
        elif op == "decoding" and live:
            rid = live[x % len(live)]
            flag = bool(y % 2)
            a.set_decoding(rid, flag)
            m.decoding[rid] = flag
        elif op == "free" and live:
            rid = live[x % len(live)]
            held = m.held(rid)
            free = a.free_bytes()
            assert a.free(rid) == held
            assert a.free_bytes() == free + held
            del m.reqs[rid], m.tokens[rid], m.decoding[rid]
        elif op == "integrate":
            check_integrate(a, m, x, w0, w1, probe)
        elif op == "full":
            check_steps_until_full(a, m)
        elif op == "probe":
            req = make_request(-1, mml, x, y, z)
            probe = (
                None
                if u % 4 == 0
                else Request(-1, min(req.prompt, mml - 1), req.output, req.max_tokens)
            )
        check_invariants(a, m, probe, tables)

    # Nothing leaks: freeing everything restores the empty allocator.
    for rid in sorted(m.reqs):
        a.free(rid)
        del m.reqs[rid], m.tokens[rid], m.decoding[rid]
        check_invariants(a, m, probe, tables)
    assert a.account(None) == fresh.account(None)
    assert a.account(probe) == fresh.account(probe)
    empty = a.account(None)
    assert empty.token_states == empty.reserved == empty.internal == 0
    if kind == "contiguous":
        assert a.holes() == [(0, capacity)] and a.slabs() == []
        assert empty.usable_free == capacity - capacity % b  # judged in whole tokens
    elif kind == "buddy":
        assert a.free_blocks() == m.top_blocks() == fresh.free_blocks()
        assert empty.usable_free == (capacity // b) * b
    else:
        assert a.free_blocks() == a.usable_blocks  # (paged: less the null block, id 0)
        assert empty.usable_free == a.usable_blocks * a.block_bytes
        # Every block id is back: requests filling the pool get each id exactly once (unless
        # no request of two tokens fits the pool: one page, rows straddling pages).
        ids: list[int] = []
        rid = 10**6
        while a.free_blocks() and m.blocks(2) <= a.usable_blocks:
            tokens = min(mml, m.tokens_in(a.free_blocks()))
            assert a.admit(Request(rid, 1, max(tokens - 1, 1)), tokens=tokens, decoding=False)
            ids.extend(a.block_table(rid))
            rid += 1
        null = a.num_blocks - a.usable_blocks
        assert sorted(ids) == list(range(null, a.num_blocks - a.free_blocks()))


@by_config
@SETTINGS
@given(geometry=GEOMETRY, tables=st.booleans(), ops=OP_LISTS)
def test_random_operations(kind, opts, geometry, tables, ops):
    run_ops(kind, opts, geometry, tables, ops)


# --------------------------------------------- integrate on states built to be interesting
POOLS = [("paged", {"block_size": bs}) for bs in (1, 2, 3, 7, 16)] + [
    ("vattention", {"page_size": page, "geometry": geo})
    for page, geo in ((4, T3), (6, T4), (8, T3))
]


@pytest.mark.parametrize(("kind", "opts"), POOLS, ids=[config_id(k, o) for k, o in POOLS])
@settings(max_examples=150, deadline=None)
@given(
    phases=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 80), st.booleans()), min_size=1, max_size=8
    ),
    clock=st.integers(0, 40),
    extra_blocks=st.integers(0, 60),
    w0=st.floats(0, 5),
    w1=st.floats(-2, 2),
    data=st.data(),
)
def test_paged_integrate_and_full(kind, opts, phases, clock, extra_blocks, w0, w1, data):
    """Block pools with many decoders at mixed residues, after the clock has moved."""
    b = opts["geometry"].bytes_per_token if kind == "vattention" else 2
    mml = 200
    m = Model(kind, opts, 0, b, mml)
    # Enough blocks for everyone's prompt, plus a random margin, so the pool may run out.
    need = sum(m.blocks(p) for p, _, _ in phases)
    longest = max([clock + 2] + [p + o for p, o, _ in phases])  # no request is TOO_LARGE
    blocks = max(need + extra_blocks, m.blocks(longest))
    blocks += kind == "paged"  # and the null block
    m.capacity = blocks * m.block_bytes + 1
    a = build(kind, opts, m.capacity, b, mml)
    # Move the clock with a throwaway decoder first, so phases are not aligned to 0.
    if clock:
        assert a.admit(Request(-5, 1, clock + 1))
        assert a.step(clock)
        a.free(-5)
    for rid, (prompt, output, decoding) in enumerate(phases):
        assert a.admit(Request(rid, prompt, output), decoding=decoding)
    a.account().check()
    check_steps_until_full(a, m)
    limits = [x for x in (a.steps_until_done(), a.steps_until_full()) if x is not None]
    n = data.draw(st.integers(0, min([60, *limits])))
    probe = Request(99, 3, 4)
    got = a.integrate(n, probe, w0, w1)
    want = brute_integrate(a, n, probe, w0, w1)
    scale = a.capacity * n * (w0 + abs(w1) * n + 1)
    for part in PARTS:
        assert got[part] == pytest.approx(want[part], rel=1e-9, abs=1e-12 * scale), part


def test_integrate_zero_steps_is_zero():
    a = build("paged", {"block_size": 4}, 1000, 2, 64)
    assert a.admit(Request(0, 5, 20))
    assert a.integrate(0, None, 3.0, 1.0) == dict.fromkeys((*PARTS, "saved"), 0)
    five = a.integrate(5, None, 1.0, 0.0)
    assert math.isclose(sum(five[part] for part in PARTS), 5 * 1000)


# ------------------------------------------------ the hybrid allocator on hybrid stacks
def _hybrid_stack(pattern: str):
    from kvfrag.sim.layers import (
        MLA,
        ChunkedLocal,
        FullAttention,
        LayerStack,
        MambaState,
        SlidingWindow,
    )

    kinds = {"s": SlidingWindow(1, 4, 2, window=20), "f": FullAttention(1, 4, 2),
             "c": ChunkedLocal(1, 4, 2, chunk=24), "m": MLA(6, 2, 2),
             "g": MambaState(600, "gated_delta_net")}
    return LayerStack(pattern, tuple(kinds[ch] for ch in pattern))


HYBRID = ["sssssfsssssf", "sfsfsf", "cccfcccf", "mmmm", "gggfgggf"]


@pytest.mark.parametrize("pattern", HYBRID)
@settings(max_examples=60, deadline=None)
@given(
    phases=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 80), st.booleans()), min_size=1, max_size=6
    ),
    clock=st.integers(0, 40),
    extra_blocks=st.integers(0, 200),
    w0=st.floats(0, 5),
    w1=st.floats(-2, 2),
    data=st.data(),
)
def test_hybrid_integrate_and_full(pattern, phases, clock, extra_blocks, w0, w1, data):
    """Hybrid pools with decoders at mixed phases: integrate is the brute-force sum, and
    steps_until_full the last step before a refusal."""
    stack = _hybrid_stack(pattern)
    b, mml = stack.full_bytes_per_token, 200
    probe_alloc = make_allocator("hybrid", capacity=10**9, bytes_per_token=b, max_model_len=mml,
                                 stack=stack)
    page = probe_alloc.page
    need = sum(probe_alloc.bytes_for(Request(0, p, 1), p) for p, _, _ in phases) // page
    blocks = max(need, probe_alloc.plan.max_request_blocks) + extra_blocks + 1
    a = make_allocator("hybrid", capacity=blocks * page + 7, bytes_per_token=b,
                       max_model_len=mml, stack=stack)
    if clock:
        assert a.admit(Request(-5, 1, clock + 1))
        assert a.step(clock)
        a.free(-5)
    for rid, (prompt, output, decoding) in enumerate(phases):
        assert a.admit(Request(rid, prompt, output), decoding=decoding)
    a.account().check()
    full, done = a.steps_until_full(), a.steps_until_done()
    if done is not None:
        c = copy.deepcopy(a)
        assert c.step(min(full, done))
        if full < done:
            assert not c.step(1)
    limits = [x for x in (done, full) if x is not None]
    n = data.draw(st.integers(0, min([60, *limits])))
    got = a.integrate(n, None, w0, w1)
    want = brute_integrate(a, n, None, w0, w1)
    scale = a.capacity * n * (w0 + abs(w1) * n + 1)
    for part in PARTS:
        assert got[part] == pytest.approx(want[part], rel=1e-9, abs=1e-12 * scale), part


@pytest.mark.parametrize("pattern", HYBRID)
@settings(max_examples=60, deadline=None)
@given(
    phases=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 80), st.booleans()), min_size=1, max_size=6
    ),
    clock=st.integers(0, 40),
    extra=st.integers(0, 6_000),
    w0=st.floats(0, 5),
    w1=st.floats(-2, 2),
    data=st.data(),
)
def test_floor_integrate_and_full(pattern, phases, clock, extra, w0, w1, data):
    """The floor with decoders at mixed phases, past window edges and chunk starts:
    integrate is the brute-force sum, steps_until_full the last step before a refusal, and
    the running sums are each request's need, summed afresh."""
    stack = _hybrid_stack(pattern)
    b, mml = stack.full_bytes_per_token, 200
    sizing = make_allocator("floor", capacity=10**12, bytes_per_token=b, max_model_len=mml,
                            stack=stack)
    need = sum(sizing.bytes_for(Request(0, p, 1), p) for p, _, _ in phases)
    capacity = max(need, sizing.bytes_for(Request(0, 1, 1), clock + 2)) + extra
    a = make_allocator("floor", capacity=capacity, bytes_per_token=b, max_model_len=mml,
                       stack=stack)
    if clock:
        assert a.admit(Request(-5, 1, clock + 1))
        assert a.step(clock)
        a.free(-5)
    for rid, (prompt, output, decoding) in enumerate(phases):
        assert a.admit(Request(rid, prompt, output), decoding=decoding)
    acc = a.account()
    acc.check()
    assert acc.internal == acc.external == 0
    assert acc.token_states == sum(a.need(a.tokens(r)) for r in a.rids())
    assert acc.allocated == sum(a.allocated_bytes(r) for r in a.rids())
    full, done = a.steps_until_full(), a.steps_until_done()
    if done is not None:
        c = copy.deepcopy(a)
        if full is None or full >= done:
            assert c.step(done)
        else:
            assert c.step(full)
            assert not c.step(1)
            after = sum(c.need(c.tokens(r) + c.is_decoding(r)) for r in c.rids())
            assert after + c.account().reserved > c.capacity  # (the next step does not fit)
        c.account().check()
        assert c.account().token_states == sum(c.need(c.tokens(r)) for r in c.rids())
    limits = [x for x in (done, full) if x is not None]
    n = data.draw(st.integers(0, min([60, *limits])))
    got = a.integrate(n, None, w0, w1)
    want = brute_integrate(a, n, None, w0, w1)
    scale = a.capacity * n * (w0 + abs(w1) * n + 1)
    for part in PARTS:
        assert got[part] == pytest.approx(want[part], rel=1e-9, abs=1e-12 * scale), part


def test_floor_full_passes_a_chunk_start_where_the_need_drops():
    """Three chunked-local layers (chunk 24) and a full one, 16 B per token each: a decoder's
    need is 64 B a token up to a chunk's end, drops to the full layer's and one token at the
    next chunk's start, and grows again; in 1,536 B it fills at 24 tokens, passes the chunk
    start, and is refused only past 42 (16 x 43 + 48 x 19 > 1,536)."""
    from kvfrag.sim.layers import ChunkedLocal, FullAttention, LayerStack

    stack = LayerStack("c3f", (ChunkedLocal(1, 4, 2, chunk=24),) * 3 + (FullAttention(1, 4, 2),))
    a = make_allocator("floor", capacity=1536, bytes_per_token=64, max_model_len=200,
                       stack=stack)
    assert a.admit(Request(0, 23, 100))
    assert a.account().token_states == 64 * 23
    assert a.steps_until_full() == 19
    assert a.step(1) and a.account().usable_free == 0  # 24 tokens: the budget, exactly
    assert a.step(1) and a.account().token_states == 16 * 25 + 48  # a chunk start
    assert a.step(17) and a.account().usable_free == 0
    assert a.steps_until_full() == 0 and not a.step(1)
