"""Arena and paged replays on CPU agree with the model to the byte; broken logs are caught."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig
from kvfrag.validate.outcome import Outcome
from kvfrag.validate.replay import pick_checks, replay_log

B = 32  # bytes per token
BUDGET = 24 * 1024  # 768 tokens
MML = 256
ROOT_TINY = Path(__file__).resolve().parents[2] / "scenarios" / "validate-tiny.yaml"


def workload(n: int = 45, seed: int = 3, group: dict | None = None) -> pd.DataFrame:
    """Requests; `group` adds a column of sequences per request, e.g. {"n": 3}."""
    rng = np.random.default_rng(seed)
    df = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.sort(rng.uniform(0, 2.0, n)),
            "prompt_tokens": rng.integers(5, 120, n),
            "output_tokens": rng.integers(1, 100, n),
        }
    )
    for column, value in (group or {}).items():
        df[column] = value
    return df


def simulate(kind: str, engine: dict | None = None, group: dict | None = None, **options):
    alloc = make_allocator(kind, capacity=BUDGET, bytes_per_token=B, max_model_len=MML, **options)
    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, log_allocations=True)
    cfg = dataclasses.replace(cfg, **(engine or {}))
    return run(workload(group=group), alloc, cfg)


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
    from kvfrag.validate import suite

    from kvfrag.config import load_scenario

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


def test_plan_skips_vattention_pages_that_rows_straddle():
    """Paged mode replays token-aligned blocks: vAttention pages are replayed only when the
    page size is a multiple of the model's buffer row."""
    from kvfrag.sim.scenario import Scenario
    from kvfrag.validate import suite

    from kvfrag.config import load_scenario

    tiny = load_scenario(ROOT_TINY, ["kv_budget=64MiB", "model=llama-3-8b"]).scenario
    va = {"label": "va", "kind": "vattention", "page_size": "64KiB"}
    sweep = {"model": ["llama-3-8b", "opt-13b"]}
    scenario = Scenario.model_validate(
        {**tiny.model_dump(exclude_unset=True), "allocators": [va], "sweep": sweep}
    )
    for mode in ("auto", "paged", "all"):
        jobs, skipped = suite.plan(scenario, mode, "cpu")
        assert [(j.spec.kind, j.mode, j.scenario.model) for j in jobs] == [
            ("vattention", "paged", "llama-3-8b")
        ]
        assert [(o.kind, o.mode, o.point, o.status) for o in skipped] == [
            ("vattention", "paged", 1, "skip")
        ]
        assert skipped[0].note == (
            "opt-13b's 10240-byte token rows straddle 64.0 KiB pages: pages are not token-aligned "
            "blocks, which paged mode replays"
        )


# ------------------------------------------------------------------ groups (n > 1)
CHUNKED = {"chunked_prefill": True, "max_num_batched_tokens": 64}
GROUPS = [
    ("paged", {}, {"n": 3}, {"block_size": 16}),
    ("paged", CHUNKED, {"n": 2}, {"block_size": 8}),
    ("paged", {}, {"beam_width": 3}, {"block_size": 16}),
    ("paged", CHUNKED, {"beam_width": 3}, {"block_size": 8}),
    ("contiguous", {}, {"n": 2}, {"reserve": "oracle", "placement": "first-fit"}),
    ("contiguous", {}, {"n": 2}, {"reserve": "oracle", "compaction": True}),
    ("buddy", CHUNKED, {"n": 3}, {"reserve": "pow2"}),
]


