"""Drive vLLM's real v1 ``Scheduler`` / ``KVCacheManager`` on CPU, step by step (a test oracle).

``run_vllm(requests, ...)`` replays a list of ``OracleRequest`` through
``vllm.v1.core.sched.scheduler.Scheduler`` (the synchronous one; with
``async_scheduling=True`` the ``AsyncScheduler``; one KV-cache group of full attention;
speculative decoding with ``num_speculative_tokens``, see below) and records every iteration,
so kvfrag's engine can be compared with vLLM iteration by iteration.

Loop (step k = the k-th call of ``schedule()``, k = 0, 1, 2, ...):

1. add every request with ``arrival_step <= k`` not yet added, in (arrival_step, rid) order;
2. ``schedule()`` -- also when nothing can run (an empty step is recorded);
3. a fake ``ModelRunnerOutput``: one sampled token (``SAMPLED_TOKEN``) for each scheduled
   request whose prompt (plus, for a resumed request, its earlier output) is complete after
   this step's tokens; a partial prefill chunk samples nothing (what vLLM's model runner does);
4. ``update_from_output()``; record the step.

It stops when every request has finished. A request ends after ``output_tokens`` sampled
tokens (``SamplingParams(max_tokens=output_tokens, ignore_eos=True)``).

Async scheduling (``async_scheduling=True``) runs the loop as ``EngineCore.
step_with_batch_queue`` does with its batch queue of 2: step k's ``schedule()`` comes BEFORE
step k-1's ``update_from_output()``, so step 4 above applies the previous step's output (the
sampled-or-not of each request is read right after its own ``schedule()``, as the model runner
would). A step's record is taken after that update. Its clock ``t``: empty steps (nothing
scheduled: only releasing a finished request) take no time, steps that schedule tokens one
unit, and when the scheduler has no request at all (``has_requests()`` false) the engine core
waits for the next arrival without scheduling. Requests arrive by that clock
(``arrival_step <= t``), and a request's ``first_token_t``/``finished_t`` are the clock at the
end of the step whose output carried the token: kvfrag's times with 1 s iterations.
Synchronous runs have ``t = k``.

Pool size: ``num_blocks`` is the number of *usable* KV blocks. vLLM's ``BlockPool`` keeps
block 0 as its ``null_block`` (never handed out, never free), so the pool given to vLLM has
``num_blocks + 1`` blocks (``cache_config.num_gpu_blocks``, ``KVCacheConfig.num_blocks``).
vLLM's watermark is ``int(watermark * (num_blocks + 1))`` blocks (it uses the pool's total).

Speculative decoding (``num_speculative_tokens=k``, ``spec_method``, ``accepted``): vLLM's
``SpeculativeConfig(method, num_speculative_tokens=k)``; "eagle" and "draft_model" take the tiny
model as their draft (the scheduler never runs it), "ngram" needs none. What the scheduler gets
from the method: ``num_lookahead_tokens`` (KV slots past the scheduled tokens: k for eagle and
draft_model, 0 for ngram) and ``draft_slots`` (budget per scheduled request: 1 for draft_model,
0 otherwise), both in ``OracleRun.config``. The fake model runner verifies a request's drafts
in each step that scheduled some (``scheduled_spec_decode_tokens``) and samples
``1 + min(a, drafts scheduled)`` tokens, ``a`` the next entry of ``accepted[rid]`` (one entry
per such step, in order, resumptions included; drafts that are only padding -- a waiting
request admitted with one token left -- are all rejected and take no entry). Synchronous: after
``update_from_output()`` the runner proposes k drafts for every request of the step
(``update_draft_token_ids``, as ``EngineCore.post_step``; the scheduler drops them for partial
prefills and finished requests; none when the step says ``skip_drafts``). Async: the
``AsyncScheduler`` itself puts k placeholder drafts on each request that samples.

Needs vLLM 0.33.0 installed without its GPU dependencies (``.ci/install-oracle.sh``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TINY_MODEL_DIR = Path(__file__).resolve().parent / "tiny-llama"
SAMPLED_TOKEN = 7  # the id every fake sampling step returns (no special meaning to vLLM)

STEP_FIELDS = (
    "step",
    "scheduled_tokens",
    "running",
    "waiting",
    "preempted",
    "admitted",
    "blocks_used",
    "blocks_used_sched",
    "free_blocks",
    "idle_cached_blocks",
    "prefix_hit_tokens",
    "evictions",
    "finished",
)


@dataclass(frozen=True)
class OracleRequest:
    rid: int
    arrival_step: int  # added to the scheduler just before schedule() of this step
    prompt: tuple[int, ...]  # token ids (equal ids in equal leading blocks -> prefix hits)
    output_tokens: int  # the request ends after sampling this many tokens (ignore_eos)
    priority: int = 0  # vLLM's request priority (run_vllm's policy "priority": lowest first)


@dataclass
class OracleRun:
    steps: list[dict]  # one per step: STEP_FIELDS (ints) + "tokens" / "blocks" (rid -> int)
    requests: dict[int, dict]  # rid -> see run_vllm
    config: dict[str, Any] = field(default_factory=dict)  # the vLLM settings used
    wall_s: float = 0.0  # seconds spent in the loop (vLLM import and config excluded)


@functools.cache
def _vllm() -> dict[str, Any]:
    """Import the vLLM pieces once (6-20 s the first time)."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    # vLLM logs every config at INFO; keep the test output readable.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    return {
        "torch": torch,
        "CacheConfig": CacheConfig,
        "DeviceConfig": DeviceConfig,
        "ModelConfig": ModelConfig,
        "ParallelConfig": ParallelConfig,
        "SchedulerConfig": SchedulerConfig,
        "SpeculativeConfig": SpeculativeConfig,
        "VllmConfig": VllmConfig,
        "SamplingParams": SamplingParams,
        "get_hash_fn_by_name": get_hash_fn_by_name,
        "get_request_block_hasher": get_request_block_hasher,
        "init_none_hash": init_none_hash,
        "Scheduler": Scheduler,
        "AsyncScheduler": AsyncScheduler,
        "FullAttentionSpec": FullAttentionSpec,
        "KVCacheConfig": KVCacheConfig,
        "KVCacheGroupSpec": KVCacheGroupSpec,
        "ModelRunnerOutput": ModelRunnerOutput,
        "DraftTokenIds": DraftTokenIds,
        "Request": Request,
        "StructuredOutputManager": StructuredOutputManager,
    }


