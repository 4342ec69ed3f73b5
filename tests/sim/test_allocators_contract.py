"""The allocator contract, checked for every kind x reserve policy x placement (and paged block
sizes): capacity is reached exactly, refusals carry the right reason and change nothing, freed
space is reused, and the accounting identity holds after every operation."""

from __future__ import annotations

import copy

import pytest
from kvfrag.sim.allocators import (
    PARTS,
    Allocator,
    Grant,
    Placement,
    Reason,
    Refusal,
    Request,
    Reserve,
    make_allocator,
)

RESERVES = [r.value for r in Reserve]
PLACEMENTS = [p.value for p in Placement]
BLOCK_SIZES = [1, 16, 7]

CONFIGS: list[tuple[str, dict]] = (
    [("contiguous", {"reserve": r, "placement": p}) for r in RESERVES for p in PLACEMENTS]
    + [("buddy", {"reserve": r}) for r in RESERVES]
    + [("paged", {"block_size": bs}) for bs in BLOCK_SIZES]
    + [("contiguous", {"reserve": r, "placement": p, "compaction": True})
       for r in ("oracle", "max_tokens") for p in ("first-fit", "next-fit")]
)
CONFIG_IDS = [f"{kind}-{'-'.join(str(v) for v in opts.values())}" for kind, opts in CONFIGS]
# Slab configs whose slab size depends on the request (so holes of different sizes can form).
# (Compaction turns FRAGMENTED refusals into moves: tests/sim/test_compaction.py.)
VARYING_SLABS = [
    (k, o) for k, o in CONFIGS
    if k != "paged" and o["reserve"] != "max_model_len" and not o.get("compaction")
]
VARYING_IDS = [f"{k}-{'-'.join(o.values())}" for k, o in VARYING_SLABS]

by_config = pytest.mark.parametrize(("kind", "opts"), CONFIGS, ids=CONFIG_IDS)


# ------------------------------------------------------------------ independent expectations
def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def reservation(kind: str, opts: dict, req: Request, mml: int) -> int:
    """Tokens a slab allocator sets aside for `req` (paged: the max_model_len cap)."""
    policy = opts.get("reserve", "max_model_len")
    if kind == "paged" or policy == "max_model_len":
        tokens = mml
    elif policy in ("pow2", "pow2_final"):
        tokens = next_pow2(req.prompt + req.output)
    elif policy == "pow2_output":
        tokens = req.prompt + (next_pow2(req.output) if req.output else 0)
    elif policy == "oracle":
        tokens = req.prompt + req.output
    else:
        tokens = req.prompt + req.max_tokens if req.max_tokens else mml
    return min(tokens, mml)


def slab_bytes(kind: str, tokens: int, b: int) -> int:
    return tokens * b if kind == "contiguous" else next_pow2(tokens) * b


