"""The Hugging Face Qwen3-MoE format (`Qwen3MoeForCausalLM`): config.json + safetensors ↔ the mixture-of-experts
family's config and parameters (models/moe.py) with Qwen3's per-head q/k RMSNorm (`qk_norm`).

Llama's attention, norms, embedding and lm_head as interop/hf_llama.py reads and writes them, plus per layer
`self_attn.q_norm.weight` and `k_norm.weight` [head_dim]; the experts as Qwen3-MoE checkpoints hold them (and
transformers 5 saves them, fusing them only in memory): per layer `mlp.gate.weight` [E, h] (the router), and per
expert e `mlp.experts.e.gate_proj.weight`, `up_proj` [f, h] and `down_proj` [h, f] (interop/hf_mixtral.py reads and
writes both layouts). head_dim is config.json's own (Qwen3-30B-A3B: 128 at hidden 2048 and 32 heads: kv_channels).

Qwen3-MoE routes dropless, so a converted model is dropless (`moe_capacity_factor` none), its top-k weights
renormalised where config.json's `norm_topk_prob` says so (`moe_norm_topk`), with its aux-loss coefficient (the
Switch form transformers computes: jaxseq adds each layer's, transformers pools the layers' router logits into one,
equal for one layer). Refused in one line: dense MLP layers among the sparse ones (`mlp_only_layers`,
`decoder_sparse_step` ≠ 1: every jaxseq layer is a mixture), attention biases, sliding-window attention; and,
writing, what Qwen3-MoE cannot hold (shared experts, the aux-loss-free bias, attention without the q/k norm).
config.json's `intermediate_size` is the dense layers' MLP width, which no layer here has: written as the experts'.
"""

from __future__ import annotations

import numpy as np

from jaxseq.config import ConfigError, ModelConfig
from jaxseq.interop.hf import Tensor, Weights
from jaxseq.interop.hf_llama import llama_config, llama_fields
from jaxseq.interop.hf_mixtral import read_experts, write_experts

QWEN3_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")  # the MoE block's name, each expert's gate, up and down


def model_config(hf: dict, dtype: str = "float32") -> ModelConfig:
    """The jaxseq model an HF Qwen3-MoE config describes, or a ConfigError naming what does not fit."""
    def refuse(what):
        raise ConfigError(f"config.json: {what} is not supported by jaxseq")

    if hf.get("model_type") != "qwen3_moe":
        refuse(f"model_type={hf.get('model_type')!r} (only 'qwen3_moe')")
    if hf.get("mlp_only_layers"):
        refuse(f"mlp_only_layers={hf['mlp_only_layers']!r} (dense layers among the experts'; only [])")
    if hf.get("decoder_sparse_step", 1) != 1:
        refuse(f"decoder_sparse_step={hf['decoder_sparse_step']!r} (dense layers among the experts'; only 1)")
    if hf.get("attention_bias", False):
        refuse("attention_bias=true")
    if hf.get("use_sliding_window", False):
        refuse("use_sliding_window=true (only false)")
    try:  # transformers 5 writes num_local_experts, Qwen's releases num_experts
        experts = int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"])
        top_k, width = int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"])
    except KeyError as e:
        raise ConfigError(f"config.json: {e.args[0]} is missing") from None
    if experts < 1:
        refuse(f"num_experts={experts} (a dense Qwen3; only ≥ 1)")
    # without use_sliding_window transformers ignores sliding_window; the experts' width is the MLP's
    fields = llama_fields({**hf, "sliding_window": None, "intermediate_size": width}, dtype)
    return ModelConfig(family="moe", **fields, qk_norm=True, moe_experts=experts, moe_top_k=top_k,
                       moe_capacity_factor=None, moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
                       moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def hf_config(cfg: ModelConfig) -> dict:
    """A Qwen3-MoE config.json for a jaxseq mixture of experts with the q/k norm, as transformers 5 writes it."""
    if cfg.family != "moe":
        raise ConfigError(f"family={cfg.family!r}: HF Qwen3-MoE needs family='moe'")
    for what, fits in (("moe_shared_experts", cfg.moe_shared_experts == 0), ("moe_bias_rate", cfg.moe_bias_rate == 0),
                       ("qk_norm", cfg.qk_norm)):
        if not fits:
            raise ConfigError(f"{what}={getattr(cfg, what)!r}: Qwen3-MoE has no shared experts, no aux-loss-free bias "
                              "and always normalises each head's q and k")
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **llama_config(cfg),
            "moe_intermediate_size": cfg.mlp_hidden, "num_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_top_k, "norm_topk_prob": cfg.moe_norm_topk, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "router_aux_loss_coef": cfg.moe_aux_loss_coef, "output_router_logits": False,
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None}


def to_params(cfg: ModelConfig, weights: Weights) -> tuple[dict, dict, dict]:
    """HF tensors → (jaxseq params as `Leaf`s read on demand, the record from_params needs to write them back,
    buffers), as `hf_llama.to_params`."""
    return read_experts(cfg, weights, *QWEN3_EXPERTS)


def from_params(cfg: ModelConfig, params: dict, record: dict | None = None,
                buffers: dict[str, np.ndarray] | None = None) -> dict[str, Tensor]:
    """jaxseq params → HF Qwen3-MoE tensors, each computed when written, as `hf_mixtral.from_params`."""
    hf_config(cfg)  # refuse what Qwen3-MoE cannot hold before writing anything
    return write_experts(cfg, params, record, buffers, *QWEN3_EXPERTS)
