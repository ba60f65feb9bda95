"""The Hugging Face Llama format: `config.json` + safetensors ↔ a jaxseq Llama config and parameter tree.

Pure NumPy, like `hf` (GPT-2), whose reading, writing and record-keeping it reuses: only the names,
layouts and refusals here are Llama's. torch's Linear stores weights as [out, in], so every kernel is
transposed; q/k/v are split into heads. HF stores q and k for rotate-half RoPE, which jaxseq applies
too, so no rows are permuted. Everything refusable is refused from config.json and the files' headers,
before a weight is read.

Tied embeddings (`tie_word_embeddings=true`, Llama 3.2 1B/3B) are refused in one line: jaxseq's Llama has an
untied lm_head (models/llama.py), so a copy of the embedding would train as a second V·h matrix and come back
untied. Every checkpoint read has its own lm_head.weight, and every one written has it too.
"""

from __future__ import annotations

import math

import numpy as np

from jaxseq.config import ConfigError, ModelConfig
from jaxseq.interop.hf import (Leaf, Tensor, Weights, as_tensors, check_params, leftovers, open_weights, read_config,
                               tensor_leaf, unstacked)

ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_positions"}
# Older conversions saved RoPE's inverse frequencies as a buffer: kept verbatim, never used.
BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------------------------
# config.json ↔ ModelConfig


def model_config(hf: dict, dtype: str = "float32") -> ModelConfig:
    """The jaxseq model an HF Llama config describes, or a ConfigError naming what does not fit."""
    def refuse(what):
        raise ConfigError(f"config.json: {what} is not supported by jaxseq")

    if hf.get("model_type") != "llama":
        refuse(f"model_type={hf.get('model_type')!r} (only 'llama')")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            refuse(f"{flag}=true")
    return ModelConfig(family="llama", **llama_fields(hf, dtype))


def llama_fields(hf: dict, dtype: str) -> dict:
    """The ModelConfig fields of a Llama-shaped HF config (Llama's, Mixtral's): sizes, heads, RoPE, norms; a
    ConfigError naming what does not fit."""
    def refuse(what):
        raise ConfigError(f"config.json: {what} is not supported by jaxseq")

    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("sliding_window") is not None:
        refuse(f"sliding_window={hf['sliding_window']!r} (only null)")
    if hf.get("tie_word_embeddings", False):
        refuse("tie_word_embeddings=true (Llama 3.2 1B/3B: jaxseq's Llama has an untied lm_head, so the embedding's "
               "copy would train as a second V·h matrix)")
    try:
        h, heads, layers = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
        vocab, positions, ffn = int(hf["vocab_size"]), int(hf["max_position_embeddings"]), int(hf["intermediate_size"])
    except KeyError as e:
        raise ConfigError(f"config.json: {e.args[0]} is missing") from None
    kv = int(hf.get("num_key_value_heads") or heads)
    if kv <= 0 or heads % kv:
        refuse(f"num_key_value_heads={kv} not dividing num_attention_heads={heads}")
    head_dim = hf.get("head_dim")
    if head_dim is None and h % heads:
        refuse(f"num_attention_heads={heads} not dividing hidden_size={h} without a head_dim")
    head_dim = int(head_dim if head_dim is not None else h // heads)
    return dict(vocab_size=vocab, seq_len=positions, hidden=h, heads=heads, layers=layers,
                kv_heads=None if kv == heads else kv, ffn_hidden=ffn,
                kv_channels=None if head_dim * heads == h else head_dim,
                dropout=float(hf.get("attention_dropout", 0.0)), dtype=dtype,
                ln_eps=float(hf.get("rms_norm_eps", 1e-6)),
                **_rope(hf, refuse))


def _rope(hf: dict, refuse) -> dict:
    """RoPE's ModelConfig fields from either spelling: transformers 5's `rope_parameters` (type, theta and
    scaling in one dict), or 4's top-level `rope_theta` beside `rope_scaling` (`rope_type`, earlier `type`)."""
    scaling = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(scaling, dict) or any(isinstance(v, dict) for v in scaling.values()):
        refuse(f"rope parameters {scaling!r} (one dict expected)")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        refuse(f"rope_type={kind!r} (only {' / '.join(ROPE_TYPES)})")
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        refuse(f"partial_rotary_factor={partial!r} (only 1.0)")
    fields = {"rope_theta": float(scaling.get("rope_theta", hf.get("rope_theta", 10000.0))),
              "rope_scaling": None if kind == "default" else kind}
    if kind == "llama3":
        missing = [k for k in LLAMA3_ROPE if k not in scaling]
        if missing:
            raise ConfigError(f"config.json: the llama3 rope scaling has no {missing[0]}")
        fields.update({ours: float(scaling[k]) for k, ours in LLAMA3_ROPE.items()})
        fields["rope_original_positions"] = int(scaling["original_max_position_embeddings"])
    return fields


def hf_config(cfg: ModelConfig) -> dict:
    """A Llama config.json for a jaxseq model, written as the installed transformers (5.x) writes it:
    RoPE in `rope_parameters`, the embeddings untied (lm_head.weight is written)."""
    if cfg.family != "llama":
        raise ConfigError(f"family={cfg.family!r}: HF Llama needs family='llama'")
    if cfg.qk_norm:
        raise ConfigError("qk_norm=True: HF Llama has no q/k norm (Qwen3's dense format is not among jaxseq's)")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **llama_config(cfg), "attention_bias": False,
            "mlp_bias": False}


