"""The engine against a plain per-iteration reference stepper, and the seed checks.

The reference below visits every iteration and sums account() x dt one iteration at a time:
no stretches, no closed forms. The fast engine must agree with it record for record.
"""

from __future__ import annotations

import gc
import math
from dataclasses import replace
from pathlib import Path
from runpy import run_path

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Reason, Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.engine_records import REJECT_REASONS
from kvfrag.sim.geometry import KVGeometry, preset
from kvfrag.sim.reference import reference
from kvfrag.sim.units import parse_size

NEVER = {Reason.PROMPT_TOO_LONG, Reason.TOO_LARGE}


def random_workload(
    seed: int,
    n: int,
    max_prompt: int,
    max_output: int,
    rate: float,
    samples: int = 1,
    column: str = "n",
):
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    prompts = rng.integers(1, max_prompt + 1, n)
    # Prefix hashes per 8-token chunk from a tiny alphabet, so that prefixes repeat.
    hashes = [[int(h) for h in rng.integers(0, 2, -(-int(p) // 8))] for p in prompts]
    df = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": arrival - arrival[0] if rng.random() < 0.5 else arrival,
            "prompt_tokens": prompts,
            "output_tokens": rng.integers(1, max_output + 1, n),
            column: rng.integers(1, samples + 1, n),
            "hash_ids": hashes,
        }
    )
    df.attrs["hash_block_tokens"] = 8
    return df


ROWS_24 = KVGeometry("rows-24", layers=2, kv_heads=1, head_dim=12, dtype_bytes=2)
ALLOCATORS = [
    ("paged", {"block_size": 4}),
    ("paged", {"block_size": 16}),
    ("paged", {"block_size": 1}),
    ("contiguous", {"reserve": "max_model_len"}),
    ("contiguous", {"reserve": "oracle", "placement": "best-fit"}),
    ("contiguous", {"reserve": "pow2", "placement": "next-fit"}),
    ("buddy", {"reserve": "pow2"}),
    ("buddy", {"reserve": "max_model_len"}),
    ("prefix-caching", {"block_size": 4}),
    ("prefix-caching", {"block_size": 8}),
    # vAttention pages with token rows of 24 bytes straddling them (b = 96 = 2 x 2 x 24):
    # 3 pages per 2 tokens, 3 pages per 5 tokens; and whole rows (2 tokens a page).
    ("vattention", {"page_size": 16, "geometry": ROWS_24}),
    ("vattention", {"page_size": 40, "geometry": ROWS_24}),
    ("vattention", {"page_size": 48, "geometry": ROWS_24}),
]


#: A hardware-shaped step time (tests/sim/table_time.py).
TABLE = run_path(str(Path(__file__).with_name("table_time.py")))["TABLE"]
#: The fast engine held to the reference, request by request (tests/sim/agreement.py).
AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(ALLOCATORS))),
    n=st.integers(1, 25),
    capacity_tokens=st.integers(64, 600),
    chunked=st.booleans(),
    skip=st.booleans(),
    linear=st.booleans(),
    table=st.booleans(),
    samples=st.sampled_from([1, 1, 3]),
    beams=st.booleans(),
    max_seqs=st.sampled_from([8, 8, 2]),  # 2: groups of 3 never fit a batch
    watermark=st.sampled_from([0.0, 0.0, 0.1]),
    long_prefill=st.sampled_from([0, 0, 16, 48]),
    reserve=st.sampled_from([True, True, False]),
    max_time=st.sampled_from([None, None, None, 2.53]),  # a run stopped mid-stretch (not at a
    # multiple of a step: there, rounding decides whether one more iteration starts)
)
# Beams hold more blocks at their fork than at their end: a prompt whose fork exceeds the pool
# must be rejected, not wait forever (the engine stalled here once).
@example(seed=54, which=0, n=5, capacity_tokens=64, chunked=True, skip=False, linear=False,
         table=False, samples=3, beams=True, max_seqs=8, watermark=0.0, long_prefill=0,
         reserve=True, max_time=None)
