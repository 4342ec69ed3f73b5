"""Async scheduling (`EngineConfig.async_scheduling`, `engine.async_scheduling`): the fast engine
against the per-iteration reference, what async changes (a done request's memory and seat held
through the next scheduling, where it may be preempted; a preempted decoder's blocks cached
over its processed tokens), and what it leaves alone (static batching; the hybrid allocator,
not modelled yet). vLLM's AsyncScheduler itself: tests/oracle/test_async_match.py."""

from __future__ import annotations

from pathlib import Path
from runpy import run_path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.reference import reference

from kvfrag.config import ScenarioError, load_scenario

#: The fast engine held to the reference, request by request (tests/sim/agreement.py).
AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]

B = 96  # bytes per token
ALLOCATORS = [
    ("paged", {"block_size": 4}),
    ("paged", {"block_size": 16}),
    ("prefix-caching", {"block_size": 4}),
    ("prefix-caching", {"block_size": 8}),
    ("contiguous", {"reserve": "max_model_len"}),
    ("contiguous", {"reserve": "oracle", "placement": "best-fit"}),
    ("buddy", {"reserve": "pow2"}),
]


def workload(seed: int, n: int, samples: int = 1) -> pd.DataFrame:
    """Requests of up to 100 prompt and 80 output tokens, two a second, with hash ids per
    8-token chunk from a tiny alphabet (prefixes repeat)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, 101, n)
    df = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.cumsum(rng.exponential(0.5, n)),
            "prompt_tokens": prompts,
            "output_tokens": rng.integers(1, 81, n),
            "n": rng.integers(1, samples + 1, n),
            "hash_ids": [[int(h) for h in rng.integers(0, 2, -(-int(p) // 8))] for p in prompts],
        }
    )
    df.attrs["hash_block_tokens"] = 8
    return df


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(ALLOCATORS))),
    n=st.integers(1, 25),
    capacity_tokens=st.integers(64, 600),
    chunked=st.booleans(),
    samples=st.sampled_from([1, 1, 3]),
    long_prefill=st.sampled_from([0, 0, 16]),
    asynchronous=st.booleans(),
)
def test_fast_engine_matches_the_reference(
    seed, which, n, capacity_tokens, chunked, samples, long_prefill, asynchronous
):
    kind, opts = ALLOCATORS[which]
    wl = workload(seed, n, samples)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=40 if chunked else 160,
                       chunked_prefill=chunked, long_prefill_token_threshold=long_prefill,
                       async_scheduling=asynchronous, step_time=StepTime(0.05, 1e-3, 1e-4))

    def fresh():
        return make_allocator(kind, capacity=capacity_tokens * B + 37, bytes_per_token=B,
                              max_model_len=128, **opts)

    fast = run(wl, fresh(), cfg)
    slow = reference(wl, fresh(), cfg)
    AGREE(fast, slow)


def paged(blocks: int, block_size: int = 16):
    """A paged pool of `blocks` usable blocks (and vLLM's null block)."""
    return make_allocator("paged", capacity=(blocks + 1) * block_size * B, bytes_per_token=B,
                          max_model_len=512, block_size=block_size)


def requests(*rows: tuple[float, int, int]) -> pd.DataFrame:
    """(arrival, prompt, output) per request."""
    arrival, prompt, output = zip(*rows, strict=True)
    return pd.DataFrame({"request_id": np.arange(len(rows)), "arrival_s": arrival,
                         "prompt_tokens": prompt, "output_tokens": output})


def one_second(asynchronous: bool, **kw) -> EngineConfig:
    return EngineConfig(async_scheduling=asynchronous, step_time=StepTime(base_s=1.0), **kw)


def test_a_done_request_keeps_its_seat_through_the_next_scheduling():
    """Two seats: request 0 ends at t = 2 (prefill, then one decode step); request 2 waits
    for its seat. Synchronous, it is admitted at t = 2; async, request 0 still holds the seat
    when iteration 2 is scheduled (request 1 decodes in it), so request 2 comes in at t = 3.
    Request 0's finish time is the same."""
    wl = requests((0.0, 10, 2), (0.0, 10, 40), (0.0, 10, 5))
    got = {}
    for asynchronous in (False, True):
        res = run(wl, paged(64), one_second(asynchronous, max_num_seqs=2))
        got[asynchronous] = res.requests.set_index("request_id")
        assert got[asynchronous].loc[0, "finished_s"] == 2.0
    assert got[False].loc[2, "admitted_s"] == 2.0
    assert got[True].loc[2, "admitted_s"] == 3.0


def test_a_done_request_can_be_preempted_and_still_finishes():
    """Four blocks of 16: request 0 (31 tokens, 20 outputs: 50 slots at most) and request 1
    (31 tokens, 2 outputs) hold two each; request 1 is done at t = 2, when request 0 needs a
    third block. Synchronous, request 1's blocks are free by then; async, it still holds them,
    is the newest running request, and is preempted: counted, freed, and completed at the
    same time, never recomputed."""
    wl = requests((0.0, 31, 20), (0.0, 31, 2))
    for asynchronous, preemptions in ((False, 0), (True, 1)):
        res = run(wl, paged(4), one_second(asynchronous, max_num_batched_tokens=512))
        rows = res.requests.set_index("request_id")
        assert rows.loc[1, "status"] == "completed"
        assert rows.loc[1, "finished_s"] == 2.0
        assert rows.loc[1, "preemptions"] == preemptions
        assert rows.loc[1, "recomputed_tokens"] == 0
        assert rows.loc[0, "preemptions"] == 0
        assert res.summary["preemptions"] == preemptions
        slow = reference(wl, paged(4), one_second(asynchronous, max_num_batched_tokens=512))
        assert slow["requests"][1]["preemptions"] == preemptions


def test_a_preempted_decoder_caches_only_its_processed_blocks():
    """Prefix caching: a decoder holding 32 tokens (two full 16-token blocks of its own past
    a 10-token prompt... the first holding prompt and output), preempted while its 32nd
    token's step is in flight, keeps only the first block cached (16 processed tokens of 31);
    freed whole (synchronous), both."""
    found = {}
    for processed in (None, 31):
        a = make_allocator("prefix-caching", capacity=20 * 16 * B, bytes_per_token=B,
                           max_model_len=512, block_size=16)
        req = Request(0, 10, 40, prefix=(1,), prefix_tokens=16)
        assert a.admit(req, 10, decoding=False)
        assert a.grow(0, 22)
        if processed is None:
            a.free(0)
        else:
            a.free_preempted(0, processed)
        found[processed] = a.cached_prefix_tokens(req, 33)  # (resumed: 32 + its last token)
    assert found == {None: 32, 31: 16}


def test_static_batching_ignores_async_scheduling():
    """A static batch frees together once its last member is done: a done member's extra
    step changes nothing, and the engine runs it as it always did."""
    wl = requests(*[(0.0, 20 + 3 * i, 5 + 7 * i) for i in range(6)])
    runs = [run(wl, paged(12), one_second(a, batching="static")) for a in (False, True)]
    pd.testing.assert_frame_equal(runs[0].requests, runs[1].requests)
    assert runs[0].summary == runs[1].summary


ROOT = Path(__file__).resolve().parents[2]
PAGED = """\
name: t
model: opt-13b
kv_budget: 12GiB
max_model_len: 2048
workload: {synthetic: {count: 5, prompt: {kind: uniform, low: 10, high: 200},
           output: {kind: uniform, low: 10, high: 200}}}
allocators: [{label: paged-16, kind: paged, block_size: 16}]
"""


def test_async_scheduling_is_on_by_default_and_can_be_turned_off(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(PAGED)
    loaded = load_scenario(path)
    assert loaded.scenario.engine_config().async_scheduling is True
    assert loaded.resolved()["engine"]["async_scheduling"] is True
    off = load_scenario(path, ["engine.async_scheduling=false"])
    assert off.scenario.engine_config().async_scheduling is False
    with pytest.raises(ScenarioError, match=r"engine\.async_scheduling: "):
        load_scenario(path, ["engine.async_scheduling=maybe"])


def test_a_hybrid_scenario_schedules_asynchronously_by_default():
    """A scenario with the hybrid allocator resolves async scheduling true when the key is left
    out (vLLM's server default), and its sliding groups' admission cap counts two batches in
    flight (vLLM's max_concurrent_batches); set false, one."""
    from kvfrag.sim.scenario import build_allocator

    path = ROOT / "scenarios" / "gpt-oss-120b-h100.yaml"
    assert "async_scheduling" not in path.read_text()
    on = load_scenario(path).scenario
    off = load_scenario(path, ["engine.async_scheduling=false"]).scenario
    assert on.engine_config().async_scheduling is True
    assert load_scenario(path).resolved()["engine"]["async_scheduling"] is True
    assert off.engine_config().async_scheduling is False
    for point, batches in ((on, 2), (off, 1)):
        spec = next(a for a in point.allocators if a.kind == "hybrid")
        (sliding,) = (m for m in build_allocator(point, spec).managers
                      if m.kind == "sliding_window")
        in_flight = batches * point.engine_config().max_num_batched_tokens
        want = -(-min(sliding.window - 1 + in_flight, point.max_model_len)
                 // sliding.block_size) + 1
        assert sliding.cap == want, batches
