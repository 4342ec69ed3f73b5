"""Pin what the vLLM oracle (tests/oracle/vllm_driver.py) reports on tiny cases.

Every expected number below was computed by hand from vLLM 0.33's documented / source
behaviour (v1 Scheduler, KVCacheManager, BlockPool); these tests check OUR understanding of
vLLM. Block size 16 throughout; ``num_blocks`` is the usable pool (vLLM adds a null block).
"""

from __future__ import annotations

import random
import time

import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.scheduler")

from .vllm_driver import STEP_FIELDS, OracleRequest, run_vllm  # noqa: E402

BS = 16


def prompt(n: int, rid: int) -> tuple[int, ...]:
    """n token ids unique to ``rid`` (no accidental prefix hits between requests)."""
    return tuple(100_000 * (rid + 1) + i for i in range(n))


def run(reqs, **kw):
    cfg = dict(
        block_size=BS,
        num_blocks=100,
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        chunked_prefill=True,
        prefix_caching=False,
        max_model_len=2048,
    )
    cfg.update(kw)
    return run_vllm(reqs, **cfg)


def col(r, name):
    return [s[name] for s in r.steps]


def test_record_shape():
    r = run([OracleRequest(0, 0, prompt(20, 0), 5)])
    for s in r.steps:
        assert set(STEP_FIELDS) <= set(s)
        assert all(isinstance(s[f], int) for f in STEP_FIELDS)
        assert s["blocks_used"] + s["free_blocks"] == 100
    assert col(r, "step") == list(range(len(r.steps)))
    assert r.config["vllm_num_gpu_blocks"] == 101


def test_single_request_slots():
    # P=20, O=5: step 0 prefills 20 tokens (2 blocks) and samples token 1; steps 1..4 each
    # compute one token (21..24) and sample tokens 2..5. The 5th sampled token never gets a
    # KV slot: P + O - 1 = 24 slots at the end, still 2 blocks.
    r = run([OracleRequest(0, 0, prompt(20, 0), 5)])
    assert col(r, "scheduled_tokens") == [20, 1, 1, 1, 1]
    assert [s["tokens"].get(0) for s in r.steps] == [20, 21, 22, 23, None]
    assert [s["blocks"].get(0) for s in r.steps] == [2, 2, 2, 2, None]
    assert col(r, "blocks_used_sched") == [2, 2, 2, 2, 2]
    # freed in the step it finishes (synchronous scheduler)
    assert col(r, "blocks_used") == [2, 2, 2, 2, 0]
    assert col(r, "running") == [1, 1, 1, 1, 0]
    assert col(r, "admitted") == [1, 0, 0, 0, 0]
    assert col(r, "finished") == [0, 0, 0, 0, 1]
    assert r.requests[0] == {
        "first_token_step": 0,
        "finished_step": 4,
        "preemptions": 0,
        "admitted_step": 0,
        "prefix_hit_tokens": 0,
    }


def test_block_boundary_after_full_prompt():
    # P=32: 2 full blocks after step 0; step 1 computes token 33 -> a 3rd block.
    r = run([OracleRequest(0, 0, prompt(32, 0), 2)])
    assert col(r, "scheduled_tokens") == [32, 1]
    assert col(r, "blocks_used_sched") == [2, 3]
    assert col(r, "blocks_used") == [2, 0]
    assert r.requests[0]["finished_step"] == 1
    r = run([OracleRequest(0, 0, prompt(32, 0), 3)])
    assert [s["blocks"].get(0) for s in r.steps] == [2, 3, None]
    assert [s["tokens"].get(0) for s in r.steps] == [32, 33, None]


