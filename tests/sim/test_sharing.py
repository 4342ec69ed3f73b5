"""Sharing within a request: n samples (or beams) of one prompt share blocks when paged.

Parallel sampling shares the prompt's full blocks; beams share their whole trunk of full
blocks and each keep a private copy of the current partial block. Slabs cannot share.
"""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig

B = 64  # bytes per token


def paged(blocks: int, bs: int = 16):
    return make_allocator(
        "paged", capacity=(blocks + 1) * bs * B + 7, bytes_per_token=B, max_model_len=512,
        block_size=bs,  # `blocks` blocks and the null block
    )


def kept(beam: bool, prompt: int, tokens: int, bs: int) -> int:
    """Full blocks the sequences share: the prompt's (samples) or the whole trunk (beams)."""
    return tokens // bs if beam else prompt // bs


def expected_blocks(n: int, prompt: int, tokens: int, bs: int, beam: bool = False) -> int:
    """Shared full blocks once, then each sequence's own blocks (copied partial one too)."""
    return n * -(-tokens // bs) - (n - 1) * kept(beam, prompt, tokens, bs)


def test_samples_share_the_prompt_full_blocks():
    a = paged(100)
    req = Request(0, prompt=40, output=30, n=4)
    grant = a.admit(req, 41)
    # 2 full prompt blocks kept once; each of 4 samples holds its copy of the partial block.
    assert grant.nbytes == (2 + 4 * 1) * 16 * B
    acc = a.account()
    acc.check()
    assert acc.token_states == (32 + 4 * 9) * B  # shared tokens stored once
    assert a.saved_by_sharing() == 3 * 2 * 16 * B
    a.step(12)  # each sample at 53 tokens: 4 blocks each, 2 shared
    assert a.allocated_bytes(0) == expected_blocks(4, 40, 53, 16) * 16 * B
    a.account().check()
    a.free(0)
    assert a.free_blocks() == a.usable_blocks and a.saved_by_sharing() == 0


def test_slab_samples_each_store_their_own_copy():
    a = make_allocator(
        "contiguous", capacity=10_000 * B, bytes_per_token=B, max_model_len=512, reserve="oracle"
    )
    grant = a.admit(Request(0, prompt=40, output=30, n=3), 41)
    assert grant.nbytes == 3 * 70 * B
    assert len(a.slabs()) == 3
    acc = a.account()
    acc.check()
    assert acc.token_states == 3 * 41 * B
    assert a.saved_by_sharing() == 0


def test_slab_samples_are_placed_all_or_none():
    a = make_allocator(
        "contiguous", capacity=250 * B, bytes_per_token=B, max_model_len=512, reserve="oracle"
    )
    before = a.account()
    refusal = a.admit(Request(0, prompt=40, output=60, n=3), 41)  # 300 tokens > 250
    assert not refusal
    assert a.account() == before and a.slabs() == []


def test_beams_share_their_trunk_and_copy_the_partial_block():
    a = paged(100)
    a.admit(Request(0, prompt=40, output=30, n=4, beam=True), 41)
    assert a.blocks_of(0) == 2 + 4  # trunk of 2 full blocks, 4 private partial blocks
    a.step(7)  # 48 tokens: the partial blocks filled, pruned back to one trunk of 3
    assert a.blocks_of(0) == 3
    a.step(1)  # 49 tokens: four new private partial blocks
    assert a.blocks_of(0) == 3 + 4
    acc = a.account()
    acc.check()
    assert acc.token_states == (48 + 4 * 1) * B
    assert a.saved_by_sharing() == 3 * 3 * 16 * B


@settings(max_examples=150, deadline=None)
@given(
    beam=st.booleans(),
    bs=st.sampled_from([1, 4, 16]),
    groups=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 60), st.integers(1, 40)), min_size=1,
        max_size=6,
    ),
    steps=st.lists(st.integers(1, 9), max_size=6),
    w=st.tuples(st.floats(0.01, 1.0), st.floats(0.0, 0.5)),
)
def test_group_accounting_matches_its_closed_form(beam, bs, groups, steps, w):
    a = paged(400, bs)
    live = {}
    for rid, (n, prompt, output) in enumerate(groups):
        if a.admit(Request(rid, prompt, output, n=n, beam=beam), prompt + 1):
            live[rid] = (n, prompt)
    for k in steps:
        done = a.steps_until_done()
        full = a.steps_until_full()
        k = min(k, done if done is not None else k, full if full is not None else k)
        if k <= 0:
            break
        # integrate() over the next k steps equals stepping one by one on a copy.
        c = copy.deepcopy(a)
        total = dict.fromkeys(PARTS, 0.0)
        for j in range(k):
            c.step(1)
            acc = c.account()
            for p in PARTS:
                total[p] += getattr(acc, p) * (w[0] + w[1] * j)
        got = a.integrate(k, None, *w)
        for p in PARTS:
            assert got[p] == pytest.approx(total[p], rel=1e-9, abs=1e-6)
        assert a.step(k)
        acc = a.account()
        acc.check()
        tokens = {r: a.tokens(r) for r in live}
        blocks = sum(expected_blocks(n, p, tokens[r], bs, beam) for r, (n, p) in live.items())
        assert a.usable_blocks - a.free_blocks() == blocks
        stored = sum(
            n * tokens[r] - (n - 1) * kept(beam, p, tokens[r], bs) * bs
            for r, (n, p) in live.items()
        )
        assert acc.token_states == stored * B
        saved = sum((n - 1) * kept(beam, p, tokens[r], bs) for r, (n, p) in live.items())
        assert a.saved_by_sharing() == saved * bs * B
    for rid in list(live):
        a.free(rid)
    assert a.free_blocks() == a.usable_blocks
    assert a.account().token_states == 0


