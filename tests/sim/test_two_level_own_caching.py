"""`two-level` in its own layout with prefix caching (`sim/allocators/two_level_own_caching.py`):
the accounting over random operations with shared prefixes on the hybrid presets (identity to
the byte, every held page once and of its type, no leak, steps_until_full exact, integrals the
step-by-step sums), hits as vLLM's where the layouts agree, a sliding hit shortened by its
window's pages evicted, and the engine end to end."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from runpy import run_path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Reason, Request, make_allocator
from kvfrag.sim.allocators.two_level_own_caching import TwoLevelOwnCaching
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.hybrid.caching import HORIZON
from kvfrag.sim.hybrid_presets import STACKS
from kvfrag.sim.layers import FullAttention, LayerStack, SlidingWindow
from kvfrag.sim.scenario_run import run as run_scenario

from kvfrag.config import load_scenario

warnings.filterwarnings("ignore", message=".*pure-Python.*")

_HP = run_path(str(Path(__file__).with_name("test_hybrid_prefix.py")))

PRESETS = ["gemma-3-27b", "gpt-oss-20b", "qwen3-next-80b-a3b", "jamba-1.5-mini"]
BS = 16
MML = 1024


def _own(stack: LayerStack, capacity: int, mml: int = MML, bs: int = BS, **kw):
    a = make_allocator("two-level", capacity=capacity, bytes_per_token=stack.full_bytes_per_token,
                       max_model_len=mml, stack=stack, block_size=bs, prefix_caching=True, **kw)
    assert isinstance(a, TwoLevelOwnCaching)
    return a


def _brute(a, n: int, w0: float, w1: float) -> dict[str, float]:
    c = copy.deepcopy(a)
    sums = dict.fromkeys(PARTS, 0.0)
    for j in range(1, n + 1):
        assert c.step(1)
        for part, value in zip(PARTS, c.parts(None), strict=True):
            sums[part] += value * (w0 + w1 * (j - 1))
    return sums


def _request(rid: int, system: int, blocks: int, question: int, own: int,
             output: int) -> Request:
    """Behind system prompt `system` (of `blocks` blocks), `own` tokens of question
    `question` (a few, so that a question is asked again: a sliding window or a Mamba state
    is cached where a prompt ends, or at a junction a later lookup found)."""
    own_blocks = -(-own // BS)
    ids = [1000 * system + c for c in range(blocks)] + [10**6 + question * 1000 + c
                                                       for c in range(own_blocks)]
    return Request(rid, blocks * BS + own, output, prefix=tuple(ids), prefix_tokens=BS)


@pytest.mark.parametrize("name", PRESETS)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(asynchronous=st.booleans(), pages=st.integers(0, 20), data=st.data())
def test_random_operations_keep_the_accounting(name, asynchronous, pages, data):
    stack = STACKS[name]
    probe = make_allocator("two-level", capacity=1 << 44,
                           bytes_per_token=stack.full_bytes_per_token, max_model_len=MML,
                           stack=stack, block_size=BS)
    # (vLLM's memory check, which the plan keeps: one request of max_model_len fits)
    vllm = probe.plan
    capacity = (vllm.max_request_blocks + 1) * vllm.page_bytes + probe.large * pages + 5
    a = _own(stack, capacity)
    if asynchronous:
        a.set_async()
    fresh = a.parts(None)
    rid, last, prompts = 0, {}, {}
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        op = data.draw(st.sampled_from(["admit", "admit", "grow", "step", "step", "decode",
                                        "free", "preempt"]))
        if op == "admit" and len(a.rids()) < 6:
            system = data.draw(st.integers(0, 1))
            req = _request(rid, system, 20 + 10 * system, data.draw(st.integers(0, 3)),
                           data.draw(st.sampled_from([40, 100, 300])),
                           data.draw(st.integers(1, 200)))
            hit = a.cached_prefix_tokens(req)
            first = data.draw(st.integers(hit + 1, req.prompt))
            decoding = first == req.prompt and data.draw(st.booleans())
            before = a.parts(None)
            got = a.admit(req, tokens=hit + (first - hit), decoding=decoding)
            event(f"admit {bool(got)}, hit {hit > 0}")
            if got:
                last[rid], prompts[rid] = first - hit, req.prompt
            else:
                assert got.reason in (Reason.OUT_OF_MEMORY, Reason.TOO_LARGE)
                assert a.parts(None) == before
            rid += 1
        elif op == "grow":
            growing = [r for r in a.rids() if not a.is_decoding(r) and a.tokens(r) < prompts[r]]
            if not growing:
                continue
            r = data.draw(st.sampled_from(growing))
            n = data.draw(st.integers(1, prompts[r] - a.tokens(r)))
            flight = data.draw(st.sampled_from([0, last[r]])) if asynchronous else 0
            short = a.grow_shortfall(r, n, flight)
            granted = a.grow(r, n, flight)
            assert bool(granted) == (short == 0)
            if granted:
                last[r] = n
        elif op == "decode" and a.rids():
            r = data.draw(st.sampled_from(a.rids()))
            a.set_decoding(r, a.tokens(r) < a.final_tokens(r) and data.draw(st.booleans()))
        elif op == "step":
            done, full = a.steps_until_done(), a.steps_until_full()
            if done is None:
                continue
            if full < min(done, HORIZON):  # exact: the step past it is refused, changes nothing
                c = copy.deepcopy(a)
                assert c.step(full)
                before = c.parts(None)
                assert not c.step(1) and c.parts(None) == before
                event("refused step")
            assert a.step(data.draw(st.integers(0, full)))
            while a.steps_until_done() == 0:
                a.free(a.first_done())
        elif op in ("free", "preempt") and a.rids():
            r = data.draw(st.sampled_from(a.rids()))
            if op == "free":
                a.free(r)
            else:
                a.free_preempted(r, max(0, a.tokens(r) - (1 if asynchronous else 0)))
        acc = a.account()
        acc.check()  # (the identity, to the byte)
        assert sum(a.parts(None)) == a.capacity
        a.check_pages()  # (every held page once, of its type, in a large page of its type)
        done = a.steps_until_done()
        if done:
            n = data.draw(st.integers(0, min(done, a.steps_until_full(), 12)))
            w0, w1 = data.draw(st.floats(0, 3)), data.draw(st.floats(-1, 1))
            got_sums, want = a.integrate(n, None, w0, w1), _brute(a, n, w0, w1)
            scale = a.capacity * n * (w0 + abs(w1) * n + 1)
            for part in PARTS:
                assert got_sums[part] == pytest.approx(want[part], rel=1e-9, abs=1e-12 * scale)
    event(f"evictions {min(a.evictions, 1)}")
    for r in a.rids():
        a.free(r)
    a.check_pages()
    assert a.pool.held_large_pages() == 0 and a.parts(None) == fresh  # (no leak)


@pytest.mark.parametrize("stack", _HP["STACKS"], ids=lambda s: s.name)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_quiet_decode_steps_are_the_steps_applied(stack, asynchronous):
    """A decode step judged quiet (`_quiet_step`: it frees, takes and caches nothing for a
    decoder, sliding and chunked tables included) is skipped; applying every step instead
    gives the same records, in a pool small enough to evict and preempt."""
    wl = _HP["shared"](5, 20, 100, 60)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=40, chunked_prefill=True,
                       async_scheduling=asynchronous, step_time=StepTime(0.05, 1e-3, 1e-4))
    probe = _HP["make"](stack, 10**9, tokens=40)
    capacity = (probe.plan.max_request_blocks + 12) * probe.page

    def make():
        return _own(stack, capacity, mml=_HP["MML"], bs=_HP["BS"], max_num_batched_tokens=40)

    every = make()
    every._quiet_step = lambda *args: False  # (every decoder's step applied)
    a, b = run(wl, make(), cfg), run(wl, every, cfg)
    assert a.summary == b.summary
    assert a.timeseries.equals(b.timeseries) and a.requests.equals(b.requests)
    assert a.summary["prefix_hit_blocks"] > 0


# ------------------------------------------------------------------------------- hits
def _one_type(name: str, layer) -> LayerStack:
    return LayerStack(name, (layer,) * 3)


ONE_TYPE = [_one_type("full", FullAttention(1, 4, 2)),
            _one_type("sliding", SlidingWindow(1, 4, 2, window=32)),
            *[s for s in _HP["STACKS"] if s.name == "mla"]]


@pytest.mark.parametrize("stack", ONE_TYPE, ids=lambda s: s.name)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_type_models_hit_as_vllms_hybrid(stack, seed):
    """One layer type: two-level's own layout is vLLM's one group (the same page), so the
    same shared-prefix traffic finds the same hits, evicting or not."""
    wl = _HP["shared"](seed, 20, 100, 60)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=_HP["MML"],
                       step_time=StepTime(0.05, 1e-3, 1e-4))
    probe = _HP["make"](stack, 10**9)
    for extra in (100, 10**4):
        capacity = (probe.plan.max_request_blocks + 1 + extra) * probe.page
        h = run(wl, _HP["make"](stack, capacity), cfg).summary
        # (vLLM's pool less its null block: the same pages to hand out)
        own = _own(stack, capacity - probe.page, mml=_HP["MML"], bs=_HP["BS"])
        assert own.large == probe.page
        t = run(wl, own, cfg).summary
        assert t["prefix_hit_blocks"] == h["prefix_hit_blocks"] > 0
        assert t["prefill_tokens_skipped"] == h["prefill_tokens_skipped"]
        assert t["prefix_evictions"] == h["prefix_evictions"]


@pytest.mark.parametrize("stack", _HP["STACKS"], ids=lambda s: s.name)
def test_hits_as_vllms_hybrid_in_a_budget_that_is_not_short(stack):
    """Several types, a budget that never runs short: nothing is evicted and the hits are the
    `hybrid` allocator's with prefix caching (the hit rules are vLLM's), also where a large
    page holds several small pages of a type: a type out of free slots opens a large page
    rather than evict its idle pages in place while the allocation leaves room (the cache
    pool's room)."""
    wl = _HP["shared"](7, 25, 100, 60)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=_HP["MML"],
                       step_time=StepTime(0.05, 1e-3, 1e-4))
    h = run(wl, _HP["make"](stack, 10**8), cfg).summary
    own = _own(stack, 10**8, mml=_HP["MML"], bs=_HP["BS"])
    t = run(wl, own, cfg).summary
    assert h["prefix_evictions"] == 0 and t["prefix_hit_blocks"] > 0
    assert t["prefix_hit_blocks"] == h["prefix_hit_blocks"]
    assert t["prefill_tokens_skipped"] == h["prefill_tokens_skipped"]
    assert t["prefix_evictions"] == 0