def test_preemption_recompute_and_head_of_line():
    # 4 blocks. A (P=32, O=20) and B (P=16, O=20) both admitted at step 0 (3 blocks).
    # Step 1: running is served in order: A computes token 33 -> takes the last free block;
    # B computes token 17 -> needs a block, none free -> the victim is running[-1] = B
    # itself (recompute: its block is freed, it goes back to the HEAD of waiting).
    # C (P=8, 1 block) arrives at step 1; nothing is admitted in a preempting step, and
    # afterwards FCFS keeps C behind B: B (17 tokens -> 2 blocks) does not fit the 1 free
    # block, so the scan stops and C waits too although it would fit.
    # A needs its 4th block at token 49 (step 17, the free one) and finishes at step 19
    # (first token at 0, 20th at 19). Step 20: B resumes (recomputes 16 + 1 tokens, hit 0)
    # and C is admitted behind it.
    reqs = [
        OracleRequest(0, 0, prompt(32, 0), 20),
        OracleRequest(1, 0, prompt(16, 1), 20),
        OracleRequest(2, 1, prompt(8, 2), 2),
    ]
    r = run(reqs, num_blocks=4)
    s = r.steps
    assert s[0]["admitted"] == 2 and s[0]["blocks_used"] == 3
    assert s[1]["preempted"] == 1 and s[1]["admitted"] == 0
    assert s[1]["running"] == 1 and s[1]["waiting"] == 2
    assert s[1]["blocks_used"] == 3 and s[1]["tokens"] == {0: 33}
    assert all(x["admitted"] == 0 for x in s[1:20])
    assert [x["waiting"] for x in s[1:20]] == [2] * 19
    assert s[17]["blocks"] == {0: 4} and s[16]["blocks"] == {0: 3}
    assert r.requests[0]["finished_step"] == 19
    assert s[19]["blocks_used"] == 0
    assert s[20]["admitted"] == 2 and s[20]["scheduled_tokens"] == 17 + 8
    assert s[20]["tokens"] == {1: 17, 2: 8} and s[20]["blocks"] == {1: 2, 2: 1}
    assert r.requests[1]["preemptions"] == 1
    assert r.requests[1]["first_token_step"] == 0
    assert r.requests[1]["admitted_step"] == 0
    # B: 1 token before the preemption, 19 more from step 20 -> 20th at step 38
    assert r.requests[1]["finished_step"] == 38
    assert r.requests[2] == {
        "first_token_step": 20,
        "finished_step": 21,
        "preemptions": 0,
        "admitted_step": 20,
        "prefix_hit_tokens": 0,
    }
    assert sum(col(r, "preempted")) == 1


def test_victim_is_last_running():
    # 5 blocks, three requests of P=16 admitted at step 0 (3 blocks). Step 1: all three
    # need a 2nd block (token 17): A takes one, B takes one, C finds none -> C (running[-1])
    # preempted. The victim is the most recently admitted, not the one asking.
    reqs = [OracleRequest(i, 0, prompt(16, i), 30) for i in range(3)]
    r = run(reqs, num_blocks=5)
    assert r.steps[1]["preempted"] == 1
    assert r.steps[1]["tokens"] == {0: 17, 1: 17}
    # A case where the asker is not the victim: 5 blocks, A (P=16), B (P=16), C (P=48)
    # fill the pool at step 0. Step 1: A asks for its 2nd block, none free -> the victim
    # is running[-1] = C; its 3 blocks are freed and A's allocation succeeds, then B's.
    reqs = [
        OracleRequest(0, 0, prompt(16, 0), 30),
        OracleRequest(1, 0, prompt(16, 1), 30),
        OracleRequest(2, 0, prompt(48, 2), 30),
    ]
    r = run(reqs, num_blocks=5)
    assert r.steps[0]["blocks_used"] == 5
    assert r.steps[1]["preempted"] == 1 and r.steps[1]["admitted"] == 0
    assert r.steps[1]["tokens"] == {0: 17, 1: 17} and r.steps[1]["blocks_used"] == 4
    assert r.requests[2]["preemptions"] >= 1


def test_chunked_prefill_two_chunks():
    # P=100, budget 64: chunks of 64 and 36; the first token comes from step 1.
    r = run([OracleRequest(0, 0, prompt(100, 0), 3)], max_num_batched_tokens=64)
    assert col(r, "scheduled_tokens") == [64, 36, 1, 1]
    assert [s["blocks"].get(0) for s in r.steps] == [4, 7, 7, None]
    assert r.requests[0]["first_token_step"] == 1
    assert r.requests[0]["finished_step"] == 3