def test_fast_engine_matches_per_iteration_reference(
    seed, which, n, capacity_tokens, chunked, skip, linear, table, samples, beams, max_seqs,
    watermark, long_prefill, reserve, max_time,
):
    kind, opts = ALLOCATORS[which]
    if kind == "vattention" and opts["page_size"] % 24:
        samples = 1  # pages that token rows straddle are not combined with sample groups
    b = 96
    mml = 128
    wl = random_workload(
        seed, n, 100, 80, rate=2.0, samples=samples, column="beam_width" if beams else "n"
    )
    cfg = EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=40 if chunked else 160,
        chunked_prefill=chunked,
        admission="skip" if skip else "fcfs",
        lookahead=3,
        watermark=watermark,
        long_prefill_token_threshold=long_prefill,
        reserve_full_isl=reserve,
        step_time=TABLE if table else StepTime(0.05, 1e-3, 1e-4) if linear else StepTime(0.05),
        max_time_s=max_time,
    )

    def fresh():
        return make_allocator(
            kind, capacity=capacity_tokens * b + 37, bytes_per_token=b, max_model_len=mml, **opts
        )

    fast = run(wl, fresh(), cfg)
    slow = reference(wl, fresh(), cfg)
    AGREE(fast, slow, parts=[*PARTS, "internal_overreservation"])
    assert sum(fast.summary[f"{p}_frac"] for p in PARTS) == pytest.approx(1.0, abs=1e-12)
    split = fast.summary["internal_overreservation_frac"] + fast.summary["internal_rounding_frac"]
    assert split == pytest.approx(fast.summary["internal_frac"], abs=1e-12)


def at_once(n: int, prompt: int, output: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.zeros(n),
            "prompt_tokens": np.full(n, prompt),
            "output_tokens": np.full(n, output),
        }
    )


@pytest.mark.parametrize(
    ("kind", "opts", "expected"),
    [("contiguous", {"reserve": "max_model_len"}, 46), ("paged", {"block_size": 16}, 378)],
)
def test_seed_50gb_llama3_8b(kind, opts, expected):
    alloc = make_allocator(
        kind,
        capacity=parse_size("50GB"),
        bytes_per_token=preset("llama-3-8b").bytes_per_token,
        max_model_len=8192,
        **opts,
    )
    cfg = EngineConfig(max_num_seqs=1000, max_num_batched_tokens=1_000_000)
    result = run(at_once(1000, 999, 1), alloc, cfg)
    assert result.summary["max_running"] == expected
    assert result.summary["completed"] == 1000
    assert result.timeseries["running"].max() == expected


def test_opt13b_buddy_worst_case_strands_memory_as_external():
    alloc = make_allocator(
        "buddy",
        capacity=parse_size("12GiB"),
        bytes_per_token=preset("opt-13b").bytes_per_token,
        max_model_len=2048,
        reserve="max_model_len",
    )
    rng = np.random.default_rng(1)
    n = 60
    wl = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.zeros(n),
            "prompt_tokens": rng.integers(20, 400, n),
            "output_tokens": rng.integers(20, 400, n),
        }
    )
    # (synchronous: async, a freed slot is seen one iteration after it is freed)
    result = run(wl, alloc, EngineConfig(max_num_batched_tokens=4096, async_scheduling=False))
    assert result.summary["max_running"] == 7
    saturated = result.timeseries[result.timeseries["waiting"] > 0]
    assert len(saturated) > 0
    # 15,728 slots hold 7 blocks of 2,048; the 1,392 left are free but fit no request.
    assert (saturated["usable_free_bytes"] == 0).all()
    stranded = (15728 - 7 * 2048) * preset("opt-13b").bytes_per_token
    assert (saturated[saturated["running"] == 7]["external_bytes"] >= stranded).all()
    assert result.summary["external_frac"] > 0.05


def test_conservation_and_truncation():
    alloc = make_allocator(
        "contiguous", capacity=200 * 64, bytes_per_token=64, max_model_len=100, reserve="pow2"
    )
    wl = random_workload(3, 40, max_prompt=120, max_output=60, rate=5.0)
    result = run(wl, alloc, EngineConfig(max_num_seqs=4, max_num_batched_tokens=128))
    s = result.summary
    assert s["completed"] + s["rejected"] + s["unfinished"] == len(wl)
    assert s["unfinished"] == 0
    req = result.requests
    rejected = req[req["status"] == "rejected"]
    assert (rejected["prompt_tokens"] >= 100).all()
    assert (rejected["reason"] == "prompt_too_long").all()
    done = req[req["status"] == "completed"]
    # vLLM's slots: P + O - 1 at the end (the last sampled token is never stored); a request
    # ends at its reservation's last slot, with the token it samples there.
    final = done["prompt_tokens"] + done["output_tokens"] - 1
    cap = np.minimum(2 ** np.ceil(np.log2(final)), 100)
    expected = np.minimum(done["output_tokens"], cap - done["prompt_tokens"] + 1)
    assert (done["generated_tokens"] == expected).all()
    assert s["generated_tokens"] == expected.sum()


