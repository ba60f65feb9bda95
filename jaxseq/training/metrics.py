"""Throughput from the paper's FLOP formulas, and the metrics log (JSONL + TensorBoard).

Every number is labelled by its key's unit suffix or documented here: tokens_per_sec (tokens/s),
tflops_per_device (model TFLOP/s per device: the paper's 72·B·s·L·h²·(1 + s/(6h) + V/(12hL)) per
iteration, counted matmul by matmul so that it holds for any attention and MLP width),
hardware_tflops_per_device (plus the forward matmuls the remat policy replays in backward), mfu
(model TFLOP/s ÷ the device's dense bf16 peak), memory_gib (device memory in use, GiB).
"""

from __future__ import annotations

import json
import os
import sys

import jax

from jaxseq import hardware
from jaxseq.config import ModelConfig
from jaxseq.models.formulas import train_flops


def peak_tflops(device=None) -> float | None:
    """The device's dense bf16 peak (jaxseq/hardware.py); None off GPU or for a GPU not listed there."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return None
    return hardware.peak_tflops(device.device_kind)


def memory_gib(device=None) -> float | None:
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_in_use" not in stats:
        return None
    return stats["bytes_in_use"] / 2**30


def throughput(cfg: ModelConfig, remat: str, batch_size: int, steps: int, seconds: float, num_devices: int,
               peak: float | None, chunks: int = 1) -> dict:
    """tokens/s, model and hardware TFLOP/s per device, and MFU (None without a known peak). chunks: the stack's
    p·v pipeline chunks, in each of which a block remat spec recomputes its first N layers."""
    per_device = steps / seconds / num_devices / 1e12
    model_tflops = train_flops(cfg, batch_size) * per_device
    return {
        "tokens_per_sec": batch_size * cfg.seq_len * steps / seconds,
        "tflops_per_device": model_tflops,
        "hardware_tflops_per_device": train_flops(cfg, batch_size, remat, chunks) * per_device,
        "mfu": None if not peak else model_tflops / peak,
    }


def summary_writer():
    """tensorboardX's SummaryWriter, imported without PyTorch where the process has not imported it: the writer's
    module imports torch, where installed, only to accept torch tensors, which jaxseq never logs, and that import
    was most of a train command's start-up beside JAX's own (`None` in `sys.modules` makes `import torch` fail
    there, as if torch were not installed; later imports of torch are untouched)."""
    if "torch" in sys.modules or "tensorboardX.writer" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsLog:
    """One JSON object per logged step in RUN_DIR/metrics.jsonl, the same scalars to TensorBoard."""

    def __init__(self, run_dir: str, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._tb = None
        if enabled:
            self._tb = summary_writer()(os.path.join(run_dir, "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, record["step"])
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
