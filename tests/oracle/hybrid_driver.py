"""Drive vLLM 0.33's real ``Scheduler`` with a hybrid model's KV cache on CPU (a test oracle).

The full-attention driver (tests/oracle/vllm_driver.py) gives vLLM one KV-cache group of one
layer. Here every layer of a model shape gets the spec its attention would report on a GPU,
built with vLLM's own classes (``FullAttentionSpec``, ``SlidingWindowSpec``,
``ChunkedLocalAttentionSpec``, ``MLAAttentionSpec``; ``MambaSpec`` with the state shapes and
dtypes of ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator``, after vLLM's
``MambaModelConfig`` and ``Platform._align_hybrid_block_size`` have set the Mamba cache mode,
block size and padded page as on a CUDA GPU: ``align_for_mamba``), and the KV cache is
planned the way
``EngineCore._initialize_kv_caches`` plans it: ``get_global_kv_cache_groups``,
``get_kv_cache_configs``, ``generate_scheduler_kv_cache_config``,
``resolve_kv_cache_block_sizes``. The hybrid KV-cache manager is switched on after
``VllmConfig`` is built (the CPU platform switches it off; the manager itself is
platform-independent), or left off to get vLLM's fallback (every layer promoted to full
attention, one group). The scheduler then runs through ``vllm_driver.run_vllm``'s loop and
fake model output unchanged, so both drivers follow the same step conventions; with
``async_scheduling=True`` that is vLLM's ``AsyncScheduler`` driven as
``EngineCore.step_with_batch_queue`` does (a batch queue of two: step k's ``schedule()``
before step k-1's ``update_from_output()``; the record's clock ``t`` as ``run_vllm`` keeps it).

Extra per step (besides ``vllm_driver.STEP_FIELDS``; after ``update_from_output()`` unless
said otherwise; async: the update that follows the step's ``schedule()``, which applies the
previous step's output, or none for the first step):
  group_blocks        per KV-cache group: non-null blocks in its single-type manager's
                      ``req_to_blocks``, summed over requests
  group_blocks_sched  the same right after ``schedule()`` (the step's peak)
  held                sum of ``group_blocks`` (no prefix caching: each block id has one
                      owner, so held + free_blocks == num_blocks - 1, the null block)
  scheduled           {rid: tokens scheduled this step}
  req_tokens_sched    {rid: num_computed_tokens} right after ``schedule()`` (this step's
                      tokens included)
  req_blocks_sched    {rid: per group, non-null blocks} right after ``schedule()``

Needs vLLM 0.33.0 installed without its GPU dependencies (``.ci/install-oracle.sh``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    Layer,
    LayerStack,
    MambaState,
    SlidingWindow,
)

from . import hybrid_shapes as shapes
from .vllm_driver import TINY_MODEL_DIR, OracleRequest, _vllm, run_vllm, scheduler_for

GROUP_FIELDS = (
    "group_blocks",
    "group_blocks_sched",
    "held",
    "scheduled",
    "req_tokens_sched",
    "req_blocks_sched",
)

_KIND = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
    "MLAAttentionSpec": "mla",
    "MambaSpec": "mamba",
}


@dataclass
class HybridRun:
    """``steps, per_request = run_vllm_hybrid(...)`` unpacks; ``plan`` says what vLLM built."""

    steps: list[dict]
    requests: dict[int, dict]
    plan: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def __iter__(self) -> Iterator[Any]:
        return iter((self.steps, self.requests))


@functools.cache
def _hybrid_vllm() -> dict[str, Any]:
    """vLLM's planner, spec classes and scheduler pieces (imported once)."""
    v = dict(_vllm())
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.config import MambaModelConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    v.update(
        get_global_kv_cache_groups=get_global_kv_cache_groups,
        get_kv_cache_configs=get_kv_cache_configs,
        generate_scheduler_kv_cache_config=generate_scheduler_kv_cache_config,
        resolve_kv_cache_block_sizes=resolve_kv_cache_block_sizes,
        SlidingWindowSpec=SlidingWindowSpec,
        ChunkedLocalAttentionSpec=ChunkedLocalAttentionSpec,
        MLAAttentionSpec=MLAAttentionSpec,
        MambaSpec=MambaSpec,
        shape_calc=MambaStateShapeCalculator,
        dtype_calc=MambaStateDtypeCalculator,
        registry=ModelRegistry,
        mamba_model_config=MambaModelConfig,
        platform=Platform,
        multiple_of=MultipleOf,
        mamba_backends=MambaAttentionBackendEnum,
    )
    return v


