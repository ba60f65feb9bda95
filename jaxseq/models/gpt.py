"""The GPT family (GPT-2/GPT-3, the papers' model): learned positions, pre-LayerNorm blocks with a GELU MLP
and multi-head attention, biases, the token embedding tied to the output logits.

One family's home: its parameter table, its embedding, its block, its head, and the same block against a
KV cache for sampling. models/model.py calls through these for every family alike. Tensor parallelism
comes from the parameter specs (the logical axes below), sequence parallelism from the activation
constraints (`shard(x, "batch", "seq_sp", None)`); XLA inserts the collectives.

Shapes: b batch, s sequence, h hidden, a heads, d head_dim, f mlp width, V padded vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxseq.config import ConfigError, ModelConfig
from jaxseq import remat
from jaxseq.models.ops import add_bias, attention, dropout, gelu, layer_norm, matmul, vocab_logits
from jaxseq.models.params import bias, derive, drop_layer_axis, kernel, norm_bias, norm_scale, Param, Traits
from jaxseq.sharding import Sharder

# Q, K, V and MLP-up are column-parallel (heads / mlp split), the projection and MLP-down are
# row-parallel, the token embedding is vocab-parallel. Q, K and V are three weights, as MaxText keeps them by default:
# as one [h, 3, a, d] kernel (`fused_qkv`, Megatron's), the GPU's backward concatenates cuDNN's three gradients into
# one tensor for its two GEMMs (7.25 GB a gpt3-1.3b step on the H100's program, experiments/results/bf16_levers.md).
# Fused, the kernel is [h, 3, a, d] so that splitting heads keeps each rank's Q, K and V together.
QKV = ("q", "k", "v")
FUSED_QKV = {"kernel": kernel(("L", "h", "3", "a", "d"), ("layers", "embed", None, "heads", None)),
             "bias": bias(("L", "3", "a", "d"), ("layers", None, "heads", None))}
PARAMS = {
    "embed": {"token": kernel(("V", "h"), ("vocab", "embed")),
              "position": Param(("s", "h"), (None, "embed"), "normal", decay=False, cast=True)},
    "layers": {
        "ln1": {"scale": norm_scale(layers=True), "bias": norm_bias(layers=True)},
        "attn": {
            **{name: {"kernel": kernel(("L", "h", "a", "d"), ("layers", "embed", "heads", None)),
                      "bias": bias(("L", "a", "d"), ("layers", "heads", None))} for name in QKV},
            "out": {"kernel": kernel(("L", "a", "d", "h"), ("layers", "heads", None, "embed"), "residual"),
                    "bias": bias(("L", "h"), ("layers", None))},
        },
        "ln2": {"scale": norm_scale(layers=True), "bias": norm_bias(layers=True)},
        "mlp": {
            "wi": {"kernel": kernel(("L", "h", "f"), ("layers", "embed", "mlp")),
                   "bias": bias(("L", "f"), ("layers", "mlp"))},
            "wo": {"kernel": kernel(("L", "f", "h"), ("layers", "mlp", "embed"), "residual"),
                   "bias": bias(("L", "h"), ("layers", None))},
        },
    },
    "final_ln": {"scale": norm_scale(layers=False), "bias": norm_bias(layers=False)},
}

PARAMS_FUSED = {**PARAMS, "layers": {**PARAMS["layers"], "attn": {
    "qkv": FUSED_QKV, "out": PARAMS["layers"]["attn"]["out"]}}}
LAYER_AXES = {fused: drop_layer_axis(derive(params, lambda p: p.axes)["layers"])
              for fused, params in ((False, PARAMS), (True, PARAMS_FUSED))}

# LayerNorm keeps its float32 mean and 1/std; GELU's input is f wide, bias + GELU move 2e forward and 3e back;
# learned positions are added at the lookup; the papers' formulas are this family's.
TRAITS = Traits(norm_stat_bytes=8, mlp_up_widths=1, mlp_elementwise=(2, 3), learned_positions=True, rotary=False,
                papers_formulas=True, shape_fields=())


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type this family's weights convert to (interop/hf.py)."""
    return "gpt2"


# The other family's settings GPT has no use for: grouped K/V heads and a RoPE scaling. Refused, not ignored.
REFUSED_FIELDS = ("kv_heads", "rope_scaling")


