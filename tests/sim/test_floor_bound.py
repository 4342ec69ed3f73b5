"""No allocator holds less than the exact-need floor (issue 35, check 4a): random operation
sequences (admit, chunked grow, step, set_decoding, free, preempt; async on and off) applied
in lockstep to the `floor` allocator and to every allocator kind that runs on each hybrid
preset, in a budget where nothing is refused. At every instant each allocator's held bytes
are at least the floor's (its need plus the chunks in flight), and its token_states equal the
floor's, to the byte."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfrag.sim.allocators import Allocator, Request, make_allocator
from kvfrag.sim.hybrid.caching import HORIZON
from kvfrag.sim.hybrid_presets import STACKS
from kvfrag.sim.layers import ChunkedLocal, LayerStack, SlidingWindow

CAPACITY = 1 << 44  # (nothing is refused: the check is what the same live requests hold)


def _span(stack: LayerStack) -> int:
    """The longest window or chunk of the stack (64 without any): lengths go past it."""
    spans = [layer.window for layer in stack.layers if isinstance(layer, SlidingWindow)]
    spans += [layer.chunk for layer in stack.layers if isinstance(layer, ChunkedLocal)]
    return max(spans, default=64)


def _layouts(stack: LayerStack) -> list[tuple[str, dict]]:
    """The allocator kinds (and options) that run on `stack`: a Mamba hybrid only with the
    layouts that place its layers by type (the hybrid manager, a pool per type, two-level's own
layout with prefix caching); the others
    also as every layout without one keeps every layer."""
    out: list[tuple[str, dict]] = [("hybrid", {"stack": stack}),
                                   ("static-partition", {"stack": stack}),
                                   ("two-level", {"stack": stack, "prefix_caching": True})]
    if stack.mamba_layers:
        return out
    out += [
        ("hybrid", {"stack": stack, "hybrid_kv_cache_manager": False}),
        ("paged", {"block_size": 16}),
        ("prefix-caching", {"block_size": 16}),
        ("contiguous", {"reserve": "oracle"}),
        ("buddy", {"reserve": "pow2_final"}),
        ("torch-caching", {"reserve": "oracle"}),
    ]
    if stack.full_geometry() is not None:
        out.append(("vattention", {"page_size": 2 * 2**20}))
    return out


def _build(kind: str, opts: dict, stack: LayerStack, mml: int, asynchronous: bool) -> Allocator:
    a = make_allocator(kind, capacity=CAPACITY, bytes_per_token=stack.full_bytes_per_token,
                       max_model_len=mml, geometry=stack.geometry(), **opts)
    if kind not in ("hybrid", "floor", "static-partition", "two-level"):
        a.view_model(stack)
    a.defer_block_ids()
    if asynchronous:
        a.set_async()
    return a


OPS = st.lists(
    st.tuples(st.sampled_from(["admit", "admit", "grow", "grow", "step", "step", "decode",
                               "free", "preempt"]),
              st.integers(0, 10**6), st.integers(0, 10**6), st.booleans()),
    min_size=1, max_size=24,
)


def _held(a: Allocator) -> int:
    token_states, reserved, internal, _, _ = a.parts()
    return token_states + reserved + internal


@pytest.mark.parametrize("name", sorted(STACKS))
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=OPS, asynchronous=st.booleans())
def test_no_allocator_holds_less_than_the_floor(name, ops, asynchronous):
    stack = STACKS[name]
    span = _span(stack)
    mml = 4 * span
    floor = _build("floor", {"stack": stack}, stack, mml, asynchronous)
    others = [_build(k, o, stack, mml, asynchronous) for k, o in _layouts(stack)]
    every = [floor, *others]
    prompts: dict[int, int] = {}  # rid -> prompt tokens (live requests)
    last: dict[int, int] = {}  # rid -> tokens its last allocation took (async: in flight)
    rid = 0
    for op, x, y, flag in ops:
        live = floor.rids()
        if op == "admit" and len(live) < 6:
            prompt = 1 + x % (2 * span)
            output = y % (2 * span)
            if prompt + output >= mml:
                output = mml - 1 - prompt
            req = Request(rid, prompt, output)
            first = prompt if flag else 1 + y % prompt  # whole, or a first chunk
            decoding = flag and output > 0
            # the floor's admission figure (chunks in flight included) is vLLM's capped one at most
            assert floor.bytes_for(req, prompt) <= others[0].bytes_for(req, prompt)
            for a in every:
                assert a.admit(req, first, decoding=decoding)
            prompts[rid], last[rid] = prompt, first
            rid += 1
        elif op == "grow" and live:
            r = live[x % len(live)]
            left = floor.final_tokens(r) - floor.tokens(r)
            if left < 1:
                continue
            n = 1 + y % min(left, span + 7)
            in_flight = last[r] if asynchronous and not floor.is_decoding(r) else 0
            in_flight = min(in_flight, floor.tokens(r))
            for a in every:
                assert a.grow(r, n, in_flight)
            last[r] = n
        elif op == "step":
            done = floor.steps_until_done()
            if done is None:
                continue
            n = min(done, x % (2 * span + 1))
            for a in every:
                left = n
                while left:  # (prefix caching looks at most HORIZON steps ahead at once)
                    full = a.steps_until_full()
                    most = left if full is None else min(left, full)
                    assert most >= min(left, HORIZON), a.kind
                    assert a.step(most)
                    left -= most
        elif op == "decode" and live:
            r = live[x % len(live)]
            on = flag and floor.tokens(r) < floor.final_tokens(r)
            for a in every:
                a.set_decoding(r, on)
        elif op in ("free", "preempt") and live:
            r = live[x % len(live)]
            processed = floor.tokens(r) - (1 if asynchronous and floor.is_decoding(r) else 0)
            for a in every:
                if op == "free":
                    a.free(r)
                else:
                    a.free_preempted(r, max(processed, 0))
            del prompts[r], last[r]
        want = floor.parts()
        assert want[2] == want[3] == 0 and sum(want) == CAPACITY
        assert want[0] == sum(floor.need(floor.tokens(r)) for r in floor.rids())
        assert _held(floor) == sum(floor.allocated_bytes(r) for r in floor.rids())
        for a in others:
            got = a.parts()
            assert got[0] == want[0], (a.kind, "token_states")
            assert _held(a) >= _held(floor), (a.kind, _held(a), _held(floor))
    for r in floor.rids():
        floor.free(r)
    assert floor.parts() == (0, 0, 0, 0, CAPACITY)
