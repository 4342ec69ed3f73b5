"""The hybrid allocator on a Mamba hybrid with prefix caching: vLLM's `mamba_cache_mode` "align"
(`sim.hybrid.caching`, `sim.hybrid.prefix`), rule by rule on a tiny model, and the fast engine
against the per-iteration reference on a shared-prefix workload. vLLM itself checks these
rules in tests/oracle/test_hybrid_mamba_align.py; here they hold without it."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim.allocators import Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.layers import FullAttention, LayerStack, MambaState, SlidingWindow
from kvfrag.sim.reference import reference

warnings.filterwarnings("ignore", message=".*pure-Python.*")

MML = 256
#: Three Mamba layers of 256 B of state beside one full-attention layer of 16 B per token:
#: the attention block grows to 16 tokens, whose page (256 B) holds a state.
STACK = LayerStack("mamba-like", (MambaState(256), MambaState(256), MambaState(256),
                                  FullAttention(1, 4, 2)))


def make(capacity: int = 10**6, stack: LayerStack = STACK, **opts):
    return make_allocator("hybrid", capacity=capacity, bytes_per_token=stack.full_bytes_per_token,
                          max_model_len=MML, stack=stack, block_size=16,
                          max_num_batched_tokens=MML, prefix_caching=True, **opts)


def req(rid: int, prompt: int, ids: list[int], output: int = 8) -> Request:
    return Request(rid, prompt, output, prefix=tuple(ids), prefix_tokens=16)


def test_plan_is_align_with_one_block_size():
    a = make()
    p = a.plan
    assert p.mamba_cache_mode == "align" and p.block_size == 16 and p.mamba_block_size == 16
    assert [g.kind for g in p.groups] == ["mamba", "mamba", "mamba", "full"]
    assert p.hash_block_size == p.scheduler_block_size == 16


def test_prefill_chunks_end_where_a_state_is_kept():
    """vLLM's `_mamba_block_aligned_split`: the last boundary before the last token, block
    boundaries inside the prefill, a sub-block chunk only when a block is wider than a chunk
    may be; 0 when no boundary is in reach. Other layouts keep their chunk."""
    a = make()
    r = req(0, 50, [1, 2, 3, 4])
    assert a.aligned_chunk(r, 0, 50, 50, MML) == 48  # the state after 48 tokens is kept
    assert a.aligned_chunk(r, 48, 2, 50, MML) == 2  # the prompt's end
    assert a.aligned_chunk(r, 0, 20, 50, MML) == 16  # a chunk inside the prefill: aligned
    assert a.aligned_chunk(r, 16, 4, 50, MML) == 0  # no boundary in reach: not this step
    assert a.aligned_chunk(r, 0, 8, 50, 8) == 8  # a 16-token block, chunks of 8 at most
    assert a.aligned_chunk(r, 8, 30, 50, 8) == 8  # from inside a block: to its end
    resumed = a.aligned_chunk(r, 0, 60, 60, MML)  # resumed with 10 tokens generated
    assert resumed == 48
    assert a.aligned_chunk(r, 48, 12, 60, MML) == 12  # (no boundary left before token 60)
    assert a.aligned_chunk(r, 32, 28, 60, MML) == 16  # one more block: to its boundary
    plain = make(stack=LayerStack("sf", (SlidingWindow(1, 4, 2, window=32),
                                         FullAttention(1, 4, 2))))
    assert plain.aligned_chunk(r, 0, 20, 50, MML) == 20


def test_a_mamba_group_holds_its_state_and_the_previous_one_for_a_step():
    a = make()
    assert a.admit(req(0, 50, [1, 2, 3, 4]), 48, decoding=False)
    assert a.group_blocks() == (1, 1, 1, 3)  # one state block (index 2) per Mamba group
    assert a.group_tables(0)[0] == (0, 0, a.group_tables(0)[0][2])
    assert a.grow(0, 2)  # 48 -> 50 enters block 3: a new state block, the old one kept
    assert a.group_blocks() == (2, 2, 2, 4)
    a.set_decoding(0, True)
    assert a.step(1)  # 50 processed: the old state block goes (it was cached: idle)
    assert a.group_blocks() == (1, 1, 1, 4)
    assert a.idle_cached_blocks() == 3  # the states after 48 tokens, kept for a hit


def test_a_hit_finds_the_state_at_the_replay_boundary_and_waits_a_step_if_it_is_new():
    """The first request caches its state after 48 tokens (its replay boundary: 49 aligned
    down); a repeat of its prompt hits 48 tokens, but not in the step that cached it."""
    a = make()
    first = req(0, 50, [1, 2, 3, 4])
    assert a.admit(first, 48, decoding=False)
    again = req(1, 50, [1, 2, 3, 4])
    hit = a.cached_prefix_tokens(again, 50)
    assert hit == 48
    frees = a.frees
    assert a.admission_bytes(again, 50, hit) > a.free_bytes()  # cached in this step: wait
    assert a.steps_until_shrink() == 1
    assert a.grow(0, 2)  # the next step
    assert a.frees > frees  # (the engine's FCFS head may try again)
    assert a.admission_bytes(again, 50, hit) <= a.free_bytes()
    assert a.admit(again, 50, decoding=False)
    # the hit's state block (shared with nobody now: the first request moved on) and a new one
    assert [len([b for b in t if b]) for t in a.group_tables(1)] == [2, 2, 2, 4]
    # a prompt that shares only its first block finds no state (none kept at 16 tokens)
    assert a.cached_prefix_tokens(req(2, 50, [1, 9, 9, 9]), 50) == 0


def shared(seed: int, n: int) -> pd.DataFrame:
    """Prompts behind one of three system prompts (1 to 4 blocks), half of them repeated."""
    rng = np.random.default_rng(seed)
    systems = [int(b) for b in rng.integers(1, 5, 3)]
    rows, fresh, asked = [], 1000, []
    for rid in range(n):
        if asked and rng.random() < 0.5:
            ids, prompt = asked[int(rng.integers(len(asked)))]
        else:
            g = int(rng.integers(3))
            own = int(rng.integers(1, 80))
            ids = [100 * g + c for c in range(systems[g])] + list(
                range(fresh, fresh + -(-own // 16)))
            fresh += -(-own // 16)
            prompt = 16 * systems[g] + own
            asked.append((ids, prompt))
        rows.append((rid, float(rid // 3), prompt, int(rng.integers(2, 40)), ids))
    wl = pd.DataFrame(rows, columns=["request_id", "arrival_s", "prompt_tokens",
                                     "output_tokens", "hash_ids"])
    wl.attrs["hash_block_tokens"] = 16
    return wl


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("budget", [32, MML])
def test_fast_engine_matches_per_iteration_reference(seed, budget):
    """A pool of 40 block ids (preemptions), chunks of 32 tokens or whole prompts: the fast
    engine finishes every request when the reference does, with its hits; the reference
    checks the accounting identity at every iteration."""
    wl = shared(seed, 40)
    page = make().page
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=budget, chunked_prefill=True,
                       step_time=StepTime(base_s=1.0))
    ref = reference(wl, make(41 * page), cfg)
    fast = run(wl, make(41 * page), cfg)
    rows = fast.requests.set_index("request_id")
    assert sum(sum(r["hits"]) for r in ref["requests"].values()) > 0
    assert sum(r["preemptions"] for r in ref["requests"].values()) > 0
    for rid, r in ref["requests"].items():
        assert r["status"] == "completed", rid
        assert rows.loc[rid, "finished_s"] == r["finished"], rid
        assert rows.loc[rid, "preemptions"] == r["preemptions"], rid
    assert fast.summary["prefill_tokens_skipped"] == sum(
        sum(r["hits"]) for r in ref["requests"].values())
