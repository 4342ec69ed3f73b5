"""What prefix caching keeps to answer fast, pinned against recomputing it from scratch at every
step of random runs (hybrid with prefix caching, two-level's own layout with it, and two-level
under vLLM's constraints): the held ids' figures counted without sets (`held_figures`) against
collecting every table's ids (`held_figures_walk`); the ids per group with an attention
table's leading nulls found by bisection against counting its nulls; each decoder's quiet stretch
(`PrefixState.quiet`: steps skipped as freeing, taking and caching nothing) against asking
`_quiet_step` at each step; the decoders' list against the live requests; the look-ahead's
answers, walked only as far as each question needs (or not at all where the free blocks
surely suffice), against walking the whole stretch; and the look-ahead's pool (`AheadPool`, an
overlay on the pool) against a full copy of the pool."""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import random
import warnings

import pytest
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.allocators.two_level_own_caching import TwoLevelOwnCaching
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.hybrid import caching, prefix_figures
from kvfrag.sim.hybrid.caching import HORIZON, HybridPrefixCaching
from kvfrag.sim.hybrid.prefix import AheadPool, BlockPool, PrefixState
from kvfrag.sim.layers import FullAttention, LayerStack, MambaState

warnings.filterwarnings("ignore", message=".*pure-Python.*")

_spec = importlib.util.spec_from_file_location(
    "hybrid_prefix_tests", pathlib.Path(__file__).with_name("test_hybrid_prefix.py"))
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
shared = _mod.shared  # shared-prefix workloads of 8-token hashed chunks
STACKS = {s.name: s for s in _mod.STACKS}
STACKS["mamba"] = LayerStack("mamba", (*(MambaState(200),) * 3, FullAttention(1, 4, 2)))
MML = 256


class Counts:
    figures = steps = skipped = questions = blocks = 0


@pytest.fixture
def checked(monkeypatch):
    """Every figures' call and every decode step checked against the from-scratch answer."""
    counts = Counts()
    fast = prefix_figures.held_figures

    def figures(st, live_of, clock, kinds, kind_of, tb, sb, pages, apart=False):
        got = fast(st, live_of, clock, kinds, kind_of, tb, sb, pages, apart)
        assert got == prefix_figures.held_figures_walk(st, live_of, clock, kinds, kind_of, tb,
                                                       sb, pages)
        counts.figures += 1
        return got

    def wrap(cls):
        step = cls._step

        def checked_step(self, st, clock, victims=None):
            decoders = [(rid, live) for rid, live in self._live.items() if live.decoding]
            assert self._decoders() == decoders
            for rid, live in decoders:
                tokens = live.base + clock
                if st.quiet.get(rid, 0) > tokens:
                    processed = tokens - 1
                    if self._lag:
                        processed = (self._first[rid] if self._joined[rid] == clock - 1
                                     else tokens - 2)
                    assert self._quiet_step(st, rid, tokens, self._quiet, processed), (
                        rid, tokens, st.quiet[rid])
                    counts.skipped += 1
            counts.steps += 1
            return step(self, st, clock, victims)

        monkeypatch.setattr(cls, "_step", checked_step)
        for name in ("can_step", "steps_until_full", "steps_until_full_within",
                     "steps_until_shrink"):
            monkeypatch.setattr(cls, name, _checked_question(getattr(cls, name), name, counts))

    counted = PrefixState.blocks_per_group

    def blocks_per_group(st, kind_of, prefix_nulls=()):
        got = counted(st, kind_of, prefix_nulls)
        # (one table a kind, nulls by bisection, against every table scanned)
        assert got == tuple(sum(len(ts[g]) - ts[g].count(0) for ts in st.tables.values())
                            for g in range(len(kind_of)))
        counts.blocks += 1
        return got

    monkeypatch.setattr(PrefixState, "blocks_per_group", blocks_per_group)
    monkeypatch.setattr(caching, "held_figures", figures)
    import kvfrag.sim.allocators.two_level_own_caching as own
    monkeypatch.setattr(own, "held_figures", figures)
    wrap(HybridPrefixCaching)
    wrap(TwoLevelOwnCaching)
    return counts


def _whole_walk(alloc) -> tuple[int | None, int | None]:
    """(steps_until_full, steps_until_shrink) from a walk of the whole stretch (at most
    HORIZON steps) on a copy of the state, as the look-ahead answers them."""
    done = alloc.steps_until_done()
    if done is None:
        return None, None
    st = alloc._st.light_copy()
    pending = [(rid, [list(t) for t in ts], p) for rid, ts, p in alloc._pending]
    limit = full = min(done, HORIZON)
    shrink = None
    evictions = st.pool.evictions
    for s in range(1, limit + 1):
        if alloc._step(st, alloc._clock + s, pending if s == 1 else None) >= 0:
            full = s - 1
            break
        if shrink is None and (st.freed or (alloc._mamba and st.pool.evictions != evictions)):
            shrink = s
    if shrink is None and full < done:
        shrink = full + 1
    return full, shrink


