"""`policy: priority`: the waiting queue's order, the fast engine held to the per-iteration
reference (`sim.reference`) under it, what priorities change in a run, and the settings it
refuses. Its agreement with vLLM's scheduler is tests/oracle/test_priority_match.py's."""

from __future__ import annotations

from pathlib import Path
from runpy import run_path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.reference import reference
from kvfrag.sim.waiting import PriorityQueue
from kvfrag.workloads import WorkloadError, load_trace
from kvfrag.workloads.build import build_workload

from kvfrag.config import ScenarioError, load_scenario

#: The fast engine held to the reference, request by request (tests/sim/agreement.py).
AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]

# (the synchronous scheduler, where kvfrag has an async_scheduling key: what the reference
# and the oracle cases compare)
SYNC = {"async_scheduling": False} if "async_scheduling" in EngineConfig.__dataclass_fields__ \
    else {}


def item(idx: int, priority: int, arrival: float) -> SimpleNamespace:
    return SimpleNamespace(idx=idx, priority=priority, arrival=arrival)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["arrive", "preempt", "pop"]),
                              st.integers(-2, 2), st.integers(0, 5)), max_size=60))
def test_queue_is_in_vllms_order(ops):
    """Whatever the arrivals (in time order, ties in any order), preemptions and admissions
    of the head, the queue reads in (priority, arrival, workload order), as vLLM's heap."""
    queue, running, clock, idx = PriorityQueue(), [], 0.0, 0
    for op, priority, dt in ops:
        if op == "arrive":
            clock += dt / 2
            queue.append(item(idx, priority, clock))
            idx += 1
        elif op == "preempt" and running:
            queue.appendleft(running.pop(priority % len(running)))
        elif op == "pop" and queue:
            running.append(queue[0])
            del queue[0]
        keys = [(r.priority, r.arrival, r.idx) for r in queue]
        assert keys == sorted(keys) and len(queue) == len(keys) == queue.n
        assert bool(queue) == bool(keys)
        if keys:
            assert (queue[0].priority, queue[0].arrival, queue[0].idx) == keys[0]
            assert [queue[i].idx for i in range(len(queue))] == [r.idx for r in queue]


def test_queue_index_beyond_its_length_is_an_error():
    queue = PriorityQueue()
    queue.append(item(0, 1, 0.0))
    with pytest.raises(IndexError):
        queue[1]
    with pytest.raises(IndexError):
        del queue[1]


def workload(seed: int, n: int, max_prompt: int, max_output: int, rate: float,
             levels: int = 3, samples: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    # A third of the requests arrive with the one before (ties of arrival time, broken by
    # priority, then workload order). (Not on whole seconds: on the grid of iteration ends
    # the reference's summed times and the stretches' closed forms round either way.)
    gaps = rng.exponential(1 / rate, n) * (rng.random(n) > 1 / 3)
    arrival = np.cumsum(gaps)
    prompts = rng.integers(1, max_prompt + 1, n)
    df = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": arrival,
            "prompt_tokens": prompts,
            "output_tokens": rng.integers(1, max_output + 1, n),
            "n": rng.integers(1, samples + 1, n),
            "hash_ids": [[int(h) for h in rng.integers(0, 2, -(-int(p) // 8))] for p in prompts],
            "priority": rng.integers(-1, levels - 1, n),
        }
    )
    df.attrs["hash_block_tokens"] = 8
    return df


ALLOCATORS = [
    ("paged", {"block_size": 4}),
    ("paged", {"block_size": 16}),
    ("prefix-caching", {"block_size": 4}),
    ("contiguous", {"reserve": "max_model_len"}),
    ("buddy", {"reserve": "pow2"}),
]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(ALLOCATORS))),
    n=st.integers(1, 25),
    capacity_tokens=st.integers(64, 600),
    chunked=st.booleans(),
    samples=st.sampled_from([1, 1, 3]),
    max_seqs=st.sampled_from([8, 8, 3]),
    watermark=st.sampled_from([0.0, 0.0, 0.1]),
    long_prefill=st.sampled_from([0, 0, 16, 48]),
    linear=st.booleans(),
    asynchronous=st.booleans(),
)
def test_fast_engine_matches_per_iteration_reference(
    seed, which, n, capacity_tokens, chunked, samples, max_seqs, watermark, long_prefill, linear,
    asynchronous,
):
    """Under policy priority, synchronous or async, the fast engine keeps the reference's
    every request record, the simulated time and the time-averaged parts (its stretches stop
    at every arrival, its victims are chosen by priority, a victim's prefill chunk goes back to
    the budget, decoders walk one by one at a shortage)."""
    kind, opts = ALLOCATORS[which]
    b, mml = 96, 128
    wl = workload(seed, n, 100, 80, rate=2.0, samples=samples)
    cfg = EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=40 if chunked else 160,
        chunked_prefill=chunked,
        watermark=watermark,
        long_prefill_token_threshold=long_prefill,
        policy="priority",
        step_time=StepTime(0.05, 1e-3, 1e-4) if linear else StepTime(0.05),
        async_scheduling=asynchronous,
    )

    def fresh():
        return make_allocator(
            kind, capacity=capacity_tokens * b + 37, bytes_per_token=b, max_model_len=mml, **opts
        )

    fast = run(wl, fresh(), cfg)
    slow = reference(wl, fresh(), cfg)
    AGREE(fast, slow, parts=[*PARTS, "internal_overreservation"], columns=("priority",))


