"""The floor allocator under the fast engine against the per-iteration reference stepper
(`sim.reference`), record for record: the fast engine's decode stretches lean on the floor's
`steps_until_full`, `steps_until_shrink` and closed-form `integrals`, which the reference
never calls. Whole and chunked prefill, async scheduling on and off, pools tight enough to
preempt. And the floor holds the hybrid allocator's workload no worse than it does."""

from __future__ import annotations

import warnings
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
from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    LayerStack,
    MambaState,
    SlidingWindow,
)
from kvfrag.sim.reference import reference

warnings.filterwarnings("ignore", message=".*pure-Python.*")

AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]
MML = 128


def _stack(pattern: str, window: int = 32) -> LayerStack:
    kinds = {
        "s": SlidingWindow(1, 4, 2, window=window),
        "f": FullAttention(1, 4, 2),
        "c": ChunkedLocal(1, 4, 2, chunk=24),
        "m": MLA(6, 2, 2),
        "g": MambaState(600, "gated_delta_net"),
    }
    return LayerStack(pattern, tuple(kinds[ch] for ch in pattern))


STACKS = [_stack("ssf"), _stack("sssssf", 21), _stack("sfsf", 6), _stack("cccf"),
          _stack("mmm"), _stack("gggf"), _stack("ffff")]


def workload(seed: int, n: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.cumsum(rng.exponential(0.5, n)),
        "prompt_tokens": rng.integers(1, 101, n),
        "output_tokens": rng.integers(1, 81, n),
    })


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(STACKS))),
    n=st.integers(1, 20),
    slack=st.sampled_from([0, 1, 3, 10, 40]),  # requests of 100 tokens over one of MML
    chunked=st.booleans(),
    asynchronous=st.booleans(),
    timing=st.sampled_from(["flat", "linear"]),
)
def test_fast_engine_matches_reference_for_the_floor(seed, which, n, slack, chunked,
                                                     asynchronous, timing):
    stack = STACKS[which]
    tokens = 40 if chunked else 160
    b = stack.full_bytes_per_token

    def fresh():
        sizing = make_allocator("floor", capacity=10**12, bytes_per_token=b, max_model_len=MML,
                                stack=stack, max_num_batched_tokens=tokens)
        one = sizing.bytes_for(sizing_req(), MML)
        return make_allocator("floor", capacity=one + slack * sizing.need(100) + 7,
                              bytes_per_token=b, max_model_len=MML, stack=stack,
                              max_num_batched_tokens=tokens)

    wl = workload(seed, n)
    step = {"flat": StepTime(0.05), "linear": StepTime(0.05, 1e-3, 1e-4)}[timing]
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=tokens, chunked_prefill=chunked,
                       lookahead=3, async_scheduling=asynchronous, step_time=step)
    fast = run(wl, fresh(), cfg)
    slow = reference(wl, fresh(), cfg)
    AGREE(fast, slow)
    assert sum(fast.summary[f"{p}_frac"] for p in PARTS) == pytest.approx(1.0, abs=1e-12)
    assert fast.summary["internal_frac"] == fast.summary["external_frac"] == 0


def sizing_req():
    from kvfrag.sim.allocators import Request

    return Request(0, 1, MML - 1)
