"""GPU presets: each figure as its vendor's data sheet prints it (dense FP16, not sparse)."""

from __future__ import annotations

import math

import pytest
from kvfrag.sim.hardware import GPU, PRESETS, gpu

GIB = 2**30


@pytest.mark.parametrize(
    ("name", "memory", "bandwidth", "flops", "interconnect"),
    [
        # NVIDIA A100 data sheet (2021): 312 TFLOPS FP16 tensor (624 sparse), NVLink 600 GB/s
        ("a100-40gb", 40 * GIB, 1555e9, 312e12, 600e9),
        ("a100-80gb", 80 * GIB, 2039e9, 312e12, 600e9),
        # NVIDIA H100 data sheet (2023), SXM: 1,979 TFLOPS with sparsity -> 989 dense
        ("h100-80gb", 80 * GIB, 3.35e12, 989e12, 900e9),
        # NVIDIA H200 data sheet (2024): 141 GB HBM3e, 4.8 TB/s, 1,979 sparse -> 989 dense
        ("h200", 141 * GIB, 4.8e12, 989e12, 900e9),
        # NVIDIA L40S data sheet (2023): 362.05 TFLOPS (733 sparse), 864 GB/s, PCIe Gen4 x16
        ("l40s", 48 * GIB, 864e9, 362.05e12, 64e9),
        # AMD MI300X data sheet (2023): 1,307.4 TFLOPS FP16 dense, 5.3 TB/s, 7 x 128 GB/s IF
        ("mi300x", 192 * GIB, 5.3e12, 1307.4e12, 896e9),
    ],
)
def test_preset_figures_match_the_data_sheets(name, memory, bandwidth, flops, interconnect):
    g = gpu(name)
    assert g.name == name
    assert g.memory_bytes == memory
    assert g.hbm_bandwidth_bytes_s == pytest.approx(bandwidth)
    assert g.fp16_dense_flops == pytest.approx(flops)
    assert g.interconnect_bytes_s == pytest.approx(interconnect)


def test_every_preset_is_pinned_and_named_by_its_key():
    assert set(PRESETS) == {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "l40s", "mi300x"}
    for name, g in PRESETS.items():
        assert g.name == name


def test_dense_not_sparse_throughput():
    # the sparse figures are twice these; a preset holding one would be off by 2x everywhere
    assert gpu("a100-80gb").fp16_dense_flops < 400e12
    assert gpu("h100-80gb").fp16_dense_flops < 1000e12
    assert gpu("h200").fp16_dense_flops == gpu("h100-80gb").fp16_dense_flops  # same chip
    assert gpu("l40s").fp16_dense_flops < 400e12
    assert gpu("mi300x").fp16_dense_flops < 1400e12


def test_ridge_point():
    # FLOPs per byte above which a kernel is compute-bound at the data-sheet peaks
    assert gpu("a100-80gb").ridge_flops_per_byte == pytest.approx(312e12 / 2039e9)
    assert gpu("h100-80gb").ridge_flops_per_byte == pytest.approx(295.2, rel=1e-3)


def test_unknown_name_lists_the_presets():
    with pytest.raises(ValueError, match=r"unknown gpu 'a10'.*a100-40gb, a100-80gb, h100-80gb"):
        gpu("a10")


def test_custom_gpu_from_the_same_fields():
    g = GPU("rtx-4090", 24 * GIB, 1008e9, 165.2e12, 64e9)
    assert g.memory_bytes == 24 * GIB
    assert g.ridge_flops_per_byte == pytest.approx(165.2e12 / 1008e9)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("memory_bytes", 0),
        ("memory_bytes", -1),
        ("memory_bytes", 24.5e9),  # not a whole number of bytes
        ("hbm_bandwidth_bytes_s", 0.0),
        ("hbm_bandwidth_bytes_s", math.nan),
        ("fp16_dense_flops", -1e12),
        ("fp16_dense_flops", math.inf),
        ("interconnect_bytes_s", True),
        ("interconnect_bytes_s", "900GB/s"),
    ],
)
def test_custom_gpu_rejects_bad_figures(field, value):
    fields = {
        "memory_bytes": 24 * GIB,
        "hbm_bandwidth_bytes_s": 1e12,
        "fp16_dense_flops": 100e12,
        "interconnect_bytes_s": 64e9,
    }
    fields[field] = value
    with pytest.raises(ValueError, match=rf"gpu 'mine': {field} must be"):
        GPU("mine", **fields)


def test_custom_gpu_needs_a_name():
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        GPU("", GIB, 1e12, 1e12, 1e9)
