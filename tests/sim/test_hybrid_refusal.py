"""The engine asks a hybrid allocator to admit the FCFS head again, after a memory refusal,
only once more bytes are free than then (`Allocator.refusal_by_free`): the same run, to the
last row, as when it asks at every step, with fewer admissions asked."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim.allocators.hybrid import HybridAllocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.layers import FullAttention, LayerStack, SlidingWindow

warnings.filterwarnings("ignore", message=".*pure-Python.*")

STACK = LayerStack("sssf", (SlidingWindow(1, 4, 2, window=24),) * 3 + (FullAttention(1, 4, 2),))


class Counting(HybridAllocator):
    """Counts the admissions asked of it, at its gate or itself (an interpreted subclass:
    the engine cannot be observed from outside, compiled)."""

    asked = 0

    def admit(self, req, tokens=None, decoding=True):
        self.asked += 1
        return super().admit(req, tokens, decoding)

    def admission_bytes(self, req, tokens, hit):
        self.asked += 1
        return super().admission_bytes(req, tokens, hit)


def _run(by_free: bool, chunked: bool, watermark: float, asynchronous: bool):
    rng = np.random.default_rng(7)
    n = 40
    wl = pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.cumsum(rng.exponential(0.05, n)),
        "prompt_tokens": rng.integers(10, 64, n),
        "output_tokens": rng.integers(10, 64, n),
    })
    alloc = Counting(capacity=STACK.full_bytes_per_token * 300,
                     bytes_per_token=STACK.full_bytes_per_token, max_model_len=128, stack=STACK,
                     block_size=8, max_num_batched_tokens=128)
    assert not alloc.refusal_by_free  # (a subclass: off unless it says so)
    alloc.refusal_by_free = by_free
    cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=128, chunked_prefill=chunked,
                       watermark=watermark, async_scheduling=asynchronous,
                       step_time=StepTime(0.01, 1e-4, 1e-6))
    return run(wl, alloc, cfg), alloc.asked


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("watermark", [0.0, 0.05])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_refusal_by_free_changes_nothing_but_the_admissions_asked(chunked, watermark,
                                                                  asynchronous):
    memo, asked_memo = _run(True, chunked, watermark, asynchronous)
    every, asked_every = _run(False, chunked, watermark, asynchronous)
    assert asked_memo < asked_every  # (memory-bound: the head is refused, and not asked again)
    assert memo.summary == every.summary
    pd.testing.assert_frame_equal(memo.requests, every.requests)
    pd.testing.assert_frame_equal(memo.timeseries, every.timeseries)


def test_the_plain_hybrid_allocator_says_so():
    alloc = HybridAllocator(capacity=STACK.full_bytes_per_token * 1200,
                            bytes_per_token=STACK.full_bytes_per_token, max_model_len=128,
                            stack=STACK, block_size=8)
    assert alloc.refusal_by_free
