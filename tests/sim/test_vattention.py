"""vAttention-style virtual-memory pages: per-buffer physical pages mapped on demand.

The waste is checked against a closed form (a request of L tokens maps ceil(L*t/P) pages of P
bytes in each of its 2 x layers K/V buffers), whether or not token rows straddle pages; with
P a multiple of t the allocator is checked against a paged allocator with P // t-token blocks
operation by operation; then decode stepping (`integrate`, `steps_until_full`) against a
step-by-step walk, and runs through the engine and a scenario. (Random operation sequences
with rows straddling pages: tests/sim/test_allocators_properties.py; the engine against its
per-iteration reference: tests/sim/test_engine.py.)"""

from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import (
    PagedAllocator,
    Request,
    VAttentionAllocator,
    make_allocator,
    options_of,
)
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.geometry import PRESETS, KVGeometry, preset
from kvfrag.sim.scenario import Scenario
from kvfrag.sim.scenario_run import run as run_scenario
from kvfrag.sim.units import parse_size

KIB, MIB, GIB = 2**10, 2**20, 2**30


class NoNullBlock(PagedAllocator):
    """The paged pool without vLLM's null block, as vAttention's pages have none."""

    null_blocks = 0

LENGTHS = [1, 100, 1023, 1024, 1025, 2047, 2048, 2049, 3000, 8000]
# 10 KiB rows (opt-13b, llama-2-13b): 6.4 tokens a 64 KiB page, 204.8 a 2 MiB page.
STRADDLING = [2, 6, 7, 12, 13, 32, 33, 204, 205, 409, 410, 1023, 1024, 1025, 4096, 4097]


def build(model: str, page, capacity: int = 40 * GIB, mml: int = 8192) -> VAttentionAllocator:
    geo = preset(model)
    a = make_allocator(
        "vattention",
        capacity=capacity,
        bytes_per_token=geo.bytes_per_token,
        max_model_len=mml,
        geometry=geo,
        page_size=page,
    )
    assert isinstance(a, VAttentionAllocator)
    return a


def held_closed_form(geo: KVGeometry, page: int, tokens: int) -> int:
    """Bytes mapped for a request storing `tokens` tokens: whole pages in every buffer."""
    t = geo.bytes_per_buffer_token
    return 2 * geo.layers * math.ceil(tokens * t / page) * page


@pytest.mark.parametrize(("t", "page"), [(10240, 2 * MIB), (10240, 64 * KIB), (3, 4), (2048, 3000),
                                         (18432, 2 * MIB), (6, 4), (5, 5), (7, 1)])
