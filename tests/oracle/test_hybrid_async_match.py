"""kvfrag's `hybrid` allocator under async scheduling against vLLM's `AsyncScheduler` over its
hybrid KV-cache manager, iteration by iteration.

vLLM frees a sliding window's (and a chunked-local group's, and in Mamba's "align" mode the
state's) blocks by the tokens *processed*: computed less those in flight, the previous step's
(`allocate_slots` -> `remove_skipped_blocks(num_computed_tokens - num_in_flight_tokens)`). The
requests, model shapes and pools are test_hybrid_match.py's (`run_both` with vLLM's
`AsyncScheduler`, tests/oracle/hybrid_driver.py, and kvfrag's `async_scheduling`); the clock is
test_async_match.py's: vLLM's steps that schedule tokens are compared in order with kvfrag's
iterations, each starting at the driver's clock (a step that only releases a finished request
takes no time). Every one must agree exactly: tokens scheduled, requests running and waiting,
preemptions, admissions, free blocks and blocks in use per KV-cache group (prefix caching:
tokens found cached, evictions, idle cached blocks); and every request its first-token and
finish times and its preemptions; the fast engine the reference's every request. Each case
prints its iterations compared and preemptions
(`pytest -s -n 0`: in one process, so that the prints show).
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.async_scheduler")

from . import hybrid_shapes as shapes  # noqa: E402
from .test_hybrid_match import COMPARED, PREFIX, Case, gpt_oss, run_both  # noqa: E402

GiB = shapes.GiB


def divergence(oracle: Any, trace: list[dict], ref: dict,
               compared: tuple[str, ...]) -> tuple[int, str | None]:
    """(iterations compared, None or the first difference): vLLM's steps that schedule tokens
    against kvfrag's iterations in order, each starting at the driver's clock."""
    steps = [s for s in oracle.steps if s["scheduled_tokens"]]
    for i, (s, it) in enumerate(zip(steps, trace, strict=False)):
        mine = {c: it[c] for c in compared}
        theirs = {c: s[c] for c in compared}
        theirs["group_blocks"] = tuple(theirs["group_blocks"])
        if it["start"] != s["t"] or mine != theirs:
            diff = {c: (mine[c], theirs[c]) for c in compared if mine[c] != theirs[c]}
            return i, f"step {s['step']} at t={s['t']} (kvfrag at {it['start']}): {diff}"
    if len(steps) != len(trace):
        return min(len(steps), len(trace)), f"{len(trace)} iterations, vLLM {len(steps)} steps"
    for rid, r in ref["requests"].items():
        v = oracle.requests[rid]
        got = (r["status"], r["first"], r["finished"], r["preemptions"])
        want = ("completed", v["first_token_t"], v["finished_t"], v["preemptions"])
        if got != want:
            return len(trace), f"request {rid} (status, first, finished, preemptions): {got} {want}"
    return len(trace), None


# test_hybrid_match.py's shapes and pools (Gemma-3 chunked in 3 GiB: vLLM's memory check counts
# two batches in flight under async scheduling, and 2 GiB cannot hold a max_model_len request).
CASES = {
    "gpt-oss-120b-whole": Case(gpt_oss(), True, 300, None, 1600, 400),
    "gpt-oss-120b-chunked": Case(gpt_oss(), True, 300, 512, 1600, 400),
    "gemma-3-27b-3gib-chunked": Case(shapes.gemma_3_27b(), True, 3 * GiB, 2048, 6000, 300),
    "gemma-3-27b-4gib-whole": Case(shapes.gemma_3_27b(), True, 4 * GiB, None, 6000, 300),
    "llama-4-scout-chunked": Case(shapes.llama_4_scout(), True, 5 * GiB // 2, 2048, 12000, 400),
    "deepseek-v3-whole": Case(shapes.deepseek_v3(), True, 300, None, 1600, 400),
    "deepseek-v3-chunked": Case(shapes.deepseek_v3(), True, 300, 512, 1600, 400),
    "qwen3-next-whole": Case(shapes.qwen3_next(), True, 40, None, 3000, 400),
    "qwen3-next-chunked": Case(shapes.qwen3_next(), True, 40, 512, 3000, 400),
    "jamba-1.5-mini-chunked": Case(shapes.jamba_1_5_mini(), True, 150, 512, 1600, 400),
    # Prefix caching (vLLM's default for these models; Mamba groups in mode "align"): shared
    # system prompts and repeated questions, pools tight enough to evict and to preempt.
    "gpt-oss-120b-prefix-whole": Case(gpt_oss(), True, 300, None, 480, 250, n=70,
                                      system_blocks=8),
    "gpt-oss-120b-prefix-chunked": Case(gpt_oss(), True, 300, 256, 480, 250, n=70,
                                        system_blocks=8),
    "gemma-3-27b-prefix-chunked": Case(shapes.gemma_3_27b(), True, 2 * GiB, 512, 1200, 200,
                                       n=30, system_blocks=80),
    "llama-4-scout-prefix-chunked": Case(shapes.llama_4_scout(), True, 5 * GiB // 2, 2048,
                                         4000, 300, n=20, system_blocks=600),
    "qwen3-next-align-chunked": Case(shapes.qwen3_next(), True, 40, 1024, 1200, 300, n=100,
                                     system_blocks=100),
    "jamba-1.5-mini-align-whole": Case(shapes.jamba_1_5_mini(), True, 120, 4096, 1200, 300,
                                       n=40, system_blocks=40),
    # 512-token chunks under a 544-token block: a chunk ahead takes the whole budget and a
    # decoder behind it goes without a token, so nothing of it is in flight at its next step.
    "qwen3-next-align-chunked-512": Case(shapes.qwen3_next(), True, 30, 512, 1200, 300, n=40,
                                         system_blocks=100, seed=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_iteration_matches_vllms_async_scheduler(name: str) -> None:
    case = CASES[name]
    oracle, trace, ref, fast = run_both(case, asynchronous=True)
    caching = case.system_blocks > 0
    compared, where = divergence(oracle, trace, ref, COMPARED + PREFIX if caching else COMPARED)
    assert where is None, where
    preempted = sum(s["preempted"] for s in oracle.steps)
    assert preempted > 0, "the pool should be tight"
    hits = sum(s["prefix_hit_tokens"] for s in oracle.steps)
    evictions = sum(s["evictions"] for s in oracle.steps)
    print(f"\n{name}: {compared} iterations compared, {preempted} preemptions, "
          f"{hits} prefix-hit tokens, {evictions} evictions")
    if name.endswith("-512"):
        assert sum(it["tokenless"] for it in trace) > 0, "a decoder should go without a token"
    if caching:
        assert hits > 0 and evictions > 0
        for rid, r in ref["requests"].items():  # tokens found cached, resumptions included
            assert sum(r["hits"]) == oracle.requests[rid]["prefix_hit_tokens"], rid
    rows = fast.requests.set_index("request_id")
    for rid, r in ref["requests"].items():  # the fast engine: the reference's every request
        assert rows.loc[rid, "first_token_s"] == r["first"], rid
        assert rows.loc[rid, "finished_s"] == r["finished"], rid
        assert rows.loc[rid, "preemptions"] == r["preemptions"], rid


def test_windows_freed_by_the_tokens_computed_part_from_vllm(monkeypatch) -> None:
    """The comparison sees the tokens in flight: the gpt-oss chunked case with kvfrag's engine
    async but its allocator freeing windows by the tokens computed (as vLLM's synchronous
    scheduler does) parts from vLLM's AsyncScheduler."""
    from kvfrag.sim.allocators.base import Allocator
    from kvfrag.sim.allocators.hybrid import HybridAllocator

    from . import test_hybrid_match

    class ByComputed(HybridAllocator):
        def set_async(self) -> None:
            Allocator.set_async(self)  # (the engine async; the windows not told)

    made = test_hybrid_match.make_allocator

    def make(kind: str, **options: Any) -> Any:
        return ByComputed(**options) if kind == "hybrid" else made(kind, **options)

    monkeypatch.setattr(test_hybrid_match, "make_allocator", make)
    oracle, trace, ref, _ = run_both(CASES["gpt-oss-120b-chunked"], asynchronous=True)
    where = divergence(oracle, trace, ref, COMPARED)[1]
    assert where is not None and "blocks" in where, where
