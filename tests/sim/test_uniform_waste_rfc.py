"""The waste of laying out every layer alike, against the figures of vLLM's hybrid memory
allocator RFC (vllm-project/vllm#11382): "The memory waste can be ... 25% in Gemma-2, and
56.25% in Ministral".

Those figures are one request at the model's full context: Gemma-2 (half its layers slide
over 4,096 tokens) at its 8,192, Ministral-8B (one full layer, then three sliding over 32,768
tokens; 36 layers of 8 KV heads x 128) at 131,072. Laid out as vLLM's fallback (every layer
full attention), the bytes held beyond what the exact-need floor holds for the same request
(the `floor` allocator: what each layer still reads) are that share of the request's bytes;
with vLLM's hybrid manager on they are none at a block-aligned length.
"""

from __future__ import annotations

import warnings

import pytest
from kvfrag.sim.allocators import Request, make_allocator
from kvfrag.sim.hybrid_presets import stack
from kvfrag.sim.layers import FullAttention, LayerStack, SlidingWindow

warnings.filterwarnings("ignore", message=".*pure-Python.*")

#: Ministral-8B-Instruct-2410's layers as the RFC counts them (transformers' Ministral: "1 full
#: attention layer followed by 3 sliding window attention layers"; window 32,768).
MINISTRAL_LIKE = LayerStack("ministral-like", tuple(
    FullAttention(8, 128) if i % 4 == 0 else SlidingWindow(8, 128, window=32768)
    for i in range(36)
))


def _grown(kind: str, layers: LayerStack, context: int, **options: object):
    """An allocator holding one request grown to `context` tokens by a decode step (the
    prefill's out-of-window blocks are freed then)."""
    a = make_allocator(
        kind, capacity=4 * context * layers.full_bytes_per_token,
        bytes_per_token=layers.full_bytes_per_token, max_model_len=context, stack=layers,
        **options,
    )
    assert a.admit(Request(1, context - 1, 1))
    assert a.grow(1, 1)
    return a


def _waste_over_floor(layers: LayerStack, context: int, manager: bool) -> float:
    """The request's bytes beyond what the exact-need floor holds for it, as a share."""
    held = _grown("hybrid", layers, context, hybrid_kv_cache_manager=manager).allocated_bytes(1)
    floor = _grown("floor", layers, context)
    assert floor.allocated_bytes(1) == floor.parts()[0]  # (a decoder: exactly its need)
    return (held - floor.allocated_bytes(1)) / held


@pytest.mark.parametrize(("layers", "context", "rfc"), [
    (stack("gemma-2-27b"), 8192, 0.25),
    (MINISTRAL_LIKE, 131072, 0.5625),
])
def test_uniform_layout_wastes_what_the_rfc_measured(layers, context, rfc):
    assert layers is not None
    assert _waste_over_floor(layers, context, manager=False) == pytest.approx(rfc, abs=1e-3)
    assert _waste_over_floor(layers, context, manager=True) == 0.0
