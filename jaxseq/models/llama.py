"""The Llama family (Llama 2/3, Mistral-shaped): RMSNorm, rotary positions on Q and K, a SwiGLU MLP,
grouped-query attention (kv_heads K/V heads shared by groups of query heads), an untied lm_head, no biases.

One family's home, as models/gpt.py is GPT's: its parameter table, embedding, block, head and the block
against a KV cache. Tensor parallelism splits the query heads over `tensor`; the K/V heads split too where
kv_heads is a multiple of t. Where t is a multiple of kv_heads (8 K/V heads at t = 16) each K/V head is
held by the t/kv_heads ranks whose query heads use it (Megatron-LM's answer): the K/V kernel is stored
whole on every rank and each rank takes its head's slice; the slices' gradients sum back over `tensor`.

Shapes: b batch, s sequence, h hidden, a heads, k K/V heads, d head_dim, f MLP width, V padded vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxseq.config import ConfigError, ModelConfig
from jaxseq import remat
from jaxseq.models.ops import attention, dropout, head_rms_norm, matmul, rms_norm, rope, swiglu, vocab_logits
from jaxseq.models.params import derive, drop_layer_axis, kernel, norm_scale, Param, Traits
from jaxseq.sharding import Sharder


# RMSNorm keeps its float32 1/rms; SwiGLU's input is gate and up (2f), it reads both and writes their product
# (3e) and backward reads gate, up and dy and writes two gradients (5e); RoPE instead of learned positions.
TRAITS = Traits(norm_stat_bytes=4, mlp_up_widths=2, mlp_elementwise=(3, 5), learned_positions=False, rotary=True,
                papers_formulas=False,
                shape_fields=(("kv_heads", "num_kv_heads"), ("f", "mlp_hidden")))


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type this family's weights convert to (interop/hf_llama.py, which refuses qk_norm)."""
    return "llama"


ROPE_SCALINGS = ("llama3",)  # ModelConfig.rope_scaling: Llama 3.1's frequency scaling (`ops.rope`)


def validate(cfg: ModelConfig) -> None:
    """The fields only this family reads: grouped K/V heads, the MLP width, RoPE's θ and scaling, the q/k norm."""
    kv = cfg.kv_heads
    if cfg.fused_qkv is not False:
        raise ConfigError(f"fused_qkv={cfg.fused_qkv!r} is a GPT-family setting; the Llama families keep Q and K/V "
                          "apart (set family: gpt)")
    if not isinstance(cfg.qk_norm, bool):
        raise ConfigError(f"qk_norm={cfg.qk_norm!r} must be true or false")
    if kv is not None and (not isinstance(kv, int) or kv <= 0 or cfg.heads % kv):
        raise ConfigError(f"kv_heads={kv!r} must be a positive integer dividing heads={cfg.heads}")
    if cfg.ffn_hidden is not None and (not isinstance(cfg.ffn_hidden, int) or cfg.ffn_hidden <= 0):
        raise ConfigError(f"ffn_hidden={cfg.ffn_hidden!r} must be a positive integer")
    if cfg.head_dim % 2:
        raise ConfigError(f"head width {cfg.head_dim} must be even (RoPE rotates pairs)")
    if not cfg.rope_theta > 0:
        raise ConfigError(f"rope_theta={cfg.rope_theta!r} must be positive")
    if cfg.rope_scaling is not None and cfg.rope_scaling not in ROPE_SCALINGS:
        raise ConfigError(f"rope_scaling={cfg.rope_scaling!r} is not a known RoPE scaling; valid: none, "
                          f"{', '.join(ROPE_SCALINGS)}")
    if cfg.rope_scaling == "llama3" and not (cfg.rope_factor > 0 and
                                             0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor):
        raise ConfigError(f"llama3 RoPE scaling needs factor > 0 and 0 < low_freq_factor < high_freq_factor; got "
                          f"{cfg.rope_factor}, {cfg.rope_low_freq_factor}, {cfg.rope_high_freq_factor}")