def make_scheduler(
    *,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    chunked_prefill: bool,
    prefix_caching: bool,
    max_model_len: int,
    watermark: float = 0.0,
    long_prefill_token_threshold: int = 0,
    reserve_full_isl: bool = True,
    policy: str = "fcfs",
    async_scheduling: bool = False,
    num_speculative_tokens: int = 0,
    spec_method: str = "eagle",
):
    """Build vLLM's v1 Scheduler as EngineCore does, minus the model executor: the synchronous
    ``Scheduler``, or with ``async_scheduling`` the ``AsyncScheduler`` (VllmConfig picks it);
    with ``num_speculative_tokens`` > 0, speculative decoding by ``spec_method``.

    Returns (scheduler, block_hasher or None). ``num_blocks`` usable blocks (+1 null block).
    """
    v = _vllm()
    model_config = v["ModelConfig"](
        model=str(TINY_MODEL_DIR),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float32",
    )
    scheduler_config = v["SchedulerConfig"](
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduler_reserve_full_isl=reserve_full_isl,
        watermark=watermark,
        async_scheduling=async_scheduling,
        policy=policy,
    )
    cache_config = v["CacheConfig"](block_size=block_size, enable_prefix_caching=prefix_caching)
    vllm_config = v["VllmConfig"](
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        # No vllm._C: vLLM cannot infer a platform; the scheduler never touches a device.
        device_config=v["DeviceConfig"](device="cpu"),
        speculative_config=(
            spec_config(model_config, spec_method, num_speculative_tokens)
            if num_speculative_tokens
            else None
        ),
    )
    sc = vllm_config.scheduler_config
    # VllmConfig may rewrite settings; make sure it kept ours.
    kept = {
        "max_num_batched_tokens": (sc.max_num_batched_tokens, max_num_batched_tokens),
        "max_num_seqs": (sc.max_num_seqs, max_num_seqs),
        "enable_chunked_prefill": (sc.enable_chunked_prefill, chunked_prefill),
        "async_scheduling": (bool(sc.async_scheduling), async_scheduling),
        "enable_prefix_caching": (vllm_config.cache_config.enable_prefix_caching, prefix_caching),
        "block_size": (vllm_config.cache_config.block_size, block_size),
        "max_model_len": (vllm_config.model_config.max_model_len, max_model_len),
    }
    changed = {k: got for k, (got, want) in kept.items() if got != want}
    if changed:
        raise RuntimeError(f"VllmConfig changed the oracle's settings: {changed}")
    if vllm_config.num_speculative_tokens != num_speculative_tokens:
        raise RuntimeError(
            f"VllmConfig has {vllm_config.num_speculative_tokens} speculative tokens, "
            f"not {num_speculative_tokens}"
        )

    total_blocks = num_blocks + 1  # + vLLM's null block
    kv_cache_config = v["KVCacheConfig"](
        num_blocks=total_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            v["KVCacheGroupSpec"](
                ["layer"],
                v["FullAttentionSpec"](
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=v["torch"].float32,
                ),
            )
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = total_blocks
    # (hash_block_size == block_size for one group, as EngineCore.__init__ has it)
    scheduler, hasher = scheduler_for(
        vllm_config, kv_cache_config, block_size, block_size, prefix_caching
    )
    if async_scheduling != (type(scheduler).__name__ == "AsyncScheduler"):
        raise RuntimeError(f"async_scheduling={async_scheduling} built {type(scheduler)}")
    return scheduler, hasher


SPEC_METHODS = ("eagle", "draft_model", "ngram")


def spec_config(model_config: Any, method: str, k: int) -> Any:
    """vLLM's ``SpeculativeConfig`` for ``method`` with ``k`` drafts per step. "eagle" and
    "draft_model" take the tiny model as their draft (they need one to build; the scheduler
    only reads the method's lookahead and draft slots from it)."""
    v = _vllm()
    if method not in SPEC_METHODS:
        raise ValueError(f"spec_method {method!r}: one of {SPEC_METHODS}")
    if method == "ngram":
        return v["SpeculativeConfig"](
            method="ngram", num_speculative_tokens=k, prompt_lookup_max=2, prompt_lookup_min=1
        )
    return v["SpeculativeConfig"](
        method=method,
        num_speculative_tokens=k,
        model=str(TINY_MODEL_DIR),
        target_model_config=model_config,
        target_parallel_config=v["ParallelConfig"](),
    )


def scheduler_for(
    vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int,
    prefix_caching: bool,
) -> tuple[Any, Any]:
    """vLLM's `Scheduler` over `kv_cache_config`, and the request block hasher that
    EngineCore.__init__ makes for prefix caching (None without it)."""
    v = _vllm()
    # (the class the engine core builds: scheduler_config.get_scheduler_cls(), the
    # AsyncScheduler with async scheduling on)
    scheduler_cls = (
        v["AsyncScheduler"] if vllm_config.scheduler_config.async_scheduling else v["Scheduler"]
    )
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=v["StructuredOutputManager"](vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=False,
    )
    block_hasher = None
    if prefix_caching:
        hash_fn = v["get_hash_fn_by_name"](vllm_config.cache_config.prefix_caching_hash_algo)
        v["init_none_hash"](hash_fn)
        block_hasher = v["get_request_block_hasher"](
            hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens
        )
    return scheduler, block_hasher


def run_vllm(
    requests: Iterable[OracleRequest],
    *,
    block_size: int = 16,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    chunked_prefill: bool,
    prefix_caching: bool,
    max_model_len: int,
    watermark: float = 0.0,
    long_prefill_token_threshold: int = 0,
    reserve_full_isl: bool = True,
    record_slots: bool = True,
    make: Callable[[], tuple[Any, Any]] | None = None,
    policy: str = "fcfs",
    async_scheduling: bool = False,
    num_speculative_tokens: int = 0,
    spec_method: str = "eagle",
    accepted: Mapping[int, Sequence[int]] | None = None,
) -> OracleRun:
    """Replay ``requests`` through vLLM's real scheduler; one record per ``schedule()`` call.

    Settings go to vLLM as: ``SchedulerConfig(max_num_seqs, max_num_batched_tokens,
    enable_chunked_prefill=chunked_prefill, long_prefill_token_threshold,
    scheduler_reserve_full_isl=reserve_full_isl, watermark, async_scheduling,
    policy="fcfs")``, ``CacheConfig(block_size, enable_prefix_caching=prefix_caching)`` with
    ``num_gpu_blocks = num_blocks + 1``, ``ModelConfig(max_model_len)``. vLLM itself requires
    ``max_num_batched_tokens >= max_num_seqs`` and, without chunked prefill,
    ``max_num_batched_tokens >= max_model_len``.

    Step record (ints, taken after ``update_from_output()`` unless said otherwise; async:
    the update of step k-1's output, which comes after step k's schedule()):
      step               k (the k-th schedule() call)
      t                  the step's clock (k when synchronous; async: see the module)
      scheduled_tokens   tokens scheduled this step (sum over requests)
      running            len(scheduler.running) after the step (finished ones removed)
      waiting            requests waiting after the step: never scheduled + preempted
      preempted          requests preempted inside this step's schedule()
      admitted           requests moved from waiting to running this step (new or resumed)
      blocks_used        num_blocks - free_blocks: blocks with ref_cnt > 0 (a block shared
                         through the prefix cache counts once; the null block is not counted)
      blocks_used_sched  the same, right after schedule() (before update_from_output() frees
                         the blocks of requests finishing this step): the step's peak
      free_blocks        block_pool.get_num_free_blocks(): free blocks INCLUDING idle cached
                         ones (the null block is never in the free queue)
      idle_cached_blocks free blocks (ref_cnt 0) that still hold a prefix-cache hash
      prefix_hit_tokens  tokens found in the prefix cache by this step's admissions
                         (num_computed_tokens at admission, before this step's tokens)
      evictions          cached blocks whose hash was dropped because get_new_blocks()
                         reused them (this step's schedule())
      finished           requests that finished in this step (async: by step k-1's output)
      tokens             {rid: num_computed_tokens} of each running request after the step
      blocks             {rid: blocks in its block table} of each running request
    (``tokens``/``blocks`` only with ``record_slots``; ``blocks`` only for one KV-cache group.)
    With speculative decoding also:
      drafts             draft tokens scheduled this step (sum of scheduled_spec_decode_tokens)
      accepted           {rid: drafts accepted} of the outputs this step's update applied
                         (async: step k-1's), for the requests whose drafts were verified

    ``accepted``: rid -> accepted-draft counts (0..k) of that request's verifying steps, in
    order (see the module); a request that needs more entries than it has is an error.

    ``make``: builds (scheduler, block_hasher) instead of ``make_scheduler`` (the hybrid
    driver's several KV-cache groups, tests/oracle/hybrid_driver.py); the settings above must
    then describe that scheduler, ``num_blocks`` its usable blocks.

    Per request (``OracleRun.requests[rid]``): ``first_token_step`` (step whose output gave
    its first token), ``finished_step``, ``first_token_t``/``finished_t`` (async only: the clock
    at the end of those steps), ``preemptions``, ``admitted_step`` (first step it was scheduled),
    ``prefix_hit_tokens`` (summed over its admissions, resumptions included); with
    speculative decoding ``accepted`` (the counts applied, clipped to the drafts scheduled).
    """
    v = _vllm()
    reqs = sorted(requests, key=lambda r: (r.arrival_step, r.rid))
    if len({r.rid for r in reqs}) != len(reqs):
        raise ValueError("duplicate rid")
    for r in reqs:
        if not r.prompt or r.output_tokens < 1 or r.arrival_step < 0:
            raise ValueError(f"request {r.rid}: empty prompt, output_tokens < 1 or arrival < 0")
        if len(r.prompt) + r.output_tokens > max_model_len:
            raise ValueError(f"request {r.rid}: prompt + output exceeds max_model_len")
    spec_k = num_speculative_tokens
    if spec_k < 0 or (accepted is not None and not spec_k):
        raise ValueError("accepted needs num_speculative_tokens >= 1")
    draws: dict[str, list[int]] = {str(r.rid): [] for r in reqs}
    for rid, counts in (accepted or {}).items():
        if str(rid) not in draws:
            raise ValueError(f"accepted: no request {rid}")
        if any(not 0 <= a <= spec_k for a in counts):
            raise ValueError(f"accepted[{rid}]: counts must lie in 0..{spec_k}")
        draws[str(rid)] = list(counts)

    scheduler, block_hasher = make() if make is not None else make_scheduler(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        chunked_prefill=chunked_prefill,
        prefix_caching=prefix_caching,
        max_model_len=max_model_len,
        watermark=watermark,
        long_prefill_token_threshold=long_prefill_token_threshold,
        reserve_full_isl=reserve_full_isl,
        policy=policy,
        async_scheduling=async_scheduling,
        num_speculative_tokens=spec_k,
        spec_method=spec_method,
    )
    kvm = scheduler.kv_cache_manager
    pool = kvm.block_pool
    managers = kvm.coordinator.single_type_managers
    req_to_blocks = managers[0].req_to_blocks if len(managers) == 1 else None

    # Count evictions: BlockPool.get_new_blocks() calls _maybe_evict_cached_block() on every
    # block it hands out; it returns True when the block still held a cached hash.
    evictions = [0]
    orig_evict = pool._maybe_evict_cached_block

    def counting_evict(block):
        evicted = orig_evict(block)
        if evicted:
            evictions[0] += 1
        return evicted

    pool._maybe_evict_cached_block = counting_evict

    Request, SamplingParams = v["Request"], v["SamplingParams"]
    ModelRunnerOutput = v["ModelRunnerOutput"]
    DraftTokenIds = v["DraftTokenIds"]
    vreqs: dict[str, Any] = {}
    info: dict[int, dict] = {
        r.rid: {
            "first_token_step": None,
            "finished_step": None,
            "preemptions": 0,
            "admitted_step": None,
            "prefix_hit_tokens": 0,
            **({"first_token_t": None, "finished_t": None} if async_scheduling else {}),
            **({"accepted": []} if spec_k else {}),
        }
        for r in reqs
    }
    steps: list[dict] = []
    next_arrival = 0
    unfinished = len(reqs)
    k = 0
    clock = 0  # async: steps that scheduled tokens, and idle waits (see run_vllm)
    # async: the step in flight, (k, its clock, its output, the model's output, its
    # accepted counts), applied after the next schedule() as EngineCore.step_with_batch_queue
    in_flight: tuple[int, int, Any, Any, dict[str, int]] | None = None
    applied_accepted: dict[int, int] = {}  # the accepted counts of the last apply()
    t0 = time.perf_counter()

    def apply(step: int, at: int, out: Any, runner_out: Any, acc: dict[str, int]) -> int:
        """update_from_output() of step `step` (started at clock `at`); returns how many
        requests it finished."""
        req_ids = runner_out.req_ids
        outputs_before = {rid: vreqs[rid].num_output_tokens for rid in req_ids}
        scheduler.update_from_output(out, runner_out)
        applied_accepted.clear()
        for req_id, a in acc.items():
            applied_accepted[int(req_id)] = a
            info[int(req_id)]["accepted"].append(a)
        finished = 0
        for req_id in req_ids:
            vr = vreqs[req_id]
            ri = info[int(req_id)]
            if ri["first_token_step"] is None and vr.num_output_tokens > outputs_before[req_id]:
                ri["first_token_step"] = step
                if async_scheduling:
                    ri["first_token_t"] = at + 1
            if vr.is_finished() and ri["finished_step"] is None:
                ri["finished_step"] = step
                if async_scheduling:
                    ri["finished_t"] = at + 1
                finished += 1
        return finished

    while unfinished:
        time_now = clock if async_scheduling else k
        while next_arrival < len(reqs) and reqs[next_arrival].arrival_step <= time_now:
            r = reqs[next_arrival]
            vr = Request(
                request_id=str(r.rid),
                prompt_token_ids=list(r.prompt),
                sampling_params=SamplingParams(max_tokens=r.output_tokens, ignore_eos=True),
                pooling_params=None,
                arrival_time=float(r.arrival_step),
                priority=r.priority,
                block_hasher=block_hasher,
            )
            vreqs[vr.request_id] = vr
            scheduler.add_request(vr)
            next_arrival += 1
        if async_scheduling and not scheduler.has_requests():
            # EngineCore waits for input without scheduling (nothing is in flight: the last
            # step applied finished every request it held).
            if in_flight is not None:
                unfinished -= apply(*in_flight)
                in_flight = None
            if next_arrival < len(reqs):
                clock = max(clock, reqs[next_arrival].arrival_step)
            continue

        running_before = {vr.request_id for vr in scheduler.running}
        evictions[0] = 0
        out = scheduler.schedule()
        num_sched: dict[str, int] = out.num_scheduled_tokens
        step_evictions = evictions[0]
        blocks_used_sched = num_blocks - pool.get_num_free_blocks()

        admitted = 0
        hit_tokens = 0
        sampled_ids: list[list[int]] = []
        spec_sched = out.scheduled_spec_decode_tokens
        step_accepted: dict[str, int] = {}
        for req_id, n in num_sched.items():
            vr = vreqs[req_id]
            if req_id in spec_sched and not vr.is_prefill_chunk:
                # The runner verifies this step's drafts: 1 + accepted tokens come back.
                if req_id in running_before:
                    if not draws[req_id]:
                        raise ValueError(
                            f"accepted[{req_id}]: no entry left for its step {k} "
                            f"({len(info[int(req_id)]['accepted'])} used)"
                        )
                    a = min(draws[req_id].pop(0), len(spec_sched[req_id]))
                else:  # padding of a waiting request admitted one token short
                    a = 0
                step_accepted[req_id] = a
            if req_id not in running_before:
                admitted += 1
                hits = vr.num_computed_tokens - n  # computed before this step's tokens
                hit_tokens += hits
                ri = info[int(req_id)]
                ri["prefix_hit_tokens"] += hits
                if ri["admitted_step"] is None:
                    ri["admitted_step"] = k
            # The runner samples once the request's known tokens are all computed (read
            # right after schedule(): async, the next schedule() moves it on).
            sampled_ids.append(
                [] if vr.is_prefill_chunk else [SAMPLED_TOKEN] * (1 + step_accepted.get(req_id, 0))
            )
        req_ids = list(num_sched)
        runner_out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled_ids,
        )
        if async_scheduling:
            previous, in_flight = in_flight, (k, clock, out, runner_out, step_accepted)
            applied_accepted.clear()
            finished = apply(*previous) if previous is not None else 0
        else:
            finished = apply(k, k, out, runner_out, step_accepted)
            if spec_k and out.total_num_scheduled_tokens and not out.skip_drafts:
                # EngineCore.post_step: the drafter's proposals for the step's requests
                scheduler.update_draft_token_ids(
                    DraftTokenIds(req_ids, [[SAMPLED_TOKEN] * spec_k for _ in req_ids])
                )
        unfinished -= finished

        free = pool.get_num_free_blocks()
        rec = {
            "step": k,
            "t": clock if async_scheduling else k,
            "scheduled_tokens": out.total_num_scheduled_tokens,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting) + len(scheduler.kv_holding_waiting),
            "preempted": len(out.preempted_req_ids),
            "admitted": admitted,
            "blocks_used": num_blocks - free,
            "blocks_used_sched": blocks_used_sched,
            "free_blocks": free,
            "idle_cached_blocks": (
                sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
                if prefix_caching
                else 0
            ),
            "prefix_hit_tokens": hit_tokens,
            "evictions": step_evictions,
            "finished": finished,
        }
        if spec_k:
            rec["drafts"] = sum(len(t) for t in spec_sched.values())
            rec["accepted"] = dict(applied_accepted)
        if record_slots:
            rec["tokens"] = {int(vr.request_id): vr.num_computed_tokens for vr in scheduler.running}
        if record_slots and req_to_blocks is not None:
            rec["blocks"] = {
                int(vr.request_id): len(req_to_blocks.get(vr.request_id, ()))
                for vr in scheduler.running
            }
        steps.append(rec)

        idle = out.total_num_scheduled_tokens == 0 and not scheduler.running
        stuck = idle and next_arrival == len(reqs) and unfinished
        if async_scheduling:  # (an empty step may only have released a finished request)
            stuck = stuck and len(steps) > 1 and steps[-2]["scheduled_tokens"] == 0
        if stuck:
            left = sorted(int(vr.request_id) for vr in vreqs.values() if not vr.is_finished())
            raise RuntimeError(
                f"step {k}: vLLM cannot schedule anything and nothing runs; requests {left} "
                f"can never fit ({num_blocks} blocks of {block_size})"
            )
        if async_scheduling and out.total_num_scheduled_tokens:
            clock += 1
        k += 1

    for rid, ri in info.items():
        ri["preemptions"] = vreqs[str(rid)].num_preemptions
    wall = time.perf_counter() - t0
    config = {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "vllm_num_gpu_blocks": num_blocks + 1,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "enable_chunked_prefill": chunked_prefill,
        "enable_prefix_caching": prefix_caching,
        "max_model_len": max_model_len,
        "watermark": watermark,
        "watermark_blocks": kvm.watermark_blocks,
        "long_prefill_token_threshold": long_prefill_token_threshold,
        "scheduler_reserve_full_isl": reserve_full_isl,
        "async_scheduling": async_scheduling,
        "policy": policy,
        "sampled_token": SAMPLED_TOKEN,
        "num_speculative_tokens": spec_k,
    }
    if spec_k:
        vc = scheduler.vllm_config
        config.update(
            spec_method=spec_method,
            num_lookahead_tokens=vc.num_lookahead_tokens,
            draft_slots=vc.speculative_config.max_num_new_slots_for_drafting,
            max_num_scheduled_tokens=scheduler.max_num_scheduled_tokens,
        )
    return OracleRun(steps=steps, requests=info, config=config, wall_s=wall)
