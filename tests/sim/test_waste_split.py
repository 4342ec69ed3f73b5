"""Hybrid models' waste, named: token states as the layers read them for every allocator, and
internal split exactly into over-reservation + padding + out of window + rounding.

Checked three ways: an allocator's running totals (`waste_parts`, `parts`) against the live
requests walked afresh and against a formula of the layers; its closed-form `integrals` /
`waste_integrals` against stepping a copy; and the fast engine's time-averaged split against
the per-iteration reference stepper (`sim.reference`), which samples `waste_breakdown()` at
every iteration."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Request, make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.layers import ChunkedLocal, FullAttention, LayerStack, MambaState, SlidingWindow
from kvfrag.sim.reference import reference

warnings.filterwarnings("ignore", message=".*pure-Python.*")

ROOT = Path(__file__).resolve().parents[2]
SPLIT = ("internal_overreservation", "internal_padding", "internal_out_of_window",
         "internal_rounding")


def _stack(name: str, pattern: str, window: int = 21, chunk: int = 24) -> LayerStack:
    """s: sliding, f: full, c: chunked, g: a Mamba state (gated delta net); tiny heads (16
    bytes per token per layer)."""
    kinds = {"s": SlidingWindow(1, 4, 2, window=window), "f": FullAttention(1, 4, 2),
             "c": ChunkedLocal(1, 4, 2, chunk=chunk), "g": MambaState(600, "gated_delta_net")}
    return LayerStack(name, tuple(kinds[ch] for ch in pattern))


STACKS = [
    _stack("gemma-like", "sssssf"),  # a window off the block grid
    _stack("gpt-oss-like", "sfsf", window=6),  # a window under a block
    _stack("llama4-like", "cccf"),
    _stack("mixed", "scf", window=9, chunk=7),
    _stack("qwen3-next-like", "gggfsf", window=9),  # Mamba state: the hybrid manager only
]
#: Allocators that keep every token in every layer (the model view counts what they waste).
PLAIN = [
    ("paged", {"block_size": 16}),
    ("paged", {"block_size": 5}),
    ("contiguous", {"reserve": "max_model_len"}),
    ("contiguous", {"reserve": "oracle"}),
    ("buddy", {"reserve": "pow2_final"}),
    ("torch-caching", {}),
    ("prefix-caching", {"block_size": 8}),
    ("vattention", {"page_size": 64}),  # (the stack's layers are alike: a uniform geometry)
]
MML = 128


def out_of_window(stack: LayerStack, tokens: int) -> int:
    """Bytes of a sequence of `tokens` tokens that no layer reads: per sliding layer those
    before its last W, per chunked layer those before its current chunk."""
    out = 0
    for layer in stack.layers:
        if isinstance(layer, SlidingWindow):
            read = min(layer.window, tokens)
        elif isinstance(layer, ChunkedLocal):
            read = tokens - (tokens - 1) // layer.chunk * layer.chunk
        else:
            read = tokens
        out += (tokens - read) * layer.bytes_per_token
    return out


def plain(kind: str, opts: dict, stack: LayerStack, capacity: int):
    geometry = stack.geometry() if kind == "vattention" else None
    a = make_allocator(kind, capacity=capacity, bytes_per_token=stack.full_bytes_per_token,
                       max_model_len=MML, geometry=geometry, **opts)
    a.view_model(stack)
    return a


# ------------------------------------------------------------ an allocator's running totals
def check_now(a, stack: LayerStack) -> None:
    """The identity, and the split from the running totals = the live requests walked."""
    acc = a.account(None)
    acc.check()
    walk = a.waste_breakdown()
    assert min(walk.values()) >= 0 and sum(walk.values()) == acc.internal
    assert a.waste_parts() == (walk["padding"], walk["out_of_window"])
    if a.kind != "hybrid":
        out = sum(out_of_window(stack, a.tokens(rid)) for rid in a.rids())
        assert walk["out_of_window"] == out
        assert acc.token_states == a.bytes_per_token * a.total_tokens() - out


def check_integrals(a, n: int, w0: float, w1: float) -> None:
    """`integrals` and `waste_integrals` over n steps = stepping a copy and summing."""
    got = a.integrate(n, None, w0, w1)
    waste = a.waste_integrals(n, w0, w1)
    c = copy.deepcopy(a)
    want = dict.fromkeys((*PARTS, "padding", "out_of_window"), 0.0)
    for j in range(1, n + 1):
        assert c.step(1)
        w = w0 + w1 * (j - 1)
        acc = c.account(None)
        for p in PARTS:
            want[p] += getattr(acc, p) * w
        for key, value in zip(("padding", "out_of_window"), c.waste_parts(), strict=True):
            want[key] += value * w
    scale = a.capacity * (n * (abs(w0) + abs(w1) * n) + 1)
    for p in PARTS:
        assert got[p] == pytest.approx(want[p], rel=1e-9, abs=1e-12 * scale), p
    for key, value in zip(("padding", "out_of_window"), waste, strict=True):
        assert value == pytest.approx(want[key], rel=1e-9, abs=1e-12 * scale), key


def _allocator(which: int, kind_i: int, extra: int):
    stack = STACKS[which]
    if stack.mamba_layers:  # (its state needs the hybrid manager: vLLM has no fallback)
        kind_i = len(PLAIN)
    if kind_i >= len(PLAIN):  # hybrid, the manager on or off
        def make(capacity: int):
            return make_allocator("hybrid", capacity=capacity, max_model_len=MML,
                                  bytes_per_token=stack.full_bytes_per_token, stack=stack,
                                  block_size=8,
                                  hybrid_kv_cache_manager=kind_i == len(PLAIN))
        probe = make(10**9)
        return stack, make((probe.plan.max_request_blocks + 1 + extra) * probe.page + 5)
    kind, opts = PLAIN[kind_i]
    return stack, plain(kind, opts, stack, stack.full_bytes_per_token * MML * (2 + extra // 8))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    which=st.sampled_from(range(len(STACKS))),
    kind_i=st.sampled_from(range(len(PLAIN) + 2)),
    extra=st.integers(0, 40),
    ops=st.lists(st.tuples(st.sampled_from("aaagsssdfii"), st.integers(0, 10**6),
                           st.integers(0, 10**6)), max_size=30),
)
def test_split_is_exact_for_every_allocator_on_hybrid_stacks(which, kind_i, extra, ops):
    stack, a = _allocator(which, kind_i, extra)
    rid = 0
    check_now(a, stack)
    for op, x, y in ops:
        live = a.rids()
        if op == "a":  # admit, and decode or not
            prompt = 1 + x % 90
            req = Request(rid, prompt, y % (MML - prompt))
            rid += 1
            a.admit(req, decoding=bool(y % 2))
        elif not live:
            continue
        elif op == "g":  # a prefill chunk (outside the cohort) or a grown decoder
            r = live[x % len(live)]
            room = a.final_tokens(r) - a.tokens(r)
            if room:
                a.grow(r, 1 + y % room)
        elif op == "d":  # join or leave the decode cohort
            r = live[x % len(live)]
            a.set_decoding(r, not a.is_decoding(r))
        elif op == "f":
            a.free(live[x % len(live)])
        elif op in "si":
            limits = [v for v in (a.steps_until_done(), a.steps_until_full()) if v is not None]
            if not limits:
                continue
            n = x % (min([30, *limits]) + 1)
            if op == "i":
                check_integrals(a, n, 0.5 + y % 7 / 3, (y % 5 - 2) / 50)
            elif n:
                assert a.step(n)
        check_now(a, stack)
    limits = [v for v in (a.steps_until_done(), a.steps_until_full()) if v is not None]
    if limits:  # and the state it ends in, over as many steps as it may take (up to 40)
        check_integrals(a, min([40, *limits]), 1.0, 0.01)


# --------------------------------------------------------- the engine against the reference
def workload(seed: int, n: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(0.5, n))
    return pd.DataFrame({
        "request_id": np.arange(n),
        "arrival_s": arrival,
        "prompt_tokens": rng.integers(1, 90, n),
        "output_tokens": rng.integers(1, 60, n),
    })


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.sampled_from(range(len(STACKS))),
    kind_i=st.sampled_from(range(len(PLAIN) + 2)),
    extra=st.sampled_from([0, 2, 10, 40]),
    n=st.integers(1, 14),
    linear=st.booleans(),
)
def test_engine_split_matches_per_iteration_samples(seed, which, kind_i, extra, n, linear):
    cfg = EngineConfig(max_num_seqs=6, max_num_batched_tokens=160, chunked_prefill=True,
                       step_time=StepTime(0.05, 1e-3, 1e-4) if linear else StepTime(0.05))
    wl = workload(seed, n)
    fast = run(wl, _allocator(which, kind_i, extra)[1], cfg)
    slow = reference(wl, _allocator(which, kind_i, extra)[1], cfg)
    for p in [*PARTS, *SPLIT[:3]]:
        got = fast.summary[f"{p}_frac"]
        assert got == pytest.approx(slow["fractions"][p], rel=1e-7, abs=1e-9), p
    # over-reservation + padding + out of window + rounding == internal
    total = sum(fast.summary[f"{p}_frac"] for p in SPLIT)
    assert total == pytest.approx(fast.summary["internal_frac"], rel=1e-9, abs=1e-12)


# ------------------------------------------------------------ full-attention runs unchanged
def test_a_full_attention_run_is_unchanged_and_its_new_columns_are_0():
    full = LayerStack("full", (FullAttention(1, 4, 2),) * 4)
    wl = workload(7, 12)
    cfg = EngineConfig(max_num_seqs=6, max_num_batched_tokens=160, chunked_prefill=True,
                       step_time=StepTime(0.05, 1e-3, 1e-4))
    for kind, opts in PLAIN[:3]:
        def make(view: bool, kind=kind, opts=opts):
            a = make_allocator(kind, capacity=full.full_bytes_per_token * MML * 3,
                               bytes_per_token=full.full_bytes_per_token, max_model_len=MML,
                               **opts)
            if view:
                a.view_model(full)  # every layer reads every token: nothing to count
            return a

        viewed, bare = run(wl, make(True), cfg), run(wl, make(False), cfg)
        assert not make(True).waste_split
        assert viewed.summary == bare.summary
        assert viewed.timeseries.equals(bare.timeseries)
        s = bare.summary
        assert s["internal_padding_frac"] == s["internal_out_of_window_frac"] == 0.0
        assert s["internal_rounding_frac"] == pytest.approx(
            s["internal_frac"] - s["internal_overreservation_frac"], abs=1e-15)
        assert not any(c.startswith("blocks_") for c in bare.timeseries.columns)


# ------------------------------------------------------------------- the shipped Gemma-3 case
def test_gemma3_out_of_window_is_most_of_paged_and_the_fallback_and_little_of_hybrid():
    """The shipped scenario's layouts on a shorter workload: with every layer full (paged,
    the fallback) most of the budget is tokens the 52 sliding layers no longer read; the
    hybrid manager frees them, leaving only the window's block rounding."""
    from kvfrag.sim.scenario import Scenario, build_allocator
    from kvfrag.workloads import build_workload

    doc = yaml.safe_load((ROOT / "scenarios/gemma3-27b-long-context.yaml").read_text())
    doc["workload"]["synthetic"]["count"] = 12
    point = Scenario.model_validate(doc)
    wl = build_workload(point.workload, ROOT, None, point.max_model_len).requests
    got = {}
    for spec in point.allocators:
        if spec.kind == "contiguous":
            continue
        s = run(wl, build_allocator(point, spec), point.engine_config()).summary
        got[spec.label] = s
        total = sum(s[f"{p}_frac"] for p in SPLIT)
        assert total == pytest.approx(s["internal_frac"], abs=1e-9)
    for label in ("paged-16", "fallback"):
        # 52 of 62 layers read at most 1,024 of 4K-16K tokens: most held bytes are unread
        out = got[label]["internal_out_of_window_frac"]
        assert out > 2 * got[label]["token_states_frac"], label
    hybrid = got["hybrid"]
    assert hybrid["internal_out_of_window_frac"] < 0.2 * got["paged-16"][
        "internal_out_of_window_frac"]
    assert hybrid["internal_padding_frac"] > 0  # 52 sliding layers padded to groups of 10
    assert got["paged-16"]["internal_padding_frac"] == 0.0
