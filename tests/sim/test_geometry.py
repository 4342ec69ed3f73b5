"""KV geometry: bytes per token = layers x kv_heads x head_dim x 2 x dtype_bytes."""

from __future__ import annotations

import pytest
from kvfrag.sim.geometry import PRESETS, KVGeometry, preset


@pytest.mark.parametrize(
    ("name", "bytes_per_token"),
    [
        ("llama-3-8b", 131072),  # 128 KiB: grouped-query, 8 KV heads
        ("llama-2-7b", 524288),  # 512 KiB
        ("opt-13b", 819200),  # 800 KiB
        ("llama-2-13b", 819200),
        ("llama-2-70b", 327680),
        ("llama-3-70b", 327680),
        ("llama-3.2-1b", 32768),  # 16 layers of 8 KV heads of 64
        ("mistral-7b", 131072),
        ("qwen2.5-7b", 57344),
        ("qwen2.5-72b", 327680),
        ("opt-66b", 2359296),
        ("opt-175b", 4718592),
    ],
)
def test_preset_bytes_per_token(name, bytes_per_token):
    g = preset(name)
    assert g.name == name
    assert g.bytes_per_token == bytes_per_token
    assert g.bytes_per_token == g.layers * g.kv_heads * g.head_dim * 2 * g.dtype_bytes


def test_every_preset_is_tested_and_consistent():
    assert len(PRESETS) == 12
    for name, g in PRESETS.items():
        assert g.name == name
        assert g.dtype_bytes == 2  # fp16/bf16
        assert g.bytes_per_token == 2 * g.layers * g.bytes_per_buffer_token


def test_bytes_per_buffer_token():
    assert preset("llama-3-8b").bytes_per_buffer_token == 8 * 128 * 2
    assert preset("llama-2-7b").bytes_per_buffer_token == 32 * 128 * 2


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match="unknown model 'llama-4'") as err:
        preset("llama-4")
    message = str(err.value)
    for name in PRESETS:
        assert name in message
    assert ", ".join(sorted(PRESETS)) in message
    assert "layers, kv_heads, head_dim, dtype_bytes" in message


def test_custom_geometry():
    g = KVGeometry("tiny", layers=2, kv_heads=4, head_dim=8, dtype_bytes=1)
    assert g.bytes_per_token == 2 * 4 * 8 * 2 * 1
    fp32 = KVGeometry("fp32", layers=32, kv_heads=8, head_dim=128, dtype_bytes=4)
    assert fp32.bytes_per_token == 2 * preset("llama-3-8b").bytes_per_token
    assert KVGeometry("x", 1, 1, 1).dtype_bytes == 2


@pytest.mark.parametrize("field", ["layers", "kv_heads", "head_dim", "dtype_bytes"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "8"])
def test_custom_geometry_validation(field, value):
    kwargs = {"layers": 2, "kv_heads": 4, "head_dim": 8, "dtype_bytes": 2, field: value}
    with pytest.raises(ValueError, match=f"model 'bad': {field} must be a positive integer"):
        KVGeometry("bad", **kwargs)


def test_geometry_is_frozen():
    g = preset("llama-3-8b")
    with pytest.raises(AttributeError):
        g.layers = 1  # type: ignore[misc]
