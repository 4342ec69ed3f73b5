"""The `static-partition` allocator: one pool per layer type, a fixed share of the budget each.
Each pool is held, operation by operation, to a `hybrid` allocator over its type's layers
alone (itself held to vLLM elsewhere); here too: the partition option and its errors,
all-or-nothing admissions and chunks across pools, the identity and no leak, the closed forms
(integrate, steps_until_full) against stepping, the fast engine against the per-iteration
reference, and a sweep over a share."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from runpy import run_path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Refusal, Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    LayerStack,
    MambaState,
    SlidingWindow,
)
from kvfrag.sim.reference import reference

warnings.filterwarnings("ignore", message=".*pure-Python.*")

AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]
ROOT = Path(__file__).resolve().parents[2]
MML = 128


def _stack(pattern: str, window: int = 32) -> LayerStack:
    kinds = {
        "s": SlidingWindow(1, 4, 2, window=window),
        "f": FullAttention(1, 4, 2),
        "c": ChunkedLocal(1, 4, 2, chunk=24),
        "m": MLA(6, 2, 2),
        "g": MambaState(600, "gated_delta_net"),
    }
    return LayerStack(pattern, tuple(kinds[ch] for ch in pattern))


STACKS = [_stack("ssf"), _stack("sssssf", 21), _stack("cccf"), _stack("mmm"), _stack("gggf"),
          _stack("sfsfgg", 6)]


def make(stack: LayerStack, capacity: int, **options):
    return make_allocator("static-partition", capacity=capacity,
                          bytes_per_token=stack.full_bytes_per_token, max_model_len=MML,
                          stack=stack, block_size=8, max_num_batched_tokens=40, **options)


def smallest(stack: LayerStack, **options) -> int:
    """A budget each pool of which holds one request of MML (the default shares)."""
    a = make(stack, 10**9, **options)
    return 2 * sum((p.max_request_blocks + 2) * p.page if p.kind != "mamba" else p.page
                   for p in a.pools)


# ------------------------------------------------------------------ the partition option
def test_default_shares_are_each_types_bytes_for_one_request_at_max_model_len():
    stack = _stack("ssf")  # 2 sliding layers (window 32) and 1 full, 16 B per token each
    a = make(stack, 10**6)
    # vLLM's memory check: full 128 tokens; sliding min(31 + 2 x 40, 128) = 111 -> 14 + 1
    # blocks of 8, in whole blocks of the type's page
    full, sliding = 16 * 8 * 16, 15 * 8 * 32
    assert a.shares == pytest.approx({"full": full / (full + sliding),
                                      "sliding": sliding / (full + sliding)}, rel=1e-12)
    assert a.summary_stats()["partition_sliding_page_bytes"] == 8 * 32


@pytest.mark.parametrize(("partition", "said"), [
    ({"full": 0.5}, "partition: no share for sliding"),
    ({"full": 0.5, "sliding": 0.4, "mamba": 0.1}, "partition: unknown layer type 'mamba'"),
    ({"full": 0.5, "slide": 0.5}, "partition: unknown name 'slide'"),
    ({"full": 0.5, "sliding": 0.6}, "partition: the shares sum to 1.1, not 1"),
    ({"full": 0, "sliding": 1}, "partition.full must be a share above 0"),
    ({"full": True, "sliding": 0.5}, "partition.full must be a share above 0"),
    ([0.5, 0.5], "partition must map each layer type (full, sliding)"),
])
def test_bad_partitions_name_the_field(partition, said):
    with pytest.raises(ValueError, match="^" + __import__("re").escape(said)):
        make(_stack("ssf"), 10**6, partition=partition)


def test_a_share_too_small_for_one_request_names_its_type():
    with pytest.raises(ValueError, match=r"^partition\.full \(0\.01 of the budget\): To serve"):
        make(_stack("ssf"), 20_000, partition={"full": 0.01, "sliding": 0.99})


def test_a_bad_partition_in_a_scenario_is_one_line_exit_2(capsys, tmp_path):
    from kvfrag.cli import main

    out = tmp_path / "out"
    code = main(["run", str(ROOT / "scenarios" / "gpt-oss-120b-h100.yaml"), "--set",
                 "allocators=[{label: sp, kind: static-partition, partition: {full: 0.7}}]",
                 "-o", str(out), "-q", "--no-plots"])
    lines = [x for x in capsys.readouterr().err.splitlines()
             if "UserWarning" not in x and "import" not in x]
    assert code == 2 and len(lines) == 1, lines
    assert "allocator 'sp'" in lines[0] and "partition: no share for sliding" in lines[0]
    assert not out.exists()


# --------------------------------------------------------------------- all or nothing
def test_an_admission_or_chunk_one_pool_refuses_changes_no_pool():
    stack = _stack("ssf")
    # the sliding pool is ample, the full pool holds 40 blocks of 8 tokens, a few requests
    a = make(stack, 200_000, partition={"full": 0.3, "sliding": 0.7})
    full, sliding = a.pools
    rid = 0
    while a.admit(Request(rid, 60, 60), decoding=False):
        rid += 1
    refused = a.admit(Request(rid, 60, 60), decoding=False)
    assert isinstance(refused, Refusal) and "full pool" in refused.detail
    assert a.free_in(sliding) > 0 and a.free_in(full) < 8  # only the full pool was short
    before = (a.parts(), [a.held_in(p) for p in a.pools], a.rids())
    assert not a.admit(Request(rid, 60, 60), decoding=False)
    assert (a.parts(), [a.held_in(p) for p in a.pools], a.rids()) == before
    grown = a.grow(0, 60)  # more blocks than the full pool has free
    assert isinstance(grown, Refusal) and grown.detail == "full pool"
    assert (a.parts(), [a.held_in(p) for p in a.pools]) == before[:2]
    a.account().check()


@pytest.mark.parametrize("stack", STACKS, ids=[s.name for s in STACKS])
def test_lifecycle_identity_and_no_leak(stack):
    a = make(stack, smallest(stack))
    fresh = copy.deepcopy(a)
    rid = 0
    while a.admit(Request(rid, 20 + rid % 7, 30)):
        a.account().check()
        rid += 1
    assert rid > 0
    while (full := a.steps_until_full()) is not None and a.steps_until_done():
        assert a.step(min(full, a.steps_until_done()))
        a.account().check()
        if full < a.steps_until_done():
            before = a.parts()
            assert not a.step(full + 1) and a.parts() == before
            a.free(a.rids()[0])
        while a.steps_until_done() == 0:
            a.free(a.first_done())
    for r in a.rids():
        a.free(r)
        a.account().check()
    assert a.account() == fresh.account()
    assert a.parts()[:3] == (0, 0, 0)


def _per_type(a, stack: LayerStack) -> list:
    """A `hybrid` allocator over each attention type's layers alone, on that type's share:
    what each pool of `a` must hold and answer, pool by pool."""
    from kvfrag.sim.allocators.static_partition import layers_by_type

    subs = layers_by_type(stack)
    return [make_allocator("hybrid", capacity=p.size, bytes_per_token=subs[p.kind]
                           .full_bytes_per_token, max_model_len=MML, stack=subs[p.kind],
                           block_size=8, max_num_batched_tokens=40)
            for p in a.pools if p.kind != "mamba"]


@pytest.mark.parametrize("stack", STACKS, ids=[s.name for s in STACKS])
@settings(max_examples=20, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("agsf"), st.integers(1, 90), st.integers(1, 60)),
                    min_size=1, max_size=30),
       slack=st.sampled_from([1.0, 1.5]))
def test_each_pool_is_a_hybrid_allocator_over_its_types_layers(stack, ops, slack):
    """One cohort over every pool's managers (the pools apart): each pool holds, grants and
    looks ahead exactly as a `hybrid` allocator over its type's layers alone would."""
    a = make(stack, int(smallest(stack) * slack))
    pools = [p for p in a.pools if p.kind != "mamba"]
    alone = _per_type(a, stack)
    state = [p for p in a.pools if p.kind == "mamba"]
    rid = 0
    for op, x, y in ops:
        if op == "a":
            got = a.admit(Request(rid, x, y), decoding=x % 2 == 0)
            state_short = bool(state) and a.free_in(state[0]) == 0
            if got:
                for h in alone:
                    assert h.admit(Request(rid, x, y), decoding=x % 2 == 0)
            elif not state_short:
                assert any(h.admit_shortfall(x) > 0 for h in alone)
            rid += 1
        elif op == "g" and a.rids():
            r = a.rids()[x % len(a.rids())]
            if not a.is_decoding(r) and a.tokens(r) < a.final_tokens(r):
                n = min(y, a.final_tokens(r) - a.tokens(r))
                if a.grow(r, n):
                    for h in alone:
                        assert h.grow(r, n)
                else:
                    assert any(h.grow_shortfall(r, n) > 0 for h in alone)
        elif op == "s" and a.steps_until_done():
            n = min(x % 5 + 1, a.steps_until_done())
            ok = bool(a.step(n))
            assert ok == all(h.steps_until_full() is None or h.steps_until_full() >= n
                             for h in alone)
            if ok:
                for h in alone:
                    assert h.step(n)
            while a.steps_until_done() == 0:
                done = a.first_done()
                a.free(done)
                for h in alone:
                    h.free(done)
        elif op == "f" and a.rids():
            r = a.rids()[x % len(a.rids())]
            a.free(r)
            for h in alone:
                h.free(r)
        for p, h in zip(pools, alone, strict=True):
            assert a.held_in(p) == h.num_blocks - h.free_blocks()
            assert a.pool_steps_until_full(p) == h.steps_until_full()
        a.account().check()


