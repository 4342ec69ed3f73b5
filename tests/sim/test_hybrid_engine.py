"""The hybrid allocator under the fast engine against the per-iteration reference stepper
(`sim.reference`), record for record: the fast engine's decode stretches lean on the
allocator's `steps_until_full`, `steps_until_shrink` and closed-form `integrals`, which the
reference never calls (it steps one token at a time and sums the accounting)."""

from __future__ import annotations

import warnings
from pathlib import Path
from runpy import run_path

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, make_allocator
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


def _stack(name: str, pattern: str, window: int = 32) -> LayerStack:
    """s: sliding (window `window`), f: full, c: chunked (chunk 24), m: MLA, g: Mamba state
    of 600 B (attention blocks aligned to 48 tokens or more); tiny heads."""
    kinds = {
        "s": SlidingWindow(1, 4, 2, window=window),
        "f": FullAttention(1, 4, 2),
        "c": ChunkedLocal(1, 4, 2, chunk=24),
        "m": MLA(6, 2, 2),
        "g": MambaState(600, "gated_delta_net"),
    }
    return LayerStack(name, tuple(kinds[ch] for ch in pattern))


STACKS = [
    _stack("ssf", "ssf"),  # 2 sliding layers of window 32 and one full
    _stack("mla", "mmm"),
    _stack("gemma-like", "sssssf", window=21),  # padding layers, a window off the block grid
    _stack("gpt-oss-like", "sfsf", window=6),  # a window under a block
    _stack("llama4-like", "cccf"),
    _stack("qwen3-next-like", "gggf"),  # Mamba state: one block per request per group
    _stack("jamba-like", "ggggfggg"),
]
#: A hardware-shaped step time (tests/sim/table_time.py).
TABLE = run_path(str(Path(__file__).with_name("table_time.py")))["TABLE"]
#: The fast engine held to the reference, request by request (tests/sim/agreement.py).
AGREE = run_path(str(Path(__file__).with_name("agreement.py")))["assert_fast_equals_reference"]
MML = 128


def workload(seed: int, n: int, max_prompt: int, max_output: int, rate: float) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    return pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": arrival - arrival[0] if rng.random() < 0.5 else arrival,
        "prompt_tokens": rng.integers(1, max_prompt + 1, n),
        "output_tokens": rng.integers(1, max_output + 1, n),
    })


def build(stack: LayerStack, blocks: int, manager: bool, bs: int, tokens: int):
    """A hybrid allocator whose pool is `blocks` over the planner's minimum (one request of
    max_model_len), plus a tail the plan leaves over."""

    def make(capacity: int):
        return make_allocator("hybrid", capacity=capacity,
                              bytes_per_token=stack.full_bytes_per_token, max_model_len=MML,
                              stack=stack, block_size=bs, hybrid_kv_cache_manager=manager,
                              max_num_batched_tokens=tokens)

    probe = make(10**9)
    capacity = (probe.plan.max_request_blocks + 1 + blocks) * probe.page + 37
    return lambda: make(capacity)


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(STACKS))),
    manager=st.booleans(),
    bs=st.sampled_from([4, 8, 16]),
    n=st.integers(1, 25),
    extra_blocks=st.sampled_from([0, 1, 2, 5, 10, 20, 50, 120]),  # small pools: preemptions
    chunked=st.booleans(),
    skip=st.booleans(),
    timing=st.sampled_from(["flat", "linear", "table"]),
    max_seqs=st.sampled_from([8, 8, 2]),
    watermark=st.sampled_from([0.0, 0.0, 0.1]),
)
# A decoder's last step frees a sliding block as it reaches its final length: the FCFS head,
# refused before, must be tried again in that iteration (before the decoder is freed).
@example(seed=302595366, which=0, manager=True, bs=8, n=8, extra_blocks=10, chunked=True,
         skip=False, timing="linear", max_seqs=8, watermark=0.0)
def test_fast_engine_matches_per_iteration_reference_for_hybrid(
    seed, which, manager, bs, n, extra_blocks, chunked, skip, timing, max_seqs, watermark,
):
    tokens = 40 if chunked else 160
    # (vLLM cannot run a Mamba hybrid without its hybrid manager: the manager is on)
    manager = manager or bool(STACKS[which].mamba_layers)
    fresh = build(STACKS[which], extra_blocks, manager, bs, tokens)
    wl = workload(seed, n, 100, 80, rate=2.0)
    step = {"flat": StepTime(0.05), "linear": StepTime(0.05, 1e-3, 1e-4), "table": TABLE}
    cfg = EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=tokens,
        chunked_prefill=chunked,
        admission="skip" if skip else "fcfs",
        lookahead=3,
        watermark=watermark,
        step_time=step[timing],
    )
    fast = run(wl, fresh(), cfg)
    slow = reference(wl, fresh(), cfg)
    AGREE(fast, slow, parts=[*PARTS, "internal_overreservation"])
    assert sum(fast.summary[f"{p}_frac"] for p in PARTS) == pytest.approx(1.0, abs=1e-12)