def table(cfg: ModelConfig, tensor: int) -> dict:
    """The parameters. Q is [h, a, d]; K and V one kernel [h, 2, k, d] (one matmul); gate and up one kernel
    [h, 2, f]. The K/V heads split over `tensor` (logical axis kv_heads) only where t divides them."""
    kv_axis = "kv_heads" if cfg.num_kv_heads % tensor == 0 else None
    attn = {
        "q": {"kernel": kernel(("L", "h", "a", "d"), ("layers", "embed", "heads", None))},
        "kv": {"kernel": kernel(("L", "h", "2", "k", "d"), ("layers", "embed", None, kv_axis, None))},
        "out": {"kernel": kernel(("L", "a", "d", "h"), ("layers", "heads", None, "embed"), "residual")},
    }
    if cfg.qk_norm:  # one scale over head_dim for every head: replicated, each tensor rank normalises its own heads
        attn.update({name: {"scale": Param(("L", "d"), ("layers", None), "ones", decay=False, cast=False)}
                     for name in ("q_norm", "k_norm")})
    return {
        "embed": {"token": kernel(("V", "h"), ("vocab", "embed"))},
        "layers": {
            "attn_norm": {"scale": norm_scale(layers=True)},
            "attn": attn,
            "mlp_norm": {"scale": norm_scale(layers=True)},
            "mlp": {
                "wi": {"kernel": kernel(("L", "h", "2", "f"), ("layers", "embed", None, "mlp"))},
                "wo": {"kernel": kernel(("L", "f", "h"), ("layers", "mlp", "embed"), "residual")},
            },
        },
        "final_norm": {"scale": norm_scale(layers=False)},
        "lm_head": {"kernel": kernel(("V", "h"), ("vocab", "embed"))},
    }


def layer_axes(cfg: ModelConfig, tensor: int) -> dict:
    return drop_layer_axis(derive(table(cfg, tensor), lambda p: p.axes)["layers"])


def cache_heads(cfg: ModelConfig, tensor: int) -> int:
    """K/V heads as a layer computes them on `tensor` ranks: kv_heads, or t where t is a multiple of it (each
    head repeated over the t/kv_heads ranks that use it)."""
    return max(cfg.num_kv_heads, tensor)


def _kv_kernel(w, cfg: ModelConfig, shard: Sharder):
    """The K/V kernel [h, 2, k, d] with its heads repeated to one per tensor rank where t > kv_heads, split
    over `tensor` (each rank's block: the head its query heads use)."""
    repeat = cache_heads(cfg, shard.tensor) // cfg.num_kv_heads
    return w if repeat == 1 else shard(jnp.repeat(w, repeat, axis=2), None, None, "heads", None)


def embed(group, tokens, key, cfg: ModelConfig, shard: Sharder):
    """tokens [b, s] → the first block's input [b, s(/t), h]: the vocab-parallel lookup, then dropout."""
    x = shard(shard.embed(group["token"], tokens), "batch", "seq_sp", None)
    return dropout(x, cfg.dropout, key, remat.EMBED_DROPOUT_MASK, shard.reorder(tokens.shape[1]), shard=shard)


def final_norm(params, x, cfg: ModelConfig):
    return rms_norm(x, params["final_norm"]["scale"], cfg.ln_eps)


LOGITS_WEIGHT = ("lm_head", "kernel")  # (group, name) of the weight the logits multiply by


def logits(params, x, cfg: ModelConfig, shard: Sharder):
    """Untied lm_head logits [b, s, V] sharded over vocab; padded vocabulary entries are -inf."""
    return vocab_logits(params["lm_head"]["kernel"], x, cfg, shard)


def _project_qkv(y, w, cfg: ModelConfig):
    return (matmul("bsh,had->bsad", y, w["q"], cfg), matmul("bsh,hckd->bsckd", y, w["kv"], cfg))