def mamba_state(layer: MambaState) -> tuple[tuple, tuple, Any]:
    """(shapes, dtypes, backend) of a Mamba layer from vLLM's calculators (bf16, tp 1): the
    gated delta net of Qwen3-Next or the Mamba 1 of Jamba (tests/oracle/hybrid_shapes.py),
    whose bytes must be the layer's."""
    v = _hybrid_vllm()
    bf16 = v["torch"].bfloat16
    if layer.mamba_kind == "gated_delta_net":
        state = v["shape_calc"].gated_delta_net_state_shape(1, **shapes.QWEN3_NEXT_GDN)
        dtypes = v["dtype_calc"].gated_delta_net_state_dtype(bf16, "auto", "auto")
        backend = v["mamba_backends"].GDN_ATTN
    else:
        assert layer.mamba_kind == "mamba1", layer
        state = v["shape_calc"].mamba1_state_shape(1, **shapes.JAMBA_MAMBA1)
        dtypes = v["dtype_calc"].mamba1_state_dtype(bf16, "auto", "auto")
        backend = v["mamba_backends"].MAMBA1
    spec = v["MambaSpec"](block_size=1, shapes=tuple(state), dtypes=tuple(dtypes))
    if spec.page_size_bytes != layer.state_bytes:
        raise ValueError(f"vLLM sizes this {layer.mamba_kind} state at "
                         f"{spec.page_size_bytes} B, the layer at {layer.state_bytes} B")
    return tuple(state), tuple(dtypes), backend


class _FlashAttentionLike:
    """What `_align_hybrid_block_size` asks of the attention backend on a CUDA GPU."""

    multiple_of: Any = None

    @classmethod
    def get_name(cls) -> str:
        return "FLASH_ATTN"

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None):
        return [cls.multiple_of(16)]

    @classmethod
    def customize_spec(cls, spec):
        return spec


def align_for_mamba(config: Any, stack: LayerStack, max_model_len: int) -> None:
    """Set ``config.cache_config``'s Mamba cache mode, Mamba block size, attention block size
    and padded Mamba page as a CUDA GPU's engine does: vLLM's
    ``MambaModelConfig.verify_and_update_config``, then ``Platform._align_hybrid_block_size``
    with a FlashAttention-like backend (kernel blocks of multiples of 16). The model config
    they read is a stand-in with the stack's attention shape and Mamba state (the CPU config
    is a tiny llama); vLLM's model registry answers with it while they run."""
    v = _hybrid_vllm()
    attn = stack.attention_layers[0]
    mamba_layer = next(layer for layer in stack.layers if isinstance(layer, MambaState))
    state, dtypes, _ = mamba_state(mamba_layer)

    class Model:
        @staticmethod
        def get_mamba_state_shape_from_config(vllm_config):
            return state

        @staticmethod
        def get_mamba_state_dtype_from_config(vllm_config):
            return dtypes

    model_config = SimpleNamespace(
        use_mla=isinstance(attn, MLA),
        dtype=v["torch"].bfloat16,
        architecture="KvfragHybrid",
        max_model_len=max_model_len,
        get_num_kv_heads=lambda parallel_config: attn.kv_heads,
        get_head_size=lambda: attn.head_dim,
    )
    proxy = SimpleNamespace(
        cache_config=config.cache_config,
        model_config=model_config,
        parallel_config=config.parallel_config,
        scheduler_config=config.scheduler_config,
        compilation_config=config.compilation_config,
    )
    backend = type("FA", (_FlashAttentionLike,), {"multiple_of": v["multiple_of"]})

    class GpuLike(v["platform"]):
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config):
            return [backend]

    registry = v["registry"]
    had = "resolve_model_cls" in vars(registry)
    saved = vars(registry).get("resolve_model_cls")
    registry.resolve_model_cls = lambda *a, **k: (Model, "KvfragHybrid")
    try:
        v["mamba_model_config"].verify_and_update_config(proxy)
        GpuLike._align_hybrid_block_size(proxy, backend)
    finally:
        if had:
            registry.resolve_model_cls = saved
        else:
            del registry.resolve_model_cls