@pytest.mark.parametrize("stack", STACKS, ids=[s.name for s in STACKS])
@settings(max_examples=25, deadline=None)
@given(
    phases=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 60), st.booleans()),
                    min_size=1, max_size=5),
    clock=st.integers(0, 40),
    w0=st.floats(0, 5),
    w1=st.floats(-2, 2),
    data=st.data(),
)
def test_integrate_is_the_stepped_sum_and_full_is_the_last_step(stack, phases, clock, w0, w1,
                                                                data):
    a = make(stack, smallest(stack))
    if clock:
        assert a.admit(Request(-5, 1, clock + 1))
        assert a.step(clock)
        a.free(-5)
    for rid, (prompt, output, decoding) in enumerate(phases):
        if not a.admit(Request(rid, prompt, output), decoding=decoding):
            break
    full, done = a.steps_until_full(), a.steps_until_done()
    if done is not None and full is not None and full < done:
        c = copy.deepcopy(a)
        assert c.step(full)
        assert any(c.pool_steps_until_full(p) == 0 for p in c.pools)  # a pool is short next
    limits = [x for x in (done, full) if x is not None]
    n = data.draw(st.integers(0, min([40, *limits])))
    got = a.integrate(n, None, w0, w1)
    c = copy.deepcopy(a)
    want = dict.fromkeys(PARTS, 0.0)
    for j in range(1, n + 1):
        assert c.step(1)
        acc = c.account()
        for part in PARTS:
            want[part] += getattr(acc, part) * (w0 + w1 * (j - 1))
    scale = a.capacity * n * (w0 + abs(w1) * n + 1)
    for part in PARTS:
        assert got[part] == pytest.approx(want[part], rel=1e-9, abs=1e-12 * scale), part


