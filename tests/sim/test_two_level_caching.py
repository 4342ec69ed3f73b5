"""`two-level` with vLLM's constraints and prefix caching (`vllm_groups: true`,
`prefix_caching: true`: `sim/allocators/two_level_caching.py`, vLLM's caching on the two-level
cache pool) keeps the `hybrid` allocator's records with prefix caching exactly: on
shared-prefix traffic with small pools (evictions, preemptions, hits) and on shipped
hybrid scenarios given a shared system prompt. Two-level's own layout with prefix caching is
another class (`two_level_own_caching`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from runpy import run_path

import pandas as pd
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.allocators.two_level_caching import BlockPoolView, TwoLevelVllmCaching
from kvfrag.sim.allocators.two_level_own_caching import TwoLevelOwnCaching
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.scenario_run import run as run_scenario

from kvfrag.config import load_scenario

warnings.filterwarnings("ignore", message=".*pure-Python.*")

_HP = run_path(str(Path(__file__).with_name("test_hybrid_prefix.py")))


def _two_level(stack, capacity: int, tokens: int):
    return make_allocator("two-level", capacity=capacity,
                          bytes_per_token=stack.full_bytes_per_token, max_model_len=_HP["MML"],
                          stack=stack, block_size=_HP["BS"], max_num_batched_tokens=tokens,
                          prefix_caching=True, vllm_groups=True)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), which=st.sampled_from(range(len(_HP["STACKS"]))),
       extra_blocks=st.sampled_from([0, 3, 10, 40]), chunked=st.booleans(),
       asynchronous=st.booleans())
def test_shared_prefix_traffic_matches_hybrid(seed, which, extra_blocks, chunked,
                                              asynchronous):
    """The same summary, time series and requests as the hybrid allocator with prefix
    caching, in pools small enough to evict and preempt."""
    stack = _HP["STACKS"][which]
    tokens = 40 if chunked else _HP["MML"]
    probe = _HP["make"](stack, 10**9, tokens=tokens)
    capacity = (probe.plan.max_request_blocks + 1 + extra_blocks) * probe.page + 37
    wl = _HP["shared"](seed, 20, 100, 60)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=tokens, chunked_prefill=chunked,
                       async_scheduling=asynchronous, step_time=StepTime(0.05, 1e-3, 1e-4))
    ours = _two_level(stack, capacity, tokens)
    assert isinstance(ours, TwoLevelVllmCaching) and isinstance(ours._st.pool, BlockPoolView)
    a, b = run(wl, _HP["make"](stack, capacity, tokens=tokens), cfg), run(wl, ours, cfg)
    assert a.summary == b.summary
    pd.testing.assert_frame_equal(a.timeseries, b.timeseries)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    event(f"evictions {min(a.summary['prefix_evictions'], 1)}, "
          f"preemptions {min(int(a.requests['preemptions'].sum()), 1)}")
    pool = ours._st.pool.pool
    pool.check()
    assert pool.usable_large_pages() == ours.num_blocks  # (nothing held at the end)


SCENARIOS = [
    ("gemma3-27b-long-context", 8),
    ("qwen3-next-80b-a3b-mamba", 5),  # (Mamba in mode "align")
]


@pytest.mark.parametrize(("name", "count"), SCENARIOS)
def test_shipped_scenarios_with_a_shared_prefix_match_hybrid(name, count):
    """Shipped hybrid scenarios, cut to their first requests and to short prompts (vLLM's
    caching is modelled block by block: long prompts cost seconds), each behind one of two
    system prompts of 1,024 tokens: the same summary (but for its label and kind), time
    series and requests as the hybrid allocator with prefix caching, hits included."""
    scenario = load_scenario(name, [
        f"workload.transforms.first_n={count}",
        "workload.synthetic.shared_prefix={tokens: 1024, groups: 2, chunk_tokens: 16}",
        "workload.synthetic.prompt={kind: uniform, low: 64, high: 512}",
        "workload.synthetic.output={kind: uniform, low: 16, high: 100}",
        "allocators=[{label: hybrid, kind: hybrid, prefix_caching: true}, "
        "{label: vllm, kind: two-level, vllm_groups: true, prefix_caching: true}]",
    ]).scenario
    h, t = (r.result for r in run_scenario(scenario).runs)
    assert h.summary["prefix_hit_blocks"] > 0
    skip = ("label", "kind", "allocator")
    assert ({k: v for k, v in t.summary.items() if k not in skip}
            == {k: v for k, v in h.summary.items() if k not in skip})
    pd.testing.assert_frame_equal(t.timeseries, h.timeseries)
    pd.testing.assert_frame_equal(t.requests, h.requests)


def test_own_layout_with_prefix_caching_is_its_own_class():
    """Without vllm_groups, prefix caching is two-level's own layout's
    (`two_level_own_caching`, tests/sim/test_two_level_own_caching.py); a value that is not a
    boolean is refused in one line."""
    stack = _HP["STACKS"][0]
    kw = dict(capacity=10**6, bytes_per_token=stack.full_bytes_per_token, max_model_len=64,
              stack=stack)
    own = make_allocator("two-level", prefix_caching=True, **kw)
    assert isinstance(own, TwoLevelOwnCaching) and not isinstance(own, TwoLevelVllmCaching)
    with pytest.raises(ValueError, match=r"^prefix_caching must be true or false, not 1$"):
        make_allocator("two-level", prefix_caching=1, **kw)