def test_token_budget_running_first():
    # Two P=100 prompts, budget 64. Step 0: A gets 64, the budget is spent, B waits.
    # Step 1: A (running, served first) 36; B admitted with the 28 left.
    # Step 2: A 1 (decode), B 63. Step 3: A 1, B 9 -> B's first token at step 3.
    reqs = [OracleRequest(0, 0, prompt(100, 0), 5), OracleRequest(1, 0, prompt(100, 1), 2)]
    r = run(reqs, max_num_batched_tokens=64)
    assert [s["tokens"] for s in r.steps[:4]] == [
        {0: 64},
        {0: 100, 1: 28},
        {0: 101, 1: 91},
        {0: 102, 1: 100},
    ]
    assert col(r, "scheduled_tokens")[:4] == [64, 64, 64, 10]
    assert r.requests[1]["admitted_step"] == 1
    assert r.requests[1]["first_token_step"] == 3


def test_no_chunked_prefill_waits_for_budget():
    # Without chunked prefill a prompt is scheduled whole or not at all (budget 128).
    reqs = [OracleRequest(0, 0, prompt(100, 0), 3), OracleRequest(1, 0, prompt(100, 1), 2)]
    r = run(reqs, chunked_prefill=False, max_num_batched_tokens=128, max_model_len=128)
    assert col(r, "scheduled_tokens")[:3] == [100, 101, 2]
    assert r.requests[1]["admitted_step"] == 1


def test_reserve_full_isl():
    # 8 blocks. A: P=48 O=10 (3 blocks, 4 from step 1). B (P=100 = 7 blocks) arrives at
    # step 2 with 4 blocks free; budget 64 and A takes 1 token -> B's first chunk is 63
    # tokens = 4 blocks, which would fit.
    reqs = [OracleRequest(0, 0, prompt(48, 0), 10), OracleRequest(1, 2, prompt(100, 1), 2)]
    kw = dict(num_blocks=8, max_num_batched_tokens=64)
    # scheduler_reserve_full_isl=True (vLLM's default): the whole prompt must fit -> B
    # waits until A finishes (step 9) and is admitted at step 10.
    r = run(reqs, **kw)
    assert r.steps[2]["admitted"] == 0 and r.steps[2]["waiting"] == 1
    assert r.requests[1]["admitted_step"] == 10
    assert sum(col(r, "preempted")) == 0
    # reserve_full_isl=False: only the chunk must fit -> admitted at step 2 with 63 tokens;
    # at step 3 it needs 3 more blocks for its last 37 tokens, none free: B (running[-1])
    # preempts itself.
    r = run(reqs, reserve_full_isl=False, **kw)
    assert r.steps[2]["admitted"] == 1 and r.steps[2]["tokens"] == {0: 50, 1: 63}
    assert r.steps[2]["blocks_used"] == 8
    assert r.steps[3]["preempted"] == 1 and r.steps[3]["tokens"] == {0: 51}
    assert r.requests[1]["preemptions"] >= 1


def test_watermark():
    # watermark 0.25 of 7 + 1 = 8 blocks -> 2 blocks kept free when admitting while
    # something runs. A (P=16) runs; at step 1 it holds 2 blocks, 5 free. B (P=64 = 4
    # blocks) arrives at step 1: 4 + 2 > 5 -> not admitted; without watermark it is.
    reqs = [OracleRequest(0, 0, prompt(16, 0), 10), OracleRequest(1, 1, prompt(64, 1), 2)]
    r = run(reqs, num_blocks=7, watermark=0.25)
    assert r.config["watermark_blocks"] == 2
    assert r.steps[1]["admitted"] == 0
    assert r.requests[1]["admitted_step"] == 10  # A finishes at step 9
    r = run(reqs, num_blocks=7)
    assert r.requests[1]["admitted_step"] == 1
    # The watermark does not apply when nothing runs: a lone request may use every block.
    r = run([OracleRequest(0, 0, prompt(112, 0), 1)], num_blocks=7, watermark=0.25)
    assert r.requests[0]["admitted_step"] == 0