def block(x, p, key, cfg: ModelConfig, shard: Sharder):
    """One pre-norm block. x: [b, s, h], sequence-sharded between blocks under sequence parallelism."""
    train = key is not None
    k_attn, k_resid1, k_resid2 = jax.random.split(key, 3) if train else (None, None, None)
    order = shard.reorder(x.shape[1])  # the stored tokens' global positions under context parallelism
    x = attention_half(x, p, k_attn, k_resid1, cfg, shard)
    return _mlp_half(x, p, k_resid2, order, cfg, shard)


def attention_half(x, p, k_attn, k_resid1, cfg: ModelConfig, shard: Sharder):
    """The block's first half: x + attention(RMSNorm(x)) (after dropout with key k_resid1), tagged as the
    mid-layer residual; the mixture-of-experts family's block shares it (models/moe.py)."""
    x = checkpoint_name(shard(x, "batch", "seq_sp", None), remat.DECODER_LAYER_INPUT)

    # Attention: RMSNorm on the (sequence-sharded) stream, all-gather, column-parallel Q and K/V (one gather).
    y = checkpoint_name(shard(rms_norm(x, p["attn_norm"]["scale"], cfg.ln_eps), "batch", "seq_sp", None),
                        remat.QKV_INPUT)
    w = {"q": p["attn"]["q"]["kernel"], "kv": _kv_kernel(p["attn"]["kv"]["kernel"], cfg, shard)}
    q, kv = shard.column_parallel(lambda y, w: _project_qkv(y, w, cfg), y, w,
                                  {"q": (None, "heads", None), "kv": (None, None, "heads", None)},
                                  (("batch", "seq", "heads", None), ("batch", "seq", None, "heads", None)))
    k, v = (t[:, :, 0] for t in jnp.split(kv, 2, axis=2))
    q, k = rotated_qk(q, k, p["attn"], jnp.asarray(shard.positions(q.shape[1])), cfg, tag=True)
    v = checkpoint_name(v, remat.VALUE)
    ctx = attention(q, k, v, cfg, k_attn, shard)  # tagged CONTEXT
    # Row-parallel projection: partial sums reduced (all-reduce; reduce-scatter with SP).
    out = checkpoint_name(shard(matmul("bsad,adh->bsh", ctx, p["attn"]["out"]["kernel"], cfg), "batch", "seq_sp", None),
                          remat.OUT_PROJ)
    dropped = dropout(out, cfg.dropout, k_resid1, remat.ATTN_OUT_DROPOUT_MASK, shard.reorder(x.shape[1]), shard=shard)
    return checkpoint_name(x + dropped, remat.MID_LAYER_RESIDUAL)


def rotated_qk(q, k, attn, positions, cfg: ModelConfig, tag: bool = False):
    """q [b, s, a, d] and k [b, s, k, d] as attention takes them: each head's RMSNorm where cfg.qk_norm (Qwen3), then
    RoPE. Tagged (tag) QUERY and KEY where backward gets them cheapest: the rotated q and k; with the norm the
    projections' outputs (the same bytes), from which backward recomputes the norm and RoPE, elementwise, rather than
    keep both or replay the projections. The norm's statistics are not kept (not NORM_STATS): recomputed too."""
    name = checkpoint_name if tag else (lambda x, _: x)
    if cfg.qk_norm:
        q, k = name(q, remat.QUERY), name(k, remat.KEY)
        q, k = (head_rms_norm(x, attn[n]["scale"], cfg.ln_eps) for x, n in ((q, "q_norm"), (k, "k_norm")))
        return rope(q, positions, cfg), rope(k, positions, cfg)
    return name(rope(q, positions, cfg), remat.QUERY), name(rope(k, positions, cfg), remat.KEY)


