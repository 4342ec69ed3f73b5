"""The `static-partition` allocator: one pool per layer type, a fixed share of the budget each.
Its pools are the hybrid allocator's (held to vLLM elsewhere); here: the partition option and
its errors, all-or-nothing admissions and chunks across pools, the identity and no leak, the
closed forms (integrate, steps_until_full) against stepping, the fast engine against the
per-iteration reference, and a sweep over a share."""

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
    return sum(p.plan.max_request_blocks * p.page + 2 * p.page for p in a.pools) * 2 + (
        2 * a.state.page if a.state is not None else 0)


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
    assert sliding.free_blocks() > 0 and full.free_blocks() < 8  # only the full pool was short
    before = (a.parts(), [p.parts() for p in a.pools], a.rids(), [p.rids() for p in a.pools])
    assert not a.admit(Request(rid, 60, 60), decoding=False)
    assert (a.parts(), [p.parts() for p in a.pools], a.rids(), [p.rids() for p in a.pools]
            ) == before
    grown = a.grow(0, 60)  # more blocks than the full pool has free
    assert isinstance(grown, Refusal) and grown.detail == "full pool"
    assert (a.parts(), [p.parts() for p in a.pools]) == before[:2]
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
        assert any(p.steps_until_full() == 0 for p in c.pools)  # a pool is short next step
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