def mamba_spec(layer: MambaState, cache_config: Any) -> Any:
    """A Mamba layer's ``MambaSpec`` as its model layer reports it (``MambaBase``), with the
    Mamba block size, padded page and cache mode ``align_for_mamba`` set."""
    state, dtypes, backend = mamba_state(layer)
    return _hybrid_vllm()["MambaSpec"](
        block_size=cache_config.mamba_block_size,
        shapes=state,
        dtypes=dtypes,
        page_size_padded=cache_config.mamba_page_size_padded,
        mamba_type=backend,
        mamba_cache_mode=cache_config.mamba_cache_mode,
    )


def attention_spec(layer: Layer, block_size: int) -> Any:
    """An attention layer's vLLM spec (bf16), as the model's layer would report it; None for
    a Mamba state layer, whose spec needs the platform's block-size alignment first."""
    v = _hybrid_vllm()
    bf16 = v["torch"].bfloat16
    if isinstance(layer, MLA):
        return v["MLAAttentionSpec"](block_size=block_size, num_kv_heads=1,
                                     head_size=layer.latent + layer.rope, dtype=bf16,
                                     cache_dtype_str="auto")
    if not isinstance(layer, FullAttention):
        return None
    heads = {"block_size": block_size, "num_kv_heads": layer.kv_heads,
             "head_size": layer.head_dim, "dtype": bf16}
    if isinstance(layer, SlidingWindow):
        return v["SlidingWindowSpec"](**heads, sliding_window=layer.window)
    if isinstance(layer, ChunkedLocal):
        return v["ChunkedLocalAttentionSpec"](**heads, attention_chunk_size=layer.chunk)
    return v["FullAttentionSpec"](**heads)


def vllm_specs(stack: LayerStack, cache_config: Any) -> dict[str, Any]:
    """Every layer's vLLM spec (bf16), as the model's layers would report them: attention at
    ``cache_config.block_size``, Mamba state as ``mamba_spec`` (after ``align_for_mamba``)."""
    specs: dict[str, Any] = {}
    for i, layer in enumerate(stack.layers):
        if isinstance(layer, MambaState):
            spec = mamba_spec(layer, cache_config)
        else:
            spec = attention_spec(layer, cache_config.block_size)
        specs[f"model.layers.{i}.attn"] = spec
    return specs


