"""kvfrag's plan of a hybrid model's KV cache: the headline figures, pinned without vLLM.

Every number here was read from vLLM 0.33's own planner on the same shapes
(tests/oracle/test_hybrid_planner_oracle.py checks them all against it where vLLM is
installed); this file keeps them checked where it is not.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from kvfrag.sim.hybrid import plan
from kvfrag.sim.layers import FullAttention, LayerStack, MambaState, SlidingWindow

_SHAPES_PATH = Path(__file__).resolve().parents[1] / "oracle" / "hybrid_shapes.py"
_spec = importlib.util.spec_from_file_location("kvfrag_test_hybrid_shapes", _SHAPES_PATH)
assert _spec is not None and _spec.loader is not None
shapes = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = shapes
_spec.loader.exec_module(shapes)

GiB, MiB = shapes.GiB, shapes.MiB
LEN = 4096


def test_gemma_3_27b_hybrid_manager():
    p = plan(shapes.gemma_3_27b(), 4 * GiB, max_model_len=LEN)
    assert [(g.kind, len(g.layers), g.padding) for g in p.groups] == [
        ("sliding_window", 9, 1),
        ("sliding_window", 9, 1),
        ("sliding_window", 9, 1),
        ("sliding_window", 9, 1),
        ("sliding_window", 8, 2),
        ("sliding_window", 8, 2),
        ("full", 10, 0),
    ]
    # "Add 8 padding layers, may waste at most 15.38% KV cache memory"
    assert p.padding_warnings == (("sliding_window", 8, 15.38),)
    assert p.padding_layers == 8
    assert p.group_size == 10
    assert p.groups[0].layers == (0, 7, 14, 21, 28, 36, 43, 50, 57)  # sliding[0::6]
    assert p.groups[-1].layers == tuple(range(5, 62, 6))
    assert p.page_bytes == 1.25 * MiB
    assert p.num_blocks == 3276 and p.usable_blocks == 3275  # block 0 is the null block
    assert p.scheduler_block_size == p.hash_block_size == 16


def test_gemma_3_27b_without_hybrid_manager():
    p = plan(shapes.gemma_3_27b(), 4 * GiB, hybrid_manager=False, max_model_len=LEN)
    (g,) = p.groups
    assert g.kind == "full" and g.promoted and g.window == 1024
    assert g.layers == tuple(range(62)) and g.padding == 0
    assert p.page_bytes == 7.75 * MiB
    assert p.num_blocks == 528


def test_qwen3_next_544_token_blocks():
    for mode, prefix, mamba_bs, sched in (("none", False, LEN, 69632), ("align", True, 544, 544)):
        p = plan(shapes.qwen3_next(), 4 * GiB, mamba_cache_mode=mode, max_model_len=LEN)
        assert p.mamba_cache_mode == mode and p.prefix_caching is prefix
        assert p.block_size == 544
        assert p.mamba_page_bytes == 1_097_728
        assert p.mamba_page_padded == 544 * 2048  # padded by 1.49 %
        assert round(100 * (p.mamba_page_padded / p.mamba_page_bytes - 1), 2) == 1.49
        assert [(g.kind, len(g.layers)) for g in p.groups] == [("mamba", 12)] * 3 + [("full", 12)]
        assert p.groups[-1].block_size == 544 and p.groups[0].block_size == mamba_bs
        assert p.page_bytes == 12 * 544 * 2048
        assert p.num_blocks == 321
        assert p.scheduler_block_size == p.hash_block_size == sched


def test_qwen3_next_block_size_32_and_flashinfer_checkpoints():
    assert plan(shapes.qwen3_next(), 4 * GiB, 32, max_model_len=LEN).block_size == 544
    # FlashInfer's gated delta net (Hopper) puts align-mode blocks on a 64-token grid.
    p = plan(
        shapes.qwen3_next(),
        4 * GiB,
        mamba_cache_mode="align",
        max_model_len=LEN,
        mamba_checkpoint_alignment=64,
    )
    assert p.block_size == 576 and p.max_request_blocks == 3 * 3 + 8


def test_jamba_80_token_blocks():
    p = plan(shapes.jamba_1_5_mini(), 4 * GiB, max_model_len=LEN)
    assert p.block_size == 80
    assert [(g.kind, len(g.layers)) for g in p.groups] == [("mamba", 4)] * 7 + [("full", 4)]
    assert p.groups[-1].layers == (4, 12, 20, 28)
    assert p.page_bytes == 4 * 80 * 4096
    assert p.num_blocks == 3276


def test_gpt_oss_and_llama_4():
    p = plan(shapes.gpt_oss(36), 4 * GiB, max_model_len=LEN)
    assert [(g.kind, len(g.layers)) for g in p.groups] == [("sliding_window", 18), ("full", 18)]
    assert p.page_bytes == 18 * 16 * 2048 and p.num_blocks == 7281
    p = plan(shapes.llama_4_scout(), 4 * GiB, max_model_len=LEN)
    assert [(g.kind, len(g.layers)) for g in p.groups] == [("chunked_local", 12)] * 3 + [
        ("full", 12)
    ]
    off = plan(shapes.llama_4_scout(), 4 * GiB, hybrid_manager=False, max_model_len=LEN)
    assert len(off.groups) == 1 and off.page_bytes == 4 * p.page_bytes


def test_deepseek_v3_one_mla_group():
    p = plan(shapes.deepseek_v3(), 4 * GiB, max_model_len=LEN)
    (g,) = p.groups
    assert g.kind == "mla" and g.layer_page_bytes == 16 * 576 * 2
    assert p.page_bytes == 61 * 16 * 1152 and p.num_blocks == 4 * GiB // (61 * 16 * 1152)


def test_smaller_attention_pages_get_bigger_blocks():
    # Full layers with twice the heads: the sliding layers' blocks double to match the page.
    stack = LayerStack(
        "mixed",
        tuple(
            FullAttention(16, 128) if i % 4 == 3 else SlidingWindow(8, 128, window=512)
            for i in range(8)
        ),
    )
    p = plan(stack, GiB, max_model_len=LEN)
    assert [(g.kind, g.block_size) for g in p.groups] == [
        ("sliding_window", 32),
        ("sliding_window", 32),
        ("sliding_window", 32),
        ("full", 16),
    ]
    assert p.scheduler_block_size == 32 and p.hash_block_size == 16


def test_refusals():
    with pytest.raises(ValueError, match="Mamba state cannot be promoted"):
        plan(shapes.qwen3_next(), 4 * GiB, hybrid_manager=False, max_model_len=LEN)
    with pytest.raises(ValueError, match="max seq len"):
        plan(shapes.gemma_3_27b(), 1 * GiB, hybrid_manager=False, max_model_len=LEN)
    with pytest.raises(ValueError, match="No available memory"):
        plan(shapes.gemma_3_27b(), 1024, max_model_len=LEN)
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        plan(shapes.qwen3_next(), GiB, mamba_cache_mode="all", max_model_len=LEN)
    with pytest.raises(ValueError, match="block_size"):
        plan(shapes.gemma_3_27b(), GiB, block_size=0, max_model_len=LEN)
    mixed = LayerStack("m", (FullAttention(8, 128), FullAttention(2, 64), MambaState(10**6)))
    with pytest.raises(ValueError, match="not modelled"):
        plan(mixed, GiB, max_model_len=LEN)