def _checked_question(ask, name, counts):
    """A look-ahead question whose answer is checked against the whole stretch walked."""

    def checked(self, *args):
        got = ask(self, *args)
        if name == "steps_until_shrink" and ((self._freed_last and self._joined)
                                             or self._waited):
            return got
        full, shrink = _whole_walk(self)
        if name == "can_step":
            want = full != 0
        elif name == "steps_until_full":
            want = full
        elif name == "steps_until_full_within":
            want = full if full is None or full < args[0] else args[0]
        else:
            want = shrink
        assert got == want, (name, args, got, want)
        counts.questions += 1
        return got

    return checked


def make(kind: str, stack: LayerStack, capacity: int, tokens: int, **extra):
    return make_allocator(kind, capacity=capacity, bytes_per_token=stack.full_bytes_per_token,
                          max_model_len=MML, stack=stack,
                          block_size=16 if stack.mamba_layers else 8,
                          max_num_batched_tokens=tokens, prefix_caching=True, **extra)


@pytest.mark.parametrize("kind", ["hybrid", "two-level", "two-level-vllm"])
@pytest.mark.parametrize("name", ["ssf", "gemma-like", "gpt-oss-like", "llama4-like", "mamba"])
@pytest.mark.parametrize("seed", [1, 2])
def test_kept_answers_equal_the_recomputed_ones_at_every_step(checked, kind, name, seed):
    stack = STACKS[name]
    rng = random.Random(seed * 31 + len(name))
    chunked = rng.random() < 0.5
    asynchronous = seed == 2
    tokens = 40 if chunked else MML
    extra = {"vllm_groups": True} if kind == "two-level-vllm" else {}
    kind = kind.removesuffix("-vllm")
    # small pools: evictions and preemptions; shared prefixes: ids held by several requests
    # (a Mamba state's page needs more than 1.3 sequences' bytes)
    factor = max(rng.choice([1.3, 1.6, 2.0]), 1.6 if stack.mamba_layers else 0)
    capacity = int(factor * MML * stack.full_bytes_per_token)
    wl = shared(seed, 30, 100, 150)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=tokens, chunked_prefill=chunked,
                       async_scheduling=asynchronous, step_time=StepTime(0.05, 1e-3, 1e-4))
    res = run(wl, make(kind, stack, capacity, tokens, **extra), cfg)
    assert res.summary["prefix_hit_blocks"] > 0
    assert checked.figures > 0 and checked.steps > 0 and checked.skipped > 0
    assert checked.questions > 0
    assert checked.blocks > 0 or kind != "hybrid"


def _reference_copy(pool: BlockPool) -> BlockPool:
    """What a look-ahead's pool used to be: a copy of every dict, no cache."""
    other = copy.deepcopy(pool)
    other.cache = None
    other.evicted = []
    return other


@pytest.mark.parametrize("seed", range(20))
def test_the_look_aheads_pool_takes_and_frees_as_a_copy_would(seed):
    rng = random.Random(seed)
    pool = BlockPool(30)
    held: list[list[int]] = []
    key = 0
    for _ in range(rng.randrange(5, 60)):  # a history: takes, frees, caching, hits
        op = rng.random()
        if op < 0.45 and pool.free_count():
            got = pool.take(rng.randint(1, min(4, pool.free_count())))
            held.append(got)
            for b in got:
                if rng.random() < 0.6:
                    key += 1
                    pool.insert(("k", key), b)
        elif op < 0.8 and held:
            pool.free(held.pop(rng.randrange(len(held))))
        elif op < 1 and pool.keys:  # a hit on cached ids (idle ones revived)
            ids = rng.sample(sorted(pool.keys), min(3, len(pool.keys)))
            pool.touch(ids)
            held.append(ids)
    ahead, want = pool.light_copy(), _reference_copy(pool)
    assert isinstance(ahead, AheadPool)
    before = copy.deepcopy(pool.__dict__)
    mine = [list(t) for t in held]
    for _ in range(40):
        assert ahead.free_count() == want.free_count()
        if rng.random() < 0.5 and want.free_count():
            n = rng.randint(1, min(5, want.free_count()))
            got = ahead.take(n)
            assert got == want.take(n)
            mine.append(got)
        elif mine:
            ids = mine.pop(rng.randrange(len(mine)))
            assert ahead.free(ids) == want.free(ids)
        assert ahead.evictions == want.evictions and ahead.evicted == want.evicted
        for b in range(1, 31):
            assert ahead.ref.get(b) == want.ref.get(b), b
    assert pool.__dict__ == before  # the pool looked ahead from is left as it was


@pytest.mark.parametrize("kind", ["hybrid", "two-level"])
def test_a_copy_taken_while_the_look_ahead_walks_answers_as_the_original(monkeypatch, kind):
    stack = STACKS["ssf"]
    alloc = make(kind, stack, int(1.3 * MML * stack.full_bytes_per_token), MML)
    ask = HybridPrefixCaching.steps_until_shrink
    copies = []

    def shrink_then_copy(self):
        got = ask(self)
        if self is alloc:  # (the look-ahead walked part of the stretch: copied mid-walk)
            other = copy.deepcopy(self)
            assert other.steps_until_full() == self.steps_until_full()
            assert ask(other) == ask(self) == got
            copies.append(other)
        return got

    monkeypatch.setattr(HybridPrefixCaching, "steps_until_shrink", shrink_then_copy)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=MML,
                       step_time=StepTime(0.05, 1e-3, 1e-4))
    run(shared(1, 30, 100, 150), alloc, cfg)
    assert copies
