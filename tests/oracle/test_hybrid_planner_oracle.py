"""kvfrag's hybrid KV-cache plan (`kvfrag.sim.hybrid.plan`) against vLLM 0.33's own planner.

For each model shape, budget and block size, the layers' specs are built with vLLM's classes
(`FullAttentionSpec`, `SlidingWindowSpec`, `ChunkedLocalAttentionSpec`, `MLAAttentionSpec`,
`MambaSpec` with shapes and dtypes from `MambaStateShapeCalculator` /
`MambaStateDtypeCalculator`) and planned as the engine core does: `MambaModelConfig` and
`Platform._align_hybrid_block_size` for Mamba hybrids (with a FlashAttention-like backend:
kernel blocks of multiples of 16), then `get_global_kv_cache_groups`, `get_kv_cache_configs`
and `resolve_kv_cache_block_sizes`. The groups (type, layers, padding, block size, page),
the page size, `num_blocks` and the scheduler / hash block sizes must be kvfrag's exactly.

One `VllmConfig` (tiny llama, bf16, max_model_len 4096) serves every case; each case sets
the cache and scheduler fields it needs and resets them.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.oracle

pytest.importorskip("vllm.v1.core.kv_cache_planning")

from kvfrag.sim.hybrid import plan  # noqa: E402
from kvfrag.sim.layers import (  # noqa: E402
    FullAttention,
    LayerStack,
    MambaState,
    SlidingWindow,
)

from . import hybrid_shapes as shapes  # noqa: E402
from .hybrid_driver import align_for_mamba, attention_spec, mamba_spec  # noqa: E402
from .vllm_driver import TINY_MODEL_DIR, _vllm  # noqa: E402

GiB = shapes.GiB
MAX_MODEL_LEN = 4096
BUDGETS = (2 * GiB, 4 * GiB, 40 * GiB)

# (id, stack, hybrid manager, mamba cache mode, prefix caching)
CASES = [
    ("gemma-3-27b", shapes.gemma_3_27b, True, "none", True),
    ("gemma-3-27b-off", shapes.gemma_3_27b, False, "none", True),
    ("gpt-oss-120b", lambda: shapes.gpt_oss(36), True, "none", True),
    ("gpt-oss-20b", lambda: shapes.gpt_oss(24), True, "none", True),
    ("llama-4-scout", shapes.llama_4_scout, True, "none", True),
    ("llama-4-scout-off", shapes.llama_4_scout, False, "none", True),
    ("deepseek-v3", shapes.deepseek_v3, True, "none", True),
    ("qwen3-next-none", shapes.qwen3_next, True, "none", False),
    ("qwen3-next-align", shapes.qwen3_next, True, "align", True),
    ("jamba-1.5-mini", shapes.jamba_1_5_mini, True, "none", False),
    # Full layers with twice the sliding layers' heads: unify_kv_cache_spec_page_size doubles
    # the sliding blocks, and the hash block size (GCD) differs from the scheduler's (LCM).
    ("mixed-heads", lambda: _mixed_heads(), True, "none", True),
]
# Gemma-3-27B with the hybrid manager is refused in 2 GiB at max_model_len 4096 (each of the
# six sliding groups reserves min(1023 + in-flight tokens, 4096) tokens + 1 block: 2.19 GiB),
# where the full-attention layout fits (1.94 GiB): both planners must refuse it.


def _mixed_heads() -> LayerStack:
    return LayerStack(
        "mixed-heads",
        tuple(
            FullAttention(16, 128) if i % 4 == 3 else SlidingWindow(8, 128, window=512)
            for i in range(8)
        ),
    )


@pytest.fixture(scope="module")
def vllm():
    """vLLM's pieces and one VllmConfig for every case (building it takes seconds)."""
    v = _vllm()
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    config = v["VllmConfig"](
        model_config=v["ModelConfig"](
            model=str(TINY_MODEL_DIR),
            skip_tokenizer_init=True,
            max_model_len=MAX_MODEL_LEN,
            dtype="bfloat16",
        ),
        cache_config=v["CacheConfig"](block_size=16),
        device_config=v["DeviceConfig"](device="cpu"),
    )
    # A GPU engine core resolves the layout from its backends; FlashAttention declares none,
    # so vLLM's default preference applies: LBNHC (layer-outer).
    config.cache_config.kv_cache_layout = "LBNHC"
    return SimpleNamespace(
        config=config,
        groups=get_global_kv_cache_groups,
        configs=get_kv_cache_configs,
        block_sizes=resolve_kv_cache_block_sizes,
    )


def _specs(v, stack: LayerStack) -> dict:
    """Every layer's vLLM spec, as the model's layers would report them."""
    cc = v.config.cache_config
    specs = {}
    for i, layer in enumerate(stack.layers):
        if isinstance(layer, MambaState):
            spec = mamba_spec(layer, cc)
        else:
            spec = attention_spec(layer, cc.block_size)
        specs[f"model.layers.{i}.attn"] = spec
    return specs


_KIND = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
    "MLAAttentionSpec": "mla",
    "MambaSpec": "mamba",
}


