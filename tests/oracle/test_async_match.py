"""kvfrag's engine with async scheduling against vLLM's `AsyncScheduler`, iteration by iteration.

vLLM's engine core runs its AsyncScheduler with a batch queue of two: it schedules step k,
then applies step k-1's output (tests/oracle/vllm_driver.py, `async_scheduling=True`). A request
whose last token is in flight keeps its blocks and its seat through that scheduling (skipped,
it may still be preempted: it finishes all the same), and a preempted decoder's blocks are
cached over its processed tokens only (computed less the one in flight). kvfrag models it
(`EngineConfig.async_scheduling`, `sim.reference` and the fast engine).

Time: an iteration takes 1 s in kvfrag; a step of vLLM's that schedules nothing (it only
releases a finished request) takes none, in kvfrag as in the driver's clock, so the steps that
schedule tokens are compared in order with kvfrag's iterations, each starting at the driver's
clock. Every one must agree exactly (tokens scheduled, requests running and waiting,
preemptions, admissions, blocks in use; prefix caching: tokens found cached, evictions, idle
cached blocks), and every request its first-token and finish times and its preemptions.
"""

from __future__ import annotations

import contextlib

import pandas as pd
import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.async_scheduler")

from kvfrag.sim.allocators import make_allocator  # noqa: E402
from kvfrag.sim.engine import run  # noqa: E402
from kvfrag.sim.engine_config import EngineConfig, StepTime  # noqa: E402
from kvfrag.sim.reference import reference  # noqa: E402

from .test_vllm_match import (  # noqa: E402
    BS,
    BYTES_PER_TOKEN,
    COMPARED,
    PREFIX,
    mooncake,
    own_sampled_tokens,
    shared_prefixes,
    synthetic,
    token_ids,
)
from .vllm_driver import OracleRequest, run_vllm  # noqa: E402


def both(wl: pd.DataFrame, num_blocks: int, max_num_seqs: int, budget: int, chunked: bool,
         max_model_len: int, kind: str = "paged", long_prefill: int = 0,
         kvfrag_async: bool = True):
    """(vLLM's AsyncScheduler run, kvfrag's per-iteration trace and requests, kvfrag's
    fast-engine result); `kvfrag_async` False: kvfrag synchronous (to show it differs)."""
    caching = kind == "prefix-caching"
    chunk = int(wl.attrs.get("hash_block_tokens", 0)) if caching else 0
    with own_sampled_tokens() if caching else contextlib.nullcontext():
        oracle = run_vllm(
            [OracleRequest(int(r.request_id), int(r.arrival_s), token_ids(r, chunk),
                           int(r.output_tokens)) for r in wl.itertuples()],
            block_size=BS, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget, chunked_prefill=chunked, prefix_caching=caching,
            max_model_len=max_model_len, long_prefill_token_threshold=long_prefill,
            record_slots=False, async_scheduling=True,
        )
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, chunked_prefill=chunked,
        long_prefill_token_threshold=long_prefill, async_scheduling=kvfrag_async,
        step_time=StepTime(base_s=1.0),
    )

    def fresh():
        return make_allocator(kind, capacity=(num_blocks + 1) * BS * BYTES_PER_TOKEN,
                              bytes_per_token=BYTES_PER_TOKEN, max_model_len=max_model_len,
                              block_size=BS)

    trace: list[dict] = []
    ref = reference(wl, fresh(), cfg, trace)
    return oracle, trace, ref, run(wl, fresh(), cfg)