def make_hybrid_scheduler(
    stack_or_specs: LayerStack | Mapping[str, Any],
    *,
    budget_bytes: int | None = None,
    num_blocks: int | None = None,
    block_size: int = 16,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    chunked: bool,
    max_model_len: int,
    hybrid_manager: bool = True,
    prefix_caching: bool = False,
    retention: int | None = 0,
    async_scheduling: bool = False,
) -> tuple[Any, Any, dict[str, Any]]:
    """vLLM's scheduler over the KV cache its own planner lays out, as EngineCore builds it.

    Returns (scheduler, block_hasher or None, plan). Either ``budget_bytes`` (the memory the
    planner divides into block ids) or ``num_blocks`` (vLLM's ``num_gpu_blocks_override``: the
    block ids including the null block) sizes the pool. vLLM's own memory check applies: a pool
    that cannot hold one ``max_model_len`` request raises ValueError. ``async_scheduling``:
    vLLM's ``AsyncScheduler`` (what the engine core builds with it on).
    """
    if (budget_bytes is None) == (num_blocks is None):
        raise ValueError("give exactly one of budget_bytes and num_blocks")
    v = _hybrid_vllm()
    config = v["VllmConfig"](
        model_config=v["ModelConfig"](
            model=str(TINY_MODEL_DIR),
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            dtype="bfloat16",
        ),
        cache_config=v["CacheConfig"](block_size=block_size, enable_prefix_caching=prefix_caching,
                                      prefix_cache_retention_interval=retention),
        scheduler_config=v["SchedulerConfig"](
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=chunked,
            async_scheduling=async_scheduling,
            policy="fcfs",
        ),
        device_config=v["DeviceConfig"](device="cpu"),
    )
    sc = config.scheduler_config
    kept = {
        "max_num_batched_tokens": (sc.max_num_batched_tokens, max_num_batched_tokens),
        "max_num_seqs": (sc.max_num_seqs, max_num_seqs),
        "enable_chunked_prefill": (sc.enable_chunked_prefill, chunked),
        "async_scheduling": (bool(sc.async_scheduling), async_scheduling),
        "enable_prefix_caching": (config.cache_config.enable_prefix_caching, prefix_caching),
        "max_model_len": (config.model_config.max_model_len, max_model_len),
    }
    changed = {k: got for k, (got, want) in kept.items() if got != want}
    if changed:
        raise RuntimeError(f"VllmConfig changed the oracle's settings: {changed}")
    # The CPU platform turned the hybrid manager off; a GPU platform would leave it on.
    sc.disable_hybrid_kv_cache_manager = not hybrid_manager
    # A GPU engine core resolves the layout from its backends (FlashAttention: vLLM's default).
    config.cache_config.kv_cache_layout = "LBNHC"
    if num_blocks is not None:
        config.cache_config.num_gpu_blocks_override = num_blocks

    if isinstance(stack_or_specs, LayerStack) and stack_or_specs.mamba_layers:
        align_for_mamba(config, stack_or_specs, max_model_len)
    specs = (
        vllm_specs(stack_or_specs, config.cache_config)
        if isinstance(stack_or_specs, LayerStack)
        else dict(stack_or_specs)
    )
    groups = v["get_global_kv_cache_groups"](config, [dict(specs)])
    memory = budget_bytes if budget_bytes is not None else 0
    (worker,) = v["get_kv_cache_configs"](config, [dict(specs)], [memory], groups)
    kv_cache_config = v["generate_scheduler_kv_cache_config"]([worker])
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
    )
    sched_bs, hash_bs = v["resolve_kv_cache_block_sizes"](kv_cache_config, config)
    scheduler, block_hasher = scheduler_for(config, kv_cache_config, sched_bs, hash_bs,
                                            prefix_caching)
    if async_scheduling != (type(scheduler).__name__ == "AsyncScheduler"):
        raise RuntimeError(f"async_scheduling={async_scheduling} built {type(scheduler)}")
    plan = {
        "num_blocks": kv_cache_config.num_blocks,
        "page_bytes": (
            worker.kv_cache_tensors[0].size // worker.num_blocks if worker.kv_cache_tensors else 0
        ),
        "groups": [
            {
                "kind": _KIND[type(g.kv_cache_spec).__name__],
                "layers": len(g.layer_names),
                "block_size": g.kv_cache_spec.block_size,
                "window": _window(g.kv_cache_spec),
            }
            for g in kv_cache_config.kv_cache_groups
        ],
        "scheduler_block_size": sched_bs,
        "hash_block_size": hash_bs,
        "hybrid_manager": hybrid_manager,
        "max_model_len": max_model_len,
        "mamba_cache_mode": config.cache_config.mamba_cache_mode,
        "mamba_block_size": config.cache_config.mamba_block_size,
        "mamba_page_padded": config.cache_config.mamba_page_size_padded,
    }
    return scheduler, block_hasher, plan


def _window(spec: Any) -> int | None:
    """The sliding window or local chunk of a spec; None for full attention (the fallback's
    promoted specs keep their original fields, so the kind decides)."""
    kind = _KIND[type(spec).__name__]
    if kind == "sliding_window":
        return spec.sliding_window
    return spec.attention_chunk_size if kind == "chunked_local" else None


def _count(blocks: Iterable[Any]) -> int:
    return sum(1 for b in blocks if not b.is_null)