def test_determinism():
    wl = random_workload(5, 50, max_prompt=300, max_output=200, rate=3.0)

    def once():
        alloc = make_allocator("paged", capacity=4000 * 64, bytes_per_token=64, max_model_len=512)
        return run(wl, alloc, EngineConfig(max_num_batched_tokens=1024))

    a, b = once(), once()
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.timeseries, b.timeseries)
    assert a.summary == b.summary


@pytest.mark.parametrize(("kind", "opts"), ALLOCATORS)
def test_run_makes_little_cyclic_garbage_and_restores_the_collector(kind, opts):
    """The engine pauses the cyclic collector for a run, which is sound only while a run makes
    (almost) no cyclic garbage: what a collection finds after it must not grow with the
    workload. The collector's state is left as found."""

    def garbage(n: int) -> int:
        wl = random_workload(7, n, max_prompt=200, max_output=100, rate=5.0)
        alloc = make_allocator(kind, capacity=3000 * 96, bytes_per_token=96, max_model_len=512,
                               **opts)
        gc.collect()
        result = run(wl, alloc, EngineConfig(max_num_batched_tokens=1024))
        assert gc.isenabled()
        assert result.summary["completed"] > 0
        del result, alloc
        return gc.collect()

    small, large = garbage(20), garbage(400)
    assert large <= small + 20, (small, large)
    gc.disable()
    try:
        wl = random_workload(8, 10, max_prompt=50, max_output=20, rate=5.0)
        run(wl, make_allocator(kind, capacity=3000 * 96, bytes_per_token=96,
                               max_model_len=512, **opts))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_stopped_run_restores_the_collector():
    wl = random_workload(9, 200, max_prompt=200, max_output=500, rate=5.0)
    alloc = make_allocator("paged", capacity=3000 * 64, bytes_per_token=64, max_model_len=512)

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(wl, alloc, EngineConfig(max_num_batched_tokens=1024), progress=stop)
    assert gc.isenabled()


NAMING = [(k, o) for k, o in ALLOCATORS if k in ("paged", "prefix-caching", "vattention")]


@pytest.mark.parametrize(("kind", "opts"), NAMING)
def test_block_ids_left_unnamed_change_no_record(kind, opts):
    """Without an allocation log the engine lets the allocator leave block ids unnamed
    (`defer_block_ids`): the records are those of a run that names (and logs) every id."""
    samples = 1 if kind == "vattention" and opts["page_size"] % 24 else 3
    wl = random_workload(7, 40, max_prompt=100, max_output=80, rate=4.0, samples=samples)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=160)

    def once(log: bool):
        alloc = make_allocator(kind, capacity=300 * 96, bytes_per_token=96, max_model_len=128,
                               **opts)
        return run(wl, alloc, replace(cfg, log_allocations=log))

    quiet, logged = once(False), once(True)
    assert quiet.summary["preemptions"] > 0  # (ids freed and named again, under pressure)
    pd.testing.assert_frame_equal(quiet.requests, logged.requests)
    pd.testing.assert_frame_equal(quiet.timeseries, logged.timeseries)
    assert {k: v for k, v in quiet.summary.items() if "wall" not in k} == {
        k: v for k, v in logged.summary.items() if "wall" not in k
    }


def test_deferred_block_ids_are_named_when_asked():
    alloc = make_allocator("paged", capacity=64 * 10, bytes_per_token=1, max_model_len=64,
                           block_size=16)
    alloc.defer_block_ids()
    a, b = Request(0, 20, 10), Request(1, 40, 10)
    grant = alloc.admit(a)
    assert grant and grant.blocks == ()  # (counted, not named)
    assert alloc.admit(b) and alloc.free_blocks() == 40 - 1 - 5  # (less the null block)
    alloc.free(0)
    table = alloc.block_table(1)
    assert len(table) == 3 and len(set(table)) == 3
    alloc.step(10)  # 50 tokens: a fourth block
    assert len(alloc.block_table(1)) == 4 and alloc.block_table(1)[:3] == table


