"""What one GPU can do: memory, HBM bandwidth, dense FP16 tensor throughput, interconnect.

These four numbers are all a roofline step-time model needs (sim/steptime.py): a kernel takes
at least its bytes over the bandwidth and at least its FLOPs over the peak. Every preset is the
vendor's data-sheet figure, not a measured one; how much of it kernels really reach is fitted
separately (sim/steptime.py's efficiencies), so a preset never hides a fudge factor.

Conventions, because data sheets mix them:
- memory_bytes: the capacity the data sheet names, read in binary units (HBM stacks are sized
  in GiB; "80GB" is 80 GiB). What the driver leaves usable is slightly less.
- hbm_bandwidth_bytes_s, fp16_dense_flops: decimal (1 TB/s = 1e12 B/s), as data sheets mean.
- fp16_dense_flops: FP16/BF16 tensor-core throughput WITHOUT structured sparsity. NVIDIA's
  sheets print the sparse figure (2x) next to it or, for Hopper, only the sparse one with a
  footnote; we always take the dense half.
- interconnect_bytes_s: the per-GPU GPU-to-GPU bandwidth the data sheet states (NVLink /
  Infinity Fabric, both directions together; PCIe where there is no NVLink). A ring all-reduce
  sends and receives at once, so it sees half of it per direction (sim/steptime.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvfrag.sim.presets import lookup

_GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator's data-sheet figures; a custom one is built from the same fields."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_s: float
    fp16_dense_flops: float
    interconnect_bytes_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("gpu: name must be a non-empty string")
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"gpu {self.name!r}: {f.name} must be a number, got {value!r}")
            if not value > 0 or value == float("inf"):
                raise ValueError(f"gpu {self.name!r}: {f.name} must be positive and finite")
        if not isinstance(self.memory_bytes, int):
            raise ValueError(f"gpu {self.name!r}: memory_bytes must be a whole number of bytes")

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a kernel is compute-bound at the data-sheet peaks."""
        return self.fp16_dense_flops / self.hbm_bandwidth_bytes_s


# Vendor data sheets (figures as printed; dense FP16/BF16 tensor throughput, see above):
# [A100]  NVIDIA A100 Tensor Core GPU data sheet (2021): FP16/BF16 Tensor Core
#         312 TFLOPS (624 with sparsity); 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s (SXM);
#         NVLink 600 GB/s (SXM).
# [H100]  NVIDIA H100 Tensor Core GPU data sheet (2023): H100 SXM FP16/BF16 Tensor Core
#         1,979 TFLOPS "with sparsity" (989 dense); 80GB HBM3 3.35 TB/s; NVLink 900 GB/s.
# [H200]  NVIDIA H200 Tensor Core GPU data sheet (2024): H200 SXM FP16/BF16 Tensor Core
#         1,979 TFLOPS "with sparsity" (989 dense); 141GB HBM3e 4.8 TB/s; NVLink 900 GB/s.
# [L40S]  NVIDIA L40S GPU data sheet (2023): FP16/BF16 Tensor 362.05 TFLOPS (733 with
#         sparsity); 48GB GDDR6 864 GB/s; no NVLink: PCIe Gen4 x16 64 GB/s bidirectional.
# [MI300X] AMD Instinct MI300X accelerator data sheet (2023): peak FP16/BF16 1,307.4 TFLOPS
#         (2,614.9 with sparsity); 192GB HBM3 5.3 TB/s; 7 Infinity Fabric links x 128 GB/s
#         (896 GB/s peer-to-peer per GPU).
PRESETS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("a100-40gb", 40 * _GIB, 1555e9, 312e12, 600e9),  # [A100] SXM
        GPU("a100-80gb", 80 * _GIB, 2039e9, 312e12, 600e9),  # [A100] SXM
        GPU("h100-80gb", 80 * _GIB, 3.35e12, 989e12, 900e9),  # [H100] SXM
        GPU("h200", 141 * _GIB, 4.8e12, 989e12, 900e9),  # [H200] SXM
        GPU("l40s", 48 * _GIB, 864e9, 362.05e12, 64e9),  # [L40S] PCIe only
        GPU("mi300x", 192 * _GIB, 5.3e12, 1307.4e12, 896e9),  # [MI300X]
    )
}


def gpu(name: str) -> GPU:
    """Look up a preset by name; the error lists the valid names."""
    return lookup(
        PRESETS, name, "gpu",
        "name, memory_bytes, hbm_bandwidth_bytes_s, fp16_dense_flops, interconnect_bytes_s",
    )


def batch_defaults(hardware: GPU | None) -> tuple[int, int]:
    """vLLM 0.33's server defaults for (max_num_seqs, max_num_batched_tokens) on this GPU
    (`EngineArgs.get_batch_defaults`, OpenAI API server): 1024 / 16384 with >= 160 GiB of
    memory; 1024 / 8192 with >= 70 GiB unless an A100; 256 / 2048 otherwise, and when the GPU
    is unknown (as vLLM falls back when it cannot query the device)."""
    memory = hardware.memory_bytes if hardware is not None else 0
    if memory >= 160 * _GIB:
        return 1024, 16384
    if memory >= 70 * _GIB and "a100" not in hardware.name.lower():
        return 1024, 8192
    return 256, 2048
