"""Prefix caching: hits on a hand-built trace, reference counts, LRU eviction, the identity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig
from kvfrag.workloads import load_trace, samples

B = 8


def cache(blocks: int, bs: int = 16):
    return make_allocator(
        "prefix-caching",
        capacity=(blocks + 1) * bs * B,  # `blocks` blocks and the null block
        bytes_per_token=B,
        max_model_len=4096,
        block_size=bs,
    )


def req(
    rid: int, prompt: int, chain: tuple[int, ...], output: int = 10, chunk: int = 32,
    n: int = 1, beam: bool = False,
):
    return Request(rid, prompt, output, n=n, beam=beam, prefix=chain, prefix_tokens=chunk)


def kept(r: Request, tokens: int, bs: int) -> int:
    """Blocks a group keeps once for its n sequences: the prompt's full blocks (samples), the
    trunk of full blocks (beams); none while its prompt is prefilled (one sequence)."""
    if r.n == 1 or tokens <= r.prompt:
        return 0
    return tokens // bs if r.beam else r.prompt // bs


def own_blocks(a, r: Request, tokens: int) -> int:
    """Closed form of the blocks a request holds besides its cached prompt blocks: its
    sequences' blocks, the kept ones once, less the cached ones (counted by the cache)."""
    bs = a.block_size
    n = r.n if tokens > r.prompt else 1
    return n * -(-tokens // bs) - (n - 1) * kept(r, tokens, bs) - len(a._held.get(r.rid, ()))


def check_blocks(a, live: dict[int, Request]) -> None:
    """The identity, reference counts, the closed-form block count, and block ids: each
    sequence's table starts with its request's cached blocks and holds its tokens; a block of
    a request's own is nobody else's; distinct ids are the counted blocks; every cached block
    is listed once under its key (duplicates under one key allowed); named, cached and free ids
    never overlap and cover the pool."""
    a.account().check()
    bs = a.block_size
    assert all(users > 0 for users in a._refs.values())
    assert not set(a._refs) & set(a._idle)
    held = {b for r in live for b in a._held.get(r, ())}
    assert held == set(a._refs)
    for r in live:  # the refs count each request (group) once
        assert len(set(a._held.get(r, ()))) == len(a._held.get(r, ()))
    assert all(a._refs[b] == sum(b in a._held.get(r, ()) for r in live) for b in a._refs)
    own = {r: own_blocks(a, q, a.tokens(r)) for r, q in live.items()}
    assert a.usable_blocks - a.free_blocks() == sum(own.values()) + len(a._refs)
    assert sum(own.values()) + len(a._refs) + len(a._idle) <= a.usable_blocks
    saved = sum((q.n - 1) * kept(q, a.tokens(r), bs) for r, q in live.items())
    saved += sum(users - 1 for users in a._refs.values())
    assert a.saved_by_sharing() == saved * a.block_bytes
    private = []
    for r, q in live.items():
        cached = list(a._held.get(r, ()))
        tables = a.block_tables(r)
        assert len(tables) == (q.n if a.tokens(r) > q.prompt else 1)
        for t in tables:
            assert list(t[: len(cached)]) == cached
            assert len(t) == -(-a.tokens(r) // bs) == len(set(t))
        mine = {b for t in tables for b in t} - set(cached)
        assert len(mine) == own[r]
        assert list(a.block_table(r)) == cached + sorted(mine, key=a.block_table(r).index)
        private += mine
    assert set(a._key) == set(a._refs) | set(a._idle)
    listed = [b for ids in a._cached.values() for b in ids]
    assert sorted(listed) == sorted(a._key) and all(ids for ids in a._cached.values())
    assert all(a._key[b] == key for key, ids in a._cached.items() for b in ids)
    ids = private + list(a._key) + a._stack
    assert sorted(ids) == list(range(1, a.num_blocks))  # (block 0: the null block)


def cache_state(a) -> tuple:
    """What is cached, by key (ids aside): users of the blocks in use, idle ones in LRU order."""
    return sorted((a._key[b], users) for b, users in a._refs.items()), [a._key[b] for b in a._idle]


def test_hits_on_a_hand_built_trace():
    a = cache(100)
    # Chunks of 32 tokens; blocks of 16. Request 1 shares its first two chunks with request 0.
    assert a.admit(req(0, 100, (1, 2, 3, 4)), 101)
    assert a.cached_prefix_tokens(req(1, 90, (1, 2, 7))) == 64  # blocks 0-3
    assert a.admit(req(1, 90, (1, 2, 7)), 91)
    # Same prompt again: all full blocks but the one holding the last prompt token.
    assert a.cached_prefix_tokens(req(2, 100, (1, 2, 3, 4))) == 96
    # A different first chunk shares nothing.
    assert a.cached_prefix_tokens(req(3, 100, (9, 2, 3, 4))) == 0
    stats = a.summary_stats()
    assert stats["prefix_lookup_blocks"] == 6 + 5 and stats["prefix_hit_blocks"] == 4
    assert a.saved_by_sharing() == 4 * 16 * B


@pytest.mark.parametrize("beam", [False, True])
def test_groups_hit_as_single_requests_and_count_by_closed_form(beam):
    a = cache(100)
    live: dict[int, Request] = {}
    # The trace of test_hits_on_a_hand_built_trace, each request a group of 3 sequences.
    for r in (req(0, 100, (1, 2, 3, 4), output=40, n=3, beam=beam),
              req(1, 90, (1, 2, 7), output=40, n=3, beam=beam)):
        assert a.admit(r, r.prompt + 1)
        live[r.rid] = r
        check_blocks(a, live)
    stats = a.summary_stats()
    assert stats["prefix_lookup_blocks"] == 6 + 5 and stats["prefix_hit_blocks"] == 4
    # Request 0 caches its 6 full prompt blocks, request 1 shares 4 of them and caches 1.
    assert len(a._refs) == 7 and sorted(a._refs.values()) == [1] * 3 + [2] * 4
    # Samples: 3 sequences past the prompt's 6 (5) full blocks; beams: the same at the fork.
    assert a.free_blocks() == 100 - 7 - 3 - 3
    tables = a.block_tables(0)
    assert len({t[6] for t in tables}) == 3  # the partial prompt block, copied on write
    copies = a.take_copies()
    assert sorted(rid for rid, _, _ in copies) == [0, 0, 1, 1]
    assert all(src == a.block_tables(rid)[0][live[rid].prompt // 16] for rid, src, _ in copies)
    for _ in range(39):
        assert a.step(1)
        check_blocks(a, live)
    # Request 0 stores 139 tokens a sequence: 8 full blocks and a partial one each.
    expect = 3 * 9 - 2 * (8 if beam else 6) - 6
    assert own_blocks(a, live[0], 139) == a.blocks_of(0) == expect
    a.free(0)
    live.pop(0)
    check_blocks(a, live)
    # Blocks 0-3 stay in use by request 1; request 0's own cached blocks 4, 5 are idle.
    assert sorted(a._refs.values()) == [1] * 5 and len(a._idle) == 2
    a.free(1)
    assert not a._refs and len(a._idle) == 7 and a.free_blocks() == 100
    assert a.account().token_states == 0 and a.saved_by_sharing() == 0


def test_a_free_keeps_blocks_others_hold_after_blocks_that_go():
    # A request's blocks others hold are as a rule a leading run of its table; duplicates
    # break the rule. Request 0 fills blocks 1-2 after request 1 cached them (its own copies,
    # younger: nobody finds them) and blocks 3-5 first, which request 2 then finds. Freeing
    # request 0 idles blocks 1-2 only: block 0 and blocks 3-5 stay in use.
    a = cache(40)
    live = {0: req(0, 100, (1, 2, 3, 4))}
    assert a.admit(live[0], 20, decoding=False)  # block 0 cached
    live[1] = req(1, 50, (1, 2))
    assert a.admit(live[1], 51)  # hits block 0, caches blocks 1-2
    assert a.grow(0, 81)  # blocks 1-2: duplicates; blocks 3-5: the first under their keys
    live[2] = req(2, 100, (1, 2, 3, 4))
    assert a.cached_prefix_tokens(live[2]) == 96
    assert a.admit(live[2], 101)  # finds block 0, request 1's 1-2, request 0's 3-5
    check_blocks(a, live)
    table = a.block_table(0)
    a.free(0)
    live.pop(0)
    check_blocks(a, live)
    assert list(a._idle) == [table[2], table[1]]  # (least recently freed first)
    assert set(table[3:6]) <= set(a._refs) and a._refs[table[0]] == 2
    a.free(2)
    live.pop(2)
    check_blocks(a, live)
    a.free(1)
    assert not a._refs and len(a._idle) == 8 and a.free_blocks() == 40  # 6 + 2 duplicates
    assert a.cached_prefix_tokens(req(3, 100, (1, 2, 3, 4))) == 96


@pytest.mark.parametrize("beam", [False, True])
def test_a_prefilling_group_keeps_its_blocks_when_the_same_tokens_were_cached_meanwhile(beam):
    # Block tables are append-only (vLLM): a block a request fills is its own and joins the
    # cache even when the same tokens were cached since its admission; both stay cached under
    # the key (duplicates). (kvfrag used to give its own block back and share the cached one.)
    a = cache(40)
    live = {0: req(0, 100, (1, 2, 3, 4), output=30, n=3, beam=beam)}
    assert a.admit(live[0], 20, decoding=False)  # one sequence; block 0 cached
    check_blocks(a, live)
    mine = a.block_table(0)[1]  # its own partial block 1
    live[1] = req(1, 100, (1, 2, 3, 4), output=5)
    assert a.admit(live[1], 100)  # hits block 0, caches blocks 1-5 under its own ids
    check_blocks(a, live)
    assert a.block_table(1)[0] == a.block_table(0)[0] and mine not in a.block_table(1)
    assert a.grow(0, 81)  # its blocks 1-5 join the cache too: duplicates of request 1's
    assert a.tokens(0) == 101 and a.block_table(0)[1] == mine != a.block_table(1)[1]
    assert not set(a.block_table(0)[1:6]) & set(a.block_table(1)[1:6])
    check_blocks(a, live)
    assert sorted(a._refs.values()) == [1] * 10 + [2]
    assert sorted(len(ids) for ids in a._cached.values()) == [1] + [2] * 5
    a.set_decoding(0, True)
    while a.tokens(1) < a.final_tokens(1):
        assert a.step(1)
        check_blocks(a, live)
    a.free(1)
    live.pop(1)
    check_blocks(a, live)
    # Request 1's blocks 1-5 are idle; block 0 and the group's 1-5 still in use.
    assert sorted(a._refs.values()) == [1] * 6 and len(a._idle) == 5
    # A lookup finds the oldest block under a key: request 1's idle ones.
    assert a._cached[a._keys_of[0][1]][0] == list(a._idle)[-1]
    while a.tokens(0) < a.final_tokens(0):
        assert a.step(1)
        check_blocks(a, live)
    a.free(0)
    assert len(a._idle) == 11 and a.free_blocks() == 40


@pytest.mark.parametrize("at_once", [False, True])
def test_beams_evict_idle_blocks_at_their_peak(at_once):
    a = cache(20, bs=4)
    assert a.admit(req(0, 16, (1, 2), chunk=8), 17, decoding=False)
    a.free(0)  # 4 idle cached blocks
    assert a.admit(Request(1, 48, 10), 48, decoding=False)  # 12 blocks
    beams = Request(2, 7, 20, n=3, beam=True)
    assert a.admit(beams, 8)  # one trunk of 2 full blocks: 2 blocks
    assert a.free_blocks() == 6 and len(a._idle) == 4 and a.steps_until_evict() == 1
    # From 8 to 12 tokens the beams hold 5, 5, 5, then 3 blocks (pruned at the boundary):
    # 3 more than the 2 blocks neither used nor idle, so one idle block goes, stepped at once
    # or one step at a time.
    if at_once:
        assert a.step(4)
    else:
        assert all(a.step(1) for _ in range(4))
    assert a.evictions == 1 and len(a._idle) == 3 and a.free_blocks() == 20 - 12 - 3
    a.account().check()


def test_shared_blocks_are_freed_by_their_last_user_and_then_evicted_lru():
    a = cache(12)
    a.admit(req(0, 64, (1, 2)), 64)  # 4 cached blocks
    # The same prompt hits 3 blocks (its last token is computed): it recomputes the 4th into
    # a fresh block, a duplicate of request 0's, as vLLM does (block tables are append-only).
    assert a.cached_prefix_tokens(req(1, 64, (1, 2))) == 48
    a.admit(req(1, 64, (1, 2)), 64)
    assert a.free_blocks() == 12 - 4 - 1
    a.free(0)
    assert a.free_blocks() == 12 - 4  # blocks 0-2 and its own 4th still used by request 1
    assert a.idle_cached_blocks() == 1
    a.free(1)
    assert a.free_blocks() == 12 and a.idle_cached_blocks() == 5  # idle ones count as free...
    assert a.cached_prefix_tokens(req(2, 64, (1, 2))) == 48  # ...and still hit
    # A resumed request (65 tokens to prefill) may find all 4.
    assert a.cached_prefix_tokens(req(2, 64, (1, 2)), 65) == 64
    # A request with other content needing 10 blocks evicts 3 idle ones, least recently freed
    # first: request 0's 4th block, then request 1's blocks last first (4th, 3rd).
    a.admit(Request(3, 150, 10), 150)
    assert a.summary_stats()["prefix_evictions"] == 3
    assert a.cached_prefix_tokens(req(2, 64, (1, 2))) == 32
    a.account().check()


@settings(max_examples=150, deadline=None)
@given(
    bs=st.sampled_from([4, 16, 32]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "step", "free"]),
            st.integers(1, 120),
            st.lists(st.integers(0, 2), min_size=0, max_size=5),
            st.integers(0, 7),
            st.sampled_from([(1, False), (1, False), (3, False), (2, True), (3, True)]),
        ),
        max_size=40,
    ),
)
def test_identity_refcounts_and_no_leaks(bs, ops):
    """Random operations on single requests, sample groups and beams: after each, the
    identity, reference counts, closed-form block counts and block ids hold (`check_blocks`),
    and a twin that takes every step one at a time has evicted the same idle blocks (beams
    give blocks back at boundaries: a stretch of steps evicts at its peak)."""
    a, twin = cache(40, bs), cache(40, bs)
    live: dict[int, Request] = {}
    rid = 0
    for op, size, chain, pick, (n, beam) in ops:
        if op == "admit":
            r = req(rid, size, tuple(chain), output=20, chunk=8, n=n, beam=beam)
            rid += 1
            decoding = pick % 2 == 0
            # A group decodes once it forks (prompt + 1); else it may be mid-prefill.
            tokens = size + 1 if decoding and n > 1 else min(size, r.final)
            if pick % 4 == 1:
                tokens = max(1, size // 2)
            if a.admit(r, tokens, decoding=decoding):
                live[r.rid] = r
            assert bool(twin.admit(r, tokens, decoding=decoding)) == (r.rid in live)
        elif op == "grow" and live:
            target = sorted(live)[pick % len(live)]
            left = a.final_tokens(target) - a.tokens(target)
            if left:
                assert bool(a.grow(target, min(left, 1 + pick))) == bool(
                    twin.grow(target, min(left, 1 + pick))
                )
        elif op == "step":
            done, full = a.steps_until_done(), a.steps_until_full()
            k = min(x for x in (pick + 1, done, full) if x is not None)
            if k:
                assert a.step(k)
                assert all(twin.step(1) for _ in range(k))
        elif op == "free" and live:
            gone = live.pop(sorted(live)[pick % len(live)]).rid
            a.free(gone)
            twin.free(gone)
        check_blocks(a, live)
        # Block ids differ (the twin names none: check_blocks names a's), the cache does not.
        assert cache_state(a) == cache_state(twin) and a.evictions == twin.evictions
        assert a.parts() == twin.parts()
    for r in list(live):
        a.free(r)
    assert a.free_blocks() == a.usable_blocks and not a._refs
    assert a.account().token_states == 0 and a.saved_by_sharing() == 0


SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def mooncake(rows: int) -> pd.DataFrame:
    return load_trace(samples.path("mooncake-conv")).requests.iloc[:rows].copy()


def test_mooncake_prefixes_are_reused_across_requests():
    wl = mooncake(300)
    assert wl.attrs["hash_block_tokens"] == 512
    cfg = EngineConfig(max_num_seqs=64, chunked_prefill=True, max_num_batched_tokens=8192)
    results = {}
    for kind in ("paged", "prefix-caching"):
        alloc = make_allocator(
            kind, capacity=64 * 2**30, bytes_per_token=131072, max_model_len=131072
        )
        results[kind] = run(wl, alloc, cfg).summary
    cached = results["prefix-caching"]
    assert cached["completed"] == results["paged"]["completed"]
    assert cached["prefill_tokens_skipped"] > 0
    assert 0 < cached["prefix_hit_rate_tokens"] < 1
    assert cached["prefix_hit_rate_blocks"] > 0
    assert cached["p50_latency_s"] < results["paged"]["p50_latency_s"]


@pytest.mark.parametrize("bs", [16, 512, 1024])
def test_hash_chunks_map_onto_any_block_size(bs):
    a = cache(2000, bs)
    chain = (5, 6, 7, 8)
    a.admit(req(0, 2048, chain, chunk=512), 2049)
    # The same first three chunks: every block inside them hits.
    hit = a.cached_prefix_tokens(req(1, 2048, (5, 6, 7, 9), chunk=512))
    assert hit == 1536 // bs * bs


def test_ideal_reuse_is_bounded_by_the_trace_figure():
    """With a cache that never evicts, token reuse matches the trace's ideal prefix reuse."""
    wl = mooncake(1000)
    a = make_allocator(
        "prefix-caching", capacity=2**25, bytes_per_token=1, max_model_len=200_000,
        block_size=512,
    )
    hit = total = 0
    for row in wl.itertuples():
        r = Request(int(row.request_id), int(row.prompt_tokens), 1,
                    prefix=tuple(row.hash_ids), prefix_tokens=512)
        hit += a.cached_prefix_tokens(r)
        total += r.prompt
        a.admit(r, r.prompt + 1)
    # SOURCE.md: ideal reuse 37.4 % of input tokens over the full trace (at least one token
    # of each prompt is always computed here, so slightly less).
    assert 0.2 < hit / total < 0.5
    assert np.isfinite(hit)


def test_a_synthetic_system_prompt_is_found_again():
    from kvfrag.workloads import WorkloadSpec, build_workload

    spec = WorkloadSpec.model_validate(
        {
            "synthetic": {
                "count": 50,
                "prompt": {"kind": "fixed", "value": 30},
                "output": {"kind": "fixed", "value": 10},
                "shared_prefix": {"tokens": 64, "groups": 1, "chunk_tokens": 16},
                "arrival": {"kind": "constant", "rate": 1.0},
            }
        }
    )
    wl = build_workload(spec, Path(".")).requests
    alloc = make_allocator(
        "prefix-caching", capacity=10_000 * B, bytes_per_token=B, max_model_len=512,
        block_size=16,
    )
    s = run(wl, alloc, EngineConfig(max_num_seqs=8, max_num_batched_tokens=512)).summary
    # Every request after the first finds the 64-token system prompt (4 blocks) cached.
    assert s["prefill_tokens_skipped"] == 49 * 64
    assert s["prefix_hit_blocks"] == 49 * 4


# ------------------------------------------------------- vLLM 0.33's rules (tests/oracle)
def test_generated_blocks_are_cached_and_a_resumed_request_finds_its_own_output():
    a = cache(20)
    r = req(0, 20, (1,), output=40, chunk=32)  # one hash id covers blocks 0 (20 tokens)
    assert a.admit(r, 20)
    assert a.step(16)  # 36 tokens: block 1 (4 prompt tokens, 12 generated ones) is full
    assert a.idle_cached_blocks() == 0 and len(a._refs) == 1  # block 1 is its own while live
    a.free(0)  # preempted with 36 tokens: blocks 0, 1 cached (idle), the partial one free
    assert a.idle_cached_blocks() == 2 and a.free_blocks() == 20
    # Resumed with 37 tokens to prefill (its 36 and the last sampled token): hits capped at
    # 36 tokens find both blocks, its own output included. Fresh, it would find block 0.
    assert a.cached_prefix_tokens(r, 37) == 32 and a.cached_prefix_tokens(r) == 16
    assert a.admission_bytes(r, 37, 32) == (3 - 2 + 2) * a.block_bytes  # idle hits count
    assert a.admit(r, 37) and a.idle_cached_blocks() == 0
    assert a.block_table(0)[:2] == tuple(a._held[0])
    assert a.summary_stats()["prefix_hit_blocks"] == 2
    check_blocks(a, {0: r})
    # Without a hash chain its blocks are its own too: cached, found again when resumed.
    s = Request(1, 40, 10)
    assert a.admit(s, 40) and a.cached_prefix_tokens(s, 41) == 0
    a.free(1)
    assert a.cached_prefix_tokens(s, 41) == 32 and a.cached_prefix_tokens(s) == 32
    assert a.cached_prefix_tokens(Request(2, 40, 10), 41) == 0  # nobody else's


def test_cache_generated_off_caches_only_what_the_hash_chain_names():
    a = make_allocator(
        "prefix-caching", capacity=20 * 16 * B, bytes_per_token=B, max_model_len=4096,
        block_size=16, cache_generated=False,
    )
    r = req(0, 20, (1,), output=40, chunk=32)
    assert a.admit(r, 20) and a.step(16)
    a.free(0)
    assert a.idle_cached_blocks() == 1  # block 0, named by the chain; block 1 not cached
    # A resumed request's cap still counts its output: all its named prompt blocks.
    assert a.cached_prefix_tokens(r, 37) == 16
    assert a.cached_prefix_tokens(req(1, 16, (1,), chunk=32), 17) == 16
    assert a.cached_prefix_tokens(req(1, 16, (1,), chunk=32)) == 0  # fresh: P - 1 tokens
    with pytest.raises(ValueError, match="cache_generated"):
        make_allocator("prefix-caching", capacity=4096, bytes_per_token=B, max_model_len=64,
                       cache_generated="yes")


def test_preempted_requests_resume_finding_their_output():
    """Engine: a pool that preempts; resumed requests find their stored tokens cached (those
    not evicted meanwhile), as vLLM's do, and skip their prefill."""
    rng = np.random.default_rng(0)
    wl = pd.DataFrame({
        "request_id": np.arange(30),
        "arrival_s": np.zeros(30),
        "prompt_tokens": rng.integers(20, 60, 30),
        "output_tokens": rng.integers(60, 120, 30),
    })
    cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512)
    out = {}
    for kind in ("paged", "prefix-caching"):
        alloc = make_allocator(kind, capacity=60 * 16 * B, bytes_per_token=B,
                               max_model_len=512, block_size=16)
        out[kind] = run(wl, alloc, cfg).summary
    s = out["prefix-caching"]
    assert s["preemptions"] > 0 and out["paged"]["preemptions"] > 0
    # No prompt is shared: every hit is a resumed request's own tokens.
    assert s["prefill_tokens_skipped"] > 0 and s["completed"] == 30
    assert s["prefix_hit_rate_tokens"] < 1 and s["prefix_evictions"] > 0


def test_first_admission_hits_never_exceed_the_traces_ideal_reuse():
    """Hits at first admissions are reuse across requests: at most what an unbounded cache
    would find (the trace's ideal reuse). Hits on re-admissions after a preemption are the
    request's own blocks found again, and are counted apart."""
    from kvfrag.workloads import Workload
    from kvfrag.workloads.stats import ideal_prefix_reuse

    wl = mooncake(300)
    alloc = make_allocator(
        "prefix-caching", capacity=12 * 2**30, bytes_per_token=131072, max_model_len=131072,
        block_size=16,
    )
    cfg = EngineConfig(max_num_seqs=64, chunked_prefill=True, max_num_batched_tokens=8192)
    result = run(wl, alloc, cfg)
    s, req = result.summary, result.requests
    assert s["preemptions"] > 0  # a pool tight enough to re-admit
    assert req["prefix_hit_tokens"].sum() == s["prefill_tokens_skipped_first"] > 0
    assert s["prefill_tokens_skipped"] > s["prefill_tokens_skipped_first"]
    _, ideal_tokens = ideal_prefix_reuse(Workload(wl, "mooncake"))
    assert s["prefix_hit_rate_first_tokens"] <= ideal_tokens
    assert s["prefill_tokens_skipped_first"] <= ideal_tokens * wl["prompt_tokens"].sum()