@pytest.mark.parametrize(
    ("kind", "opts"), [("contiguous", {"reserve": "max_model_len"}), ("paged", {"block_size": 16})]
)
@pytest.mark.parametrize("n", [40, 200])
def test_event_count_independent_of_output_length(kind, opts, n):
    """All 40 fit at once: events are exactly the same. 200 queue: events stay O(requests)."""
    rng = np.random.default_rng(7)
    wl = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.zeros(n),
            "prompt_tokens": rng.integers(10, 200, n),
            "output_tokens": rng.integers(10, 300, n),
        }
    )
    longer = wl.assign(output_tokens=wl["output_tokens"] * 2)

    def events(w):
        alloc = make_allocator(
            kind, capacity=40 * 2048 * 64, bytes_per_token=64, max_model_len=2048, **opts
        )
        result = run(w, alloc, EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096))
        assert result.summary["preemptions"] == 0
        return result.summary["events"]

    short, long = events(wl), events(longer)
    if n == 40:
        assert short == long
    else:
        assert short <= 3 * n and long <= 3 * n


def test_paged_preempts_newest_and_recomputes():
    # Two requests that together need more blocks than exist: the newer one is preempted.
    alloc = make_allocator("paged", capacity=10 * 4 * 8, bytes_per_token=8, max_model_len=64,
                           block_size=4)
    wl = at_once(2, 8, 20)
    result = run(wl, alloc, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))
    req = result.requests.set_index("request_id")
    assert (req["status"] == "completed").all()
    assert req.loc[1, "preemptions"] >= 1
    assert req.loc[0, "preemptions"] == 0
    assert result.summary["recomputed_tokens"] == req["recomputed_tokens"].sum() > 0


def test_static_batching_frees_together():
    alloc = make_allocator("paged", capacity=1000 * 8, bytes_per_token=8, max_model_len=256)
    wl = pd.DataFrame(
        {
            "request_id": [0, 1, 2],
            "arrival_s": [0.0, 0.0, 0.0],
            "prompt_tokens": [10, 10, 10],
            "output_tokens": [5, 50, 5],
        }
    )
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, batching="static")
    result = run(wl, alloc, cfg)
    req = result.requests.set_index("request_id")
    # The third request waits for the whole first batch, including the long member.
    assert req.loc[2, "admitted_s"] >= req.loc[1, "finished_s"]
    assert req.loc[0, "finished_s"] < req.loc[1, "finished_s"]


def test_static_batch_ends_when_its_last_runner_is_preempted():
    """A static batch whose only running member is preempted is over: its finished members
    free their memory, and the preempted one starts the next batch (no stall)."""
    alloc = make_allocator(
        "paged", capacity=31 * 8, bytes_per_token=8, max_model_len=64, block_size=1
    )  # 30 blocks and the null block
    wl = pd.DataFrame(
        {
            "request_id": [0, 1],
            "arrival_s": [0.0, 0.0],
            "prompt_tokens": [10, 10],
            "output_tokens": [2, 15],  # 11 and 24 slots: together more than 30 blocks
        }
    )
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, batching="static")
    result = run(wl, alloc, cfg)
    req = result.requests.set_index("request_id")
    assert (req["status"] == "completed").all()
    assert req.loc[1, "preemptions"] == 1 and req.loc[1, "recomputed_tokens"] == 19
    # The short request held its memory until its batch ended, at the preemption.
    assert req.loc[0, "finished_s"] < req.loc[0, "released_s"] < req.loc[1, "finished_s"]


def test_groups_wider_than_a_batch_are_rejected():
    alloc = make_allocator("paged", capacity=1000 * 8, bytes_per_token=8, max_model_len=256)
    wl = at_once(3, 10, 5)
    wl["n"] = [1, 4, 2]
    result = run(wl, alloc, EngineConfig(max_num_seqs=3, max_num_batched_tokens=256))
    req = result.requests.set_index("request_id")
    assert list(req["status"]) == ["completed", "rejected", "completed"]
    assert req.loc[1, "reason"] == "too_many_sequences"
    assert result.summary["rejected"] == 1