def _vllm_plan(v, stack, budget, block_size, manager, mode, prefix, monkeypatch) -> dict:
    """vLLM's plan, in the terms of kvfrag's `Plan`."""
    cfg = v.config
    cc = cfg.cache_config
    monkeypatch.setattr(cc, "block_size", block_size)
    monkeypatch.setattr(cc, "enable_prefix_caching", prefix)
    monkeypatch.setattr(cc, "mamba_cache_mode", mode)
    monkeypatch.setattr(cc, "mamba_block_size", None)
    monkeypatch.setattr(cc, "mamba_page_size_padded", None)
    monkeypatch.setattr(cfg.scheduler_config, "disable_hybrid_kv_cache_manager", not manager)
    if any(isinstance(layer, MambaState) for layer in stack.layers):
        align_for_mamba(cfg, stack, MAX_MODEL_LEN)
    specs = _specs(v, stack)
    groups = v.groups(cfg, [dict(specs)])
    (kv_config,) = v.configs(cfg, [dict(specs)], [budget], groups)
    scheduler_bs, hash_bs = v.block_sizes(kv_config, cfg)
    out_groups = []
    group_size = max(len(g.layer_names) for g in kv_config.kv_cache_groups)
    for g in kv_config.kv_cache_groups:
        spec = g.kv_cache_spec
        layers = tuple(int(re.search(r"\.(\d+)\.", n).group(1)) for n in g.layer_names)
        window = getattr(spec, "sliding_window", None) or getattr(
            spec, "attention_chunk_size", None
        )
        out_groups.append(
            (
                _KIND[type(spec).__name__],
                layers,
                group_size - len(layers),
                spec.block_size,
                spec.page_size_bytes,
                len(layers) * spec.page_size_bytes,
                window,
            )
        )
    return {
        "groups": out_groups,
        "block_size": cc.block_size,
        "mamba_block_size": cc.mamba_block_size,
        "mamba_page_padded": cc.mamba_page_size_padded,
        "mamba_cache_mode": cc.mamba_cache_mode,
        "num_blocks": kv_config.num_blocks,
        "page_bytes": kv_config.kv_cache_tensors[0].size // kv_config.num_blocks,
        "scheduler_block_size": scheduler_bs,
        "hash_block_size": hash_bs,
    }


def _kvfrag_plan(v, stack, budget, block_size, manager, mode, prefix) -> dict:
    cfg = v.config
    p = plan(
        stack,
        budget,
        block_size,
        manager,
        mode,
        max_model_len=MAX_MODEL_LEN,
        prefix_caching=prefix,
        max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
        concurrent_batches=cfg.max_concurrent_batches,
    )
    has_mamba = any(isinstance(layer, MambaState) for layer in stack.layers)
    return {
        "groups": [
            (
                g.kind,
                g.layers,
                g.padding,
                g.block_size,
                g.layer_page_bytes,
                g.page_bytes,
                g.window,
            )
            for g in p.groups
        ],
        "block_size": p.block_size,
        # vLLM leaves mamba_block_size unset for models without Mamba layers.
        "mamba_block_size": p.mamba_block_size if has_mamba else None,
        "mamba_page_padded": p.mamba_page_padded,
        "mamba_cache_mode": p.mamba_cache_mode,
        "num_blocks": p.num_blocks,
        "page_bytes": p.page_bytes,
        "scheduler_block_size": p.scheduler_block_size,
        "hash_block_size": p.hash_block_size,
    }


def _outcome(planner, *args) -> dict | str:
    """The plan, or "refused" where the planner raises ValueError (vLLM's memory check)."""
    try:
        return planner(*args)
    except ValueError:
        return "refused"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("name", "make", "manager", "mode", "prefix"), CASES, ids=[c[0] for c in CASES]
)
def test_plan_matches_vllm(vllm, monkeypatch, name, make, manager, mode, prefix, block_size):
    stack = make()
    for budget in BUDGETS:
        with monkeypatch.context() as m:
            want = _outcome(_vllm_plan, vllm, stack, budget, block_size, manager, mode, prefix, m)
        got = _outcome(_kvfrag_plan, vllm, stack, budget, block_size, manager, mode, prefix)
        assert got == want, (name, budget, block_size)


def test_shared_doc_gemma_figures(vllm, monkeypatch):
    """vllm-hybrid-kv.md: Gemma-3-27B in 4 GiB, 3,276 blocks of 1.25 MiB with the hybrid
    manager, 528 of 7.75 MiB without."""
    stack = shapes.gemma_3_27b()
    for manager, blocks, mib in ((True, 3276, 1.25), (False, 528, 7.75)):
        with monkeypatch.context() as m:
            want = _vllm_plan(vllm, stack, 4 * GiB, 16, manager, "none", True, m)
        assert (want["num_blocks"], want["page_bytes"] / 2**20) == (blocks, mib)


def test_refusals_match_vllm(vllm, monkeypatch):
    """What vLLM refuses, kvfrag refuses: a Mamba hybrid without the hybrid manager, and a
    budget that cannot hold one max_model_len request after the null block."""
    for stack, budget, manager in (
        (shapes.qwen3_next(), 4 * GiB, False),
        (shapes.gemma_3_27b(), 1 * GiB, False),
    ):
        with monkeypatch.context() as m, pytest.raises(ValueError):
            _vllm_plan(vllm, stack, budget, 16, manager, "none", False, m)
        with pytest.raises(ValueError):
            _kvfrag_plan(vllm, stack, budget, 16, manager, "none", False)


@pytest.mark.parametrize("block_size", [16, 2048])
def test_shipped_qwen3_next_scenario_plans_as_vllm(vllm, monkeypatch, block_size):
    """scenarios/qwen3-next-80b-a3b-mamba.yaml's two layouts (--block-size 16 and 2048, about
    52 GB of KV, no prefix caching): vLLM's groups, attention block, padded state page and
    num_blocks."""
    budget = 52_036_611_993
    stack = shapes.qwen3_next()
    with monkeypatch.context() as m:
        want = _vllm_plan(vllm, stack, budget, block_size, True, "none", False, m)
    got = _kvfrag_plan(vllm, stack, budget, block_size, True, "none", False)
    assert got == want
    assert want["block_size"] == (544 if block_size == 16 else 2048)
