"""How many bytes one token's keys and values take: the unit all KV memory is counted in.

bytes_per_token = layers x kv_heads x head_dim x 2 (K and V) x dtype_bytes. Grouped-query
models (llama-3, mistral, qwen2.5) store far fewer KV heads than attention heads, which is why
llama-3-8b needs 128 KiB per token where llama-2-7b needs 512 KiB.

A model whose layers are not alike (MLA's one latent per token, layers of different head
counts or sizes: `sim.layers.LayerStack.geometry`) gives its bytes per token as `token_bytes`;
its layers / kv_heads / head_dim then only describe it (the attention layers' count, the
largest heads and head size), and a layout per K/V buffer (vAttention) cannot be made from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfrag.sim.presets import lookup


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's KV cache for one model (whole model, all layers)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    #: Bytes per token when the layers are not alike (see the module's docstring); None: the
    #: product of the figures above.
    token_bytes: int | None = None

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {self.name!r}: {field} must be a positive integer")
        t = self.token_bytes
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 1):
            raise ValueError(f"model {self.name!r}: token_bytes must be a positive integer")

    @property
    def uniform(self) -> bool:
        """Whether every layer keeps one K and one V row of the same shape per token (what a
        per-buffer layout needs)."""
        return self.token_bytes is None

    @property
    def bytes_per_token(self) -> int:
        if self.token_bytes is not None:
            return self.token_bytes
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def bytes_per_buffer_token(self) -> int:
        """Bytes one token takes in one layer's K (or V) buffer: what a per-buffer page holds."""
        return self.kv_heads * self.head_dim * self.dtype_bytes


# Published configs (config.json of each model); fp16/bf16 KV unless stated otherwise.
PRESETS: dict[str, KVGeometry] = {
    g.name: g
    for g in (
        KVGeometry("llama-2-7b", layers=32, kv_heads=32, head_dim=128),
        KVGeometry("llama-2-13b", layers=40, kv_heads=40, head_dim=128),
        KVGeometry("llama-2-70b", layers=80, kv_heads=8, head_dim=128),
        KVGeometry("llama-3-8b", layers=32, kv_heads=8, head_dim=128),
        KVGeometry("llama-3-70b", layers=80, kv_heads=8, head_dim=128),
        # (a draft model for the Llama 3 family: engine.speculative.draft_model)
        KVGeometry("llama-3.2-1b", layers=16, kv_heads=8, head_dim=64),
        KVGeometry("mistral-7b", layers=32, kv_heads=8, head_dim=128),
        KVGeometry("opt-13b", layers=40, kv_heads=40, head_dim=128),
        KVGeometry("opt-66b", layers=64, kv_heads=72, head_dim=128),
        KVGeometry("opt-175b", layers=96, kv_heads=96, head_dim=128),
        KVGeometry("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128),
        KVGeometry("qwen2.5-72b", layers=80, kv_heads=8, head_dim=128),
    )
}


#: Each preset's own context length in tokens: what vLLM 0.33 takes as `max_model_len` when none
#: is given (the smallest of config.json's max_position_embeddings and the like, see
#: vllm/transformers_utils/model_arch_config_convertor.py, derived_max_model_len_and_key; none
#: of these configs scales it by a RoPE factor vLLM would apply). A scenario may leave
#: `max_model_len` out for a preset; an explicit value wins. Sources, config.json each:
CONTEXT_LENGTHS: dict[str, int] = {
    "llama-2-7b": 4096,  # meta-llama/Llama-2-7b-hf: max_position_embeddings 4096
    "llama-2-13b": 4096,  # meta-llama/Llama-2-13b-hf: max_position_embeddings 4096
    "llama-2-70b": 4096,  # meta-llama/Llama-2-70b-hf: max_position_embeddings 4096
    "llama-3-8b": 8192,  # meta-llama/Meta-Llama-3-8B: max_position_embeddings 8192
    "llama-3-70b": 8192,  # meta-llama/Meta-Llama-3-70B: max_position_embeddings 8192
    "llama-3.2-1b": 131072,  # meta-llama/Llama-3.2-1B: max_position_embeddings 131072
    # mistralai/Mistral-7B-v0.1: max_position_embeddings 32768 (its 4096-token sliding window
    # does not cap it: vLLM 0.33 only does so with --disable-sliding-window)
    "mistral-7b": 32768,
    "opt-13b": 2048,  # facebook/opt-13b: max_position_embeddings 2048
    "opt-66b": 2048,  # facebook/opt-66b: max_position_embeddings 2048
    "opt-175b": 2048,  # OPT-175B (metaseq; the OPT paper): 2048 positions, as opt-66b
    # Qwen/Qwen2.5-7B-Instruct and -72B-Instruct: max_position_embeddings 32768 (the served
    # instruct models; 128K needs YaRN rope_scaling added to the config)
    "qwen2.5-7b": 32768,
    "qwen2.5-72b": 32768,
}


def preset(name: str) -> KVGeometry:
    """Look up a preset by name; the error lists the valid names."""
    return lookup(PRESETS, name, "model", "layers, kv_heads, head_dim, dtype_bytes")