def test_closed_loop_users_wait_for_their_previous_request():
    wl = pd.DataFrame(
        {
            "request_id": [0, 1, 2, 3],
            "arrival_s": [0.0, 0.0, math.nan, math.nan],
            "prompt_tokens": [10, 10, 10, 10],
            "output_tokens": [4, 8, 4, 4],
            "user_id": [0, 1, 0, 1],
            "think_s": [1.0, 1.0, 1.0, 1.0],
        }
    )
    alloc = make_allocator("paged", capacity=1000 * 8, bytes_per_token=8, max_model_len=256)
    result = run(wl, alloc, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256))
    req = result.requests.set_index("request_id")
    assert req.loc[2, "arrival_s"] == pytest.approx(req.loc[0, "finished_s"] + 1.0)
    assert req.loc[3, "arrival_s"] == pytest.approx(req.loc[1, "finished_s"] + 1.0)
    assert (req["status"] == "completed").all()


def test_skip_admission_lets_small_requests_past_a_blocked_head():
    b, mml = 8, 100
    wl = pd.DataFrame(
        {
            "request_id": [0, 1, 2],
            "arrival_s": [0.0, 0.0, 0.0],
            "prompt_tokens": [60, 90, 10],
            "output_tokens": [30, 5, 5],
        }
    )

    def admitted(admission):
        alloc = make_allocator(
            "contiguous", capacity=150 * b, bytes_per_token=b, max_model_len=mml, reserve="oracle"
        )
        cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=200, admission=admission)
        return run(wl, alloc, cfg).requests.set_index("request_id")["admitted_s"]

    fcfs, skip = admitted("fcfs"), admitted("skip")
    assert fcfs[2] >= fcfs[1] > 0
    assert skip[2] == 0.0 < skip[1]


def test_rejects_what_never_fits():
    alloc = make_allocator("contiguous", capacity=50 * 8, bytes_per_token=8, max_model_len=100)
    wl = at_once(3, 20, 5)
    result = run(wl, alloc, EngineConfig(max_num_seqs=8, max_num_batched_tokens=100))
    assert result.summary["rejected"] == 3
    assert set(result.requests["reason"]) == {"too_large"}


def _parts(summary: dict) -> list[float]:
    return [summary[f"{p}_frac"] for p in PARTS]


@pytest.mark.parametrize(
    ("kind", "opts", "budget_tokens", "n", "reason"),
    [
        # A tiny KV budget: no request fits even the empty allocator.
        ("contiguous", {"reserve": "max_model_len"}, 50, 1, "too_large"),
        ("paged", {"block_size": 16}, 32, 1, "too_large"),
        ("buddy", {"reserve": "pow2"}, 16, 1, "too_large"),
        # Room enough, but every request has more samples than a batch may hold.
        ("contiguous", {"reserve": "oracle"}, 1000, 4, "too_many_sequences"),
        ("paged", {"block_size": 16}, 1000, 4, "too_many_sequences"),
    ],
)
def test_every_request_rejected_at_t0_reports_the_empty_allocator(
    kind, opts, budget_tokens, n, reason
):
    """No time passes, so there is nothing to average over: the summary reports the empty
    allocator's own account, whose parts sum to 1, and why every request was rejected."""
    b, prompt, output = 8, 40, 20

    def fresh():
        return make_allocator(
            kind, capacity=budget_tokens * b, bytes_per_token=b, max_model_len=128, **opts
        )

    wl = at_once(5, prompt, output)
    wl["n"] = n
    result = run(wl, fresh(), EngineConfig(max_num_seqs=2, max_num_batched_tokens=256))
    s = result.summary
    assert s["sim_time_s"] == 0.0 and s["events"] == 0 and len(result.timeseries) == 0
    assert abs(sum(_parts(s)) - 1.0) <= 1e-12
    empty = fresh().account(Request(-1, prompt, output))  # the probe: the median request
    assert _parts(s) == [getattr(empty, p) / empty.capacity for p in PARTS]
    assert not {"free", "allocator"} & set(s)  # (schema 2: copies of usable_free_frac, kind)
    assert s["requests"] == s["rejected"] == 5 and s["completed"] == s["unfinished"] == 0
    assert set(result.requests["reason"]) == {reason}
    counts = {f"rejected_{why}": 5 if why == reason else 0 for why in REJECT_REASONS}
    assert {k: s[k] for k in counts} == counts
    # Nothing ran: no time-averaged occupancy to report, no share of allocated memory.
    assert s["mean_running"] == 0.0 and s["max_running"] == 0
    assert math.isnan(s["kv_utilization"])
    assert s["throughput_tok_s"] == 0.0 and math.isnan(s["p99_latency_s"])


