"""kvfrag's `hybrid` allocator against vLLM's hybrid KV-cache manager, iteration by iteration.

The same requests go through vLLM 0.33's real `Scheduler` over a KV cache planned by vLLM's own
planner (tests/oracle/hybrid_driver.py) and through kvfrag's per-iteration stepper
(`sim.reference`) with `make_allocator("hybrid", ...)` of the same budget, model layers and
engine settings (vLLM's scheduler runs one batch at a time: `concurrent_batches` 1; two under
async scheduling, test_hybrid_async_match.py).
Iterations take 1 s in kvfrag, so iteration k is vLLM's step k. Pools are tight enough to
preempt. Every iteration must agree exactly: tokens scheduled, requests running and waiting,
preemptions, admissions, blocks in use per KV-cache group and free blocks; and every request
its first-token step, finishing step and preemptions; with prefix caching (the `prefix`
cases: shared system prompts, repeated questions) also the tokens found cached, the idle
cached blocks evicted and those left idle, and each request's hits. Mamba hybrids
(Qwen3-Next, Jamba) run in mamba_cache_mode "none", the mode vLLM 0.33 uses without prefix
caching (with it, "align": test_hybrid_mamba_align.py, on this module's `run_both`). Each case
prints its iterations compared, preemptions, prefix-hit tokens and evictions
(`pytest -s -n 0`: in one process, so that the prints show).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.scheduler")

from kvfrag.sim.allocators import make_allocator  # noqa: E402
from kvfrag.sim.engine import run  # noqa: E402
from kvfrag.sim.engine_config import EngineConfig, StepTime  # noqa: E402
from kvfrag.sim.layers import LayerStack  # noqa: E402
from kvfrag.sim.reference import reference  # noqa: E402

from . import hybrid_shapes as shapes  # noqa: E402
from .hybrid_driver import run_vllm_hybrid  # noqa: E402
from .test_hybrid_scheduler_oracle import mixed  # noqa: E402
from .test_vllm_match import own_sampled_tokens, token_ids  # noqa: E402
from .vllm_driver import OracleRequest  # noqa: E402

warnings.filterwarnings("ignore", message=".*pure-Python.*")

GiB = shapes.GiB
BS = 16
SEQS = 16
COMPARED = ("scheduled_tokens", "running", "waiting", "preempted", "admitted", "free_blocks",
            "group_blocks")


@dataclass(frozen=True)
class Case:
    """One comparison: a model shape, its pool, the engine settings and a mixed workload."""

    stack: LayerStack
    manager: bool
    pool: int  # bytes of KV memory, or (under 100,000) block ids of the planned page
    chunk: int | None  # max_num_batched_tokens with chunked prefill; None: whole prefill
    max_prompt: int
    max_output: int
    n: int = 40
    #: Prefix caching on, over `shared`'s workload: four system prompts of up to this many
    #: blocks (0: off, `mixed`'s workload).
    system_blocks: int = 0
    seed: int = 0
    retention: int | None = 0  # prefix_cache_retention_interval (None: every block kept)


class Trace(list):
    """The reference's trace, each record given the allocator's free blocks and blocks per
    group at the iteration's end (where vLLM's driver reads them, after update_from_output)."""

    def __init__(self, alloc: Any) -> None:
        super().__init__()
        self.alloc = alloc

    def append(self, record: dict) -> None:
        record["free_blocks"] = self.alloc.free_blocks()
        record["group_blocks"] = self.alloc.group_blocks()
        super().append(record)


def shared(case: Case) -> pd.DataFrame:
    """Requests behind one of four system prompts of whole blocks (1 to `system_blocks`), with
    a question of up to `max_prompt` tokens (most of them whole blocks), a quarter asking an
    earlier prompt again token for token; outputs 1 to `max_output`; hash ids per block."""
    rng = np.random.default_rng(case.seed)
    systems = [int(b) * BS for b in rng.integers(1, case.system_blocks + 1, 4)]
    asked: list[tuple[list[int], int]] = []
    hashes, prompts, fresh = [], [], 10_000
    for _ in range(case.n):
        if asked and rng.random() < 0.25:
            ids, prompt = asked[int(rng.integers(len(asked)))]
        else:
            g = int(rng.integers(4))
            mine = (int(rng.integers(1, case.max_prompt // BS)) * BS if rng.random() < 0.6
                    else int(rng.integers(1, case.max_prompt)))
            own = -(-mine // BS)
            ids = [100 * g + c for c in range(systems[g] // BS)] + list(range(fresh, fresh + own))
            fresh += own
            prompt = systems[g] + mine
            asked.append((ids, prompt))
        hashes.append(ids)
        prompts.append(prompt)
    wl = pd.DataFrame({
        "request_id": np.arange(case.n),
        "arrival_s": np.sort(rng.integers(0, case.n // 2, case.n)).astype(float),
        "prompt_tokens": prompts,
        "output_tokens": rng.integers(1, case.max_output, case.n),
        "hash_ids": hashes,
    })
    wl.attrs["hash_block_tokens"] = BS
    return wl


def run_both(case: Case, asynchronous: bool = False) -> tuple[Any, list[dict], dict, Any]:
    """(vLLM's run, kvfrag's trace, kvfrag's reference result, kvfrag's fast-engine result);
    `asynchronous`: vLLM's AsyncScheduler and kvfrag's async scheduling (else both
    synchronous)."""
    caching = case.system_blocks > 0
    if caching:
        wl = shared(case)
        reqs = [OracleRequest(int(r.request_id), int(r.arrival_s), token_ids(r, BS),
                              int(r.output_tokens)) for r in wl.itertuples()]
    else:
        reqs = mixed(case.n, 0, case.max_prompt, case.max_output)
    mml = -(-max(len(r.prompt) + r.output_tokens for r in reqs) // BS) * BS
    budget = case.chunk or mml

    def hybrid(capacity: int) -> Any:
        return make_allocator(
            "hybrid", capacity=capacity, bytes_per_token=case.stack.full_bytes_per_token,
            max_model_len=mml, stack=case.stack, block_size=BS,
            hybrid_kv_cache_manager=case.manager, max_num_batched_tokens=budget,
            concurrent_batches=2 if asynchronous else 1, prefix_caching=caching,
            **({"prefix_cache_retention_interval": case.retention} if caching else {}),
        )

    budget_bytes = case.pool if case.pool >= 100_000 else case.pool * hybrid(2**50).page
    # Prefix caching: each request samples a token of its own, so that its generated blocks
    # are cached under keys only it finds again, as kvfrag keys them.
    with own_sampled_tokens() if caching else contextlib.nullcontext():
        oracle = run_vllm_hybrid(
            reqs, case.stack, budget_bytes=budget_bytes, max_num_seqs=SEQS,
            max_num_batched_tokens=budget, chunked=case.chunk is not None,
            hybrid_manager=case.manager, max_model_len=mml, prefix_caching=caching,
            retention=case.retention, async_scheduling=asynchronous,
        )
    alloc = hybrid(budget_bytes)
    assert alloc.plan.num_blocks == oracle.plan["num_blocks"]
    if case.stack.mamba_layers:  # the mode, state block size and padded page vLLM resolved
        p = alloc.plan
        assert (p.mamba_cache_mode, p.mamba_block_size, p.mamba_page_padded) == (
            oracle.plan["mamba_cache_mode"], oracle.plan["mamba_block_size"],
            oracle.plan["mamba_page_padded"])
    assert [(g["kind"], g["block_size"]) for g in oracle.plan["groups"]] == [
        (g.kind, g.block_size) for g in alloc.plan.groups
    ]
    if not caching:
        wl = pd.DataFrame({
            "request_id": [r.rid for r in reqs],
            "arrival_s": [float(r.arrival_step) for r in reqs],
            "prompt_tokens": [len(r.prompt) for r in reqs],
            "output_tokens": [r.output_tokens for r in reqs],
        })
    cfg = EngineConfig(max_num_seqs=SEQS, max_num_batched_tokens=budget,
                       chunked_prefill=case.chunk is not None, async_scheduling=asynchronous,
                       step_time=StepTime(base_s=1.0))
    trace = Trace(alloc)
    ref = reference(wl, alloc, cfg, trace)
    return oracle, list(trace), ref, run(wl, hybrid(budget_bytes), cfg)


def first_divergence(oracle: Any, trace: list[dict], ref: dict,
                     compared: tuple[str, ...] = COMPARED) -> tuple[int, str | None]:
    """(iterations compared, None or where the first difference is)."""
    steps = {s["step"]: s for s in oracle.steps}
    ours = {}
    for it in trace:
        k = int(it["start"])
        assert it["start"] == k, "iterations take 1 s: each starts on a whole step"
        ours[k] = it
    for k in sorted(set(steps) | set(ours)):
        s, it = steps.get(k), ours.get(k)
        if it is None:  # kvfrag was idle: nothing to run
            if s is not None and (s["scheduled_tokens"] or s["running"]):
                return len(ours), f"step {k}: kvfrag idle, vLLM ran {s['scheduled_tokens']}"
            continue
        if s is None:
            return len(ours), f"step {k}: vLLM has no such step"
        mine = {c: it[c] for c in compared}
        theirs = {c: s[c] for c in compared}
        theirs["group_blocks"] = tuple(theirs["group_blocks"])
        if mine != theirs:
            diff = {c: (mine[c], theirs[c]) for c in compared if mine[c] != theirs[c]}
            return len(ours), f"step {k} (kvfrag, vLLM): {diff}"
    for rid, r in ref["requests"].items():
        v = oracle.requests[rid]
        got = (r["status"], int(r["first"]) - 1, int(r["finished"]) - 1, r["preemptions"])
        want = ("completed", v["first_token_step"], v["finished_step"], v["preemptions"])
        if got != want:
            return len(ours), f"request {rid} (status, first, finished, preemptions): {got} {want}"
    return len(ours), None


def gpt_oss() -> LayerStack:
    return shapes.gpt_oss(36)


# Pools of 300 block ids as in test_hybrid_scheduler_oracle.py's workloads; Gemma-3 in 2 GiB
# holds a 3,763-token prompt back at step 0 (the sliding groups' admission cap, summed over six
# groups, exceeds what is free) and in 4 GiB prefills whole prompts.

CASES = {
    "gpt-oss-120b-whole": Case(gpt_oss(), True, 300, None, 1600, 400),
    "gpt-oss-120b-chunked": Case(gpt_oss(), True, 300, 512, 1600, 400),
    "gpt-oss-120b-off-whole": Case(gpt_oss(), False, 300, None, 1600, 400),
    "gpt-oss-120b-off-chunked": Case(gpt_oss(), False, 300, 512, 1600, 400),
    "llama-4-scout-chunked": Case(shapes.llama_4_scout(), True, 5 * GiB // 2, 2048, 12000, 400),
    "llama-4-scout-off-chunked": Case(shapes.llama_4_scout(), False, 5 * GiB // 2, 2048, 12000,
                                      400),
    "deepseek-v3-whole": Case(shapes.deepseek_v3(), True, 300, None, 1600, 400),
    "deepseek-v3-chunked": Case(shapes.deepseek_v3(), True, 300, 512, 1600, 400),
    "gemma-3-27b-2gib-chunked": Case(shapes.gemma_3_27b(), True, 2 * GiB, 2048, 6000, 300),
    "gemma-3-27b-4gib-whole": Case(shapes.gemma_3_27b(), True, 4 * GiB, None, 6000, 300),
    # Mamba hybrids, mamba_cache_mode "none" (vLLM's mode without prefix caching): one state
    # block per request per Mamba group beside the full-attention blocks (Qwen3-Next: three
    # gated-delta-net groups, 544-token attention blocks; Jamba: seven Mamba 1 groups,
    # 80-token attention blocks).
    "qwen3-next-whole": Case(shapes.qwen3_next(), True, 40, None, 3000, 400),
    "qwen3-next-chunked": Case(shapes.qwen3_next(), True, 40, 512, 3000, 400),
    "jamba-1.5-mini-whole": Case(shapes.jamba_1_5_mini(), True, 150, None, 1600, 400),
    "jamba-1.5-mini-chunked": Case(shapes.jamba_1_5_mini(), True, 150, 512, 1600, 400),
    # Prefix caching (vLLM's default for these models): `shared`'s system prompts and repeated
    # questions, each request sampling tokens of its own. gpt-oss's 128-token window needs 8
    # contiguous cached blocks for a hit, Gemma-3's 1,024-token one 64; pools tight enough
    # to evict idle cached blocks by the thousand and to preempt.
    "gpt-oss-120b-prefix-whole": Case(gpt_oss(), True, 300, None, 480, 250, n=200,
                                      system_blocks=8),
    "gpt-oss-120b-prefix-chunked": Case(gpt_oss(), True, 300, 256, 480, 250, n=200,
                                        system_blocks=8),
    # vLLM's prefix_cache_retention_interval: a window's blocks kept every 64 tokens too, or
    # every block a hit can use (None).
    "gpt-oss-120b-prefix-retention-64-chunked": Case(gpt_oss(), True, 300, 256, 480, 250,
                                                     n=200, system_blocks=8, retention=64),
    "gpt-oss-120b-prefix-dense-whole": Case(gpt_oss(), True, 300, None, 480, 250, n=200,
                                            system_blocks=8, retention=None),
    "gemma-3-27b-prefix-whole": Case(shapes.gemma_3_27b(), True, 4 * GiB, None, 1200, 200,
                                     n=120, system_blocks=80),
    "gemma-3-27b-prefix-chunked": Case(shapes.gemma_3_27b(), True, 2 * GiB, 512, 1200, 200,
                                       n=120, system_blocks=80),
    # Llama-4's 8,192-token chunks: system prompts up to 9,600 tokens, so that hits start
    # past a chunk boundary (the chunks before are hit without a lookup).
    "llama-4-scout-prefix-chunked": Case(shapes.llama_4_scout(), True, 2 * GiB, 2048, 4000,
                                         300, n=60, system_blocks=600),
}
#: What prefix caching adds to every iteration's comparison.
PREFIX = ("prefix_hit_tokens", "evictions", "idle_cached_blocks")


@pytest.mark.parametrize("name", list(CASES))
def test_every_iteration_matches_vllm(name: str) -> None:
    case = CASES[name]
    oracle, trace, ref, fast = run_both(case)
    caching = case.system_blocks > 0
    compared, divergence = first_divergence(oracle, trace, ref,
                                            COMPARED + PREFIX if caching else COMPARED)
    assert divergence is None, divergence
    assert compared > 1000
    preempted = sum(s["preempted"] for s in oracle.steps)
    assert preempted > 0, "the pool should be tight"
    hits = sum(s["prefix_hit_tokens"] for s in oracle.steps)
    evictions = sum(s["evictions"] for s in oracle.steps)
    print(f"\n{name}: {compared} iterations compared, {preempted} preemptions, "
          f"{hits} prefix-hit tokens, {evictions} evictions")
    rows = fast.requests.set_index("request_id")
    for rid, r in ref["requests"].items():  # the fast engine: the reference's every request
        assert rows.loc[rid, "finished_s"] == r["finished"], rid
        assert rows.loc[rid, "preemptions"] == r["preemptions"], rid
    if caching:
        assert hits > 1000 and evictions > 1000
        for rid, r in ref["requests"].items():  # tokens found cached, resumptions included
            assert sum(r["hits"]) == oracle.requests[rid]["prefix_hit_tokens"], rid
        summary = fast.summary
        assert summary["prefill_tokens_skipped"] == hits
        assert summary["prefix_evictions"] == evictions
