"""Arena and paged replays on CPU agree with the model to the byte; broken logs are caught."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch")

from sim.allocators import make_allocator
from sim.engine import EngineConfig, run
from validate.outcome import Outcome
from validate.replay import pick_checks, replay_log

B = 32  # bytes per token
BUDGET = 24 * 1024  # 768 tokens
MML = 256
ROOT_TINY = Path(__file__).resolve().parents[2] / "scenarios" / "validate-tiny.yaml"


def workload(n: int = 45, seed: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.sort(rng.uniform(0, 2.0, n)),
            "prompt_tokens": rng.integers(5, 120, n),
            "output_tokens": rng.integers(1, 100, n),
        }
    )


def simulate(kind: str, engine: dict | None = None, **options):
    alloc = make_allocator(kind, capacity=BUDGET, bytes_per_token=B, max_model_len=MML, **options)
    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, log_allocations=True)
    cfg = dataclasses.replace(cfg, **(engine or {}))
    return run(workload(), alloc, cfg)


def replay(log, kind: str, block_size: int | None = None, checkpoints=None) -> Outcome:
    mode = "paged" if block_size else "arena"
    out = Outcome("x", kind, mode, "cpu", BUDGET)
    return replay_log(log, out, B, "cpu", block_size, checkpoints)


CASES = [
    ("contiguous", {}, {"reserve": "oracle", "placement": "first-fit"}),
    ("contiguous", {}, {"reserve": "max_model_len", "placement": "best-fit"}),
    ("contiguous", {"chunked_prefill": True, "max_num_batched_tokens": 64},
     {"reserve": "pow2", "placement": "next-fit"}),
    ("buddy", {}, {"reserve": "pow2"}),
    ("buddy", {"batching": "static"}, {"reserve": "oracle"}),
    ("paged", {}, {"block_size": 16}),
    ("paged", {"chunked_prefill": True, "max_num_batched_tokens": 64}, {"block_size": 8}),
]


@pytest.mark.parametrize(("kind", "engine", "options"), CASES)
def test_replay_matches_model_exactly(kind, engine, options):
    result = simulate(kind, engine, **options)
    out = replay(result.log, kind, options.get("block_size"))
    assert out.status == "pass", out.first_fail
    assert out.checks == int((result.log["op"] == "check").sum()) > 10
    assert out.corrupt == 0 and out.problems == 0
    for q in ("token_states", "held_unwritten", "free"):
        assert out.figures[q]["abs_err"] == 0
    s = out.series
    assert (s["pred_token_states"] + s["pred_held_unwritten"] + s["pred_free"] == BUDGET).all()


def test_paged_replay_survives_preemptions():
    result = simulate("paged", block_size=16)
    assert result.summary["preemptions"] > 0
    assert (result.log.groupby("rid")["op"].apply(lambda ops: (ops == "admit").sum()) > 1).any()
    out = replay(result.log, "paged", 16, checkpoints=5)
    assert out.status == "pass" and out.checks == 5


def test_contiguous_replay_fills_holes():
    result = simulate("contiguous", reserve="oracle", placement="first-fit")
    live: dict[int, int] = {}
    refilled = False
    for row in result.log.itertuples():
        if row.op == "admit":
            refilled |= any(off > row.offset for off in live.values())
            live[row.rid] = row.offset
        elif row.op == "free":
            live.pop(row.rid)
    assert refilled, "no admission landed below a live slab: no hole was reused"
    assert replay(result.log, "contiguous").status == "pass"


def test_compaction_moves_are_replayed():
    result = simulate("contiguous", reserve="oracle", placement="first-fit", compaction=True)
    assert (result.log["op"] == "move").sum() > 0
    out = replay(result.log, "contiguous")
    assert out.status == "pass", out.first_fail


def _admit_over_live_slab(log: pd.DataFrame) -> tuple[int, int]:
    """(row index of an admit, offset of another slab live at that moment)."""
    live: dict[int, int] = {}
    for i, row in log.iterrows():
        if row.op == "admit":
            others = [off for rid, off in live.items() if off != row.offset]
            if others:
                return i, others[0]
            live[row.rid] = row.offset
        elif row.op == "free":
            live.pop(row.rid, None)
    raise AssertionError("no two slabs live at once")


def test_overlapping_slabs_are_caught():
    result = simulate("contiguous", reserve="oracle")
    log = result.log.copy()
    i, other = _admit_over_live_slab(log)
    log.at[i, "offset"] = other
    out = replay(log, "contiguous")
    assert out.status == "fail"
    assert out.corrupt >= 1
    assert out.first_fail_seq is not None and out.first_fail_seq >= int(log.at[i, "seq"])


def test_wrong_offset_outside_arena_is_reported():
    result = simulate("buddy", reserve="pow2")
    log = result.log.copy()
    i = log.index[log["op"] == "admit"][3]
    log.at[i, "offset"] = BUDGET - 8
    out = replay(log, "buddy")
    assert out.status == "fail"
    assert "outside the arena" in out.first_fail


def test_block_handed_out_twice_is_caught():
    result = simulate("paged", block_size=16)
    log = result.log.copy()
    live: dict[int, list[int]] = {}
    for i, row in log.iterrows():
        if row.op in ("admit", "grow") and row.blocks:
            others = [b for rid, t in live.items() if rid != row.rid for b in t]
            if others:
                log.at[i, "blocks"] = [others[0], *row.blocks[1:]]
                break
            live.setdefault(row.rid, []).extend(row.blocks)
        elif row.op == "free":
            live.pop(row.rid, None)
    out = replay(log, "paged", 16)
    assert out.status == "fail"
    assert out.corrupt >= 1


def test_wrong_prediction_is_a_mismatch():
    result = simulate("contiguous", reserve="oracle")
    log = result.log.copy()
    i = log.index[log["op"] == "check"][5]
    log.at[i, "token_states"] += B
    out = replay(log, "contiguous")
    assert out.status == "fail"
    assert out.first_fail_seq == int(log.at[i, "seq"])
    assert "token_states" in out.first_fail
    assert out.figures["token_states"]["abs_err"] == B


def test_checkpoints_are_thinned():
    assert pick_checks(10, None) == set(range(10))
    assert pick_checks(100, 5) == {0, 25, 50, 74, 99}
    result = simulate("buddy", reserve="pow2")
    assert replay(result.log, "buddy", checkpoints=7).checks == 7


def test_plan_and_requested_sizes():
    from kvfrag.config import load_scenario
    from validate import suite

    loaded = load_scenario(ROOT_TINY, ["workload.transforms.first_n=30", "kv_budget=4MiB"])
    jobs, skipped = suite.plan(loaded.scenario, "auto", "cpu")
    assert [(j.spec.kind, j.mode) for j in jobs] == [
        ("contiguous", "arena"), ("contiguous", "arena"), ("buddy", "arena"), ("paged", "paged")
    ]
    assert [(o.kind, o.status) for o in skipped] == [("torch-caching", "skip")]
    jobs, skipped = suite.plan(loaded.scenario, "all", "cpu")
    assert len(jobs) == 4 and len(skipped) == 4  # torch mode for contiguous x2, buddy, torch
    # torch mode asks torch for exactly the slab sizes the slab allocators admitted
    for job in jobs[:3]:
        result, _, requested = suite._simulate(job, loaded.base_dir, {})
        admits = result.log[result.log["op"] == "admit"]
        assert all(requested[r.rid] == r.nbytes for r in admits.itertuples())
