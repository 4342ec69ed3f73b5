"""The hybrid allocator (vLLM's hybrid KV-cache manager: attention kinds and Mamba state in
mode "none"): block counts per group against an independent model of vLLM's managers, the
accounting identity, exact `integrate`, `steps_until_full` and `steps_until_shrink`, block
ids, refusals."""

from __future__ import annotations

import copy
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import PARTS, Reason, Request, make_allocator
from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    LayerStack,
    MambaState,
    SlidingWindow,
)

warnings.filterwarnings("ignore", message=".*pure-Python.*")


def _stack(name: str, pattern: str, **kw: int) -> LayerStack:
    """s: sliding (window 32), f: full, c: chunked (chunk 24), m: MLA, g: Mamba state (`state`
    bytes, 200 by default); tiny heads."""
    layers = []
    for ch in pattern:
        if ch == "s":
            layers.append(SlidingWindow(1, 4, 2, window=kw.get("window", 32)))
        elif ch == "f":
            layers.append(FullAttention(1, 4, 2))
        elif ch == "c":
            layers.append(ChunkedLocal(1, 4, 2, chunk=kw.get("chunk", 24)))
        elif ch == "g":
            layers.append(MambaState(kw.get("state", 200), "gated_delta_net"))
        else:
            layers.append(MLA(6, 2, 2))
    return LayerStack(name, tuple(layers))


STACKS = {
    "gemma-like": _stack("gemma-like", "sssssfsssssf"),  # 5:1, padding layers
    "gpt-oss-like": _stack("gpt-oss-like", "sfsfsf", window=8),  # window under a block
    "llama4-like": _stack("llama4-like", "cccfcccf"),
    "mla": _stack("mla", "mmmm"),
    "sliding-odd": _stack("sliding-odd", "ssf", window=21),
    # Mamba hybrids: attention blocks aligned up to hold a state (600 B: blocks of 48), the
    # state pages padded; one state block per request per Mamba group.
    "qwen3-next-like": _stack("qwen3-next-like", "gggfgggf", state=600),
    "jamba-like": _stack("jamba-like", "ggggfggg"),
}


def build(name: str, capacity: int, mml: int = 64, **opts):
    stack = STACKS[name]
    return make_allocator("hybrid", capacity=capacity, bytes_per_token=stack.full_bytes_per_token,
                          max_model_len=mml, stack=stack, **opts)


def min_capacity(name: str, mml: int, **opts) -> int:
    """A budget just big enough for the planner (one max_model_len request)."""
    a = build(name, 10**9, mml, **opts)
    return (a.plan.max_request_blocks + 1) * a.page