def llama_config(cfg: ModelConfig) -> dict:
    """The config.json entries of a Llama-shaped model's sizes, heads, RoPE and norms (`llama_fields` back)."""
    rope = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope.update({k: getattr(cfg, ours) for k, ours in LLAMA3_ROPE.items()})
    elif cfg.rope_scaling is not None:
        raise ConfigError(f"rope_scaling={cfg.rope_scaling!r}: HF Llama takes None or 'llama3'")
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "intermediate_size": cfg.mlp_hidden,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads or cfg.heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.ln_eps, "rope_parameters": rope,
            "attention_dropout": cfg.dropout, "tie_word_embeddings": False, "dtype": "float32"}


def read_dir(hf_dir: str) -> tuple[dict, Weights]:
    """(config dict, the weights, read lazily) of a local HF Llama directory; no network."""
    config = read_config(hf_dir)
    model_config(config)  # refuse before reading gigabytes
    return config, open_weights(hf_dir)


# ---------------------------------------------------------------------------------------------
# Reading: HF tensors → jaxseq leaves, each block read from only the rows and columns it needs


def _prefix(weights: Weights) -> str:
    """'model.' as LlamaForCausalLM saves; '' as LlamaModel saves."""
    for p in ("model.", ""):
        if p + "embed_tokens.weight" in weights:
            return p
    raise ConfigError("model.safetensors has no model.embed_tokens.weight (not a Llama checkpoint)")


def _layer_names(p: str, i: int, qk_norm: bool = False) -> dict[str, str]:
    """Layer i's attention and norm tensors (Llama's and the Llama-shaped families'; Qwen3's q/k norms where
    qk_norm)."""
    b = f"{p}layers.{i}."
    norms = {"q_norm": b + "self_attn.q_norm.weight", "k_norm": b + "self_attn.k_norm.weight"} if qk_norm else {}
    return {"q": b + "self_attn.q_proj.weight", "k": b + "self_attn.k_proj.weight", "v": b + "self_attn.v_proj.weight",
            "o": b + "self_attn.o_proj.weight", **norms, "attn_norm": b + "input_layernorm.weight",
            "mlp_norm": b + "post_attention_layernorm.weight"}


def _mlp_names(p: str, i: int) -> dict[str, str]:
    b = f"{p}layers.{i}.mlp."
    return {"gate": b + "gate_proj.weight", "up": b + "up_proj.weight", "down": b + "down_proj.weight"}


