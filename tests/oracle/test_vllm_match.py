"""kvfrag's engine against vLLM's own scheduler, iteration by iteration.

The same requests go through vLLM 0.33's real v1 `Scheduler` (tests/oracle/vllm_driver.py)
and through kvfrag's per-iteration stepper (`sim.reference`, the specification the fast
engine is held to in tests/sim/test_engine.py) with a `paged` allocator of the same pool.
Iterations take 1 s in kvfrag (base_s = 1, no per-token cost), so iteration k starts at
t = k and a request arriving at step k arrives at t = k. Every iteration must agree exactly:
tokens scheduled, requests running and waiting, preemptions, admissions, blocks in use; and
every request its first-token step, finishing step and preemptions.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.scheduler")

from sim.allocators import make_allocator  # noqa: E402
from sim.engine import EngineConfig, StepTime, run  # noqa: E402
from sim.reference import reference  # noqa: E402
from workloads import load_trace  # noqa: E402

from .vllm_driver import OracleRequest, run_vllm  # noqa: E402

BS = 16
BYTES_PER_TOKEN = 8
COMPARED = ("scheduled_tokens", "running", "waiting", "preempted", "admitted", "blocks_used")


def mooncake(n: int, max_model_len: int) -> pd.DataFrame:
    """The shipped Mooncake sample's first n requests that fit max_model_len (their lengths),
    one arrival per step."""
    df = load_trace("sample:mooncake-conv").requests
    df = df[df["prompt_tokens"] + df["output_tokens"] <= max_model_len].head(n)
    return pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.arange(n, dtype=float),
            "prompt_tokens": df["prompt_tokens"].to_numpy(),
            "output_tokens": df["output_tokens"].to_numpy(),
        }
    )


def synthetic(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.sort(rng.integers(0, n // 2, n)).astype(float),
            "prompt_tokens": rng.integers(1, 700, n),
            "output_tokens": rng.integers(1, 300, n),
        }
    )


def both(wl: pd.DataFrame, num_blocks: int, max_num_seqs: int, budget: int, chunked: bool,
         max_model_len: int, watermark: float = 0.0):
    """(vLLM's run, kvfrag's per-iteration trace and requests, kvfrag's fast-engine result)."""
    oracle = run_vllm(
        [
            OracleRequest(
                int(r.request_id),
                int(r.arrival_s),
                tuple(1_000_000 * (int(r.request_id) + 1) + i for i in range(r.prompt_tokens)),
                int(r.output_tokens),
            )
            for r in wl.itertuples()
        ],
        block_size=BS,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        prefix_caching=False,
        max_model_len=max_model_len,
        watermark=watermark,
    )
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        watermark=watermark,
        step_time=StepTime(base_s=1.0),
    )

    def fresh():
        return make_allocator(
            "paged",
            capacity=num_blocks * BS * BYTES_PER_TOKEN,
            bytes_per_token=BYTES_PER_TOKEN,
            max_model_len=max_model_len,
            block_size=BS,
        )

    trace: list[dict] = []
    ref = reference(wl, fresh(), cfg, trace)
    return oracle, trace, ref, run(wl, fresh(), cfg)


def assert_same(oracle, trace, ref) -> int:
    """Every kvfrag iteration equals vLLM's step of the same number; vLLM's other steps are
    empty. Returns the number of iterations compared."""
    steps = {s["step"]: s for s in oracle.steps}
    ours = {}
    for it in trace:
        k = int(it["start"])
        assert it["start"] == k, "iterations take 1 s: each starts on a whole step"
        ours[k] = it
    for k, s in steps.items():
        it = ours.get(k)
        if it is None:  # kvfrag was idle: nothing to run
            assert s["scheduled_tokens"] == 0 and s["running"] == 0, k
            continue
        mine = {**it, "blocks_used": it["allocated_bytes"] // (BS * BYTES_PER_TOKEN)}
        theirs = {c: s[c] for c in COMPARED}
        assert {c: mine[c] for c in COMPARED} == theirs, f"step {k}"
    assert set(ours) <= set(steps)
    for rid, r in ref["requests"].items():
        v = oracle.requests[rid]
        assert r["status"] == "completed", rid
        assert int(r["first"]) - 1 == v["first_token_step"], rid
        assert int(r["finished"]) - 1 == v["finished_step"], rid
        assert r["preemptions"] == v["preemptions"], rid
    return len(ours)


def assert_fast_engine_agrees(ref, fast) -> None:
    rows = fast.requests.set_index("request_id")
    for rid, r in ref["requests"].items():
        assert rows.loc[rid, "finished_s"] == r["finished"], rid
        assert rows.loc[rid, "preemptions"] == r["preemptions"], rid


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_mooncake_sample_with_preemption(chunked):
    wl = mooncake(120, 16384)
    oracle, trace, ref, fast = both(
        wl, num_blocks=2500, max_num_seqs=32, budget=16384 if not chunked else 2048,
        chunked=chunked, max_model_len=16384,
    )
    assert sum(s["preempted"] for s in oracle.steps) > 0, "the pool should be tight"
    compared = assert_same(oracle, trace, ref)
    assert compared > 500
    assert_fast_engine_agrees(ref, fast)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("seed", [0, 1])
def test_synthetic_with_preemption(chunked, seed):
    wl = synthetic(300, seed)
    oracle, trace, ref, fast = both(
        wl, num_blocks=150, max_num_seqs=24, budget=1024 if not chunked else 256,
        chunked=chunked, max_model_len=1024,
    )
    assert sum(s["preempted"] for s in oracle.steps) > 0, "the pool should be tight"
    compared = assert_same(oracle, trace, ref)
    assert compared > 300
    assert_fast_engine_agrees(ref, fast)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_many_decoders_and_a_small_token_budget(chunked):
    """64 sequences against a budget of 128 tokens: long prompts arrive in chunks among many
    decoders (vLLM schedules running requests in admission order within the budget)."""
    wl = synthetic(400, 2)
    wl["prompt_tokens"] = np.minimum(wl["prompt_tokens"] * 3, 2048 - wl["output_tokens"])
    oracle, trace, ref, fast = both(
        wl, num_blocks=1500 if chunked else 4000, max_num_seqs=64,
        budget=2048 if not chunked else 128,
        chunked=chunked, max_model_len=2048,
    )
    assert max(s["running"] for s in oracle.steps) >= 20
    assert sum(s["preempted"] for s in oracle.steps) > 0
    assert assert_same(oracle, trace, ref) > 300
    assert_fast_engine_agrees(ref, fast)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_watermark(chunked):
    """vLLM keeps int(w x blocks) blocks free for admissions while anything runs; its pool
    has one more block (its null block), so w is chosen where both round alike."""
    wl = synthetic(300, 3)
    oracle, trace, ref, fast = both(
        wl, num_blocks=150, max_num_seqs=24, budget=1024 if not chunked else 256,
        chunked=chunked, max_model_len=1024, watermark=0.05,
    )
    assert oracle.config["watermark_blocks"] == int(0.05 * 150) == 7
    assert assert_same(oracle, trace, ref) > 300
    assert_fast_engine_agrees(ref, fast)
