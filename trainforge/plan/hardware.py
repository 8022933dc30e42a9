"""Accelerator and interconnect catalog: memory, dense peak FLOP/s per precision, HBM bandwidth; link bandwidth
per GPU and latency.

GPU numbers are the vendors' datasheet values for dense (non-sparse) math:
- A100: NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s BF16/FP16 dense, 19.5 TFLOP/s FP32 (156 TF32),
  40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s (SXM).
- H100 SXM5: NVIDIA H100 datasheet (2023): 989 TFLOP/s BF16/FP16 dense (1,979 with sparsity), 67 TFLOP/s FP32,
  80 GB HBM3 at 3.35 TB/s.
- H200 SXM: NVIDIA H200 datasheet (2024): same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s.
- cpu: this development machine (2 cores); a nominal figure, replaced by a measured calibration matmul where the
  trainer reports MFU.

Link numbers are per GPU and per direction (what one rank can push into a collective):
- NVLink 3 (A100, via NVSwitch): 600 GB/s total bidirectional per GPU = 300 GB/s each way (A100 datasheet).
- NVLink 4 (H100/H200 SXM, via NVSwitch gen 3): 900 GB/s bidirectional = 450 GB/s each way (H100 datasheet).
- InfiniBand: HDR 200 Gb/s = 25 GB/s (NVIDIA ConnectX-6 / DGX A100: one HDR NIC per GPU); NDR 400 Gb/s = 50 GB/s
  (ConnectX-7 / DGX H100: one NDR NIC per GPU).
- EFA: p4d.24xlarge 400 Gb/s per 8 GPUs = 6.25 GB/s per GPU; p5.48xlarge 3,200 Gb/s per 8 GPUs = 50 GB/s per GPU
  (AWS EC2 instance type pages).
- GPUDirect-TCPX: GCP A3 (8 x H100), 4 x 200 Gb/s NICs = 800 Gb/s per VM = 12.5 GB/s per GPU (GCP A3 docs); A3 Mega
  (TCPXO) doubles it.
- PCIe Gen4 x16: 16 GT/s x 16 lanes ~ 31.5 GB/s each way (PCI-SIG); Gen5 doubles it.
- Ethernet: 100 GbE per node shared by 8 GPUs = 1.56 GB/s per GPU (commodity cluster; an assumption, override it).
- loopback (CPU workers, gloo over shared memory/TCP on one host): ~5 GB/s, measured order of magnitude.
Collectives reach a fraction of the link rate (NCCL's bus bandwidth, nccl-tests): `LINK_EFFICIENCY`.
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
    generation: str = "hopper"
    """Picks the link generation (NVLink 3 vs 4, HDR vs NDR) when a cluster names only a link kind."""
    runtime_overhead_bytes: int = 1 * GiB
    """Memory taken before any tensor: CUDA context, cuBLAS workspace, NCCL buffers (~0.6-1.2 GiB on H100
    in practice); for `cpu` the Python + torch + gloo process baseline measured by bench/memory_vs_rss.py."""

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_bf16


MiB = 2**20
# Memory is the device total as nvidia-smi reports it (the "80 GB" parts carry 80 GiB of HBM): A100 40GB 40,960 MiB,
# A100 80GB 81,920 MiB, H100 SXM 81,559 MiB, H200 143,771 MiB.
GPU_CATALOG: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec("a100-40gb", 40960 * MiB, 312 * TFLOPS, 19.5 * TFLOPS, 1555 * GB, "ampere"),
    "a100-80gb": GpuSpec("a100-80gb", 81920 * MiB, 312 * TFLOPS, 19.5 * TFLOPS, 2039 * GB, "ampere"),
    "h100": GpuSpec("h100", 81559 * MiB, 989 * TFLOPS, 67 * TFLOPS, 3350 * GB, "hopper"),
    "h200": GpuSpec("h200", 143771 * MiB, 989 * TFLOPS, 67 * TFLOPS, 4800 * GB, "hopper"),
    # A CPU "slot": one worker process; memory is a per-worker share of a small machine. The runtime overhead is
    # the RSS of an idle worker after `import torch` (torch 2.13 CPU wheel) + init_process_group(gloo), before any
    # model: 222 MiB measured by bench/memory_phases.py (12 MiB for the bare interpreter, 208 MiB for torch's
    # shared libraries and import-time objects, 2 MiB for gloo); bench/memory_vs_rss.py re-measures it every run.
    "cpu": GpuSpec("cpu", 4 * GiB, 0.2 * TFLOPS, 0.1 * TFLOPS, 20 * GB, "cpu", 222 * 2**20),
}


def gpu_spec(gpu_type: str) -> GpuSpec:
    try:
        return GPU_CATALOG[gpu_type]
    except KeyError:
        raise ValueError(f"unknown gpu type {gpu_type!r}; known: {', '.join(GPU_CATALOG)}") from None


@dataclass(frozen=True, slots=True)
class LinkSpec:
    name: str
    bytes_per_s: float
    """Per GPU, per direction (vendor rate)."""
    latency_s: float
    """Per collective step (alpha term)."""


# (link kind, GPU generation) -> spec. `None` generation = any.
LINK_CATALOG: dict[tuple[str, str | None], LinkSpec] = {
    ("nvswitch", "ampere"): LinkSpec("NVLink 3 / NVSwitch", 300 * GB, 5e-6),
    ("nvswitch", "hopper"): LinkSpec("NVLink 4 / NVSwitch", 450 * GB, 4e-6),
    ("nvlink", "ampere"): LinkSpec("NVLink 3", 300 * GB, 5e-6),
    ("nvlink", "hopper"): LinkSpec("NVLink 4", 450 * GB, 4e-6),
    ("infiniband", "ampere"): LinkSpec("InfiniBand HDR 200 Gb/s per GPU", 25 * GB, 8e-6),
    ("infiniband", "hopper"): LinkSpec("InfiniBand NDR 400 Gb/s per GPU", 50 * GB, 8e-6),
    ("efa", "ampere"): LinkSpec("EFA (p4d: 400 Gb/s per node)", 6.25 * GB, 15e-6),
    ("efa", "hopper"): LinkSpec("EFA v2 (p5: 3,200 Gb/s per node)", 50 * GB, 15e-6),
    ("gpudirect-tcpx", None): LinkSpec("GPUDirect-TCPX (A3: 800 Gb/s per VM)", 12.5 * GB, 20e-6),
    ("pcie", None): LinkSpec("PCIe Gen4 x16", 31.5 * GB, 10e-6),
    ("ethernet", None): LinkSpec("100 GbE per 8-GPU node", 1.5625 * GB, 30e-6),
    ("loopback", None): LinkSpec("loopback (gloo, one host)", 5 * GB, 50e-6),
}

# Fraction of the link rate a ring collective reaches (NCCL bus bandwidth / link rate in nccl-tests: ~0.75-0.85 on
# NVSwitch, ~0.8-0.9 on IB at large message sizes).
LINK_EFFICIENCY = 0.8


def link_spec(kind: str, generation: str, override_gb_per_s: float | None = None) -> LinkSpec:
    """The link of a kind for a GPU generation; `override_gb_per_s` (GB/s per GPU) replaces the catalog rate."""
    spec = LINK_CATALOG.get((kind, generation)) or LINK_CATALOG.get((kind, None))
    if spec is None:
        # A generation the catalog has no entry for (e.g. NVSwitch on cpu): nearest known generation.
        spec = LINK_CATALOG.get((kind, "hopper")) or LINK_CATALOG[("loopback", None)]
    if override_gb_per_s:
        return LinkSpec(f"{spec.name} (override {override_gb_per_s:g} GB/s)", override_gb_per_s * GB, spec.latency_s)
    return spec