def assert_same(oracle, trace, ref, compared=COMPARED) -> int:
    """vLLM's steps that schedule tokens equal kvfrag's iterations, in order, each starting
    at the driver's clock; every request its times and preemptions. Returns the iterations
    compared."""
    steps = [s for s in oracle.steps if s["scheduled_tokens"]]
    assert len(steps) == len(trace)
    for s, it in zip(steps, trace, strict=True):
        assert it["start"] == s["t"], s["step"]
        # (capacity - free_bytes(): the null block too, as vLLM's num_gpu_blocks - free)
        mine = {**it, "blocks_used": it["allocated_bytes"] // (BS * BYTES_PER_TOKEN) - 1}
        assert {c: mine[c] for c in compared} == {c: s[c] for c in compared}, s["step"]
    for rid, r in ref["requests"].items():
        v = oracle.requests[rid]
        assert r["status"] == "completed", rid
        assert (r["first"], r["finished"], r["preemptions"]) == (
            v["first_token_t"], v["finished_t"], v["preemptions"]), rid
    return len(trace)


def assert_fast_engine_agrees(ref, fast) -> None:
    rows = fast.requests.set_index("request_id")
    for rid, r in ref["requests"].items():
        assert rows.loc[rid, "first_token_s"] == r["first"], rid
        assert rows.loc[rid, "finished_s"] == r["finished"], rid
        assert rows.loc[rid, "preemptions"] == r["preemptions"], rid


def preempted(oracle) -> int:
    return sum(s["preempted"] for s in oracle.steps)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_synthetic_under_memory_pressure(chunked):
    """300 requests on 150 blocks: about a hundred preemptions, some of them of requests whose
    last token is in flight (they finish anyway); and kvfrag's synchronous model does not match
    vLLM's async scheduler (the comparison sees the difference)."""
    wl = synthetic(300, 0)
    args = (wl, 150, 24, 256 if chunked else 1024, chunked, 1024)
    oracle, trace, ref, fast = both(*args)
    assert preempted(oracle) > 50
    assert assert_same(oracle, trace, ref) > 5000
    assert_fast_engine_agrees(ref, fast)
    sync_trace: list[dict] = []
    cfg = EngineConfig(max_num_seqs=24, max_num_batched_tokens=args[3], chunked_prefill=chunked,
                       async_scheduling=False, step_time=StepTime(base_s=1.0))
    alloc = make_allocator("paged", capacity=151 * BS * BYTES_PER_TOKEN,
                           bytes_per_token=BYTES_PER_TOKEN, max_model_len=1024, block_size=BS)
    sync = reference(wl, alloc, cfg, sync_trace)
    with pytest.raises(AssertionError):
        assert_same(oracle, sync_trace, sync)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_mooncake_sample(chunked):
    """120 Mooncake conversations (prompts up to 16k tokens) on a pool that preempts."""
    wl = mooncake(120, 16384)
    oracle, trace, ref, fast = both(wl, 2500, 32, 2048 if chunked else 16384, chunked, 16384)
    assert preempted(oracle) > 0, "the pool should be tight"
    assert assert_same(oracle, trace, ref) > 5000
    assert_fast_engine_agrees(ref, fast)


def test_prefix_caching_shared_prefixes():
    """Prefix caching, chunked: hits, evictions and idle cached blocks at every step, with
    preempted decoders' blocks cached over their processed tokens only."""
    wl = shared_prefixes(300, 1)
    oracle, trace, ref, fast = both(wl, 150, 24, 256, True, 1024, kind="prefix-caching")
    assert preempted(oracle) > 50
    assert sum(s["evictions"] for s in oracle.steps) > 1000
    assert assert_same(oracle, trace, ref, COMPARED + PREFIX) > 5000
    assert_fast_engine_agrees(ref, fast)
    s = fast.summary
    assert s["prefill_tokens_skipped"] == sum(x["prefix_hit_tokens"] for x in oracle.steps)
    assert s["prefix_evictions"] == sum(x["evictions"] for x in oracle.steps)


def test_long_prefill_token_threshold():
    """A 128-token cap on a step's prefill chunk (chunked, a 512-token budget): a held
    request's seat counts among those the cap is waived for."""
    wl = synthetic(300, 0)
    oracle, trace, ref, fast = both(wl, 150, 24, 512, True, 1024, long_prefill=128)
    assert preempted(oracle) > 50
    assert assert_same(oracle, trace, ref) > 5000
    assert_fast_engine_agrees(ref, fast)


def test_the_driver_holds_a_finished_request_one_step():
    """One request, 20 prompt tokens and 3 outputs: synchronously it is freed in the step of
    its last token (step 2); async, step 3 is scheduled while that token is in flight (nothing
    to schedule: 0 tokens, its 2 blocks still held) and frees it after. Its times are the
    same: first token at the end of step 0, finished at the end of step 2."""
    runs = {
        a: run_vllm([OracleRequest(0, 0, tuple(range(1, 21)), 3)], num_blocks=8,
                    max_num_seqs=4, max_num_batched_tokens=64, chunked_prefill=True,
                    prefix_caching=False, max_model_len=64, async_scheduling=a)
        for a in (False, True)
    }
    sync, asy = runs[False], runs[True]
    assert [s["scheduled_tokens"] for s in sync.steps] == [20, 1, 1]
    assert [s["scheduled_tokens"] for s in asy.steps] == [20, 1, 1, 0]
    assert sync.steps[-1]["blocks_used"] == 0
    assert asy.steps[2]["blocks_used"] == 2 and asy.steps[3]["blocks_used_sched"] == 2
    assert asy.steps[3]["blocks_used"] == 0 and asy.steps[3]["t"] == 3
    for run_ in (sync, asy):
        r = run_.requests[0]
        assert (r["first_token_step"], r["finished_step"]) == (0, 2)
    assert (asy.requests[0]["first_token_t"], asy.requests[0]["finished_t"]) == (1, 3)
