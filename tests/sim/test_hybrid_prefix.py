"""The hybrid allocator with prefix caching (`sim.hybrid.caching`, vLLM's block pool): hits
agreed across kinds (a sliding window's contiguous blocks, a shared-prefix junction pinned so
that the next sibling hits), hit blocks nobody holds revived and counted against the free
blocks, idle cached blocks evicted least recently freed first (a table's tail first), and the
fast engine against the per-iteration reference on shared-prefix workloads (its look-ahead
and integrals; the reference checks the accounting identity at every iteration)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.layers import MLA, ChunkedLocal, FullAttention, LayerStack, SlidingWindow
from kvfrag.sim.reference import reference

warnings.filterwarnings("ignore", message=".*pure-Python.*")

BS = 8  # tokens per block, and per hashed chunk of the prompts
MML = 256


def _stack(name: str, pattern: str, window: int = 32) -> LayerStack:
    """s: sliding (window `window`), f: full, c: chunked (chunk 24), m: MLA; tiny heads."""
    kinds = {
        "s": SlidingWindow(1, 4, 2, window=window),
        "f": FullAttention(1, 4, 2),
        "c": ChunkedLocal(1, 4, 2, chunk=24),
        "m": MLA(6, 2, 2),
    }
    return LayerStack(name, tuple(kinds[ch] for ch in pattern))


STACKS = [
    _stack("ssf", "ssf"),  # sliding window 32: a hit needs 4 contiguous cached blocks of 8
    _stack("gemma-like", "sssssf", window=21),  # padding layers, a window off the block grid
    _stack("gpt-oss-like", "sfsf", window=6),  # a window under a block
    _stack("llama4-like", "cccf"),
    _stack("mla", "mmm"),
]


def make(stack: LayerStack, capacity: int, bs: int = BS, tokens: int = MML,
         retention: int | None = 0):
    return make_allocator("hybrid", capacity=capacity, bytes_per_token=stack.full_bytes_per_token,
                          max_model_len=MML, stack=stack, block_size=bs,
                          max_num_batched_tokens=tokens, prefix_caching=True,
                          prefix_cache_retention_interval=retention)


def req(rid: int, prompt: int, ids: list[int], output: int = 4) -> Request:
    return Request(rid, prompt, output, prefix=tuple(ids), prefix_tokens=BS)


def groups(a, kind: str) -> int:
    return sum(g.kind == kind for g in a.plan.groups)


def test_a_sliding_hit_needs_the_windows_blocks_and_a_junction_is_pinned():
    """Window 32 over blocks of 8: a hit needs 4 contiguous cached blocks ending at it. A
    prompt caches them only before its replay boundary (its length less one, aligned down),
    so a sibling sharing a shorter prefix misses, and pins that junction for the next one."""
    a = make(STACKS[0], 10**6)
    full, sliding = groups(a, "full"), groups(a, "sliding_window")
    first = req(0, 80, list(range(1, 11)))
    assert a.cached_prefix_tokens(first, 80) == 0
    assert a.admit(first, 80)
    a.free(0)
    # Full groups cache all 10 blocks; sliding ones the 4 before block 9 (tokens 72-79).
    assert a.idle_cached_blocks() == 10 * full + 4 * sliding
    again = req(1, 80, list(range(1, 11)))
    assert a.cached_prefix_tokens(again, 80) == 72  # (capped at 79 tokens: 9 whole blocks)
    sibling = req(2, 80, [*range(1, 7), 20, 21, 22, 23])
    # Full attention has the 6 shared blocks, the sliding window only block 5 of them.
    assert a.cached_prefix_tokens(sibling, 80) == 0
    assert a.admit(sibling, 80)
    a.free(2)
    third = req(3, 80, [*range(1, 7), 30, 31, 32, 33])
    assert a.cached_prefix_tokens(third, 80) == 48  # blocks 2-5 kept at the junction
    assert a.admit(third, 80)
    # Its sliding tables start past the window of the hit: blocks 0-1 are never taken.
    assert a.blocks_of(3) == 10 * full + 8 * sliding
    assert [t.count(0) for t in a.group_tables(3)] == [
        2 if g.kind == "sliding_window" else 0 for g in a.plan.groups]


def test_chunks_before_the_lookups_chunk_hit_without_a_lookup():
    """Chunked local attention (chunk 24, blocks of 8): the chunks before the one of the
    lookup's length are read by no layer, so they hit as null blocks, and only the blocks
    of that chunk are looked up; full attention bounds the hit."""
    a = make(STACKS[3], 10**6)
    first = req(0, 64, list(range(1, 9)))
    assert a.admit(first, 64)
    a.free(0)
    assert a.cached_prefix_tokens(req(1, 64, list(range(1, 9))), 64) == 56
    # A different prompt: full attention finds nothing, so nothing is hit.
    assert a.cached_prefix_tokens(req(2, 64, list(range(50, 58))), 64) == 0


def test_idle_hit_blocks_are_revived_and_counted_against_the_free_blocks():
    """A hit block another request holds costs nothing; one nobody holds is taken off the
    free queue, so the admission gate counts it as vLLM does."""
    a = make(STACKS[4], 10**6)
    n = len(a.plan.groups)
    tail = (a.capacity - a.num_blocks * a.page) // a.page
    assert a.admit(req(0, 32, [1, 2, 3, 4]), 32)
    twin = req(1, 32, [1, 2, 3, 4])
    hit = a.cached_prefix_tokens(twin, 32)
    assert hit == 24
    assert a.admission_bytes(twin, 32, hit) == (1 * n + tail) * a.page  # 3 held by request 0
    a.free(0)
    hit = a.cached_prefix_tokens(twin, 32)
    assert a.admission_bytes(twin, 32, hit) == (4 * n + tail) * a.page  # 3 of them revived
    free = a.free_blocks()
    assert a.admit(twin, 32)
    assert a.free_blocks() == free - 4 * n
    assert a.idle_cached_blocks() == n  # block 3 of request 0: a copy of twin's own


def test_idle_cached_blocks_are_evicted_least_recently_freed_first():
    """Blocks nobody caches are reused first; then the idle cached ones go, each freed
    table's tail before its head, earlier frees before later ones."""
    stack = STACKS[4]
    probe = make(stack, 10**6)
    n = len(probe.plan.groups)
    a = make(stack, (probe.plan.max_request_blocks + 1) * probe.page)
    assert a.admit(req(0, 32, [1, 2, 3, 4]), 32)
    first = a.group_tables(0)
    a.free(0)
    assert a.admit(req(1, 32, [5, 6, 7, 8]), 32)
    second = a.group_tables(1)
    a.free(1)
    assert a.idle_cached_blocks() == 8 * n
    a.take_evictions()
    unused = a.free_blocks() - a.idle_cached_blocks()
    take = unused + 6 * n  # all of the first's blocks, then two of the second's per group
    assert a.admit(Request(2, take // n * BS, 4), take // n * BS)
    evicted = a.take_evictions()
    assert a.evictions == len(evicted) == 6 * n
    freed_order = [b for t in first for b in reversed(t)] + [b for t in second for b in
                                                              reversed(t)]
    assert evicted == freed_order[: 6 * n]


def shared(seed: int, n: int, max_question: int, max_output: int) -> pd.DataFrame:
    """Requests behind one of three system prompts of 1 to 6 blocks, with a question of 1 to
    `max_question` tokens, a quarter asking an earlier prompt again; hash ids per block."""
    rng = np.random.default_rng(seed)
    systems = [int(b) * BS for b in rng.integers(1, 7, 3)]
    asked: list[tuple[list[int], int]] = []
    hashes, prompts, fresh = [], [], 1000
    for _ in range(n):
        if asked and rng.random() < 0.25:
            ids, prompt = asked[int(rng.integers(len(asked)))]
        else:
            g = int(rng.integers(3))
            mine = int(rng.integers(1, max_question + 1))
            own = -(-mine // BS)
            ids = [100 * g + c for c in range(systems[g] // BS)] + list(range(fresh, fresh + own))
            fresh += own
            prompt = systems[g] + mine
            asked.append((ids, prompt))
        hashes.append(ids)
        prompts.append(prompt)
    wl = pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.sort(rng.uniform(0, n / 4, n)),
        "prompt_tokens": prompts,
        "output_tokens": rng.integers(1, max_output + 1, n),
        "hash_ids": hashes,
    })
    wl.attrs["hash_block_tokens"] = BS
    return wl


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(STACKS))),
    n=st.integers(2, 25),
    extra_blocks=st.sampled_from([0, 2, 5, 10, 20, 60]),  # small pools: evictions, preemptions
    chunked=st.booleans(),
    timing=st.sampled_from(["flat", "linear"]),
    retention=st.sampled_from([0, 0, None, 16]),
)
def test_fast_engine_matches_per_iteration_reference_with_prefix_caching(
    seed, which, n, extra_blocks, chunked, timing, retention,
):
    stack = STACKS[which]
    tokens = 40 if chunked else MML
    if not any(isinstance(layer, SlidingWindow) for layer in stack.layers):
        retention = 0  # (it applies to sliding windows only: refused elsewhere)
    probe = make(stack, 10**9, tokens=tokens)
    capacity = (probe.plan.max_request_blocks + 1 + extra_blocks) * probe.page + 37

    def fresh():
        return make(stack, capacity, tokens=tokens, retention=retention)

    wl = shared(seed, n, 100, 60)
    step = {"flat": StepTime(0.05), "linear": StepTime(0.05, 1e-3, 1e-4)}
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=tokens, chunked_prefill=chunked,
                       step_time=step[timing])
    fast = run(wl, fresh(), cfg)
    trace: list[dict] = []
    slow = reference(wl, fresh(), cfg, trace)
    rows = fast.requests.set_index("request_id")
    for rid, r in slow["requests"].items():
        row = rows.loc[rid]
        assert row["status"] == r["status"], rid
        assert row["preemptions"] == r["preemptions"], rid
        assert row["peak_bytes"] == r["peak"], rid
        for col, key in (("first_token_s", "first"), ("finished_s", "finished")):
            if math.isnan(r[key]):
                assert math.isnan(row[col]), (rid, col)
            else:
                assert row[col] == pytest.approx(r[key], rel=1e-9, abs=1e-9), (rid, col)
    s = fast.summary
    assert s["prefill_tokens_skipped"] == sum(x["prefix_hit_tokens"] for x in trace)
    assert s["prefix_evictions"] == sum(x["evictions"] for x in trace)
    assert s["sim_time_s"] == pytest.approx(slow["time"], rel=1e-9)
    for p in PARTS:
        assert s[f"{p}_frac"] == pytest.approx(slow["fractions"][p], rel=1e-7, abs=1e-9), p


