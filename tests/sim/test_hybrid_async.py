"""The hybrid allocator under async scheduling: the fast engine held to the per-iteration
reference (`sim.reference`), with and without prefix caching (and synchronously, now that the
engine's default is async), and what the tokens in flight change (vLLM frees a window's blocks
by the tokens processed: computed less those in flight; tests/oracle/test_hybrid_async_match.py
holds both to vLLM's AsyncScheduler)."""

from __future__ import annotations

import warnings
from pathlib import Path
from runpy import run_path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.layers import LayerStack, SlidingWindow
from kvfrag.sim.reference import reference

warnings.filterwarnings("ignore", message=".*pure-Python.*")

HERE = Path(__file__).parent
ENGINE = run_path(str(HERE / "test_hybrid_engine.py"))  # its stacks, pools and workloads
PREFIX = run_path(str(HERE / "test_hybrid_prefix.py"))
AGREE = run_path(str(HERE / "agreement.py"))["assert_fast_equals_reference"]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(ENGINE["STACKS"]))),
    manager=st.booleans(),
    bs=st.sampled_from([4, 8, 16]),
    n=st.integers(1, 25),
    extra_blocks=st.sampled_from([0, 1, 2, 5, 10, 20, 50]),  # small pools: preemptions
    chunked=st.booleans(),
    skip=st.booleans(),
    max_seqs=st.sampled_from([8, 2]),
    asynchronous=st.sampled_from([True, True, False]),
)
def test_fast_engine_matches_reference_under_async_scheduling(
    seed, which, manager, bs, n, extra_blocks, chunked, skip, max_seqs, asynchronous,
):
    stack = ENGINE["STACKS"][which]
    tokens = 40 if chunked else 160
    manager = manager or bool(stack.mamba_layers)
    fresh = ENGINE["build"](stack, extra_blocks, manager, bs, tokens)
    wl = ENGINE["workload"](seed, n, 100, 80, rate=2.0)
    cfg = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=tokens,
                       chunked_prefill=chunked, admission="skip" if skip else "fcfs",
                       lookahead=3, async_scheduling=asynchronous,
                       step_time=StepTime(0.05, 1e-3, 1e-4))
    AGREE(run(wl, fresh(), cfg), reference(wl, fresh(), cfg),
          parts=[*PARTS, "internal_overreservation"])


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(PREFIX["STACKS"]))),
    n=st.integers(2, 25),
    extra_blocks=st.sampled_from([0, 2, 5, 10, 20, 60]),  # small pools: evictions, preemptions
    chunked=st.booleans(),
    asynchronous=st.sampled_from([True, True, False]),
)
def test_fast_engine_matches_reference_under_async_scheduling_with_prefix_caching(
    seed, which, n, extra_blocks, chunked, asynchronous,
):
    stack = PREFIX["STACKS"][which]
    tokens = 40 if chunked else PREFIX["MML"]
    probe = PREFIX["make"](stack, 10**9, tokens=tokens)
    capacity = (probe.plan.max_request_blocks + 1 + extra_blocks) * probe.page + 37
    wl = PREFIX["shared"](seed, n, 100, 60)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=tokens, chunked_prefill=chunked,
                       async_scheduling=asynchronous, step_time=StepTime(0.05, 1e-3, 1e-4))
    trace: list[dict] = []
    slow = reference(wl, PREFIX["make"](stack, capacity, tokens=tokens), cfg, trace)
    fast = run(wl, PREFIX["make"](stack, capacity, tokens=tokens), cfg)
    AGREE(fast, slow)
    assert fast.summary["prefill_tokens_skipped"] == sum(x["prefix_hit_tokens"] for x in trace)
    assert fast.summary["prefix_evictions"] == sum(x["evictions"] for x in trace)


def _sliding() -> LayerStack:
    return LayerStack("s", (SlidingWindow(1, 4, 2, window=32),))


def test_a_decoder_frees_its_window_a_step_later_and_its_first_step_by_its_final_chunk():
    """One request, a 64-token prompt in 16-token chunks, window 32, blocks of 8: a chunk frees
    by the tokens before the previous chunk (that chunk in flight), the first decode step by
    those before the final chunk, every later step by L - 1 (the last token in flight)."""
    stack = _sliding()

    def blocks(asynchronous: bool) -> list[int]:
        a = make_allocator("hybrid", capacity=10**6, bytes_per_token=stack.full_bytes_per_token,
                           max_model_len=256, stack=stack, block_size=8)
        if asynchronous:
            a.set_async()
        a.admit(Request(0, 64, 20), tokens=16, decoding=False)
        seen = [a.blocks_of(0)]
        for _ in range(3):  # chunks 2-4, each with the previous one in flight
            assert a.grow(0, 16, in_flight=16 if asynchronous else 0)
            seen.append(a.blocks_of(0))
        a.set_decoding(0, True)
        for _ in range(10):
            assert a.step(1)
            seen.append(a.blocks_of(0))
        return seen

    sync, asy = blocks(False), blocks(True)
    # (W = 32, blocks of 8: a request freed by P holds ceil(L / 8) - max(0, P - 31) // 8)
    # chunks to 16, 32, 48, 64 tokens free by 0, 16, 32, 48 (sync) or 0, 0, 16, 32 (async)
    assert sync[:4] == [2, 4, 6, 6] and asy[:4] == [2, 4, 6, 8]
    # the first decode step (to 65): by 64, or by 48 (the final chunk in flight)
    assert sync[4] == 5 and asy[4] == 7
    # then to L by L - 1, or by L - 2: async holds a block more where L - 2 - 31 ends one
    for length, s_, a_ in zip(range(66, 75), sync[5:], asy[5:], strict=True):
        assert a_ - s_ == int((length - 32) % 8 == 0), length


def test_set_async_before_any_request():
    stack = _sliding()
    a = make_allocator("hybrid", capacity=10**6, bytes_per_token=stack.full_bytes_per_token,
                       max_model_len=256, stack=stack, block_size=8)
    a.admit(Request(0, 10, 5))
    with pytest.raises(ValueError, match="before any request"):
        a.set_async()
