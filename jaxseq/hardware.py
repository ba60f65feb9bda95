"""GPU specifications, in one place: the dense bf16 peak that MFU divides by (training.metrics) and the
nodes the configurator plans for (planning.search). Data-sheet numbers, not measurements."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU model: its dense bf16 tensor-core peak (no sparsity) and the device kinds JAX reports for
    it (the CUDA device name), matched exactly."""

    peak_tflops: float
    device_kinds: tuple[str, ...]


GPUS = {
    "a100": GPU(peak_tflops=312.0, device_kinds=("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB",
                                                 "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe")),
    "h100": GPU(peak_tflops=989.0, device_kinds=("NVIDIA H100 80GB HBM3",)),  # SXM
    "h100-pcie": GPU(peak_tflops=756.0, device_kinds=("NVIDIA H100 PCIe",)),
    # CUDA names an H200 NVL (835) "NVIDIA H200" too: its MFU reads low unless --peak-tflops says 835.
    "h200": GPU(peak_tflops=989.0, device_kinds=("NVIDIA H200",)),
}


def peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of the GPU whose device kind is exactly `device_kind`, None for one not listed.
    Exact, not by substring: an "NVIDIA H100 PCIe" contains "H100" but peaks at 756, not the SXM's 989."""
    return next((gpu.peak_tflops for gpu in GPUS.values() if device_kind in gpu.device_kinds), None)


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One node type: dense bf16 peak, memory and its bandwidth, SMs (a GEMM runs in waves of one tile per
    SM), NVLink per direction per GPU, InfiniBand per GPU; the dense FP8 peak (0: no FP8 tensor cores)."""

    name: str
    peak_tflops: float
    memory_gib: float
    hbm_gb_per_s: float  # GB/s, the GPU's memory (HBM) bandwidth
    sm_count: int  # streaming multiprocessors
    gpus_per_node: int
    intra_node_gb_per_s: float  # GB/s per direction per GPU (NVLink)
    inter_node_gbit_per_s: float  # Gb/s per GPU (InfiniBand)
    pcie_gb_per_s: float = 64.0  # GB/s per direction per GPU between its memory and the host's (PCIe)
    fp8_peak_tflops: float = 0.0  # dense FP8 tensor cores (e4m3/e5m2), twice bf16's on Hopper; none on the A100

    @property
    def inter_node_gb_per_s(self) -> float:
        return self.inter_node_gbit_per_s / 8


# DGX A100 80 GB (A100 SXM4 80 GB: HBM2e 2039 GB/s, 108 SMs; NVLink 3: 600 GB/s both directions, 8× HDR
# 200 Gb/s) and DGX H100 (H100 SXM5: HBM3 3350 GB/s, 132 SMs; NVLink 4: 900 GB/s, 8× NDR 400 Gb/s); the
# papers' runs are on the former. DGX H200: the H100's compute and links, 141 GB of HBM3e (140 GiB, as CUDA reports
# it) at 4800 GB/s. PCIe to the host (NVIDIA's data sheets: A100 "PCIe Gen4: 64 GB/s", H100 and H200 SXM "PCIe Gen5:
# 128 GB/s", both directions together): 32 and 64 GB/s per direction, x16.
# FP8 (H100 and H200 data sheets): 1,979 TFLOP/s dense; the A100 has no FP8 tensor cores.
HARDWARE = {
    "a100": Hardware(name="a100", peak_tflops=GPUS["a100"].peak_tflops, memory_gib=80.0, hbm_gb_per_s=2039.0,
                     sm_count=108, gpus_per_node=8, intra_node_gb_per_s=300.0, inter_node_gbit_per_s=200.0,
                     pcie_gb_per_s=32.0),
    "h100": Hardware(name="h100", peak_tflops=GPUS["h100"].peak_tflops, memory_gib=80.0, hbm_gb_per_s=3350.0,
                     sm_count=132, gpus_per_node=8, intra_node_gb_per_s=450.0, inter_node_gbit_per_s=400.0,
                     pcie_gb_per_s=64.0, fp8_peak_tflops=1979.0),
    "h200": Hardware(name="h200", peak_tflops=GPUS["h200"].peak_tflops, memory_gib=140.0, hbm_gb_per_s=4800.0,
                     sm_count=132, gpus_per_node=8, intra_node_gb_per_s=450.0, inter_node_gbit_per_s=400.0,
                     pcie_gb_per_s=64.0, fp8_peak_tflops=1979.0),
}