def workload(n_samples: int, count: int = 40, column: str = "n") -> pd.DataFrame:
    rng = np.random.default_rng(3)
    return pd.DataFrame(
        {
            "request_id": np.arange(count),
            "arrival_s": np.sort(rng.uniform(0, 5, count)),
            "prompt_tokens": rng.integers(60, 300, count),
            "output_tokens": rng.integers(20, 200, count),
            column: n_samples,
        }
    )


def test_saving_grows_with_the_number_of_samples():
    saved = []
    for n in (1, 2, 4, 6):
        alloc = paged(4000)
        cfg = EngineConfig(max_num_seqs=256, max_num_batched_tokens=1024)
        result = run(workload(n), alloc, cfg)
        s = result.summary
        assert s["completed"] == 40
        assert s["generated_tokens"] == n * workload(n)["output_tokens"].sum()
        saved.append(s["memory_saved_by_sharing_frac"])
    assert saved[0] == 0
    assert saved[0] < saved[1] < saved[2] < saved[3]


def test_samples_count_against_max_num_seqs():
    alloc = paged(4000)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024)
    result = run(workload(4, 10), alloc, cfg)
    # 4 samples each: at most two requests run at once.
    assert result.summary["max_running"] == 2


def test_beam_search_saves_more_than_parallel_sampling():
    def saved(column: str, width: int) -> float:
        cfg = EngineConfig(max_num_seqs=256, max_num_batched_tokens=1024)
        s = run(workload(width, column=column), paged(4000), cfg).summary
        assert s["completed"] == 40
        return s["memory_saved_by_sharing_frac"]

    for width in (2, 4, 6):
        assert saved("beam_width", width) > saved("n", width) > 0


