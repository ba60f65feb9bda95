"""The mixture-of-experts family (Mixtral-, Qwen3-MoE-shaped): Llama's attention (RMSNorm, RoPE, grouped-query
attention, models/llama.py) and in every layer a mixture of SwiGLU experts in place of the MLP, with optional shared
experts every token passes through (models/experts.py: the router, the dispatch, the experts, the balancing terms).

One family's home, as models/llama.py is Llama's: its parameter table, block, the block against a KV cache, the
check of its own fields. Its embedding, final norm and logits are Llama's. The experts [L, E, …] split over the
mesh axis `expert` (logical axis `experts`) and, like the dense MLP, their width f over `tensor`; the router [L, h, E]
is replicated.

Shapes: b batch, s sequence, h hidden, E experts, f an expert's width, g the shared experts' (shared · f).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxseq import remat
from jaxseq.config import ConfigError, ModelConfig
from jaxseq.models import experts, llama
from jaxseq.models.ops import dropout, rms_norm
from jaxseq.models.params import Param, derive, drop_layer_axis, kernel
from jaxseq.sharding import Sharder

# Llama's, with the experts' shape in a plan's header. (The cost side counts the MLP of k experts per token.)
TRAITS = dataclasses.replace(llama.TRAITS, shape_fields=llama.TRAITS.shape_fields + (
    ("E", "moe_experts"), ("top_k", "moe_top_k")))


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type this family's weights convert to: Qwen3-MoE's with the q/k norm
    (interop/hf_qwen3_moe.py), Mixtral's without (interop/hf_mixtral.py)."""
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


embed, final_norm, logits, cache_heads = llama.embed, llama.final_norm, llama.logits, llama.cache_heads
decode_embed, LOGITS_WEIGHT = llama.decode_embed, llama.LOGITS_WEIGHT


def validate(cfg: ModelConfig) -> None:
    """Llama's fields, and the experts': their count, the choices, the capacity, the balancing terms."""
    llama.validate(cfg)
    e, k, factor = cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor
    if not isinstance(e, int) or e < 1:
        raise ConfigError(f"moe_experts={e!r} must be a positive integer (the routed experts per layer)")
    if not isinstance(k, int) or not 1 <= k <= e:
        raise ConfigError(f"moe_top_k={k!r} must be an integer from 1 to moe_experts={e} (the experts each token "
                          "is routed to)")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
        raise ConfigError(f"moe_capacity_factor={factor!r} must be > 0 (each expert's slots: ceil(factor·T·k/E) "
                          "of a group of T tokens), or none for dropless routing")
    if not isinstance(cfg.moe_shared_experts, int) or cfg.moe_shared_experts < 0:
        raise ConfigError(f"moe_shared_experts={cfg.moe_shared_experts!r} must be an integer ≥ 0")
    for name in ("moe_aux_loss_coef", "moe_z_loss_coef", "moe_bias_rate"):
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{name}={value!r} must be a number ≥ 0")


def table(cfg: ModelConfig, tensor: int) -> dict:
    """Llama's table with the MLP replaced: the router [L, h, E] (and DeepSeek-V3's bias [L, E] where its rate is
    set: float32, moved by its own rule, `Param.update`), the experts' gate and up [L, E, h, 2, f] and down
    [L, E, f, h], and the shared experts' [L, h, 2, g] and [L, g, h] where there are any."""
    params = llama.table(cfg, tensor)
    layers = {name: group for name, group in params["layers"].items() if name != "mlp"}
    layers["router"] = {"kernel": kernel(("L", "h", "E"), ("layers", "embed", None))}
    if cfg.moe_bias_rate:
        layers["router"]["bias"] = Param(("L", "E"), ("layers", None), "zeros", decay=False, cast=False, update="sign")
    layers["experts"] = {
        "wi": {"kernel": kernel(("L", "E", "h", "2", "f"), ("layers", "experts", "embed", None, "mlp"))},
        "wo": {"kernel": kernel(("L", "E", "f", "h"), ("layers", "experts", "mlp", "embed"), "residual")},
    }
    if cfg.moe_shared_experts:
        layers["shared"] = {"wi": {"kernel": kernel(("L", "h", "2", "g"), ("layers", "embed", None, "mlp"))},
                            "wo": {"kernel": kernel(("L", "g", "h"), ("layers", "mlp", "embed"), "residual")}}
    return {**params, "layers": layers}


def layer_axes(cfg: ModelConfig, tensor: int) -> dict:
    return drop_layer_axis(derive(table(cfg, tensor), lambda p: p.axes)["layers"])


def block(x, p, key, cfg: ModelConfig, shard: Sharder):
    """One pre-norm block: Llama's attention half, then RMSNorm, the experts (and shared experts), dropout."""
    return _block(x, p, key, cfg, shard)[0]


def _block(x, p, key, cfg: ModelConfig, shard: Sharder):
    """(`block`'s output, the router's logits [b, s, E])."""
    train = key is not None
    k_attn, k_resid1, k_resid2 = jax.random.split(key, 3) if train else (None, None, None)
    x = llama.attention_half(x, p, k_attn, k_resid1, cfg, shard)
    y = checkpoint_name(shard(rms_norm(x, p["mlp_norm"]["scale"], cfg.ln_eps), "batch", "seq_sp", None),
                        remat.MLPWI_INPUT)
    out, router_logits = experts.moe(y, p, cfg, shard, bias=p["router"].get("bias"))
    if cfg.moe_shared_experts:
        out = out + llama.swiglu_mlp(y, p["shared"], cfg, shard)
    x = x + dropout(out, cfg.dropout, k_resid2, remat.MLP_DROPOUT_MASK, shard.reorder(x.shape[1]), shard=shard)
    return shard(x, "batch", "seq_sp", None), router_logits


def routing(params, tokens, cfg: ModelConfig, shard: Sharder = Sharder(None)):
    """The router's logits [L, b, s, E] of every layer on tokens [b, s] (no dropout; `params` in the dtype they
    compute in), layer by layer as `block` computes them: what `experts.load_balancing_loss`, `experts.z_loss` and
    the tokens each expert receives are read from."""
    x = embed(params["embed"], tokens, None, cfg, shard)
    found = []
    for i in range(cfg.layers):
        x, router_logits = _block(x, jax.tree.map(lambda a: a[i], params["layers"]), None, cfg, shard)
        found.append(router_logits)
    return jax.numpy.stack(found)


def decode_layer(x, p, cache, i, start, cfg: ModelConfig, shard: Sharder, attend):
    """Layer i against a KV cache (`llama.decode_layer`'s attention), its experts dropless: no token of a sample
    is dropped, whatever the capacity the model trained with."""
    x, cache = llama.decode_attention(x, p, cache, i, start, cfg, shard, attend)
    y = rms_norm(x, p["mlp_norm"]["scale"], cfg.ln_eps)
    sampling = dataclasses.replace(cfg, moe_capacity_factor=None, moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0)
    out, _ = experts.moe(y, p, sampling, shard, bias=p["router"].get("bias"))
    if cfg.moe_shared_experts:
        out = out + llama.swiglu_mlp(y, p["shared"], cfg, shard)
    return x + out, cache