def test_retention_interval_keeps_more_of_a_windows_blocks():
    """vLLM's `prefix_cache_retention_interval`: None keeps every block a hit can use, so the
    first sibling sharing a shorter prefix hits already; 0 (the default) does not (above)."""
    a = make_allocator("hybrid", capacity=10**6, bytes_per_token=STACKS[0].full_bytes_per_token,
                       max_model_len=MML, stack=STACKS[0], block_size=BS, prefix_caching=True,
                       prefix_cache_retention_interval=None)
    assert a.admit(req(0, 80, list(range(1, 11))), 80)
    a.free(0)
    full, sliding = groups(a, "full"), groups(a, "sliding_window")
    assert a.idle_cached_blocks() == 10 * full + 10 * sliding
    assert a.cached_prefix_tokens(req(1, 80, [*range(1, 7), 20, 21, 22, 23]), 80) == 48


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("option", "said"), [
    ("prefix_caching: 1", "prefix_caching must be true or false, not 1"),
    ("prefix_caching: true, prefix_cache_retention_interval: -16",
     "prefix_cache_retention_interval must be a whole number from 0 to"),
    ("prefix_caching: true, prefix_cache_retention_interval: 24",
     "prefix_cache_retention_interval (24) must be a multiple of the scheduler block size"),
    ("prefix_cache_retention_interval: 64",
     "prefix_cache_retention_interval needs prefix_caching true"),
])
def test_bad_prefix_caching_options_are_one_line(capsys, tmp_path, option, said):
    from kvfrag.cli import main

    out = tmp_path / "out"
    code = main(["run", str(ROOT / "scenarios" / "gpt-oss-120b-h100.yaml"), "--set",
                 f"allocators=[{{label: a, kind: hybrid, {option}}}]", "--set",
                 "workload.transforms.first_n=5", "-o", str(out), "-q", "--no-plots"])
    lines = capsys.readouterr().err.splitlines()
    lines = [x for x in lines if "UserWarning" not in x and "import" not in x]
    assert code == 2 and len(lines) == 1, lines
    assert "allocator 'a'" in lines[0] and said in lines[0], lines[0]
    assert not out.exists()
