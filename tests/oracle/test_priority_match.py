"""`engine.policy: priority` against vLLM 0.33's own scheduler with `policy="priority"`,
iteration by iteration.

The same requests, with priorities of three values mixed, go through vLLM's real v1
`Scheduler` (tests/oracle/vllm_driver.py, `SchedulerConfig(policy="priority")`, each
request's priority) and through kvfrag's per-iteration stepper (`sim.reference`) and fast
engine with `EngineConfig(policy="priority")`, on a pool small enough that requests are
preempted. Iterations take 1 s in kvfrag, so iteration k is vLLM's step k. Every iteration
must agree exactly (tokens scheduled, running, waiting, preemptions, admissions, blocks in
use) and every request its first-token step, finishing step and preemptions.

vLLM breaks ties of (priority, arrival) by request id as a string; the requests here are
numbered from 100 (three digits), so that string order is kvfrag's workload order.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.scheduler")

from kvfrag.sim.allocators import make_allocator  # noqa: E402
from kvfrag.sim.engine import run  # noqa: E402
from kvfrag.sim.engine_config import EngineConfig, StepTime  # noqa: E402
from kvfrag.sim.reference import reference  # noqa: E402

from .test_vllm_match import own_sampled_tokens, shared_prefixes, token_ids  # noqa: E402
from .vllm_driver import OracleRequest, run_vllm  # noqa: E402

BS = 16
BYTES_PER_TOKEN = 8
COMPARED = ("scheduled_tokens", "running", "waiting", "preempted", "admitted", "blocks_used")
PREFIX = ("prefix_hit_tokens", "evictions", "idle_cached_blocks")
# (the synchronous scheduler on both sides, where kvfrag has an async_scheduling key)
SYNC = {"async_scheduling": False} if "async_scheduling" in EngineConfig.__dataclass_fields__ \
    else {}


def prioritised(n: int, seed: int, levels: int = 3) -> pd.DataFrame:
    """n requests (ids from 100), bursts of arrivals, lengths up to 700 + 300, priorities
    0 .. levels-1 drawn at random."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "request_id": 100 + np.arange(n),
            "arrival_s": np.sort(rng.integers(0, n // 2, n)).astype(float),
            "prompt_tokens": rng.integers(1, 700, n),
            "output_tokens": rng.integers(1, 300, n),
            "priority": rng.integers(0, levels, n),
        }
    )


def both(wl: pd.DataFrame, num_blocks: int, max_num_seqs: int, budget: int, chunked: bool,
         long_prefill: int = 0, max_model_len: int = 1024, kind: str = "paged"):
    """(vLLM's run, kvfrag's per-iteration trace and requests, kvfrag's fast-engine result).
    kind "prefix-caching": vLLM's prefix caching on, each request sampling a token of its own
    (tests/oracle/test_vllm_match.py)."""
    caching = kind == "prefix-caching"
    chunk = int(wl.attrs.get("hash_block_tokens", 0)) if caching else 0
    with own_sampled_tokens() if caching else contextlib.nullcontext():
        oracle = run_vllm(
            [
                OracleRequest(int(r.request_id), int(r.arrival_s), token_ids(r, chunk),
                              int(r.output_tokens), int(r.priority))
                for r in wl.itertuples()
            ],
            block_size=BS,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            chunked_prefill=chunked,
            prefix_caching=caching,
            max_model_len=max_model_len,
            long_prefill_token_threshold=long_prefill,
            record_slots=True,
            policy="priority",
        )
    assert oracle.config["policy"] == "priority"
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        long_prefill_token_threshold=long_prefill,
        policy="priority",
        step_time=StepTime(base_s=1.0),
        **SYNC,
    )

    def fresh():
        return make_allocator(
            kind,
            capacity=(num_blocks + 1) * BS * BYTES_PER_TOKEN,  # (+ the null block)
            bytes_per_token=BYTES_PER_TOKEN,
            max_model_len=max_model_len,
            block_size=BS,
        )

    trace: list[dict] = []
    ref = reference(wl, fresh(), cfg, trace)
    return oracle, trace, ref, run(wl, fresh(), cfg)


