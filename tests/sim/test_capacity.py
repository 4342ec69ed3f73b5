"""Capacity (sim/capacity.py): how many requests an allocator holds when the queue never
empties, measured by a saturating replay of the same requests."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim import capacity
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.geometry import preset
from kvfrag.sim.units import parse_size

LLAMA3 = preset("llama-3-8b").bytes_per_token  # 128 KiB
BUDGET = parse_size("50GB")
STEP = 0.02
WIDE = EngineConfig(max_num_seqs=1024, max_num_batched_tokens=1_000_000,
                    step_time=StepTime(base_s=STEP))


def table(prompts, outputs, **extra) -> pd.DataFrame:
    n = len(prompts)
    return pd.DataFrame({
        "request_id": np.arange(n), "arrival_s": np.linspace(0, 100, n),
        "prompt_tokens": np.asarray(prompts, dtype=np.int64),
        "output_tokens": np.asarray(outputs, dtype=np.int64), **extra,
    })


def factory(kind: str, budget: int = BUDGET, **options):
    return lambda: make_allocator(kind, capacity=budget, bytes_per_token=LLAMA3,
                                  max_model_len=8192, **options)


def lognormal(n: int, seed: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(6.0, 0.8, n), 1, 4000).astype(int)
    outputs = np.clip(rng.lognormal(5.0, 0.8, n), 1, 2000).astype(int)
    return table(prompts, outputs)


# ------------------------------------------------------------------ the seed's numbers
SEED = table([999] * 1000, [1] * 1000)  # scenarios/seed-slab-vs-paged.yaml's requests


@pytest.mark.parametrize(("kind", "options", "held"), [
    # 50e9 // 1 GiB worst-case slabs (8192 tokens x 128 KiB)
    ("contiguous", {"reserve": "max_model_len"}, BUDGET // (8192 * LLAMA3)),
    # 50e9 // 2 MiB blocks of 16 tokens, 63 blocks for 999 slots each
    ("paged", {"block_size": 16}, (BUDGET // (16 * LLAMA3)) // math.ceil(999 / 16)),
])
def test_seed_slabs_against_paged_blocks(kind, options, held):
    assert held in (46, 378)
    fields = capacity.saturate(SEED, factory(kind, **options), WIDE)
    assert tuple(fields) == capacity.FIELDS
    assert fields["capacity_requests"] == held
    # every request is done in the iteration that admits it: `held` tokens per iteration
    assert fields["capacity_throughput_tok_s"] == pytest.approx(held / STEP)
    assert fields["capacity_memory_requests"] == held and fields["capacity_capped"] == 0


def test_exact_slabs_hold_the_budget_over_one_request_all_along_its_decode():
    slab = 300 + 200 - 1  # slots a request ends holding (its last token is never read)
    budget = 10 * slab * LLAMA3 + slab * LLAMA3 // 2
    requests = table([300] * 200, [200] * 200)
    fields = capacity.saturate(requests, factory("contiguous", budget, reserve="oracle"), WIDE)
    assert fields["capacity_requests"] == 10
    assert fields["capacity_throughput_tok_s"] == pytest.approx(10 / STEP)  # a token each


# ------------------------------------------------------------------ the window
def test_the_start_up_transient_and_the_drain_are_left_out():
    """Requests that grow ninefold while decoding: at t = 0 the memory takes many prompts,
    and the replay's plain average includes the drain; the steady window has neither."""
    budget = 200 * 1000 * LLAMA3  # 200 requests at their full 1,000 slots
    requests = table([100] * 3000, [901] * 3000)
    window, result, _ = capacity.replay(requests, factory("paged", budget, block_size=16), WIDE)
    assert window is not None
    start_count = int(result.timeseries["running"].iloc[0])
    assert start_count > 1.5 * window.running  # prompts only at t = 0
    assert window.running >= 200  # at most 1,000 slots each: 200 always fit
    assert window.running > result.summary["mean_running"]  # the drain is out
    # the window opens after one turnover and closes when the queue first empties
    assert window.completions >= capacity.MIN_TURNOVERS * window.turnover
    ts = result.timeseries
    assert (ts.loc[ts["t_s"] < window.end_s, "waiting"] > 0).all()
    assert ts.loc[ts["t_s"] == window.end_s, "waiting"].iloc[0] == 0


