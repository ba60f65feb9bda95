"""The paper's formulas (Korthikanti et al. 2022): activation bytes per layer, FLOPs per iteration,
and the one table of the paper's configurations. Arithmetic only: no JAX, no compiling.

Bytes per layer assume 16-bit activations and 1-byte dropout masks (the paper's Table 2); FLOPs are
matmul FLOPs (2 per multiply-add).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxseq.config import ModelConfig
from jaxseq.remat import POLICIES


@dataclass(frozen=True)
class PaperConfiguration:
    """One row of the paper's Table 2: how it runs in jaxseq."""

    remat: str  # the registered remat policy
    sequence_parallel: bool
    tensor_parallel: bool  # False: one device, no parallelism


# The paper's configurations, in the order of its Table 2 (plus full recompute with SP).
PAPER_CONFIGURATIONS: dict[str, PaperConfiguration] = {
    "none": PaperConfiguration("none", False, False),
    "tp": PaperConfiguration("none", False, True),
    "tp+sp": PaperConfiguration("none", True, True),
    "tp+selective": PaperConfiguration("selective", False, True),
    "tp+sp+selective": PaperConfiguration("selective", True, True),
    "full": PaperConfiguration("full", False, True),
    "full+sp": PaperConfiguration("full", True, True),
}


def paper_activation_bytes(config: str, s: int, b: int, h: int, a: int, t: int) -> float:
    """Table 2 of the paper (and 2sbh/t for full recompute with sequence parallelism)."""
    sbh, scores = s * b * h, 5 * a * s / h
    table = {
        "none": sbh * (34 + scores),
        "tp": sbh * (10 + 24 / t + scores / t),
        "tp+sp": sbh * (34 / t + scores / t),
        "tp+selective": sbh * (10 + 24 / t),
        "tp+sp+selective": sbh * 34 / t,
        "full": 2 * sbh,
        "full+sp": 2 * sbh / t,
    }
    if config not in table:
        raise ValueError(f"unknown paper configuration {config!r}; valid: {', '.join(table)}")
    return table[config]


def model_flops(B: int, s: int, L: int, h: int, V: int) -> float:
    """Model FLOPs per iteration (forward + backward, no recompute): 72·B·s·L·h²·(1 + s/(6h) + V/(12hL))."""
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def paper_hardware_flops(B: int, s: int, L: int, h: int, V: int, remat: str) -> float:
    """The paper's hardware FLOPs: selective adds the core attention's forward (QKᵀ and scores×V),
    full adds one whole forward."""
    if remat == "full":
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * h * L))
    if remat == "selective":
        return 72 * B * s * L * h * h * (1 + s / (3 * h) + V / (12 * h * L))
    return model_flops(B, s, L, h, V)


def layer_matmul_flops(cfg: ModelConfig, batch: int) -> dict[str, float]:
    """Forward FLOPs of each matmul of one layer (remat.MATMULS) for `batch` sequences. K and V are
    kv_heads wide (grouped-query attention); Llama's SwiGLU multiplies by two up kernels (gate and up)."""
    b, s, h, w, f = batch, cfg.seq_len, cfg.hidden, cfg.attention_width, cfg.mlp_hidden
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    up = 2 if cfg.family == "llama" else 1
    return {"qkv": 2 * b * s * h * (w + kv), "scores": 2 * b * s * s * w, "context": 2 * b * s * s * w,
            "out": 2 * b * s * w * h, "mlp_up": 2 * b * s * h * up * f, "mlp_down": 2 * b * s * f * h}


def train_flops(cfg: ModelConfig, batch: int, remat: str | None = None) -> float:
    """Matmul FLOPs of one training iteration over `batch` sequences: three times every forward
    matmul (forward, and backward's two), logits included, plus the forward matmuls the remat policy
    replays in backward (None: model FLOPs). For attention width h and MLP width 4h the model FLOPs
    are exactly the paper's 72·B·s·L·h²·(1 + s/(6h) + V/(12hL)); the replays match XLA's cost
    analysis (tests/test_flops.py), where the paper's hardware formulas assume more recompute."""
    matmuls = layer_matmul_flops(cfg, batch)
    logits = 2 * batch * cfg.seq_len * cfg.hidden * cfg.vocab_size
    flops = 3 * (cfg.layers * sum(matmuls.values()) + logits)
    if remat is not None:
        flops += cfg.layers * sum(matmuls[m] for m in POLICIES[remat].replays)
    return flops
