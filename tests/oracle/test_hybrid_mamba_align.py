"""Mamba hybrids with prefix caching: kvfrag's `hybrid` allocator in vLLM's `mamba_cache_mode`
"align" against vLLM 0.33's scheduler, iteration by iteration.

With prefix caching on, vLLM runs a Mamba hybrid in "align" mode (`MambaModelConfig`): the
Mamba groups take the attention block size (Qwen3-Next 544 tokens, Jamba 80), a request holds
per Mamba group its current state block and, until its next allocation, the previous one, its
state blocks are cached only where a hit can use them (the replay boundary and shared-prefix
junctions, with `prefix_cache_retention_interval` 0), hits are found right to left, and the
scheduler ends prefill chunks on block boundaries (`_mamba_block_aligned_split`), so a prompt
takes two steps or more even when the budget covers it; a hit on a state cached in the same
step waits a step. vLLM requires chunked prefill for it: the "whole" cases give every prompt
room in one step's budget (4,096 tokens).

The workload is test_hybrid_match.py's `shared` (four system prompts, repeated questions, each
request sampling tokens of its own); the comparison is its `run_both` / `first_divergence`:
every iteration's tokens scheduled, running and waiting, preemptions, admissions, blocks in
use per KV-cache group, free blocks, prefix-hit tokens, evictions and idle cached blocks, then
every request's first-token and finishing step and preemptions, and the fast engine against
the per-iteration reference. Each case prints its figures
(`pytest -s -n 0`: in one process, so that the prints show).
"""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.scheduler")

from . import hybrid_shapes as shapes  # noqa: E402
from .test_hybrid_match import COMPARED, PREFIX, Case, first_divergence, run_both  # noqa: E402

warnings.filterwarnings("ignore", message=".*pure-Python.*")

#: Pools of block ids of the planned page (Qwen3-Next 12.75 MiB, Jamba 1.25 MiB), tight
#: enough to preempt and to evict idle cached blocks by the hundred.
CASES = {
    "qwen3-next-align-whole": Case(shapes.qwen3_next(), True, 40, 4096, 1200, 300, n=100,
                                   system_blocks=100),
    "qwen3-next-align-chunked": Case(shapes.qwen3_next(), True, 40, 1024, 1200, 300, n=100,
                                     system_blocks=100),
    "jamba-1.5-mini-align-whole": Case(shapes.jamba_1_5_mini(), True, 120, 4096, 1200, 300,
                                       n=60, system_blocks=40),
    # A state kept every 160 tokens (two blocks) as well as at the replay boundary.
    "jamba-1.5-mini-align-retention-160-chunked": Case(
        shapes.jamba_1_5_mini(), True, 100, 512, 1200, 300, n=60, system_blocks=40,
        retention=160),
    # The order within a step: prompts partway through their prefill run ahead of decoders
    # admitted after them, and vLLM schedules their chunks (budget and blocks) first. In
    # 512-token chunks under a 544-token block a chunk can take the whole budget (a decoder
    # behind it takes no token); with whole prefill in tight pools the chunk's blocks come
    # before the decoders', which decides a preemption.
    "qwen3-next-align-chunked-512": Case(shapes.qwen3_next(), True, 30, 512, 1200, 300,
                                         n=100, system_blocks=100),
    "qwen3-next-align-chunked-512-seed-1": Case(shapes.qwen3_next(), True, 40, 512, 1200,
                                                300, n=100, system_blocks=100, seed=1),
    "jamba-1.5-mini-align-whole-tight": Case(shapes.jamba_1_5_mini(), True, 80, 4096, 1200,
                                             300, n=60, system_blocks=40),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mamba_align_matches_vllm(name: str) -> None:
    case = CASES[name]
    oracle, trace, ref, fast = run_both(case)
    plan = oracle.plan
    assert plan["mamba_cache_mode"] == "align"
    # one block size for every group: the attention block, which the Mamba groups take
    assert {g["block_size"] for g in plan["groups"]} == {plan["mamba_block_size"]}
    compared, divergence = first_divergence(oracle, trace, ref, COMPARED + PREFIX)
    assert divergence is None, divergence
    assert compared > 1000
    preempted = sum(s["preempted"] for s in oracle.steps)
    hits = sum(s["prefix_hit_tokens"] for s in oracle.steps)
    evictions = sum(s["evictions"] for s in oracle.steps)
    print(f"\n{name}: {compared} iterations compared, {preempted} preemptions, "
          f"{hits} prefix-hit tokens, {evictions} evictions")
    assert preempted > 0, "the pool should be tight"
    assert hits > 0 and evictions > 0
    bs = plan["mamba_block_size"]
    assert all(s["prefix_hit_tokens"] % bs == 0 for s in oracle.steps)  # hits end on a state
    # Chunks end on block boundaries: some prompt that one step's budget covers is split.
    split = [rid for rid, r in ref["requests"].items()
             if oracle.requests[rid]["first_token_step"] > oracle.requests[rid]["admitted_step"]]
    assert split
    for rid, r in ref["requests"].items():
        assert sum(r["hits"]) == oracle.requests[rid]["prefix_hit_tokens"], rid
    rows = fast.requests.set_index("request_id")
    for rid, r in ref["requests"].items():  # the fast engine: the reference's every request
        assert rows.loc[rid, "finished_s"] == r["finished"], rid
        assert rows.loc[rid, "first_token_s"] == r["first"], rid
        assert rows.loc[rid, "preemptions"] == r["preemptions"], rid
    assert fast.summary["prefill_tokens_skipped"] == hits
    assert fast.summary["prefix_evictions"] == evictions
