"""The fast engine's vectorised speculative steps (sim/spec_steps.py) held to the per-iteration
reference where they run most: few decoders with long outputs (light load), many at once,
every method (n-gram without lookahead, a draft model's input slot), rate, distribution and
column draws, sync and async, and iterations that fall back to the walk (prompts partway,
a token budget that binds, block shortages, max_model_len) between them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from runpy import run_path

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, make_allocator
from kvfrag.sim.allocators.base import Request
from kvfrag.sim.engine import Engine
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.reference import reference
from kvfrag.sim.speculative import Speculative

AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]

SPECS = [
    Speculative("eagle", 3, rate=0.7, seed=1),
    Speculative("ngram", 2, rate=0.4, seed=2),  # (no lookahead)
    Speculative("draft_model", 4, distribution=((0, 1.0), (4, 3.0)), seed=3),  # (input slot)
    Speculative("mtp", 2),  # (acceptance from the request table's column)
]


def workload(seed: int, n: int, rate: float, longest: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.cumsum(rng.exponential(1 / rate, n)),
        "prompt_tokens": rng.integers(1, 60, n),
        "output_tokens": rng.integers(1, longest + 1, n),
        "accepted_drafts": [[int(a) for a in rng.integers(0, 3, rng.integers(1, 6))]
                            for _ in range(n)],
    })


@settings(max_examples=100, deadline=None)
# (a request resumed one token short of its output still verifies a step: its count drawn)
@example(seed=0, spec=0, n=7, rate=20.0, longest=40, capacity_tokens=150, block_size=4,
         budget=24, chunked=False, asynchronous=False, max_time=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    spec=st.sampled_from(range(len(SPECS))),
    n=st.integers(1, 12),
    rate=st.sampled_from([0.05, 0.5, 20.0]),  # light load (long stretches) to all at once
    longest=st.sampled_from([40, 300]),
    capacity_tokens=st.sampled_from([150, 400, 4000]),  # shortages and preemptions, or none
    block_size=st.sampled_from([4, 16]),
    budget=st.sampled_from([24, 512]),  # binding (with a draft model's slots) or not
    chunked=st.booleans(),
    asynchronous=st.booleans(),
    max_time=st.sampled_from([None, None, 7.5]),  # a stretch cut by the run's end
)
def test_vectorised_steps_match_the_reference(seed, spec, n, rate, longest, capacity_tokens,
                                               block_size, budget, chunked, asynchronous,
                                               max_time):
    """Records, time and the time-averaged parts agree with the reference (the parts while
    the allocator is told slots at block crossings only included)."""
    b, mml = 8, 400
    wl = workload(seed, n, rate, longest)
    cfg = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget if chunked else max(budget, mml),
        chunked_prefill=chunked,
        speculative=SPECS[spec],
        step_time=StepTime(0.05, 1e-3, 1e-4),
        async_scheduling=asynchronous,
        max_time_s=max_time,
    )

    def fresh():
        return make_allocator("paged", capacity=capacity_tokens * b + 5, bytes_per_token=b,
                              max_model_len=mml, block_size=block_size)

    fast = Engine(wl, fresh(), cfg).run()
    AGREE(fast, reference(wl, fresh(), cfg), parts=[*PARTS, "internal_overreservation"])
    # As the walk makes them (logging allocations walks every iteration): the verification
    # counts (the reference does not count them).
    walked = Engine(wl, fresh(), replace(cfg, log_allocations=True)).run()
    same = ["spec_verify_steps", "spec_drafts", "spec_drafts_accepted", "completed",
            "preemptions"]
    assert [fast.summary[c] for c in same] == [walked.summary[c] for c in same]
    assert fast.summary["sim_time_s"] == pytest.approx(walked.summary["sim_time_s"], rel=1e-9)
    for p in PARTS:
        assert fast.summary[f"{p}_frac"] == pytest.approx(walked.summary[f"{p}_frac"],
                                                          rel=1e-7, abs=1e-9), p
    pd.testing.assert_series_equal(fast.requests["status"], walked.requests["status"])


def test_light_load_decodes_vectorised():
    """Two long requests, one after the other: their decode steps are a few stretches of
    many iterations (a SpecSteps window each), and the result is the reference's."""
    wl = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 30.0],
                       "prompt_tokens": [30, 20], "output_tokens": [400, 300]})
    for asynchronous in (False, True):
        cfg = EngineConfig(speculative=Speculative("eagle", 3, rate=0.6, seed=5),
                           step_time=StepTime(0.05, 1e-3, 1e-4),
                           async_scheduling=asynchronous)

        def fresh():
            return make_allocator("paged", capacity=1 << 20, bytes_per_token=8,
                                  max_model_len=2048, block_size=16)

        engine = Engine(wl, fresh(), cfg)
        fast = engine.run()
        specs = engine.specs
        assert specs is not None
        # the decode steps of each (over 150 in all) joined into a few events
        assert specs.steps > 150
        assert specs.stretched >= 2
        assert fast.summary["events"] <= 12
        AGREE(fast, reference(wl, fresh(), cfg), parts=[*PARTS, "internal_overreservation"])


def test_grow_within_is_grow_for_each():
    """The paged allocator's grow_within (a step's block crossings told at once) leaves it as
    `grow` one request at a time does: parts, free blocks, tokens, and what it refuses."""
    def fresh():
        alloc = make_allocator("paged", capacity=64 * 4 * 8, bytes_per_token=8,
                               max_model_len=200, block_size=4)
        alloc.defer_block_ids()
        for rid, (prompt, tokens) in enumerate([(5, 9), (12, 12), (3, 30)]):
            alloc.admit(Request(rid, prompt, 40), tokens, decoding=False)
        return alloc

    one, many = fresh(), fresh()
    for rid, more in [(0, 7), (2, 1), (1, 20)]:
        one.grow(rid, more)
    many.grow_within([0, 2, 1], [7, 1, 20])
    assert one.parts() == many.parts()
    assert one.free_blocks() == many.free_blocks()
    assert [one.tokens(r) for r in range(3)] == [many.tokens(r) for r in range(3)]
    with pytest.raises(ValueError):
        many.grow_within([0], [100])  # (past its final length)
    # more blocks than are free: refused before anything changes
    tight = make_allocator("paged", capacity=6 * 4 * 8, bytes_per_token=8, max_model_len=200,
                           block_size=4)
    for rid in range(2):
        assert tight.admit(Request(rid, 4, 10), decoding=False)
    before = (tight.parts(), tight.free_blocks(), tight.tokens(0), tight.tokens(1))
    with pytest.raises(AssertionError):
        tight.grow_within([0, 1], [8, 8])
    assert (tight.parts(), tight.free_blocks(), tight.tokens(0), tight.tokens(1)) == before


def test_a_request_its_prefill_ends_needs_no_counts():
    """A one-token output is given by its prefill: no accepted count is asked of it, so a
    column without any for it runs (as in the reference); a longer one needs them."""
    wl = pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 0.5],
                       "prompt_tokens": [10, 12], "output_tokens": [1, 30],
                       "accepted_drafts": [[], [2, 1]]})
    cfg = EngineConfig(speculative=Speculative("eagle", 2), step_time=StepTime(0.05, 1e-3))

    def fresh():
        return make_allocator("paged", capacity=1 << 16, bytes_per_token=8,
                              max_model_len=256, block_size=16)

    AGREE(Engine(wl, fresh(), cfg).run(), reference(wl, fresh(), cfg))
    with pytest.raises(ValueError, match="no accepted_drafts"):
        Engine(wl.assign(output_tokens=[2, 30]), fresh(), cfg).run()
