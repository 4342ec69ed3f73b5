"""A model's shape: what its weights weigh and how many FLOPs each token costs.

sim/geometry.py only needs the KV cache's shape (layers, KV heads, head dim); a step-time model
also needs the matrices every token passes through: the QKV and output projections, the MLP
(three matrices when gated, SwiGLU; two otherwise), the norms, the embedding and the LM head.
Those matrices are what a decode step streams from HBM and what a prefill step multiplies, so
their sizes set the step time (sim/steptime.py).

Each preset is the model's published config.json (Hugging Face hub), and a test pins its
parameter count to the published one within 1 %.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.presets import lookup


@dataclass(frozen=True)
class Architecture:
    """The shape of a dense decoder-only transformer (whole model, unsharded)."""

    name: str
    hidden: int
    intermediate: int  # width of ONE MLP matrix (gated models have two of them going up)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated_mlp: bool  # SwiGLU: gate and up projections, then down (Llama, Mistral, Qwen)
    tied_embeddings: bool = False  # the LM head reuses the embedding matrix (OPT)
    qkv_bias: bool = False  # biases on the Q, K and V projections only (Qwen)
    linear_bias: bool = False  # biases on every projection, attention and MLP (OPT)
    norm_bias: bool = False  # LayerNorm (weight and bias) rather than RMSNorm (weight only)
    position_embeddings: int = 0  # rows of a learned position table (OPT: 2,048 + 2)

    def __post_init__(self) -> None:
        for field in (
            "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {self.name!r}: {field} must be a positive integer")
        if self.position_embeddings < 0:
            raise ValueError(f"model {self.name!r}: position_embeddings must be >= 0")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: heads ({self.heads}) must be a multiple of "
                f"kv_heads ({self.kv_heads})"
            )

    # ------------------------------------------------------------ per-layer matrices
    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def mlp_up_matrices(self) -> int:
        """Matrices on the MLP's way up: gate and up (gated), or just up."""
        return 2 if self.gated_mlp else 1

    def layer_matmul_params(self) -> int:
        """Weights one token is multiplied by in one layer (projections and MLP, no biases)."""
        qkv = self.hidden * (self.q_width + 2 * self.kv_width)
        out = self.q_width * self.hidden
        mlp = (self.mlp_up_matrices + 1) * self.hidden * self.intermediate
        return qkv + out + mlp

    def layer_params(self) -> int:
        """Every parameter of one layer: the matrices, their biases, the two norms."""
        n = self.layer_matmul_params()
        if self.qkv_bias or self.linear_bias:
            n += self.q_width + 2 * self.kv_width
        if self.linear_bias:
            n += self.hidden + self.mlp_up_matrices * self.intermediate + self.hidden
        return n + 2 * self._norm_params()

    def _norm_params(self) -> int:
        return self.hidden * (2 if self.norm_bias else 1)

    # ------------------------------------------------------------------ whole model
    def params(self) -> int:
        """Total parameters: embeddings, layers, final norm and (unless tied) the LM head."""
        embed = (self.vocab + self.position_embeddings) * self.hidden
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return embed + self.layers * self.layer_params() + self._norm_params() + head

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of the weights (fp16/bf16 by default): what HBM holds before any KV."""
        return self.params() * dtype_bytes

    def flops_per_token(self, lm_head: bool = True) -> int:
        """FLOPs of the token-wise layers for one token (2 per multiply-add; no attention).

        The LM head runs only where a token is sampled (the last position of each sequence in
        a step), so a prefill chunk pays it once, not per token: pass lm_head=False for the
        others.
        """
        n = 2 * self.layers * self.layer_matmul_params()
        return n + (2 * self.vocab * self.hidden if lm_head else 0)

    def attention_flops(self, new_tokens: int, context: int) -> int:
        """FLOPs of causal attention for `new_tokens` queries after `context` cached tokens.

        Query i (0-based) attends to context + i + 1 keys; QK^T and PV take 2 x 2 FLOPs per
        (query head, key, head_dim element). Decode is new_tokens=1.
        """
        pairs = new_tokens * context + new_tokens * (new_tokens + 1) // 2
        return 4 * self.layers * self.heads * self.head_dim * pairs

    def kv_geometry(self, dtype_bytes: int = 2) -> KVGeometry:
        """The KV cache's shape (sim/geometry.py) this architecture implies."""
        return KVGeometry(self.name, self.layers, self.kv_heads, self.head_dim, dtype_bytes)


