"""Model presets as stacks of typed layers (`sim.layers.LayerStack`): the hybrid models served
today, and a full-attention control of similar size.

Each preset is written out here from its published config.json (layers by type, window or
chunk, KV heads, head size, dtype; Mamba states from their shapes as vLLM sizes them), and
tests/sim/test_layers.py checks it twice: its figures are pinned, and parsing the config copy
in tests/sim/hf_configs/ with `sim.hf_config` gives the same stack. Where the copy is not the
model's own file but a mirror, a derivative with the same architecture, or another source's
transcription of it, the comment says so (tests/sim/hf_configs/SOURCE.md lists every source).

`STACKS` are the new presets; `stack(name)` also answers the full-attention presets of
`sim.geometry.PRESETS` (llama-3-8b, ...) as uniform stacks, unchanged. `ARCHITECTURES` holds
the matrices (for timing on `hardware` and a derived kv_budget) only where they are sound: the
dense full-attention control. The mixture-of-experts presets (gpt-oss, Llama 4, DeepSeek-V3,
Qwen3-Next, Jamba) have none: the weights a step reads and the FLOPs a token costs depend on
the experts routed to, which `sim.architecture.Architecture` cannot say. The Gemma presets
have none either: the roofline prices every layer's attention over the whole context, while
their sliding layers read only the window (a several-fold overstatement at long context).
Timing from `hardware` and a derived kv_budget are then refused with the scenario's existing
message; give `engine.step_time` coefficients and a `kv_budget`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvfrag.sim.architecture import Architecture
from kvfrag.sim.geometry import PRESETS as FULL_PRESETS
from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    Layer,
    LayerStack,
    MambaState,
    SlidingWindow,
)


def _stack(name: str, n: int, layer: Callable[[int], Layer]) -> LayerStack:
    return LayerStack(name, tuple(layer(i) for i in range(n)))


def _every(k: int, full: Layer, other: Layer) -> Callable[[int], Layer]:
    """Layer i is `full` when (i + 1) is a multiple of k (Gemma 3, Llama 4, Qwen3-Next)."""
    return lambda i: full if (i + 1) % k == 0 else other


def _gemma3_27b() -> LayerStack:
    # google/gemma-3-27b-it config.json, text_config: 62 layers, 16 KV heads x 128, window
    # 1024, sliding_window_pattern 6 (transformers' default; the 27B config omits it), bf16.
    # Copy: tests/sim/hf_configs/gemma-3-27b.json (text_config as transcribed in a public
    # test suite; the hub file itself was not in the search tools).
    return _stack("gemma-3-27b", 62,
                  _every(6, FullAttention(16, 128), SlidingWindow(16, 128, window=1024)))


def _gemma2_27b() -> LayerStack:
    # google/gemma-2-27b-it config.json: 46 layers, 16 KV heads x 128, window 4096, even
    # layers sliding (transformers' Gemma 2 layer_types), bf16. Copy: the config of
    # EdgerunnersArchive/google-gemma-2-27b-it-ortho (an abliterated copy of the same model).
    return _stack("gemma-2-27b", 46, lambda i: SlidingWindow(16, 128, window=4096)
                  if i % 2 == 0 else FullAttention(16, 128))


def _gpt_oss(name: str, n: int) -> LayerStack:
    # openai/gpt-oss-{20b,120b} config.json: layer_types sliding_attention / full_attention
    # alternating, sliding_window 128, 8 KV heads x 64, bf16 attention (MXFP4 experts).
    # Copies: fine-tunes' configs with the same architecture (20b: cryptonaut/AltiMind-sft,
    # 120b: GohaDAYN/Affine-A10), checked against openai/gpt-oss-120b's original/config.json.
    return _stack(name, n, lambda i: SlidingWindow(8, 64, window=128)
                  if i % 2 == 0 else FullAttention(8, 64))


def _llama4_scout() -> LayerStack:
    # meta-llama/Llama-4-Scout-17B-16E config.json, text_config: 48 layers, 8 KV heads x 128,
    # attention_chunk_size 8192, no_rope_layers [1, 1, 1, 0] x 12 (NoPE layers, every 4th, are
    # full attention; vLLM's Llama4Attention chunks the RoPE ones), bf16. Copy: text_config as
    # transcribed in public test suites (the hub repo is gated).
    return _stack("llama-4-scout", 48,
                  _every(4, FullAttention(8, 128), ChunkedLocal(8, 128, chunk=8192)))


def _deepseek_v3() -> LayerStack:
    # deepseek-ai/DeepSeek-V3 config.json: 61 layers, MLA with kv_lora_rank 512 and
    # qk_rope_head_dim 64 (one 576-value latent per token per layer), bf16. Copy: the full
    # DeepseekV3ForCausalLM config in cann/cann-recipes-train; vLLM's DeepseekV3Config
    # defaults agree.
    return _stack("deepseek-v3", 61, lambda i: MLA(latent=512, rope=64))


def _qwen3_next() -> LayerStack:
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, full_attention_interval 4
    # (12 full, 2 KV heads x 256), 36 gated delta nets (16 key / 32 value heads of 128,
    # conv kernel 4: 1,097,728 B of state each), bf16. Copy: the config of
    # Qwen/Qwen3-Coder-Next (same architecture) as published copies give it; vLLM's
    # Qwen3NextConfig defaults (hidden 2048, 48 layers, 16 heads, 2 KV heads) agree.
    gdn = MambaState.gated_delta_net(16, 32, 128, 128, 4)
    return _stack("qwen3-next-80b-a3b", 48, _every(4, FullAttention(2, 256), gdn))


def _jamba_mini() -> LayerStack:
    # ai21labs/AI21-Jamba-1.5-Mini config.json: 32 layers, attention where i % 8 == 4
    # (attn_layer_period 8, attn_layer_offset 4: 4 layers, 8 KV heads x 128), 28 Mamba 1
    # layers (hidden 4096 x mamba_expand 2, d_state 16, d_conv 4: 311,296 B each), bf16.
    # UNVERIFIED for 1.5: its own config was not in the search tools; these are the figures
    # of ai21labs/Jamba-v0.1's config (Severian/Jamba-Hercules, FreedomIntelligence copies),
    # the architecture Jamba 1.5 Mini is published with, and the shared doc's table agrees.
    mamba = MambaState.mamba1(2 * 4096, 16, 4)
    return _stack("jamba-1.5-mini", 32,
                  lambda i: FullAttention(8, 128) if i % 8 == 4 else mamba)


def _mistral_small_3() -> LayerStack:
    # mistralai/Mistral-Small-24B-Instruct-2501 config.json: 40 full-attention layers,
    # 8 KV heads x 128, sliding_window null, bf16. Copy: unsloth's mirror of it.
    return _stack("mistral-small-3", 40, lambda i: FullAttention(8, 128))


STACKS: dict[str, LayerStack] = {
    s.name: s
    for s in (
        _gemma3_27b(),
        _gemma2_27b(),
        _gpt_oss("gpt-oss-20b", 24),
        _gpt_oss("gpt-oss-120b", 36),
        _llama4_scout(),
        _deepseek_v3(),
        _qwen3_next(),
        _jamba_mini(),
        _mistral_small_3(),
    )
}

#: Matrices, where sound (see the module's docstring). Mistral Small 3: hidden 5120,
#: intermediate 32768, 32 heads of 128 (not hidden / heads), vocab 131072, untied; 23.6 B.
ARCHITECTURES: dict[str, Architecture] = {
    "mistral-small-3": Architecture("mistral-small-3", 5120, 32768, 40, 32, 8, 128, 131072,
                                    gated_mlp=True),
}


#: Each preset's own context length in tokens, as vLLM 0.33 takes it for `max_model_len` when
#: none is given (see `sim.geometry.CONTEXT_LENGTHS`). Sources, config.json each (text_config
#: where the model has one):
CONTEXT_LENGTHS: dict[str, int] = {
    "gemma-3-27b": 131072,  # google/gemma-3-27b-it: max_position_embeddings 131072
    "gemma-2-27b": 8192,  # google/gemma-2-27b-it: max_position_embeddings 8192
    "gpt-oss-20b": 131072,  # openai/gpt-oss-20b: max_position_embeddings 131072 (yarn)
    "gpt-oss-120b": 131072,  # openai/gpt-oss-120b: max_position_embeddings 131072 (yarn)
    # meta-llama/Llama-4-Scout-17B-16E(-Instruct): max_position_embeddings 10485760 (10M;
    # llama3 rope scaling, which vLLM does not multiply in)
    "llama-4-scout": 10485760,
    "deepseek-v3": 163840,  # deepseek-ai/DeepSeek-V3: max_position_embeddings 163840 (yarn)
    "qwen3-next-80b-a3b": 262144,  # Qwen/Qwen3-Next-80B-A3B-Instruct: 262144
    "jamba-1.5-mini": 262144,  # ai21labs/AI21-Jamba-1.5-Mini: 262144 (the 256K it is sold with)
    "mistral-small-3": 32768,  # mistralai/Mistral-Small-24B-Instruct-2501: 32768
}


def stack(name: str) -> LayerStack | None:
    """A preset as a stack: a hybrid one, or a full-attention one of `sim.geometry` as uniform
    layers; None for an unknown name."""
    if name in STACKS:
        return STACKS[name]
    geo = FULL_PRESETS.get(name)
    if geo is None:
        return None
    layer = FullAttention(geo.kv_heads, geo.head_dim, geo.dtype_bytes)
    return LayerStack(geo.name, (layer,) * geo.layers)