def test_page_count_is_a_sum_of_block_terms(t, page):
    """ceil(L*a/p) = sum_i ceil((L - o_i)/p), o_i = floor(i*p/a), g = gcd(t, P), a = t/g,
    p = P/g: the pages of one buffer are `a` terms of the paged allocator's kind."""
    g = math.gcd(t, page)
    a, p = t // g, page // g
    offsets = [i * p // a for i in range(a)]
    for length in [*range(3 * p + 2), 10**6 + 7, 123457]:
        pages = math.ceil(length * t / page)
        assert pages == -(-length * a // p) == sum(-(-(length - o) // p) for o in offsets)


def test_straddling_page_arithmetic():
    geo = preset("opt-13b")
    assert geo.bytes_per_buffer_token == 10240 and geo.layers == 40
    a = build("opt-13b", "2MiB")  # 2 MiB / 10 KiB = 204.8 tokens a page
    assert a.pages_per_block == 5 and a.block_size == 1024  # 1,024 tokens fill 5 pages
    assert a.tokens_per_page == pytest.approx(204.8) and a.buffers == 80
    assert a.block_bytes == 80 * 2 * MIB and a.num_blocks == 40 * GIB // (160 * MIB) == 256
    b = build("llama-2-13b", "64KiB")  # 6.4 tokens a page: 32 tokens fill 5 pages
    assert (b.pages_per_block, b.block_size, b.block_bytes) == (5, 32, 80 * 64 * KIB)
    c = build("llama-3-8b", 3000)  # gcd(2048, 3000) = 8: 375 tokens fill 256 pages
    assert (c.pages_per_block, c.block_size) == (256, 375)
    # A 205-token request crosses into a second 2 MiB page in every buffer.
    assert a.admit(Request(0, 204, 1), decoding=False).nbytes == 80 * 2 * MIB
    assert a.grow(0, 1).nbytes == 80 * 2 * MIB
    assert a.pages_mapped() == 160


def test_llama3_8b_page_arithmetic():
    geo = preset("llama-3-8b")
    assert geo.bytes_per_buffer_token == 2048 and geo.bytes_per_token == 128 * KIB
    a = build("llama-3-8b", "2MiB")
    assert a.page_size == 2 * MIB and a.tokens_per_page == a.block_size == 1024
    assert a.buffers == 64 and a.block_bytes == 64 * 2 * MIB  # one page per K/V buffer
    assert a.num_blocks == 40 * GIB // (128 * MIB) == 320
    assert build("llama-3-8b", "64KiB").block_size == 32
    assert build("llama-3-8b", 256 * KIB).block_size == 128
    assert build("qwen2.5-7b", "2MiB").block_size == 2048  # 1 KiB rows: twice the tokens


@pytest.mark.parametrize(
    ("model", "lengths"),
    [(m, LENGTHS) for m in ("llama-3-8b", "qwen2.5-7b", "mistral-7b", "llama-2-7b")]
    + [(m, STRADDLING) for m in ("opt-13b", "llama-2-13b")],
)
@pytest.mark.parametrize("page", ["64KiB", "256KiB", "2MiB"])
def test_waste_matches_closed_form(model, lengths, page):
    geo, p = preset(model), parse_size(page)
    b = geo.bytes_per_token
    a = build(model, page, capacity=200 * GIB)
    for rid, length in enumerate(lengths):  # stored at their final length, prompt + 1
        assert a.admit(Request(rid, length, 1), tokens=length + 1, decoding=False)
        a.account().check()
    # ... the same lengths reached by decoding from a one-token prompt, in one step batch ...
    for i, length in enumerate(lengths):
        assert a.admit(Request(100 + i, 1, length))  # final = 1 + length
    while a.n_decoding:  # step to each completion; a finished request stops decoding
        assert a.step(a.steps_until_done())
        a.account().check()
        a.set_decoding(a.first_done(), False)
    # ... and grown a few tokens at a time, the mapped bytes checked at every length.
    for i, length in enumerate(lengths):
        rid = 200 + i
        assert a.admit(Request(rid, 1, length), decoding=False)
        while a.tokens(rid) <= length:
            step = min(1 + a.tokens(rid) % 5, length + 1 - a.tokens(rid))
            assert a.grow(rid, step)
            assert a.allocated_bytes(rid) == held_closed_form(geo, p, a.tokens(rid))
            a.account().check()
            if a.tokens(rid) == length + 1:
                break
    finals = {r + off: n + 1 for off in (0, 100, 200) for r, n in enumerate(lengths)}
    held = {rid: held_closed_form(geo, p, n) for rid, n in finals.items()}
    for rid, n in finals.items():
        assert a.tokens(rid) == n
        assert a.allocated_bytes(rid) == held[rid]
        assert a.allocated_bytes(rid) - b * n < 2 * geo.layers * p  # under a page per buffer
    acc = a.account()
    acc.check()
    assert acc.token_states == b * sum(finals.values())
    assert acc.internal == sum(held[r] - b * n for r, n in finals.items())
    assert acc.reserved == 0
    assert acc.allocated == sum(held.values())
    assert acc.external == a.capacity % (2 * geo.layers * p)
    assert a.pages_mapped() * p == acc.allocated


def test_qwen_wastes_most_with_2mib_pages():
    """With 2 MiB pages, the share of mapped memory never written is largest for qwen2.5-7b
    (and llama-3.2-1b, of the same row size): its 1 KiB rows put 2,048 tokens in a page,
    twice llama-3's 1,024."""
    lengths = [120, 400, 700, 1500, 2600]  # short chat requests
    waste = {}
    for name in PRESETS:
        a = build(name, "2MiB", capacity=200 * GIB)
        for rid, n in enumerate(lengths):
            assert a.admit(Request(rid, n, 1), tokens=n, decoding=False)
        acc = a.account()
        acc.check()
        waste[name] = acc.internal / acc.allocated
    most = max(waste.values())
    assert sorted(n for n, w in waste.items() if w == most) == ["llama-3.2-1b", "qwen2.5-7b"]
    assert waste["qwen2.5-7b"] > waste["llama-3-8b"] > waste["llama-2-7b"]


def test_page_size_must_be_positive():
    with pytest.raises(ValueError, match="page_size must be a positive number of bytes, got 0"):
        build("llama-3-8b", 0)
    assert build("llama-3-8b", "48KiB").block_size == 24  # any multiple of the row: a = 1
    assert build("llama-2-13b", "2MiB").pages_per_block == 5  # rows straddle pages: fine


def test_sample_groups_need_whole_rows_per_page():
    """Groups share pages only when rows do not straddle them; then they are paged groups."""
    a = build("opt-13b", "64KiB")
    group = Request(0, 40, 8, n=3)
    with pytest.raises(ValueError, match=r"straddling pages does not model sample groups \(n=3\)"):
        a.admit(group, tokens=41)
    with pytest.raises(ValueError, match="sample groups"):
        a.bytes_for(group, 41)
    assert a.live == 0 and a.free_blocks() == a.num_blocks  # refused before anything changed
    geo = preset("llama-3-8b")
    v = build("llama-3-8b", "64KiB", capacity=GIB)  # 32 tokens a page
    p = NoNullBlock(GIB, geo.bytes_per_token, 8192, block_size=32)
    for req in (Request(0, 40, 70, n=3), Request(1, 33, 90, n=2, beam=True)):
        assert v.admit(req, tokens=41) == p.admit(req, tokens=41)
    for n in (7, 20, 31):
        assert v.step(n) == p.step(n)
        assert v.account() == p.account() and v.saved_by_sharing() == p.saved_by_sharing()
        assert v.integrate(5, None, 1.0, 0.25) == p.integrate(5, None, 1.0, 0.25)
        assert v.block_tables(0) == p.block_tables(0) and v.block_tables(1) == p.block_tables(1)


@pytest.mark.parametrize(("model", "page"), [("opt-13b", "64KiB"), ("llama-2-13b", "2MiB")])
def test_decoding_straddling_pages(model, page):
    """Decoders at mixed phases: `integrate` is the step-by-step sum, `steps_until_full` is
    exact (that many steps succeed, one more is refused) and every request maps its closed
    form at every step."""
    geo, p = preset(model), parse_size(page)
    unit = 2 * geo.layers * p
    a = build(model, page, capacity=60 * unit + 12345, mml=20000)
    per_page = p / geo.bytes_per_buffer_token  # 6.4 or 204.8 tokens
    most = 60 * p // geo.bytes_per_buffer_token  # tokens one request may hold in the pool
    for rid, pages in enumerate((0.1, 0.8, 1, 1.1, 2, 2.5, 5.2)):
        prompt = max(1, round(pages * per_page))
        assert a.admit(Request(rid, prompt, most - prompt - 3 * rid))
        assert a.step(3 + rid)
    full = a.steps_until_full()
    assert full is not None and full < a.steps_until_done()
    probe = Request(99, 10, 10)
    n = min(full, 300)
    got = a.integrate(n, probe, 1.0, 0.01)
    c = copy.deepcopy(a)
    want = dict.fromkeys(got, 0.0)
    for j in range(1, n + 1):
        assert c.step(1)
        acc = c.account(probe)
        acc.check()
        for part in want:
            if part != "saved":
                want[part] += getattr(acc, part) * (1.0 + 0.01 * (j - 1))
        for rid in c.rids():
            assert c.allocated_bytes(rid) == held_closed_form(geo, p, c.tokens(rid))
    for part in want:
        assert got[part] == pytest.approx(want[part], rel=1e-12), part
    assert a.step(full)
    a.account().check()
    assert a.steps_until_full() == 0
    assert not a.step(1)
    # The decoders whose next token starts a page need more pages than are free.
    starting = [
        r for r in a.rids() if held_closed_form(geo, p, a.tokens(r) + 1) > a.allocated_bytes(r)
    ]
    assert len(starting) * unit > a.free_bytes() - a.capacity % unit


def test_geometry_is_required_and_must_agree():
    geo = preset("llama-3-8b")
    common = {"capacity": GIB, "max_model_len": 4096}
    with pytest.raises(ValueError, match="needs the model geometry"):
        make_allocator("vattention", bytes_per_token=geo.bytes_per_token, **common)
    with pytest.raises(ValueError, match="stores 131072 bytes per token, but bytes_per_token is 8"):
        make_allocator("vattention", bytes_per_token=8, geometry=geo, **common)
    with pytest.raises(ValueError, match="bytes_per_token is 8"):  # for every kind
        make_allocator("paged", bytes_per_token=8, geometry=geo, **common)
    with pytest.raises(ValueError, match="bytes_per_token must be a positive integer"):
        VAttentionAllocator(GIB, 0, 4096, geometry=geo)  # the common checks come first
    # Kinds without a geometry argument ignore it.
    a = make_allocator("paged", bytes_per_token=geo.bytes_per_token, geometry=geo, **common)
    assert a.block_size == 16
    assert options_of("vattention") == ["page_size"]
    with pytest.raises(ValueError, match="has no option 'block_size'"):
        make_allocator(
            "vattention", bytes_per_token=geo.bytes_per_token, geometry=geo, block_size=4, **common
        )


# ----------------------------------------------------------- the same as paged, op by op
TINY = KVGeometry("tiny", layers=2, kv_heads=1, head_dim=2, dtype_bytes=1)  # t = 2, b = 8

OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "step", "free", "decoding"]),
        st.integers(0, 10**6),
        st.integers(0, 10**6),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 7), extra=st.integers(0, 300), ops=OPS)
