"""Hybrid model shapes as kvfrag `LayerStack`s, built by hand from their published configs.

Shared by the pure planner tests (tests/sim) and the vLLM oracle test; no vLLM needed here.
The Mamba states' byte counts are vLLM's: the sum over its state tensors (conv and temporal)
of their element counts times the dtype size (`MambaStateShapeCalculator`, bf16), with the
config fields kept next to them so the oracle test can rebuild the real shapes.
"""

from __future__ import annotations

from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    LayerStack,
    MambaState,
    SlidingWindow,
)

GiB = 2**30
MiB = 2**20

#: Qwen3-Next-80B-A3B's gated delta net (tp 1): conv (8192, 3) + temporal (32, 128, 128), bf16.
QWEN3_NEXT_GDN = {
    "num_k_heads": 16,
    "num_v_heads": 32,
    "head_k_dim": 128,
    "head_v_dim": 128,
    "conv_kernel_size": 4,
}
QWEN3_NEXT_GDN_BYTES = 2 * ((16 * 128 * 2 + 32 * 128) * 3 + 32 * 128 * 128)  # 1,097,728
#: Jamba-1.5-mini's Mamba 1 (tp 1): conv (8192, 3) + temporal (8192, 16), bf16.
JAMBA_MAMBA1 = {"intermediate_size": 2 * 4096, "state_size": 16, "conv_kernel": 4}
JAMBA_MAMBA1_BYTES = 2 * (8192 * 3 + 8192 * 16)  # 311,296


def gemma_3_27b() -> LayerStack:
    """62 layers, every 6th full, the rest sliding window 1024; 16 KV heads x 128."""
    return LayerStack(
        "gemma-3-27b",
        tuple(
            FullAttention(16, 128) if (i + 1) % 6 == 0 else SlidingWindow(16, 128, window=1024)
            for i in range(62)
        ),
    )


def gpt_oss(layers: int = 36) -> LayerStack:
    """Sliding window 128 (even layers) alternating with full attention; 8 KV heads x 64."""
    name = {36: "gpt-oss-120b", 24: "gpt-oss-20b"}.get(layers, f"gpt-oss-{layers}l")
    return LayerStack(
        name,
        tuple(
            SlidingWindow(8, 64, window=128) if i % 2 == 0 else FullAttention(8, 64)
            for i in range(layers)
        ),
    )


def llama_4_scout() -> LayerStack:
    """48 layers, every 4th full, the rest chunked local attention 8192; 8 KV heads x 128."""
    return LayerStack(
        "llama-4-scout",
        tuple(
            FullAttention(8, 128) if (i + 1) % 4 == 0 else ChunkedLocal(8, 128, chunk=8192)
            for i in range(48)
        ),
    )


def deepseek_v3() -> LayerStack:
    """61 MLA layers: latent 512 + rope 64 per token per layer."""
    return LayerStack("deepseek-v3", tuple(MLA(512, 64) for _ in range(61)))


def qwen3_next() -> LayerStack:
    """48 layers, every 4th full attention (2 KV heads x 256), the rest gated delta net."""
    return LayerStack(
        "qwen3-next-80b-a3b",
        tuple(
            FullAttention(2, 256)
            if (i + 1) % 4 == 0
            else MambaState(QWEN3_NEXT_GDN_BYTES, "gated_delta_net")
            for i in range(48)
        ),
    )


def jamba_1_5_mini() -> LayerStack:
    """32 layers, attention at period 8 offset 4 (8 KV heads x 128), the rest Mamba 1."""
    return LayerStack(
        "jamba-1.5-mini",
        tuple(
            FullAttention(8, 128) if i % 8 == 4 else MambaState(JAMBA_MAMBA1_BYTES, "mamba1")
            for i in range(32)
        ),
    )
