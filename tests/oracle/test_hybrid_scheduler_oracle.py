"""vLLM 0.33's scheduler over a hybrid KV cache, step by step (tests/oracle/hybrid_driver.py).

Pins what vLLM itself does with hybrid models' KV memory, so that kvfrag's `hybrid` allocator
can be held to it: Gemma-3-27B's pool size with and without the hybrid manager and its blocks
per group while prefilling and decoding one long prompt (vllm-hybrid-kv.md's measurement), and
for gpt-oss, Llama-4-Scout (manager on and off) and DeepSeek-V3 shapes a small workload in a
pool tight enough to preempt, whole and chunked prefill, with the accounting that must hold at
every step: per request and group the exact blocks vLLM's single-type managers keep, each
group within the pool, blocks held + free = num_blocks - 1 (the null block), and every request
finished. Nothing is written to disk.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.scheduler")

from . import hybrid_shapes as shapes  # noqa: E402
from .hybrid_driver import HybridRun, make_hybrid_scheduler, run_vllm_hybrid  # noqa: E402
from .vllm_driver import OracleRequest  # noqa: E402

GiB = shapes.GiB
BS = 16
PROMPT = 5000  # the shared doc's long prompt
OUTPUT = 40
W = 1024  # Gemma-3's sliding window


def prompt(rid: int, n: int) -> tuple[int, ...]:
    """Token ids unique to the request (no prefix caching here anyway)."""
    return tuple(1_000_000 * (rid + 1) + i for i in range(n))


def mixed(n: int, seed: int, max_prompt: int, max_output: int) -> list[OracleRequest]:
    """n requests, a quarter of them long (max_prompt / 2 to max_prompt tokens), the rest
    short (under max_prompt / 4); outputs 1 to max_output; arrivals over the first n / 2
    steps."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.25
    prompts = np.where(
        long,
        rng.integers(max_prompt // 2, max_prompt, n),
        rng.integers(1, max_prompt // 4, n),
    )
    outputs = rng.integers(1, max_output, n)
    arrivals = np.sort(rng.integers(0, n // 2, n))
    return [
        OracleRequest(i, int(arrivals[i]), prompt(i, int(prompts[i])), int(outputs[i]))
        for i in range(n)
    ]


# --- Gemma-3-27B: one 5,000-token prompt in 4 GiB -------------------------------------------


@pytest.fixture(scope="module")
def gemma() -> dict[tuple[bool, bool], HybridRun]:
    """(hybrid manager, chunked) -> the run of one 5,000-token prompt, 40 tokens out."""
    runs = {}
    for manager in (True, False):
        for chunked in (True, False):
            runs[manager, chunked] = run_vllm_hybrid(
                [OracleRequest(0, 0, prompt(0, PROMPT), OUTPUT)],
                shapes.gemma_3_27b(),
                budget_bytes=4 * GiB,
                max_num_seqs=8,
                max_num_batched_tokens=2048 if chunked else 6144,
                chunked=chunked,
                hybrid_manager=manager,
                max_model_len=6144,
            )
    return runs


def test_gemma_pool(gemma):
    """3,276 block ids of 1.25 MiB with the hybrid manager (six sliding groups of 9, 9, 9, 9,
    8, 8 layers and a full one of 10), 528 of 7.75 MiB without (one group of 62)."""
    on, off = gemma[True, True].plan, gemma[False, True].plan
    assert (on["num_blocks"], on["page_bytes"]) == (3276, 1.25 * 2**20)
    assert [(g["kind"], g["layers"], g["window"]) for g in on["groups"]] == [
        ("sliding_window", n, W) for n in (9, 9, 9, 9, 8, 8)
    ] + [("full", 10, None)]
    assert (off["num_blocks"], off["page_bytes"]) == (528, 7.75 * 2**20)
    assert [(g["kind"], g["layers"]) for g in off["groups"]] == [("full", 62)]
    for run in gemma.values():
        assert run.steps[0]["free_blocks"] + run.steps[0]["held"] == run.plan["num_blocks"] - 1


def _decode(first: int, steps: int) -> list[int]:
    """Blocks per sliding group while decoding from `first` computed tokens: at each step the
    blocks before token n - W + 1 are freed (n computed before the step) and token n's block
    taken: ceil((n + 1) / bs) - floor((n - W + 1) / bs), i.e. 65 except 64 when n + 1 is a
    multiple of 16 (ceil((W - 1) / bs) + 1 = 65, and one less; never one more)."""
    return [math.ceil((n + 1) / BS) - (n - W + 1) // BS for n in range(first, first + steps)]


def test_gemma_chunked_prefill_then_decode(gemma):
    """The shared doc's measurement: 128, then 192 blocks per sliding group while prefilling in
    2,048-token chunks (and 121 for the last 904-token chunk), then 65 while decoding, 64 at
    every 16th step; the full group holds every token's block."""
    run = gemma[True, True]
    sliding = [s["group_blocks"][:6] for s in run.steps]
    assert all(len(set(g)) == 1 for g in sliding), "the six sliding groups move together"
    decode = [65] * 7 + [64] + [65] * 15 + [64] + [65] * 14
    assert [g[0] for g in sliding] == [128, 192, 121, *decode, 0]
    # Right after schedule(): the last decode step's blocks too (freed as the request ends).
    peak = [s["group_blocks_sched"][0] for s in run.steps]
    assert peak == [128, 192, 121, *_decode(PROMPT, OUTPUT - 1)] == [128, 192, 121, *decode, 65]
    full = [s["group_blocks"][6] for s in run.steps]
    assert full == [128, 256, 313] + [313] * 8 + [314] * 16 + [315] * 14 + [0]
    assert [s["scheduled_tokens"] for s in run.steps] == [2048, 2048, 904] + [1] * 39
    assert (run.requests[0]["first_token_step"], run.requests[0]["finished_step"]) == (2, 41)
    assert sum(s["preempted"] for s in run.steps) == 0
    # Peak held: the second chunk, 6 x 192 + 256 = 1,408 block ids of 3,275.
    assert max(s["held"] for s in run.steps) == 1408


def test_gemma_whole_prefill_holds_every_block_one_step(gemma):
    """Whole prefill: nothing is skipped before the prompt is computed, so every sliding group
    holds all 313 blocks at step 0 and frees down to 65 only at the first decode step."""
    run = gemma[True, False]
    sliding = [s["group_blocks_sched"][0] for s in run.steps]
    assert sliding == [313, *_decode(PROMPT, OUTPUT - 1)]
    assert run.steps[-1]["group_blocks"] == (0,) * 7
    assert run.steps[0]["held"] == 7 * 313
    assert (run.requests[0]["first_token_step"], run.requests[0]["finished_step"]) == (0, 39)


def test_gemma_fallback_keeps_every_token(gemma):
    """Manager off: one group of 62 layers, ceil(tokens / 16) blocks of 7.75 MiB."""
    for chunked, first in ((True, [128, 256, 313]), (False, [313])):
        run = gemma[False, chunked]
        blocks = [s["group_blocks"][0] for s in run.steps]
        assert blocks[: len(first)] == first
        assert blocks[-2:] == [315, 0]  # 5,000 + 39 slots: the last token never gets one
        assert max(blocks) == 315


def test_gemma_long_prompts_in_2_gib():
    """In 2 GiB vLLM refuses the full-attention layout at max_model_len 6,144 (264 block ids
    of 7.75 MiB, one request needs 384); the hybrid manager (1,638 block ids) serves four
    5,000-token prompts."""
    with pytest.raises(ValueError):
        make_hybrid_scheduler(
            shapes.gemma_3_27b(), budget_bytes=2 * GiB, max_num_seqs=8,
            max_num_batched_tokens=2048, chunked=True, max_model_len=6144,
            hybrid_manager=False,
        )
    run = run_vllm_hybrid(
        [OracleRequest(i, 0, prompt(i, PROMPT), OUTPUT) for i in range(4)],
        shapes.gemma_3_27b(), budget_bytes=2 * GiB, max_num_seqs=8,
        max_num_batched_tokens=2048, chunked=True, max_model_len=6144,
    )
    assert run.plan["num_blocks"] == 1638
    assert all(r["finished_step"] is not None for r in run.requests.values())
    assert max(s["held"] for s in run.steps) <= 1637
    assert_invariants(run, 2048)


# --- Small workloads in tight pools ---------------------------------------------------------

# (id, stack, manager, pool, max prompt, max output)
WORKLOADS = [
    ("gpt-oss-120b", lambda: shapes.gpt_oss(36), True, {"num_blocks": 300}, 1600, 400),
    ("gpt-oss-120b-off", lambda: shapes.gpt_oss(36), False, {"num_blocks": 300}, 1600, 400),
    ("llama-4-scout", shapes.llama_4_scout, True, {"budget_bytes": 5 * GiB // 2}, 12000, 400),
    ("llama-4-scout-off", shapes.llama_4_scout, False, {"budget_bytes": 5 * GiB // 2}, 12000,
     400),
    ("deepseek-v3", shapes.deepseek_v3, True, {"num_blocks": 300}, 1600, 400),
]
CHUNK = {"gpt-oss-120b": 512, "llama-4-scout": 2048, "deepseek-v3": 512}


def expected_blocks(kind: str, window: int | None, bs: int, tokens: int, scheduled: int) -> int:
    """What vLLM's single-type manager holds for a request right after allocate_slots: blocks
    up to `tokens` (this step's included), less the blocks wholly skipped by the tokens
    processed before this step (sliding: before n - W + 1; chunked local: the chunks before
    n's)."""
    n = tokens - scheduled
    held = math.ceil(tokens / bs)
    if kind == "sliding_window":
        return held - max(0, n - window + 1) // bs
    if kind == "chunked_local":
        return held - (n // window * window) // bs
    return held


def assert_invariants(run: HybridRun, chunk: int) -> None:
    """Every step: each group within the pool; blocks held (counted in the managers' tables)
    + free = num_blocks - 1; per request and group the exact blocks of `expected_blocks`,
    sliding groups at most ceil((W - 1 + chunk) / bs) + 1 and chunked local at most
    ceil((C - 1 + chunk) / bs). Every request finishes."""
    usable = run.plan["num_blocks"] - 1
    groups = run.plan["groups"]
    for s in run.steps:
        k = s["step"]
        assert max(s["group_blocks"]) <= usable and max(s["group_blocks_sched"]) <= usable, k
        assert s["held"] + s["free_blocks"] == usable, k
        assert sum(s["group_blocks_sched"]) == s["blocks_used_sched"], k
        for rid, per_group in s["req_blocks_sched"].items():
            tokens, n = s["req_tokens_sched"][rid], s["scheduled"][rid]
            for g, got in zip(groups, per_group, strict=True):
                kind, window, bs = g["kind"], g["window"], g["block_size"]
                assert got == expected_blocks(kind, window, bs, tokens, n), (k, rid, g)
                if kind == "sliding_window":
                    assert got <= math.ceil((window - 1 + chunk) / bs) + 1, (k, rid)
                elif kind == "chunked_local":
                    assert got <= math.ceil((window - 1 + chunk) / bs), (k, rid)
    assert all(r["finished_step"] is not None for r in run.requests.values())
    last = run.steps[-1]
    assert (last["running"], last["waiting"], last["held"]) == (0, 0, 0)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize(
    ("name", "make", "manager", "pool", "max_prompt", "max_output"),
    WORKLOADS,
    ids=[w[0] for w in WORKLOADS],
)
def test_workload_invariants(name, make, manager, pool, max_prompt, max_output, chunked):
    """40 mixed requests in a pool where vLLM preempts; the accounting holds at every step."""
    reqs = mixed(40, 0, max_prompt, max_output)
    max_model_len = -(-max(len(r.prompt) + r.output_tokens for r in reqs) // BS) * BS
    chunk = CHUNK[name.removesuffix("-off")] if chunked else max_model_len
    run = run_vllm_hybrid(
        reqs, make(), **pool, max_num_seqs=16, max_num_batched_tokens=chunk,
        chunked=chunked, hybrid_manager=manager, max_model_len=max_model_len,
    )
    kinds = {g["kind"] for g in run.plan["groups"]}
    if manager:
        assert len(run.plan["groups"]) > 1 or kinds == {"mla"}
    else:
        assert kinds == {"full"} and len(run.plan["groups"]) == 1
    assert sum(s["preempted"] for s in run.steps) > 0, "the pool should be tight"
    assert_invariants(run, chunk)