def test_same_as_paged_with_page_blocks(rows, extra, ops):
    page, b, mml = rows * TINY.bytes_per_buffer_token, TINY.bytes_per_token, 40
    capacity = 10 * rows * b + extra
    v = make_allocator(
        "vattention", capacity=capacity, bytes_per_token=b, max_model_len=mml,
        geometry=TINY, page_size=page,
    )
    p = NoNullBlock(capacity, b, mml, block_size=rows)
    assert v.block_bytes == p.block_bytes == 2 * TINY.layers * page
    rid = 0
    for op, x, y in ops:
        live = sorted(v.rids())
        if op == "admit":
            req = Request(rid, 1 + x % (mml - 1), 1 + y % mml)
            tokens = 1 + y % req.prompt
            assert v.admit(req, tokens, decoding=bool(x % 2)) == p.admit(
                req, tokens, decoding=bool(x % 2)
            )
            rid += 1
        elif op == "grow" and live:
            r = live[x % len(live)]
            room = v.final_tokens(r) - v.tokens(r)
            if room:
                assert v.grow(r, 1 + y % room) == p.grow(r, 1 + y % room)
        elif op == "step":
            done = v.steps_until_done()
            n = x % (8 if done is None else done + 1)
            assert v.step(n) == p.step(n)
        elif op == "free" and live:
            r = live[x % len(live)]
            assert v.free(r) == p.free(r)
        elif op == "decoding" and live:
            r = live[x % len(live)]
            v.set_decoding(r, bool(y % 2))
            p.set_decoding(r, bool(y % 2))
        acc = v.account()
        acc.check()
        assert acc == p.account()
        assert v.steps_until_full() == p.steps_until_full()
        for r in v.rids():
            assert v.block_table(r) == p.block_table(r)
        assert v.integrate(3, None, 1.0, 0.5) == p.integrate(3, None, 1.0, 0.5)


