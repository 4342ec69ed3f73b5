"""kvfrag's engine against vLLM's own scheduler, iteration by iteration.

The same requests go through vLLM 0.33's real v1 `Scheduler`, the synchronous one
(tests/oracle/vllm_driver.py; the async one: tests/oracle/test_async_match.py)
and through kvfrag's per-iteration stepper (`sim.reference`, the specification the fast
engine is held to in tests/sim/test_engine.py) with a `paged` allocator of the same pool, or a
`prefix-caching` one with vLLM's prefix caching on. Iterations take 1 s in kvfrag (base_s = 1,
no per-token cost), so iteration k starts at t = k and a request arriving at step k arrives at
t = k. Every iteration must agree exactly: tokens scheduled, requests running and waiting,
preemptions, admissions, blocks in use (prefix caching: tokens found cached by its admissions,
idle cached blocks evicted, idle cached blocks left); and every request its first-token step,
finishing step and preemptions.

Prefix caching: kvfrag's requests carry hash ids per chunk of tokens (`hash_ids`, the
Mooncake trace's 512-token chunks); vLLM's get token ids that make equal hash ids equal
tokens (hash id x 1000 + position in the chunk). Generated tokens are unique to their request
in kvfrag's model; vLLM's fake model output here samples a token of the request's own
(`own_sampled_tokens`), as the driver's one token for everybody would make the outputs of
identical prompts identical, hence found in the cache by each other.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.scheduler")

from kvfrag.sim.allocators import Request, make_allocator  # noqa: E402
from kvfrag.sim.engine import run  # noqa: E402
from kvfrag.sim.engine_config import EngineConfig, StepTime  # noqa: E402
from kvfrag.sim.reference import reference  # noqa: E402
from kvfrag.workloads import load_trace  # noqa: E402

from . import vllm_driver  # noqa: E402
from .vllm_driver import OracleRequest, run_vllm  # noqa: E402

BS = 16
BYTES_PER_TOKEN = 8
COMPARED = ("scheduled_tokens", "running", "waiting", "preempted", "admitted", "blocks_used")
PREFIX = ("prefix_hit_tokens", "evictions", "idle_cached_blocks")
OWN_TOKEN = 1_000_000_000  # + rid: the token a request samples at every step (prefix caching)


def mooncake(n: int, max_model_len: int, hashed: bool = False) -> pd.DataFrame:
    """The shipped Mooncake sample's first n requests that fit max_model_len (their lengths,
    and with `hashed` their hash ids per 512-token chunk), one arrival per step."""
    df = load_trace("sample:mooncake-conv").requests
    df = df[df["prompt_tokens"] + df["output_tokens"] <= max_model_len].head(n)
    wl = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.arange(n, dtype=float),
            "prompt_tokens": df["prompt_tokens"].to_numpy(),
            "output_tokens": df["output_tokens"].to_numpy(),
        }
    )
    if hashed:
        wl["hash_ids"] = df["hash_ids"].to_list()
        wl.attrs["hash_block_tokens"] = 512
    return wl


def shared_prefixes(n: int, seed: int) -> pd.DataFrame:
    """Requests behind one of four system prompts of whole blocks (1 to 8), most of them with
    a question of whole blocks too (prompts that are exact multiples of the block size), and a
    quarter asking an earlier prompt again, token for token. Hash ids per block-sized chunk."""
    rng = np.random.default_rng(seed)
    systems = [int(b) * BS for b in rng.integers(1, 9, 4)]
    asked: list[tuple[list[int], int]] = []
    hashes, prompts, fresh = [], [], 10_000
    for _ in range(n):
        if asked and rng.random() < 0.25:
            ids, prompt = asked[int(rng.integers(len(asked)))]
        else:
            g = int(rng.integers(4))
            whole = rng.random() < 0.6
            mine = int(rng.integers(1, 30)) * BS if whole else int(rng.integers(1, 480))
            own = -(-mine // BS)
            ids = [100 * g + c for c in range(systems[g] // BS)] + list(range(fresh, fresh + own))
            fresh += own
            prompt = systems[g] + mine
            asked.append((ids, prompt))
        hashes.append(ids)
        prompts.append(prompt)
    wl = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.sort(rng.integers(0, n // 2, n)).astype(float),
            "prompt_tokens": prompts,
            "output_tokens": rng.integers(1, 250, n),
            "hash_ids": hashes,
        }
    )
    wl.attrs["hash_block_tokens"] = BS
    return wl


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


def token_ids(r, chunk: int) -> tuple[int, ...]:
    """A request's prompt as token ids: unique to it, or with hash ids (prefix caching) equal
    hash ids give equal tokens (hash id x 1000 + position in its chunk of `chunk` tokens)."""
    if not chunk:
        return tuple(1_000_000 * (int(r.request_id) + 1) + i for i in range(r.prompt_tokens))
    ids = [int(h) for h in r.hash_ids]
    assert len(ids) == -(-r.prompt_tokens // chunk) and max(ids) < 1_000_000
    return tuple(ids[i // chunk] * 1000 + i % chunk for i in range(r.prompt_tokens))


@contextlib.contextmanager
def own_sampled_tokens():
    """vLLM's fake model output samples OWN_TOKEN + rid for a request (not the driver's one
    token for everybody): generated blocks are then cached under keys of their request's own,
    as kvfrag keys them."""
    v = vllm_driver._vllm()
    real = v["ModelRunnerOutput"]

    def output(req_ids, req_id_to_index, sampled_token_ids):
        pairs = zip(req_ids, sampled_token_ids, strict=True)
        own = [[OWN_TOKEN + int(rid)] * len(t) for rid, t in pairs]
        return real(req_ids=req_ids, req_id_to_index=req_id_to_index, sampled_token_ids=own)

    v["ModelRunnerOutput"] = output
    try:
        yield
    finally:
        v["ModelRunnerOutput"] = real


def both(wl: pd.DataFrame, num_blocks: int, max_num_seqs: int, budget: int, chunked: bool,
         max_model_len: int, watermark: float = 0.0, kind: str = "paged",
         options: dict | None = None, own_tokens: bool = True, long_prefill: int = 0,
         reserve_full_isl: bool = True):
    """(vLLM's run, kvfrag's per-iteration trace and requests, kvfrag's fast-engine result).
    kind "prefix-caching": vLLM's prefix caching on, kvfrag's prefix-caching allocator.
    `num_blocks` usable blocks: both pools hold one more, the null block (vLLM's
    num_gpu_blocks, kvfrag's budget // block bytes)."""
    caching = kind == "prefix-caching"
    chunk = int(wl.attrs.get("hash_block_tokens", 0)) if caching else 0
    with own_sampled_tokens() if caching and own_tokens else contextlib.nullcontext():
        oracle = run_vllm(
            [
                OracleRequest(
                    int(r.request_id),
                    int(r.arrival_s),
                    token_ids(r, chunk),
                    int(r.output_tokens),
                )
                for r in wl.itertuples()
            ],
            block_size=BS,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            chunked_prefill=chunked,
            prefix_caching=caching,
            max_model_len=max_model_len,
            watermark=watermark,
            long_prefill_token_threshold=long_prefill,
            reserve_full_isl=reserve_full_isl,
            record_slots=False,
            async_scheduling=False,
        )
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        watermark=watermark,
        long_prefill_token_threshold=long_prefill,
        reserve_full_isl=reserve_full_isl,
        async_scheduling=False,  # (vLLM's synchronous Scheduler: tests/oracle/test_async_match.py
        step_time=StepTime(base_s=1.0),  # holds the engine to its AsyncScheduler)
    )

    def fresh():
        return make_allocator(
            kind,
            capacity=(num_blocks + 1) * BS * BYTES_PER_TOKEN,
            bytes_per_token=BYTES_PER_TOKEN,
            max_model_len=max_model_len,
            block_size=BS,
            **(options or {}),
        )

    trace: list[dict] = []
    ref = reference(wl, fresh(), cfg, trace)
    return oracle, trace, ref, run(wl, fresh(), cfg)


def assert_same(oracle, trace, ref, compared=COMPARED) -> int:
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
        # (capacity - free_bytes(): the null block too, as vLLM's num_gpu_blocks - free)
        mine = {**it, "blocks_used": it["allocated_bytes"] // (BS * BYTES_PER_TOKEN) - 1}
        theirs = {c: s[c] for c in compared}
        assert {c: mine[c] for c in compared} == theirs, f"step {k}"
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
@pytest.mark.parametrize(("num_blocks", "watermark"), [(150, 0.05), (159, 0.05)])
def test_watermark(chunked, num_blocks, watermark):
    """vLLM keeps int(w x blocks) blocks free for admissions while anything runs, blocks
    counted with its null block: 159 usable blocks (a pool of 160) keep 8, where rounding
    over the usable blocks alone would keep 7."""
    wl = synthetic(300, 3)
    oracle, trace, ref, fast = both(
        wl, num_blocks=num_blocks, max_num_seqs=24, budget=1024 if not chunked else 256,
        chunked=chunked, max_model_len=1024, watermark=watermark,
    )
    assert oracle.config["watermark_blocks"] == int(watermark * (num_blocks + 1))
    assert assert_same(oracle, trace, ref) > 300
    assert_fast_engine_agrees(ref, fast)


def assert_prefix_hits_per_request(oracle, ref, wl, whole_blocks: bool = True) -> None:
    """Each request found as many tokens cached over its admissions as in vLLM; resumed
    requests found their own output (more than their prompt's blocks) cached; with
    `whole_blocks`, fully cached prompts of whole blocks recomputed their last block."""
    for rid, r in ref["requests"].items():
        assert sum(r["hits"]) == oracle.requests[rid]["prefix_hit_tokens"], rid
    prompt = wl.set_index("request_id")["prompt_tokens"]
    first = [(r["hits"][0], prompt[rid]) for rid, r in ref["requests"].items()]
    assert not whole_blocks or any(p % BS == 0 and hit == p - BS for hit, p in first)
    resumed = [max(r["hits"][1:]) - prompt[rid] for rid, r in ref["requests"].items()
               if len(r["hits"]) > 1]
    assert max(resumed) > 0


def assert_prefix_totals(oracle, fast) -> None:
    """The fast engine found as many tokens cached and evicted as many idle blocks."""
    s = fast.summary
    assert s["prefill_tokens_skipped"] == sum(x["prefix_hit_tokens"] for x in oracle.steps)
    assert s["prefix_evictions"] == sum(x["evictions"] for x in oracle.steps)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prefix_caching_mooncake_sample(chunked):
    """300 Mooncake conversations with their hash ids, a pool that preempts and evicts: hits
    (whole blocks, capped at all tokens but the last), idle cached blocks, evictions (least
    recently freed first) and resumed requests finding their own output equal vLLM's at every
    step."""
    wl = mooncake(300, 8192, hashed=True)
    oracle, trace, ref, fast = both(
        wl, num_blocks=1500, max_num_seqs=32, budget=8192 if not chunked else 2048,
        chunked=chunked, max_model_len=8192, kind="prefix-caching",
    )
    assert sum(s["preempted"] for s in oracle.steps) > 10, "the pool should be tight"
    assert sum(s["evictions"] for s in oracle.steps) > 10_000
    assert sum(s["prefix_hit_tokens"] for s in oracle.steps) > 100_000
    assert assert_same(oracle, trace, ref, COMPARED + PREFIX) > 10_000
    assert_prefix_hits_per_request(oracle, ref, wl, whole_blocks=False)
    assert_fast_engine_agrees(ref, fast)
    assert_prefix_totals(oracle, fast)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize(("seed", "watermark"), [(0, 0.0), (1, 0.0), (3, 0.05)])
def test_prefix_caching_shared_prefixes(chunked, seed, watermark):
    """400 requests behind four system prompts, prompts often exact multiples of the block
    size and a quarter of them asked again: a fully cached prompt recomputes its last block
    into a fresh block (a duplicate of the cached one), every full block is cached, generated
    ones included, and a preempted request resumes finding its own output."""
    wl = shared_prefixes(400, seed)
    assert (wl["prompt_tokens"] % BS == 0).mean() > 0.5
    assert wl["hash_ids"].map(tuple).duplicated().sum() > 50
    oracle, trace, ref, fast = both(
        wl, num_blocks=150, max_num_seqs=24, budget=1024 if not chunked else 256,
        chunked=chunked, max_model_len=1024, watermark=watermark, kind="prefix-caching",
    )
    assert sum(s["preempted"] for s in oracle.steps) > 50, "the pool should be tight"
    assert sum(s["evictions"] for s in oracle.steps) > 1000
    assert assert_same(oracle, trace, ref, COMPARED + PREFIX) > 5000
    assert_prefix_hits_per_request(oracle, ref, wl)
    assert_fast_engine_agrees(ref, fast)
    assert_prefix_totals(oracle, fast)


def test_prompt_only_caching_is_not_vllm():
    """`cache_generated: false` (kvfrag's earlier model: only the blocks a trace's hash chain
    names are cached) differs from vLLM: the comparison above is sensitive to it."""
    wl = shared_prefixes(150, 0)
    oracle, trace, ref, _ = both(
        wl, num_blocks=150, max_num_seqs=24, budget=1024, chunked=False, max_model_len=1024,
        kind="prefix-caching", options={"cache_generated": False},
    )
    with pytest.raises(AssertionError):
        assert_same(oracle, trace, ref, COMPARED + PREFIX)


def test_generated_blocks_of_equal_text_are_shared_by_vllm_only():
    """Pins a documented difference: vLLM keys generated blocks by their tokens, so requests
    with the same prompt that generate the same text (here the driver's one token for every
    request) share them; kvfrag keys each request's generated blocks as its own."""
    wl = shared_prefixes(150, 0)
    oracle, trace, ref, _ = both(
        wl, num_blocks=150, max_num_seqs=24, budget=1024, chunked=False, max_model_len=1024,
        kind="prefix-caching", own_tokens=False,
    )
    with pytest.raises(AssertionError):
        assert_same(oracle, trace, ref, COMPARED + PREFIX)


def test_pool_counts_equal_vllms_over_a_grid():
    """For every (watermark, pool): vLLM's watermark blocks, free blocks of an empty pool and
    after a request takes some, and usage equal kvfrag's paged and prefix-caching pools of the
    same budget (the null block is kept by both: never free, never held)."""
    grid = [(w, n) for w in (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.99)
            for n in (2, 7, 20, 99, 159, 999, 1000)]
    for w, n in grid:
        sched, _ = vllm_driver.make_scheduler(
            block_size=BS, num_blocks=n - 1, max_num_seqs=4, max_num_batched_tokens=1024,
            chunked_prefill=True, prefix_caching=False, max_model_len=1024, watermark=w,
        )
        kvm = sched.kv_cache_manager
        pool = kvm.block_pool
        for kind in ("paged", "prefix-caching"):
            a = make_allocator(kind, capacity=n * BS * BYTES_PER_TOKEN + 5,
                               bytes_per_token=BYTES_PER_TOKEN, max_model_len=1024,
                               block_size=BS)
            case = (w, n, kind)
            assert a.num_blocks == pool.num_gpu_blocks == n, case
            assert a.watermark_bytes(w) == kvm.watermark_blocks * a.block_bytes, case
            assert a.free_blocks() == pool.get_num_free_blocks() == n - 1, case
            taken = min(n - 1, 3)
            if taken:
                req = Request(0, taken * BS - 1, 1)  # (taken blocks to its last slot)
                assert a.admit(req, taken * BS - 1, decoding=False), case
            got = pool.get_new_blocks(taken)
            assert a.free_blocks() == pool.get_num_free_blocks(), case
            assert a.free_blocks() / (n - 1) == 1 - pool.get_usage(), case
            assert 0 not in {b.block_id for b in got}, case  # block 0: the null block
            if taken:
                assert 0 not in a.block_table(0), case
            pool.free_blocks(got)
            acc = a.account()
            acc.check()
            assert acc.usable_free == a.free_blocks() * a.block_bytes, case
            assert acc.external == a.block_bytes + 5, case  # the null block and the tail


@pytest.mark.parametrize(
    ("chunked", "budget", "threshold"),
    [(False, 1024, 256), (True, 512, 128), (True, 256, 64)],
    ids=["whole-256", "chunked-128", "chunked-64"],
)
def test_long_prefill_token_threshold(chunked, budget, threshold):
    """vLLM caps a request's prefill tokens in a step at long_prefill_token_threshold, for
    running and waiting requests alike, unless only one request runs or waits; with chunked
    prefill off it chunks prompts all the same."""
    wl = synthetic(300, 0)
    oracle, trace, ref, fast = both(
        wl, num_blocks=150, max_num_seqs=24, budget=budget, chunked=chunked,
        max_model_len=1024, long_prefill=threshold,
    )
    assert sum(s["preempted"] for s in oracle.steps) > 0, "the pool should be tight"
    capped = [it["scheduled_tokens"] for it in trace if it["scheduled_tokens"] > threshold]
    assert capped, "some iterations take several capped chunks or a chunk beside decoders"
    assert assert_same(oracle, trace, ref) > 300
    assert_fast_engine_agrees(ref, fast)


@pytest.mark.parametrize(("chunked", "threshold", "watermark"),
                         [(True, 0, 0.0), (True, 128, 0.05), (False, 128, 0.0)],
                         ids=["chunked", "chunked-128-watermark", "whole-128"])
def test_without_reserve_full_isl(chunked, threshold, watermark):
    """scheduler_reserve_full_isl off: a request is admitted when its first chunk (and the
    watermark) fits; more admissions, more preemptions."""
    wl = synthetic(300, 1)
    oracle, trace, ref, fast = both(
        wl, num_blocks=150, max_num_seqs=24, budget=256 if chunked else 1024, chunked=chunked,
        max_model_len=1024, long_prefill=threshold, watermark=watermark,
        reserve_full_isl=False,
    )
    assert sum(s["preempted"] for s in oracle.steps) > 50, "the pool should thrash"
    assert assert_same(oracle, trace, ref) > 300
    assert_fast_engine_agrees(ref, fast)


@pytest.mark.parametrize("reserve_full_isl", [True, False], ids=["reserve", "first-chunk"])
def test_prefix_caching_with_threshold(reserve_full_isl):
    """Shared prefixes with a 64-token cap on prefill chunks, with and without the
    full-sequence gate: every iteration equal, tokens found cached and evictions included. A
    decoder after an in-progress chunk in admission order takes its block after that chunk,
    as vLLM walks its running list (before that walk, a decoder the chunk preempted had taken
    its block first and could evict an idle cached block vLLM keeps)."""
    wl = shared_prefixes(300, 1)
    oracle, trace, ref, fast = both(
        wl, num_blocks=150, max_num_seqs=24, budget=256, chunked=True, max_model_len=1024,
        kind="prefix-caching", long_prefill=64, reserve_full_isl=reserve_full_isl,
    )
    assert sum(s["preempted"] for s in oracle.steps) > 20
    assert assert_same(oracle, trace, ref, (*COMPARED, "prefix_hit_tokens", "evictions")) > 3000
    assert_fast_engine_agrees(ref, fast)
    s = fast.summary
    assert s["prefill_tokens_skipped"] == sum(x["prefix_hit_tokens"] for x in oracle.steps)
    evicted = sum(x["evictions"] for x in oracle.steps)
    assert evicted > 5000 and s["prefix_evictions"] == evicted