def pressure(priority: np.ndarray | None = None) -> pd.DataFrame:
    """40 requests arriving over 20 s onto a pool that holds a few: requests wait and are
    preempted."""
    rng = np.random.default_rng(7)
    n = 40
    df = pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.sort(rng.integers(0, 20, n)).astype(float),
        "prompt_tokens": rng.integers(50, 400, n),
        "output_tokens": rng.integers(50, 300, n),
    })
    if priority is not None:
        df["priority"] = priority
    return df


def serve(wl: pd.DataFrame, policy: str):
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, chunked_prefill=True,
                       policy=policy, step_time=StepTime(base_s=1.0), **SYNC)
    alloc = make_allocator("paged", capacity=101 * 16 * 8, bytes_per_token=8,
                           max_model_len=1024, block_size=16)
    return run(wl, alloc, cfg)


def test_higher_priority_waits_less_and_is_preempted_less():
    """Every fourth request at priority 0, the others at 1: under policy priority the first
    wait less for their first token and are preempted less than the others, where FCFS treats
    them alike; with one priority for all, the queue is FCFS's (the first admissions equal)."""
    urgent = np.arange(40) % 4 == 0
    wl = pressure(np.where(urgent, 0, 1))
    fifo, prio = serve(wl, "fcfs").requests, serve(wl, "priority").requests
    assert (prio["status"] == "completed").all() and prio["preemptions"].sum() > 0
    assert prio["ttft_s"][urgent].mean() < fifo["ttft_s"][urgent].mean()
    assert prio["ttft_s"][urgent].mean() < prio["ttft_s"][~urgent].mean()
    assert prio["preemptions"][urgent].sum() < prio["preemptions"][~urgent].sum()
    assert list(prio["priority"]) == list(wl["priority"])
    assert "priority" not in fifo.columns or (fifo["priority"] == wl["priority"]).all()
    same = serve(pressure(), "priority").requests
    first = serve(pressure(), "fcfs").requests
    assert (same["admitted_s"].iloc[:8] == first["admitted_s"].iloc[:8]).all()


