"""The paged allocator's closed forms (`FloorSum`) against their definitions, by brute force.

`FloorSum` keeps sum_i coef_i * floor((x_i + K)/bs) in the decode clock K so that decode
stretches cost nothing per token; the allocator tests check it through the allocators, and
these check it alone, on random terms (negative coefficients too, as beams add), including
both ways of summing the residues (walked when few, bisected when many)."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Request, make_allocator
from kvfrag.sim.floor_sum import FloorSum
from kvfrag.sim.geometry import preset


def brute_value(terms: list[tuple[int, int]], bs: int, k: int) -> int:
    return sum(coef * ((x + k) // bs) for x, coef in terms)


def brute_steps_within(terms: list[tuple[int, int]], bs: int, k: int, budget: int) -> int | None:
    """The most steps t with value(k + t') - value(k) <= budget for every t' <= t."""
    if not any(coef for _, coef in terms):
        return None
    per = sum(coef for _, coef in terms)
    spread = sum(abs(coef) for _, coef in terms)
    # A period adds `per`; within one the sum moves by at most `spread`. With per <= 0 the
    # largest rise is within the first period; with per > 0 it passes any budget by this:
    horizon = bs if per <= 0 else bs * (budget + spread + 2)
    base = brute_value(terms, bs, k)
    for t in range(1, horizon + 1):
        if brute_value(terms, bs, k + t) - base > budget:
            return t - 1
    return None


def brute_integrate(terms, bs: int, k: int, n: int, w0: float, w1: float) -> float:
    return sum((w0 + w1 * (j - 1)) * brute_value(terms, bs, k + j) for j in range(1, n + 1))


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 200), st.integers(-3, 4)),
        st.tuples(st.just("step"), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("ask"), st.integers(0, 30), st.just(0)),  # a budget
        st.tuples(st.just("hold"), st.integers(0, 30), st.just(0)),  # a limit, kept over steps
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(bs=st.sampled_from([1, 2, 3, 4, 16]), ops=OPS)
def test_floorsum_matches_its_definition(bs: int, ops: list[tuple[str, int, int]]) -> None:
    check_ops(FloorSum(bs), [], bs, ops)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, first=st.lists(st.integers(1, 3), min_size=40, max_size=40))
def test_floorsum_with_many_residues(ops: list[tuple[str, int, int]], first: list[int]) -> None:
    """Past `_LINEAR` residues in use, sums are bisected rather than walked: the same answers."""
    bs, f, terms = 64, FloorSum(64), []
    for x, coef in enumerate(first):  # 40 residues, then the random operations
        f.add(x, coef)
        terms.append((x, coef))
    check_ops(f, terms, bs, ops)


def check_ops(f: FloorSum, terms: list[tuple[int, int]], bs: int, ops) -> None:
    k = 0
    for op, a, b in ops:
        if op == "add":
            if b:
                f.add(a, b)
                terms.append((a, b))
        elif op == "step":
            k += a
        else:
            base = brute_value(terms, bs, k)
            # "hold": the same limit asked again as the clock moves (the engine's pattern:
            # free blocks shrink by what the steps took).
            budget = a if op == "ask" else max(a + brute_value(terms, bs, 0) - base, 0)
            assert f.steps_within(k, budget) == brute_steps_within(terms, bs, k, budget)
        assert f.value(k) == brute_value(terms, bs, k)
        assert f.nonzero == len(_residues(terms, bs))
    n = 1 + k % 37
    got = f.integrate(k, n, 0.5, 0.25, n * 0.5 + 0.25 * n * (n - 1) / 2)
    assert abs(got - brute_integrate(terms, bs, k, n, 0.5, 0.25)) <= 1e-9 * (1 + abs(got))


def _residues(terms: list[tuple[int, int]], bs: int) -> set[int]:
    """Residues whose coefficients do not sum to zero (those a FloorSum keeps)."""
    sums: dict[int, int] = {}
    for x, coef in terms:
        sums[x % bs] = sums.get(x % bs, 0) + coef
    return {r for r, c in sums.items() if c}


def test_steps_within_after_a_crossing_with_negative_coefficients() -> None:
    """Beams' terms can take the sum over a limit and back under it: from each clock, the
    next crossing (or none, when a period adds nothing and none is in reach)."""
    f = FloorSum(4)
    f.add(3, 2)
    f.add(0, -2)  # value: 0, 2, 2, 2, 0, 2, ... (per period: +0)
    assert [f.value(k) for k in range(6)] == [0, 2, 2, 2, 0, 2]
    assert f.steps_within(0, 1) == 0  # step 1 takes it to 2 > 1
    assert f.steps_within(4, 1) == 0  # and again from 4 (not -4)
    assert f.steps_within(0, 1) == 0  # an earlier clock: not counted from 4's crossing
    assert f.steps_within(4, 2) is None  # never over 2
    assert f.steps_within(5, 0) is None  # from 2: never higher


def test_a_request_back_in_the_cohort_counts_once() -> None:
    """Leaving the decode cohort and joining it again at the same clock leaves an entry in the
    heap of decoders short of their last block equal to the new one: its internal
    fragmentation (the last block's unfilled tail) still counts once, stepped or integrated."""
    B = 8
    a = make_allocator("paged", capacity=64 * 16 * B, bytes_per_token=B, max_model_len=512)
    a.admit(Request(0, prompt=20, output=40), 21)  # final 60: last block from token 49
    for decoding in (False, True, False, True):
        a.set_decoding(0, decoding)
    n = a.steps_until_done()
    assert n == 39  # 21 tokens to 60, the last block entered at step 28
    got = a.integrate(n)
    want = dict.fromkeys(PARTS, 0.0)
    c = copy.deepcopy(a)
    for _ in range(n):
        assert c.step(1)
        acc = c.account()
        for part in PARTS:
            want[part] += getattr(acc, part)
    assert {p: got[p] for p in PARTS} == want
    assert a.step(n)
    assert a.account().internal == 4 * B  # 60 tokens in 4 blocks of 16


@settings(max_examples=100, deadline=None)
@given(
    coefs=st.lists(st.integers(-3, 5), min_size=64, max_size=64),
    k=st.integers(0, 10_000),
    n=st.integers(1, 300),
    w0=st.floats(1e-4, 1.0),
    w1=st.floats(0.0, 1e-3),
)
def test_integrate_with_numpy_is_bit_identical(coefs, k, n, w0, w1) -> None:
    """`integrate` hands many residues to numpy, or not, by a cost estimate alone: both ways
    must give the same float, bit for bit (the same operations in the same order)."""
    f = FloorSum(64)
    for x, coef in enumerate(coefs):
        if coef:
            f.add(x * 7 + 1000, coef)
    weight = n * w0 + w1 * n * (n - 1) / 2
    looped = f.q * weight
    for r, count in zip(f.res, f.coef, strict=True):  # the loop, spelled out as integrate's
        whole, m0 = divmod(r + k + 1, 64)
        y = m0 + n
        q, m = divmod(y, 64)
        u1 = 64 * q * (q - 1) // 2 + m * q
        full = 64 * 64 * (q - 1) * q * (2 * q - 1) // 6 + 64 * 63 * q * (q - 1) // 4
        p2 = full + q * (m * q * 64 + m * (m - 1) // 2)
        looped += count * (whole * weight + w0 * u1 + w1 * (p2 - m0 * u1))
    assert f._integrate_vector(f.q * weight, k, n, w0, w1, weight) == looped
    assert f.integrate(k, n, w0, w1, weight) == looped


def test_null_block_is_never_held_nor_free() -> None:
    """Block 0 is the pool's null block, as in vLLM's BlockPool: a budget of 10 blocks (and a
    tail) gives 9 to requests, block ids 1-9, the watermark rounds over all 10, and the null
    block's bytes are external with the tail, so the five parts still sum to the budget.
    vAttention's pages keep no null block."""
    b, bs = 4, 16
    for kind in ("paged", "prefix-caching"):
        a = make_allocator(kind, capacity=10 * bs * b + 7, bytes_per_token=b,
                           max_model_len=1000, block_size=bs)
        assert (a.num_blocks, a.usable_blocks, a.free_blocks()) == (10, 9, 9)
        assert a.watermark_bytes(0.15) == 1 * bs * b  # int(0.15 x 10), not int(0.15 x 9)
        assert a.pool_bytes() == 9 * bs * b
        assert a.too_large(Request(0, 9 * bs, 1))  # 9 blocks and one slot more
        assert not a.too_large(Request(0, 9 * bs - 1, 1))
        acc = a.account()
        acc.check()
        assert (acc.usable_free, acc.external) == (9 * bs * b, bs * b + 7)
        assert a.admit(Request(1, 5 * bs, 1), 5 * bs - 1, decoding=False)
        assert a.admit(Request(2, 4 * bs, 1), 4 * bs - 1, decoding=False)
        assert a.free_blocks() == 0
        assert sorted(a.block_table(1) + a.block_table(2)) == list(range(1, 10))
        refused = a.admit(Request(3, 1, 1), 1, decoding=False)
        assert not refused and refused.reason.value == "out_of_memory"
        acc = a.account()
        acc.check()
        assert (acc.usable_free, acc.external) == (0, bs * b + 7)
        # free_bytes() is vLLM's free block count (and the tail): never the null block.
        assert a.free_bytes() == 7
        a.free(2)
        assert a.free_bytes() == 4 * bs * b + 7
        assert a.admission_bytes(Request(5, 4 * bs, 1), 4 * bs + 1, 0) > a.free_bytes()
    geo = preset("llama-3-8b")
    v = make_allocator("vattention", capacity=1 << 30, bytes_per_token=geo.bytes_per_token,
                       max_model_len=1000, page_size="2MiB", geometry=geo)
    assert v.usable_blocks == v.num_blocks == v.free_blocks() > 0