def expected_count(
    kind: str, opts: dict, capacity: int, b: int, mml: int, req: Request, tokens: int
) -> int:
    """Closed form: identical requests, each storing `tokens` tokens, that fit when empty."""
    if kind == "paged":
        bs = opts["block_size"]
        num_blocks = capacity // (bs * b) - 1  # less the null block
        return num_blocks // -(-tokens // bs)
    res = reservation(kind, opts, req, mml)
    if kind == "contiguous":
        return capacity // (res * b)
    # buddy: the top blocks are the binary digits of the slot count, so a block of 2^k slots
    # fits (slots >> k) times.
    return (capacity // b) >> (res - 1).bit_length()


# ------------------------------------------------------------------------------- helpers
def build(kind: str, opts: dict, capacity: int, b: int, mml: int) -> Allocator:
    return make_allocator(kind, capacity=capacity, bytes_per_token=b, max_model_len=mml, **opts)


def refusal_free(a: Allocator) -> int:
    """The free bytes a refusal reports: every allocator reports capacity - allocated."""
    return a.free_bytes()


def checked(a: Allocator, probe: Request | None = None) -> None:
    """The accounting identity, judged without a probe and with one; the over-reserved part
    of internal fragmentation within it."""
    a.account(None).check()
    assert 0 <= a.overreserved_bytes() <= a.account(None).internal
    if probe is not None:
        a.account(probe).check()


def snapshot(a: Allocator, probe: Request | None = None) -> dict:
    """Everything observable about an allocator (block tables are materialised first)."""
    state = {
        "account": a.account(None),
        "account_probe": a.account(probe),
        "free": a.free_bytes(),
        "rids": sorted(a.rids()),
        "live": {
            rid: (a.tokens(rid), a.final_tokens(rid), a.allocated_bytes(rid)) for rid in a.rids()
        },
        "done": a.steps_until_done(),
        "full": a.steps_until_full(),
        "decoding": a.n_decoding,
    }
    if hasattr(a, "holes"):
        state["holes"] = a.holes()
    if hasattr(a, "slabs"):
        state["slabs"] = a.slabs()
    if hasattr(a, "free_blocks"):
        state["free_blocks"] = a.free_blocks()
    if hasattr(a, "block_table"):
        state["tables"] = {rid: a.block_table(rid) for rid in a.rids()}
    return state


def fill(a: Allocator, req_of, probe=None) -> tuple[list[int], Refusal]:
    """Admit requests (storing their prompts, decoding) until one is refused."""
    rids = []
    rid = 0
    while True:
        req = req_of(rid)
        result = a.admit(req)
        checked(a, probe)
        if not result:
            return rids, result
        rids.append(rid)
        rid += 1
        assert len(rids) < 100_000


# ------------------------------------------------------------------ capacity exactly reached
GEOMETRIES = [
    # b, capacity, max_model_len, prompt, output, max_tokens
    (3, 3 * 1000 + 2, 16, 5, 6, 6),
    (1, 4096, 64, 30, 10, 12),
    (5, 5 * 777, 40, 39, 1, None),
]


@by_config
@pytest.mark.parametrize(("b", "capacity", "mml", "prompt", "output", "max_tokens"), GEOMETRIES)
def test_capacity_exactly_reached(kind, opts, b, capacity, mml, prompt, output, max_tokens):
    a = build(kind, opts, capacity, b, mml)
    checked(a)

    def req_of(rid: int) -> Request:
        return Request(rid, prompt, output, max_tokens)

    expected = expected_count(kind, opts, capacity, b, mml, req_of(0), req_of(0).final)
    assert expected > 0
    n = 0
    while True:
        req = req_of(n)
        result = a.admit(req, tokens=req.final, decoding=False)
        checked(a, req)
        if not result:
            break
        assert isinstance(result, Grant) and result.rid == n
        n += 1
    assert n == expected
    assert isinstance(result, Refusal)
    assert result.reason is Reason.OUT_OF_MEMORY
    assert result.free == refusal_free(a) < result.needed
    acc = a.account(None)
    assert acc.live == expected
    assert acc.token_states == b * req.final * expected
    # Every slab/block allocation is the same size, so the bytes held are count x unit.
    assert acc.allocated == sum(a.allocated_bytes(r) for r in a.rids())
    assert len({a.allocated_bytes(r) for r in a.rids()}) == 1


# ---------------------------------------------------------------------- refusal reasons
@by_config
def test_prompt_too_long(kind, opts):
    a = build(kind, opts, 1000, 2, 32)
    assert a.admit(Request(0, 10, 10))
    before = snapshot(a)
    for rid, prompt in ((1, 32), (2, 33), (3, 500)):
        req = Request(rid, prompt, 1)
        result = a.admit(req)
        assert not result
        assert result.reason is Reason.PROMPT_TOO_LONG
        # (the base class reports all free bytes here, even for paged)
        assert result.rid == rid and result.free == a.free_bytes()
        assert snapshot(a) == before
        checked(a, req)
    # One token under the limit is a legal prompt.
    assert a.admit(Request(4, 31, 1), decoding=False)
    checked(a)


@by_config
def test_too_large(kind, opts):
    # 10 token slots; the request's final length (50) fits no policy's slab nor the paged pool.
    a = build(kind, opts, 20, 2, 64)
    req = Request(0, 2, 48, max_tokens=48)
    before = snapshot(a, req)
    result = a.admit(req)
    assert not result
    assert result.reason is Reason.TOO_LARGE
    assert result.needed > result.free == refusal_free(a)
    assert snapshot(a, req) == before
    checked(a, req)
    # A request that fits is still admitted by the same allocator, unless the pool is too
    # small to hold a single block besides its null block (paged: 20 // 14 = 1 block).
    small = Request(1, 1, 1, max_tokens=1)
    result = a.admit(small)
    if kind == "paged" and opts["block_size"] > 1:
        assert result.reason is Reason.TOO_LARGE
    elif kind != "paged" and opts["reserve"] == "max_model_len":
        assert result.reason is Reason.TOO_LARGE  # every slab is 64 tokens
    else:
        assert result
    checked(a, small)


@by_config
def test_out_of_memory_and_refusal_changes_nothing(kind, opts):
    b, capacity, mml = 4, 4 * 200 + 3, 16
    a = build(kind, opts, capacity, b, mml)

    def req_of(rid: int) -> Request:
        return Request(rid, 3, 9, max_tokens=9)

    rids, refusal = fill(a, req_of)
    assert len(rids) == expected_count(kind, opts, capacity, b, mml, req_of(0), 3)
    assert refusal.reason is Reason.OUT_OF_MEMORY
    assert refusal.needed > refusal.free == refusal_free(a)
    probe = req_of(999)
    before = snapshot(a, probe)
    for _ in range(3):
        again = a.admit(req_of(len(rids)))
        assert not again and again.reason is Reason.OUT_OF_MEMORY
        assert snapshot(a, probe) == before
    checked(a, probe)


@pytest.mark.parametrize(("kind", "opts"), VARYING_SLABS, ids=VARYING_IDS)
def test_fragmented(kind, opts):
    """Free holes add up to more than a request needs, yet none fits it."""
    b, unit, mml = 2, 4, 16
    a = build(kind, opts, 4 * unit * b, b, mml)  # 16 slots: one buddy top block

    def sized(rid: int, tokens: int) -> Request:
        # final == reservation == tokens under pow2_final and pow2_output (tokens and its
        # halves powers of two), oracle, max_tokens
        return Request(rid, tokens // 2, tokens // 2, max_tokens=tokens // 2)

    for rid in range(4):
        assert a.admit(sized(rid, unit))
        checked(a)
    assert [off for off, _, _ in a.slabs()] == [0, 8, 16, 24]
    assert a.free(0) == unit * b
    assert a.free(2) == unit * b
    checked(a)
    big = sized(9, 2 * unit)
    before = snapshot(a, big)
    result = a.admit(big)
    assert not result
    assert result.reason is Reason.FRAGMENTED
    assert result.free == 2 * unit * b >= result.needed == 2 * unit * b
    assert snapshot(a, big) == before
    acc = a.account(big)
    acc.check()
    assert acc.usable_free == 0
    assert acc.external == 2 * unit * b
    assert acc.largest_hole == unit * b
    assert acc.hole_index == pytest.approx(0.5)
    # Judged by a small request the same holes are all usable.
    small = a.account(sized(10, unit))
    assert small.usable_free == 2 * unit * b and small.external == 0
    # Freeing a neighbour coalesces a hole that fits.
    a.free(1)
    checked(a, big)
    assert a.admit(big)
    checked(a, big)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_never_fragmented(block_size):
    """Any free blocks serve any request: scattered frees never refuse a request that fits."""
    b, mml = 2, 64
    a = build("paged", {"block_size": block_size}, 41 * block_size * b, b, mml)  # + null
    rids = []
    for rid in range(40):
        assert a.admit(Request(rid, block_size, 1), decoding=False)
        rids.append(rid)
    assert a.free_blocks() == 0
    for rid in rids[::2]:  # every other block: 20 scattered free blocks
        a.free(rid)
    checked(a)
    assert a.free_blocks() == 20
    acc = a.account(Request(99, 20 * block_size - 1, 1))
    assert acc.external == a.block_bytes and acc.hole_index == 1 - 20 / 21  # the null block
    big = Request(100, min(20 * block_size, mml - 1), 1)
    assert a.admit(big, decoding=False)
    checked(a)


# -------------------------------------------------------------------- freed space reused
@by_config
def test_freed_space_is_reused(kind, opts):
    b, capacity, mml = 2, 2 * 300, 16

    def req_of(rid: int) -> Request:
        return Request(rid, 4, 8, max_tokens=8)

    a = build(kind, opts, capacity, b, mml)
    rids, refusal = fill(a, req_of)
    assert len(rids) >= 3 and refusal.reason is Reason.OUT_OF_MEMORY
    victim = rids[len(rids) // 2]
    held = a.allocated_bytes(victim)
    where = (
        a.block_table(victim)
        if kind == "paged"
        else dict((rid, off) for off, _, rid in a.slabs())[victim]
    )
    free_before = a.free_bytes()
    assert a.free(victim) == held
    checked(a)
    assert a.free_bytes() == free_before + held
    assert victim not in a.rids()
    new = req_of(1000)
    grant = a.admit(new)
    assert grant
    checked(a, new)
    if kind == "paged":
        assert set(a.block_table(1000)) == set(where)
    else:
        assert grant.offset == where
    assert a.allocated_bytes(1000) == held
    # And the allocator is exactly full again.
    again = a.admit(req_of(1001))
    assert not again and again.reason is Reason.OUT_OF_MEMORY


# ------------------------------------------------- identity after every operation, and leaks
@by_config
def test_lifecycle_identity_and_no_leak(kind, opts):
    b, capacity, mml = 3, 3 * 256 + 1, 32
    a = build(kind, opts, capacity, b, mml)
    fresh = build(kind, opts, capacity, b, mml)
    probe = Request(-1, 5, 10, max_tokens=10)
    reqs = [
        Request(i, 2 + i % 5, 4 + (3 * i) % 11, max_tokens=None if i % 3 else 9) for i in range(12)
    ]
    admitted = []
    for req in reqs:
        if a.admit(req, decoding=req.rid % 4 != 0):
            admitted.append(req.rid)
        checked(a, probe)
    assert admitted
    for _ in range(200):
        done = a.steps_until_done()
        if done is None:
            break
        full = a.steps_until_full()
        n = done if full is None else min(done, full)
        if n == 0:
            # Someone is finished, or the pool is full: retire the oldest decoder.
            rid = next(r for r in a.rids() if r in admitted)
            a.free(rid)
            admitted.remove(rid)
        else:
            tokens = {r: a.tokens(r) for r in a.rids()}
            assert a.step(n)
            for r in a.rids():
                grown = a.tokens(r) - tokens[r]
                assert grown in (0, n)
        checked(a, probe)
    for rid in list(a.rids()):
        left = a.final_tokens(rid) - a.tokens(rid)
        if left and a.grow(rid, left):
            assert a.tokens(rid) == a.final_tokens(rid)
        checked(a, probe)
        a.set_decoding(rid, False)
        checked(a, probe)
    for rid in list(a.rids()):
        a.free(rid)
        checked(a, probe)
    assert a.live == 0 and a.total_tokens() == 0
    assert a.account(None) == fresh.account(None)
    assert a.account(probe) == fresh.account(probe)


@by_config
def test_first_done_is_the_soonest_then_the_lowest_rid(kind, opts):
    """The engine completes decoders in this order: it must hold as they join and leave in
    any order (the allocator keeps its answer between changes)."""
    a = build(kind, opts, 3 * 4096 + 1, 3, 64)
    a.admit(Request(7, 10, 9))  # done after 9 steps
    assert a.first_done() == 7
    a.admit(Request(9, 12, 3))  # after 3
    assert (a.first_done(), a.steps_until_done()) == (9, 3)
    a.admit(Request(3, 12, 3))  # after 3 too, and a lower rid
    assert a.first_done() == 3
    a.admit(Request(5, 12, 3))  # after 3, a higher rid: no change
    assert a.first_done() == 3
    a.set_decoding(5, False)  # not the first: no change
    assert a.first_done() == 3
    a.free(3)  # the first: the next one
    assert a.first_done() == 9
    a.set_decoding(5, True)  # back, after 3 still: ahead of 9 (a lower rid)
    assert a.first_done() == 5
    a.set_decoding(5, False)
    a.set_decoding(9, False)
    assert (a.first_done(), a.steps_until_done()) == (7, 9)
    a.free(7)
    assert a.first_done() is None and a.steps_until_done() is None


# ------------------------------------------------------------ protocol misuse is an error
@by_config
def test_misuse_raises(kind, opts):
    a = build(kind, opts, 1000, 2, 32)
    req = Request(0, 4, 4, max_tokens=4)
    assert a.admit(req)
    with pytest.raises(ValueError, match="already live"):
        a.admit(req)
    with pytest.raises(ValueError, match="not live"):
        a.free(1)
    with pytest.raises(ValueError, match="not live"):
        a.tokens(1)
    with pytest.raises(ValueError, match="cannot grow"):
        a.grow(0, a.final_tokens(0) - a.tokens(0) + 1)
    with pytest.raises(ValueError, match="cannot grow"):
        a.grow(0, 0)
    with pytest.raises(ValueError, match="past its final length"):
        a.step(a.steps_until_done() + 1)
    with pytest.raises(ValueError, match="backwards"):
        a.step(-1)
    with pytest.raises(ValueError, match="cannot store"):
        a.admit(Request(2, 4, 4), tokens=0)
    with pytest.raises(ValueError, match="cannot store"):
        a.admit(Request(3, 4, 4, max_tokens=4), tokens=a.final_tokens(0) + 1)
    # None of that changed anything.
    assert a.rids() == [0] and a.tokens(0) == 4
    checked(a)


def test_request_validation():
    with pytest.raises(ValueError, match=">= 1 token"):
        Request(0, 0, 5)
    with pytest.raises(ValueError, match="output >= 0"):
        Request(0, 5, -1)
    with pytest.raises(ValueError, match="group of 2"):
        Request(0, 5, 0, n=2)  # its sequences fork at a stored output token
    with pytest.raises(ValueError, match="max_tokens"):
        Request(0, 5, 5, max_tokens=-1)
    assert Request(0, 5, 7).final == 12
    assert Request(0, 5, 0).final == 5  # a one-token answer stores only its prompt


def test_grant_truthy_refusal_falsy():
    g = Grant(1, 10, 4)
    r = Refusal(1, Reason.OUT_OF_MEMORY, 10, 5)
    assert g and bool(g) is True
    assert not r and bool(r) is False
    assert set(PARTS) == {"token_states", "reserved", "internal", "external", "usable_free"}


@by_config
def test_deepcopy_is_independent(kind, opts):
    a = build(kind, opts, 3000, 3, 32)
    for rid in range(3):
        assert a.admit(Request(rid, 3, 20, max_tokens=20))
    before = snapshot(a)
    c = copy.deepcopy(a)
    assert c.step(5)
    c.free(0)
    assert snapshot(a) == before


# ------------------------------------------------------------ placement, split and merge
def test_placement_policies_choose_the_documented_hole():
    """Holes of 10, 20, 30 and 25 bytes; each policy picks its own for 8- and 15-byte slabs."""

    def layout(placement: str) -> Allocator:
        a = build("contiguous", {"reserve": "oracle", "placement": placement}, 100, 1, 100)
        for rid, size in enumerate((10, 5, 20, 5, 30, 5)):
            assert a.admit(Request(rid, 1, size - 1))
        for rid in (0, 2, 4):
            a.free(rid)
        assert a.holes() == [(0, 10), (15, 20), (40, 30), (75, 25)]
        checked(a)
        return a

    expected = {
        "first-fit": (0, 15),
        "best-fit": (0, 15),
        "worst-fit": (40, 75),  # the 30-byte hole; then 25 at 75 beats the 22 left at 48
        "next-fit": (75, 83),  # from the end of the last slab (75), then on from 83
    }
    for placement, (first, second) in expected.items():
        a = layout(placement)
        assert a.admit(Request(10, 1, 7)).offset == first, placement
        assert a.admit(Request(11, 1, 14)).offset == second, placement
        checked(a)
    # next-fit wraps around when nothing past the rover fits.
    a = layout("next-fit")
    assert a.admit(Request(10, 1, 7)).offset == 75
    assert a.admit(Request(11, 1, 17)).offset == 15  # 18 bytes: 83..100 is 17, wrap to 15
    # best-fit differs from first-fit when a later hole is tighter.
    a = layout("best-fit")
    assert a.admit(Request(12, 1, 21)).offset == 75  # 22 bytes: 25 is tighter than 30
    a = layout("first-fit")
    assert a.admit(Request(12, 1, 21)).offset == 40


def test_next_fit_wraps_around():
    a = build("contiguous", {"reserve": "oracle", "placement": "next-fit"}, 30, 1, 30)
    for rid in range(3):
        assert a.admit(Request(rid, 1, 9)).offset == 10 * rid
    a.free(0)
    a.free(1)  # coalesces with 0: one hole [0, 20); the rover is at 30 (the end)
    assert a.holes() == [(0, 20)]
    assert a.admit(Request(3, 1, 4)).offset == 0  # wrapped
    assert a.admit(Request(4, 1, 4)).offset == 5  # continues from the rover
    checked(a)


def test_buddy_split_and_merge():
    a = build("buddy", {"reserve": "oracle"}, 16, 1, 16)
    assert a.free_blocks() == [(0, 4)]
    assert a.admit(Request(0, 1, 1)).offset == 0  # 2 slots: split 16 -> 8 -> 4 -> 2
    assert a.free_blocks() == [(2, 1), (4, 2), (8, 3)]
    assert a.admit(Request(1, 1, 2)).offset == 4  # 3 tokens -> 4 slots: the free order-2 block
    assert a.admit(Request(2, 1, 1)).offset == 2 * 1  # 2 slots: the free order-1 block
    assert a.free_blocks() == [(8, 3)]
    acc = a.account()
    acc.check()
    assert acc.internal == 1  # the 3-token request in a 4-slot block
    a.free(0)
    assert a.free_blocks() == [(0, 1), (8, 3)]  # its buddy (2) is still held
    a.free(2)
    assert a.free_blocks() == [(0, 2), (8, 3)]  # 0+2 merge; their buddy (4) is held
    a.free(1)
    assert a.free_blocks() == [(0, 4)]  # everything merges back
    checked(a)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_grow_and_step_refusals_change_nothing(block_size):
    b, mml = 2, 200
    a = build("paged", {"block_size": block_size}, 7 * block_size * b + 1, b, mml)  # + null
    assert a.admit(Request(0, 2 * block_size, 3 * block_size))  # 2 of 5 blocks, decoding
    assert a.admit(Request(1, 3 * block_size, 3 * block_size), decoding=False)  # 3 of 6
    assert a.free_blocks() == 1
    full = a.steps_until_full()
    assert full == block_size  # request 0 takes the last block at once and fills it
    probe = Request(9, 5, 5)
    before = snapshot(a, probe)
    refusal = a.step(full + 1)
    assert not refusal and refusal.reason is Reason.OUT_OF_MEMORY
    assert snapshot(a, probe) == before
    refusal = a.grow(1, 2 * block_size)  # needs 2 blocks, 1 is free
    assert not refusal and refusal.reason is Reason.OUT_OF_MEMORY
    assert refusal.needed == 2 * a.block_bytes
    assert refusal.free == a.free_bytes() == a.block_bytes + a.capacity % a.block_bytes
    assert snapshot(a, probe) == before
    assert a.step(full)
    assert a.free_blocks() == 0 and a.steps_until_full() == 0
    checked(a, probe)
    a.set_decoding(0, False)  # out of the cohort, stepping is free again
    assert a.steps_until_full() is None and a.step(5)
    assert a.tokens(0) == 3 * block_size
    checked(a, probe)


@by_config
def test_a_request_freed_and_admitted_again_is_the_new_one(kind, opts):
    """Lookups by rid remember the request last asked about: a rid freed and admitted again
    (a preemption, then the re-admission) must be answered from its new state."""
    a = build(kind, opts, 3 * 4096 + 1, 3, 64)
    a.admit(Request(4, 10, 9))
    a.admit(Request(6, 8, 2))
    assert a.tokens(4) == 10 and a.final_tokens(4) == 19
    a.free(4)
    with pytest.raises(ValueError, match="request 4 is not live"):
        a.tokens(4)
    a.admit(Request(4, 20, 5), tokens=12, decoding=False)
    assert (a.tokens(4), a.final_tokens(4), a.is_decoding(4)) == (12, 25, False)
    assert a.tokens(6) == 8 and a.tokens(4) == 12


# ------------------------------------------------ the hybrid allocator on hybrid stacks
def _hybrid_stacks():
    from kvfrag.sim.layers import (
        MLA,
        ChunkedLocal,
        FullAttention,
        LayerStack,
        MambaState,
        SlidingWindow,
    )

    sw, full = SlidingWindow(1, 4, 2, window=32), FullAttention(1, 4, 2)
    gdn = MambaState(600, "gated_delta_net")
    return {
        "gemma-like": LayerStack("gemma-like", (sw,) * 5 + (full,) + (sw,) * 5 + (full,)),
        "gpt-oss-like": LayerStack("gpt-oss-like", (SlidingWindow(1, 4, 2, window=8), full) * 3),
        "llama4-like": LayerStack("llama4-like", ((ChunkedLocal(1, 4, 2, chunk=24),) * 3
                                                  + (full,)) * 2),
        "mla": LayerStack("mla", (MLA(6, 2, 2),) * 4),
        "qwen3-next-like": LayerStack("qwen3-next-like", ((gdn,) * 3 + (full,)) * 2),
    }


HYBRID_STACKS = _hybrid_stacks()


@pytest.mark.parametrize("kind", ["hybrid", "floor", "static-partition", "two-level",
                                  "two-level-vllm-caching", "two-level-caching"])
@pytest.mark.parametrize("name", list(HYBRID_STACKS))
def test_hybrid_lifecycle_identity_refusals_and_no_leak(name, kind):
    stack = HYBRID_STACKS[name]
    b, mml = stack.full_bytes_per_token, 64
    opts: dict[str, object] = {}
    if kind == "two-level-vllm-caching":  # (vLLM's prefix caching on two-level's cache pool)
        kind, opts = "two-level", {"vllm_groups": True, "prefix_caching": True}
    if kind == "two-level-caching":  # (its own layout with prefix caching)
        kind, opts = "two-level", {"prefix_caching": True}
    a = make_allocator(kind, capacity=40_000, bytes_per_token=b, max_model_len=mml,
                       stack=stack, **opts)
    checked(a)
    fresh = copy.deepcopy(a)
    rids, refusal = fill(a, lambda rid: Request(rid, 20 + rid % 7, 30), Request(99, 5, 5))
    assert rids and refusal.reason is Reason.OUT_OF_MEMORY
    before = snapshot(a)
    assert not a.admit(Request(len(rids), 20 + len(rids) % 7, 30)) and snapshot(a) == before
    while (full := a.steps_until_full()) is not None and a.steps_until_done():
        assert a.step(min(full, a.steps_until_done()))
        checked(a, Request(99, 5, 5))
        if full < a.steps_until_done():
            before = snapshot(a)
            assert not a.step(full + 1) and snapshot(a) == before
            a.free(a.rids()[0])
        while a.steps_until_done() == 0:
            a.free(a.first_done())
    for rid in a.rids():
        a.free(rid)
        checked(a)
    assert a.account() == fresh.account()


@pytest.mark.parametrize(("capacity", "b", "tokens"), [(4096, 2, 5), (10_000, 6, 7), (999, 4, 1)])
def test_floor_on_full_attention_fills_the_budget_to_the_byte(capacity, b, tokens):
    """On a full-attention model the floor is every token, byte-granular: requests of
    `tokens` tokens fill capacity // (b x tokens), and the bytes left are usable free."""
    a = make_allocator("floor", capacity=capacity, bytes_per_token=b, max_model_len=64,
                       geometry=_geometry_of(b))
    rids, refusal = fill(a, lambda rid: Request(rid, tokens, 3))
    assert len(rids) == capacity // (b * tokens) and refusal.reason is Reason.OUT_OF_MEMORY
    acc = a.account()
    assert (acc.token_states, acc.reserved, acc.internal, acc.external) == (
        len(rids) * b * tokens, 0, 0, 0)
    assert acc.usable_free == capacity - len(rids) * b * tokens



def _geometry_of(b: int):
    """A one-layer full-attention model of `b` (even) bytes per token."""
    from kvfrag.sim.geometry import KVGeometry

    return KVGeometry("plain", layers=1, kv_heads=1, head_dim=b // 2, dtype_bytes=1)
