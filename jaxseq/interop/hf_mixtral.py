"""The Hugging Face Mixtral format (`MixtralForCausalLM`): config.json + safetensors ↔ the mixture-of-experts
family's config and parameters (models/moe.py).

Llama's attention, norms, embedding and lm_head as interop/hf_llama.py reads and writes them; the experts as every
Mixtral checkpoint holds them (and transformers 5 saves them, fusing them only in memory): per layer
`block_sparse_moe.gate.weight` [E, h] (the router), and per expert e `block_sparse_moe.experts.e.w1.weight` (gate)
and `w3` (up) [f, h] and `w2` (down) [h, f]. torch's Linear stores [out, in]: every kernel is transposed. The
experts' reader and writer (`read_experts`, `write_experts`) take the names: Qwen3-MoE's are its own
(interop/hf_qwen3_moe.py).

Mixtral routes dropless (every token to its k experts), so a converted model is dropless (`moe_capacity_factor`
none), with Mixtral's renormalised top-k weights and its aux-loss coefficient. Refused in one line: router jitter
noise, which jaxseq's router does not add; and, writing, what Mixtral cannot hold (shared experts, the
aux-loss-free bias, weights not renormalised, Qwen3's q/k norm).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from jaxseq.config import ConfigError, ModelConfig
from jaxseq.interop.hf import Tensor, Weights
from jaxseq.interop.hf_llama import _f32, _pair, _stacked, llama_config, llama_fields, read_params, write_params


def model_config(hf: dict, dtype: str = "float32") -> ModelConfig:
    """The jaxseq model an HF Mixtral config describes, or a ConfigError naming what does not fit."""
    if hf.get("model_type") != "mixtral":
        raise ConfigError(f"config.json: model_type={hf.get('model_type')!r} is not supported here (only 'mixtral')")
    if hf.get("router_jitter_noise") or 0.0:
        raise ConfigError(f"config.json: router_jitter_noise={hf['router_jitter_noise']!r} is not supported by "
                          "jaxseq (its router adds no noise): only 0")
    try:
        experts, top_k = int(hf["num_local_experts"]), int(hf["num_experts_per_tok"])
    except KeyError as e:
        raise ConfigError(f"config.json: {e.args[0]} is missing") from None
    return ModelConfig(family="moe", **llama_fields(hf, dtype), moe_experts=experts, moe_top_k=top_k,
                       moe_capacity_factor=None, moe_norm_topk=True,
                       moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def hf_config(cfg: ModelConfig) -> dict:
    """A Mixtral config.json for a jaxseq mixture of experts, as transformers 5 writes it."""
    if cfg.family != "moe":
        raise ConfigError(f"family={cfg.family!r}: HF Mixtral needs family='moe'")
    for what, fits in (("moe_shared_experts", cfg.moe_shared_experts == 0), ("moe_bias_rate", cfg.moe_bias_rate == 0),
                       ("moe_norm_topk", cfg.moe_norm_topk), ("qk_norm", not cfg.qk_norm)):
        if not fits:
            raise ConfigError(f"{what}={getattr(cfg, what)!r}: Mixtral has no shared experts, no aux-loss-free bias, "
                              "no q/k norm and always renormalises its top-k weights")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **llama_config(cfg),
            "num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
            "router_aux_loss_coef": cfg.moe_aux_loss_coef, "router_jitter_noise": 0.0, "output_router_logits": False,
            "sliding_window": None}


MIXTRAL_EXPERTS = ("block_sparse_moe", "w1", "w3", "w2")  # the MoE block's name, each expert's gate, up and down


def expert_names(experts: int, block: str, gate: str, up: str, down: str):
    """names(prefix, i): layer i's router and experts' tensors, by key ("router", and (w, e) for w gate/up/down)."""
    def names(p: str, i: int) -> dict:
        b = f"{p}layers.{i}.{block}."
        return {"router": b + "gate.weight",
                **{(w, e): f"{b}experts.{e}.{w}.weight" for e in range(experts) for w in (gate, up, down)}}
    return names


def to_params(cfg: ModelConfig, weights: Weights) -> tuple[dict, dict, dict]:
    """HF tensors → (jaxseq params as `Leaf`s read on demand, the record from_params needs to write them back,
    buffers), as `hf_llama.to_params`."""
    return read_experts(cfg, weights, *MIXTRAL_EXPERTS)


def read_experts(cfg: ModelConfig, weights: Weights, block: str, gate: str, up: str, down: str):
    """`to_params` of a Llama-shaped mixture whose experts are one tensor each, named as `expert_names`."""
    h, f, E, L = cfg.hidden, cfg.mlp_hidden, cfg.moe_experts, cfg.layers
    expect = {"router": (E, h),
              **{(w, e): (h, f) if w == down else (f, h) for e in range(E) for w in (gate, up, down)}}

    def experts(read):
        def each(idx, one):  # the experts range(E)[idx] of a [E, …] block
            return np.stack([one(e) for e in range(E)[idx]])

        return {
            # gate.weight [E, h] → [h, E]
            "router": {"kernel": _stacked(L, (h, E), lambda i, idx: read(i, "router", (idx[1], idx[0])).T)},
            "experts": {
                # gate, up [f, h] → [E, h, 2, f]; down [h, f] → [E, f, h]
                "wi": {"kernel": _stacked(L, (E, h, 2, f), lambda i, idx: each(idx[0], lambda e: _pair(
                    lambda j: read(i, ((gate, up)[j], e), (idx[3], idx[1])).T, idx[2], axis=1)))},
                "wo": {"kernel": _stacked(L, (E, f, h), lambda i, idx: each(
                    idx[0], lambda e: read(i, (down, e), (idx[2], idx[1])).T))},
            },
        }

    return read_params(cfg, weights, expert_names(E, block, gate, up, down), expect, experts)


def from_params(cfg: ModelConfig, params: dict, record: dict | None = None,
                buffers: dict[str, np.ndarray] | None = None) -> dict[str, Tensor]:
    """jaxseq params → HF Mixtral tensors, each computed when written (one layer's experts read from the params
    once for all of its tensors), as `hf_llama.from_params`."""
    hf_config(cfg)  # refuse what Mixtral cannot hold before writing anything
    return write_experts(cfg, params, record, buffers, *MIXTRAL_EXPERTS)


def write_experts(cfg: ModelConfig, params: dict, record: dict | None, buffers: dict[str, np.ndarray] | None,
                  block: str, gate: str, up: str, down: str) -> dict[str, Tensor]:
    """`from_params` of a Llama-shaped mixture whose experts are one tensor each, named as `expert_names`."""
    h, f, E = cfg.hidden, cfg.mlp_hidden, cfg.moe_experts
    lay = params["layers"]
    router = lay["router"]["kernel"]
    wi = lru_cache(maxsize=1)(lambda i: _f32(lay["experts"]["wi"]["kernel"][i]))  # [E, h, 2, f]
    wo = lru_cache(maxsize=1)(lambda i: _f32(lay["experts"]["wo"]["kernel"][i]))  # [E, f, h]

    def experts(n, i):
        tensors = {n["router"]: ((E, h), lambda: _f32(router[i]).T)}
        for e in range(E):
            tensors.update({n[(gate, e)]: ((f, h), lambda e=e: wi(i)[e, :, 0].T),
                            n[(up, e)]: ((f, h), lambda e=e: wi(i)[e, :, 1].T),
                            n[(down, e)]: ((h, f), lambda e=e: wo(i)[e].T)})
        return tensors

    return write_params(cfg, params, record, buffers, expert_names(E, block, gate, up, down), experts)
