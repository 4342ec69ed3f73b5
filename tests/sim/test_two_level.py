"""The `two-level` allocator in its own layout (one unpadded group per layer type, large pages
of the LCM of the small pages): its pool, and the accounting over random operations
(identity to the byte, token_states as the model needs, no overlap, every small page inside a
large page of its type, no leak, steps_until_full exact, integrals the step-by-step sums)."""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from runpy import run_path

import numpy as np
import pandas as pd
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Reason, Request, TwoLevelAllocator, make_allocator
from kvfrag.sim.allocators.paged import FreeIds
from kvfrag.sim.allocators.two_level_plan import (
    MAX_LCM_RATIO,
    MIN_LARGE_PAGES,
    large_page,
    layer_types,
)
from kvfrag.sim.allocators.two_level_pool import TwoLevelPool
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.hybrid_presets import STACKS
from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    LayerStack,
    MambaState,
    SlidingWindow,
)
from kvfrag.sim.model_view import ModelView
from kvfrag.sim.reference import reference

warnings.filterwarnings("ignore", message=".*pure-Python.*")

MML = 160


def _stack(pattern: str) -> LayerStack:
    kinds = {"s": SlidingWindow(1, 4, 2, window=20), "f": FullAttention(1, 4, 2),
             "c": ChunkedLocal(1, 4, 2, chunk=24), "m": MLA(6, 2, 2),
             "g": MambaState(600, "gated_delta_net"), "w": SlidingWindow(1, 4, 2, window=6),
             "F": FullAttention(2, 4, 2)}
    return LayerStack(pattern, tuple(kinds[ch] for ch in pattern))


PATTERNS = ["sssssfsssssf", "wfwfwf", "cccfcccf", "mmmf", "gggfgggf", "sssFw"]


# ----------------------------------------------------------------------------- the pool
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=80))
def test_one_page_per_large_page_hands_out_ids_as_free_ids(ops):
    """With vLLM's constraints (one small page per large page) the pool's ids come out in
    the order of the hybrid allocator's FreeIds, under the same takes and gives."""
    pool, ids = TwoLevelPool(40, [1], True), FreeIds(40)
    ids.pop()
    held: list[int] = []
    for take, k in ops:
        if take and len(ids):
            sid = pool.take(0, -1)
            assert sid == ids.pop()
            held.append(sid)
        elif held:
            gone = held[k % len(held):]
            del held[k % len(held):]
            pool.give(0, gone)
            ids.give(list(gone))
    assert len(pool.free_large) == len(ids)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30), st.booleans()), max_size=60),
       st.integers(0, 60))
def test_pool_undo_restores_the_state_and_its_placements(ops, cut):
    """A trial undone leaves the pool as it was by value: the same ids come out after it."""
    def run(pool: TwoLevelPool, held: list[list[int]], todo) -> list[int]:
        out = []
        for t, k, take in todo:
            if take:
                sid = pool.take(t, held[t][-1] if held[t] and k % 2 else -1)
                out.append(sid)
                if sid >= 0:
                    held[t].append(sid)
            elif held[t]:
                gone = held[t][k % len(held[t]):]
                del held[t][k % len(held[t]):]
                pool.give(t, gone)
        pool.check()
        return out

    pool, held = TwoLevelPool(12, [1, 3, 5], False), [[], [], []]
    run(pool, held, ops[:cut])
    later = copy.deepcopy((pool, held))
    mark = pool.mark()
    run(pool, [list(h) for h in held], ops[cut:])
    pool.undo(mark)
    pool.commit(mark)
    pool.check()
    assert pool.state() == later[0].state()
    assert run(pool, held, ops) == run(later[0], later[1], ops)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12), st.booleans()), max_size=40))