def _f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def _head_rows(weights: Weights, name: str, d: int, heads: slice, dims: slice, cols: slice) -> np.ndarray:
    """Block [heads, dims, cols] of a [n·d, X] weight seen as [n, d, X], reading only those heads' rows."""
    r = range(weights.shapes[name][0] // d)[heads]
    x = _f32(weights.read(name, (slice(r.start * d, r.stop * d), cols)))
    return x.reshape(len(r), d, x.shape[1])[:, dims, :]


def _head_cols(weights: Weights, name: str, d: int, heads: slice, dims: slice, rows: slice) -> np.ndarray:
    """Block [heads, dims, rows] of a [X, n·d] weight seen as [n, d, X], reading only those heads' columns."""
    r = range(weights.shapes[name][1] // d)[heads]
    x = _f32(weights.read(name, (rows, slice(r.start * d, r.stop * d))))
    return x.reshape(x.shape[0], len(r), d)[:, :, dims].transpose(1, 2, 0)


def _stacked(layers: int, layer_shape: tuple[int, ...], block) -> Leaf:
    """[L, *layer_shape] whose layer i's block `idx` is block(i, idx)."""
    shape = (layers, *layer_shape)

    def read(idx):
        out = tuple(len(range(n)[s]) for n, s in zip(shape, idx))
        if not math.prod(out):
            return np.zeros(out, np.float32)
        return np.stack([block(i, idx[1:]) for i in range(layers)[idx[0]]])

    return Leaf(shape, read)


def _pair(block, idx_pair: slice, axis: int) -> np.ndarray:
    """The blocks block(j) of a size-2 axis (K | V, gate | up) that idx_pair asks for, stacked along `axis`."""
    return np.stack([block(j) for j in range(2)[idx_pair]], axis=axis)


def to_params(cfg: ModelConfig, weights: Weights) -> tuple[dict, dict, dict]:
    """HF tensors → (jaxseq Llama params as `Leaf`s, read on demand, the record from_params needs to write
    them back, buffers). The embedding and lm_head keep their vocab_size rows; lm_head.weight must be saved
    (tied embeddings are refused by `model_config`)."""
    h, f = cfg.hidden, cfg.mlp_hidden
    mlp_expect = {"gate": (f, h), "up": (f, h), "down": (h, f)}

    def mlp(read):  # gate_proj, up_proj [f, h] → [h, 2, f]; down_proj [h, f] → [f, h].
        return {"mlp": {
            "wi": {"kernel": _stacked(cfg.layers, (h, 2, f), lambda i, idx: _pair(
                lambda j: read(i, ("gate", "up")[j], (idx[2], idx[0])).T, idx[1], axis=1))},
            "wo": {"kernel": _stacked(cfg.layers, (f, h), lambda i, idx: read(i, "down", (idx[1], idx[0])).T)},
        }}

    return read_params(cfg, weights, _mlp_names, mlp_expect, mlp)


def read_params(cfg: ModelConfig, weights: Weights, mlp_names, mlp_expect: dict, mlp) -> tuple[dict, dict, dict]:
    """`to_params` of a Llama-shaped model whose MLP is its family's own: mlp_names(prefix, i) its tensors' names
    in layer i (by key), mlp_expect their shapes (by key), mlp(read) its leaves under "layers", where read(i, key,
    idx) is block idx of layer i's tensor `key`."""
    p, h, a, d, L = _prefix(weights), cfg.hidden, cfg.heads, cfg.head_dim, cfg.layers
    k = cfg.kv_heads or cfg.heads
    embed, norm = p + "embed_tokens.weight", p + "norm.weight"
    if "lm_head.weight" not in weights:
        raise ConfigError("model.safetensors has no lm_head.weight (tie_word_embeddings=false in config.json)")
    expect = {embed: (cfg.vocab_size, h), norm: (h,), "lm_head.weight": (cfg.vocab_size, h)}
    used = {embed, norm, "lm_head.weight"}
    names = [{**_layer_names(p, i, cfg.qk_norm), **mlp_names(p, i)} for i in range(L)]
    layer_expect = {"q": (a * d, h), "k": (k * d, h), "v": (k * d, h), "o": (h, a * d), "q_norm": (d,),
                    "k_norm": (d,), "attn_norm": (h,), "mlp_norm": (h,), **mlp_expect}
    for i, layer in enumerate(names):
        missing = [n for n in layer.values() if n not in weights]
        if missing:
            raise ConfigError(f"model.safetensors has no {missing[0]} (num_hidden_layers={L} in config.json)")
        expect.update({layer[key]: shape for key, shape in layer_expect.items() if key in layer})
        used.update(layer.values())
    check_params(weights, expect, used)

    read = lambda i, key, idx: _f32(weights.read(names[i][key], idx))
    # q_norm, k_norm [d] → [L, d] (one scale for every head), where the model has them
    qk_norms = {n: {"scale": _stacked(L, (d,), lambda i, idx, n=n: read(i, n, idx))}
                for n in ("q_norm", "k_norm") if cfg.qk_norm}
    params = {
        "embed": {"token": tensor_leaf(weights, embed)},
        "layers": {
            "attn_norm": {"scale": _stacked(L, (h,), lambda i, idx: read(i, "attn_norm", idx))},
            "attn": {
                # q_proj [a·d, h] → [h, a, d]; k_proj, v_proj [k·d, h] → [h, 2, k, d]; o_proj [h, a·d] → [a, d, h].
                "q": {"kernel": _stacked(L, (h, a, d), lambda i, idx: _head_rows(
                    weights, names[i]["q"], d, idx[1], idx[2], idx[0]).transpose(2, 0, 1))},
                "kv": {"kernel": _stacked(L, (h, 2, k, d), lambda i, idx: _pair(lambda j: _head_rows(
                    weights, names[i]["kv"[j]], d, idx[2], idx[3], idx[0]).transpose(2, 0, 1), idx[1], axis=1))},
                "out": {"kernel": _stacked(L, (a, d, h), lambda i, idx: _head_cols(
                    weights, names[i]["o"], d, idx[0], idx[1], idx[2]))},
                **qk_norms,
            },
            "mlp_norm": {"scale": _stacked(L, (h,), lambda i, idx: read(i, "mlp_norm", idx))},
            **mlp(read),
        },
        "final_norm": {"scale": tensor_leaf(weights, norm)},
        "lm_head": {"kernel": tensor_leaf(weights, "lm_head.weight")},
    }
    buffers, record = leftovers(weights, used, BUFFER_SUFFIXES)
    return params, {"prefix": p, **record}, buffers


# ---------------------------------------------------------------------------------------------
# Writing: jaxseq params → HF tensors, each computed when written


def from_params(cfg: ModelConfig, params: dict, record: dict | None = None,
                buffers: dict[str, np.ndarray] | None = None) -> dict[str, Tensor]:
    """jaxseq Llama params → HF tensors, each computed when written (lm_head.weight included: untied); with the
    record of a from-hf conversion, the original names, order and dtypes. A params leaf is anything with a
    shape whose `[i]` (layer i of a stacked leaf) and `np.asarray` give host arrays."""
    h, f = cfg.hidden, cfg.mlp_hidden
    wi, wo = params["layers"]["mlp"]["wi"]["kernel"], params["layers"]["mlp"]["wo"]["kernel"]

    def mlp(n, i):
        return {n["gate"]: ((f, h), lambda: _f32(wi[i])[:, 0].T), n["up"]: ((f, h), lambda: _f32(wi[i])[:, 1].T),
                n["down"]: ((h, f), lambda: _f32(wo[i]).T)}

    return write_params(cfg, params, record, buffers, _mlp_names, mlp)


def write_params(cfg: ModelConfig, params: dict, record: dict | None, buffers: dict[str, np.ndarray] | None,
                 mlp_names, mlp) -> dict[str, Tensor]:
    """`from_params` of a Llama-shaped model whose MLP is its family's own: mlp_names as `read_params`'s, mlp(names,
    i) layer i's MLP tensors {name: (shape, load)} (names: that layer's, by key)."""
    record = record or {"prefix": "model."}
    p, h, a, d, L, V = record["prefix"], cfg.hidden, cfg.heads, cfg.head_dim, cfg.layers, cfg.vocab_size
    k = cfg.kv_heads or cfg.heads
    lay = params["layers"]
    q, kv, o = lay["attn"]["q"]["kernel"], lay["attn"]["kv"]["kernel"], lay["attn"]["out"]["kernel"]
    token, head = params["embed"]["token"], params["lm_head"]["kernel"]
    tensors = {p + "embed_tokens.weight": ((V, h), lambda: _f32(token)[:V]),
               p + "norm.weight": unstacked(params["final_norm"]["scale"]),
               "lm_head.weight": ((V, h), lambda: _f32(head)[:V])}
    for i, n in enumerate({**_layer_names(p, j, cfg.qk_norm), **mlp_names(p, j)} for j in range(L)):
        if cfg.qk_norm:
            tensors.update({n[key]: ((d,), lambda i=i, key=key: _f32(lay["attn"][key]["scale"][i]))
                            for key in ("q_norm", "k_norm")})
        tensors.update({
            n["q"]: ((a * d, h), lambda i=i: _f32(q[i]).reshape(h, a * d).T),
            n["k"]: ((k * d, h), lambda i=i: _f32(kv[i])[:, 0].reshape(h, k * d).T),
            n["v"]: ((k * d, h), lambda i=i: _f32(kv[i])[:, 1].reshape(h, k * d).T),
            n["o"]: ((h, a * d), lambda i=i: _f32(o[i]).reshape(a * d, h).T),
            n["attn_norm"]: ((h,), lambda i=i: _f32(lay["attn_norm"]["scale"][i])),
            n["mlp_norm"]: ((h,), lambda i=i: _f32(lay["mlp_norm"]["scale"][i])),
            **mlp(n, i),
        })
    dtypes = dict(record.get("dtypes", {}))
    dtypes.setdefault("lm_head.weight", dtypes.get(p + "embed_tokens.weight", "float32"))
    return as_tensors(tensors, {**record, "dtypes": dtypes}, buffers)
