"""The split of `internal` for the hybrid allocator with prefix caching (`HybridPrefixCaching`):
padding (a held id's page beyond its group's real slots or Mamba state), out of window (tokens
written in held ids that no holder reads, Mamba states held beside a request's current one)
and rounding. Without a prefix shared it is the split the allocator makes without prefix
caching; with one, the fast engine's columns equal the per-iteration reference's, whose
parts are never negative."""

from __future__ import annotations

import importlib.util
import pathlib
import warnings
from runpy import run_path

import pytest
from kvfrag.sim.allocators import make_allocator
from kvfrag.sim.engine import run
from kvfrag.sim.engine_config import EngineConfig, StepTime
from kvfrag.sim.hybrid.caching import HybridPrefixCaching
from kvfrag.sim.layers import FullAttention, LayerStack, MambaState, SlidingWindow
from kvfrag.sim.reference import reference

warnings.filterwarnings("ignore", message=".*pure-Python.*")

_spec = importlib.util.spec_from_file_location(
    "hybrid_prefix_tests", pathlib.Path(__file__).with_name("test_hybrid_prefix.py"))
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
shared = _mod.shared  # shared-prefix workloads of 8-token hashed chunks
#: The fast engine held to the reference, request by request (tests/sim/agreement.py).
AGREE = run_path(str(pathlib.Path(__file__).with_name("agreement.py")))[
    "assert_fast_equals_reference"]

MML = 256
#: Three sliding layers (window 20) and two full: two sliding groups of two layer slots, one
#: of them a padding layer; and a Mamba hybrid whose 200-byte state is padded to a 256-byte
#: page (16-token attention blocks).
PADDED = LayerStack("padded", (*(SlidingWindow(1, 4, 2, window=20),) * 3,
                               *(FullAttention(1, 4, 2),) * 2))
MAMBA = LayerStack("mamba-200", (*(MambaState(200),) * 3, FullAttention(1, 4, 2)))
COLUMNS = ("internal_padding", "internal_out_of_window")


def make(stack: LayerStack, capacity: int, tokens: int, caching: bool = True):
    return make_allocator("hybrid", capacity=capacity, bytes_per_token=stack.full_bytes_per_token,
                          max_model_len=MML, stack=stack,
                          block_size=16 if stack.mamba_layers else 8,
                          max_num_batched_tokens=tokens, prefix_caching=caching)


def config(chunked: bool) -> EngineConfig:
    return EngineConfig(max_num_seqs=8, max_num_batched_tokens=40 if chunked else MML,
                        chunked_prefill=chunked, step_time=StepTime(0.05, 1e-3, 1e-4))


@pytest.mark.parametrize("chunked", [False, True])
def test_without_a_shared_prefix_the_split_is_the_one_without_prefix_caching(chunked):
    wl = shared(3, 20, 100, 60).drop(columns=["hash_ids"])
    wl.attrs = {}
    cfg = config(chunked)
    plain = run(wl, make(PADDED, 10**5, cfg.max_num_batched_tokens, False), cfg).summary
    cached = run(wl, make(PADDED, 10**5, cfg.max_num_batched_tokens), cfg).summary
    assert plain["internal_padding_frac"] > 0 and plain["internal_out_of_window_frac"] > 0
    for col in ("internal", *COLUMNS):
        assert cached[f"{col}_frac"] == pytest.approx(plain[f"{col}_frac"], rel=1e-12), col


# (Mamba with whole prompts: ~40 preemptions, and a decode step's eviction of an idle cached
# state block lets the waiting head in with a shorter first chunk, which a decode stretch must
# not run past.)
@pytest.mark.parametrize(("stack", "chunked"),
                         [(PADDED, False), (PADDED, True), (MAMBA, False), (MAMBA, True)],
                         ids=["padded-whole", "padded-chunked", "mamba-whole", "mamba-chunked"])
def test_fast_engine_split_matches_the_reference_with_shared_prefixes(stack, chunked,
                                                                      monkeypatch):
    parts: list[dict[str, int]] = []
    walk = HybridPrefixCaching.waste_breakdown

    def checked(self):
        got = walk(self)
        parts.append(got)
        return got

    monkeypatch.setattr(HybridPrefixCaching, "waste_breakdown", checked)
    cfg = config(chunked)
    tokens = cfg.max_num_batched_tokens
    probe = make(stack, 10**9, tokens)
    capacity = (probe.plan.max_request_blocks + 6) * probe.page + 37  # tight: preemptions
    wl = shared(3, 20, 100, 60)
    wl.attrs["hash_block_tokens"] = 16 if stack.mamba_layers else 8
    slow = reference(wl, make(stack, capacity, tokens), cfg)
    result = run(wl, make(stack, capacity, tokens), cfg)
    AGREE(result, slow)  # every request's times, and the time-averaged parts
    fast = result.summary
    assert fast["preemptions"] > 0
    assert parts and all(min(p.values()) >= 0 for p in parts)
    assert fast["prefill_tokens_skipped"] > 0
    assert fast["internal_padding_frac"] > 0 and fast["internal_out_of_window_frac"] > 0
    for col in COLUMNS:
        assert fast[f"{col}_frac"] == pytest.approx(slow["fractions"][col], rel=1e-9,
                                                    abs=1e-12), col
