"""Accelerator catalog: memory, dense peak FLOP/s per precision, HBM bandwidth.

Numbers are the vendors' datasheet values for dense (non-sparse) math:
- A100: NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s BF16/FP16 dense, 19.5 TFLOP/s FP32 (156 TF32),
  40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s (SXM).
- H100 SXM5: NVIDIA H100 datasheet (2023): 989 TFLOP/s BF16/FP16 dense (1,979 with sparsity), 67 TFLOP/s FP32,
  80 GB HBM3 at 3.35 TB/s.
- H200 SXM: NVIDIA H200 datasheet (2024): same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s.
- cpu: this development machine (2 cores); a nominal figure, replaced by a measured calibration matmul where the
  trainer reports MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30
TFLOPS = 10**12


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_bytes: int
    """Usable device memory in bytes."""
    peak_flops_bf16: float
    peak_flops_fp32: float
    hbm_bytes_per_s: float

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_bf16


GPU_CATALOG: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec("a100-40gb", 40 * GB, 312 * TFLOPS, 19.5 * TFLOPS, 1555 * GB),
    "a100-80gb": GpuSpec("a100-80gb", 80 * GB, 312 * TFLOPS, 19.5 * TFLOPS, 2039 * GB),
    "h100": GpuSpec("h100", 80 * GB, 989 * TFLOPS, 67 * TFLOPS, 3350 * GB),
    "h200": GpuSpec("h200", 141 * GB, 989 * TFLOPS, 67 * TFLOPS, 4800 * GB),
    # A CPU "slot": one worker process; memory is a per-worker share of a small machine.
    "cpu": GpuSpec("cpu", 4 * GiB, 0.2 * TFLOPS, 0.1 * TFLOPS, 20 * GB),
}


def gpu_spec(gpu_type: str) -> GpuSpec:
    try:
        return GPU_CATALOG[gpu_type]
    except KeyError:
        raise ValueError(f"unknown gpu type {gpu_type!r}; known: {', '.join(GPU_CATALOG)}") from None
