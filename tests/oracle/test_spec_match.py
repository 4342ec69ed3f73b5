"""kvfrag's speculative decoding against vLLM's scheduler, iteration by iteration.

Both sides get the same accepted-draft counts per request (kvfrag's `Acceptance`, drawn from a
rate or a distribution with a seed, handed to the driver's fake model runner): a decode step
schedules the sampled token and up to k drafts (cut to the token budget), reserves the method's
lookahead slots, and a step's rejections roll the computed tokens back without freeing a block
(tests/oracle/test_spec_driver.py pins each of those facts on vLLM alone). Every step must agree
exactly (tokens scheduled, running, waiting, preemptions, admissions, blocks in use) and every
request its first-token and finish steps and its preemptions.
"""

from __future__ import annotations

import pandas as pd
import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.scheduler")

from kvfrag.sim.allocators import make_allocator  # noqa: E402
from kvfrag.sim.engine import run  # noqa: E402
from kvfrag.sim.engine_config import EngineConfig, StepTime  # noqa: E402
from kvfrag.sim.reference import reference  # noqa: E402
from kvfrag.sim.speculative import Acceptance, Speculative  # noqa: E402

from .test_async_match import assert_same as same_async  # noqa: E402
from .test_vllm_match import BS, BYTES_PER_TOKEN, assert_same, synthetic, token_ids  # noqa: E402
from .vllm_driver import OracleRequest, run_vllm  # noqa: E402


def both(wl: pd.DataFrame, spec: Speculative, num_blocks: int, max_num_seqs: int, budget: int,
         chunked: bool, max_model_len: int = 1024, async_scheduling: bool = False):
    """(vLLM's run, kvfrag's per-iteration trace, kvfrag's reference result); the fast
    engine is held to the reference here too."""
    acceptance = Acceptance(spec)
    # a request verifies at most once per output token: that many counts are enough
    accepted = {int(r.request_id): [int(a) for a in acceptance.counts(
        int(r.request_id), 0, int(r.output_tokens))] for r in wl.itertuples()}
    oracle = run_vllm(
        [OracleRequest(int(r.request_id), int(r.arrival_s), token_ids(r, 0),
                       int(r.output_tokens)) for r in wl.itertuples()],
        block_size=BS, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, chunked_prefill=chunked, prefix_caching=False,
        max_model_len=max_model_len, record_slots=False,
        num_speculative_tokens=spec.num_tokens, spec_method=spec.method, accepted=accepted,
        async_scheduling=async_scheduling,
    )
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                       chunked_prefill=chunked, async_scheduling=async_scheduling,
                       speculative=spec,
                       step_time=StepTime(base_s=1.0))
    def fresh():
        return make_allocator("paged", capacity=(num_blocks + 1) * BS * BYTES_PER_TOKEN,
                              bytes_per_token=BYTES_PER_TOKEN, max_model_len=max_model_len,
                              block_size=BS)
    trace: list[dict] = []
    ref = reference(wl, fresh(), cfg, trace)
    fast = run(wl, fresh(), cfg).requests.set_index("request_id")
    last = max(v["finished_step"] for v in oracle.requests.values())
    for rid, r in ref["requests"].items():  # the same counts were used, clipped the same way
        # (async: the driver's fake model also verifies the drafts of a finished request's
        # extra step, whose output vLLM discards; the driver stops before the output of the
        # run's very last step is applied)
        v = oracle.requests[rid]
        unapplied = int(async_scheduling and v["finished_step"] == last and r["discarded"] > 0)
        assert r["verified"] + r["discarded"] - unapplied == len(v["accepted"]), rid
        assert (fast.loc[rid, "first_token_s"], fast.loc[rid, "finished_s"],
                fast.loc[rid, "preemptions"]) == (r["first"], r["finished"], r["preemptions"])
    return oracle, trace, ref


def same(oracle, trace, ref, async_scheduling: bool) -> int:
    """Every step equal (async: the steps that schedule tokens, by the driver's clock)."""
    return (same_async if async_scheduling else assert_same)(oracle, trace, ref)


def preempted(oracle) -> int:
    return sum(s["preempted"] for s in oracle.steps)


@pytest.mark.parametrize(("method", "k", "rate"),
                         [("eagle", 3, 0.7), ("ngram", 4, 0.5), ("draft_model", 2, 0.8),
                          ("eagle", 1, 0.9)])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_synthetic_under_memory_pressure(method, k, rate, chunked, async_scheduling):
    """200 requests on 150 blocks of 16: preemptions, drafts cut by the token budget, the
    lookahead's extra blocks; async: rejections applied a step late and a finished request's
    extra step; identical at every step."""
    spec = Speculative(method, k, rate=rate, seed=3)
    oracle, trace, ref = both(synthetic(200, 1), spec, 150, 24, 256 if chunked else 1024,
                              chunked, async_scheduling=async_scheduling)
    assert preempted(oracle) > 10
    assert same(oracle, trace, ref, async_scheduling) > 1000


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_small_token_budget_cuts_drafts(async_scheduling):
    """32 sequences and a budget of 64 tokens, k 4: most steps cut some decoders' drafts or
    leave decoders without a token."""
    spec = Speculative("eagle", 4, distribution=((0, 1.0), (2, 1.0), (4, 2.0)), seed=5)
    oracle, trace, ref = both(synthetic(120, 2), spec, 400, 32, 64, True,
                              async_scheduling=async_scheduling)
    assert sum(1 for s in oracle.steps if s["scheduled_tokens"] == 64) > 100
    assert same(oracle, trace, ref, async_scheduling) > 500
