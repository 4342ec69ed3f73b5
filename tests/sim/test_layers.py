"""Layer types and the layered presets: each preset's figures pinned, and each the same stack
as its published config.json (the copy in tests/sim/hf_configs/) parsed by `sim.hf_config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvfrag.sim import hf_config
from kvfrag.sim.geometry import PRESETS as FULL_PRESETS
from kvfrag.sim.geometry import KVGeometry
from kvfrag.sim.hybrid_presets import ARCHITECTURES, STACKS, stack
from kvfrag.sim.layers import (
    MLA,
    ChunkedLocal,
    FullAttention,
    LayerStack,
    MambaState,
    SlidingWindow,
)

CONFIGS = Path(__file__).parent / "hf_configs"
KiB, MiB = 1024, 2**20

#: name: (layers by type, window or chunk, kv_heads, head_dim, bytes/token all-full,
#: bytes/token that keep growing, state bytes per request)
FIGURES = {
    "gemma-3-27b": ({"sliding_window": 52, "full": 10}, 1024, 16, 128, 496 * KiB, 80 * KiB, 0),
    "gemma-2-27b": ({"sliding_window": 23, "full": 23}, 4096, 16, 128, 368 * KiB, 184 * KiB, 0),
    "gpt-oss-20b": ({"sliding_window": 12, "full": 12}, 128, 8, 64, 48 * KiB, 24 * KiB, 0),
    "gpt-oss-120b": ({"sliding_window": 18, "full": 18}, 128, 8, 64, 72 * KiB, 36 * KiB, 0),
    "llama-4-scout": ({"chunked_local": 36, "full": 12}, 8192, 8, 128, 192 * KiB, 48 * KiB, 0),
    "deepseek-v3": ({"mla": 61}, None, None, None, 70_272, 70_272, 0),
    "qwen3-next-80b-a3b": ({"mamba": 36, "full": 12}, None, 2, 256, 24 * KiB, 24 * KiB,
                           36 * 1_097_728),
    "jamba-1.5-mini": ({"mamba": 28, "full": 4}, None, 8, 128, 16 * KiB, 16 * KiB,
                       28 * 311_296),
    "mistral-small-3": ({"full": 40}, None, 8, 128, 160 * KiB, 160 * KiB, 0),
}


def test_every_preset_is_pinned_and_has_a_config_copy():
    assert set(FIGURES) == set(STACKS)
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(STACKS)
    source = (CONFIGS / "SOURCE.md").read_text()
    assert all(f"{name}.json" in source for name in STACKS)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_preset_figures(name):
    counts, span, kv, hd, full, growing, state = FIGURES[name]
    s = STACKS[name]
    assert s.name == name
    assert s.count() == counts
    assert s.full_bytes_per_token == full
    assert s.growing_bytes_per_token == growing
    assert s.state_bytes_per_request == state
    attn = [a for a in s.layers if isinstance(a, FullAttention)]
    if kv is not None:
        assert {(a.kv_heads, a.head_dim, a.dtype_bytes) for a in attn} == {(kv, hd, 2)}
    spans = {getattr(a, "window", None) or getattr(a, "chunk", None) for a in attn} - {None, 0}
    assert spans == ({span} if span else set())


@pytest.mark.parametrize("name", sorted(STACKS))
def test_parsing_the_published_config_gives_the_preset(name):
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    assert hf_config.parse(config, name) == STACKS[name]
    assert hf_config.parse(hf_config.relevant(config), name) == STACKS[name]


def test_layer_patterns_match_the_models():
    gemma3 = STACKS["gemma-3-27b"].layers
    assert [i for i, a in enumerate(gemma3) if a.kind == "full"] == list(range(5, 62, 6))
    scout = STACKS["llama-4-scout"].layers
    assert [i for i, a in enumerate(scout) if a.kind == "full"] == list(range(3, 48, 4))
    assert [a.kind for a in STACKS["gpt-oss-20b"].layers[:2]] == ["sliding_window", "full"]
    jamba = STACKS["jamba-1.5-mini"].layers
    assert [i for i, a in enumerate(jamba) if a.kind == "full"] == [4, 12, 20, 28]


def test_mamba_states_are_sized_as_vllm_sizes_them():
    # MambaStateShapeCalculator: conv (k - 1, conv_dim) and temporal state, in the model dtype
    gdn = MambaState.gated_delta_net(16, 32, 128, 128, 4)
    assert gdn.shapes == ((3, 128 * 16 * 2 + 128 * 32), (32, 128, 128))
    assert gdn.state_bytes == 2 * (3 * 8192 + 32 * 128 * 128)
    m1 = MambaState.mamba1(8192, 16, 4)
    assert m1.shapes == ((3, 8192), (8192, 16)) and m1.state_bytes == 311_296
    m2 = MambaState.mamba2(intermediate=8192, n_groups=8, num_heads=128, head_dim=64,
                           d_state=128, d_conv=4)
    assert m2.shapes == ((3, 8192 + 2 * 8 * 128), (128, 64, 128))
    fp32 = MambaState.gated_delta_net(16, 32, 128, 128, 4, ssm_dtype_bytes=4)
    assert fp32.state_bytes == 2 * 3 * 8192 + 4 * 32 * 128 * 128
    assert MambaState.mamba1(8192, 16, 4, tp=2).state_bytes == 311_296 // 2
    assert m1.shard(2).state_bytes == 311_296 // 2
    assert MambaState(1000).shard(3).state_bytes == 334
    with pytest.raises(ValueError, match="does not split 3 ways"):
        MambaState.mamba1(8192, 16, 4, tp=3)
    with pytest.raises(ValueError, match="state_bytes must be a positive integer"):
        MambaState(0)


def test_the_all_full_geometry_of_a_stack():
    gemma = STACKS["gemma-3-27b"].geometry()
    assert gemma == KVGeometry("gemma-3-27b", 62, 16, 128)  # alike layers: a plain geometry
    assert gemma.uniform
    ds = STACKS["deepseek-v3"].geometry()
    assert not ds.uniform and ds.bytes_per_token == 61 * 576 * 2
    mixed = LayerStack("mixed", (FullAttention(8, 128), SlidingWindow(4, 64, window=16)))
    geo = mixed.geometry()
    assert geo.bytes_per_token == 2 * 8 * 128 * 2 + 2 * 4 * 64 * 2
    assert (geo.layers, geo.kv_heads, geo.head_dim) == (2, 8, 128)
    # A Mamba hybrid: its attention layers' (the state is in no KVGeometry).
    assert STACKS["jamba-1.5-mini"].geometry() == KVGeometry("jamba-1.5-mini", 4, 8, 128)
    assert STACKS["qwen3-next-80b-a3b"].geometry().bytes_per_token == 12 * 2 * 2 * 256 * 2
    with pytest.raises(ValueError, match="no attention layers"):
        LayerStack("mamba-only", (MambaState(1000),) * 2).geometry()


def test_sharding_splits_heads_and_keeps_the_latent():
    g = STACKS["gemma-3-27b"].shard(4)
    assert g.full_bytes_per_token == 496 * KiB // 4
    assert STACKS["gpt-oss-20b"].shard(16).full_bytes_per_token == 48 * KiB // 8  # replicated
    assert STACKS["deepseek-v3"].shard(8) == STACKS["deepseek-v3"]
    assert STACKS["qwen3-next-80b-a3b"].shard(2).state_bytes_per_request == 36 * 1_097_728 // 2


def test_full_attention_presets_are_uniform_stacks_unchanged():
    for name, geo in FULL_PRESETS.items():
        s = stack(name)
        assert s is not None and not s.hybrid
        assert s.geometry() == geo
    assert stack("nope") is None
    assert stack("gemma-3-27b") is STACKS["gemma-3-27b"]


def test_only_the_dense_control_has_matrices():
    assert set(ARCHITECTURES) == {"mistral-small-3"}
    arch = ARCHITECTURES["mistral-small-3"]
    assert abs(arch.params() / 23.57e9 - 1) < 0.01  # published: 23.6 B
    assert arch.kv_geometry() == STACKS["mistral-small-3"].geometry()


def test_layer_figures_are_checked():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="window must be a positive integer"):
            SlidingWindow(8, 128, window=bad)
        with pytest.raises(ValueError, match="chunk must be a positive integer"):
            ChunkedLocal(8, 128, chunk=bad)
    with pytest.raises(ValueError, match="rope must be a whole number"):
        MLA(512, -1)
    with pytest.raises(ValueError, match="no layers"):
        LayerStack("x", ())
