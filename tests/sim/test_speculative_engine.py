"""Speculative decoding in the engines: the fast engine held to the per-iteration reference
for every allocator that runs with it (request records, simulated time, memory parts), and
the acceptance draws. Their agreement with vLLM's scheduler is tests/oracle/test_spec_match.py's.
"""

from __future__ import annotations

from pathlib import Path
from runpy import run_path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.reference import reference
from kvfrag.sim.speculative import Acceptance, Speculative, extra_slots

#: The fast engine held to the reference, request by request (tests/sim/agreement.py).
AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]

ALLOCATORS = [
    ("paged", {"block_size": 4}),
    ("paged", {"block_size": 16}),
    ("contiguous", {"reserve": "max_model_len"}),
    ("contiguous", {"reserve": "oracle"}),
    ("buddy", {"reserve": "pow2"}),
]
SPECS = [
    Speculative("eagle", 3, rate=0.7, seed=1),
    Speculative("ngram", 2, rate=0.4, seed=2),
    Speculative("draft_model", 4, distribution=((0, 1.0), (4, 3.0)), seed=3),
    Speculative("mtp", 1),  # (acceptance from the request table's column)
]


def workload(seed: int, n: int, rate: float) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.cumsum(rng.exponential(1 / rate, n)),
        "prompt_tokens": rng.integers(1, 101, n),
        "output_tokens": rng.integers(1, 81, n),
        "priority": rng.integers(0, 3, n),
        "accepted_drafts": [[int(a) for a in rng.integers(0, 3, rng.integers(1, 6))]
                            for _ in range(n)],
    })


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(ALLOCATORS))),
    spec=st.sampled_from(range(len(SPECS))),
    n=st.integers(1, 25),
    capacity_tokens=st.integers(96, 600),
    chunked=st.booleans(),
    max_seqs=st.sampled_from([8, 8, 3]),
    long_prefill=st.sampled_from([0, 0, 16]),
    policy=st.sampled_from(["fcfs", "fcfs", "priority"]),
    linear=st.booleans(),
    asynchronous=st.booleans(),
)
def test_fast_engine_matches_per_iteration_reference(
    seed, which, spec, n, capacity_tokens, chunked, max_seqs, long_prefill, policy, linear,
    asynchronous,
):
    """Every request record, the simulated time and the time-averaged parts (the accounting
    identity checked at every iteration by the reference) agree, sync and async, FCFS and
    priority, for each method and way of drawing acceptance."""
    kind, opts = ALLOCATORS[which]
    b, mml = 96, 192
    wl = workload(seed, n, rate=2.0)
    cfg = EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=40 if chunked else 200,
        chunked_prefill=chunked,
        long_prefill_token_threshold=long_prefill,
        policy=policy,
        speculative=SPECS[spec],
        step_time=StepTime(0.05, 1e-3, 1e-4) if linear else StepTime(0.05),
        async_scheduling=asynchronous,
    )

    def fresh():
        return make_allocator(
            kind, capacity=capacity_tokens * b + 37, bytes_per_token=b, max_model_len=mml, **opts
        )

    fast = run(wl, fresh(), cfg)
    slow = reference(wl, fresh(), cfg)
    AGREE(fast, slow, parts=[*PARTS, "internal_overreservation"])


def lone(accepted: list[int], k: int = 3, method: str = "eagle", **kw) -> pd.DataFrame:
    """One request (prompt 40, output 61) with its accepted counts given."""
    wl = pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "prompt_tokens": [40],
                       "output_tokens": [61], "accepted_drafts": [accepted]})
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, async_scheduling=False,
                       speculative=Speculative(method, k), step_time=StepTime(1.0), **kw)
    alloc = make_allocator("paged", capacity=1000 * 16, bytes_per_token=1, max_model_len=512,
                           block_size=4)
    return run(wl, alloc, cfg).requests.iloc[0]


def test_accepted_drafts_shorten_the_decode():
    """The prefill gives the first token; each decode step 1 + accepted: 60 more tokens take
    60 steps with none accepted, 15 with all 3 (k + 1 = 4 a step), 30 with one."""
    assert lone([0])["finished_s"] == 1 + 60
    assert lone([3])["finished_s"] == 1 + 15
    assert lone([1])["finished_s"] == 1 + 30
    assert lone([7])["finished_s"] == 1 + 15  # (clipped to the 3 drafts scheduled)