# ------------------------------------------------------------------- engine and scenario
def workload(n: int, seed: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.sort(rng.uniform(0, 5, n)),
            "prompt_tokens": rng.integers(10, 1500, n),
            "output_tokens": rng.integers(1, 400, n),
        }
    )


def test_runs_through_the_engine():
    geo = preset("llama-3-8b")
    cfg = EngineConfig(max_num_seqs=64, step_time=StepTime(base_s=0.01))
    wl = workload(150)
    results = {}
    for kind, opts in (
        ("paged", {"block_size": 16}),
        ("vattention", {"page_size": "64KiB"}),
        ("vattention", {"page_size": "2MiB"}),
    ):
        a = make_allocator(
            kind, capacity=8 * GIB, bytes_per_token=geo.bytes_per_token, max_model_len=4096,
            geometry=geo, **opts,
        )
        res = run(wl, a, cfg)
        s = res.summary
        assert s["completed"] == 150 and a.kind == kind
        total = sum(s[f"{p}_frac"] for p in ("token_states", "reserved", "internal", "external"))
        assert total + s["usable_free_frac"] == pytest.approx(1.0)
        assert s["compactions"] == s["bytes_moved"] == 0 and s["stall_s"] == 0.0
        results[(kind, opts.get("page_size"))] = s
    # 64 KiB pages hold 32 tokens: twice paged-16's tail; 2 MiB pages far more (and preempt).
    assert (results[("paged", None)]["internal_frac"]
            < results[("vattention", "64KiB")]["internal_frac"])
    assert (results[("vattention", "64KiB")]["internal_frac"]
            < results[("vattention", "2MiB")]["internal_frac"])