def test_a_small_sample_agrees_with_a_large_one():
    requests = lognormal(6000)
    make = factory("paged", 2 * 2**30, block_size=16)
    figures = []
    for size in (512, 4096):
        window, _, n = _replay_with(requests, make, size)
        assert window is not None and n >= size
        figures.append(window.running)
    small, large = figures
    assert small == pytest.approx(large, rel=0.05)


def _replay_with(requests, make, size):
    old = capacity.SAMPLE
    capacity.SAMPLE = size
    try:
        return capacity.replay(requests, make, WIDE)
    finally:
        capacity.SAMPLE = old


# ------------------------------------------------------------------ engine limits
def test_max_num_seqs_applies_and_the_memory_figure_lifts_it():
    capped = EngineConfig(max_num_seqs=64, max_num_batched_tokens=1_000_000,
                          step_time=StepTime(base_s=STEP))
    fields = capacity.saturate(SEED, factory("paged", block_size=16), capped)
    assert fields["capacity_requests"] == 64
    assert fields["capacity_memory_requests"] == 378
    assert fields["capacity_capped"] == 1


def test_a_replay_that_never_saturates_gives_nan(monkeypatch):
    monkeypatch.setattr(capacity, "MAX_SAMPLE", 64)
    tiny = table([10] * 8, [5] * 8)  # 64 of them fit at once and are admitted together
    fields = capacity.saturate(tiny, factory("paged", block_size=16), WIDE)
    assert math.isnan(fields["capacity_requests"])
    assert math.isnan(fields["capacity_throughput_tok_s"])
    assert fields["capacity_sample_requests"] == 64


def test_requests_that_never_run_give_nan_without_a_larger_replay():
    too_long = table([9000] * 50, [10] * 50)  # prompts over max_model_len: all rejected
    fields = capacity.saturate(too_long, factory("paged", block_size=16), WIDE)
    assert math.isnan(fields["capacity_requests"])
    assert fields["capacity_sample_requests"] == 50


# ------------------------------------------------------------------ the sample
def test_the_sample_is_a_seeded_draw_of_a_large_workload():
    requests = lognormal(5000)
    a, b = capacity.sample(requests, 2048), capacity.sample(requests, 2048)
    pd.testing.assert_frame_equal(a, b)
    assert len(a) == 2048 and (a["arrival_s"] == 0).all()
    assert list(a["request_id"]) == list(range(2048))
    # drawn without replacement, in the workload's order: every row one of the workload's
    pairs = set(zip(requests["prompt_tokens"], requests["output_tokens"], strict=True))
    assert set(zip(a["prompt_tokens"], a["output_tokens"], strict=True)) <= pairs
    assert not a.equals(capacity.sample(requests, 2048, seed=1))


def test_a_small_workload_is_repeated_each_copy_with_its_own_prefixes():
    requests = table([40, 60, 80], [5, 6, 7], hash_ids=[[1, 2], [1, 3], [4]])
    requests = requests.assign(user_id=[0, 1, 2], think_s=[0.0, 1.0, 2.0])
    out = capacity.sample(requests, 7)
    assert list(out.columns) == ["request_id", "arrival_s", "prompt_tokens", "output_tokens",
                                 "hash_ids"]  # a closed loop's users dropped: all wait at 0
    assert list(out["prompt_tokens"]) == [40, 60, 80] * 2 + [40]
    assert list(out["hash_ids"]) == [[1, 2], [1, 3], [4], [6, 7], [6, 8], [9], [11, 12]]


def test_capacity_is_the_same_computed_twice():
    requests = lognormal(3000, seed=5)
    make = factory("buddy", 2**30, reserve="pow2_output")
    first = capacity.saturate(requests, make, WIDE)
    assert first == capacity.saturate(requests, make, WIDE)
    assert first["capacity_sample_requests"] >= capacity.SAMPLE