def test_prefix_hit_recomputes_last_block():
    # A: P=48 (3 full blocks, all cached at step 0), O=2: finishes at step 1 having also
    # held a 4th block for token 49 (1 token, never full -> never cached).
    # B: the same 48 tokens, arrives at step 3. vLLM caps hits at num_tokens - 1 = 47 ->
    # 2 whole blocks = 32 hit tokens; it recomputes the last 16 in a FRESH block (block
    # tables are append-only) and caches it under the same hash as A's idle 3rd block.
    p = prompt(48, 0)
    reqs = [OracleRequest(0, 0, p, 2), OracleRequest(1, 3, p, 2)]
    r = run(reqs, prefix_caching=True)
    s = r.steps
    assert s[0]["idle_cached_blocks"] == 0 and s[1]["idle_cached_blocks"] == 3
    assert s[1]["blocks_used"] == 0 and s[1]["free_blocks"] == 100
    assert s[2]["scheduled_tokens"] == 0  # empty step: nothing arrived yet
    assert s[3]["prefix_hit_tokens"] == 32 and s[3]["scheduled_tokens"] == 16
    assert s[3]["blocks"] == {1: 3} and s[3]["blocks_used"] == 3
    assert s[3]["idle_cached_blocks"] == 1  # A's 3rd block: a duplicate of B's new one
    assert r.requests[1]["prefix_hit_tokens"] == 32
    assert r.requests[1]["first_token_step"] == 3


def test_prefix_partial_share_and_concurrent_hit():
    # B shares A's first 40 tokens (2 whole blocks + 8) and arrives while A runs:
    # hits are whole blocks only -> 32; the shared blocks count once in blocks_used.
    pa = prompt(64, 0)
    pb = pa[:40] + prompt(24, 1)
    reqs = [OracleRequest(0, 0, pa, 10), OracleRequest(1, 1, pb, 10)]
    r = run(reqs, prefix_caching=True)
    s1 = r.steps[1]
    assert s1["prefix_hit_tokens"] == 32 and s1["scheduled_tokens"] == 1 + 32
    assert s1["blocks"] == {0: 5, 1: 4}
    assert s1["blocks_used"] == 5 + 4 - 2


def test_resumed_request_hits_its_own_output():
    # 5 blocks. A (P=16, O=20) and B (P=16, O=60) admitted at step 0; both cross a block
    # boundary at the same steps (tokens 17 and 33). Step 17: A takes the last block for
    # token 33, B needs one -> B (running[-1]) preempted after computing 32 tokens; its two
    # full blocks (prompt + 16 generated tokens) stay cached, idle. B now has 17 outputs,
    # num_tokens = 33. Resuming needs 3 blocks (2 of them idle hits, counted as taken from
    # the free pool) > 2 free, so it waits until A finishes (step 19). Step 20: B hits
    # num_tokens - 1 = 32 -> 2 whole blocks, generated tokens included, and computes 1.
    reqs = [OracleRequest(0, 0, prompt(16, 0), 20), OracleRequest(1, 0, prompt(16, 1), 60)]
    r = run(reqs, num_blocks=5, prefix_caching=True)
    s = r.steps
    assert s[17]["preempted"] == 1 and s[17]["tokens"] == {0: 33}
    assert s[17]["idle_cached_blocks"] == 2 and s[17]["free_blocks"] == 2
    assert s[18]["admitted"] == 0 and s[19]["admitted"] == 0
    assert r.requests[0]["finished_step"] == 19
    assert s[20]["admitted"] == 1 and s[20]["prefix_hit_tokens"] == 32
    assert s[20]["scheduled_tokens"] == 1 and s[20]["tokens"] == {1: 33}
    assert s[20]["evictions"] == 0  # its new block is A's uncached tail block
    assert r.requests[1]["finished_step"] == 62  # 18th output at step 20, 60th at 62
    # Without prefix caching it recomputes all 33 tokens.
    r = run(reqs, num_blocks=5)
    assert r.steps[20]["prefix_hit_tokens"] == 0 and r.steps[20]["scheduled_tokens"] == 33