def assert_same(oracle, trace, ref, compared=COMPARED) -> int:
    """Every kvfrag iteration equals vLLM's step of the same number (vLLM's other steps are
    empty), and every request its first token, finish and preemptions; returns the number of
    iterations compared."""
    steps = {s["step"]: s for s in oracle.steps}
    ours = {int(it["start"]): it for it in trace}
    assert all(it["start"] == int(it["start"]) for it in trace)
    for k, s in steps.items():
        it = ours.get(k)
        if it is None:  # kvfrag was idle: nothing to run
            assert s["scheduled_tokens"] == 0 and s["running"] == 0, k
            continue
        # (capacity - free_bytes() counts the null block, which vLLM's blocks_used does not)
        mine = {**it, "blocks_used": it["allocated_bytes"] // (BS * BYTES_PER_TOKEN) - 1}
        assert {c: mine[c] for c in compared} == {c: s[c] for c in compared}, f"step {k}"
    assert set(ours) <= set(steps)
    for rid, r in ref["requests"].items():
        v = oracle.requests[rid]
        assert r["status"] == "completed", rid
        assert (int(r["first"]) - 1, int(r["finished"]) - 1, r["preemptions"]) == (
            v["first_token_step"], v["finished_step"], v["preemptions"]
        ), rid
    return len(ours)


def victims_not_newest(oracle) -> int:
    """Preemptions in vLLM's run whose victims were not the most recently admitted running
    requests (FCFS would take those): read from the running lists (in vLLM's order) before
    and after each step that preempted."""
    finished_at = {rid: v["finished_step"] for rid, v in oracle.requests.items()}
    count = 0
    for before, step in zip(oracle.steps, oracle.steps[1:], strict=False):
        if not step["preempted"]:
            continue
        order = list(before["tokens"])
        gone = [rid for rid in order
                if rid not in step["tokens"] and finished_at[rid] != step["step"]]
        assert len(gone) == step["preempted"]
        count += len(set(gone) - set(order[len(order) - len(gone):]))
    return count


def assert_fast_engine_agrees(ref, fast) -> None:
    rows = fast.requests.set_index("request_id")
    for rid, r in ref["requests"].items():
        assert rows.loc[rid, "first_token_s"] == r["first"], rid
        assert rows.loc[rid, "finished_s"] == r["finished"], rid
        assert rows.loc[rid, "preemptions"] == r["preemptions"], rid
    assert (rows["priority"] == rows.index.map(lambda rid: ref["requests"][rid]["priority"])).all()


@pytest.mark.parametrize(
    ("chunked", "budget", "long_prefill"),
    [(False, 1024, 0), (True, 256, 0), (True, 256, 64)],
    ids=["whole", "chunked", "chunked-long-prefill-64"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_priority_with_preemption(chunked, budget, long_prefill, seed):
    """Priorities 0-2 mixed, a pool of 120 blocks: preemption by priority (victims that were
    not the newest running request), identical at every iteration."""
    wl = prioritised(80, seed)
    oracle, trace, ref, fast = both(
        wl, num_blocks=120, max_num_seqs=16, budget=budget, chunked=chunked,
        long_prefill=long_prefill,
    )
    assert sum(s["preempted"] for s in oracle.steps) > 0, "the pool should be tight"
    assert victims_not_newest(oracle) > 0, "some victim should be chosen by priority"
    assert assert_same(oracle, trace, ref) > 300
    assert_fast_engine_agrees(ref, fast)


def test_one_priority_is_fcfs_order():
    """Every request at one priority: vLLM's priority queue serves by arrival, as FCFS does,
    but its victim is the latest arrival, not the newest admission."""
    wl = prioritised(80, 2).assign(priority=5)
    oracle, trace, ref, fast = both(wl, num_blocks=120, max_num_seqs=16, budget=256,
                                    chunked=True)
    assert sum(s["preempted"] for s in oracle.steps) > 0
    assert assert_same(oracle, trace, ref) > 300
    assert_fast_engine_agrees(ref, fast)


@pytest.mark.parametrize(("seed", "chunked"), [(0, False), (1, True)], ids=["whole", "chunked"])
def test_priority_with_prefix_caching(seed, chunked):
    """Shared prefixes and repeated prompts (200 requests, priorities 0-2), vLLM's prefix
    caching: a victim by priority that had taken its slot in the step (its block, filled by
    it, cached as vLLM caches it when scheduled) counts in the evictions too; tokens found
    cached, evictions and idle cached blocks identical at every iteration."""
    wl = shared_prefixes(200, seed)
    wl["request_id"] = 100 + np.arange(len(wl))  # (three digits: vLLM's ties in our order)
    wl["priority"] = np.random.default_rng(seed).integers(0, 3, len(wl))
    oracle, trace, ref, fast = both(
        wl, num_blocks=150, max_num_seqs=24, budget=256 if chunked else 1024, chunked=chunked,
        kind="prefix-caching",
    )
    assert sum(s["preempted"] for s in oracle.steps) > 50
    assert victims_not_newest(oracle) > 0
    assert sum(s["evictions"] for s in oracle.steps) > 1000
    assert assert_same(oracle, trace, ref, COMPARED + PREFIX) > 300
    assert_fast_engine_agrees(ref, fast)


@pytest.mark.parametrize("kind", ["paged", "prefix-caching"])
def test_priority_with_async_scheduling(kind):
    """vLLM's AsyncScheduler with policy priority (its server's default scheduling, chunked):
    a victim by priority whose token vLLM had scheduled in the step keeps its blocks cached
    over one token more than one that had not; every iteration and request identical."""
    from .test_async_match import assert_same as assert_same_async

    if kind == "paged":
        wl, num_blocks, seqs = prioritised(80, 1), 120, 16
    else:
        wl, num_blocks, seqs = shared_prefixes(200, 1), 150, 24
        wl["request_id"] = 100 + np.arange(len(wl))
        wl["priority"] = np.random.default_rng(1).integers(0, 3, len(wl))
    caching = kind == "prefix-caching"
    chunk = int(wl.attrs.get("hash_block_tokens", 0)) if caching else 0
    with own_sampled_tokens() if caching else contextlib.nullcontext():
        oracle = run_vllm(
            [OracleRequest(int(r.request_id), int(r.arrival_s), token_ids(r, chunk),
                           int(r.output_tokens), int(r.priority)) for r in wl.itertuples()],
            block_size=BS, num_blocks=num_blocks, max_num_seqs=seqs, max_num_batched_tokens=256,
            chunked_prefill=True, prefix_caching=caching, max_model_len=1024,
            record_slots=False, async_scheduling=True, policy="priority",
        )
    cfg = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=256, chunked_prefill=True,
                       async_scheduling=True, policy="priority", step_time=StepTime(base_s=1.0))

    def fresh():
        return make_allocator(kind, capacity=(num_blocks + 1) * BS * BYTES_PER_TOKEN,
                              bytes_per_token=BYTES_PER_TOKEN, max_model_len=1024, block_size=BS)

    trace: list[dict] = []
    ref = reference(wl, fresh(), cfg, trace)
    assert sum(s["preempted"] for s in oracle.steps) > 20
    assert assert_same_async(oracle, trace, ref, COMPARED + (PREFIX if caching else ())) > 3000
    assert_fast_engine_agrees(ref, run(wl, fresh(), cfg))


@pytest.mark.parametrize(("seed", "max_num_seqs", "budget"), [(0, 24, 128), (1, 16, 96)])
def test_priority_walk_with_long_prefill_prefix_caching(seed, max_num_seqs, budget):
    """The long-prefill cap (32) leaves prompts partway ahead of decoders: vLLM walks its
    running list in admission order under priority too, each request taking its token or
    chunk and its blocks in turn, a shortage preempting the victim by priority, which gives
    back its token or chunk when it was scheduled earlier in the walk. Where the chunk before
    a decoder meets the shortage decides which freed blocks are evicted: evictions and idle
    cached blocks identical at every iteration (150 requests with shared prefixes, a pool
    of 100 blocks)."""
    wl = shared_prefixes(150, seed)
    wl["request_id"] = 100 + np.arange(len(wl))
    wl["priority"] = np.random.default_rng(seed).integers(0, 3, len(wl))
    oracle, trace, ref, fast = both(
        wl, num_blocks=100, max_num_seqs=max_num_seqs, budget=budget, chunked=True,
        long_prefill=32, kind="prefix-caching",
    )
    # (the reference's record: it equals the fast engine, which compiled cannot be watched)
    given_back = sum(it["given_back"] for it in trace)
    assert given_back, "a victim by priority should have been scheduled earlier in the walk"
    assert victims_not_newest(oracle) > 0
    assert sum(s["evictions"] for s in oracle.steps) > 500
    assert assert_same(oracle, trace, ref, COMPARED + PREFIX) > 300
    assert_fast_engine_agrees(ref, fast)