def _llama(name: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           vocab: int, tied: bool = False) -> Architecture:
    """Llama-shaped: RMSNorm, SwiGLU, no biases, head_dim = hidden / heads, the head untied
    unless `tied` (Llama 3.2's small models)."""
    return Architecture(name, hidden, intermediate, layers, heads, kv_heads, hidden // heads,
                        vocab, gated_mlp=True, tied_embeddings=tied)


def _opt(name: str, hidden: int, layers: int, heads: int) -> Architecture:
    """OPT: LayerNorm, ReLU MLP of 4 x hidden, biases everywhere, tied head, learned positions
    (2,048 + 2 offset rows), vocab 50,272."""
    return Architecture(name, hidden, 4 * hidden, layers, heads, heads, hidden // heads, 50272,
                        gated_mlp=False, tied_embeddings=True, linear_bias=True,
                        norm_bias=True, position_embeddings=2050)


# From each model's config.json on the Hugging Face hub (hidden_size, intermediate_size or
# ffn_dim, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size,
# tie_word_embeddings): meta-llama/Llama-2-{7b,13b,70b}-hf, meta-llama/Meta-Llama-3-{8B,70B},
# meta-llama/Llama-3.2-1B (head_dim 64, tied embeddings),
# mistralai/Mistral-7B-v0.1, facebook/opt-{13b,66b}, Qwen/Qwen2.5-{7B,72B},
# codellama/CodeLlama-34b-Instruct-hf, Qwen/Qwen-72B. OPT-175B's weights are not on the hub:
# its shape is Table 1 of Zhang et al., "OPT: Open Pre-trained Transformer Language Models"
# (2022), with the vocab and positions of the other OPT configs.
PRESETS: dict[str, Architecture] = {
    a.name: a
    for a in (
        _llama("llama-2-7b", 4096, 11008, 32, 32, 32, 32000),
        _llama("llama-2-13b", 5120, 13824, 40, 40, 40, 32000),
        _llama("llama-2-70b", 8192, 28672, 80, 64, 8, 32000),
        _llama("llama-3-8b", 4096, 14336, 32, 32, 8, 128256),
        _llama("llama-3-70b", 8192, 28672, 80, 64, 8, 128256),
        _llama("llama-3.2-1b", 2048, 8192, 16, 32, 8, 128256, tied=True),
        _llama("mistral-7b", 4096, 14336, 32, 32, 8, 32000),
        _opt("opt-13b", 5120, 40, 40),
        _opt("opt-66b", 9216, 64, 72),
        _opt("opt-175b", 12288, 96, 96),
        Architecture("qwen2.5-7b", 3584, 18944, 28, 28, 4, 128, 152064, gated_mlp=True,
                     qkv_bias=True),
        Architecture("qwen2.5-72b", 8192, 29568, 80, 64, 8, 128, 152064, gated_mlp=True,
                     qkv_bias=True),
        # Vidur's profiled models (sim/steptime.py calibrates against them).
        _llama("codellama-34b", 8192, 22016, 48, 64, 8, 32000),
        # Qwen (v1) writes intermediate_size 49152 for its two up matrices together: each
        # is 24,576 wide (modeling_qwen.py halves it). Full multi-head attention, QKV bias.
        Architecture("qwen-72b", 8192, 24576, 80, 64, 64, 128, 152064, gated_mlp=True,
                     qkv_bias=True),
    )
}


def architecture(name: str) -> Architecture:
    """Look up a preset by name; the error lists the valid names."""
    return lookup(
        PRESETS, name, "model architecture",
        "hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, gated_mlp",
    )