def test_empty_workload_reports_the_empty_allocator():
    alloc = make_allocator("paged", capacity=1024 * 8, bytes_per_token=8, max_model_len=256)
    s = run(at_once(0, 1, 1), alloc, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256))
    # 64 whole blocks: all usable but the null block, which is external
    assert _parts(s.summary) == [0.0, 0.0, 0.0, 1 / 64, 63 / 64]
    assert s.summary["rejected"] == 0
    assert all(s.summary[f"rejected_{why}"] == 0 for why in REJECT_REASONS)


def test_some_requests_rejected_for_each_reason():
    """A run that rejects some requests for each reason and serves the rest: the parts are
    time averages that sum to 1, and the per-reason counts add up to `rejected`."""
    alloc = make_allocator(
        "contiguous", capacity=100 * 8, bytes_per_token=8, max_model_len=120, reserve="oracle"
    )
    wl = pd.DataFrame(
        {
            "request_id": np.arange(6),
            "arrival_s": [0.0, 0.0, 0.5, 1.0, 1.5, 2.0],
            "prompt_tokens": [20, 130, 30, 100, 10, 25],  # 130 > max_model_len
            "output_tokens": [10, 5, 10, 60, 5, 10],  # 100 + 60, cut to 120 > 100
            "n": [1, 1, 1, 1, 3, 1],  # 3 > max_num_seqs
        }
    )
    result = run(wl, alloc, EngineConfig(max_num_seqs=2, max_num_batched_tokens=256))
    s = result.summary
    assert s["sim_time_s"] > 0
    assert abs(sum(_parts(s)) - 1.0) <= 1e-12
    assert s["completed"] == 3 and s["rejected"] == 3
    assert (s["rejected_prompt_too_long"], s["rejected_too_large"],
            s["rejected_too_many_sequences"]) == (1, 1, 1)
    assert sum(s[f"rejected_{why}"] for why in REJECT_REASONS) == s["rejected"]
    req = result.requests.set_index("request_id")
    assert list(req.loc[[1, 3, 4], "reason"]) == [
        "prompt_too_long", "too_large", "too_many_sequences"
    ]
    assert 0 < s["kv_utilization"] <= 1


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=10, max_num_batched_tokens=5)
    with pytest.raises(ValueError, match="batching"):
        EngineConfig(batching="dynamic")
    with pytest.raises(ValueError, match="take time"):
        StepTime(base_s=0.0)
    alloc = make_allocator("paged", capacity=1000, bytes_per_token=8, max_model_len=512)
    with pytest.raises(ValueError, match="chunked_prefill"):
        run(at_once(1, 5, 5), alloc, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256))


def test_time_to_first_token_and_per_output_token():
    """With 1 s iterations and room for everybody: the prefill iteration gives the first
    token at 1 s, then one token a second (TPOT 1 s); a one-token answer has no TPOT."""
    alloc = make_allocator("paged", capacity=10_000 * 8, bytes_per_token=8, max_model_len=512,
                           block_size=16)
    wl = at_once(3, 10, 5)
    wl.loc[2, "output_tokens"] = 1
    result = run(wl, alloc, EngineConfig(step_time=StepTime(base_s=1.0)))
    req = result.requests.set_index("request_id")
    assert req["ttft_s"].tolist() == [1.0, 1.0, 1.0]
    assert req.loc[0, "tpot_s"] == req.loc[1, "tpot_s"] == 1.0
    assert np.isnan(req.loc[2, "tpot_s"])
    s = result.summary
    assert (s["mean_ttft_s"], s["p99_ttft_s"], s["mean_tpot_s"], s["p90_tpot_s"]) == (
        1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_prompt_over_max_model_len_is_rejected_not_waited_for(chunked):
    """Without chunked prefill the token budget only has to cover max_model_len: a longer
    prompt never fits it, and must be rejected rather than block the queue forever."""
    wl = pd.DataFrame({"request_id": [0, 1, 2], "arrival_s": [0.0, 0.0, 0.0],
                       "prompt_tokens": [50, 300, 40], "output_tokens": [5, 5, 5]})
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, chunked_prefill=chunked)
    alloc = make_allocator("paged", capacity=4096 * 96, bytes_per_token=96, max_model_len=128,
                           block_size=16)
    result = run(wl, alloc, cfg)
    rows = result.requests.set_index("request_id")
    assert rows.loc[1, "status"] == "rejected"
    assert rows.loc[1, "reason"] == "prompt_too_long"
    assert (rows.loc[[0, 2], "status"] == "completed").all()
    slow = reference(wl, make_allocator("paged", capacity=4096 * 96, bytes_per_token=96,
                                        max_model_len=128, block_size=16), cfg)
    assert slow["requests"][1]["status"] == "rejected"
    assert slow["time"] == pytest.approx(result.summary["sim_time_s"], rel=1e-12)