def test_a_stretch_stops_at_an_arrival_that_jumps_the_head():
    """A long-running request, one waiting for memory, and one of a higher priority arriving
    meanwhile, mid-stretch: it is admitted at its arrival, before the waiting one (the stretch
    stopped there); FCFS keeps it behind the waiting one."""
    wl = pd.DataFrame({
        "request_id": [0, 1, 2],
        "arrival_s": [0.0, 1.0, 5.0],
        "prompt_tokens": [600, 600, 100],
        "output_tokens": [200, 50, 50],
        "priority": [0, 1, 0],
    })
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=1024, chunked_prefill=False,
               step_time=StepTime(base_s=1.0), **SYNC)
    alloc = dict(capacity=61 * 16 * 8, bytes_per_token=8, max_model_len=1024, block_size=16)
    prio = run(wl, make_allocator("paged", **alloc), EngineConfig(policy="priority", **cfg))
    fifo = run(wl, make_allocator("paged", **alloc), EngineConfig(**cfg))
    p, f = prio.requests.set_index("request_id"), fifo.requests.set_index("request_id")
    assert p.loc[2, "admitted_s"] == 5.0 < p.loc[1, "admitted_s"]
    assert f.loc[1, "admitted_s"] <= f.loc[2, "admitted_s"] and f.loc[2, "admitted_s"] > 5.0
    slow = reference(wl, make_allocator("paged", **alloc), EngineConfig(policy="priority", **cfg))
    assert [slow["requests"][i]["admitted"] for i in range(3)] == list(p["admitted_s"])


def test_config_refuses_an_unknown_policy_and_skip_admission():
    with pytest.raises(ValueError, match="policy must be fcfs or priority"):
        EngineConfig(policy="lifo")
    with pytest.raises(ValueError, match="admission must be fcfs"):
        EngineConfig(policy="priority", admission="skip")


SCENARIO = """\
name: t
model: opt-13b
kv_budget: 12GiB
max_model_len: 2048
workload:
  synthetic:
    count: 20
    prompt: {kind: uniform, low: 10, high: 200}
    output: {kind: uniform, low: 10, high: 200}
allocators:
  - {label: paged-16, kind: paged, block_size: 16}
engine:
  step_time: {base_s: 0.02}
"""


def load(tmp_path, extra: str):
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO + extra)
    return load_scenario(path).scenario


def test_scenario_policy_reaches_the_engine(tmp_path):
    assert load(tmp_path, "").engine_config().policy == "fcfs"
    assert load(tmp_path, "  policy: priority\n").engine_config().policy == "priority"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ("  policy: lifo\n", r"s\.yaml:14: engine\.policy: Input should be 'fcfs' or 'priority'$"),
        ("  policy: priority\n  admission: skip\n",
         r"s\.yaml:15: engine\.admission: must be fcfs with engine\.policy priority "),
        ("  max_num_partial_prefills: 2\n",
         r"s\.yaml:14: engine\.max_num_partial_prefills: vLLM 0\.33's v1 scheduler has no such "
         r"limit"),
        ("  max_long_partial_prefills: 1\n",
         r"s\.yaml:14: engine\.max_long_partial_prefills: vLLM 0\.33's v1 scheduler has no such "
         r"limit"),
    ],
)
def test_scenario_refusals_are_one_line_naming_the_field(tmp_path, lines, expected):
    """A bad policy, skip admission with priority, and vLLM's V0 limits on partial prefills
    (which vLLM 0.33's v1 scheduler does not have) are refused in one line."""
    with pytest.raises(ScenarioError, match=expected) as info:
        load(tmp_path, lines)
    assert "\n" not in str(info.value)


def test_trace_priorities_reach_the_request_table(tmp_path):
    """A kvfrag-layout trace's priority column is read (any sign); a bad value is one line
    naming the file, row and column."""
    good = tmp_path / "t.csv"
    good.write_text("arrival_s,prompt_tokens,output_tokens,priority\n0,10,5,2\n1,10,5,-3\n")
    assert list(load_trace(good).requests["priority"]) == [2, -3]
    other = tmp_path / "o.csv"  # (another layout: the column map names it)
    other.write_text("t,in,out,prio\n0,10,5,4\n1,10,5,0\n")
    mapped = load_trace(other, format="csv", time_unit="s", columns={
        "arrival": "t", "prompt_tokens": "in", "output_tokens": "out", "priority": "prio"})
    assert list(mapped.requests["priority"]) == [4, 0]
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens,priority\n0,10,5,2\n1,10,5,1.5\n")
    with pytest.raises(WorkloadError, match=r"bad\.csv: row 2 \(line 3\), column priority: 1\.5 "
                                            r"is not a whole number"):
        load_trace(bad)