def test_scenario_sweeps_the_model():
    data = {
        "model": "llama-3-8b",
        "kv_budget": "8GiB",
        "max_model_len": 4096,
        "workload": {
            "synthetic": {
                "count": 60,
                "prompt": {"kind": "uniform", "low": 10, "high": 1000},
                "output": {"kind": "uniform", "low": 1, "high": 200},
                "arrival": {"kind": "poisson", "rate": 20.0},
            },
            "seed": 1,
        },
        "allocators": [
            {"label": "paged-16", "kind": "paged", "block_size": 16},
            {"label": "va-2m", "kind": "vattention", "page_size": "2MiB"},
        ],
        "sweep": {"model": ["llama-3-8b", "qwen2.5-7b"]},
    }
    scenario = Scenario.model_validate(data)
    summary = run_scenario(scenario).summary()
    va = summary[summary["label"] == "va-2m"].set_index("model")
    assert list(va.index) == ["llama-3-8b", "qwen2.5-7b"]
    assert (summary["completed"] == 60).all()
    assert va.loc["qwen2.5-7b", "bytes_per_token"] == preset("qwen2.5-7b").bytes_per_token
    opts = next(a for a in scenario.points()[1][1].allocators if a.label == "va-2m").options
    assert opts == {"page_size": "2MiB"}
    # Rows straddling pages: opt-13b's 10 KiB rows in 2 MiB pages.
    opt = run_scenario(Scenario.model_validate({**data, "sweep": {"model": ["opt-13b"]}}))
    summary = opt.summary().set_index("label")
    assert (summary["completed"] == 60).all()
    assert summary.loc["va-2m", "internal_frac"] > summary.loc["paged-16", "internal_frac"]
