"""The order within a step: where a prompt partway through its prefill runs ahead of a decoder
in admission order, the engine walks its running requests in that order, as vLLM does (each
takes its token or its chunk and its blocks in turn; a decoder past the token budget takes no
token that step). The fast engine is held to the per-iteration reference where the walk runs
(tests/oracle/test_hybrid_mamba_align.py and test_vllm_match.py hold both to vLLM)."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from runpy import run_path

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.layers import FullAttention, LayerStack, MambaState
from kvfrag.sim.reference import reference

warnings.filterwarnings("ignore", message=".*pure-Python.*")

#: The fast engine held to the reference, request by request (tests/sim/agreement.py).
AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]
MML = 512
MAMBA = LayerStack("mamba-200", (*(MambaState(200),) * 3, FullAttention(1, 4, 2)))


def workload(seed: int, n: int, hashed: int) -> pd.DataFrame:
    """Prompts of 40-400 tokens arriving 0.05 s apart on average, outputs of 2-60; prefix
    ids per `hashed`-token chunk from a small alphabet (shared prefixes)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(40, 400, n)
    df = pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.cumsum(rng.exponential(0.05, n)),
        "prompt_tokens": prompts,
        "output_tokens": rng.integers(2, 60, n),
        "hash_ids": [[int(h) for h in rng.integers(0, 2, -(-int(p) // hashed))]
                     for p in prompts],
    })
    df.attrs["hash_block_tokens"] = hashed
    return df


def allocator(kind: str, budget: int):
    if kind == "mamba-align":  # prefix caching: Mamba "align", chunks end on block boundaries
        return make_allocator("hybrid", capacity=16 * 1024,
                              bytes_per_token=MAMBA.full_bytes_per_token, max_model_len=MML,
                              stack=MAMBA, block_size=32, max_num_batched_tokens=budget,
                              prefix_caching=True)
    return make_allocator(kind, capacity=60 * 16 * 64, bytes_per_token=64, max_model_len=MML,
                          block_size=16)


def config(budget: int, cap: int = 0, asynchronous: bool = True) -> EngineConfig:
    return EngineConfig(max_num_seqs=12, max_num_batched_tokens=budget, chunked_prefill=True,
                        long_prefill_token_threshold=cap, async_scheduling=asynchronous,
                        step_time=StepTime(0.05, 1e-3, 1e-4))


#: (allocator, config, prefix ids' chunk tokens, seed, a decoder left without a token?)
CASES = {
    # several prompts partway at once through the long-prefill cap
    "paged-threshold": ("paged", config(96, 32), 8, 0, False),
    "paged-threshold-sync": ("paged", config(96, 32, False), 8, 0, False),
    "prefix-caching-threshold": ("prefix-caching", config(64, 32), 16, 0, False),
    # Mamba align (synchronous): chunks clipped to 32-token blocks leave budget for later
    # admissions, and a chunk ahead of the decoders can take the whole budget
    "mamba-align": ("mamba-align", config(64), 32, 1, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_walk_in_admission_order_matches_the_reference(name):
    kind, cfg, hashed, seed, tokenless = CASES[name]
    wl = workload(seed, 60, hashed)
    budget = cfg.max_num_batched_tokens
    fast = run(wl, allocator(kind, budget), cfg)
    trace: list[dict] = []
    slow = reference(wl, allocator(kind, budget), cfg, trace)
    # per walk, the decoding sequences left without a token (the reference's record: the
    # fast engine, compiled, cannot be watched from outside; it equals the reference below)
    walks = [it["tokenless"] for it in trace if it["walked"]]
    print(f"\n{name}: {len(walks)} walks, {sum(1 for w in walks if w)} with decoders "
          f"left without a token, {fast.summary['preemptions']} preemptions")
    assert walks and fast.summary["preemptions"] > 0
    assert any(walks) == tokenless
    AGREE(fast, slow)


@pytest.mark.parametrize(
    ("kind", "cap", "hashed", "seed", "asynchronous"),
    [("paged", 32, 8, 0, False), ("prefix-caching", 16, 16, 1, True)],
    ids=["paged-sync", "prefix-caching-async"],
)
def test_walk_under_priority_matches_the_reference(kind, cap, hashed, seed, asynchronous):
    """Policy priority walks the running list too (vLLM's order): a shortage preempts the
    victim by priority, and one scheduled earlier in the walk gives its token or chunk back
    (tests/oracle/test_priority_match.py holds both engines to vLLM)."""
    budget = 96 if kind == "paged" else 64
    cfg = replace(config(budget, cap, asynchronous), policy="priority")
    wl = workload(seed, 60, hashed)
    wl["priority"] = np.random.default_rng(seed).integers(0, 3, len(wl))
    fast = run(wl, allocator(kind, budget), cfg)
    trace: list[dict] = []
    slow = reference(wl, allocator(kind, budget), cfg, trace)
    assert sum(it["given_back"] for it in trace) and fast.summary["preemptions"] > 0
    AGREE(fast, slow)