def _scenario(model: str, tp: int = 1, **engine: int):
    from kvfrag.sim.scenario import Scenario

    return Scenario.model_validate({
        "model": model, "tp": tp, "kv_budget": "40GiB", "max_model_len": 8192,
        "workload": {"synthetic": {"count": 6, "prompt": {"kind": "uniform", "low": 1000,
                                                          "high": 3000},
                                   "output": {"kind": "fixed", "value": 40}}},
        "engine": {"step_time": {"base_s": 0.02}, **engine},
        "allocators": [{"label": "hybrid", "kind": "hybrid", "block_size": 16},
                       {"label": "fallback", "kind": "hybrid",
                        "hybrid_kv_cache_manager": False}],
    })


def test_a_scenario_gives_the_hybrid_allocator_its_sharded_layers_and_token_budget():
    """The layers one GPU of tp keeps (not the all-full geometry, which for Gemma-3 is
    uniform and would read as all-full layers), and the engine's token budget (the sliding
    groups' admission cap counts the tokens in flight)."""
    from kvfrag.sim.hybrid_presets import STACKS as PRESETS
    from kvfrag.sim.scenario import build_allocator

    s = _scenario("gemma-3-27b", tp=2, max_num_batched_tokens=2048)
    on, off = (build_allocator(s, spec) for spec in s.allocators)
    assert on.stack == off.stack == PRESETS["gemma-3-27b"].shard(2)
    assert on.capacity == s.budget_bytes and on.bytes_per_token == s.geometry.bytes_per_token
    caps = {m.kind: m.cap for m in on.managers}
    assert caps == {"sliding_window": -(-(1023 + 2 * 2048) // 16) + 1, "full": None}
    assert [m.kind for m in off.managers] == ["full"]
    plain = build_allocator(_scenario("llama-3-8b", tp=2), _scenario("llama-3-8b").allocators[0])
    assert plain.stack.layers == (FullAttention(4, 128, 2),) * 32


@pytest.mark.parametrize("model", ["deepseek-v3", "gemma-3-27b", "gpt-oss-20b"])
def test_hybrid_models_run_in_a_scenario_with_the_manager_on_and_off(model):
    """MLA and sliding-window models run (the uniform-geometry refusal is for vAttention's
    per-layer buffers, not for an allocator that lays out the typed layers); the manager on
    plans a group per kind of layer, off one group of every layer full."""
    from kvfrag.sim.scenario_run import run_point
    from kvfrag.workloads import build_workload

    s = _scenario(model)
    requests = build_workload(s.workload, None, None, s.max_model_len).requests
    on, off = (run_point(s, spec, requests) for spec in s.allocators)
    for result in (on, off):
        assert (result.requests["status"] == "completed").all()
    assert off.summary["hybrid_groups"] == 1
    assert (on.summary["hybrid_groups"] > 1) == (model != "deepseek-v3")


MAMBA_SCENARIO = """\
name: t
model: {model}
kv_budget: 4GiB
max_model_len: 4096
workload:
  synthetic:
    count: 6
    prompt: {{kind: uniform, low: 500, high: 2000}}
    output: {{kind: fixed, value: 20}}
engine:
  step_time: {{base_s: 0.02}}
allocators:
  - {{label: hybrid, kind: hybrid}}
  - {allocator}
"""


@pytest.mark.parametrize(("model", "allocator", "expected"), [
    ("jamba-1.5-mini", "{label: paged-16, kind: paged}",
     r"s\.yaml:14: allocators\[1\]: allocator 'paged-16': paged cannot hold the Mamba state of "
     r"jamba-1\.5-mini \(28 layers; .*\): use kind hybrid \(or static-partition, "
     r"floor\)$"),
    ("{layers: [{type: full}, {type: mamba, state_bytes: 1MiB}], kv_heads: 8, head_dim: 64}",
     "{label: slab, kind: contiguous, reserve: max_model_len}",
     r"allocators\[1\]: allocator 'slab': contiguous cannot hold the Mamba state of custom "
     r"\(1 layers"),
    ("qwen3-next-80b-a3b", "{label: fallback, kind: hybrid, hybrid_kv_cache_manager: false}",
     r"allocators\[1\]: allocator 'fallback': Mamba state cannot be promoted to full "
     r"attention: a Mamba hybrid needs the hybrid KV-cache manager$"),
    ("qwen3-next-80b-a3b", "{label: align, kind: hybrid, mamba_cache_mode: align}",
     r"allocators\[1\]: allocator 'align': mamba_cache_mode 'align' needs prefix caching"),
    ("qwen3-next-80b-a3b", "{label: m, kind: hybrid, mamba_cache_mode: aligned}",
     r"allocators\[1\]: allocator 'm': mamba_cache_mode must be one of none, align, not "
     r"'aligned'$"),
])
def test_mamba_models_refuse_layouts_without_a_place_for_their_state(capsys, tmp_path, model,
                                                                      allocator, expected):
    """vLLM runs a Mamba hybrid only with its hybrid manager, in mode "none" without prefix
    caching: any other layout, the fallback, "align" and an unknown mode are one line naming
    the allocator, exit 2, nothing written."""
    import re

    from kvfrag.cli import main

    path = tmp_path / "s.yaml"
    path.write_text(MAMBA_SCENARIO.format(model=model, allocator=allocator))
    out = tmp_path / "out"
    code = main(["run", str(path), "-o", str(out), "-q", "--no-plots", "-j", "1"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert re.search(expected, lines[0]), lines[0]
    assert not out.exists()


@pytest.mark.parametrize("model", ["qwen3-next-80b-a3b", "jamba-1.5-mini"])
def test_mamba_hybrids_run_in_a_scenario(model):
    """A Mamba hybrid runs with the hybrid allocator: one state block per request per Mamba
    group, whose unpadded state counts as token states and its page's rest as padding."""
    from kvfrag.sim.hybrid_presets import STACKS as PRESETS
    from kvfrag.sim.scenario import Scenario, build_allocator
    from kvfrag.sim.scenario_run import run_point
    from kvfrag.workloads import build_workload

    s = Scenario.model_validate({
        "model": model, "kv_budget": "4GiB", "max_model_len": 4096,
        "workload": {"synthetic": {"count": 6, "prompt": {"kind": "uniform", "low": 500,
                                                          "high": 2000},
                                   "output": {"kind": "fixed", "value": 20}}},
        "engine": {"step_time": {"base_s": 0.02}},
        "allocators": [{"label": "hybrid", "kind": "hybrid"}],
    })
    (spec,) = s.allocators
    a = build_allocator(s, spec)
    stack = PRESETS[model]
    mamba = [m for m in a.managers if m.kind == "mamba"]
    assert len(mamba) == 1 and mamba[0].block_size == 4096
    assert mamba[0].state_bytes == stack.state_bytes_per_request
    requests = build_workload(s.workload, None, None, s.max_model_len).requests
    result = run_point(s, spec, requests)
    assert (result.requests["status"] == "completed").all()
    assert result.summary["hybrid_groups"] == len(a.plan.groups) > 1


def test_the_shipped_qwen3_next_scenario_plans_as_its_comments_say():
    """scenarios/qwen3-next-80b-a3b-mamba.yaml: 544-token attention blocks and state pages
    padded by 1.49 % at the default block size; 2,048-token blocks and 4 MiB state pages at
    --block-size 2048; both hold one state block per request per gated-delta-net group."""
    from pathlib import Path

    from kvfrag.sim.scenario import build_allocator

    from kvfrag.config import load_scenario

    path = Path(__file__).parents[2] / "scenarios" / "qwen3-next-80b-a3b-mamba.yaml"
    s = load_scenario(path).scenario
    assert 51e9 < s.budget_bytes < 53e9
    default, coarse = (build_allocator(s, spec) for spec in s.allocators if spec.kind == "hybrid")
    assert (default.plan.block_size, coarse.plan.block_size) == (544, 2048)
    state = 1_097_728
    assert default.plan.mamba_page_padded == 544 * 2048
    assert round((544 * 2048 / state - 1) * 100, 2) == 1.49
    assert coarse.plan.mamba_page_padded == 4 * 2**20
    for a in (default, coarse):
        mamba = next(m for m in a.managers if m.kind == "mamba")
        assert mamba.groups == 3 and mamba.state_bytes == 36 * state