# ---------------------------------------------------------------- the independent model
def held(kind: str, bs: int, window: int, tokens: int, processed: int) -> int:
    """vLLM: ceil(tokens / bs) blocks in the table, the skipped ones null."""
    blocks = -(-tokens // bs)
    if kind == "mamba":  # get_num_skipped_tokens: n - 1 (bs is max_model_len in mode none)
        skipped = max(0, processed - 1)
    elif kind == "sliding_window":
        skipped = max(0, processed - window + 1)
    elif kind == "chunked_local":
        skipped = processed // window * window
    else:
        skipped = 0
    return blocks - skipped // bs


def model_blocks(a, tokens: int, processed: int) -> int:
    total = 0
    for g in a.plan.groups:
        kind = "full" if g.kind in ("full", "mla") else g.kind
        total += held(kind, g.block_size, g.window or 0, tokens, processed)
    return total


def model_parts(a, tokens: int, processed: int, final: int) -> tuple[int, int, int]:
    """(token_states, reserved, internal) from the layers, one group at a time."""
    token_states = reserved = 0
    for g in a.plan.groups:
        for i in g.layers:
            layer = a.stack.layers[i]
            b = layer.bytes_per_token
            # what the layer reads, by its own kind (a promoted one too: manager off)
            if isinstance(layer, SlidingWindow):
                need = min(layer.window, tokens)
            elif isinstance(layer, ChunkedLocal):
                need = tokens - (tokens - 1) // layer.chunk * layer.chunk
            else:
                need = tokens
            token_states += need * b + getattr(layer, "state_bytes", 0)  # (Mamba: its state)
            end = -(-tokens // g.block_size) * g.block_size
            reserved += max(0, min(final, end) - tokens) * b
    allocated = model_blocks(a, tokens, processed) * a.page
    return token_states, reserved, allocated - token_states - reserved


class Shadow:
    def __init__(self) -> None:
        self.tokens: dict[int, int] = {}
        self.proc: dict[int, int] = {}
        self.final: dict[int, int] = {}
        self.decoding: dict[int, bool] = {}
        self.stale: dict[int, bool] = {}  # joined the cohort and not stepped since

    def processed(self, rid: int) -> int:
        if self.decoding[rid] and not self.stale[rid]:
            return self.tokens[rid] - 1
        return self.proc[rid]


def check(a, m: Shadow) -> None:
    assert sorted(a.rids()) == sorted(m.tokens)
    blocks = 0
    parts = [0, 0, 0]
    for rid, tokens in m.tokens.items():
        assert a.tokens(rid) == tokens
        p = m.processed(rid)
        b = model_blocks(a, tokens, p)
        assert a.blocks_of(rid) == b
        assert a.allocated_bytes(rid) == b * a.page
        blocks += b
        for i, v in enumerate(model_parts(a, tokens, p, m.final[rid])):
            parts[i] += v
        table = a.block_table(rid)
        assert len(table) == b
    ids = [i for rid in m.tokens for i in a.block_table(rid)]
    assert len(ids) == len(set(ids)) and all(1 <= i < a.plan.num_blocks for i in ids)
    acc = a.account()
    acc.check()
    assert (acc.token_states, acc.reserved, acc.internal) == tuple(parts)
    assert acc.usable_free == (a.num_blocks - blocks) * a.page
    assert acc.external == a.capacity - a.num_blocks * a.page
    w = a.waste_breakdown()
    assert min(w.values()) >= 0 and sum(w.values()) == acc.internal


def brute_integrate(a, n: int, w0: float, w1: float) -> dict[str, float]:
    c = copy.deepcopy(a)
    sums = dict.fromkeys(PARTS, 0.0)
    for j in range(1, n + 1):
        assert c.step(1)
        acc = c.account()
        for part in PARTS:
            sums[part] += getattr(acc, part) * (w0 + w1 * (j - 1))
    return sums


def check_cohort(a, w0: float, w1: float, just_freed: bool = False) -> None:
    """`just_freed`: the last step freed a block of a request still decoding since (the engine
    asks after a step whether memory came back: `steps_until_shrink` answers 1 then)."""
    done, full, shrink = a.steps_until_done(), a.steps_until_full(), a.steps_until_shrink()
    if done is None:
        assert full is None and shrink is None
        return
    limit = min(done, full)
    # steps_until_full: exact.
    c = copy.deepcopy(a)
    assert c.step(limit)
    if full < done:
        before = c.account()
        refused = c.step(1)
        assert not refused and refused.reason is Reason.OUT_OF_MEMORY
        assert c.account() == before
    # steps_until_shrink: the first step that gives blocks back without a free.
    c = copy.deepcopy(a)
    first = None
    for t in range(1, limit + 1):
        decoders = [r for r in c.rids() if c.is_decoding(r)]
        before = {r: c.blocks_of(r) for r in decoders}
        skipped_before = {r: _skipped(c, r) for r in decoders}
        c.step(1)
        if any(_skipped(c, r) > skipped_before[r] for r in decoders):
            first = t
            break
        del before
    if just_freed:
        assert shrink == 1
    elif first is not None:
        assert shrink == first
    else:
        assert shrink is None or shrink > limit
    # integrate: exact over up to 40 steps.
    n = min(limit, 40)
    got = a.integrate(n, None, w0, w1)
    want = brute_integrate(a, n, w0, w1)
    scale = a.capacity * n * (abs(w0) + abs(w1) * n + 1)
    for part in PARTS:
        assert got[part] == pytest.approx(want[part], rel=1e-9, abs=1e-12 * scale), part


def _skipped(a, rid: int) -> int:
    return sum(t.count(0) for t in a.group_tables(rid))


OP = st.tuples(st.sampled_from(["admit", "admit", "admit", "grow", "step", "step", "decoding",
                                "free", "cohort"]),
               st.integers(0, 2**16), st.integers(0, 2**16), st.integers(0, 2**16),
               st.floats(0, 5), st.floats(-2, 2))


@pytest.mark.parametrize("name", list(STACKS))
@pytest.mark.parametrize("manager", [True, False])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mml=st.integers(20, 90), extra=st.integers(0, 40), ops=st.lists(OP, max_size=40),
       defer=st.booleans())
def test_random_operations_match_vllm_managers(name, manager, mml, extra, ops, defer):
    if not manager and STACKS[name].mamba_layers:
        # vLLM cannot promote Mamba state to full attention (unify_hybrid_kv_cache_specs).
        with pytest.raises(ValueError, match="promote"):
            build(name, 10**9, mml, hybrid_kv_cache_manager=False)
        return
    base = min_capacity(name, mml, hybrid_kv_cache_manager=manager)
    a = build(name, base + extra * 37, mml, hybrid_kv_cache_manager=manager)
    if defer:
        a.defer_block_ids()
    m = Shadow()
    rid = 0
    check(a, m)
    freed: set[int] = set()  # decoders the last step freed a block of
    for op, x, y, z, w0, w1 in ops:
        live = sorted(m.tokens)
        if op == "admit":
            req = Request(rid, 1 + x % (mml + 1), 1 + y % mml)
            if req.prompt >= mml:
                assert a.admit(req).reason is Reason.PROMPT_TOO_LONG
                continue
            final = min(req.final, mml)
            tokens = 1 + z % final if z % 2 else req.prompt
            decoding = bool(z // 2 % 3)
            need = model_blocks(a, tokens, 0)
            before = a.account()
            free = a.free_blocks()
            result = a.admit(req, tokens=tokens, decoding=decoding)
            if need > free:
                assert not result
                assert a.account() == before
                continue
            assert result and result.nbytes == need * a.page
            assert defer or len(result.blocks) == need
            m.tokens[rid], m.proc[rid], m.final[rid] = tokens, 0, final
            m.decoding[rid], m.stale[rid] = decoding, True
            rid += 1
        elif op == "grow" and live:
            r = live[x % len(live)]
            if m.tokens[r] >= m.final[r]:
                continue
            n = 1 + y % (m.final[r] - m.tokens[r])
            old = m.tokens[r]
            net = model_blocks(a, old + n, old) - model_blocks(a, old, m.processed(r))
            before = a.account()
            free = a.free_blocks()
            result = a.grow(r, n)
            if net > free:
                assert not result and a.account() == before
                continue
            assert result
            m.tokens[r] += n
            m.proc[r] = old
            if m.decoding[r]:
                m.stale[r] = True  # (it left and joined the cohort again:
                freed.discard(r)  # what its last step freed is no longer "just freed")
        elif op == "step":
            done, full = a.steps_until_done(), a.steps_until_full()
            if done is None:
                continue
            n = x % (done + 1)
            if 1 <= n <= full:  # (which decoders the last of these n steps frees a block of)
                c = copy.deepcopy(a)
                c.step(n - 1)
                before = {r: _skipped(c, r) for r in live if m.decoding[r]}
            result = a.step(n)
            if n > full:
                assert not result
                continue
            assert result
            if n:
                freed = {r for r, k in before.items() if _skipped(a, r) > k}
            for r in live:
                if m.decoding[r]:
                    m.tokens[r] += n
                    if n:
                        m.stale[r] = False
        elif op == "decoding" and live:
            r = live[x % len(live)]
            flag = bool(y % 2)
            if flag != m.decoding[r]:
                if not flag:
                    m.proc[r] = m.processed(r)
                m.stale[r] = True
                freed.discard(r)
            a.set_decoding(r, flag)
            m.decoding[r] = flag
        elif op == "free" and live:
            r = live[x % len(live)]
            nbytes = model_blocks(a, m.tokens[r], m.processed(r)) * a.page
            assert a.free(r) == nbytes
            for d in (m.tokens, m.proc, m.final, m.decoding, m.stale):
                del d[r]
            freed.discard(r)
        elif op == "cohort":
            check_cohort(a, w0, w1, just_freed=bool(freed))
        check(a, m)
    for r in sorted(m.tokens):
        a.free(r)
    assert a.free_blocks() == a.num_blocks
    # Every id is back: one request filling the pool gets each once.
    a.admit(Request(10**6, 1, 1), tokens=1, decoding=False)
    assert len(a.block_table(10**6)) == model_blocks(a, 1, 0)


def test_shrink_after_a_decoder_joined_again_is_its_next_free():
    """A decoder whose step freed a block and that then left the cohort and joined again at
    the same clock has not stepped since it joined: `steps_until_shrink` is its next window
    crossing, not 1 (the early answer hypothesis found in the random operations)."""
    a = build("gemma-like", 10**6, 90)  # window 32, blocks of 16
    assert a.admit(Request(0, 40, 40), tokens=40, decoding=True)
    assert a.step(8)  # the step to 48 tokens frees by 47 processed: one block
    assert a.steps_until_shrink() == 1
    a.set_decoding(0, False)
    a.set_decoding(0, True)
    assert a.steps_until_shrink() == 16  # (the step to 64 frees the next)
    a.set_decoding(0, False)
    assert a.steps_until_shrink() is None


def test_prefill_blocks_held_until_the_first_step_then_the_window():
    a = build("sliding-odd", 10**6, 256)  # window 21, blocks of 16
    assert a.admit(Request(0, 100, 50))
    assert a.blocks_of(0) == 3 * 7  # every prompt block, every group (#30166)
    assert a.steps_until_shrink() == 1
    assert a.step(1)
    # 101 tokens, processed 100: skipped (100 - 21 + 1) // 16 = 5 per sliding group
    assert a.blocks_of(0) == 2 * (7 - 5) + 7
    assert a.group_tables(0)[0][:5] == (0,) * 5


def test_hybrid_fits_more_than_the_fallback():
    cap = min_capacity("gemma-like", 512, hybrid_kv_cache_manager=False) * 3
    counts = {}
    for manager in (True, False):
        a = build("gemma-like", cap, 512, hybrid_kv_cache_manager=manager)
        n = 0
        while a.admit(Request(n, 400, 100)) and n < 10_000:
            a.step(1)  # each steps once: its out-of-window prompt blocks go back
            n += 1
        counts[manager] = n
    assert counts[True] > 2 * counts[False]


def test_admission_gate_caps_windowed_groups():
    a = build("sliding-odd", 10**6, 256, max_num_batched_tokens=8, concurrent_batches=1)
    # sliding cap: ceil(min(21 - 1 + 8, 256) / 16) + 1 = 3 blocks; full: ceil(200 / 16) = 13
    assert a.bytes_for(Request(0, 200, 5), 200) == (2 * 3 + 13) * a.page
    # The gate's need counts the pool's unusable whole pages too (the null block, the
    # remainder), which free_bytes() counts: need > free_bytes() compares free block ids.
    tail = (a.capacity - a.num_blocks * a.page) // a.page
    assert tail >= 1
    assert a.admission_bytes(Request(0, 200, 5), 200, 0) == (2 * 3 + 13 + tail) * a.page
    # Within one step's budget (8 tokens) the cap does not bind: what admit takes.
    assert a.bytes_for(Request(0, 8, 5), 8) == 3 * a.page
    assert a.admit(Request(0, 8, 5)).nbytes == 3 * a.page


def test_gate_counts_free_block_ids():
    """A request whose blocks are exactly the free block ids passes the gate; one more
    block does not, though free_bytes() (with the null block) would hold it."""
    a = build("mla", 10 * 2**10)
    free = a.free_blocks()
    tokens = free * a.block_size
    assert a.admission_bytes(Request(0, tokens, 1), tokens, 0) <= a.free_bytes()
    more = tokens + 1
    assert a.admission_bytes(Request(0, more, 1), more, 0) > a.free_bytes()
    assert a.bytes_for(Request(0, more, 1), more) <= a.free_bytes()


def test_decode_step_is_checked_request_by_request():
    """vLLM allocates the running requests one after the other: a step whose total fits
    (the later decoder frees 2 blocks, the earlier takes 3, 2 free) is refused when the
    earlier one, in admission order, finds too few free; freeing the later one makes room."""
    a = build("sliding-odd", 18 * 256)
    assert a.page == 256 and a.num_blocks == 17
    assert a.admit(Request(0, 31, 10), decoding=True)
    assert a.step(1)  # 32 tokens: its next step takes a block in each of the 3 groups
    assert a.admit(Request(1, 40, 10), decoding=True)  # its first step frees 2 sliding blocks
    assert (a.free_blocks(), a.blocks_of(0), a.blocks_of(1)) == (2, 6, 9)
    assert a.steps_until_full() == 0
    assert not a.step(1)
    a.free(1)  # the engine preempts the last admitted
    assert a.steps_until_full() == 9
    assert a.step(1) and a.blocks_of(0) == 9


def test_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="'align' needs prefix caching"):
        build("jamba-like", 10**6, mamba_cache_mode="align")
    with pytest.raises(ValueError, match="mamba_cache_mode must be one of none, align, not 'x'"):
        build("jamba-like", 10**6, mamba_cache_mode="x")
    # (with prefix caching, a Mamba hybrid runs in "align" mode, as vLLM forces it)
    assert build("jamba-like", 10**6, prefix_caching=True).plan.mamba_cache_mode == "align"
    with pytest.raises(ValueError, match="prefix_caching must be true or false, not 1"):
        build("gemma-like", 10**6, prefix_caching=1)
    with pytest.raises(ValueError, match="only with hybrid_kv_cache_manager true"):
        build("gemma-like", 10**6, prefix_caching=True, hybrid_kv_cache_manager=False)
    with pytest.raises(ValueError, match="LayerStack"):
        make_allocator("hybrid", capacity=10**6, bytes_per_token=16, max_model_len=64)
    a = build("gemma-like", 10**6)
    with pytest.raises(ValueError, match="sample groups"):
        a.admit(Request(0, 4, 4, n=2), tokens=5)
