"""Speculative decoding in vLLM 0.33's scheduler, measured: facts kvfrag's engine must reproduce.

Each test drives vLLM's real v1 ``Scheduler`` (synchronous, or the ``AsyncScheduler``) with
speculative decoding on through tests/oracle/vllm_driver.py (``num_speculative_tokens``,
``spec_method``, ``accepted``) and asserts what it does, step by step:

- a decode step schedules ``1 + k`` tokens (the sampled one and k drafts) from the token budget,
  drafts cut to what the budget leaves; the first decode step after a prompt's final chunk
  already carries drafts, a step after a partial chunk none;
- each allocation reserves ``num_lookahead_tokens`` slots past the scheduled tokens (k for
  EAGLE and a draft model, 0 for n-gram), on prefill chunks too; a request's blocks are the
  high-water mark of ``computed + scheduled + lookahead``: rejected drafts roll
  ``num_computed_tokens`` back and free no block;
- a draft model (``draft_model``) costs each scheduled request one more input slot;
- async scheduling schedules one more decode step of ``1 + k`` for a request whose last tokens
  are in flight (vLLM assumes every draft in flight may be rejected);
- with prefix caching, EAGLE's block hashes also cover the token after the block;
- vLLM's planner puts a draft's KV layers in the target's group (same shape or not): each
  block holds them too, so the pool has budget // (all layers' page bytes) blocks.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.sched.async_scheduler")

from .vllm_driver import OracleRequest, run_vllm  # noqa: E402

BASE = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_model_len=128,
            prefix_caching=False, chunked_prefill=True)


def lone(prompt: int, output: int, k: int, accepted: list[int], method: str = "eagle",
         async_scheduling: bool = False, budget: int = 64):
    return run_vllm([OracleRequest(0, 0, tuple(range(1, prompt + 1)), output)], **BASE,
                    max_num_batched_tokens=budget, num_speculative_tokens=k,
                    spec_method=method, accepted={0: accepted},
                    async_scheduling=async_scheduling)


@pytest.mark.parametrize(("method", "lookahead", "draft_slots"),
                         [("eagle", 3, 0), ("ngram", 0, 0), ("draft_model", 3, 1)])
def test_method_sets_lookahead_and_draft_slots(method, lookahead, draft_slots):
    run = lone(10, 5, 3, [3] * 5, method=method)
    assert run.config["num_lookahead_tokens"] == lookahead
    assert run.config["draft_slots"] == draft_slots
    assert run.config["max_num_scheduled_tokens"] == 64  # = max_num_batched_tokens


@pytest.mark.parametrize("method", ["eagle", "ngram"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("output", "k"), [(9, 3), (10, 3), (17, 2), (2, 4)])
def test_full_acceptance_finishes_in_ceil_steps(method, async_scheduling, output, k):
    """Prefill gives the first token; each decode step then k + 1 (the last one cut at
    max_tokens): the request finishes ceil((O - 1) / (k + 1)) steps after its prefill."""
    run = lone(10, output, k, [k] * output, method=method, async_scheduling=async_scheduling)
    req = run.requests[0]
    decode_steps = math.ceil((output - 1) / (k + 1))
    assert req["first_token_step"] == 0
    assert req["finished_step"] == decode_steps
    assert len(req["accepted"]) == decode_steps
    busy = [s for s in run.steps if s["scheduled_tokens"]]
    for s in busy[1:]:  # every step after the one-chunk prefill: 1 + k tokens
        assert (s["scheduled_tokens"], s["drafts"]) == (1 + k, k)
    # Async: with the last decode step in flight, vLLM schedules one more unless the one token
    # that step is sure to give (all its drafts rejected) reaches max_tokens, i.e. unless the
    # tokens known before it (1 + (d - 1)(k + 1)) plus 1 reach O.
    extra = async_scheduling and 1 + (decode_steps - 1) * (k + 1) + 1 < output
    assert len(busy) == 1 + decode_steps + extra


@pytest.mark.parametrize(("method", "k"), [("eagle", 3), ("ngram", 3), ("eagle", 1),
                                           ("draft_model", 2)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_are_high_water_of_computed_scheduled_lookahead(method, k, async_scheduling):
    """A lone request's blocks after each step = ceil(max over steps so far of
    (computed before the step + scheduled + lookahead) / block size); rejections roll the
    computed count back and never free a block."""
    accepted = [(i * 7) % (k + 1) for i in range(40)]  # 0..k, rejections included
    run = lone(10, 30, k, accepted, method=method, async_scheduling=async_scheduling)
    lookahead = run.config["num_lookahead_tokens"]
    bs = BASE["block_size"]
    high = 0
    # computed before the step = after the previous step's record (sync: its update rolled
    # back its own rejections; async: the update of the step before it)
    computed_before = 0
    rolled_back = 0
    for s in run.steps:
        high = max(high, computed_before + s["scheduled_tokens"] + lookahead)
        assert s["blocks_used_sched"] == math.ceil(high / bs), s
        if 0 in s["tokens"]:
            assert s["blocks"][0] == math.ceil(high / bs), s
            after = s["tokens"][0]
            rolled_back += computed_before + s["scheduled_tokens"] - after
            computed_before = after
    assert sum(run.requests[0]["accepted"]) < k * len(run.requests[0]["accepted"])
    assert rolled_back > 0


def test_async_rollback_lands_a_step_late():
    """Every draft rejected (k 3, prompt 10, output 12): synchronously each update rolls back
    3 before the next schedule; async, a step's rollback comes after the next step was
    scheduled, so computed runs 1 + k ahead and the last step reserves one block more:
    sync ceil((10 + 10 + 4 + 3) / 4) = 7 blocks, async ceil((10 + 13 + 4 + 3) / 4) = 8."""
    k = 3
    sync = lone(10, 12, k, [0] * 11)
    run = lone(10, 12, k, [0] * 11, async_scheduling=True)
    assert [s["tokens"].get(0) for s in sync.steps[:4]] == [10, 11, 12, 13]
    assert [s["tokens"].get(0) for s in run.steps[:4]] == [10, 14, 15, 16]
    for r in (sync, run):
        busy = [s for s in r.steps if s["scheduled_tokens"]]
        assert [s["scheduled_tokens"] for s in busy] == [10] + [1 + k] * 11
        assert r.requests[0]["finished_step"] == 11  # one token per decode step
    assert max(s["blocks_used_sched"] for s in sync.steps) == 7
    assert max(s["blocks_used_sched"] for s in run.steps) == 8


def test_drafts_count_against_the_token_budget_and_are_cut_to_fit():
    """Budget 10, k 3: two decodes take 4 each; the third gets the 2 left: its sampled token
    and 1 draft (an accepted count of 3 is clipped to the 1 draft scheduled)."""
    reqs = [OracleRequest(i, 0, tuple(range(1, 5)), 20) for i in range(3)]
    run = run_vllm(reqs, **BASE, max_num_batched_tokens=10, num_speculative_tokens=3,
                   accepted={i: [3] * 20 for i in range(3)})
    s0, s1, s2 = run.steps[:3]
    assert s0["tokens"] == {0: 4, 1: 4, 2: 2}  # prefill: 4 + 4 + a 2-token chunk
    assert s0["drafts"] == 0
    # step 1: two decodes (4 + 4), request 2's last prefill chunk (2): drafts 6
    assert (s1["scheduled_tokens"], s1["drafts"]) == (10, 6)
    # step 2: request 2's first decode step is cut to 1 + 1 draft
    assert (s2["scheduled_tokens"], s2["drafts"]) == (10, 7)
    assert s2["accepted"] == {0: 3, 1: 3, 2: 1}
    # blocks on the prefill step include the lookahead: ceil((4 + 3) / 4), ceil((2 + 3) / 4)
    assert s0["blocks"] == {0: 2, 1: 2, 2: 2}


def test_draft_model_costs_one_input_slot_per_scheduled_request():
    """draft_model (draft_slots 1): two requests scheduled use 2 x (4 + 1) = 10 of the input
    budget of 10, so the third is not admitted until one finishes."""
    reqs = [OracleRequest(i, 0, tuple(range(1, 5)), 20) for i in range(3)]
    run = run_vllm(reqs, **BASE, max_num_batched_tokens=10, num_speculative_tokens=3,
                   spec_method="draft_model", accepted={i: [3] * 20 for i in range(3)})
    for s in run.steps[:6]:
        assert (s["scheduled_tokens"], s["running"], s["waiting"]) in {(8, 2, 1), (8, 0, 1)}
    assert run.requests[2]["admitted_step"] == 6


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_follow_the_final_prefill_chunk_only(async_scheduling):
    """A 10-token prompt in chunks of 6 and 4: no drafts after the partial chunk; the step
    after the final chunk (which samples) carries k drafts. Prefill chunks reserve the
    lookahead too: ceil((6 + 3) / 4) = 3 blocks after the first chunk."""
    run = lone(10, 5, 3, [1] * 5, budget=6, async_scheduling=async_scheduling)
    assert [s["scheduled_tokens"] for s in run.steps[:3]] == [6, 4, 4]
    assert [s["drafts"] for s in run.steps[:3]] == [0, 0, 3]
    assert run.steps[0]["blocks"] == {0: 3}
    assert run.requests[0]["first_token_step"] == 1


def test_preemption_under_pressure_counts_lookahead():
    """14 blocks of 4, three 8-token prompts, k 2 (EAGLE, lookahead 2), all accepted: each
    step needs ceil((computed + 3 + 2) / 4) blocks a request; at computed 14 that is 5 each,
    15 > 14, and the last request is preempted (step 3)."""
    reqs = [OracleRequest(i, 0, tuple(range(1, 9)), 16) for i in range(3)]
    run = run_vllm(reqs, block_size=4, num_blocks=14, max_num_seqs=4, max_model_len=128,
                   prefix_caching=False, chunked_prefill=True, max_num_batched_tokens=64,
                   num_speculative_tokens=2, accepted={i: [2] * 20 for i in range(3)})
    assert [s["blocks_used"] for s in run.steps[:3]] == [9, 12, 12]
    assert [s["preempted"] for s in run.steps[:4]] == [0, 0, 0, 1]
    assert run.steps[3]["blocks"] == {0: 5, 1: 5}
    assert run.requests[2]["preemptions"] == 1


def test_accepted_is_checked():
    with pytest.raises(ValueError, match=r"0\.\.3"):
        lone(10, 5, 3, [4])
    with pytest.raises(ValueError, match=r"accepted\[0\]: no entry left"):
        lone(10, 9, 3, [0])


@pytest.mark.parametrize(("method", "hit"), [(None, 16), ("eagle", 12), ("ngram", 16),
                                             ("draft_model", 16)])
def test_eagle_block_hashes_cover_the_next_token(method, hit):
    """Prefix caching: two prompts share 16 tokens (4 blocks of 4) and differ after. With
    EAGLE a block's hash also covers the token after it (num_hash_lookahead_tokens 1), so the
    block that ends where the prompts part is no hit: 12 tokens, not 16."""
    shared = tuple(range(1, 17))
    reqs = [OracleRequest(0, 0, (*shared, 100, 101), 3),
            OracleRequest(1, 5, (*shared, 200, 201), 3)]
    spec = dict(num_speculative_tokens=2, spec_method=method,
                accepted={0: [0] * 3, 1: [0] * 3}) if method else {}
    run = run_vllm(reqs, **{**BASE, "prefix_caching": True}, max_num_batched_tokens=64, **spec)
    assert run.requests[1]["prefix_hit_tokens"] == hit


@pytest.mark.parametrize(("drafts", "draft_heads", "num_blocks"),
                         [(0, 8, 2048), (1, 8, 1820), (2, 8, 1638), (1, 4, 1927)])
def test_draft_kv_layers_share_the_targets_blocks(drafts, draft_heads, num_blocks):
    """vLLM's planner over 8 target layers (8 KV heads of 128, bf16, blocks of 16: 64 KiB a
    layer a block) and the draft's layers (EAGLE: one; MTP: its MTP layers), 1 GiB: a draft
    layer joins the target's group and every block holds it too, so num_blocks = budget //
    (sum of the layers' page bytes): 2**30 // (9 * 64 KiB) = 1820; a draft of 4 KV heads,
    2**30 // (8 * 64 KiB + 32 KiB) = 1927."""
    import torch
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    from .vllm_driver import TINY_MODEL_DIR, _vllm

    v = _vllm()
    cfg = v["VllmConfig"](
        model_config=v["ModelConfig"](model=str(TINY_MODEL_DIR), skip_tokenizer_init=True,
                                      max_model_len=4096, dtype="bfloat16"),
        cache_config=v["CacheConfig"](block_size=16),
        device_config=v["DeviceConfig"](device="cpu"),
    )
    cfg.cache_config.kv_cache_layout = "LBNHC"  # (as tests/oracle/test_hybrid_planner_oracle)

    def spec(heads: int, draft: bool):
        s = v["FullAttentionSpec"](block_size=16, num_kv_heads=heads, head_size=128,
                                   dtype=torch.bfloat16)
        return dataclasses.replace(s, is_draft=draft)

    specs = {f"model.layers.{i}.attn": spec(8, False) for i in range(8)}
    specs |= {f"draft.layers.{j}.attn": spec(draft_heads, True) for j in range(drafts)}
    groups = get_global_kv_cache_groups(cfg, [dict(specs)])
    (kv_config,) = get_kv_cache_configs(cfg, [dict(specs)], [1 << 30], groups)
    assert [len(g.layer_names) for g in kv_config.kv_cache_groups] == [8 + drafts]
    assert kv_config.num_blocks == num_blocks
    assert num_blocks == (1 << 30) // sum(s.page_size_bytes for s in specs.values())
