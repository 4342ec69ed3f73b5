"""Models as stacks of typed layers: what each layer keeps per token or per request.

A full-attention model keeps every token's keys and values in every layer, so one number,
bytes per token, describes its KV memory (`sim.geometry.KVGeometry`). Hybrid models do not:

- `FullAttention`: every token, K and V, in every layer of this type.
- `SlidingWindow(window=W)`: a token is read only while it is among the last W; older ones
  can be freed (vLLM's `SlidingWindowSpec`).
- `ChunkedLocal(chunk=C)`: a token is read only within its chunk of C tokens (Llama 4's
  `attention_chunk_size`; vLLM's `ChunkedLocalAttentionSpec`).
- `MLA(latent=R, rope=P)`: one compressed vector of R + P values per token per layer, no
  separate V (DeepSeek V2/V3, Kimi; vLLM's `MLAAttentionSpec`).
- `MambaState(state_bytes=S)`: a fixed-size recurrent state per request, whatever its length
  (Mamba 1/2, gated delta net; vLLM's `MambaSpec`).

Each layer's figures are per GPU of the model (KV heads as the model has them; tensor
parallelism divides them elsewhere, as for `KVGeometry`). The byte arithmetic is vLLM's:
an attention layer's page for one token is (head_dim + head_dim_v) x kv_heads x dtype_bytes,
with head_dim_v = head_dim for full, sliding and chunked layers and 0 for MLA (whose head is
the latent).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvfrag.sim.geometry import KVGeometry


def _positive(owner: str, field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {field} must be a positive integer, not {value!r}")


@dataclass(frozen=True)
class FullAttention:
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    #: The layer type's name in scenarios, configs and messages.
    kind = "full"

    def __post_init__(self) -> None:
        for field in ("kv_heads", "head_dim", "dtype_bytes"):
            _positive(f"{self.kind} layer", field, getattr(self, field))

    @property
    def bytes_per_token(self) -> int:
        """One token's K and V in one layer of this type."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def as_full(self) -> FullAttention:
        """The layer as an engine without a hybrid manager keeps it: every token, for the
        request's whole length (vLLM promotes sliding and chunked layers to full attention)."""
        return FullAttention(self.kv_heads, self.head_dim, self.dtype_bytes)


@dataclass(frozen=True)
class SlidingWindow(FullAttention):
    window: int = 0

    kind = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("sliding_window layer", "window", self.window)


@dataclass(frozen=True)
class ChunkedLocal(FullAttention):
    chunk: int = 0

    kind = "chunked_local"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("chunked_local layer", "chunk", self.chunk)


@dataclass(frozen=True)
class MLA:
    latent: int  # kv_lora_rank
    rope: int  # qk_rope_head_dim
    dtype_bytes: int = 2

    kind = "mla"

    def __post_init__(self) -> None:
        _positive("mla layer", "latent", self.latent)
        if not isinstance(self.rope, int) or isinstance(self.rope, bool) or self.rope < 0:
            raise ValueError(f"mla layer: rope must be a whole number >= 0, not {self.rope!r}")
        _positive("mla layer", "dtype_bytes", self.dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        """One latent vector per token per layer (no separate V)."""
        return (self.latent + self.rope) * self.dtype_bytes

    def as_full(self) -> MLA:
        return self  # (MLA keeps every token already)


@dataclass(frozen=True)
class MambaState:
    state_bytes: int  # per layer per request
    mamba_kind: str = "mamba2"  # mamba1, mamba2, gated_delta_net, ...

    kind = "mamba"

    def __post_init__(self) -> None:
        _positive("mamba layer", "state_bytes", self.state_bytes)

    @property
    def bytes_per_token(self) -> int:
        return 0  # (the state does not grow with tokens)


Layer = FullAttention | SlidingWindow | ChunkedLocal | MLA | MambaState


@dataclass(frozen=True)
class LayerStack:
    """A model as its layers, in order (layer i is `layers[i]`)."""

    name: str
    layers: tuple[Layer, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"model {self.name!r}: no layers")

    def count(self) -> dict[str, int]:
        """Layers per type, in order of first appearance."""
        return dict(Counter(layer.kind for layer in self.layers))

    @property
    def hybrid(self) -> bool:
        """Whether its layers keep different things (what a hybrid manager is for)."""
        return len(set(self.layers)) > 1 or any(
            isinstance(layer, SlidingWindow | ChunkedLocal | MambaState) for layer in self.layers
        )

    @property
    def attention_layers(self) -> tuple[FullAttention | MLA, ...]:
        return tuple(layer for layer in self.layers if not isinstance(layer, MambaState))

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes per token when every attention layer keeps every token (vLLM with its hybrid
        manager off; what a slab reserves per token of length)."""
        return sum(layer.as_full().bytes_per_token for layer in self.attention_layers)

    @property
    def state_bytes_per_request(self) -> int:
        """Bytes of recurrent state per request (Mamba layers), whatever its length."""
        return sum(layer.state_bytes for layer in self.layers if isinstance(layer, MambaState))

    def full_geometry(self) -> KVGeometry | None:
        """The stack as one full-attention `KVGeometry`, where its attention layers are alike
        enough for one (same heads, head size and dtype, no MLA, no state); else None."""
        attn = self.attention_layers
        if self.state_bytes_per_request or not attn or any(isinstance(a, MLA) for a in attn):
            return None
        shapes = {(a.kv_heads, a.head_dim, a.dtype_bytes) for a in attn}  # type: ignore[union-attr]
        if len(shapes) != 1:
            return None
        ((kv_heads, head_dim, dtype_bytes),) = shapes
        return KVGeometry(self.name, len(attn), kv_heads, head_dim, dtype_bytes)