def test_generated_blocks_are_cached():
    # vLLM hashes every full block, generated tokens included. P=16, O=17: the last KV
    # slot is token 32 (P + O - 1), so block 2 fills with 16 generated tokens and is
    # cached -> 2 idle cached blocks after the finish. With O=16 it ends at 31: only 1.
    r = run([OracleRequest(0, 0, prompt(16, 0), 17)], prefix_caching=True)
    assert r.steps[-1]["idle_cached_blocks"] == 2
    r = run([OracleRequest(0, 0, prompt(16, 0), 16)], prefix_caching=True)
    assert r.steps[-1]["idle_cached_blocks"] == 1
    # Without prefix caching nothing is ever cached.
    r = run([OracleRequest(0, 0, prompt(16, 0), 17)])
    assert r.steps[-1]["idle_cached_blocks"] == 0


def test_evictions():
    # 4 blocks. A (P=48, O=1) finishes at step 0 and leaves 3 idle cached blocks; the free
    # queue is [never used, A3, A2, A1] (cached blocks go to the tail, last block first).
    # B (P=64, distinct) at step 1 takes all 4: 3 cached blocks evicted.
    reqs = [OracleRequest(0, 0, prompt(48, 0), 1), OracleRequest(1, 1, prompt(64, 1), 1)]
    r = run(reqs, num_blocks=4, prefix_caching=True)
    assert col(r, "idle_cached_blocks") == [3, 4]
    assert col(r, "evictions") == [0, 3]
    assert col(r, "free_blocks") == [4, 4]
    # B with A's first block as its prefix: 1 hit, its own 3 new blocks come from the
    # never-used one and A3, A2 (evicted: 2).
    pb = prompt(48, 0)[:16] + prompt(48, 1)
    r = run([reqs[0], OracleRequest(1, 1, pb, 1)], num_blocks=4, prefix_caching=True)
    assert r.steps[1]["prefix_hit_tokens"] == 16
    assert r.steps[1]["evictions"] == 2


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_speed_300_requests(prefix_caching):
    rng = random.Random(0)
    reqs = []
    for rid in range(300):
        n = rng.randint(50, 2000)
        shared = rng.choice([0, 0, 256, 512]) if prefix_caching else 0
        p = prompt(shared, 999)[:shared] + prompt(n - min(shared, n), rid)
        reqs.append(OracleRequest(rid, rid // 3, p[:n], rng.randint(10, 500)))
    t = time.perf_counter()
    r = run(
        reqs,
        num_blocks=1500,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        prefix_caching=prefix_caching,
    )
    wall = time.perf_counter() - t
    pre = sum(col(r, "preempted"))
    print(
        f"\n300 requests (prefix_caching={prefix_caching}): {len(r.steps)} steps, "
        f"{pre} preemptions, {sum(col(r, 'evictions'))} evictions, "
        f"{sum(col(r, 'prefix_hit_tokens'))} hit tokens, {wall:.2f} s"
    )
    assert all(v["finished_step"] is not None for v in r.requests.values())
    assert pre > 0  # the pool is small enough to preempt
    assert sum(col(r, "finished")) == 300
    # every preemption is followed by exactly one re-admission
    assert sum(col(r, "admitted")) == 300 + pre
    assert pre == sum(v["preemptions"] for v in r.requests.values())
    for s in r.steps:
        # a block table covers exactly the computed tokens
        assert all(s["blocks"][q] == -(-t // BS) for q, t in s["tokens"].items())
        held = sum(s["blocks"].values())
        # shared (prefix-hit) blocks count once in blocks_used
        assert held == s["blocks_used"] if not prefix_caching else held >= s["blocks_used"]
        assert s["blocks_used"] <= s["blocks_used_sched"]  # update_from_output only frees
        assert s["idle_cached_blocks"] <= s["free_blocks"]
    assert wall < 60
