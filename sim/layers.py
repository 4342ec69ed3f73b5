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
  (Mamba 1/2, gated delta net; vLLM's `MambaSpec`). `MambaState.mamba1/mamba2/
  gated_delta_net` size it from a model's figures the way vLLM's `MambaStateShapeCalculator`
  and `MambaStateDtypeCalculator` do (a conv state and a temporal state, in the model's dtype
  unless the SSM state's dtype is given).

Each layer's figures are per GPU of the model (KV heads as the model has them; tensor
parallelism divides them elsewhere, as for `KVGeometry`). The byte arithmetic is vLLM's:
an attention layer's page for one token is (head_dim + head_dim_v) x kv_heads x dtype_bytes,
with head_dim_v = head_dim for full, sliding and chunked layers and 0 for MLA (whose head is
the latent).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

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
        for name in ("kv_heads", "head_dim", "dtype_bytes"):
            _positive(f"{self.kind} layer", name, getattr(self, name))

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
    #: The state tensors' shapes and element sizes (bytes), as vLLM's `MambaSpec` holds them;
    #: empty when only the total is known. Not part of equality: two layers of the same
    #: kind and size keep the same thing.
    shapes: tuple[tuple[int, ...], ...] = field(default=(), compare=False)
    dtype_bytes: tuple[int, ...] = field(default=(), compare=False)

    kind = "mamba"

    def __post_init__(self) -> None:
        _positive("mamba layer", "state_bytes", self.state_bytes)
        if len(self.shapes) != len(self.dtype_bytes):
            raise ValueError("mamba layer: one dtype size per state shape")
        if self.shapes and self.state_bytes != sum(
            math.prod(s) * d for s, d in zip(self.shapes, self.dtype_bytes, strict=True)
        ):
            raise ValueError("mamba layer: state_bytes is not the sum of its shapes' bytes")

    @property
    def bytes_per_token(self) -> int:
        return 0  # (the state does not grow with tokens)

    def shard(self, tp: int) -> MambaState:
        """One GPU's share of the state for tensor parallelism `tp`: vLLM splits the conv
        state's channels and the temporal state's leading dimension (heads, or Mamba 1's
        inner width); here each is divided rounding up (Mamba 2's group replication is not
        modelled). A state known only as a total is divided evenly, rounding up."""
        if tp == 1:
            return self
        if not self.shapes:
            return MambaState(-(-self.state_bytes // tp), self.mamba_kind)
        conv, temporal = self.shapes[0], self.shapes[1:]
        shapes = ((*conv[:-1], -(-conv[-1] // tp)),
                  *((-(-t[0] // tp), *t[1:]) for t in temporal))
        return MambaState._of(self.mamba_kind, shapes, self.dtype_bytes)

    # --------------------------------------------------- from a model's figures (vLLM's way)
    @classmethod
    def _of(cls, kind: str, shapes: tuple[tuple[int, ...], ...],
            dtypes: tuple[int, ...]) -> MambaState:
        for shape in shapes:
            for n in shape:
                _positive(f"{kind} state", "dimension", n)
        total = sum(math.prod(s) * d for s, d in zip(shapes, dtypes, strict=True))
        return cls(total, kind, shapes, dtypes)

    @classmethod
    def mamba1(cls, intermediate: int, d_state: int, d_conv: int, dtype_bytes: int = 2,
               ssm_dtype_bytes: int | None = None, tp: int = 1) -> MambaState:
        """Mamba 1 (Jamba, Falcon-Mamba): a conv state of (d_conv - 1) x intermediate and a
        temporal state of intermediate x d_state, intermediate split `tp` ways
        (`MambaStateShapeCalculator.mamba1_state_shape`)."""
        _positive("mamba1 state", "d_conv", d_conv)
        inner = _divide("mamba1 state", intermediate, tp)
        shapes = ((d_conv - 1, inner), (inner, d_state))
        return cls._of("mamba1", shapes, (dtype_bytes, ssm_dtype_bytes or dtype_bytes))

    @classmethod
    def mamba2(cls, intermediate: int, n_groups: int, num_heads: int, head_dim: int,
               d_state: int, d_conv: int, dtype_bytes: int = 2,
               ssm_dtype_bytes: int | None = None, tp: int = 1) -> MambaState:
        """Mamba 2 (Bamba, Nemotron-H, Granite 4): a conv state over the inner width and both
        groups' B and C, and a temporal state of heads x head_dim x d_state
        (`mamba2_state_shape`; groups replicated when tp does not divide them)."""
        _positive("mamba2 state", "d_conv", d_conv)
        groups = n_groups + (0 if n_groups % tp == 0 else tp - n_groups)
        conv_dim = _divide("mamba2 state", intermediate + 2 * groups * d_state, tp)
        shapes = ((d_conv - 1, conv_dim),
                  (_divide("mamba2 state", num_heads, tp), head_dim, d_state))
        return cls._of("mamba2", shapes, (dtype_bytes, ssm_dtype_bytes or dtype_bytes))

    @classmethod
    def gated_delta_net(cls, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                        head_v_dim: int, conv_kernel: int, dtype_bytes: int = 2,
                        ssm_dtype_bytes: int | None = None, tp: int = 1) -> MambaState:
        """Gated delta net (Qwen3-Next, Qwen3.5 linear attention): a conv state over Q, K and
        V, and a recurrent state of v_heads x head_v_dim x head_k_dim
        (`gated_delta_net_state_shape`)."""
        _positive("gated_delta_net state", "conv_kernel", conv_kernel)
        conv_dim = head_k_dim * num_k_heads * 2 + head_v_dim * num_v_heads
        shapes = ((conv_kernel - 1, _divide("gated_delta_net state", conv_dim, tp)),
                  (_divide("gated_delta_net state", num_v_heads, tp), head_v_dim, head_k_dim))
        return cls._of("gated_delta_net", shapes,
                       (dtype_bytes, ssm_dtype_bytes or dtype_bytes))


def _divide(owner: str, n: int, tp: int) -> int:
    """n / tp, which must be whole (vLLM's `divide`)."""
    if n % tp:
        raise ValueError(f"{owner}: {n} does not split {tp} ways")
    return n // tp


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

    @property
    def growing_bytes_per_token(self) -> int:
        """Bytes per token of the layers that keep every token even with a hybrid manager
        (full attention and MLA): what still grows with a request's length when sliding
        and chunked layers keep only their window."""
        return sum(layer.bytes_per_token for layer in self.attention_layers
                   if not isinstance(layer, SlidingWindow | ChunkedLocal))

    @property
    def mamba_layers(self) -> int:
        return sum(isinstance(layer, MambaState) for layer in self.layers)

    def shard(self, tp: int) -> LayerStack:
        """What one GPU of `tp` keeps: KV heads split tp ways (replicated when fewer, as
        vLLM does); an MLA latent is replicated whole; a Mamba state is split as
        `MambaState.shard` says."""
        _positive(f"model {self.name!r}", "tp", tp)
        if tp == 1:
            return self
        out: list[Layer] = []
        for layer in self.layers:
            if isinstance(layer, FullAttention):
                out.append(replace(layer, kv_heads=max(layer.kv_heads // tp, 1)))
            elif isinstance(layer, MambaState):
                out.append(layer.shard(tp))
            else:
                out.append(layer)
        return LayerStack(self.name, tuple(out))

    def geometry(self) -> KVGeometry:
        """The stack as today's allocators lay it out: the all-full fallback (vLLM with its
        hybrid manager off), one `KVGeometry` of `full_bytes_per_token`. Alike layers give
        a plain geometry (the per-buffer layout vAttention needs is then exact); MLA or
        layers of different shapes give one whose `token_bytes` is the stack's figure and
        whose layers / kv_heads / head_dim describe the attention layers only roughly
        (their count, the largest heads and head size). A Mamba hybrid's is that of its
        attention layers alone: no `KVGeometry` holds a state per request, which only the
        hybrid allocator lays out (vLLM cannot run such a model without its hybrid manager;
        `sim.scenario` refuses the other allocators for it). A stack without attention
        layers has none (ValueError)."""
        attn = self.attention_layers
        if not attn:
            raise ValueError(f"model {self.name!r} has no attention layers: kvfrag models "
                             "attention KV (with or without Mamba state beside it)")
        stack = LayerStack(self.name, attn) if self.mamba_layers else self
        plain = stack.full_geometry()
        if plain is not None:
            return plain
        kv = max(a.kv_heads if isinstance(a, FullAttention) else 1 for a in attn)
        hd = max(a.head_dim if isinstance(a, FullAttention) else a.latent + a.rope for a in attn)
        dt = max(a.dtype_bytes for a in attn)
        return KVGeometry(self.name, len(attn), kv, hd, dt, token_bytes=self.full_bytes_per_token)

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