# ------------------------------------------------------------------ time-series chunks
def _rows_frame(rows: list[tuple]) -> pd.DataFrame:
    """What the time series must be: the rows as pandas makes them, parts float64 where any
    row's parts are floats (a decode stretch's), int64 otherwise."""
    from kvfrag.sim.engine_records import _SERIES

    frame = pd.DataFrame(rows, columns=list(_SERIES))
    kinds = {"t_s": "float64", "dt_s": "float64", "iterations": "int64", "running": "int64",
             "waiting": "int64", "largest_hole_bytes": "int64", "frag_blocked": "bool"}
    return frame.astype(kinds)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.booleans(),  # a stretch's row: parts are floats
            st.lists(st.integers(0, 2**50), min_size=5, max_size=5),
            st.integers(0, 2**50),
            st.booleans(),
        ),
        max_size=40,
    ),
    cuts=st.sets(st.integers(0, 40)),
)
def test_rows_in_chunks_equal_rows_at_once(rows, cuts):
    """_Rows converts its rows in chunks (each chunk's parts int64 or float64); wherever the
    chunks are cut, the frame equals the rows converted at once, values and dtypes."""
    from kvfrag.sim.engine_records import _Rows

    chunked, expected = _Rows(), []
    for i, (stretch, parts, hole, blocked) in enumerate(rows):
        if i in cuts:
            chunked.flush()
        values = [p / 3 for p in parts] if stretch else parts
        if stretch:
            chunked.stretches = True
        row = (i * 0.5, 0.25 + i, i % 3, i, 2 * i, *values, hole, blocked)
        for column, value in zip(chunked.columns(), row, strict=True):
            column.append(value)
        expected.append(row)
    frame = chunked.frame()
    if not rows:
        assert frame.empty and list(frame.columns) == list(_rows_frame([]).columns)
        return
    want = _rows_frame(expected)
    if not any(stretch for stretch, *_ in rows):
        want = want.astype(dict.fromkeys((f"{p}_bytes" for p in PARTS), "int64"))
    pd.testing.assert_frame_equal(frame, want, check_exact=True)


def test_engine_refuses_a_budget_beyond_what_it_models():
    """The time series keeps byte counts exact (int64, float64 beside averages: below 2**53):
    an allocator over 1 PiB, which no scenario can ask for, is refused by name."""
    alloc = make_allocator("contiguous", capacity=2**51, bytes_per_token=4, max_model_len=64)
    workload = pd.DataFrame({"arrival_s": [0.0], "prompt_tokens": [4], "output_tokens": [2]})
    with pytest.raises(ValueError, match=r"capacity 2\.0 PiB is larger than kvfrag models"):
        run(workload, alloc, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64))


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"request_id": [3, 5, 3]}, r"^workload request ids are not unique$"),
        ({"request_id": [3, 5, 7], "n": [1, 2, 2], "beam_width": [1, 1, 3]},
         r"^request 7: n and beam_width are both above 1$"),
    ],
)
def test_engine_names_what_is_wrong_with_its_workload(columns, message):
    """The engine's own checks over every request (a workload built by hand, not through
    `workloads`, which checks the same): the request named, nothing run."""
    workload = pd.DataFrame({"arrival_s": [0.0, 1.0, 2.0], "prompt_tokens": [4, 4, 4],
                             "output_tokens": [2, 2, 2], **columns})
    alloc = make_allocator("paged", capacity=2**20, bytes_per_token=4, max_model_len=64)
    with pytest.raises(ValueError, match=message):
        run(workload, alloc, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64))
