"""What training T tokens costs at a predicted step time (`plan --search --tokens T --price-per-gpu-hour P`): days,
GPU-hours and dollars, each with the error band the time model measured.

    steps     = ⌈T / (global batch · s)⌉
    days      = step time · steps / 86,400
    GPU-hours = step time · steps · GPUs / 3,600
    cost      = GPU-hours · P  (dollars, P per GPU-hour)

The band is what the measured step times were against the model's prediction (measured / predicted), so each figure's
low and high are the prediction times those two factors:
- one GPU (no collective, no pipeline): the H100 steps measured (gpt3-1.3b and a 1.5B Llama, every remat policy,
  s = 1k–8k, micro-batches 1–32; docs/planning.md, experiments/results/gpu_target_vs_measured.md): with `--target` the
  model came within −2.7% to +3.3% of them, so measured / predicted ∈ [1/1.033, 1/0.973]; without it (Megatron's
  kernels counted) 3.6–8.1% low, ∈ [1/0.964, 1/0.919];
- several GPUs: the papers' runs (Narayanan et al. 2021 Table 1, Korthikanti et al. 2022 Tables 3 and 5 on A100s;
  experiments/results/autoconfig.md): the model's TFLOP/s from −7.3% to +13.6% of the measured, so measured /
  predicted ∈ [0.927, 1.136]. No multi-GPU H100 step has been measured: on H100 clusters this band is the A100 runs'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_DAY = 86_400
SECONDS_PER_HOUR = 3_600


@dataclass(frozen=True)
class Band:
    """measured / predicted step time, as the time model's measurements found it, and where from."""

    low: float
    high: float
    source: str


ONE_GPU_TARGET = Band(1 / 1.033, 1 / 0.973, "one GPU, --target: the 19 H100 steps measured, predicted −2.7% to +3.3%")
ONE_GPU_COUNTED = Band(1 / 0.964, 1 / 0.919,
                       "one GPU, without --target: the 19 H100 steps measured, predicted 3.6–8.1% low")
PAPERS = Band(0.927, 1.136, "several GPUs: the papers' 12 A100 runs, predicted TFLOP/s −7.3% to +13.6% of the measured")


def band(gpus: int, target: str | None) -> Band:
    """The band of a search over `gpus` GPUs, with its layers compiled for `target` (None: XLA:CPU's)."""
    if gpus > 1:
        return PAPERS
    return ONE_GPU_TARGET if target is not None else ONE_GPU_COUNTED


@dataclass(frozen=True)
class Pricing:
    """The run to price: its total tokens and, optionally, the dollars one GPU costs an hour."""

    tokens: int
    price_per_gpu_hour: float | None = None


def steps(tokens: int, global_batch: int, seq_len: int) -> int:
    """Optimizer steps to train `tokens` tokens at global_batch sequences of seq_len a step."""
    return math.ceil(tokens / (global_batch * seq_len))


def _banded(value: float, b: Band) -> dict:
    return {"value": value, "low": value * b.low, "high": value * b.high}


def training_cost(step_s: float, pricing: Pricing, global_batch: int, seq_len: int, gpus: int, b: Band) -> dict:
    """days, gpu_hours and cost (dollars; None without a price), each {value, low, high}, and the steps."""
    seconds = step_s * steps(pricing.tokens, global_batch, seq_len)
    gpu_hours = seconds * gpus / SECONDS_PER_HOUR
    cost = None if pricing.price_per_gpu_hour is None else _banded(gpu_hours * pricing.price_per_gpu_hour, b)
    return {"steps": steps(pricing.tokens, global_batch, seq_len), "days": _banded(seconds / SECONDS_PER_DAY, b),
            "gpu_hours": _banded(gpu_hours, b), "cost": cost}


def format_note(pricing: Pricing, global_batch: int, seq_len: int, b: Band) -> str:
    """The line under the search's table that says what the days, GPU-h and cost columns are."""
    price = (f"cost = GPU-h × ${pricing.price_per_gpu_hour:g} per GPU-hour, in dollars"
             if pricing.price_per_gpu_hour is not None else "no cost without --price-per-gpu-hour")
    return (f"days, GPU-h: {pricing.tokens:,} tokens = {steps(pricing.tokens, global_batch, seq_len):,} steps of "
            f"{global_batch} × {seq_len} tokens at the row's step s (days = step s × steps / 86,400; GPU-h = step s × "
            f"steps × GPUs / 3,600); {price}; each within ×{b.low:.3f} to ×{b.high:.3f} (--json: low and high), "
            f"the band the time model measured: {b.source} (planning/cost.py)")