def check_tables(a, rid: int, req: Request, before: list[tuple[int, ...]] | None) -> list:
    """A group's block tables follow its sequences: shared blocks once, the rest private."""
    bs, tokens = a.block_size, a.tokens(rid)
    tables = a.block_tables(rid)
    assert len(tables) == (req.n if tokens > req.prompt else 1)
    assert all(len(t) == -(-tokens // bs) for t in tables)
    ids = {b for t in tables for b in t}
    assert len(ids) == a.blocks_of(rid) == len(a.block_table(rid))
    assert set(a.block_table(rid)) == ids
    kept_rows = kept(req.beam, req.prompt, tokens, bs) if len(tables) > 1 else 0
    for t in tables[1:]:
        assert t[:kept_rows] == tables[0][:kept_rows]  # shared by reference
    for row in range(kept_rows, -(-tokens // bs)):
        assert len({t[row] for t in tables}) == len(tables)  # one private block each
    if before is not None:
        # Beam 0 (and every sample) only ever appends: its blocks keep their tokens.
        olds = before if not req.beam else before[:1]
        for old, new in zip(olds, tables, strict=False):
            assert new[: len(old)] == old
    return tables


@settings(max_examples=150, deadline=None)
@given(
    beam=st.booleans(),
    bs=st.sampled_from([1, 4, 16]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "step", "name", "free"]),
            st.integers(1, 4), st.integers(1, 60), st.integers(0, 30),
        ),
        max_size=30,
    ),
)
def test_block_tables_follow_the_sequences(beam, bs, ops):
    a = paged(120, bs)
    live: dict[int, Request] = {}
    tables: dict[int, list] = {}  # rid -> its tables when last named
    named: dict[int, int] = {}  # rid -> its tokens then

    def copies_at_the_fork_only(rid: int | None = None) -> None:
        for rid, pairs in _by_rid(a.take_copies()).items():
            req = live[rid]
            # Only at the fork, for every sequence past the first, when the prompt ends
            # inside a block: the partial prompt block is the source.
            assert named[rid] <= req.prompt < a.tokens(rid) and req.prompt % bs
            assert len(pairs) == req.n - 1
            now = a.block_tables(rid)
            row = req.prompt // bs
            assert {src for src, _ in pairs} == {now[0][row]}
            assert [dst for _, dst in pairs] == [t[row] for t in now[1:]]

    def name(rid: int) -> None:
        tables[rid] = check_tables(a, rid, live[rid], tables.get(rid))
        copies_at_the_fork_only()
        named[rid] = a.tokens(rid)

    for i, (op, n, size, k) in enumerate(ops):
        if op == "admit":
            req = Request(i, size, 1 + k, n=n, beam=beam)
            tokens = min(req.final, 1 + k * size // 30 + k % 2)
            # A group decodes only once its prompt is stored (the engine's order).
            if a.admit(req, tokens, decoding=tokens > req.prompt):
                live[i], named[i] = req, 0
                copies_at_the_fork_only()
                name(i)
        elif op == "grow" and live:
            rid = sorted(live)[k % len(live)]
            left = a.final_tokens(rid) - a.tokens(rid)
            if left and a.grow(rid, min(left, size)):
                copies_at_the_fork_only()
                name(rid)
        elif op == "step":
            done, full = a.steps_until_done(), a.steps_until_full()
            k = min(x for x in (k + 1, done, full) if x is not None)
            if k:
                assert a.step(k)
        elif op == "name" and live:
            name(sorted(live)[k % len(live)])
        elif op == "free" and live:
            rid = sorted(live)[k % len(live)]
            a.free(rid)
            del live[rid], tables[rid], named[rid]
        assert not a.take_copies()
        a.account().check()
    seen: set[int] = set()
    for rid in live:
        name(rid)
        ids = set(a.block_table(rid))
        assert seen.isdisjoint(ids), "a block in two requests"
        assert all(1 <= b < a.num_blocks for b in ids)  # (block 0: the null block)
        seen |= ids
    for rid in list(live):
        a.free(rid)
    assert sorted(a._stack) == list(range(1, a.num_blocks))


def _by_rid(copies):
    out: dict[int, list[tuple[int, int]]] = {}
    for rid, src, dst in copies:
        out.setdefault(rid, []).append((src, dst))
    return out


def test_samples_copy_the_partial_prompt_block_at_the_fork():
    a = paged(100)
    a.admit(Request(0, prompt=40, output=30, n=3), 30, decoding=False)  # chunked prefill
    assert a.block_tables(0) == [(1, 2)] and not a.take_copies()
    a.grow(0, 11)  # the prompt's last 10 tokens and the first output token's slot
    tables = a.block_tables(0)
    assert tables == [(1, 2, 3), (1, 2, 4), (1, 2, 5)]
    assert a.take_copies() == [(0, 3, 4), (0, 3, 5)]
    a.set_decoding(0, True)
    a.step(8)  # 49 tokens: each sample takes its own fourth block
    assert [t[3] for t in a.block_tables(0)] == [6, 7, 8] and not a.take_copies()


def test_beams_prune_back_to_beam_zero():
    a = paged(100)
    a.admit(Request(0, prompt=40, output=30, n=3, beam=True), 41)
    assert a.block_tables(0) == [(1, 2, 3), (1, 2, 4), (1, 2, 5)]
    assert a.take_copies() == [(0, 3, 4), (0, 3, 5)]
    a.step(7)  # 48 tokens: beam 0's block 2 joins the trunk, the other copies go back
    assert a.block_tables(0) == [(1, 2, 3)] * 3
    a.step(1)  # 49: a fresh private block each, nothing to copy
    assert a.block_tables(0) == [(1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 6)]
    assert not a.take_copies()
    a.step(20)  # 69: two boundaries crossed between namings
    tables = a.block_tables(0)
    assert tables[0][:4] == (1, 2, 3, 4) and len({t[4] for t in tables}) == 3
    assert all(t[:4] == tables[0][:4] for t in tables)
    assert len(set(a.block_table(0))) == a.blocks_of(0) == 4 + 3


def test_blocks_pruned_while_unnamed_are_named_again_when_needed():
    a = paged(9)
    a.admit(Request(0, prompt=40, output=30, n=4, beam=True), 41)  # 2 + 4 blocks named
    a.step(7)  # 48 tokens: pruned to 3 blocks, the pruned ids not named back yet
    assert a.free_blocks() == 6
    assert a.admit(Request(1, prompt=95, output=1), 96)  # takes all 6 free blocks
    ids = set(a.block_table(0)) | set(a.block_table(1))
    assert len(ids) == 9 == a.usable_blocks - a.free_blocks()


@pytest.mark.parametrize("beam", [False, True])
def test_a_group_decodes_only_after_its_fork(beam):
    """Counting n sequences in the decode cohort is right only once the group has forked:
    decoding from the bare prompt is refused, before anything is allocated."""
    a = paged(100, bs=4)
    req = Request(0, prompt=6, output=3, n=2, beam=beam)
    with pytest.raises(ValueError, match="admit it with prompt \\+ 1 tokens"):
        a.admit(req)  # default: the prompt's 6 tokens, decoding
    assert a.live == 0 and a.free_blocks() == 100
    a.admit(req, 6, decoding=False)  # prefilled, not decoding yet: one sequence
    assert a.total_tokens() == 6
    with pytest.raises(ValueError, match="decodes once it stores more than"):
        a.set_decoding(0, True)
    a.grow(0, 1)
    a.set_decoding(0, True)
    a.account().check()
    assert a.total_tokens() == 4 + 2 * 3  # one shared prompt block, then 3 tokens each