def _mlp_half(x, p, k_resid2, order, cfg: ModelConfig, shard: Sharder):
    # MLP: RMSNorm, all-gather, column-parallel gate and up (one matmul), SwiGLU, row-parallel down.
    y = checkpoint_name(shard(rms_norm(x, p["mlp_norm"]["scale"], cfg.ln_eps), "batch", "seq_sp", None),
                        remat.MLPWI_INPUT)
    out = swiglu_mlp(y, p["mlp"], cfg, shard)
    x = x + dropout(out, cfg.dropout, k_resid2, remat.MLP_DROPOUT_MASK, order, shard=shard)
    return shard(x, "batch", "seq_sp", None)


def swiglu_mlp(y, p, cfg: ModelConfig, shard: Sharder):
    """The SwiGLU MLP of the normed stream y [b, s(/t), h] with p = {"wi": [h, 2, f], "wo": [f, h]}: column-parallel
    gate and up (one matmul, one all-gather under SP), row-parallel down; its output before dropout [b, s(/t), h]."""
    hid = shard.column_parallel(lambda y, w: matmul("bsh,hcf->bscf", y, w["kernel"], cfg), y,
                                {"kernel": p["wi"]["kernel"]}, {"kernel": (None, None, "mlp")},
                                ("batch", "seq", None, "mlp"))
    hid = checkpoint_name(shard(hid, "batch", "seq", None, "mlp"), remat.MLPWI)
    return checkpoint_name(shard(matmul("bsf,fh->bsh", swiglu(hid), p["wo"]["kernel"], cfg), "batch", "seq_sp", None),
                           remat.MLPWO)


# ---------------------------------------------------------------------------------------------
# Sampling: the same model against a KV cache


def decode_embed(params, tokens, start, cfg: ModelConfig, shard: Sharder):
    """`embed` without dropout (positions enter each layer, as RoPE)."""
    return shard(shard.embed(params["embed"]["token"], tokens), "batch", None, None)


def decode_layer(x, p, cache, i, start, cfg: ModelConfig, shard: Sharder, attend):
    """Layer i (as `block` computes it without dropout) on x [b, n, h] at positions start … start + n − 1,
    writing its keys and values into layer i of the cache (K, V [L, b, S, cache_heads, d]) first;
    `attend(q, k, v)` is the cached attention."""
    x, cache = decode_attention(x, p, cache, i, start, cfg, shard, attend)
    y = rms_norm(x, p["mlp_norm"]["scale"], cfg.ln_eps)
    hid = shard(swiglu(matmul("bsh,hcf->bscf", y, p["mlp"]["wi"]["kernel"], cfg)), "batch", None, "mlp")
    return x + shard(matmul("bsf,fh->bsh", hid, p["mlp"]["wo"]["kernel"], cfg), "batch", None, None), cache


def decode_attention(x, p, cache, i, start, cfg: ModelConfig, shard: Sharder, attend):
    """`decode_layer`'s first half, x + attention (the mixture-of-experts family's too), and the cache."""
    y = rms_norm(x, p["attn_norm"]["scale"], cfg.ln_eps)
    q, kv = _project_qkv(y, {"q": p["attn"]["q"]["kernel"],
                             "kv": _kv_kernel(p["attn"]["kv"]["kernel"], cfg, shard)}, cfg)
    q, k = rotated_qk(q, kv[:, :, 0], p["attn"], start + jnp.arange(x.shape[1]), cfg)
    q, k = shard(q, "batch", None, "heads", None), shard(k, "batch", None, "heads", None)
    v = shard(kv[:, :, 1], "batch", None, "heads", None)
    cache = tuple(jax.lax.dynamic_update_slice(c, new[None], (i, 0, start, 0, 0)) for c, new in zip(cache, (k, v)))
    ctx = attend(q, *(jax.lax.dynamic_index_in_dim(c, i, keepdims=False) for c in cache))
    return x + shard(matmul("bsad,adh->bsh", ctx, p["attn"]["out"]["kernel"], cfg), "batch", None, None), cache