def validate(cfg: ModelConfig) -> None:
    """The fields only this family reads (none beyond the shared ones), and none it would silently ignore."""
    for name in REFUSED_FIELDS:
        if getattr(cfg, name) is not None:
            raise ConfigError(f"{name}={getattr(cfg, name)!r} is a Llama-family setting; the gpt family has none "
                              "(set family: llama)")
    if cfg.qk_norm is not False:
        raise ConfigError(f"qk_norm={cfg.qk_norm!r} is a Llama-family setting; the gpt family has none "
                          "(set family: llama)")
    if not isinstance(cfg.fused_qkv, bool):
        raise ConfigError(f"fused_qkv={cfg.fused_qkv!r} must be true or false")


def table(cfg: ModelConfig, tensor: int) -> dict:
    return PARAMS_FUSED if cfg.fused_qkv else PARAMS


def layer_axes(cfg: ModelConfig, tensor: int) -> dict:
    return LAYER_AXES[cfg.fused_qkv]


def embed(group, tokens, key, cfg: ModelConfig, shard: Sharder):
    """tokens [b, s] → the first block's input [b, s(/t), h] from the embedding group (params["embed"]): the
    vocab-parallel lookup (each rank masks its rows and the ranks reduce; reduce-scatter with SP) plus the
    learned positions (of the stored order under context parallelism; with packed documents each token's position
    in its document), then dropout."""
    x = shard.embed(group["token"], tokens)
    order = shard.reorder(tokens.shape[1])
    positions = group["position"][: tokens.shape[1]] if order is None else jnp.take(group["position"], order, axis=0)
    if shard.documents is not None:
        positions = jnp.take(group["position"], shard.documents.positions, axis=0)  # [b, s, h]
    x = shard(x + positions, "batch", "seq_sp", None)
    return dropout(x, cfg.dropout, key, remat.EMBED_DROPOUT_MASK, order, shard=shard)


def final_norm(params, x, cfg: ModelConfig):
    return layer_norm(x, params["final_ln"]["scale"], params["final_ln"]["bias"], cfg.ln_eps)


LOGITS_WEIGHT = ("embed", "token")  # (group, name) of the weight the logits multiply by: the tied embedding


def logits(params, x, cfg: ModelConfig, shard: Sharder):
    """Tied-embedding logits [b, s, V] sharded over vocab; padded vocabulary entries are -inf."""
    return vocab_logits(params["embed"]["token"], x, cfg, shard)


def _linear(spec: str, cfg: ModelConfig):
    return lambda x, p: matmul(spec, x, p["kernel"], cfg)


def _qkv(y, attn, cfg: ModelConfig, shard: Sharder):
    """q, k, v [b, s, a, d], biases added, from the column-parallel projection of y: three GEMMs (one all-gather of
    y under SP, one reduction of its gradient), or one of the fused kernel and a split (backward: one concatenate,
    not three zero-padded gradients summed)."""
    if cfg.fused_qkv:
        qkv = shard.column_parallel(_linear("bsh,hcad->bscad", cfg), y, {"kernel": attn["qkv"]["kernel"]},
                                    {"kernel": LAYER_AXES[True]["attn"]["qkv"]["kernel"]},
                                    ("batch", "seq", None, "heads", None))
        qkv = add_bias(qkv, attn["qkv"]["bias"])
        return tuple(t[:, :, 0] for t in jnp.split(qkv, 3, axis=2))
    kernels = {name: attn[name]["kernel"] for name in QKV}
    qkv = shard.column_parallel(lambda y, w: tuple(matmul("bsh,had->bsad", y, w[n], cfg) for n in QKV), y, kernels,
                                {name: LAYER_AXES[False]["attn"][name]["kernel"] for name in QKV},
                                (("batch", "seq", "heads", None),) * 3)
    return tuple(add_bias(t, attn[name]["bias"]) for t, name in zip(qkv, QKV))