@pytest.mark.parametrize(("kind", "engine", "group", "options"), GROUPS)
def test_groups_replay_exactly(kind, engine, group, options):
    result = simulate(kind, engine, group, **options)
    log = result.log
    assert result.summary["completed"] == 45
    out = replay(log, kind, options.get("block_size"))
    assert out.status == "pass", out.first_fail
    assert out.corrupt == 0 and out.problems == 0
    assert out.checks == int((log["op"] == "check").sum()) > 10
    admits = log[log["op"] == "admit"]
    width = next(iter(group.values()))
    if kind == "paged":
        # At each fork (one table -> n), the prompt's partial block is copied on write for
        # every sequence past the first (beams: unless they have filled it already).
        prompt = dict(zip(admits["rid"], admits["prompt"], strict=False))
        bs, beam = options["block_size"], "beam_width" in group
        forks, forked = 0, set()
        for row in log[log["op"].isin(["admit", "grow", "free"])].itertuples():
            p = prompt[row.rid]
            if row.op == "free":
                forked.discard(row.rid)
            elif len(row.tables) == width and row.rid not in forked:
                forked.add(row.rid)
                forks += p % bs > 0 and (not beam or row.tokens // bs == p // bs)
            else:
                assert len(row.tables) in (1, width)
        assert (log["op"] == "copy").sum() == (width - 1) * forks > 0
    else:
        assert (admits["offsets"].map(len) == width).all()
        assert (log["op"] == "copy").sum() == 0


def test_beams_are_pruned_and_preempted_in_the_replay():
    result = simulate("paged", CHUNKED, {"beam_width": 3}, block_size=8)
    log = result.log
    assert result.summary["preemptions"] > 0
    grows = log[log["op"] == "grow"]
    distinct = grows["tables"].map(lambda t: len({b for table in t for b in table}))
    assert (distinct.diff() < 0).any(), "no grow gave pruned blocks back"
    out = replay(log, "paged", 8)
    assert out.status == "pass", out.first_fail


@pytest.mark.parametrize("how", ["skip", "wrong source"])
def test_a_bad_copy_on_write_is_caught(how):
    result = simulate("paged", {}, {"n": 3}, block_size=16)
    log = result.log.copy()
    copies = log.index[log["op"] == "copy"]
    if how == "skip":
        log = log.drop(copies[:2]).reset_index(drop=True)
    else:  # copy the first prompt block instead of the partial last one
        for i in copies:
            rid = log.at[i, "rid"]
            first = log[(log["rid"] == rid) & (log["op"] == "admit") & (log.index > i)].iloc[0]
            log.at[i, "blocks"] = [first["tables"][0][0], log.at[i, "blocks"][1]]
    out = replay(log, "paged", 16)
    assert out.status == "fail"
    assert out.corrupt >= 1  # the copies' prompt bytes: HELD, or the wrong tokens


def test_slab_copies_are_checked_by_value():
    result = simulate("contiguous", {}, {"n": 2}, reserve="oracle")
    log = result.log.copy()
    i = log.index[log["op"] == "admit"][4]
    first, _ = log.at[i, "offsets"]
    log.at[i, "offsets"] = [first, first]  # both samples written over one slab
    out = replay(log, "contiguous")
    assert out.status == "fail" and out.corrupt >= 1


# ------------------------------------------------------------------ prefix caching
def shared_prompts(bs: int = 8, count: int = 60, seed: int = 3) -> pd.DataFrame:
    """Requests behind one of three 40-token system prompts (hash chains per 8 tokens)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(40, 150, count)
    system, chunk = 40, 8
    group = rng.integers(0, 3, count)
    hashes, own = [], 10_000
    for g, p in zip(group.tolist(), prompt.tolist(), strict=True):
        mine = -(-p // chunk) - system // chunk
        hashes.append([100 * g + c for c in range(system // chunk)] + list(range(own, own + mine)))
        own += mine
    df = pd.DataFrame(
        {
            "request_id": np.arange(count),
            "arrival_s": np.sort(rng.uniform(0, 2.0, count)),
            "prompt_tokens": prompt,
            "output_tokens": rng.integers(1, 60, count),
            "hash_ids": hashes,
        }
    )
    df.attrs["hash_block_tokens"] = chunk
    return df


def simulate_cached(bs: int, engine: dict | None = None, group: tuple[str, int] | None = None):
    alloc = make_allocator(
        "prefix-caching", capacity=BUDGET, bytes_per_token=B, max_model_len=MML, block_size=bs
    )
    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, log_allocations=True)
    workload = shared_prompts()
    if group is not None:  # every request a group: n samples or beams
        workload[group[0]] = group[1]
    return run(workload, alloc, dataclasses.replace(cfg, **(engine or {})))


# (4-token blocks synchronous: async, none of its preempted requests finds its own output
# again before it is evicted)
@pytest.mark.parametrize(("bs", "engine"),
                         [(16, {}), (8, CHUNKED), (4, {"async_scheduling": False})])
def test_prefix_caching_replays_exactly(bs, engine):
    result = simulate_cached(bs, engine)
    s, log = result.summary, result.log
    assert s["completed"] == 60 and s["prefix_hit_blocks"] > 0 and s["prefix_evictions"] > 0
    assert (log["op"] == "evict").sum() > 0
    admits = log[log["op"] == "admit"]
    assert (admits["keys"].map(len) > 0).all()
    # Requests behind the same system prompt name the same block for its first tokens.
    first_block = admits["tables"].map(lambda tables: tables[0][0])
    system = admits["keys"].map(lambda keys: keys[0])
    assert first_block.groupby(system).apply(lambda ids: ids.duplicated().any()).all()
    # Every full block is cached, generated ones included: a preempted request is resumed
    # with its table starting with blocks it held, past its prompt's (its own output).
    assert s["preemptions"] > 0 and resumed_with_own_output(log, bs) > 0
    out = replay(log, "prefix-caching", bs)
    assert out.status == "pass", out.first_fail
    assert out.corrupt == 0 and out.problems == 0 and out.checks > 10


def resumed_with_own_output(log: pd.DataFrame, bs: int) -> int:
    """Admissions of a preempted request whose table starts with more of the blocks it freed
    than its prompt's full blocks."""
    freed, found = {}, 0
    for row in log.itertuples():
        if row.op == "free":
            freed[row.rid] = list(row.blocks)
        elif row.op == "admit" and row.rid in freed and len(row.tables):
            same = 0
            for a, b in zip(row.tables[0], freed[row.rid], strict=False):
                if a != b:
                    break
                same += 1
            found += same > row.prompt // bs
    return found


@pytest.mark.parametrize(
    ("bs", "group", "engine"),
    [(16, ("n", 3), {}), (4, ("n", 3), CHUNKED), (16, ("beam_width", 3), CHUNKED),
     (8, ("beam_width", 2), {})],
)
def test_prefix_caching_groups_replay_exactly(bs, group, engine):
    """Sample groups and beams with prefix caching: cached prompt blocks by key digest, the
    partial prompt block copied on write, each sequence's own tokens, all to the byte."""
    result = simulate_cached(bs, engine, group)
    s, log = result.summary, result.log
    assert s["completed"] == 60 and s["prefix_hit_blocks"] > 0 and s["preemptions"] > 0
    assert (log["op"] == "copy").sum() > 0 and (log["op"] == "evict").sum() > 0
    admits = log[log["op"] == "admit"]
    forked = admits[admits["tokens"] > admits["prompt"]]
    assert (forked["tables"].map(len) == group[1]).all() and len(forked) > 0
    # Every sequence's table starts with the same cached blocks, found again across requests.
    first_block = forked["tables"].map(lambda tables: {t[0] for t in tables})
    assert (first_block.map(len) == 1).all()
    system = forked["keys"].map(lambda keys: keys[0])
    ids = first_block.map(min)
    assert ids.groupby(system).apply(lambda x: x.duplicated().any()).all()
    out = replay(log, "prefix-caching", bs)
    assert out.status == "pass", out.first_fail
    assert out.corrupt == 0 and out.problems == 0 and out.checks > 10


def test_a_corrupted_cached_block_is_caught(monkeypatch):
    from kvfrag.validate import replay as replay_mod

    result = simulate_cached(16)
    real_free = replay_mod.MemoryReplay.free

    def free_then_scribble(self, rid, nbytes, offset, blocks, *rest):
        idle = set(self.idle)
        got = real_free(self, rid, nbytes, offset, blocks, *rest)
        for b in set(self.idle) - idle:  # a block just gone idle: one byte overwritten
            self.pool[b, 3, 0] = 1 + self.pool[b, 3, 0] % 250
        return got

    monkeypatch.setattr(replay_mod.MemoryReplay, "free", free_then_scribble)
    out = replay(result.log, "prefix-caching", 16)
    assert out.status == "fail" and out.corrupt >= 1
    assert "idle cached" in out.first_fail or "found at its admit" in out.first_fail


def test_shipped_sharing_scenarios_pass_cut_down():
    """validate-sharing.yaml (samples, beams) and validate-prefix-caching.yaml (single
    requests, then n = 2 samples), on fewer requests: every replay passes exactly."""
    from kvfrag.validate import suite

    from kvfrag.config import load_scenario

    root = ROOT_TINY.parent
    outcomes = []
    loaded = load_scenario(root / "validate-sharing.yaml", ["kv_budget=4MiB"])
    sweep = loaded.scenario.sweep
    fewer = [{**w, "transforms": {**w["transforms"], "first_n": 15}} for w in sweep["workload"]]
    assert [(w.get("n"), w.get("beam_width")) for w in fewer] == [(2, None), (4, None), (None, 3)]
    scenario = loaded.scenario.model_copy(update={"sweep": {"workload": fewer}})
    jobs, skipped = suite.plan(scenario, "auto", "cpu")
    assert len(jobs) == 9 and not skipped
    outcomes += suite.run_jobs(jobs, loaded.base_dir, "cpu", checkpoints=5)
    loaded = load_scenario(
        root / "validate-prefix-caching.yaml", ["workload.synthetic.count=25", "kv_budget=2MiB"]
    )
    jobs, _ = suite.plan(loaded.scenario, "auto", "cpu")
    kinds = [("prefix-caching", "paged")] * 2 + [("paged", "paged")]
    assert [(j.spec.kind, j.mode) for j in jobs] == kinds * 2
    outcomes += suite.run_jobs(jobs, loaded.base_dir, "cpu", checkpoints=5)
    assert [o.status for o in outcomes] == ["pass"] * 15, [o.first_fail for o in outcomes]


def random_run(seed: int, kind: str, opts: dict, group: tuple[str, int] | None, engine: dict):
    """A small random workload (closed-loop users, prefix hashes for prefix caching) run with
    its allocation log."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 40))
    prompt = rng.integers(1, 120, n)
    df = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.sort(rng.uniform(0, float(rng.choice([0.01, 1.0, 5.0])), n)),
            "prompt_tokens": prompt,
            "output_tokens": rng.integers(1, 100, n),
        }
    )
    if group is not None:
        df[group[0]] = rng.integers(1, group[1] + 1, n)
    if kind == "prefix-caching":  # three shared system prompts of 0-5 chunks, then own chunks
        hashes, own = [], 10**6
        for p in prompt.tolist():
            chunks, system = -(-p // 8), int(rng.integers(0, 6))
            mine = max(0, chunks - system)
            shared = [1000 * int(rng.integers(0, 3)) + c for c in range(min(system, chunks))]
            hashes.append(shared + list(range(own, own + mine)))
            own += mine
        df["hash_ids"] = hashes
        df.attrs["hash_block_tokens"] = 8
    if rng.random() < 0.3:  # closed loop: each user's next request follows its previous one
        df["user_id"] = rng.integers(0, 4, n)
        df["think_s"] = rng.uniform(0, 1, n)
        df.loc[df.duplicated("user_id"), "arrival_s"] = np.nan
    budget = int(rng.integers(300, 2000)) * B
    alloc = make_allocator(kind, capacity=budget, bytes_per_token=B, max_model_len=MML, **opts)
    cfg = EngineConfig(max_num_batched_tokens=512, log_allocations=True)
    return run(df, alloc, dataclasses.replace(cfg, **engine)), budget


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["paged", "prefix-caching", "contiguous", "buddy"]),
    bs=st.sampled_from([1, 4, 16]),
    reserve=st.sampled_from(["oracle", "pow2", "max_model_len"]),
    compaction=st.booleans(),
    group=st.one_of(st.none(), st.tuples(st.sampled_from(["n", "beam_width"]), st.integers(2, 4))),
    engine=st.fixed_dictionaries(
        {
            "max_num_seqs": st.sampled_from([2, 3, 8, 40]),
            "batching": st.sampled_from(["continuous", "continuous", "static"]),
            "admission": st.sampled_from(["fcfs", "skip"]),
            "lookahead": st.integers(1, 4),
            "watermark": st.sampled_from([0.0, 0.0, 0.1, 0.3]),
            "max_time_s": st.sampled_from([None, None, 0.5, 2.0]),
        }
    ),
    chunk=st.sampled_from([None, 40, 150]),
)
def test_random_runs_replay_exactly(seed, kind, bs, reserve, compaction, group, engine, chunk):
    """Whatever the allocator, sharing and engine options, the log replays to the byte."""
    paged = kind in ("paged", "prefix-caching")
    if paged:
        opts = {"block_size": bs}
    else:
        opts = {"reserve": reserve}
        if kind == "contiguous":
            opts["compaction"] = compaction
    if chunk is not None:
        engine = {**engine, "chunked_prefill": True, "max_num_batched_tokens": chunk}
    result, budget = random_run(seed, kind, opts, group, engine)
    out = replay_log(
        result.log, Outcome("x", kind, "paged" if paged else "arena", "cpu", budget), B, "cpu",
        bs if paged else None,
    )
    assert out.status == "pass", out.first_fail
    assert out.corrupt == 0 and out.problems == 0
    s = result.summary
    assert s["completed"] + s["rejected"] + s["unfinished"] == s["requests"]