def test_synthetic_priorities_are_drawn_last(tmp_path):
    """`synthetic.priority` draws each request's priority by the relative weights given, after
    every other column (the table is otherwise the one drawn without it); a bad pair is
    refused in one line naming the field."""
    output = "    output: {kind: uniform, low: 10, high: 200}\n"

    def table(extra: str) -> pd.DataFrame:
        path = tmp_path / "s.yaml"
        path.write_text(SCENARIO.replace(output, output + extra))
        spec = load_scenario(path).scenario
        return build_workload(spec.workload, tmp_path, np.random.default_rng(3)).requests

    plain = table("")
    drawn = table("    priority: [[0, 1], [7, 3]]\n")
    assert drawn.drop(columns="priority").equals(plain)
    assert sorted(set(drawn["priority"])) == [0, 7] and drawn["priority"].dtype == np.int64
    with pytest.raises(ScenarioError, match=r"s\.yaml:10: workload\.synthetic\.priority\[0\]\[1\]: "
                                            r"must be a number above 0"):
        table("    priority: [[0, 0]]\n")


@pytest.mark.parametrize("n", [40, 200])
def test_event_count_independent_of_output_length(n):
    """Under policy priority, as under FCFS: all 40 fit at once, events are exactly the same
    with outputs twice as long; 200 queue (by priority): events stay O(requests)."""
    rng = np.random.default_rng(7)
    wl = pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.zeros(n),
        "prompt_tokens": rng.integers(10, 200, n),
        "output_tokens": rng.integers(10, 300, n),
        "priority": rng.integers(0, 3, n),
    })

    def events(w: pd.DataFrame) -> int:
        alloc = make_allocator("paged", capacity=40 * 2048 * 64, bytes_per_token=64,
                               max_model_len=2048, block_size=16)
        cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096, policy="priority")
        result = run(w, alloc, cfg)
        assert result.summary["preemptions"] == 0
        return result.summary["events"]

    short, long = events(wl), events(wl.assign(output_tokens=wl["output_tokens"] * 2))
    if n == 40:
        assert short == long
    else:
        assert short <= 3 * n and long <= 3 * n


@pytest.mark.parametrize(("kind", "asynchronous"),
                         [("paged", False), ("prefix-caching", True)], ids=["paged", "prefix"])
def test_allocation_log_replays_exactly(kind, asynchronous):
    """The allocation log of a priority run (decoders walking one by one at a shortage, victims
    growing before they are freed) replays on CPU to the byte, as `kvfrag validate` does."""
    pytest.importorskip("torch")
    from kvfrag.validate.outcome import Outcome
    from kvfrag.validate.replay import replay_log

    bpt, budget = 32, 24 * 1024
    rng = np.random.default_rng(3)
    n = 45
    wl = pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": np.sort(rng.uniform(0, 2.0, n)),
        "prompt_tokens": rng.integers(1, 150, n),
        "output_tokens": rng.integers(1, 100, n),
        "priority": rng.integers(0, 3, n),
    })
    if kind == "prefix-caching":  # (prompts sharing their first blocks)
        wl["hash_ids"] = [[int(i % 3)] + [1000 + 100 * i + c for c in range(-(-p // 8) - 1)]
                          for i, p in enumerate(wl["prompt_tokens"])]
        wl.attrs["hash_block_tokens"] = 8
    alloc = make_allocator(kind, capacity=budget, bytes_per_token=bpt, max_model_len=256,
                           block_size=8)
    result = run(wl, alloc, EngineConfig(max_num_seqs=32, max_num_batched_tokens=512,
                                         log_allocations=True, policy="priority",
                                         async_scheduling=asynchronous))
    assert result.summary["preemptions"] > 0
    out = replay_log(result.log, Outcome("x", kind, "paged", "cpu", budget), bpt, "cpu", 8)
    assert out.status == "pass", out.first_fail
    assert out.corrupt == 0 and out.problems == 0
