"""The Hugging Face GPT-2 format: `config.json` + `model.safetensors` ↔ a jaxseq config and parameter tree.

Pure NumPy (the `safetensors` NumPy API): converting needs neither torch nor JAX. Why a module of
its own: the tensor names and layouts belong to Hugging Face, and everything jaxseq cannot represent
is refused here, once, with one line naming it.

HF GPT-2's Conv1D stores weights as [in, out]; `c_attn` is [h, 3h] = Q | K | V, each split into heads,
which is exactly jaxseq's [h, 3, heads, head_dim] kernel reshaped.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxseq.config import ConfigError, ModelConfig

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GPT-2's tanh GELU, which jaxseq computes
# Non-parameter tensors older checkpoints carry (causal-mask buffers): kept verbatim, never used.
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
# Files of an HF directory carried through a conversion unchanged (tokenizer, generation settings).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt")


def safetensors_numpy():
    try:
        import safetensors.numpy as st
    except ImportError:
        raise ConfigError("the safetensors package is not installed (pip install -r requirements.txt)") from None
    return st


# ---------------------------------------------------------------------------------------------
# config.json ↔ ModelConfig


def model_config(hf: dict, dtype: str = "float32") -> ModelConfig:
    """The jaxseq model an HF GPT-2 config describes, or a ConfigError naming what does not fit."""
    def refuse(what):
        raise ConfigError(f"config.json: {what} is not supported by jaxseq")

    if hf.get("model_type") != "gpt2":
        refuse(f"model_type={hf.get('model_type')!r} (only 'gpt2')")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        refuse(f"activation_function={act!r} (only {' / '.join(ACTIVATIONS)})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(flag, False):
            refuse(f"{flag}=true")
    if not hf.get("scale_attn_weights", True):
        refuse("scale_attn_weights=false")
    if not hf.get("tie_word_embeddings", True):
        refuse("tie_word_embeddings=false (untied embeddings)")
    try:
        h, heads, layers = int(hf["n_embd"]), int(hf["n_head"]), int(hf["n_layer"])
        vocab, positions = int(hf["vocab_size"]), int(hf["n_positions"])
    except KeyError as e:
        raise ConfigError(f"config.json: {e.args[0]} is missing") from None
    if h % heads:
        refuse(f"n_head={heads} not dividing n_embd={h}")
    inner = hf.get("n_inner") or 4 * h
    if inner % h:
        refuse(f"n_inner={inner} (must be a multiple of n_embd={h})")
    return ModelConfig(vocab_size=vocab, seq_len=positions, hidden=h, heads=heads, layers=layers,
                       mlp_ratio=inner // h, dropout=float(hf.get("resid_pdrop", 0.1)), dtype=dtype,
                       ln_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def hf_config(cfg: ModelConfig) -> dict:
    """A GPT-2 config.json for a jaxseq model (when no original config travelled with the weights)."""
    if cfg.kv_channels is not None and cfg.kv_channels * cfg.heads != cfg.hidden:
        raise ConfigError(f"kv_channels={cfg.kv_channels}: HF GPT-2 needs heads × head width = hidden")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.hidden, "n_head": cfg.heads,
            "n_layer": cfg.layers, "n_inner": None if cfg.mlp_ratio == 4 else cfg.mlp_hidden,
            "layer_norm_epsilon": cfg.ln_eps, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout, "tie_word_embeddings": True, "scale_attn_weights": True,
            "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1, "dtype": "float32"}


# ---------------------------------------------------------------------------------------------
# Reading and writing the tensors


def read_dir(hf_dir: str) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(config dict, tensors by name, safetensors metadata) of a local HF directory; no network."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{hf_dir!r} has no config.json (not a Hugging Face model directory)")
    config = json.load(open(cfg_path))
    model_config(config)  # refuse before reading gigabytes
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"{hf_dir!r} has no model.safetensors (re-save with save_pretrained(safe_serialization=True))")
    st, tensors, metadata = safetensors_numpy(), {}, {}
    from safetensors import safe_open

    for name in files:
        path = os.path.join(hf_dir, name)
        tensors.update(st.load_file(path))
        with safe_open(path, "np") as f:
            metadata = f.metadata() or metadata
    return config, tensors, metadata


def write_dir(out: str, config: dict, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    stale = os.path.join(out, "model.safetensors.index.json")  # would shadow the single file we write
    if os.path.isfile(stale):
        os.remove(stale)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    path = os.path.join(out, "model.safetensors")
    safetensors_numpy().save_file(tensors, path, metadata=metadata or {"format": "pt"})


def _prefix(tensors: dict) -> str:
    """'transformer.' as GPT2LMHeadModel saves; '' as GPT2Model (and the original OpenAI upload) saves."""
    for p in ("transformer.", ""):
        if p + "wte.weight" in tensors:
            return p
    raise ConfigError("model.safetensors has no wte.weight (not a GPT-2 checkpoint)")


def _layer_names(p: str, i: int) -> dict[str, str]:
    b = f"{p}h.{i}."
    return {"ln1.scale": b + "ln_1.weight", "ln1.bias": b + "ln_1.bias", "ln2.scale": b + "ln_2.weight",
            "ln2.bias": b + "ln_2.bias", "qkv.kernel": b + "attn.c_attn.weight", "qkv.bias": b + "attn.c_attn.bias",
            "out.kernel": b + "attn.c_proj.weight", "out.bias": b + "attn.c_proj.bias",
            "wi.kernel": b + "mlp.c_fc.weight", "wi.bias": b + "mlp.c_fc.bias",
            "wo.kernel": b + "mlp.c_proj.weight", "wo.bias": b + "mlp.c_proj.bias"}


def to_params(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> tuple[dict, dict, dict]:
    """HF tensors → (jaxseq params in float32, the record to-hf needs to write them back, buffers).
    The token embedding keeps its vocab_size rows; `rundir.place` pads it for a mesh.

    The record holds the key prefix, each tensor's dtype and the buffers carried verbatim, so that
    from-hf → to-hf reproduces every tensor exactly.
    """
    p, h, a, d, L = _prefix(tensors), cfg.hidden, cfg.heads, cfg.head_dim, cfg.layers
    used = {p + "wte.weight", p + "wpe.weight", p + "ln_f.weight", p + "ln_f.bias"}
    f32 = lambda name: np.asarray(tensors[name], np.float32)

    def stack(key, shape):
        names = [_layer_names(p, i)[key] for i in range(L)]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ConfigError(f"model.safetensors has no {missing[0]} (n_layer={L} in config.json)")
        used.update(names)
        return np.stack([f32(n).reshape(shape) for n in names])

    wte = f32(p + "wte.weight")
    if wte.shape != (cfg.vocab_size, h):
        raise ConfigError(f"wte.weight has shape {wte.shape}, config.json says ({cfg.vocab_size}, {h})")
    if "lm_head.weight" in tensors:
        if not np.array_equal(tensors["lm_head.weight"], tensors[p + "wte.weight"]):
            raise ConfigError("lm_head.weight differs from wte.weight (untied embeddings) is not supported by jaxseq")
        used.add("lm_head.weight")
    ln = lambda k: {"scale": stack(f"{k}.scale", (h,)), "bias": stack(f"{k}.bias", (h,))}
    params = {
        "embed": {"token": wte, "position": f32(p + "wpe.weight")},
        "layers": {
            "ln1": ln("ln1"),
            "attn": {"qkv": {"kernel": stack("qkv.kernel", (h, 3, a, d)), "bias": stack("qkv.bias", (3, a, d))},
                     "out": {"kernel": stack("out.kernel", (a, d, h)), "bias": stack("out.bias", (h,))}},
            "ln2": ln("ln2"),
            "mlp": {"wi": {"kernel": stack("wi.kernel", (h, cfg.mlp_hidden)),
                           "bias": stack("wi.bias", (cfg.mlp_hidden,))},
                    "wo": {"kernel": stack("wo.kernel", (cfg.mlp_hidden, h)), "bias": stack("wo.bias", (h,))}},
        },
        "final_ln": {"scale": f32(p + "ln_f.weight"), "bias": f32(p + "ln_f.bias")},
    }
    if params["embed"]["position"].shape != (cfg.seq_len, h):
        raise ConfigError(f"wpe.weight has shape {params['embed']['position'].shape}, expected ({cfg.seq_len}, {h})")
    extra = sorted(set(tensors) - used)
    unknown = [n for n in extra if not n.endswith(BUFFER_SUFFIXES)]
    if unknown:
        raise ConfigError(f"model.safetensors holds {unknown[0]}, which jaxseq cannot represent")
    record = {"prefix": p, "order": list(tensors), "dtypes": {n: str(t.dtype) for n, t in tensors.items()},
              "lm_head": "lm_head.weight" in tensors}
    return params, record, {n: tensors[n] for n in extra}


def from_params(cfg: ModelConfig, params: dict, record: dict | None = None,
                buffers: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """jaxseq params → HF tensors; with the record of a from-hf conversion, the original names, order and dtypes."""
    record = record or {"prefix": "transformer.", "lm_head": False}
    p, h, L = record["prefix"], cfg.hidden, cfg.layers
    x = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))
    lay = params["layers"]
    tensors = {p + "wte.weight": x(params["embed"]["token"])[: cfg.vocab_size],
               p + "wpe.weight": x(params["embed"]["position"]),
               p + "ln_f.weight": x(params["final_ln"]["scale"]), p + "ln_f.bias": x(params["final_ln"]["bias"])}
    sources = {"ln1.scale": lay["ln1"]["scale"], "ln1.bias": lay["ln1"]["bias"], "ln2.scale": lay["ln2"]["scale"],
               "ln2.bias": lay["ln2"]["bias"], "qkv.kernel": lay["attn"]["qkv"]["kernel"],
               "qkv.bias": lay["attn"]["qkv"]["bias"], "out.kernel": lay["attn"]["out"]["kernel"],
               "out.bias": lay["attn"]["out"]["bias"], "wi.kernel": lay["mlp"]["wi"]["kernel"],
               "wi.bias": lay["mlp"]["wi"]["bias"], "wo.kernel": lay["mlp"]["wo"]["kernel"],
               "wo.bias": lay["mlp"]["wo"]["bias"]}
    names = [_layer_names(p, i) for i in range(L)]
    for key, stacked in sources.items():
        # Kernels back to Conv1D's [in, out]: qkv [h, 3, a, d] → [h, 3h], out [a, d, h] → [a·d, h].
        shape = {"qkv.kernel": (h, -1), "out.kernel": (-1, h)}.get(key, (-1,) if not key.endswith("kernel") else None)
        for i, w in enumerate(x(stacked)):
            tensors[names[i][key]] = np.ascontiguousarray(w.reshape(shape) if shape else w)
    if record.get("lm_head"):
        tensors["lm_head.weight"] = tensors[p + "wte.weight"]
    tensors.update(buffers or {})
    dtypes = record.get("dtypes", {})
    order = record.get("order") or sorted(tensors)
    return {n: tensors[n].astype(_dtype(dtypes.get(n, "float32")), copy=False) for n in order}


def _dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def copy_side_files(src: str, dst: str, names=SIDE_FILES) -> list[str]:
    """Copy the tokenizer and config files that exist in `src`; returns the names copied."""
    import shutil

    os.makedirs(dst, exist_ok=True)
    copied = [n for n in names if os.path.isfile(os.path.join(src, n))]
    for n in copied:
        shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    return copied

