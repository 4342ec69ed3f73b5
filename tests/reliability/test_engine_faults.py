"""The engine under inputs at the edge of what it models, and under signals.

- A far horizon (an arrival or `max_time_s` 1e300 s away) ends a decode stretch in closed form:
  its search for the iteration that reaches it is bounded, so the run ends.
- Times so long that the byte-second integrals overflow make the run fail with one line
  instead of a summary whose every share is NaN.
- The serving loop calls `sim.interrupts.poll` every `PROGRESS_TURNS` turns: where the engine
  is compiled, that is where a pending signal's handler runs (Ctrl-C, SIGTERM, SIGHUP).
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim import engine, engine_timing
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.engine import PROGRESS_TURNS, run
from kvfrag.sim.engine_config import EngineConfig, StepTime

BYTES_PER_TOKEN = 1024


def _paged(capacity: int = 1 << 26):
    return make_allocator("paged", capacity=capacity, bytes_per_token=BYTES_PER_TOKEN,
                          max_model_len=4096, block_size=16)


def _workload(n: int, gap_s: float = 0.01, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.cumsum(rng.exponential(gap_s, n)),
        "prompt_tokens": rng.integers(1, 200, n),
        "output_tokens": rng.integers(1, 50, n),
    })


def _config(**kw) -> EngineConfig:
    return EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096,
                        step_time=StepTime(0.001), **kw)


@pytest.mark.parametrize("per_token", [0.0, 1e-6])
def test_a_far_max_time_ends_the_run(per_token):
    cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096,
                       step_time=StepTime(0.02, per_kv_token_s=per_token), max_time_s=1e300)
    start = time.monotonic()
    result = run(_workload(50), _paged(), cfg)
    assert time.monotonic() - start < 30
    assert result.summary["completed"] == 50


def test_the_last_arrival_far_away_is_refused_not_written_as_nan():
    work = _workload(20)
    work.loc[19, "arrival_s"] = 1e300  # 1e300 s x 2**40 bytes: byte-seconds overflow
    with pytest.raises(ValueError, match="not finite") as caught:
        run(work, _paged(1 << 40), _config())
    assert "\n" not in str(caught.value)


def test_the_far_horizon_search_is_bounded():
    reach = engine_timing.iterations_to_reach
    assert reach(1e300, 0.02, 0.0, 7) == 7
    assert reach(1e300, 0.02, 1e-9, 1000) == 1000
    assert reach(1.0, 0.0, 0.0, 5) == 5  # nothing takes time: the bound, not a division by 0
    # the fewest iterations when the horizon is within reach: 0.1 + 0.2 + 0.3 >= 0.55
    assert reach(0.55, 0.1, 0.1, 100) == 3
    assert reach(0.05, 0.1, 0.1, 100) == 1


def test_the_loop_polls_for_signals(monkeypatch):
    calls = []
    monkeypatch.setattr(engine, "poll", lambda: calls.append(1))
    alloc = _paged()
    run(_workload(3000), alloc, _config())
    # (a turn per admission or stretch: a few thousand here)
    assert len(calls) >= 3


def test_a_signal_stops_a_long_run_within_a_second():
    class Alarm(Exception):
        pass

    def handler(signum, frame):
        raise Alarm

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        start = time.monotonic()
        with pytest.raises(Alarm):
            # (several seconds of serving loop, compiled or not)
            run(_workload(200_000), _paged(), _config())
        assert time.monotonic() - start < 1.5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_poll_is_interpreted():
    """Compiled, `poll` would be a C call in which no signal handler runs (sim/interrupts.py)."""
    from kvfrag.sim import interrupts

    assert type(interrupts.poll).__name__ == "function"
    assert PROGRESS_TURNS <= 4096  # "at least every few thousand events"