def test_take_many_is_takes_in_a_row(ops):
    """`take_many` (a large page at a time) places exactly as `take` after `take`, each hinted
    by the one before, and refuses where they run short; undone, the pool is as before."""
    one, many = TwoLevelPool(9, [1, 3, 5], False), TwoLevelPool(9, [1, 3, 5], False)
    held: list[list[int]] = [[], [], []]
    for t, n, keep in ops:
        want: list[int] = []
        hint = held[t][-1] if held[t] else -1
        for _ in range(n):
            sid = one.take(t, hint)
            if sid < 0:
                break
            want.append(sid)
            hint = sid
        got: list[int] = []
        mark = many.mark()
        ok = many.take_many(t, n, held[t][-1] if held[t] else -1, got)
        assert ok == (len(want) == n) and got == want
        if not ok:
            one.give(t, want)
            many.undo(mark)
        else:
            held[t].extend(got)
        many.commit(mark)
        if not keep and held[t]:
            gone = held[t][len(held[t]) // 2:]
            del held[t][len(held[t]) // 2:]
            one.give(t, list(gone))
            many.give(t, list(gone))
        many.check()
        assert one.state() == many.state()


def test_masks_wider_than_a_machine_word():
    """A type of more than 64 small pages a large page (its masks beyond a machine int):
    `take_many` places as `take` after `take`, a trial with gives undone restores the pool,
    and giving everything back empties it."""
    one, many = TwoLevelPool(4, [1, 70], False), TwoLevelPool(4, [1, 70], False)
    want, hint = [], -1
    for _ in range(100):
        hint = one.take(1, hint)
        want.append(hint)
    got: list[int] = []
    assert many.take_many(1, 100, -1, got) and got == want
    assert many.state() == one.state()
    mark = many.mark()
    more: list[int] = []
    assert many.take_many(1, 30, got[-1], more) and len(more) == 30
    many.give(1, got[10:80])
    many.undo(mark)
    many.commit(mark)
    many.check()
    assert many.state() == one.state()
    many.give(1, got)
    many.check()
    assert many.used_large_pages() == 0 and many.free_small == [0, 0]


def test_the_last_page_of_a_bitmap_word():
    """Large page 31, the last of its partly-used bitmap word: given a slot back inside a
    trial and undone, no other page is left marked partly used, so with every page full a
    take finds none."""
    pool = TwoLevelPool(40, [2], False)
    held: list[int] = []
    assert pool.take_many(0, 80, -1, held)
    mark = pool.mark()
    pool.give(0, [held[63]])  # (page 31's second slot)
    pool.check()
    pool.undo(mark)
    pool.commit(mark)
    pool.check()
    before = pool.state()
    got: list[int] = []
    assert not pool.take_many(0, 1, -1, got) and got == []
    assert pool.state() == before


def test_request_aware_placement_keeps_a_request_together():
    """A request's pages of one type fill its own large page first, so large pages empty as
    requests finish; fresh pages only when no large page of the type has room."""
    pool = TwoLevelPool(10, [4], False)
    a = [pool.take(0, -1)]
    b = [pool.take(0, -1)]  # (into a's large page: the only one of the type with room)
    for _ in range(5):
        a.append(pool.take(0, a[-1]))
    assert {x // 4 for x in a} == {0, 1} and pool.used_large_pages() == 2
    pool.give(0, a)
    assert pool.used_large_pages() == 1  # a's second large page went back; b's stays
    pool.give(0, b)
    assert pool.used_large_pages() == 0 and pool.free_small == [0]


# ----------------------------------------------------------------------------- the plan
def test_gemma_3_27b_types_and_pages():
    """Gemma-3-27B: two types, no padding: 52 sliding layers (window 1,024) and 10 full,
    each 16 KV heads x 128 x bf16 K and V = 8 KiB per token per layer; small pages of 16
    tokens: 6.5 MiB and 1.25 MiB, large page their LCM, 6.5 MiB."""
    stack = STACKS["gemma-3-27b"]
    types = layer_types(stack)
    assert [(k, w, len(ls)) for k, w, ls in types] == [("sliding_window", 1024, 52),
                                                        ("full", 0, 10)]
    small = [16 * 52 * 8192, 16 * 10 * 8192]
    assert large_page(small, 18 << 30) == (52 * 16 * 8192 * 5, [5, 26], False)


def test_an_absurd_lcm_falls_back_to_the_largest_small_page():
    """Small pages whose LCM exceeds MAX_LCM_RATIO x the largest, or a budget that holds
    fewer than MIN_LARGE_PAGES of it: the large page is the largest, each type fitting
    floor(large / small) pages of it (padded)."""
    budget = 10**9
    assert math.lcm(1000, 999) > MAX_LCM_RATIO * 1000
    assert large_page([1000, 999], budget) == (1000, [1, 1], True)
    assert large_page([1000, 301], budget) == (1000, [1, 3], True)
    assert large_page([1000, 250], budget) == (1000, [1, 4], False)
    assert large_page([1000, 300], budget) == (3000, [3, 10], False)
    assert large_page([1000, 300], 3000 * MIN_LARGE_PAGES - 1) == (1000, [1, 3], True)


def test_bad_options_one_line():
    stack = _stack("sf")
    kw = dict(capacity=10**6, bytes_per_token=stack.full_bytes_per_token, max_model_len=MML,
              stack=stack)
    with pytest.raises(ValueError, match=r"^prefix_caching must be true or false, not 1$"):
        make_allocator("two-level", prefix_caching=1, **kw)
    with pytest.raises(ValueError, match=r"^prefix caching is modelled by TwoLevelOwnCaching"):
        TwoLevelAllocator(prefix_caching=True, **kw)  # (make_allocator builds that)
    with pytest.raises(ValueError, match=r"^vllm_groups must be true or false"):
        make_allocator("two-level", vllm_groups="yes", **kw)


# ------------------------------------------------------- where it differs from vLLM on purpose
def test_async_frees_by_the_tokens_computed_unlike_vllm():
    """Async scheduling: two-level frees a window's blocks by the tokens computed before the
    allocation, as without async scheduling (the GPU runs the step that still reads them
    first); vLLM, and two-level with `vllm_groups`, by the tokens processed, a step later. A
    second chunk of 20 tokens after 20 with window 6 and blocks of 2: two-level frees the
    floor((20 - 6 + 1) / 2) = 7 blocks out of the window at once, vLLM none of them yet."""
    stack = _stack("wfwfwf")
    held = {}
    for kind, vllm_groups in (("two-level", False), ("two-level", True), ("hybrid", None)):
        kw: dict = dict(capacity=10**6, bytes_per_token=stack.full_bytes_per_token,
                        max_model_len=MML, stack=stack, block_size=2)
        if vllm_groups is not None:
            kw["vllm_groups"] = vllm_groups
        a = make_allocator(kind, **kw)
        a.set_async()
        assert a.admit(Request(0, 40, 10), tokens=20, decoding=False)
        assert a.grow(0, 20, 20)
        assert a.group_kinds() == ("sliding_window", "full")
        held[kind, vllm_groups] = [len(t) for t in a.group_tables(0)]
    assert held["two-level", False] == [20 - 7, 20]
    assert held["two-level", True] == held["hybrid", None] == [20, 20]


def test_admission_caps_allow_one_batch_in_flight_unlike_vllm():
    """Freeing by the tokens computed, a sliding group never holds more than W - 1 tokens
    before a chunk and the chunk: two-level's admission cap counts one batch in flight, where
    vLLM's (and two-level's with `vllm_groups`) counts `concurrent_batches` of them."""
    stack = _stack("wfwfwf")
    kw: dict = dict(capacity=10**6, bytes_per_token=stack.full_bytes_per_token,
                    max_model_len=MML, stack=stack, block_size=2, max_num_batched_tokens=20,
                    concurrent_batches=2)
    caps = {vg: make_allocator("two-level", vllm_groups=vg, **kw).managers[0].cap
            for vg in (False, True)}
    assert caps == {False: -(-(6 - 1 + 20) // 2) + 1, True: -(-(6 - 1 + 2 * 20) // 2) + 1}


# ----------------------------------------------------------------- random operations
def _need(stack: LayerStack, tokens: int) -> int:
    """What the model needs of a request of `tokens`: every layer's window of them, and
    its Mamba state (`ModelView`, the hybrid allocator's definition)."""
    view = ModelView.of(stack)
    out = 0 if view is None else view.out_of_window(tokens)
    return tokens * stack.full_bytes_per_token - out + stack.state_bytes_per_request


def _brute(a, n: int, w0: float, w1: float) -> dict[str, float]:
    c = copy.deepcopy(a)
    sums = dict.fromkeys(PARTS, 0.0)
    for j in range(1, n + 1):
        assert c.step(1)
        for part, value in zip(PARTS, c.parts(None), strict=True):
            sums[part] += value * (w0 + w1 * (j - 1))
    return sums


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=30, deadline=None)
@given(asynchronous=st.booleans(), pages=st.integers(1, 12), data=st.data())
def test_random_operations_keep_the_accounting(pattern, asynchronous, pages, data):
    stack = _stack(pattern)
    b = stack.full_bytes_per_token
    probe = make_allocator("two-level", capacity=10**9, bytes_per_token=b, max_model_len=MML,
                           stack=stack)
    # (vLLM's memory check, which the plan keeps: one request of max_model_len fits)
    vllm = probe.plan
    capacity = (vllm.max_request_blocks + 1) * vllm.page_bytes + probe.large * pages + 3
    a = make_allocator("two-level", capacity=capacity, bytes_per_token=b, max_model_len=MML,
                       stack=stack)
    if asynchronous:
        a.set_async()
    fresh = a.parts(None)
    rid, last, prompts = 0, {}, {}
    for _ in range(data.draw(st.integers(1, 30), label="ops")):
        op = data.draw(st.sampled_from(["admit", "admit", "grow", "step", "step", "free"]))
        if op == "admit":
            prompt, output = data.draw(st.integers(1, 90)), data.draw(st.integers(1, 70))
            decoding = data.draw(st.booleans())
            chunk = prompt if decoding else data.draw(st.integers(1, prompt))
            short = a.admit_shortfall(chunk)
            got = a.admit(Request(rid, prompt, output), tokens=chunk, decoding=decoding)
            assert bool(got) == (short == 0) or got.reason is Reason.TOO_LARGE
            event(f"admit {bool(got)}")
            last[rid], prompts[rid] = chunk, prompt
            rid += 1
        elif op == "grow":
            growing = [r for r in a.rids() if not a.is_decoding(r) and a.tokens(r) < prompts[r]]
            if not growing:
                continue
            r = data.draw(st.sampled_from(growing))
            n = data.draw(st.integers(1, prompts[r] - a.tokens(r)))
            flight = data.draw(st.sampled_from([0, last[r]])) if asynchronous else 0
            short = a.grow_shortfall(r, n, flight)
            before = a.parts(None)
            granted = a.grow(r, n, flight)
            assert bool(granted) == (short == 0)
            if not granted:
                assert a.parts(None) == before
            else:
                last[r] = n
                if a.tokens(r) == prompts[r] and data.draw(st.booleans()):
                    a.set_decoding(r, True)
        elif op == "step":
            done, full = a.steps_until_done(), a.steps_until_full()
            if done is None:
                continue
            if full < done:  # exact: the step past it is refused, and changes nothing
                c = copy.deepcopy(a)
                assert c.step(full)
                before = c.parts(None)
                assert not c.step(1) and c.parts(None) == before
                event("refused step")
            n = data.draw(st.integers(0, full))
            assert a.step(n)
            while a.steps_until_done() == 0:
                a.free(a.first_done())
        elif op == "free" and a.rids():
            a.free(data.draw(st.sampled_from(a.rids())))
        acc = a.account()
        acc.check()
        assert acc.token_states == sum(_need(stack, a.tokens(r)) for r in a.rids())
        a.check_pages()
        done = a.steps_until_done()
        if done:
            n = data.draw(st.integers(0, min(done, a.steps_until_full(), 40)))
            w0, w1 = data.draw(st.floats(0, 3)), data.draw(st.floats(-1, 1))
            got, want = a.integrate(n, None, w0, w1), _brute(a, n, w0, w1)
            scale = a.capacity * n * (w0 + abs(w1) * n + 1)
            for part in PARTS:
                assert got[part] == pytest.approx(want[part], rel=1e-9, abs=1e-12 * scale)
    for r in a.rids():
        a.free(r)
    assert a.pool.used_large_pages() == 0 and a.parts(None) == fresh


def _walked_state(a):
    """What a walk of the decoders' events leaves: the pool by value, the tables, the
    events."""
    return (a.pool.state(), a.pool.free_large_pages(), a._tables, a._named_start,
            sorted(a._clocks), dict(zip(a._clocks, a._buckets, strict=True)),
            {d.rid: d.at for d in a._decoders.values()})


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=30, deadline=None)
@given(asynchronous=st.booleans(), pages=st.integers(1, 12), data=st.data())
def test_a_look_ahead_replayed_is_the_walk(pattern, asynchronous, pages, data):
    """Stepping as far as a look-ahead walked replays its journals (`_redo`): the same pool,
    tables and events as walking those steps afresh."""
    stack = _stack(pattern)
    b = stack.full_bytes_per_token
    probe = make_allocator("two-level", capacity=10**9, bytes_per_token=b, max_model_len=MML,
                           stack=stack)
    capacity = (probe.plan.max_request_blocks + 1) * probe.plan.page_bytes + probe.large * pages
    a = make_allocator("two-level", capacity=capacity, bytes_per_token=b, max_model_len=MML,
                       stack=stack)
    if asynchronous:
        a.set_async()
    rid = 0
    for _ in range(data.draw(st.integers(1, 12), label="rounds")):
        for _ in range(data.draw(st.integers(0, 3), label="admissions")):
            prompt, output = data.draw(st.integers(1, 60)), data.draw(st.integers(1, 90))
            a.admit(Request(rid, prompt, output), tokens=prompt, decoding=True)
            rid += 1
        done = a.steps_until_done()
        if not done:
            while a.n_decoding and a.steps_until_done() == 0:
                a.free(a.first_done())
            continue
        full = a.steps_until_full()
        if not full:
            a.free(data.draw(st.sampled_from(a.rids())))
            continue
        n = data.draw(st.integers(1, min(done, full)))
        twin = copy.deepcopy(a)
        twin._replay = None
        assert a.steps_until_full_within(n) == n
        a.integrate(n, None, 1.0, 0.5)  # (looks as far too: the free large pages' timeline)
        replayed = a._replay is not None and a._replay[2] == n
        event(f"replayed {replayed}")
        a.advance(n)
        twin.advance(n)
        assert a._replay is None
        assert _walked_state(a) == _walked_state(twin)
        a.check_pages()
        while a.n_decoding and a.steps_until_done() == 0:
            a.free(a.first_done())


# ------------------------------------------------------------------- in the engine
#: The fast engine held to the reference, request by request (tests/sim/agreement.py).
AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 20), pages=st.integers(0, 30),
       chunked=st.booleans(), asynchronous=st.booleans())
def test_fast_engine_matches_per_iteration_reference(pattern, seed, n, pages, chunked,
                                                     asynchronous):
    """The engine's decode stretches lean on steps_until_full(_within) and the integrals,
    which the per-iteration reference (`sim.reference`) never calls: record for record the
    same, in pools small enough to preempt."""
    stack = _stack(pattern)
    tokens = 40 if chunked else 160
    b = stack.full_bytes_per_token

    def make(capacity: int):
        return make_allocator("two-level", capacity=capacity, bytes_per_token=b,
                              max_model_len=MML, stack=stack, max_num_batched_tokens=tokens)

    probe = make(10**9)
    capacity = (probe.plan.max_request_blocks + 1) * probe.plan.page_bytes + probe.large * pages
    rng = np.random.default_rng(seed)
    wl = pd.DataFrame({"request_id": np.arange(n),
                       "arrival_s": np.cumsum(rng.exponential(0.5, n)),
                       "prompt_tokens": rng.integers(1, 101, n),
                       "output_tokens": rng.integers(1, 81, n)})
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=tokens, chunked_prefill=chunked,
                       async_scheduling=asynchronous, step_time=StepTime(0.05, 1e-3, 1e-4))
    fast = run(wl, make(capacity), cfg)
    slow = reference(wl, make(capacity), cfg)
    AGREE(fast, slow, parts=[*PARTS, "internal_overreservation"])
    event(f"preempted {fast.summary['preemptions'] > 0}")


@pytest.mark.parametrize(("option", "message"), [
    ("vllm_groups: maybe", "vllm_groups must be true or false, not 'maybe'"),
    ("prefix_caching: 1", "prefix_caching must be true or false, not 1"),
    ("window: 3", "allocator 'two' (two-level) has no option 'window'"),
])
def test_scenario_refuses_bad_options_in_one_line(option, message):
    from kvfrag.config import ScenarioError, load_scenario

    with pytest.raises(ScenarioError) as err:
        load_scenario("gemma3-27b-long-context",
                      [f"allocators=[{{label: two, kind: two-level, {option}}}]"])
    text = str(err.value)
    assert message in text and "\n" not in text.strip()