def run_vllm_hybrid(
    requests: Iterable[OracleRequest],
    stack_or_specs: LayerStack | Mapping[str, Any],
    *,
    budget_bytes: int | None = None,
    num_blocks: int | None = None,
    block_size: int = 16,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    chunked: bool,
    hybrid_manager: bool = True,
    max_model_len: int | None = None,
    prefix_caching: bool = False,
    retention: int | None = 0,
    async_scheduling: bool = False,
) -> HybridRun:
    """Replay ``requests`` through vLLM's scheduler over a hybrid model's KV cache.

    ``stack_or_specs``: a kvfrag ``LayerStack`` (attention, sliding, chunked local and MLA
    layers, and the Mamba states of hybrid_shapes' Qwen3-Next and Jamba; its specs are built
    with vLLM's classes, bf16) or vLLM specs by layer name.
    The pool: ``budget_bytes`` of KV memory, or ``num_blocks`` block ids (vLLM's count, the
    null block included). ``max_model_len`` defaults to the longest prompt + output rounded up
    to 16 tokens (it sizes vLLM's memory check and its sliding-window admission reserve).
    ``chunked``: vLLM's chunked prefill with ``max_num_batched_tokens`` per step; without it
    ``max_num_batched_tokens`` must cover ``max_model_len``. ``prefix_caching``: vLLM's
    prefix caching, with ``retention`` its ``prefix_cache_retention_interval`` (0 by default,
    vLLM's; None: dense). ``async_scheduling``: vLLM's ``AsyncScheduler`` (``run_vllm``'s
    async loop: each step's record then carries its clock ``t``, and requests their
    ``first_token_t`` / ``finished_t``).

    Returns ``HybridRun``; ``steps, per_request = run_vllm_hybrid(...)``. ``steps``: one
    record per ``schedule()`` call with ``vllm_driver.STEP_FIELDS`` (``blocks_used`` and
    ``free_blocks`` over the usable ``num_blocks - 1``) plus the fields named in this
    module's docstring; ``per_request``: rid -> first_token_step, finished_step, preemptions,
    admitted_step, prefix_hit_tokens (as ``vllm_driver.run_vllm``). ``plan``: num_blocks,
    page bytes, groups (kind, layers, block size, window), scheduler and hash block sizes.
    Nothing is written to disk.
    """
    reqs = list(requests)
    if max_model_len is None:
        longest = max(len(r.prompt) + r.output_tokens for r in reqs)
        max_model_len = -(-longest // 16) * 16
    scheduler, block_hasher, plan = make_hybrid_scheduler(
        stack_or_specs,
        budget_bytes=budget_bytes,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        chunked=chunked,
        max_model_len=max_model_len,
        hybrid_manager=hybrid_manager,
        prefix_caching=prefix_caching,
        retention=retention,
        async_scheduling=async_scheduling,
    )
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    extra: list[dict] = []  # one per schedule(): its step's fields
    # whether the last schedule()'s step still waits for the update its record follows (async:
    # none follows the first step, and an idle wait's update follows a record already taken)
    waiting_update = [False]
    real_schedule, real_update = scheduler.schedule, scheduler.update_from_output
    by_id = scheduler.requests

    def groups() -> tuple[int, ...]:
        return tuple(sum(_count(b) for b in m.req_to_blocks.values()) for m in managers)

    def schedule():
        out = real_schedule()
        now = groups()
        extra.append({
            "scheduled": {int(r): n for r, n in out.num_scheduled_tokens.items()},
            "group_blocks_sched": now,
            "req_tokens_sched": {
                int(r): by_id[r].num_computed_tokens for r in out.num_scheduled_tokens
            },
            "req_blocks_sched": {
                int(r): tuple(_count(m.req_to_blocks.get(r, ())) for m in managers)
                for r in out.num_scheduled_tokens
            },
            "group_blocks": now,
            "held": sum(now),
        })
        waiting_update[0] = True
        return out

    def update_from_output(out, runner_out):
        result = real_update(out, runner_out)
        if waiting_update[0]:
            now = groups()
            extra[-1].update(group_blocks=now, held=sum(now))
            waiting_update[0] = False
        return result

    scheduler.schedule = schedule
    scheduler.update_from_output = update_from_output
    run = run_vllm(
        reqs,
        block_size=plan["scheduler_block_size"],
        num_blocks=plan["num_blocks"] - 1,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        chunked_prefill=chunked,
        prefix_caching=prefix_caching,
        max_model_len=max_model_len,
        record_slots=True,
        make=lambda: (scheduler, block_hasher),
        async_scheduling=async_scheduling,
    )
    assert len(extra) == len(run.steps)
    steps = [{**s, **e} for s, e in zip(run.steps, extra, strict=True)]
    return HybridRun(steps=steps, requests=run.requests, plan=plan, wall_s=run.wall_s)