def block(x, p, key, cfg: ModelConfig, shard: Sharder):
    """One pre-LN block. x: [b, s, h], sequence-sharded between blocks under sequence parallelism."""
    train = key is not None
    k_attn, k_resid1, k_resid2 = jax.random.split(key, 3) if train else (None, None, None)
    order = shard.reorder(x.shape[1])  # the stored tokens' global positions under context parallelism
    x = checkpoint_name(shard(x, "batch", "seq_sp", None), remat.DECODER_LAYER_INPUT)

    # Attention: LN on the (sequence-sharded) stream, all-gather, column-parallel QKV.
    y = checkpoint_name(shard(layer_norm(x, p["ln1"]["scale"], p["ln1"]["bias"], cfg.ln_eps), "batch", "seq_sp", None),
                        remat.QKV_INPUT)
    q, k, v = _qkv(y, p["attn"], cfg, shard)
    q, k, v = checkpoint_name(q, remat.QUERY), checkpoint_name(k, remat.KEY), checkpoint_name(v, remat.VALUE)
    ctx = attention(q, k, v, cfg, k_attn, shard)  # tagged CONTEXT
    # Row-parallel projection: partial sums reduced (all-reduce; reduce-scatter with SP).
    out = add_bias(matmul("bsad,adh->bsh", ctx, p["attn"]["out"]["kernel"], cfg), p["attn"]["out"]["bias"])
    out = checkpoint_name(shard(out, "batch", "seq_sp", None), remat.OUT_PROJ)
    dropped = dropout(out, cfg.dropout, k_resid1, remat.ATTN_OUT_DROPOUT_MASK, order, shard=shard)
    x = checkpoint_name(x + dropped, remat.MID_LAYER_RESIDUAL)

    # MLP: LN, all-gather, column-parallel up, GELU, row-parallel down.
    y = checkpoint_name(shard(layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"], cfg.ln_eps), "batch", "seq_sp", None),
                        remat.MLPWI_INPUT)
    hid = shard.column_parallel(_linear("bsh,hf->bsf", cfg), y, {"kernel": p["mlp"]["wi"]["kernel"]},
                                {"kernel": LAYER_AXES[False]["mlp"]["wi"]["kernel"]}, ("batch", "seq", "mlp"))
    # Kept before its bias, which backward adds again: the GEMM writes this tensor anyway, while kept after the bias
    # it is a second [b, s, f] tensor the forward writes (3.2 GB a gpt3-1.3b step on the H100's program).
    hid = checkpoint_name(shard(hid, "batch", "seq", "mlp"), remat.MLPWI)
    act = gelu(add_bias(hid, p["mlp"]["wi"]["bias"]))
    out = add_bias(matmul("bsf,fh->bsh", act, p["mlp"]["wo"]["kernel"], cfg), p["mlp"]["wo"]["bias"])
    out = checkpoint_name(shard(out, "batch", "seq_sp", None), remat.MLPWO)
    x = x + dropout(out, cfg.dropout, k_resid2, remat.MLP_DROPOUT_MASK, order, shard=shard)
    return shard(x, "batch", "seq_sp", None)


# ---------------------------------------------------------------------------------------------
# Sampling: the same model against a KV cache


def cache_heads(cfg: ModelConfig, tensor: int) -> int:
    """K/V heads a layer's cache holds (split over `tensor`)."""
    return cfg.heads


def decode_embed(params, tokens, start, cfg: ModelConfig, shard: Sharder):
    """`embed` without dropout for tokens [b, n] at positions start … start + n − 1."""
    x = shard.embed(params["embed"]["token"], tokens)
    positions = jax.lax.dynamic_slice_in_dim(params["embed"]["position"], start, tokens.shape[1])
    return shard(x + positions, "batch", None, None)


def decode_layer(x, p, cache, i, start, cfg: ModelConfig, shard: Sharder, attend):
    """Layer i (as `block` computes it without dropout) on x [b, n, h] at positions start … start + n − 1,
    writing its keys and values into layer i of the cache (K, V [L, b, S, a, d]) first; `attend(q, k, v)`
    is the cached attention."""
    linear = lambda spec, y, w: add_bias(matmul(spec, y, w["kernel"], cfg), w["bias"])
    y = layer_norm(x, p["ln1"]["scale"], p["ln1"]["bias"], cfg.ln_eps)
    if cfg.fused_qkv:
        qkv = shard(linear("bsh,hcad->bscad", y, p["attn"]["qkv"]), "batch", None, None, "heads", None)
        q, k, v = (t[:, :, 0] for t in jnp.split(qkv, 3, axis=2))
    else:
        q, k, v = (shard(linear("bsh,had->bsad", y, p["attn"][name]), "batch", None, "heads", None) for name in QKV)
    cache = tuple(jax.lax.dynamic_update_slice(c, new[None], (i, 0, start, 0, 0)) for c, new in zip(cache, (k, v)))
    ctx = attend(q, *(jax.lax.dynamic_index_in_dim(c, i, keepdims=False) for c in cache))
    x = x + shard(linear("bsad,adh->bsh", ctx, p["attn"]["out"]), "batch", None, None)
    y = layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"], cfg.ln_eps)
    hid = shard(gelu(linear("bsh,hf->bsf", y, p["mlp"]["wi"])), "batch", None, "mlp")
    return x + shard(linear("bsf,fh->bsh", hid, p["mlp"]["wo"]), "batch", None, None), cache
