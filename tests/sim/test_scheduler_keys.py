"""The scenario keys of vLLM's scheduler that kvfrag models (`engine.long_prefill_token_threshold`,
`engine.scheduler_reserve_full_isl`): validated on load, passed to the engine, and what they do
to a run. Their step-by-step agreement with vLLM is tests/oracle/test_vllm_match.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.reference import reference

from kvfrag.config import ScenarioError, load_scenario

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


def load(tmp_path: Path, extra: str):
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO + extra)
    return load_scenario(path).scenario


def test_defaults_are_vllms(tmp_path):
    cfg = load(tmp_path, "").engine_config()
    assert cfg.long_prefill_token_threshold == 0 and cfg.reserve_full_isl is True


def test_keys_reach_the_engine(tmp_path):
    extra = "  long_prefill_token_threshold: 256\n  scheduler_reserve_full_isl: false\n"
    cfg = load(tmp_path, extra).engine_config()
    assert cfg.long_prefill_token_threshold == 256 and cfg.reserve_full_isl is False


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("  long_prefill_token_threshold: 4096\n",
         r"s\.yaml:14: engine\.long_prefill_token_threshold: 4,096 must be at most "
         r"max_model_len \(2,048\), as vLLM requires$"),
        ("  long_prefill_token_threshold: -1\n",
         r"s\.yaml:14: engine\.long_prefill_token_threshold: must be a whole number"),
        ("  scheduler_reserve_full_isl: maybe\n",
         r"s\.yaml:14: engine\.scheduler_reserve_full_isl: "),
    ],
)
def test_bad_values_are_one_line_naming_the_field(tmp_path, line, expected):
    with pytest.raises(ScenarioError, match=expected) as info:
        load(tmp_path, line)
    assert "\n" not in str(info.value)


def test_engine_config_refuses_a_negative_threshold():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)


def workload(n: int, prompt: int, output: int) -> pd.DataFrame:
    return pd.DataFrame({
        "request_id": np.arange(n), "arrival_s": np.zeros(n),
        "prompt_tokens": np.full(n, prompt), "output_tokens": np.full(n, output),
    })


def paged(blocks: int):
    return make_allocator("paged", capacity=(blocks + 1) * 16 * 8, bytes_per_token=8,
                          max_model_len=1024, block_size=16)


def test_the_threshold_chunks_prompts_even_unchunked_but_not_a_lone_request():
    """Three 600-token prompts, threshold 256, chunked prefill off: each takes its prompt in
    256-token chunks (vLLM caps before it checks the budget); a lone request is not capped."""
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024, chunked_prefill=False,
                       long_prefill_token_threshold=256, step_time=StepTime(base_s=1.0))
    trace: list[dict] = []
    reference(workload(3, 600, 5), paged(200), cfg, trace)
    assert [it["scheduled_tokens"] for it in trace[:3]] == [768, 768, 264]
    lone: list[dict] = []
    reference(workload(1, 600, 5), paged(200), cfg, lone)
    assert lone[0]["scheduled_tokens"] == 600
    fast = run(workload(3, 600, 5), paged(200), cfg).requests
    assert (fast["first_token_s"] == 3.0).all()  # the third iteration ends each prefill


def test_without_the_full_sequence_gate_more_is_admitted_and_preempted():
    """40 blocks, 256-token chunks of 600-token prompts: with the gate a request waits until
    its whole prompt fits (one runs at a time); without it, two start at once, and the pool
    runs out under them."""
    wl = workload(6, 600, 50)
    counts = {}
    for reserve in (True, False):
        cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, chunked_prefill=True,
                           reserve_full_isl=reserve, step_time=StepTime(base_s=1.0))
        fast = run(wl, paged(60), cfg)
        slow = reference(wl, paged(60), cfg)
        assert fast.summary["preemptions"] == sum(r["preemptions"]
                                                  for r in slow["requests"].values())
        counts[reserve] = (fast.summary["preemptions"], fast.summary["max_running"])
    assert counts[True][0] == 0 < counts[False][0]
    assert counts[True][1] < counts[False][1]
