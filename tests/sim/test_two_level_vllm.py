"""Check 4b of issue 35: `two-level` with vLLM's constraints (`vllm_groups: true`: vLLM's
groups with padding layers and one page size, so a large page is one block id) keeps the
`hybrid` allocator's records exactly: every gain of its own layout comes from the layout.

The two share the coordinator and managers, not the pool nor the decode look-ahead: two-level
places every small page on its two-level pool and walks the decoders' events, where hybrid
counts blocks in closed form (`sim.hybrid.cohort`). So what is compared is what differs:
fit, steps_until_full, the accounting and the blocks per group, operation after operation
(hypothesis) and run against run on the shipped hybrid scenarios."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import Request, make_allocator
from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    LayerStack,
    MambaState,
    SlidingWindow,
)
from kvfrag.sim.scenario_run import run

from kvfrag.config import load_scenario

warnings.filterwarnings("ignore", message=".*pure-Python.*")


def _stack(pattern: str) -> LayerStack:
    kinds = {"s": SlidingWindow(1, 4, 2, window=20), "f": FullAttention(1, 4, 2),
             "c": ChunkedLocal(1, 4, 2, chunk=24), "m": MLA(6, 2, 2),
             "g": MambaState(600, "gated_delta_net"), "w": SlidingWindow(1, 4, 2, window=6)}
    return LayerStack(pattern, tuple(kinds[ch] for ch in pattern))


OPS = ["admit", "admit", "grow", "step", "step", "free", "unsched"]
PATTERNS = ["sssssfsssssf", "wfwfwf", "cccfcccf", "mmmm", "gggfgggf"]
MML = 160


def _pair(stack: LayerStack, blocks: int, asynchronous: bool):
    b = stack.full_bytes_per_token
    probe = make_allocator("hybrid", capacity=10**9, bytes_per_token=b, max_model_len=MML,
                           stack=stack)
    capacity = (probe.plan.max_request_blocks + blocks + 1) * probe.page + 5
    out = []
    for kind, extra in (("hybrid", {}), ("two-level", {"vllm_groups": True})):
        a = make_allocator(kind, capacity=capacity, bytes_per_token=b, max_model_len=MML,
                           stack=stack, **extra)
        if asynchronous:
            a.set_async()
        out.append(a)
    return out


def _same_grant(h, t) -> None:
    """The same grant or refusal; block ids apart (the hybrid allocator names a decoder's
    blocks lazily, when asked: its freed ids come back to its pool later, so ids taken since
    may differ), but as many."""
    assert type(t) is type(h)
    if h:
        assert (t.nbytes, t.capacity_tokens, len(t.blocks)) == (h.nbytes, h.capacity_tokens,
                                                                 len(h.blocks))
    else:
        assert t == h


def _same(h, t, probe: Request) -> None:
    assert t.parts(probe) == h.parts(probe)
    assert t.group_blocks() == h.group_blocks()
    assert t.free_bytes() == h.free_bytes()
    assert t.steps_until_done() == h.steps_until_done()
    assert t.steps_until_full() == h.steps_until_full()
    assert t.waste_parts() == h.waste_parts()
    assert t.admission_bytes(probe, 50, 0) == h.admission_bytes(probe, 50, 0)
    t.check_pages()
    assert t.pool.used_large_pages() * t.large == t._totals()[0] * t.page


@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=40, deadline=None)
@given(asynchronous=st.booleans(), blocks=st.integers(0, 12), data=st.data())
def test_random_operations_match_hybrid(pattern, asynchronous, blocks, data):
    """Random admissions (prefill or decoding), chunk growth, decode stretches up to the
    first refusal and one past it, frees and unscheduled decoders: after every operation
    both allocators agree on everything the engine reads, grants and refusals included."""
    h, t = _pair(_stack(pattern), blocks, asynchronous)
    probe = Request(999, 30, 20)
    rid = 0
    last: dict[int, int] = {}  # rid -> tokens its last allocation took
    prompts: dict[int, int] = {}
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        op = data.draw(st.sampled_from(OPS))
        if op == "admit":
            prompt = data.draw(st.integers(1, 90))
            output = data.draw(st.integers(1, 70))
            decoding = data.draw(st.booleans())
            chunk = prompt if decoding else data.draw(st.integers(1, prompt))
            req = Request(rid, prompt, output)
            got = [a.admit(req, tokens=chunk, decoding=decoding) for a in (h, t)]
            _same_grant(*got)
            event(f"admit {bool(got[0])}")
            last[rid], prompts[rid] = chunk, prompt
            rid += 1
        elif op == "grow":
            growing = [r for r in h.rids() if not h.is_decoding(r)
                       and h.tokens(r) < prompts[r]]
            if not growing:
                continue
            r = data.draw(st.sampled_from(growing))
            n = data.draw(st.integers(1, prompts[r] - h.tokens(r)))
            # (in flight: the tokens of its previous chunk, if it ran in the last step)
            flight = data.draw(st.sampled_from([0, last[r]])) if asynchronous else 0
            got = [a.grow(r, n, flight) for a in (h, t)]
            last[r] = n
            _same_grant(*got)
            event(f"grow {bool(got[0])}")
            if got[0] and h.tokens(r) == prompts[r] and data.draw(st.booleans()):
                for a in (h, t):
                    a.set_decoding(r, True)
        elif op == "step":
            done, full = h.steps_until_done(), h.steps_until_full()
            if done is None:
                continue
            most = min(done, full + 1)
            n = data.draw(st.one_of(st.just(most), st.integers(0, most)))
            got = [a.step(n) for a in (h, t)]
            assert bool(got[0]) == bool(got[1])
            event(f"step {bool(got[0])} {len([r for r in h.rids() if h.is_decoding(r)]) > 2}")
            while h.steps_until_done() == 0:
                first = h.first_done()
                for a in (h, t):
                    a.free(first)
        elif op == "free" and h.rids():
            r = data.draw(st.sampled_from(h.rids()))
            assert h.free(r) == t.free(r)
        elif op == "unsched" and asynchronous:
            decoders = [r for r in h.rids() if h.is_decoding(r)]
            if decoders:
                r = data.draw(st.sampled_from(decoders))
                for a in (h, t):
                    a.unscheduled(r)
        _same(h, t, probe)
        n = data.draw(st.integers(0, min(x for x in (h.steps_until_done(), 50)
                                         if x is not None) if h.steps_until_done() else 0))
        w = data.draw(st.tuples(st.floats(0, 3), st.floats(-1, 1)))
        assert t.integrate(n, probe, *w) == h.integrate(n, probe, *w)
    for r in h.rids():
        h.free(r)
        t.free(r)
    _same(h, t, probe)
    assert t.pool.used_large_pages() == 0


SCENARIOS = [
    ("gemma3-27b-long-context", 40),
    ("gpt-oss-120b-h100", 40),
    ("qwen3-next-80b-a3b-mamba", 80),
]


@pytest.mark.parametrize(("name", "count"), SCENARIOS)
def test_shipped_scenarios_match_hybrid(name, count):
    """The shipped hybrid scenarios, cut to their first requests: the same summary (but for
    its label and kind), time series (blocks per group included) and requests."""
    scenario = load_scenario(name, [
        f"workload.transforms.first_n={count}",
        "allocators=[{label: hybrid, kind: hybrid}, "
        "{label: vllm, kind: two-level, vllm_groups: true}]",
    ]).scenario
    h, t = (run.result for run in run(scenario).runs)
    assert len(h.timeseries) > count
    assert [c for c in h.timeseries.columns if c.startswith("blocks_")]
    skip = ("label", "kind", "allocator")
    assert ({k: v for k, v in t.summary.items() if k not in skip}
            == {k: v for k, v in h.summary.items() if k not in skip})
    pd.testing.assert_frame_equal(t.timeseries, h.timeseries)
    pd.testing.assert_frame_equal(t.requests, h.requests)