def test_summary_counts_drafts_and_acceptance():
    """60 tokens after the first: all 3 drafts accepted, 15 steps of 4 tokens; one accepted,
    30 steps of 2; without speculation there are no such columns."""
    wl = pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "prompt_tokens": [40],
                       "output_tokens": [61], "accepted_drafts": [[3]]})

    def summary(spec):
        cfg = EngineConfig(max_num_batched_tokens=512, async_scheduling=False, speculative=spec)
        alloc = make_allocator("paged", capacity=1000 * 16, bytes_per_token=1,
                               max_model_len=512, block_size=4)
        return run(wl, alloc, cfg).summary

    got = summary(Speculative("eagle", 3))
    assert (got["spec_verify_steps"], got["spec_drafts"], got["spec_drafts_accepted"]) == (
        15, 45, 45)
    assert (got["spec_acceptance"], got["spec_tokens_per_step"]) == (1.0, 4.0)
    got = summary(Speculative("eagle", 3, distribution=((1, 1.0),)))
    assert (got["spec_verify_steps"], got["spec_acceptance"], got["spec_tokens_per_step"]) == (
        30, pytest.approx(1 / 3), 2.0)
    assert not any(key.startswith("spec_") for key in summary(None))


def test_lookahead_slots_hold_blocks_and_rejections_free_none():
    """EAGLE (lookahead k) holds blocks for computed + 1 + k + k slots at the last step:
    prompt 40 + 59 tokens decoded before it = 99, + 7 = 106 slots, 27 blocks of 4; n-gram
    (no lookahead) 103 slots, 26 blocks; the peak is the same whatever was rejected."""
    assert lone([0])["peak_bytes"] == 27 * 4
    assert lone([0], method="ngram")["peak_bytes"] == 26 * 4
    assert lone([2, 0, 3])["peak_bytes"] >= lone([0])["peak_bytes"] - 4 * 4


def test_extra_slots_are_what_the_last_steps_can_take():
    spec = Speculative("eagle", 3)
    assert extra_slots(None, 10, 10, 100) == 0
    assert extra_slots(spec, 10, 10, 100) == 6  # drafts and lookahead
    assert extra_slots(spec, 10, 10, 100, asynchronous=True) == 10  # and the step in flight
    assert extra_slots(spec, 10, 88, 100) == 3  # within max_model_len
    assert extra_slots(Speculative("ngram", 3), 10, 10, 100) == 3


def test_draws_follow_the_rate_and_do_not_depend_on_the_order_asked():
    spec = Speculative("eagle", 4, rate=0.6, seed=11)
    a, b = Acceptance(spec), Acceptance(spec)
    first = [a.count(rid, j) for rid in range(50) for j in range(40)]
    second = {(rid, j): b.count(rid, j) for j in range(40) for rid in reversed(range(50))}
    assert first == [second[(rid, j)] for rid in range(50) for j in range(40)]
    many = Acceptance(spec).counts(0, 0, 200_000)
    # a draft accepted with probability p until the first rejection, at most k
    p, k = 0.6, 4
    want = [p**j * (1 - p) for j in range(k)] + [p**k]
    got = np.bincount(many, minlength=k + 1) / len(many)
    assert got == pytest.approx(want, abs=0.005)


def test_distribution_and_column_draws():
    spec = Speculative("eagle", 3, distribution=((1, 1.0), (3, 3.0)), seed=4)
    got = Acceptance(spec).counts(5, 0, 40_000)
    assert set(np.unique(got)) == {1, 3}
    assert (got == 3).mean() == pytest.approx(0.75, abs=0.01)
    column = Acceptance(Speculative("eagle", 3), {7: [2, 0, 1]})
    assert list(column.counts(7, 0, 7)) == [2, 0, 1, 2, 0, 1, 2]  # read again from the start
    with pytest.raises(ValueError, match="request 8: no accepted_drafts"):
        column.counts(8, 0, 1)


@pytest.mark.parametrize(("kw", "match"), [
    ({"method": "medusa"}, "speculative.method 'medusa'"),
    ({"num_tokens": 0}, "num_tokens must be at least 1"),
    ({"rate": 1.5}, r"rate must lie in \[0, 1\]"),
    ({"distribution": ((4, 1.0),)}, r"accepted counts in 0\.\.3"),
])
def test_bad_speculative_config_is_refused(kw, match):
    args = {"method": "eagle", "num_tokens": 3, **kw}
    with pytest.raises(ValueError, match=match):
        Speculative(**args)


def test_engine_refuses_what_it_does_not_model():
    wl = pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "prompt_tokens": [4],
                       "output_tokens": [4], "n": [2]})
    cfg = EngineConfig(async_scheduling=False, speculative=Speculative("eagle", 2, rate=0.5))
    alloc = make_allocator("paged", capacity=1 << 20, bytes_per_token=8, max_model_len=64)
    with pytest.raises(ValueError, match="sample groups"):
        run(wl, alloc, cfg)
    caching = make_allocator("prefix-caching", capacity=1 << 20, bytes_per_token=8,
                             max_model_len=64)
    with pytest.raises(ValueError, match="prefix-caching"):
        run(wl.drop(columns="n"), caching, cfg)
    with pytest.raises(ValueError, match="continuous batching"):
        EngineConfig(batching="static", speculative=Speculative("eagle", 2, rate=0.5))