def test_evicted_window_pages_shorten_a_sliding_hit():
    """A sliding type's cached pages at the end of its window are evicted (their large pages
    were made evictable first: a request's tables are freed sliding first) while the full
    attention type's stay cached: the full type alone would hit 7 blocks, the sliding type
    now finds no window, so the agreed hit is shorter."""
    bs = 8
    stack = LayerStack("sf", (SlidingWindow(1, 4, 2, window=32), FullAttention(1, 4, 2)))
    page = bs * SlidingWindow(1, 4, 2, window=32).bytes_per_token
    a = _own(stack, 40 * page, mml=128, bs=bs)
    assert a.small_pages == [page, page] and a.large == page  # (one small page each)
    ids = list(range(8))
    first = Request(0, 64, 4, prefix=tuple(ids), prefix_tokens=bs)
    assert a.admit(first, tokens=64, decoding=True)
    a.step(2)
    a.free(0)
    again = Request(1, 64, 4, prefix=tuple(ids), prefix_tokens=bs)
    assert a.cached_prefix_tokens(again) == 56
    cached = [set(a.pool.cache[t]) for t in range(2)]
    # A request of its own prefix that the free large pages alone cannot hold: it evicts the
    # least recently evictable large pages, the sliding type's window pages.
    free = a.pool.free_large_pages()
    tokens = next(t for t in range(bs, 128, bs)
                  if sum(a._type_need(t, 0, False)) > free)
    assert sum(a._type_need(tokens, 0, False)) - free <= 4
    other = Request(2, tokens, 1, prefix=tuple(range(100, 100 + tokens // bs)),
                    prefix_tokens=bs)
    assert a.cached_prefix_tokens(other) == 0
    assert a.admit(other, tokens=tokens)
    assert a.evictions > 0
    assert cached[1] <= set(a.pool.cache[1])  # the full type's pages stay cached
    assert not cached[0] <= set(a.pool.cache[0])  # the sliding type's window lost pages
    assert a.cached_prefix_tokens(again) < 56
    a.account().check()
    a.check_pages()


# ------------------------------------------------------------------------- the engine
SCENARIOS = [
    ("gemma3-27b-long-context", 8, True),
    # (Mamba: prefix caching runs vLLM's mode "align", whose prefill chunks stop at the
    # states a hit can use: vLLM's `hybrid` holds fewer at saturation with caching too)
    ("qwen3-next-80b-a3b-mamba", 5, False),
]


@pytest.mark.parametrize(("name", "count", "more_than_without"), SCENARIOS)
def test_shipped_scenarios_with_a_shared_prefix(name, count, more_than_without):
    """Shipped hybrid scenarios cut to their first requests and short prompts, behind one of
    two system prompts of 1,024 tokens: two-level's own layout with prefix caching finds at
    least the prompt tokens vLLM's `hybrid` with prefix caching finds (the budget is not short:
    it evicts nothing), finishes every request, and holds at saturation (`capacity_requests`)
    at least as many requests as `hybrid` with prefix caching, and on Gemma-3 as many as
    two-level without caching."""
    scenario = load_scenario(name, [
        f"workload.transforms.first_n={count}",
        "workload.synthetic.shared_prefix={tokens: 1024, groups: 2, chunk_tokens: 16}",
        "workload.synthetic.prompt={kind: uniform, low: 64, high: 512}",
        "workload.synthetic.output={kind: uniform, low: 16, high: 100}",
        "allocators=[{label: cached, kind: two-level, prefix_caching: true}, "
        "{label: plain, kind: two-level}, {label: vllm, kind: hybrid, prefix_caching: true}]",
    ]).scenario
    cached, plain, vllm = (r.result for r in run_scenario(scenario).runs)
    s = cached.summary
    assert s["prefix_hit_blocks"] > 0 and s["prefill_tokens_skipped"] > 0
    assert s["prefill_tokens_skipped"] >= vllm.summary["prefill_tokens_skipped"]
    assert s["prefix_evictions"] == vllm.summary["prefix_evictions"] == 0
    assert (cached.requests["status"] == "completed").all()
    assert s["capacity_requests"] >= vllm.summary["capacity_requests"]
    if more_than_without:
        assert s["capacity_requests"] >= plain.summary["capacity_requests"]
    ts = cached.timeseries
    parts = ["token_states_bytes", "reserved_bytes", "internal_bytes", "external_bytes",
             "usable_free_bytes"]
    # (the identity in each row: time averages, so to rounding)
    assert ts[parts].sum(axis=1).to_numpy() == pytest.approx(s["capacity_bytes"], rel=1e-12)


def test_config_accepts_prefix_caching_in_the_own_layout():
    scenario = load_scenario("gemma3-27b-long-context", [
        "allocators=[{label: cached, kind: two-level, prefix_caching: true}]",
    ]).scenario
    assert scenario.allocators[0].options["prefix_caching"] is True