# ------------------------------------------------------------------------- the engine
def workload(seed: int, n: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.cumsum(rng.exponential(0.5, n)),
        "prompt_tokens": rng.integers(1, 101, n),
        "output_tokens": rng.integers(1, 81, n),
    })


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(STACKS))),
    n=st.integers(1, 16),
    slack=st.sampled_from([1.0, 1.5, 3.0]),
    chunked=st.booleans(),
    asynchronous=st.booleans(),
)
def test_fast_engine_matches_reference(seed, which, n, slack, chunked, asynchronous):
    stack = STACKS[which]
    tokens = 40 if chunked else 160
    capacity = int(smallest(stack) * slack)

    def fresh():
        return make_allocator("static-partition", capacity=capacity,
                              bytes_per_token=stack.full_bytes_per_token, max_model_len=MML,
                              stack=stack, block_size=8, max_num_batched_tokens=tokens,
                              concurrent_batches=2 if asynchronous else 1)

    wl = workload(seed, n)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=tokens, chunked_prefill=chunked,
                       lookahead=3, async_scheduling=asynchronous,
                       step_time=StepTime(0.05, 1e-3, 1e-4))
    fast = run(wl, fresh(), cfg)
    slow = reference(wl, fresh(), cfg)
    AGREE(fast, slow)
    assert sum(fast.summary[f"{p}_frac"] for p in PARTS) == pytest.approx(1.0, abs=1e-12)


def test_a_sweep_over_the_partition_runs_each_ratio(tmp_path):
    """The best ratio for a trace is found by a sweep over the layout's `partition` (the whole
    mapping: a sweep over one share alone would leave the sum off 1)."""
    from kvfrag.cli import main

    out = tmp_path / "out"
    code = main(["run", str(ROOT / "scenarios" / "gpt-oss-120b-h100.yaml"), "--set",
                 "allocators=[{label: sp, kind: static-partition}]", "--set",
                 "sweep={allocators.sp.partition: [{full: 0.8, sliding: 0.2}, "
                 "{full: 0.9, sliding: 0.1}]}", "--set", "workload.transforms.first_n=30",
                 "-o", str(out), "-q", "--no-plots"])
    assert code == 0
    summary = pd.read_csv(out / "summary.csv")
    assert summary["partition_full_share"].tolist() == [0.8, 0.9]
    blocks = summary["partition_full_blocks"].tolist()
    assert blocks[0] < blocks[1]  # (a larger share, more blocks of the same page)
